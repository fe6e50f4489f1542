"""The memory planner: byte formulas against hand-computed values, pool arithmetic against brute
force, weight accounting against a saved checkpoint, SGLang's split on a hand-worked example,
errors, JSON and the command line."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from tidal.plan import (
    GIB,
    PlanError,
    PoolLayout,
    Workload,
    kda_state_bytes_per_request,
    main,
    mla_kv_bytes_per_token,
    plan,
    plan_for_pool,
    plan_table,
    plan_to_json,
    pool_layout,
    prefix_snapshot_interval,
    recommend_ratio,
    sglang_split,
    weight_breakdown,
)
from tidal.presets import preset, tiny_k3, tiny_kimi_linear

K3 = preset("kimi-k3")
KL = preset("kimi-linear-48b")

# k3-model.md §1.6 and §2.2, by hand.
K3_KDA_LAYER = 3 * 96 * 128 * 3 * 2 + 96 * 128 * 128 * 4  # 221,184 + 6,291,456
KL_KDA_LAYER = 3 * 32 * 128 * 3 * 2 + 32 * 128 * 128 * 4  # 73,728 + 2,097,152
K3_TP8_STATE = 69 * (221_184 // 8 + 6_291_456 // 8)  # 56,171,520 B = 53.57 MiB


# ---- per-request and per-token bytes -------------------------------------------------------------


def test_kda_state_bytes_match_hand_values():
    assert K3_KDA_LAYER == 221_184 + 6_291_456
    assert kda_state_bytes_per_request(K3) == 69 * (221_184 + 6_291_456)
    assert KL_KDA_LAYER == 73_728 + 2_097_152
    assert kda_state_bytes_per_request(KL) == 20 * (73_728 + 2_097_152)
    assert kda_state_bytes_per_request(K3) / 2**20 == pytest.approx(428.6, abs=0.05)


def test_mla_kv_bytes_match_hand_values():
    assert mla_kv_bytes_per_token(K3) == 27_648
    assert mla_kv_bytes_per_token(KL) == 8_064
    assert mla_kv_bytes_per_token(K3, kv_dtype_bytes=1) == 13_824


def test_snapshot_interval_is_the_pages_whose_kv_is_worth_one_state():
    # K3, one rank: 449,372,160 B of state / (27,648 B x 16 tokens a page) = 1015.8 -> 1016 pages.
    assert prefix_snapshot_interval(kda_state_bytes_per_request(K3), 27_648, 16) == 1016 * 16 == 16_256
    assert prefix_snapshot_interval(K3_TP8_STATE, 27_648, 16) == 127 * 16  # TP splits the state only
    assert prefix_snapshot_interval(442_368, 27_648, 16) == 16  # exactly one page
    assert prefix_snapshot_interval(442_369, 27_648, 16) == 32
    assert prefix_snapshot_interval(1, 27_648, 16) == 16  # at least a page
    assert prefix_snapshot_interval(1000, 0, 16) == 0  # no MLA: prompt and request ends only
    assert prefix_snapshot_interval(442_368, 27_648, 16, fraction=0.5) == 16
    p = plan_for_pool(K3, 64 * GIB, tp_size=8)
    assert p.prefix_snapshot_interval == 2032
    assert plan_to_json(p)["prefix_snapshot_interval"] == 2032
    assert "prefix snapshot interval (KV >= 1 x state)" in plan_table(p) and "2,032 tokens" in plan_table(p)


def test_tp_splits_kda_state_but_not_mla_kv():
    assert kda_state_bytes_per_request(K3, tp_size=8) == K3_TP8_STATE
    assert K3_TP8_STATE / 2**20 == pytest.approx(53.6, abs=0.05)  # serving-engines.md §1.1
    assert kda_state_bytes_per_request(KL, tp_size=4) == 20 * (73_728 // 4 + 2_097_152 // 4)
    assert kda_state_bytes_per_request(K3, tp_size=8, conv_dtype_bytes=4) == 69 * (221_184 // 4 + 6_291_456 // 8)
    p1 = plan(K3, gpu_memory_gib=288, tp_size=8)
    p8 = plan(K3, gpu_memory_gib=288, tp_size=8, dcp_size=8)
    assert p1.mla_kv_bytes_per_token == p8.mla_kv_bytes_per_token == 27_648
    assert p1.kda_state_bytes_per_request == p8.kda_state_bytes_per_request == K3_TP8_STATE


# ---- the single pool -----------------------------------------------------------------------------


def test_pool_layout_hand_worked():
    lay = pool_layout(K3, 10 * GIB, tp_size=8)
    assert lay.page_bytes == 16 * 27_648 == 442_368
    assert lay.state_bytes == K3_TP8_STATE
    assert lay.pages_per_block == 127  # 56,171,520 / 442,368 = 126.98, rounded up
    assert lay.block_bytes == 127 * 442_368
    assert lay.num_blocks == 191  # 10 GiB / 56,180,736 = 191.1
    assert lay.state_slots == 191
    assert lay.kv_tokens_per_rank == 191 * 127 * 16 == 388_112
    assert lay.kv_tokens_logical == 388_112
    # 8192 tokens = 512 pages. 37 requests: 37 + ceil(37*512/127) = 37 + 150 = 187 blocks <= 191;
    # 38 requests: 38 + ceil(38*512/127) = 38 + 154 = 192 > 191.
    assert lay.max_requests(8192) == 37
    assert lay.max_context_len() == 190 * 127 * 16


def test_dcp_multiplies_logical_tokens_not_state():
    one = pool_layout(K3, 10 * GIB, tp_size=8)
    four = pool_layout(K3, 10 * GIB, tp_size=8, dcp_size=4)
    assert four.state_bytes == one.state_bytes and four.num_blocks == one.num_blocks
    assert four.kv_tokens_per_rank == one.kv_tokens_per_rank
    assert four.kv_tokens_logical == 4 * one.kv_tokens_logical
    assert four.pages_per_request(8192) == 8192 // (4 * 16)
    # 95 requests: 95 + ceil(95*128/127) = 95 + 96 = 191 blocks; 96 would need 193.
    assert four.max_requests(8192) == 95
    assert four.max_context_len() == 4 * one.max_context_len()


def _brute_max_requests(lay: PoolLayout, context_len: int) -> int:
    s, p = lay.state_blocks_per_request, lay.pages_per_request(context_len)
    n = 0
    while (n + 1) * s + math.ceil((n + 1) * p / lay.pages_per_block) <= lay.num_blocks:
        n += 1
    return n


def test_max_requests_matches_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        lay = PoolLayout(
            pool_bytes=0,
            page_size=rng.choice([1, 4, 16]),
            page_bytes=1,
            state_bytes=1,
            pages_per_block=rng.randint(1, 40),
            num_blocks=rng.randint(0, 300),
            dcp_size=rng.choice([1, 2, 4]),
            spec_draft_tokens=rng.choice([0, 0, 3]),
        )
        L = rng.randint(1, 3000)
        assert lay.max_requests(L) == _brute_max_requests(lay, L)
        # the longest context fits as one request and one token more does not
        longest = lay.max_context_len()
        if longest > 0:
            assert lay.max_requests(longest) == 1
            assert lay.max_requests(longest + 1) == 0


def test_spec_decoding_costs_state_blocks_and_kv_headroom():
    lay = pool_layout(K3, 10 * GIB, tp_size=8, spec_draft_tokens=4)
    assert lay.state_blocks_per_request == 5
    assert lay.pages_per_request(8192) == 513  # 8196 tokens
    assert lay.max_requests(8192) < pool_layout(K3, 10 * GIB, tp_size=8).max_requests(8192)


def test_pool_too_small_for_one_state_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot hold one request's KDA state"):
        pool_layout(K3, 50 * 2**20, tp_size=8)
    assert pool_layout(K3, K3_TP8_STATE + 16 * 27_648, tp_size=8).num_blocks == 1


# ---- weights -------------------------------------------------------------------------------------


def _checkpoint_bytes_by_kind(config, tmp_path) -> dict[str, int]:
    from tidal.model.checkpoint import expected_tensors, save_model
    from tidal.model.kimi import KimiForCausalLM

    torch.manual_seed(0)
    save_model(KimiForCausalLM(config), tmp_path, dtype=torch.bfloat16)
    kind_of = {name: spec.kind for name, spec in expected_tensors(config).items()}
    rename = {"embedding": "embeddings", "norm": "norms"}
    sizes = {"BF16": 2, "F32": 4, "U8": 1}
    out: dict[str, int] = {}
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            piece = f.get_slice(name)
            kind = rename.get(kind_of[name], kind_of[name])
            out[kind] = out.get(kind, 0) + math.prod(piece.get_shape()) * sizes[piece.get_dtype()]
    return out


@pytest.mark.parametrize(
    "make", [tiny_k3, lambda: tiny_k3(mxfp4=False, attn_res_block_size=None), tiny_kimi_linear], ids=["k3", "k3-dense", "kl"]
)
def test_weight_bytes_equal_saved_checkpoint(make, tmp_path):
    config = make()
    disk = _checkpoint_bytes_by_kind(config, tmp_path)
    formula = {w.kind: w.total_bytes for w in weight_breakdown(config)}
    assert sum(formula.values()) == sum(disk.values())
    assert formula == disk


def test_routed_experts_at_stored_precision():
    experts = {w.kind: w for w in weight_breakdown(K3)}["routed_experts"]
    params = 92 * 896 * 3 * 3072 * 3584  # 2.723 T (k3-model.md §5.4)
    assert experts.total_bytes == params * 4.25 / 8
    kl = {w.kind: w for w in weight_breakdown(KL)}["routed_experts"]
    assert kl.total_bytes == 26 * 256 * 3 * 1024 * 2304 * 2


def test_published_k3_a_log_has_128_values():
    base = sum(w.total_bytes for w in weight_breakdown(K3))
    published = sum(w.total_bytes for w in weight_breakdown(K3, a_log_values=128))
    assert published - base == 69 * (128 - 96) * 4
    # a rank loads only its heads either way
    rank = lambda **kw: sum(w.per_rank_bytes for w in weight_breakdown(K3, tp_size=8, **kw))
    assert rank() == rank(a_log_values=128)


def test_sharding_per_kind():
    whole = {w.kind: w for w in weight_breakdown(K3)}
    for tp, ep in ((8, 1), (8, 8), (16, 4)):
        ranked = {w.kind: w for w in weight_breakdown(K3, tp_size=tp, ep_size=ep)}
        for kind in ("router", "latent_proj", "norms", "attn_res"):
            assert ranked[kind].per_rank_bytes == whole[kind].total_bytes, kind
        for kind in ("routed_experts", "shared_experts", "dense_mlp", "embeddings", "lm_head"):
            assert ranked[kind].per_rank_bytes * tp == whole[kind].total_bytes, kind
        # heads split; the low-rank f_a and o_norm (KDA), q_a/kv_a and their norms (MLA) do not
        f_a_o_norm = 69 * (128 * 7168 * 2 + 128 * 4)
        assert (ranked["kda"].per_rank_bytes - f_a_o_norm) * tp == whole["kda"].total_bytes - f_a_o_norm
        mla_rep = 24 * ((1536 + 576) * 7168 * 2 + (1536 + 512) * 2)
        assert (ranked["mla"].per_rank_bytes - mla_rep) * tp == whole["mla"].total_bytes - mla_rep


def test_k3_checkpoint_size_matches_spec():
    total = sum(w.total_bytes for w in weight_breakdown(K3, a_log_values=128))
    assert total / 1e12 == pytest.approx(1.56, abs=0.01)  # "Checkpoint: ... ≈1.56 TB" (vision excluded)


# ---- SGLang's split ------------------------------------------------------------------------------


def test_sglang_split_hand_worked():
    # K3 TP8, rest = 100 GiB = 107,374,182,400 B, R = 0.9, 3 slots per request, page 16.
    # state budget = floor(rest * 0.9 / 1.9) = 50,861,454,821; slots = floor(/56,171,520) = 905;
    # KV = (rest - 905 * 56,171,520) / 27,648 = 2,044,956.3 -> page-rounded 2,044,944;
    # cap = min(clamp(2,044,944 / 1,048,576 * 512, 2048, 4096), 905 // 3) = min(2048, 301) = 301.
    s = sglang_split(K3, 100 * GIB, ratio=0.9, tp_size=8)
    assert s.state_budget_bytes == 50_861_454_821
    assert s.state_bytes_per_request == 56_171_520
    assert s.state_slots == 905
    assert s.kv_tokens_per_rank == 2_044_944
    assert s.max_running_requests == 301
    assert s.spec_scratch_bytes == 0


def test_sglang_split_with_speculative_scratch_hand_worked():
    # D = 4: slots = floor(budget / (per_req * (1 + 4/3))) = floor(388.06) = 388; 129 running;
    # scratch = 4 * 56,171,520 * 129 = 28,984,504,320; KV = (rest - 388 * per_req - scratch) / 27,648
    # = 2,046,988.1 -> 2,046,976.
    s = sglang_split(K3, 100 * GIB, ratio=0.9, tp_size=8, spec_draft_tokens=4)
    assert s.state_slots == 388
    assert s.max_running_requests == 129
    assert s.spec_scratch_bytes == 28_984_504_320
    assert s.kv_tokens_per_rank == 2_046_976


def test_sglang_ratio_meaning_and_dcp():
    # R = 1 gives half the rest to state; DCP widens logical tokens, not per-rank ones.
    s = sglang_split(KL, 10 * GIB, ratio=1.0)
    assert s.state_budget_bytes == 5 * GIB
    assert s.state_slots == 5 * GIB // kda_state_bytes_per_request(KL)
    d = sglang_split(KL, 10 * GIB, ratio=1.0, dcp_size=2)
    assert d.kv_tokens_per_rank == s.kv_tokens_per_rank and d.kv_tokens_logical == 2 * s.kv_tokens_logical
    with pytest.raises(PlanError, match="must be > 0"):
        sglang_split(KL, 10 * GIB, ratio=0)


def test_recommended_ratio_is_the_smallest_that_serves_the_workload():
    rest = 30 * GIB
    wl = Workload(isl=8192, osl=1024, concurrency=50)
    lay = pool_layout(K3, rest, tp_size=8)
    rec = recommend_ratio(K3, rest, wl, lay, tp_size=8)
    assert rec.ratio is not None and rec.ratio_min <= rec.ratio <= rec.ratio_max
    assert sglang_split(K3, rest, ratio=rec.ratio, tp_size=8).max_requests(9216) >= 50
    assert sglang_split(K3, rest, ratio=round(rec.ratio - 0.01, 2), tp_size=8).max_requests(9216) < 50
    assert rec.tidal_max_requests == lay.max_requests(9216) >= 50
    # too many requests for any split: no ratio, and the reason says what is needed
    big = recommend_ratio(K3, rest, Workload(8192, 1024, 5000), lay, tp_size=8)
    assert big.ratio is None and "no ratio fits" in big.reason


def test_plan_sglang_mode_top_level_numbers():
    wl = Workload(isl=4096, osl=1024, concurrency=16)
    p = plan(KL, gpu_memory_gib=80, tp_size=2, engine="sglang", mamba_full_memory_ratio=0.5, workload=wl)
    s = sglang_split(KL, p.pool_bytes, ratio=0.5, tp_size=2)
    assert p.sglang == s
    assert (p.state_slots, p.kv_tokens_per_rank) == (s.state_slots, s.kv_tokens_per_rank)
    assert p.max_running_requests == s.max_requests(wl.context_len)


# ---- plan, errors, output ------------------------------------------------------------------------


def test_pool_is_static_fraction_minus_weights_and_reserve():
    p = plan(KL, gpu_memory_gib=80, tp_size=2, mem_fraction_static=0.85, reserve_bytes=GIB)
    weights = sum(w.per_rank_bytes for w in weight_breakdown(KL, tp_size=2))
    assert p.weights_bytes_per_rank == weights
    assert p.pool_bytes == int(80 * GIB * 0.85) - weights - GIB
    assert p.layout == pool_layout(KL, p.pool_bytes, tp_size=2)


def test_plan_for_pool_goes_through_the_same_functions():
    wl = Workload(2048, 512, 8)
    p = plan(KL, gpu_memory_gib=80, tp_size=2, dcp_size=2, workload=wl, spec_draft_tokens=2)
    q = plan_for_pool(KL, p.pool_bytes, p.weights_bytes_per_rank, tp_size=2, dcp_size=2, workload=wl, spec_draft_tokens=2)
    assert q.layout == p.layout and q.recommendation == p.recommendation
    assert plan_to_json(q)["max_running_requests"] == plan_to_json(p)["max_running_requests"]
    f32 = plan_for_pool(tiny_k3(), 2**20, dtype=torch.float32)
    assert f32.layout == pool_layout(tiny_k3(), 2**20, kv_dtype_bytes=4, conv_dtype_bytes=4)


@pytest.mark.parametrize(
    "config, kw, message",
    [
        (K3, dict(tp_size=5), "does not divide the 96 KDA heads"),
        (tiny_k3().replace(kda_num_heads=4), dict(tp_size=4), "does not divide the 2 MLA heads"),
        (K3, dict(tp_size=8, dcp_size=3), "--dcp-size 3 does not divide --tp-size 8"),
        (KL.replace(num_experts=250), dict(tp_size=4, ep_size=4), "does not divide the 250 routed experts"),
        (K3, dict(tp_size=8, ep_size=3), "--ep-size 3 does not divide --tp-size 8"),
        (K3, dict(tp_size=8, num_gpus=16), "--num-gpus .16. must equal --tp-size .8."),
    ],
)
def test_impossible_setups(config, kw, message):
    with pytest.raises(PlanError, match=message):
        plan(config, gpu_memory_gib=1000, **kw)


def test_weights_that_do_not_fit_say_by_how_much():
    with pytest.raises(PlanError, match="weights do not fit") as e:
        plan(K3, gpu_memory_gib=141, tp_size=8)
    weights = sum(w.per_rank_bytes for w in weight_breakdown(K3, tp_size=8)) / GIB
    short = float(str(e.value).split("short by ")[1].split(" GiB")[0])
    assert short == pytest.approx(weights - (141 * 0.9 - 2), abs=0.006)


def test_workload_parse():
    assert Workload.parse("isl=8192,osl=1024,concurrency=50") == Workload(8192, 1024, 50)
    for bad in ("isl=1,osl=2", "isl=a,osl=1,concurrency=1", "isl=1,osl=1,users=3", "isl=1,osl=1,concurrency=0"):
        with pytest.raises(PlanError, match="--workload"):
            Workload.parse(bad)


REQUIRED_KEYS = (
    "weights_bytes_per_rank",
    "kda_state_bytes_per_request_per_rank",
    "mla_kv_bytes_per_token_per_rank",
    "pool_bytes_per_rank",
    "kv_tokens_per_rank",
    "kv_tokens_logical",
    "state_slots",
    "max_running_requests",
)


def test_json_keys_and_inputs():
    wl = Workload(8192, 1024, 50)
    p = plan(K3, gpu_memory_gib=141, tp_size=16, dcp_size=8, ep_size=16, workload=wl, engine="sglang",
             mamba_full_memory_ratio=0.7, kv_dtype="fp8")
    out = json.loads(json.dumps(plan_to_json(p)))
    for key in REQUIRED_KEYS:
        assert isinstance(out[key], int), key
    assert out["mla_kv_bytes_per_token_per_rank"] == 13_824
    assert out["kda_state_bytes_per_request_per_rank"] == 69 * (221_184 // 16 + 6_291_456 // 16)
    assert out["kv_tokens_logical"] == 8 * out["kv_tokens_per_rank"]
    inputs = out["inputs"]
    assert (inputs["tp_size"], inputs["dcp_size"], inputs["ep_size"], inputs["num_gpus"]) == (16, 8, 16, 16)
    assert inputs["gpu_memory_gib"] == 141 and inputs["kv_dtype"] == "fp8"
    assert inputs["mamba_full_memory_ratio"] == 0.7
    assert inputs["workload"] == {"isl": 8192, "osl": 1024, "concurrency": 50}
    assert out["recommendation"]["mamba_full_memory_ratio"] is not None


def test_table_shows_the_numbers():
    p = plan(KL, gpu_memory_gib=80, tp_size=2, workload=Workload(32768, 1024, 64))
    text = plan_table(p)
    for s in ("routed_experts", "KDA state per request", "8,064 B", f"{p.layout.num_blocks:,}",
              f"{p.layout.kv_tokens_per_rank:,}", "--mamba-full-memory-ratio"):
        assert s in text, s


def test_main_returns_2_with_a_message(capsys):
    assert main(["--model", "kimi-k3", "--gpu-memory", "141", "--tp-size", "7"]) == 2
    err = capsys.readouterr().err
    assert "does not divide the 96 KDA heads" in err and "Traceback" not in err
    assert main(["--model", "/nonexistent/config.json", "--gpu-memory", "80"]) == 2


def test_model_from_config_path(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(KL.to_dict()))
    assert main(["--model", str(tmp_path), "--gpu-memory", "80", "--tp-size", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kda_state_bytes_per_request_per_rank"] == 20 * (73_728 + 2_097_152) // 2


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tidal.cli", "plan", *args], capture_output=True, text=True, timeout=60)


def test_cli_subprocess_json():
    r = _cli("--model", "kimi-k3", "--gpu-memory", "141", "--num-gpus", "16", "--tp-size", "16", "--json",
             "--workload", "isl=8192,osl=1024,concurrency=50")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in REQUIRED_KEYS:
        assert key in out
    # K3 does not fit on 8 x 141 GiB (about 191 GiB of weights per rank): still parseable JSON, exit 2
    r = _cli("--model", "kimi-k3", "--gpu-memory", "141", "--num-gpus", "8", "--tp-size", "8", "--json")
    assert r.returncode == 2
    assert "weights do not fit" in json.loads(r.stdout)["error"]
    assert "Traceback" not in r.stderr


def test_cli_tp_defaults_to_num_gpus_and_advice_names_what_fits(capsys):
    from tidal.plan.cli import main

    assert main(["--model", "kimi-k3", "--gpu-memory", "141", "--num-gpus", "16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"]["tp_size"] == 16
    assert main(["--model", "kimi-k3", "--gpu-memory", "141", "--num-gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert "This fits: --num-gpus 16 --tp-size 16" in err and "mem-fraction-static" not in err.split("short by")[1]
    assert main(["--model", "kimi-k3", "--gpu-memory", "141", "--num-gpus", "16"]) == 0


def test_engine_plan_names_its_device_and_keeps_measured_and_formula_totals_apart():
    """A pool measured on a CPU says so (not "1 GPU(s)"); the measured total stands beside the
    formula's, each with its own whole-model figure, so per rank never reads larger than the model."""
    measured = 3 * sum(w.per_rank_bytes for w in plan_for_pool(KL, 2**30).weights)
    p = plan_for_pool(KL, 2**30, measured, device="cpu")
    text = plan_table(p)
    assert "| cpu, TP 1" in text and "GPU(s)" not in text
    gib = f"{measured / 2**30:,.2f} GiB"
    row = next(line for line in text.splitlines() if "total (measured)" in line)
    assert row.count(gib) == 2, row
    assert "total (formula)" in text
    assert "GPU(s)" in plan_table(plan_for_pool(KL, 2**30, measured, device="cuda:0"))
