"""The embedded default model that ships inside the package, and how it was made.

Until tidal trains its own (the "Embedded default model" issue), the embedded checkpoint is a
small Kimi-K3-architecture model with seeded random weights and a byte-level tokenizer carrying
K3's special tokens: every K3 feature (KDA, gated NoPE MLA, latent MoE with SiTU, Block AttnRes,
MXFP4 routed experts) runs, but its text is noise.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

# K3's special tokens (spec §6.1, renamed set), in id order after the 256 byte tokens.
K3_SPECIAL_TOKENS = [
    "[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>",
    "[start_header_id]", "[end_header_id]", "[EOT]", "<|media_begin|>", "<|media_content|>",
    "<|media_end|>", "<|media_pad|>", "[UNK]", "[PAD]",
]


def embedded_model_dir() -> Path:
    """Directory of the checkpoint shipped with the package."""
    return Path(str(resources.files("tidal.assets").joinpath("embedded")))


def embedded_config_dict(vocab_size: int) -> dict[str, Any]:
    """Kimi-K3 layout at ~10M parameters: 8 layers (6 KDA, 2 MLA), 16 experts top-2 in MXFP4,
    AttnRes blocks of 4."""
    from tidal.presets import tiny_k3_dict

    d = tiny_k3_dict(hidden_size=256, num_layers=8, vocab_size=vocab_size, attn_res_block_size=4,
                     num_experts=16, top_k=2)
    t = d["text_config"]
    t.update(
        intermediate_size=512, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128,
        kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        moe_intermediate_size=128, routed_expert_hidden_size=128, max_position_embeddings=8192,
    )
    t["linear_attn_config"].update(num_heads=4, head_dim=64)
    return d


def write_byte_tokenizer(out_dir: Path) -> tuple[int, dict[str, int]]:
    """A byte-level tokenizer.json (256 byte tokens, no merges) + K3 specials; returns
    (vocab size, special ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(K3_SPECIAL_TOKENS)
    tok.save(str(out_dir / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in K3_SPECIAL_TOKENS}
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "[BOS]", "eos_token": "<|end_of_msg|>", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "model_max_length": 8192,
    }, indent=2))
    return tok.get_vocab_size(with_added_tokens=True), ids


def write_random_embedded_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the random-weight embedded checkpoint (config, MXFP4 safetensors, tokenizer)."""
    import torch

    from tidal.config import ModelConfig
    from tidal.model.checkpoint import save_model
    from tidal.model.init import init_weights
    from tidal.model.kimi import KimiForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_tokens, ids = write_byte_tokenizer(out)
    vocab = (n_tokens + 63) // 64 * 64
    d = embedded_config_dict(vocab)
    d.update(bos_token_id=ids["[BOS]"], eos_token_id=ids["<|end_of_msg|>"], pad_token_id=ids["[PAD]"])
    d["text_config"]["eos_token_id"] = ids["<|end_of_msg|>"]
    config = ModelConfig.from_dict(d)
    torch.manual_seed(seed)
    model = init_weights(KimiForCausalLM(config), seed=seed)
    save_model(model.to_dtype(torch.bfloat16), out, expert_format="mxfp4-pack-quantized")
    return out


if __name__ == "__main__":
    import sys

    print(write_random_embedded_model(sys.argv[1] if len(sys.argv) > 1 else embedded_model_dir()))
