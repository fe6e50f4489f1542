"""Tensor, expert and decode-context parallelism: real rank processes joined by gloo, against TP 1 on
the same checkpoint (tiny K3: AttnRes, latent MoE, MXFP4 experts; tiny Kimi Linear).

The engine runs SPMD on every rank (same scheduler decisions, logits gathered over the vocabulary,
so every rank samples the same token): greedy tokens must equal TP 1's and prompt logprobs stay
within 1e-3 (float32; the all-reduce order changes the sums), through chunked prefills, decodes,
preemptions, prefix-cache hits and an abort, with each rank's pool back to its start afterwards."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import parallel_ranks as pr  # noqa: E402
from memory_maps import mapped_ranges  # noqa: E402
from tidal.model.checkpoint import load_model  # noqa: E402
from tidal.parallel.groups import Collectives, RankPlace  # noqa: E402
from tidal.parallel.launch import run_ranks  # noqa: E402
from tidal.parallel.loader import load_rank_model  # noqa: E402
from tidal.parallel.shard import build_rank_model, copy_shards  # noqa: E402
from tidal.plan.weights import weight_breakdown  # noqa: E402

# (checkpoint, tp, ep, dcp)
LAYOUTS = [(2, 1, 1), (2, 2, 1), (2, 1, 2), (4, 1, 2)]  # the TP 2, TP 2 + EP 2, TP 2 + DCP 2, TP 4 + DCP 2
ENGINE_LAYOUTS = [(kind, *lay) for kind in ("k3", "kl") for lay in LAYOUTS]
DCP_LAYOUTS = [("k3", 2, 1, 2), ("kl", 4, 2, 4)]
ALL = sorted({lay for lay in ENGINE_LAYOUTS + DCP_LAYOUTS})


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("parallel")
    return {kind: str(pr.make_checkpoint(kind, root / kind)) for kind in ("k3", "kl")}


def _solo(place: RankPlace) -> Collectives:
    return Collectives(place, None, None)  # loading and slicing need no process group


@pytest.mark.parametrize("layout", ALL)
def test_sharded_load_reads_only_its_slices(ckpts, layout) -> None:
    """Each rank's tensors, read through safetensors slices, equal the same slices of the whole
    loaded model; the ranks together read each routed expert once, and no rank the whole model."""
    kind, tp, ep, dcp = layout
    full = load_model(ckpts[kind], torch.float32, quantization="mxfp4" if kind == "k3" else None)
    packed = kind == "k3"
    read = []
    for rank in range(tp):
        place = RankPlace(rank, tp, ep, dcp)
        got = load_rank_model(ckpts[kind], place, _solo(place), torch.float32)
        want = copy_shards(full, build_rank_model(full.config, place, _solo(place), packed=packed), place)
        w, g = want.state_dict(), got.state_dict()
        assert w.keys() == g.keys()
        for name in w:
            assert torch.equal(w[name], g[name]), (rank, name)
        read.append(got.loaded_bytes)
        per_rank = sum(s.per_rank_bytes for s in weight_breakdown(full.config, tp_size=tp, ep_size=ep))
        held = sum(t.numel() * t.element_size() for t in [*got.parameters(), *got.buffers()])
        assert held == per_rank, "the planner's per-rank weight bytes are what a rank holds"
    whole = sum(t.numel() * t.element_size() for t in [*full.parameters(), *full.buffers()])
    assert max(read) < whole


@pytest.mark.parametrize("kind", ["k3", "kl"])
def test_sharded_load_into_place_and_converted_agree_with_a_padded_vocabulary(tmp_path, kind) -> None:
    """A vocabulary TP 4 does not divide (250 = 3 x 63 + 61) and a float32 checkpoint: every rank's
    tensors equal the full model's slices both where the slices are read straight into the rank's
    tensors (float32 model: the last rank's two padding rows zeroed) and where they are converted
    (bfloat16 model, through a buffer)."""
    from tidal.config import ModelConfig
    from tidal.model.init import init_weights
    from tidal.model.kimi import KimiForCausalLM
    from tidal.model.checkpoint import save_model

    d = pr.tiny_config(kind).to_dict()
    d.get("text_config", d)["vocab_size"] = 250
    config = ModelConfig.from_dict(d)
    assert config.vocab_size == 250
    save_model(init_weights(KimiForCausalLM(config), seed=1), tmp_path, dtype=torch.float32, max_shard_bytes=1 << 20)
    packed = kind == "k3"
    for dtype in (torch.float32, torch.bfloat16):
        full = load_model(tmp_path, dtype, quantization="mxfp4" if packed else None)
        for rank in range(4):
            place = RankPlace(rank, 4, 2, 1)
            got = load_rank_model(tmp_path, place, _solo(place), dtype).state_dict()
            want = copy_shards(full, build_rank_model(full.config, place, _solo(place), packed=packed), place)
            for name, w in want.state_dict().items():
                assert w.dtype == got[name].dtype and torch.equal(w, got[name]), (dtype, rank, name)
        tail = load_rank_model(tmp_path, RankPlace(3, 4, 2, 1), _solo(RankPlace(3, 4, 2, 1)), dtype)
        assert torch.equal(tail.model.embed_tokens.weight[61:], torch.zeros(2, config.hidden_size, dtype=dtype))


def _many_experts(tmp_path: Path) -> Path:
    """A bfloat16 tiny Kimi Linear with 12 experts: the file holds them in the names' order."""
    from tidal.config import ModelConfig
    from tidal.model.checkpoint import save_model
    from tidal.model.init import init_weights
    from tidal.model.kimi import KimiForCausalLM

    d = pr.tiny_config("kl").to_dict()
    d.get("text_config", d)["num_experts"] = 12
    config = ModelConfig.from_dict(d)
    return save_model(init_weights(KimiForCausalLM(config), seed=2).to_dtype(torch.bfloat16), tmp_path)


FILE_ORDER = [0, 1, 4, 5, 6, 7, 8, 9, 10, 11, 2, 3]  # slots of experts 0..11 (experts.10 sorts third)


def test_rank_experts_mapped_in_file_order_equal_the_copying_load(tmp_path) -> None:
    """bfloat16, 12 experts. TP 2: each rank's gate and up rows of every expert, and its column half
    of the down projection (a view with the file's row stride), are strided views of the file
    (Experts.slots in file order), and so are the column halves of the row-parallel o_proj and
    down_proj; TP 2 + EP 2: a rank's experts are not evenly spaced in the file and are copied.
    Each rank's state_dict equals the copying load's, and on two gloo ranks the logits of prefills,
    chunked prefills and decodes equal the copying load's exactly."""
    from tidal.model.moe import Experts

    ckpt = _many_experts(tmp_path)
    files = [ckpt / "model.safetensors"]
    for tp, ep in ((2, 1), (2, 2)):
        for rank in range(tp):
            place = RankPlace(rank, tp, ep, 1)
            mapped = load_rank_model(ckpt, place, _solo(place), torch.bfloat16)
            copied = load_rank_model(ckpt, place, _solo(place), torch.bfloat16, use_mmap=False)
            m, c = mapped.state_dict(), copied.state_dict()
            assert m.keys() == c.keys() and all(torch.equal(m[k], c[k]) for k in m), (tp, ep, rank)
            ranges = mapped_ranges(files)
            for experts in (x for x in mapped.modules() if isinstance(x, Experts)):
                in_file = [any(lo <= w.data_ptr() < hi for lo, hi in ranges) for w in (experts.w1, experts.w3, experts.w2)]
                if ep == 1:
                    assert experts.slots == FILE_ORDER and in_file == [True, True, True], (tp, ep, rank)
                    assert not experts.w2.is_contiguous()  # the file's rows, this rank's columns
                else:
                    assert experts.slots is None and not any(in_file), (tp, ep, rank)
            columns = [m.weight for n, m in mapped.named_modules() if n.endswith(("o_proj", "down_proj"))]
            assert columns and all(any(lo <= w.data_ptr() < hi for lo, hi in ranges) for w in columns)
    for result in run_ranks(pr.mapped_and_copied_program, tp_size=2, args=(str(ckpt),), timeout_s=600):
        assert result["equal"] == [True] * 4 and all(s == FILE_ORDER for s in result["slots"]), result


def test_rank_packed_experts_mapped_equal_the_copying_load(ckpts) -> None:
    """MXFP4 experts (tiny K3, 8 experts). TP 2 and TP 2 + EP 2: every local expert's codes and scales
    stay in the file's mapping (PackedExperts held apart: rows of w1/w3, the file's rows and this
    rank's columns of w2; under EP only the rank's own experts, which the file does not space
    evenly), each rank's state_dict equals the copying load's, and on two gloo ranks (TP 2 + EP 2)
    the logits of prefills, chunked prefills and decodes equal the copying load's exactly."""
    from tidal.model.moe import PackedExperts

    files = [Path(ckpts["k3"]) / "model.safetensors"]
    for tp, ep in ((2, 1), (2, 2)):
        for rank in range(tp):
            place = RankPlace(rank, tp, ep, 1)
            mapped = load_rank_model(ckpts["k3"], place, _solo(place), torch.float32)
            copied = load_rank_model(ckpts["k3"], place, _solo(place), torch.float32, use_mmap=False)
            m, c = mapped.state_dict(), copied.state_dict()
            assert m.keys() == c.keys() and all(torch.equal(m[k], c[k]) for k in m), (tp, ep, rank)
            ranges = mapped_ranges(files)
            experts = [x for x in mapped.modules() if isinstance(x, PackedExperts)]
            assert experts and all(x.apart for x in experts)
            assert not any(x.apart for x in copied.modules() if isinstance(x, PackedExperts))
            for x in experts:
                first, count = x.local_experts
                assert count == 8 // ep and first == place.ep_rank * count
                held = [x.expert_matrices(leaf, e) for leaf in ("w1", "w2", "w3") for e in range(count)]
                assert all(any(lo <= t.data_ptr() < hi for lo, hi in ranges) for pair in held for t in pair)
                if ep == 1:  # each expert cut in two: the file's rows, this rank's columns
                    assert not x.expert_matrices("w2", 0)[0].is_contiguous()
    # TP 2 alone (each expert's w2 columns a view with the file's row stride) runs in the engine test
    for result in run_ranks(pr.mapped_and_copied_program, tp_size=2, ep_size=2, args=(ckpts["k3"],), timeout_s=600):
        assert result["equal"] == [True] * 4 and result["apart"] and all(result["apart"]), result


def _close(ref: dict, got: dict, where: str) -> None:
    assert got["tokens"] == ref["tokens"], where
    worst = 0.0
    for rid, lps in ref["prompt_logprobs"].items():
        assert len(got["prompt_logprobs"][rid]) == len(lps), (where, rid)
        for a, b in zip(lps, got["prompt_logprobs"][rid]):
            if a is not None:
                worst = max(worst, abs(a - b))
    assert worst < 1e-3, (where, worst)


@pytest.fixture(scope="module")
def ranks(ckpts) -> list[dict]:
    """Four rank processes run every layout (one start-up for all)."""
    return run_ranks(pr.layouts_program, tp_size=4, world_size=4, args=(ckpts, ENGINE_LAYOUTS, DCP_LAYOUTS),
                     timeout_s=900)


def test_engine_on_ranks_equals_tp1(ckpts, ranks) -> None:
    refs = {kind: pr.rank_program(RankPlace(0), _solo(RankPlace(0)), path) for kind, path in ckpts.items()}
    assert refs["k3"]["preemptions"] > 0 and refs["k3"]["prefix_hits"] > 0
    assert refs["kl"]["prefix_hits"] > 0
    assert {(tp, ep, dcp) for kind, tp, ep, dcp in ENGINE_LAYOUTS if kind == "kl"} == set(LAYOUTS)
    for i, (kind, tp, ep, dcp) in enumerate(ENGINE_LAYOUTS):
        for rank in range(tp):
            got = ranks[rank]["engine"][i]
            where = f"{kind} tp{tp} ep{ep} dcp{dcp} rank {rank}"
            _close(refs[kind], got, where)
            assert got["pool_back_to_start"], where
            assert got["preemptions"] + got["prefix_hits"] > 0, where
            # the planner's per-rank pool: what the rank allocated, its KDA state 1/tp of TP 1's
            assert got["pool_buffer_bytes"] == got["num_blocks"] * got["block_bytes"], where
            assert got["state_bytes"] * tp == refs[kind]["state_bytes"], where
            # DCP: each rank stores 1/dcp of every page's tokens, so the same blocks hold dcp x the
            # logical context of a TP-only rank with the same state size
            assert got["stored_page_size"] * dcp == got["logical_page_size"] == pr.PAGE * dcp, where


def test_dcp_forward_on_ranks_equals_tp1(ckpts, ranks) -> None:
    """DCP: each rank holds 1/dcp of the MLA latents (none of a 1-token request on ranks past the
    first) and the merged attention gives TP 1's logits, through prefill chunks next to decodes."""
    refs = {kind: pr.forward_program(RankPlace(0), _solo(RankPlace(0)), path) for kind, path in ckpts.items()}
    for i, (kind, tp, ep, dcp) in enumerate(DCP_LAYOUTS):
        for rank in range(tp):
            for step, (want, got) in enumerate(zip(refs[kind], ranks[rank]["forward"][i])):
                err = float((want - got).abs().max())
                assert err < 1e-3, (kind, tp, ep, dcp, rank, step, err)
                assert torch.equal(want.argmax(-1), got.argmax(-1))


def test_rank_slice_extents_are_the_bytes_its_views_span(tmp_path) -> None:
    """What a rank asks the disk for ahead of its model build (loader._extent): a whole tensor, a row
    range, and a column range from its first element to its last (the other columns between)."""
    import contextlib

    from safetensors.torch import save_file

    from tidal.model.checkpoint import _open
    from tidal.parallel.loader import _extent

    save_file({"a": torch.zeros(3, dtype=torch.bfloat16), "w": torch.zeros(4, 6, dtype=torch.bfloat16)},
              str(tmp_path / "model.safetensors"))
    with contextlib.ExitStack() as stack:
        ckpt = _open(stack, tmp_path)
        offset = ckpt.info("w")[0]
        assert _extent(ckpt, "w", None) == ("model.safetensors", offset, 48)
        assert _extent(ckpt, "w", (0, 1, 3)) == ("model.safetensors", offset + 12, 24)
        assert _extent(ckpt, "w", (0, 2, 9)) == ("model.safetensors", offset + 24, 24)  # clamped to the rows
        assert _extent(ckpt, "w", (1, 2, 5)) == ("model.safetensors", offset + 4, (3 * 6 + 3) * 2)
        view = ckpt.view("w", (4, 3), torch.bfloat16, (1, 2, 5))
        base = ckpt.view("w", (4, 6), torch.bfloat16).data_ptr() - offset
        from tidal.model.mapped import extent
        lo, hi = extent(view)
        assert (lo - base, hi - lo) == _extent(ckpt, "w", (1, 2, 5))[1:]
