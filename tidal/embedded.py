"""The embedded default model that ships inside the package, and how it was made.

``tidal/assets/embedded`` holds a small Kimi-K3-architecture model trained by tidal itself on CPU:
a byte-level BPE tokenizer (8192 tokens with K3's special tokens) and 19.4M parameters in the K3
layout (KDA + gated NoPE MLA, latent MoE with SiTU, Block AttnRes), routed experts in MXFP4 after
quantisation-aware training; 23.4 MB on disk. Trained on the running interpreter's standard library
(12 modules held out, tidal.train.data.HELDOUT_MODULES) and synthetic K3-format conversations: a
base run of 1450 steps of 4 x 512 tokens, then a 1000-step fine-tune from it (``tidal train
--init``) on bodies after bare signatures and tool dialogues, 5.02M tokens in all. The README's
"The embedded model" has the recipe and the figures ``benchmarks/eval_embedded.py`` measures
(held-out loss 4.679 nats/token, 1.335 nats/byte; MXFP4 minus fp32-twin -0.0011 nats/token).

:func:`write_random_embedded_model` still writes a seeded random-weight twin with a byte-level
tokenizer, for tests and benchmarks that need a K3-layout checkpoint without the trained one.
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
# The Kimi K2 / Kimi Linear chat format's special tokens (k3-model.md §6.2), for K2-format test
# checkpoints; <think>/</think> special as in K2-Thinking's tokenizer.
K2_SPECIAL_TOKENS = [
    "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>", "[UNK]", "[PAD]",
]


def embedded_model_dir() -> Path:
    """Directory of the checkpoint shipped with the package."""
    return Path(str(resources.files("tidal.assets").joinpath("embedded")))


def embedded_config_dict(vocab_size: int) -> dict[str, Any]:
    """Kimi-K3 layout at ~19M parameters: hidden 256, 8 layers (KDA at 1-3, 5-7; MLA at 4 and 8,
    the last layer MLA as in K3), a dense first layer, 32 routed experts top-2 at latent width 128
    plus one shared expert, SiTU, AttnRes blocks of 4, MXFP4 routed experts."""
    from tidal.presets import tiny_k3_dict

    d = tiny_k3_dict(hidden_size=256, num_layers=8, vocab_size=vocab_size, attn_res_block_size=4,
                     num_experts=32, top_k=2)
    t = d["text_config"]
    t.update(
        intermediate_size=512, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128,
        kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, first_k_dense_replace=1,
        moe_intermediate_size=128, routed_expert_hidden_size=128, max_position_embeddings=8192,
    )
    t["linear_attn_config"].update(num_heads=4, head_dim=64)
    return d


def write_byte_tokenizer(out_dir: Path, special_tokens: list[str] = K3_SPECIAL_TOKENS,
                         eos_token: str = "<|end_of_msg|>") -> tuple[int, dict[str, int]]:
    """A byte-level tokenizer.json (256 byte tokens, no merges) + special tokens (K3's unless
    given); returns (vocab size, special ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(special_tokens)
    tok.save(str(out_dir / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in special_tokens}
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "[BOS]", "eos_token": eos_token, "pad_token": "[PAD]", "unk_token": "[UNK]",
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


def write_random_k2_model(out_dir: str | Path, seed: int = 0) -> Path:
    """A seeded random-weight tiny Kimi Linear checkpoint (float32) with a byte-level tokenizer
    carrying the K2 chat format's special tokens: the server speaks the K2 format to it."""
    import torch

    from tidal.config import ModelConfig
    from tidal.model.checkpoint import save_model
    from tidal.model.init import init_weights
    from tidal.model.kimi import KimiForCausalLM
    from tidal.presets import tiny_kimi_linear_dict

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_tokens, ids = write_byte_tokenizer(out, K2_SPECIAL_TOKENS, eos_token="[EOS]")
    d = tiny_kimi_linear_dict(vocab_size=(n_tokens + 63) // 64 * 64)
    d.update(bos_token_id=ids["[BOS]"], eos_token_id=ids["[EOS]"], pad_token_id=ids["[PAD]"])
    torch.manual_seed(seed)
    model = init_weights(KimiForCausalLM(ModelConfig.from_dict(d)), seed=seed)
    save_model(model, out, dtype=torch.float32)
    return out


if __name__ == "__main__":
    import sys

    print(write_random_embedded_model(sys.argv[1] if len(sys.argv) > 1 else embedded_model_dir()))
