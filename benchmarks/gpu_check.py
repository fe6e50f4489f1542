"""The GPU check of issue 19 (run by scripts/gpu_check.sh on an H200): correctness of the CUDA path
against the CPU float32 reference, then decode and prefill speed on a slice of real Kimi-K3 shapes
against the hardware's bounds, then a projection to full K3 on 8 GPUs.

The JSON report is rewritten after every step, so a run cut short still reports what it did.
``--smoke`` shrinks every shape (a CPU run of the script's logic, no GPU figures).
"""

from __future__ import annotations

import argparse
import json
import math
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from tidal.cache.pool import MemoryPool
from tidal.config import ModelConfig
from tidal.engine.core import EngineConfig, EngineCore
from tidal.engine.cuda_graph import DecodeGraphs
from tidal.model.context import ForwardBatch, SimpleCache, simple_batch
from tidal.model.init import init_weights
from tidal.model.kimi import KimiForCausalLM
from tidal.model.moe import KimiMoE, PackedExperts
from tidal.ops import backends
from tidal.plan import pool_layout
from tidal.presets import preset_dict, tiny_k3, tiny_kimi_linear
from tidal.sampling_params import SamplingParams

HBM_BYTES_PER_S = 4.3e12  # H200, measured (shared/spec/gpu-stack.md)
BF16_FLOPS = 790e12  # H200 bf16 dense GEMM, measured
SGLANG_ITL_MS = 37.9  # published: median ITL, concurrency 10, 8xB300, speculative decoding
K3_KDA_LAYERS, K3_MLA_LAYERS = 69, 24


class Report:
    def __init__(self, path: Path) -> None:
        self.path, self.data = path, {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "steps": {}}
        self.save()

    def step(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        t0 = time.time()
        try:
            result = fn()
            result["ok"] = result.get("ok", True)
        except Exception as e:  # a failed step is reported, the next ones still run
            result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        result["seconds"] = round(time.time() - t0, 1)
        self.data["steps"][name] = result
        self.save()
        print(json.dumps({name: {k: v for k, v in result.items() if k != "traceback"}}, indent=1), flush=True)

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1))


# ---- (a0) each kernel compiled for the device against its torch reference -----------------------
def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double().cpu() - ref.double().cpu()).abs().max() / ref.double().abs().max().clamp(min=1e-30))


def check_kernels(device: str) -> dict[str, Any]:
    """bf16 kernels at small K3-like shapes against float64 references (the interpreter tests run
    the same contracts on the CPU; this checks the compiled code)."""
    from tidal.ops.kda import kda_recurrent
    from tidal.ops.mla import gather_pages, mla_absorbed_attention, mla_naive_attention
    from tidal.ops.mxfp import dequantize_mxfp4
    from tidal.ops.short_conv import causal_conv_step

    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    out: dict[str, Any] = {}
    # MLA decode: 16 heads, rank 512 + rope 64, pages of 16, lengths up to 300
    B, n, dn, r, rope, ps = 4, 16, 128, 512, 64, 16
    lengths = torch.tensor([1, 77, 300, 16])
    pages = torch.randn(200, ps, r + rope, generator=g)
    table = torch.randperm(200, generator=g)[: B * 20].view(B, 20)
    q_nope, q_pe = torch.randn(B, n, dn, generator=g), torch.randn(B, n, rope, generator=g)
    kv_b = torch.randn(n * 256, r, generator=g) / r**0.5
    got = backends.mla_paged_decode(q_nope.to(device, bf), q_pe.to(device, bf), pages.to(device, bf),
                                    table.to(device), lengths.to(device), kv_b.to(device, bf), 0.07)
    lat = gather_pages(pages.to(bf).double(), table, lengths)
    ref = mla_absorbed_attention(q_nope[:, None].double(), q_pe[:, None].double(), lat, lengths, kv_b.to(bf).double(),
                                 0.07)[:, 0]
    out["mla_decode_rel_err"] = rel_err(got, ref)
    # MLA prefill over a context, in key tiles
    T, L = 200, 700
    latents = torch.randn(L, r + rope, generator=g)
    qn, qp = torch.randn(T, n, dn, generator=g), torch.randn(T, n, rope, generator=g)
    got = backends.mla_prefill_attention(qn.to(device, bf), qp.to(device, bf), latents.to(device, bf),
                                         kv_b.to(device, bf), 0.07)
    ref = mla_naive_attention(qn.double(), qp.double(), latents.to(bf).double(), kv_b.to(bf).double(), 0.07)
    out["mla_prefill_rel_err"] = rel_err(got, ref)
    # grouped MXFP4 experts: 64 experts top-8, d 512, I 256
    E, k, d, inter, T = 64, 8, 512, 256, 37
    w13 = (torch.randint(0, 256, (E, 2 * inter, d // 2), dtype=torch.uint8, generator=g),
           torch.randint(118, 124, (E, 2 * inter, d // 32), dtype=torch.uint8, generator=g))
    w2 = (torch.randint(0, 256, (E, d, inter // 2), dtype=torch.uint8, generator=g),
          torch.randint(118, 124, (E, d, inter // 32), dtype=torch.uint8, generator=g))
    h = torch.randn(T, d, generator=g).to(bf)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=g)
    silu = lambda a, b: torch.nn.functional.silu(a.float()) * b.float()  # noqa: E731
    got = backends.routed_experts(h.to(device), ids.to(device), wts.to(device),
                                  tuple(t.to(device) for t in w13), tuple(t.to(device) for t in w2),
                                  lambda a, b: silu(a, b).to(a.dtype))
    W13, W2 = dequantize_mxfp4(*w13, torch.float64), dequantize_mxfp4(*w2, torch.float64)
    ref = torch.zeros(T, d, dtype=torch.float64)
    for t in range(T):
        for j, e in enumerate(ids[t].tolist()):
            a, b = (W13[e] @ h[t].double()).chunk(2)
            ref[t] += wts[t, j].double() * (W2[e] @ silu(a, b).to(bf).double())
    out["moe_mxfp4_rel_err"] = rel_err(got, ref)
    # conv step on slots
    C, W = 3 * 1536, 4
    state = torch.randn(10, W - 1, C, generator=g).to(bf)
    x, wc = torch.randn(3, C, generator=g).to(bf), torch.randn(C, W, generator=g)
    slots = torch.tensor([7, 2, 4])
    st = state.to(device)
    got = backends.conv_decode_(x.to(device), wc.to(device), st, slots.to(device, torch.int32))
    ref, ref_state = causal_conv_step(x, wc, state[slots])
    out["conv_rel_err"] = rel_err(got, ref)
    out["conv_state_equal"] = bool(torch.equal(st[slots.to(device)].cpu(), ref_state))
    # KDA through fla: decode on slots and varlen prefill, against the token-by-token reference
    H, K = 4, 128
    q = torch.nn.functional.normalize(torch.randn(3, H, K, generator=g), dim=-1) * K**-0.5
    kk = torch.nn.functional.normalize(torch.randn(3, H, K, generator=g), dim=-1)
    v, gate = torch.randn(3, H, K, generator=g), -torch.rand(3, H, K, generator=g)
    beta = torch.rand(3, H, generator=g)
    pool_state = torch.randn(9, H, K, K, generator=g) * 0.1
    ps_dev = pool_state.to(device)
    cu = torch.arange(4, device=device)
    got = backends.kda_decode_(q.to(device), kk.to(device), v.to(device), gate.to(device), beta.to(device), ps_dev,
                               slots.to(device, torch.int32), cu)
    ref, ref_s = kda_recurrent(q[:, None].double(), kk[:, None].double(), v[:, None].double(), gate[:, None].double(),
                               beta[:, None].double(), pool_state[slots].double())
    out["kda_decode_rel_err"] = rel_err(got, ref[:, 0])
    out["kda_decode_state_rel_err"] = rel_err(ps_dev[slots.to(device)], ref_s)
    lens = [50, 130, 7]
    Tt = sum(lens)
    qs = torch.nn.functional.normalize(torch.randn(Tt, H, K, generator=g), dim=-1) * K**-0.5
    ks = torch.nn.functional.normalize(torch.randn(Tt, H, K, generator=g), dim=-1)
    vs, gs, bs = torch.randn(Tt, H, K, generator=g), -torch.rand(Tt, H, K, generator=g) * 0.3, torch.rand(Tt, H, generator=g)
    ps_dev = pool_state.to(device)
    cu_list = [0, 50, 180, 187]
    got = backends.kda_prefill_(qs.to(device), ks.to(device), vs.to(device), gs.to(device), bs.to(device), ps_dev,
                                slots.to(device), cu_list)
    errs = []
    for i, s_ in enumerate(slots.tolist()):
        sl = slice(cu_list[i], cu_list[i + 1])
        o_ref, s_ref = kda_recurrent(*(t[sl][None].double() for t in (qs, ks, vs, gs, bs)), pool_state[s_][None].double())
        errs += [rel_err(got[sl], o_ref[0]), rel_err(ps_dev[s_], s_ref[0])]
    out["kda_prefill_rel_err"] = max(errs)
    out["ok"] = all(v < 3e-2 for key, v in out.items() if key.endswith("rel_err")) and out["conv_state_equal"]
    return out


# ---- (a) tiny models on the GPU against the CPU float32 reference ------------------------------
def reference_run(model: KimiForCausalLM, prompt: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    """Prompt logits (last position) and n greedy tokens over a SimpleCache, in the model's dtype and device."""
    dev = next(model.parameters()).device
    cache = SimpleCache(model.config, 1, model.dtype, dev)
    ids, cached, out, first = list(prompt), 0, [], None
    with torch.inference_mode():
        while len(out) < n:
            h = model(torch.tensor(ids, device=dev), simple_batch(model.config, [len(ids)], cache, [cached]))
            logits = model.compute_logits(h[-1:]).float().cpu()
            first = logits if first is None else first
            cached += len(ids)
            ids = [int(logits.argmax())]
            out.append(ids[0])
    return first[0], out


def engine_greedy(model: KimiForCausalLM, prompts: list[list[int]], n: int, graphs: bool) -> list[list[int]]:
    cfg = EngineConfig(page_size=16, kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False,
                       disable_cuda_graph=not graphs, cuda_graph_max_bs=8)
    engine = EngineCore(model, cfg)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))]


def check_tiny(make: Callable[[], ModelConfig], device: str) -> dict[str, Any]:
    cfg = make()
    ref = init_weights(KimiForCausalLM(cfg), seed=0).eval()
    gpu = init_weights(KimiForCausalLM(cfg), seed=0).eval().to(device).to_dtype(torch.bfloat16 if device != "cpu"
                                                                              else torch.float32)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size - 4, (n,), generator=g).tolist() for n in (5, 37, 130, 1)]
    n = 8
    result: dict[str, Any] = {"prompts": len(prompts), "new_tokens": n}
    errs, same_first = [], 0
    refs = []
    for p in prompts:
        l_ref, t_ref = reference_run(ref, p, n)
        l_gpu, _ = reference_run(gpu, p, n)
        refs.append(t_ref)
        errs.append(float((l_gpu - l_ref).abs().max() / l_ref.abs().max()))
        same_first += int(l_gpu.argmax() == l_ref.argmax())
    result["logits_max_rel_err"] = max(errs)
    result["first_token_argmax_equal"] = f"{same_first}/{len(prompts)}"
    for graphs in ((False, True) if device != "cpu" else (False,)):
        got = engine_greedy(gpu, prompts, n, graphs)
        # greedy tokens equal up to the first divergence (bf16 may flip a near-tie later)
        agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), n) for x, y in zip(got, refs)]
        result[f"engine_greedy_prefix_agreement{'_graphs' if graphs else ''}"] = agree
    result["ok"] = max(errs) < 0.05  # bf16 tolerance on logits
    return result


# ---- (b) a slice of real K3 shapes --------------------------------------------------------------
def random_packed_experts(config: ModelConfig, device: str) -> PackedExperts:
    """A layer's routed experts as MXFP4 with random codes and moderate scales, made on the device
    (the slice is too big for dense experts)."""
    experts = PackedExperts(config, device)
    for name, buf in experts.named_buffers():
        if name.endswith("packed"):
            buf.random_(0, 256)
        else:
            buf.random_(118, 124)
    return experts


def expert_bytes(experts: PackedExperts) -> int:
    """Bytes of one expert's packed weights and scales."""
    return sum(b[0].numel() for b in experts.buffers())


def k3_slice_config(smoke: bool) -> ModelConfig:
    """K3 shapes with 4 layers: 3 KDA + 1 MLA, every layer MoE (the typical layer)."""
    d = preset_dict("kimi-k3")
    t = d["text_config"]
    t.update(num_hidden_layers=4, first_k_dense_replace=0)
    t["linear_attn_config"] = dict(t["linear_attn_config"], full_attn_layers=[4], kda_layers=[1, 2, 3])
    t.pop("quantization_config", None)
    d.pop("vision_config", None)
    if smoke:
        t.update(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, num_experts=16,
                 num_experts_per_token=4, moe_intermediate_size=64, routed_expert_hidden_size=128, q_lora_rank=64,
                 vocab_size=512)
        t["linear_attn_config"] = dict(t["linear_attn_config"], num_heads=2)
    return ModelConfig.from_dict(d)


def build_slice(cfg: ModelConfig, device: str) -> tuple[KimiForCausalLM, int]:
    """The slice with random bf16 weights made on the device and packed experts; -> (model, bytes
    of the weights read by every decode step: everything but the routed experts and embeddings)."""
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    with torch.device("meta"):
        model = KimiForCausalLM(cfg)
    for m in model.modules():
        if isinstance(m, KimiMoE):
            m.experts = nn.Module()  # placeholder: replaced after materialising
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                p.fill_(1.0)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.uniform_(-0.5, 0.5, generator=gen)
    model.to_dtype(dtype).eval()
    for m in model.modules():
        if isinstance(m, KimiMoE):
            m.experts = random_packed_experts(cfg, device)
    dense = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if "embed_tokens" not in n and "lm_head" not in n)
    return model, dense


def timed(fn: Callable[[], Any], device: str, iters: int) -> float:
    """Median seconds of fn() (after two warm-up calls)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def slice_decode(model: KimiForCausalLM, dense_bytes: int, device: str, batches: list[int], context: int,
                 iters: int) -> dict[str, Any]:
    cfg = model.config
    layout = pool_layout(cfg, 24 << 30 if device != "cpu" else 64 << 20, page_size=16,
                         kv_dtype_bytes=model.dtype.itemsize, conv_dtype_bytes=model.dtype.itemsize)
    pool = MemoryPool(cfg, layout, model.dtype, device)
    model.process_weights_after_loading()
    graphs = DecodeGraphs(model, pool.storage, max(batches), context + 8) if device != "cpu" else None
    if graphs is not None:
        graphs.capture_all()
    expert = next(m for m in model.modules() if isinstance(m, PackedExperts))
    E, k = cfg.num_experts, cfg.num_experts_per_token
    state_bytes = cfg.num_kda_layers * (math.prod(cfg.kda_recurrent_state_shape) * 4
                                        + math.prod(cfg.kda_conv_state_shape) * model.dtype.itemsize)
    rows = []
    for B in batches:
        owners = [f"b{B}-{i}" for i in range(B)]
        for o in owners:
            if not (pool.alloc_state(o) and pool.reserve(o, context + 1)):
                raise RuntimeError(f"the pool cannot hold {B} sequences of {context} tokens")
        ids = torch.randint(0, cfg.vocab_size, (B,)).tolist()
        cached = [context] * B

        def eager() -> None:
            cache = pool.cache_view(owners, [1] * B, cached)
            with torch.inference_mode():
                model(torch.tensor(ids, device=device), ForwardBatch([1] * B, cached, cache))

        row: dict[str, Any] = {"batch": B, "context": context}
        row["eager_ms"] = timed(eager, device, iters) * 1e3
        if graphs is not None:
            tables, slots = [pool.page_table(o) for o in owners], [pool.state_block(o) for o in owners]
            row["graph_ms"] = timed(lambda: graphs.run(tables, slots, ids, cached), device, iters) * 1e3
            row["graph_speedup"] = row["eager_ms"] / row["graph_ms"]
        active = E * (1 - (1 - k / E) ** B)  # expected distinct experts of B tokens routed to k of E each
        moe_layers = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
        step_bytes = (dense_bytes + moe_layers * active * expert_bytes(expert) + 2 * B * state_bytes
                      + B * context * cfg.num_mla_layers * cfg.mla_cache_width * model.dtype.itemsize)
        row["bytes_per_step"] = int(step_bytes)
        row["hbm_bound_ms"] = step_bytes / HBM_BYTES_PER_S * 1e3
        best = min(row["eager_ms"], row.get("graph_ms", math.inf))
        row["fraction_of_hbm_bound"] = row["hbm_bound_ms"] / best
        rows.append(row)
        for o in owners:
            pool.free(o)
    return {"rows": rows, "dense_weight_bytes": dense_bytes, "expert_bytes": expert_bytes(expert),
            "targets": "batch 1 >= 50% of the HBM bound; graphs >= 1.3x eager at batch 1"}


def slice_prefill(model: KimiForCausalLM, device: str, tokens: int, iters: int) -> dict[str, Any]:
    cfg = model.config
    layout = pool_layout(cfg, 8 << 30 if device != "cpu" else 64 << 20, page_size=16,
                         kv_dtype_bytes=model.dtype.itemsize, conv_dtype_bytes=model.dtype.itemsize)
    pool = MemoryPool(cfg, layout, model.dtype, device)
    assert pool.alloc_state("p") and pool.reserve("p", tokens)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), device=device)

    def run() -> None:
        cache = pool.cache_view(["p"], [tokens], [0])
        with torch.inference_mode():
            model(ids, ForwardBatch([tokens], [0], cache))

    seconds = timed(run, device, iters)
    # FLOPs: 2 per weight per token for the weights each token uses, plus causal MLA attention
    per_expert = 3 * cfg.moe_intermediate_size * cfg.expert_hidden_size
    dense = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    moe_layers = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    flops = 2 * tokens * (dense + moe_layers * cfg.num_experts_per_token * per_expert)
    n, dqk, dv = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim
    flops += cfg.num_mla_layers * 2 * n * (dqk + dv) * tokens * tokens / 2
    return {"tokens": tokens, "seconds": seconds, "tok_per_s": tokens / seconds, "flops": flops,
            "flop_bound_s": flops / BF16_FLOPS, "fraction_of_flop_bound": flops / BF16_FLOPS / seconds,
            "note": "KDA chunk FLOPs are not counted (small beside the projections)",
            "target": ">= 40% of the bf16 FLOP bound"}


def projection(decode: dict[str, Any]) -> dict[str, Any]:
    """Full K3 (69 KDA + 24 MLA layers) on 8 GPUs with tensor parallelism 8, from the slice's step
    times: the slice's 3:1 KDA:MLA mix is K3's (69:24), so a layer costs the slice's time / 4, and
    TP 8 divides each layer's weight and state reads by 8; plus two all-reduces per layer."""
    allreduce_s = 15e-6  # one small all-reduce over NVLink, an assumption, not a measurement
    layers = K3_KDA_LAYERS + K3_MLA_LAYERS
    rows = []
    for r in decode["rows"]:
        best = min(r["eager_ms"], r.get("graph_ms", math.inf))
        ms = best / 4 * layers / 8 + 2 * layers * allreduce_s * 1e3
        rows.append({"batch": r["batch"], "projected_step_ms": ms,
                     "projected_hbm_bound_ms": r["hbm_bound_ms"] / 4 * layers / 8})
    return {"rows": rows, "sglang_published_itl_ms": SGLANG_ITL_MS,
            "caveat": "a first-order projection (per-layer time scaled, weights split 8 ways, "
                      f"{allreduce_s * 1e6:.0f} us per all-reduce assumed, no speculative decoding); SGLang's "
                      "figure is on 8xB300 with speculative decoding at concurrency 10"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (checks the script on a CPU)")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--context", type=int, default=1024, help="cached tokens per sequence at decode")
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    report = Report(args.out)
    report.data["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    report.data["torch"] = torch.__version__
    report.save()
    if device != "cpu":
        report.step("a0_kernels", lambda: check_kernels(device))
    report.step("a_tiny_k3", lambda: check_tiny(lambda: tiny_k3(mxfp4=False), device))
    report.step("a_tiny_kimi_linear", lambda: check_tiny(tiny_kimi_linear, device))
    cfg = k3_slice_config(args.smoke)
    holder: dict[str, Any] = {}

    def build() -> dict[str, Any]:
        holder["model"], holder["dense"] = build_slice(cfg, device)
        return {"dense_weight_bytes": holder["dense"], "layers": "3 KDA + 1 MLA, all MoE",
                "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads, "experts": cfg.num_experts,
                "top_k": cfg.num_experts_per_token}

    report.step("b_build_slice", build)
    batches = [int(b) for b in args.batches.split(",")]
    iters = 3 if args.smoke else 20
    context = 64 if args.smoke else args.context
    report.step("b_decode", lambda: slice_decode(holder["model"], holder["dense"], device, batches, context, iters))
    tokens = 256 if args.smoke else args.prefill_tokens
    report.step("b_prefill", lambda: slice_prefill(holder["model"], device, tokens, 1 if args.smoke else 3))
    decode = report.data["steps"]["b_decode"]
    if decode.get("ok"):
        report.step("c_projection_k3_tp8", lambda: projection(decode))
    report.data["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    report.save()


if __name__ == "__main__":
    main()
