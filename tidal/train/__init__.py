"""Training the embedded default model on CPU: data, tokenizer, trainer, quantisation, evaluation.

``tidal train`` (cli.py) builds a BPE tokenizer and a K3-architecture model from data every
machine has offline (the running interpreter's standard library plus synthetic K3-format
conversations), trains it with MXFP4 quantisation-aware routed experts, and ``tidal quantize``
(quantize.py) writes the compressed-tensors checkpoint that ships in ``tidal/assets/embedded``.
"""
