"""The server: tokenizer-side pieces (detokenizer, chat formats, reply parsers) and the HTTP app."""
