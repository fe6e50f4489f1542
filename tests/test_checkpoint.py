"""Checkpoint writer -> loader round trips and every bad-checkpoint error."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from safetensors import safe_open
from memory_maps import mapped_ranges
from safetensors.torch import load_file, save_file

from tidal import presets
from tidal.config import ConfigError, ModelConfig
from tidal.model import checkpoint
from tidal.model.checkpoint import KINDS, CheckpointError, expected_tensors, load_model, save_model
from tidal.model.kimi import KimiForCausalLM
from tidal.ops.mxfp import fake_quantize_mxfp4

EXPERT = re.compile(r"experts\.w[123]$")


def random_model(config, dtype=torch.bfloat16, seed=0) -> KimiForCausalLM:
    torch.manual_seed(seed)
    model = KimiForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model.to_dtype(dtype)


def expected_state(model, mxfp4: bool) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    if mxfp4:
        state = {k: fake_quantize_mxfp4(v) if EXPERT.search(k) else v for k, v in state.items()}
    return state


def assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), k


CASES = {
    "k3_mxfp4": (lambda: presets.tiny_k3(), torch.bfloat16),
    "k3_dense_bf16": (lambda: presets.tiny_k3(mxfp4=False), torch.bfloat16),
    "k3_dense_fp32": (lambda: presets.tiny_k3(mxfp4=False), torch.float32),
    "k3_no_attn_res": (lambda: presets.tiny_k3(attn_res_block_size=None), torch.bfloat16),
    "kimi_linear": (lambda: presets.tiny_kimi_linear(), torch.bfloat16),
}


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_round_trip(tmp_path, case, sharded):
    make_config, dtype = CASES[case]
    config = make_config()
    model = random_model(config, dtype)
    save_model(model, tmp_path, max_shard_bytes=30_000 if sharded else None)
    loaded = load_model(tmp_path, dtype=dtype)
    mxfp4 = config.expert_format == "mxfp4-pack-quantized"
    assert loaded.config == model.config.replace(torch_dtype=str(dtype).removeprefix("torch."))
    assert_same_state(loaded.state_dict(), expected_state(model, mxfp4))

    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    if sharded:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    else:
        assert files == ["model.safetensors"]
    names = {}
    for f in files:
        with safe_open(str(tmp_path / f), "pt") as h:
            names.update({k: (h.get_slice(k).get_shape(), h.get_slice(k).get_dtype()) for k in h.keys()})
    prefix = "language_model." if config.model_type == "kimi_k3" else ""
    assert all(k.startswith(prefix + "model.") or k == prefix + "lm_head.weight" for k in names)
    assert set(names) == set(expected_tensors(model.config.replace(torch_dtype=str(dtype)[6:])))
    H, I = config.kda_num_heads, config.moe_intermediate_size
    a_log = names[prefix + "model.layers.0.self_attn.A_log"]
    assert a_log == (([H], "F32") if config.model_type == "kimi_k3" else ([1, 1, H, 1], "F32"))
    moe_layer = next(i for i in range(config.num_hidden_layers) if config.is_moe_layer(i))
    stem = f"{prefix}model.layers.{moe_layer}.block_sparse_moe.experts.{config.num_experts - 1}"
    d_e = config.expert_hidden_size
    if mxfp4:
        assert names[stem + ".w1.weight_packed"] == ([I, d_e // 2], "U8")
        assert names[stem + ".w2.weight_scale"] == ([d_e, I // 32], "U8")
        assert prefix + f"model.layers.{moe_layer}.block_sparse_moe.experts.0.w1.weight" not in names
    else:
        assert names[stem + ".w2.weight"] == ([d_e, I], "BF16" if dtype == torch.bfloat16 else "F32")
    if config.model_type == "kimi_k3":
        conv = names[prefix + "model.layers.0.self_attn.q_conv1d.weight"]
        assert conv[1] == "F32"
    cfg_json = json.loads((tmp_path / "config.json").read_text())
    text = cfg_json.get("text_config", cfg_json)
    assert ("quantization_config" in text) == mxfp4


def test_loading_converts_dtype_like_to_dtype(tmp_path):
    model = random_model(presets.tiny_k3(mxfp4=False), torch.float32)
    save_model(model, tmp_path)
    loaded = load_model(tmp_path, dtype=torch.bfloat16)
    want = random_model(presets.tiny_k3(mxfp4=False), torch.float32).to_dtype(torch.bfloat16).state_dict()
    assert_same_state(loaded.state_dict(), want)
    assert loaded.model.layers[0].self_attn.A_log.dtype == torch.float32


def test_mxfp4_export_of_a_dense_model(tmp_path):
    model = random_model(presets.tiny_k3(mxfp4=False), torch.float32)
    save_model(model, tmp_path, expert_format="mxfp4-pack-quantized", dtype=torch.bfloat16)
    loaded = load_model(tmp_path, dtype=torch.float32)
    assert loaded.config.expert_format == "mxfp4-pack-quantized"
    w = model.model.layers[1].block_sparse_moe.experts.w2
    assert torch.equal(loaded.model.layers[1].block_sparse_moe.experts.w2, fake_quantize_mxfp4(w))
    emb = model.model.embed_tokens.weight.to(torch.bfloat16).float()
    assert torch.equal(loaded.model.embed_tokens.weight, emb)


def test_tied_embeddings_omit_lm_head(tmp_path):
    config = presets.tiny_kimi_linear().replace(tie_word_embeddings=True)
    model = random_model(config)
    save_model(model, tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    loaded = load_model(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert_same_state(loaded.state_dict(), model.state_dict())


def rewrite(path, change):
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_k3_a_log_longer_than_heads_reads_first_values(tmp_path):
    config = presets.tiny_k3()
    model = random_model(config)
    save_model(model, tmp_path)
    name = "language_model.model.layers.1.self_attn.A_log"
    H = config.kda_num_heads
    longer = torch.randn(4 * H + 3)

    def extend(t):
        longer[:H] = t[name]
        t[name] = longer

    rewrite(tmp_path / "model.safetensors", extend)
    loaded = load_model(tmp_path)
    assert torch.equal(loaded.model.layers[1].self_attn.A_log.reshape(-1), longer[:H])
    assert torch.equal(loaded.model.layers[1].self_attn.A_log, model.model.layers[1].self_attn.A_log)

    rewrite(tmp_path / "model.safetensors", lambda t: t.__setitem__(name, longer[: H - 1].clone()))
    with pytest.raises(CheckpointError, match=re.escape(name) + ".*model.safetensors.*at least 2"):
        load_model(tmp_path)


def test_k3_vision_tensors_ignored(tmp_path):
    model = random_model(presets.tiny_k3())
    save_model(model, tmp_path)
    rewrite(
        tmp_path / "model.safetensors",
        lambda t: t.update({"vision_tower.patch_embed.weight": torch.ones(3, 3), "mm_projector.proj.weight": torch.ones(2)}),
    )
    assert_same_state(load_model(tmp_path).state_dict(), expected_state(model, True))


def test_expected_tensors_inventory():
    config = presets.tiny_k3(vision=True)
    specs = expected_tensors(config)
    assert {s.kind for s in specs.values()} == set(KINDS)
    moe_layers = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
    expert_names = [n for n, s in specs.items() if s.kind == "routed_experts"]
    assert len(expert_names) == len(moe_layers) * config.num_experts * 3 * 2
    assert specs["language_model.model.layers.1.block_sparse_moe.experts.3.w1.weight_scale"].shape == (32, 1)
    assert specs["language_model.model.layers.3.self_attn.kv_b_proj.weight"].kind == "mla"
    assert specs["language_model.model.layers.0.self_attn.A_log"].min_length
    assert specs["language_model.model.layers.1.block_sparse_moe.gate.e_score_correction_bias"].dtype == torch.float32
    assert specs["language_model.model.embed_tokens.weight"].dtype == torch.bfloat16
    kl = expected_tensors(presets.tiny_kimi_linear())
    assert all(not n.startswith("language_model.") for n in kl)
    assert kl["model.layers.0.self_attn.A_log"].shape == (1, 1, 2, 1)
    assert "attn_res" not in {s.kind for s in kl.values()} and "latent_proj" not in {s.kind for s in kl.values()}


def test_load_logs_throughput(tmp_path, caplog, monkeypatch):
    save_model(random_model(presets.tiny_kimi_linear()), tmp_path)
    monkeypatch.setattr(checkpoint, "PROGRESS_SECONDS", 0.0)
    with caplog.at_level(logging.INFO, logger="tidal.load"):
        load_model(tmp_path)
    messages = [r.getMessage() for r in caplog.records if r.name == "tidal.load"]
    assert any("GB/s" in m and "bytes" in m for m in messages)
    assert any("tensors" in m and "GB/s" not in m for m in messages)  # progress lines


# ---- bad checkpoints -------------------------------------------------------------------------------


@pytest.fixture
def k3_dir(tmp_path):
    save_model(random_model(presets.tiny_k3()), tmp_path)
    return tmp_path


def load_error(path, cls=CheckpointError) -> str:
    with pytest.raises(cls) as info:
        load_model(path)
    return str(info.value)


PACKED = "language_model.model.layers.1.block_sparse_moe.experts.5.w3.weight_packed"
SCALE = "language_model.model.layers.1.block_sparse_moe.experts.5.w3.weight_scale"
Q_PROJ = "language_model.model.layers.2.self_attn.q_proj.weight"


def test_missing_tensor(k3_dir):
    rewrite(k3_dir / "model.safetensors", lambda t: t.pop(Q_PROJ))
    msg = load_error(k3_dir)
    assert "missing" in msg and Q_PROJ in msg and "model.safetensors" in msg


def test_unexpected_tensor(k3_dir):
    name = "language_model.model.layers.2.self_attn.q_proj.bias"
    rewrite(k3_dir / "model.safetensors", lambda t: t.update({name: torch.zeros(32)}))
    msg = load_error(k3_dir)
    assert "unexpected" in msg and name in msg and "model.safetensors" in msg


def test_wrong_shape(k3_dir):
    rewrite(k3_dir / "model.safetensors", lambda t: t.update({Q_PROJ: torch.zeros(32, 65)}))
    msg = load_error(k3_dir)
    assert Q_PROJ in msg and "model.safetensors" in msg and "[32, 65]" in msg and "[32, 64]" in msg


def test_wrong_dtype_for_packed_weights(k3_dir):
    rewrite(k3_dir / "model.safetensors", lambda t: t.update({PACKED: t[PACKED].float()}))
    msg = load_error(k3_dir)
    assert PACKED in msg and "model.safetensors" in msg and "uint8" in msg


def test_scale_byte_255(k3_dir):
    def poison(t):
        t[SCALE][3, 0] = 255

    rewrite(k3_dir / "model.safetensors", poison)
    msg = load_error(k3_dir)
    assert SCALE in msg and "model.safetensors" in msg and "255" in msg


def test_truncated_file(k3_dir):
    path = k3_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    msg = load_error(k3_dir)
    assert str(path) in msg and "truncated" in msg
    named = re.search(r"tensor '([^']+)'", msg).group(1)
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    assert header[named]["data_offsets"][1] > len(data) - 100 - 8 - header_len  # its bytes were cut


def test_garbage_file(k3_dir):
    (k3_dir / "model.safetensors").write_bytes(b"\x05")
    msg = load_error(k3_dir)
    assert "model.safetensors" in msg and "corrupt" in msg


def test_index_points_to_missing_shard(tmp_path):
    save_model(random_model(presets.tiny_k3()), tmp_path, max_shard_bytes=30_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / victim).unlink()
    name = next(k for k, v in index["weight_map"].items() if v == victim)
    msg = load_error(tmp_path)
    assert victim in msg and name in msg and "missing" in msg


def test_shard_headers_read_ahead_equal_the_checked_ones_and_bad_shards_are_left_to_safe_open(tmp_path):
    """_read_headers (every shard's header at once, before safe_open) gives each shard's data start
    and header as a plain read of it does; a truncated or garbage shard is left out, and loading
    names it as it does without the read ahead."""
    save_model(random_model(presets.tiny_k3()), tmp_path, max_shard_bytes=30_000)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 4
    assert checkpoint._read_headers(tmp_path, files) == {f: checkpoint._data_start(tmp_path / f) for f in files}
    garbage, short, huge = files[1], files[2], files[3]
    (tmp_path / garbage).write_bytes(b"\x05")
    data = (tmp_path / short).read_bytes()
    (tmp_path / short).write_bytes(data[: 8 + int.from_bytes(data[:8], "little") // 2])  # half a header
    (tmp_path / huge).write_bytes(b"\xff" * 64)  # a header length past any file: never allocated
    assert set(checkpoint._read_headers(tmp_path, files)) == set(files) - {garbage, short, huge}
    msg = load_error(tmp_path)
    assert garbage in msg and "corrupt" in msg, msg


def test_index_lists_tensor_absent_from_its_shard(tmp_path):
    save_model(random_model(presets.tiny_k3()), tmp_path, max_shard_bytes=30_000)
    path = tmp_path / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(k for k, v in index["weight_map"].items() if v == shards[1])
    index["weight_map"][name] = shards[0]
    path.write_text(json.dumps(index))
    msg = load_error(tmp_path)
    assert name in msg and shards[0] in msg and "absent" in msg


def test_no_weights(tmp_path):
    save_model(random_model(presets.tiny_kimi_linear()), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    msg = load_error(tmp_path)
    assert "model.safetensors" in msg and str(tmp_path) in msg


def test_missing_config(tmp_path):
    msg = load_error(tmp_path, ConfigError)
    assert str(tmp_path / "config.json") in msg


def test_config_not_json(k3_dir):
    (k3_dir / "config.json").write_text("{not json")
    msg = load_error(k3_dir, ConfigError)
    assert str(k3_dir / "config.json") in msg and "JSON" in msg


def test_unknown_model_type(k3_dir):
    path = k3_dir / "config.json"
    data = json.loads(path.read_text())
    data["model_type"] = "llama"
    path.write_text(json.dumps(data))
    msg = load_error(k3_dir, ConfigError)
    assert "model_type" in msg and str(path) in msg


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_load_to_cuda_matches_cpu(k3_dir):
    cpu = load_model(k3_dir, dtype=torch.bfloat16)
    gpu = load_model(k3_dir, dtype=torch.bfloat16, device="cuda")
    for k, v in cpu.state_dict().items():
        g = gpu.state_dict()[k]
        assert g.is_cuda and torch.equal(g.cpu(), v), k


def test_dense_mlp_under_transformers_name_loads_and_both_spellings_are_rejected(tmp_path):
    config = presets.tiny_kimi_linear()
    model = random_model(config)
    save_model(model, tmp_path)
    path = tmp_path / "model.safetensors"
    names = [k for k in load_file(path) if ".mlp." in k]
    assert names

    def rename(t):
        for k in names:
            t[k.replace(".mlp.", ".block_sparse_moe.")] = t.pop(k)

    rewrite(path, rename)
    assert_same_state(load_model(tmp_path).state_dict(), model.state_dict())

    def duplicate(t):
        t[names[0]] = t[names[0].replace(".mlp.", ".block_sparse_moe.")].clone()

    rewrite(path, duplicate)
    with pytest.raises(CheckpointError, match="again as"):
        load_model(tmp_path)


def test_weights_whose_bytes_are_on_disk_are_views_of_the_mapped_file(tmp_path):
    """With use_mmap (the default) every weight whose checkpoint bytes are its bytes (bf16 on disk
    and in memory, stacked experts included) lies in a mapping of its shard; the model equals a
    copying load; a write to a weight stays in this process (private mapping: the file keeps its bytes)."""
    model = random_model(presets.tiny_kimi_linear(), torch.bfloat16)
    save_model(model, tmp_path, max_shard_bytes=256 << 10)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) > 2
    mapped = load_model(tmp_path, torch.bfloat16)
    copied = load_model(tmp_path, torch.bfloat16, use_mmap=False)
    assert_same_state(mapped.state_dict(), copied.state_dict())
    ranges = mapped_ranges(files)

    def in_file(t: torch.Tensor) -> bool:
        return any(lo <= t.data_ptr() < hi for lo, hi in ranges)

    for k, t in mapped.named_parameters():
        assert in_file(t), k  # float32 norms and gates are float32 on disk too
    assert not any(in_file(t) for t in copied.state_dict().values())
    with torch.no_grad():
        mapped.model.embed_tokens.weight.add_(1)
    again = load_model(tmp_path, torch.bfloat16, use_mmap=False)
    assert torch.equal(again.model.embed_tokens.weight, copied.model.embed_tokens.weight)


def test_safetensors_load_strategy_of_the_engine(tmp_path):
    """``LLM(safetensors_load_strategy=...)`` (``tidal serve --safetensors-load-strategy``, vLLM's
    name): "lazy" leaves the engine's weights in the file's mapping, "eager" in memory of its own,
    with the same greedy tokens; an unknown strategy is refused before anything loads."""
    from tidal import LLM, SamplingParams

    save_model(random_model(presets.tiny_kimi_linear(), torch.bfloat16), tmp_path)
    files = [tmp_path / "model.safetensors"]
    outs = {}
    for strategy in ("lazy", "eager"):
        llm = LLM(str(tmp_path), dtype="bfloat16", skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20,
                  safetensors_load_strategy=strategy)
        ranges = mapped_ranges(files)
        weights = [p for p in llm.engine.model.parameters()]
        in_file = [any(lo <= p.data_ptr() < hi for lo, hi in ranges) for p in weights]
        assert any(in_file) if strategy == "lazy" else not any(in_file), strategy
        params = SamplingParams(max_tokens=6, temperature=0)
        outs[strategy] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}, {"prompt_token_ids": [5, 6]}], params)]
        del llm
    assert outs["lazy"] == outs["eager"]
    with pytest.raises(ValueError, match=r"safetensors_load_strategy 'mmap' is not supported.*'lazy', 'eager'"):
        LLM(str(tmp_path), skip_tokenizer_init=True, safetensors_load_strategy="mmap")


@pytest.mark.parametrize("case", ["kimi_linear_bf16", "kimi_linear_grouped_bf16", "k3_dense_bf16", "k3_dense_fp32"])
def test_stacked_experts_are_strided_views_in_file_order_and_exact(tmp_path, case, monkeypatch):
    """12 experts: the file holds them in the names' order (0, 1, 10, 11, 2, ...). Mapped, each
    stacked expert weight is a strided view of the file in that order (Experts.slots); the state_dict
    is in expert order and equals a copying load; greedy tokens and prompt logprobs of a batch mixing
    prefills and decodes equal the copying load's (float32: the C grouped kernel on the strided
    weights; bf16: the per-expert matmuls); a write to a weight never reaches the file. bf16 experts
    and projections stay in the file through the serving prep (gate and up, and KDA's and MLA's
    input projections, unfused), with the tokens and logprobs of the fused copies prep made before.
    (Products of many bf16 rows stay in the C kernels here, whose outputs are the same bits fused or
    apart; torch's matmul picks kernels by the weight's shape and layout: tests/test_bf16_blas.py.)"""
    monkeypatch.setenv("TIDAL_BF16_BLAS_MIN_ROWS", "0")
    from tidal import LLM, SamplingParams
    from tidal.model import layers
    from tidal.model.kda import KimiDeltaAttention
    from tidal.model.moe import Experts

    if case.startswith("kimi_linear"):
        d = presets.tiny_kimi_linear_dict(num_experts=12)
        if "grouped" in case:  # 4 groups of 3 experts, the best 2 groups: groups are runs of expert numbers
            d.update(num_expert_group=4, topk_group=2)
        config = ModelConfig.from_dict(d)
    else:
        config = presets.tiny_k3(mxfp4=False, num_experts=12)
    dtype = torch.float32 if case.endswith("fp32") else torch.bfloat16
    save_model(random_model(config, dtype), tmp_path)
    files = [tmp_path / "model.safetensors"]
    mapped = load_model(tmp_path, dtype)
    copied = load_model(tmp_path, dtype, use_mmap=False)
    assert_same_state(mapped.state_dict(), copied.state_dict())
    ranges = mapped_ranges(files)

    def in_file(t: torch.Tensor) -> bool:
        return any(lo <= t.data_ptr() < hi for lo, hi in ranges)

    experts = [m for m in mapped.modules() if isinstance(m, Experts)]
    assert experts
    for m in experts:
        if dtype == torch.float32:  # copied: MKL's float32 sums depend on the weight's alignment
            assert m.slots is None and not any(in_file(getattr(m, w)) for w in ("w1", "w2", "w3"))
            continue
        assert m.slots == [0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 2, 3]  # expert 2 is the file's fifth
        assert all(in_file(getattr(m, w)) for w in ("w1", "w2", "w3"))
    # the other readers of stacked experts see expert order: load_state_dict, packing, relayout
    again = load_model(tmp_path, dtype)
    again.load_state_dict(copied.state_dict())
    assert_same_state(again.state_dict(), copied.state_dict())
    if dtype == torch.bfloat16:
        from tidal.model.moe import pack_experts

        assert_same_state(pack_experts(load_model(tmp_path, dtype)).state_dict(),
                          pack_experts(load_model(tmp_path, dtype, use_mmap=False)).state_dict())
        m = [x for x in again.modules() if isinstance(x, Experts)][0]
        m.in_model_order()
        c = [x for x in copied.modules() if isinstance(x, Experts)][0]
        assert m.slots is None and all(torch.equal(getattr(m, w), getattr(c, w)) for w in ("w1", "w2", "w3"))
    with torch.no_grad():
        experts[0].w2.add_(1)  # a private mapping: the file keeps its bytes
    assert torch.equal(load_model(tmp_path, dtype, use_mmap=False).state_dict()[_w2_name(mapped, experts[0])],
                       copied.state_dict()[_w2_name(mapped, experts[0])])
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 7 * i))} for i in range(3)] + [{"prompt_token_ids": [9]}]
    params = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=0)
    outs = {}
    for strategy in ("lazy", "eager", "eager, gate and up fused"):
        if strategy.endswith("fused"):
            monkeypatch.setattr(layers, "APART_DTYPES", ())
        llm = LLM(str(tmp_path), dtype=str(dtype).removeprefix("torch."), skip_tokenizer_init=True,
                  kv_cache_memory_bytes=8 << 20, safetensors_load_strategy=strategy.split(",")[0],
                  max_num_batched_tokens=48)
        served = [m for m in llm.engine.model.modules() if isinstance(m, Experts)]
        fused = dtype == torch.float32 or strategy.endswith("fused")
        assert all((m.w13 is not None) == fused for m in served), strategy
        kda = [m for m in llm.engine.model.modules() if isinstance(m, KimiDeltaAttention)]
        assert kda and all((m.in_proj is not None) == fused for m in kda), strategy
        if strategy == "lazy" and not fused:  # prep left every weight in the file's mapping
            ranges = mapped_ranges(files)
            assert all(in_file(getattr(m, w)) for m in served for w in ("w1", "w2", "w3"))
            linears = [(n, m.weight) for n, m in llm.engine.model.named_modules() if isinstance(m, torch.nn.Linear)]
            assert all(in_file(w) for _, w in linears), [n for n, w in linears if not in_file(w)][:3]
        outs[strategy] = [(o.outputs[0].token_ids, o.prompt_logprobs)
                          for o in [*llm.generate(prompts, params), *llm.generate(prompts[1:2], params)]]
        del llm  # the lone request decodes one token per step (Experts._one_token)
    assert outs["lazy"] == outs["eager"] == outs["eager, gate and up fused"]


def _w2_name(model, experts) -> str:
    return next(n for n, m in model.named_modules() if m is experts) + ".w2"


def test_writer_keeps_each_layers_routed_experts_in_one_shard(tmp_path):
    """save_model cuts shards between tensors but never among one layer's routed experts, so every
    stacked expert weight of a sharded checkpoint is mapped (a cut among them leaves it copied)."""
    from tidal.model.moe import Experts

    config = ModelConfig.from_dict(presets.tiny_kimi_linear_dict(num_experts=12))
    save_model(random_model(config), tmp_path, max_shard_bytes=200 << 10)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    files_of: dict[str, set[str]] = {}
    for name, file in weight_map.items():
        if ".experts." in name:
            files_of.setdefault(name.split(".experts.")[0], set()).add(file)
    assert len(set(weight_map.values())) >= 4 and files_of  # the old cut split 3 of the layers here
    assert all(len(files) == 1 for files in files_of.values()), files_of
    mapped = load_model(tmp_path, torch.bfloat16)
    ranges = mapped_ranges(sorted(tmp_path.glob("*.safetensors")))
    for m in mapped.modules():
        if isinstance(m, Experts):
            assert all(any(lo <= getattr(m, w).data_ptr() < hi for lo, hi in ranges) for w in ("w1", "w2", "w3"))


def test_each_stacked_expert_weight_is_mapped_on_its_own(tmp_path):
    """Another writer's shards: layer 1's w3 experts lie in two files after its w1 and w2. w1 and
    w2 are mapped (slots in file order), w3 is copied into the same slots; the state equals the
    copying load and greedy tokens and prompt logprobs equal it too."""
    from tidal import LLM, SamplingParams
    from tidal.model.moe import Experts

    config = ModelConfig.from_dict(presets.tiny_kimi_linear_dict(num_experts=12))
    save_model(random_model(config), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    stem = "model.layers.1.block_sparse_moe.experts"
    w3 = [f"{stem}.{e}.w3.weight" for e in range(12)]
    parts = {"a.safetensors": [n for n in tensors if n not in w3], "b.safetensors": w3[:5], "c.safetensors": w3[5:]}
    for file, names in parts.items():
        save_file({n: tensors[n] for n in names}, str(tmp_path / file), metadata={"format": "pt"})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: file for file, names in parts.items() for n in names}}))
    mapped = load_model(tmp_path, torch.bfloat16)
    copied = load_model(tmp_path, torch.bfloat16, use_mmap=False)
    assert_same_state(mapped.state_dict(), copied.state_dict())
    ranges = mapped_ranges(sorted(tmp_path.glob("*.safetensors")))

    def in_file(t: torch.Tensor) -> bool:
        return any(lo <= t.data_ptr() < hi for lo, hi in ranges)

    layer = mapped.model.layers[1].block_sparse_moe.experts
    assert isinstance(layer, Experts) and layer.slots == [0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 2, 3]
    assert in_file(layer.w1) and in_file(layer.w2) and not in_file(layer.w3)
    prompts = [{"prompt_token_ids": list(range(3 + i, 30 + 5 * i))} for i in range(2)]
    params = SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=0)
    outs = []
    for strategy in ("lazy", "eager"):
        llm = LLM(str(tmp_path), dtype="bfloat16", skip_tokenizer_init=True, kv_cache_memory_bytes=8 << 20,
                  safetensors_load_strategy=strategy)
        outs.append([(o.outputs[0].token_ids, o.prompt_logprobs) for o in llm.generate(prompts, params)])
        del llm
    assert outs[0] == outs[1]
