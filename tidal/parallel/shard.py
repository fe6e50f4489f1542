"""What one rank holds: its model (the ordinary model at local widths) and its slice of each tensor.

TP divides the KDA and MLA heads, the dense and shared-expert intermediate widths and the
vocabulary; EP gives each group of TP/EP ranks E/EP routed experts, each cut along its intermediate
width into TP/EP slices; everything else (f_a/g_a, q_a/kv_a, norms, router, latent projections,
AttnRes) is replicated. The slices follow the planner's accounting (``tidal.plan.weights``).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn

from tidal.config import ModelConfig
from tidal.model.checkpoint import meta_model
from tidal.model.kimi import KimiForCausalLM
from tidal.model.moe import Experts, KimiMLP, KimiMoE, PackedExperts, pack_experts
from tidal.model.mla import KimiMLA
from tidal.parallel.dcp import DecodeContextParallel
from tidal.parallel.groups import Collectives, RankPlace
from tidal.parallel.layers import VocabParallelEmbedding, VocabParallelLMHead, all_reduce_output, vocab_shard

# Parameters cut along their output rows (dim 0) / input columns (dim 1) by TP, by module name.
TP_ROWS = {"q_proj", "k_proj", "v_proj", "g_proj", "q_conv1d", "k_conv1d", "v_conv1d", "f_b_proj", "g_b_proj",
           "b_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj"}
TP_COLS = {"o_proj", "down_proj"}
# KDA vectors with one entry per head channel (dt_bias) or per head (A_log in the "head" layout).
TP_VECTORS = {"dt_bias", "A_log"}


def rank_config(config: ModelConfig, place: RankPlace) -> ModelConfig:
    """The config a rank's attention and dense layers are built with: heads and dense intermediate
    divided by TP (so module shapes, KDA state shapes and pool sizes are this rank's)."""
    place.check(config)
    tp = place.tp_size
    return dataclasses.replace(config, num_attention_heads=config.num_attention_heads // tp,
                               kda_num_heads=config.kda_num_heads // tp, intermediate_size=config.intermediate_size // tp)


def expert_config(config: ModelConfig, place: RankPlace) -> ModelConfig:
    """The config of a rank's routed experts: E/EP experts, intermediate / (TP/EP)."""
    return dataclasses.replace(config, num_experts=config.num_experts // place.ep_size,
                               moe_intermediate_size=config.moe_intermediate_size // place.moe_tp_size)


def build_rank_model(config: ModelConfig, place: RankPlace, comm: Collectives, packed: bool = False) -> KimiForCausalLM:
    """This rank's model (parameters uninitialised: build it under ``torch.device("meta")`` and load,
    or copy a full model's slices with :func:`copy_shards`), with the collectives installed;
    ``packed``: the routed experts as :class:`PackedExperts` (MXFP4)."""
    model = KimiForCausalLM(rank_config(config, place))
    model.parallel = place  # type: ignore[assignment]
    model.full_config = config  # type: ignore[assignment]
    if place.tp_size == 1:
        return pack_experts(model) if packed else model  # type: ignore[return-value]
    tp, d = place.tp_size, config.hidden_size
    inner = model.model
    inner.embed_tokens = VocabParallelEmbedding(config.vocab_size, d, comm)
    model.lm_head = VocabParallelLMHead(d, config.vocab_size, comm)
    if config.tie_word_embeddings:
        model.lm_head.weight = inner.embed_tokens.weight
    for layer in inner.layers:
        all_reduce_output(layer.self_attn, comm)
        if isinstance(layer.self_attn, KimiMLA) and place.dcp_size > 1:
            layer.self_attn.context_parallel = DecodeContextParallel(comm)
        if hasattr(layer, "mlp"):
            all_reduce_output(layer.mlp, comm)
            continue
        moe: KimiMoE = layer.block_sparse_moe
        ec = expert_config(config, place)
        moe.experts = PackedExperts(ec) if packed else Experts(ec)
        moe.experts.local_experts = (place.ep_rank * ec.num_experts, ec.num_experts)
        if config.num_shared_experts:
            moe.shared_experts = KimiMLP(model.config, d, config.moe_intermediate_size * config.num_shared_experts // tp)
        if config.is_latent_moe:  # the latent norm needs the whole routed sum: reduce before it
            all_reduce_output(moe.experts, comm)
            if config.num_shared_experts:
                all_reduce_output(moe.shared_experts, comm)
        else:
            all_reduce_output(moe, comm)
    return model


@functools.lru_cache(maxsize=8)
def full_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape in the whole (TP 1) model."""
    return {name: tuple(t.shape) for name, t in meta_model(config).state_dict(keep_vars=True).items()}


def tensor_slice(name: str, shape: tuple[int, ...], config: ModelConfig, place: RankPlace) -> tuple[int, int, int] | None:
    """(dim, start, stop) of this rank's part of non-expert parameter ``name`` (its full shape
    ``shape``), or None when the rank holds all of it. Vocabulary shards may run past the end (the
    caller zero-pads)."""
    if place.tp_size == 1:
        return None
    parts = name.split(".")
    module, leaf = (parts[-2] if len(parts) > 1 else ""), parts[-1]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        first, rows, _ = vocab_shard(config.vocab_size, place.tp_size, place.rank)
        return 0, first, first + rows
    if ".routed_expert_" in name or ".block_sparse_moe.gate." in name:
        return None
    if leaf == "A_log" and config.kda_a_log_layout != "head":
        return None
    if leaf in TP_VECTORS or (leaf == "weight" and module in TP_ROWS):
        dim = 0
    elif leaf == "weight" and module in TP_COLS:
        dim = 1
    else:
        return None
    size = shape[dim] // place.tp_size
    return dim, place.rank * size, (place.rank + 1) * size


def take(full: torch.Tensor, where: tuple[int, int, int] | None) -> torch.Tensor:
    """``full`` narrowed to ``where`` (zero-padded past its end along that dim)."""
    if where is None:
        return full
    dim, start, stop = where
    part = full.narrow(dim, min(start, full.shape[dim]), max(0, min(stop, full.shape[dim]) - start))
    if part.shape[dim] == stop - start:
        return part
    pad = list(full.shape)
    pad[dim] = stop - start - part.shape[dim]
    return torch.cat([part, full.new_zeros(pad)], dim=dim)


def expert_slice(leaf: str, width: int, place: RankPlace) -> tuple[int, int, int]:
    """(dim, start, stop) in one expert's [out, in] tensor (dense weight, MXFP4 codes or scales,
    ``width`` = that tensor's size along the cut dim) of this rank's intermediate slice: rows of
    w1/w3, columns of w2."""
    dim = 1 if leaf == "w2" else 0
    size = width // place.moe_tp_size
    return dim, place.moe_tp_rank * size, (place.moe_tp_rank + 1) * size


@torch.no_grad()
def copy_shards(full: KimiForCausalLM, rank: KimiForCausalLM, place: RankPlace) -> KimiForCausalLM:
    """Fill ``rank`` (from :func:`build_rank_model`, its experts packed as ``full``'s are) with this
    rank's slices of the full model's tensors."""
    config: ModelConfig = full.config
    src = full.state_dict()
    out = {}
    for name, target in rank.state_dict(keep_vars=True).items():
        module_name, _, leaf = name.rpartition(".")
        owner = rank.get_submodule(module_name)
        if isinstance(owner, (Experts, PackedExperts)) and owner.local_experts is not None:
            out[name] = _expert_shard(full.get_submodule(module_name), owner, leaf, place)
        else:
            out[name] = take(src[name], tensor_slice(name, tuple(src[name].shape), config, place))
        if out[name].shape != target.shape:
            raise AssertionError(f"{name}: rank slice {tuple(out[name].shape)}, rank model {tuple(target.shape)}")
    for name, tensor in out.items():
        module_name, _, leaf = name.rpartition(".")
        module = rank.get_submodule(module_name)
        if leaf in module._parameters:
            module._parameters[leaf] = nn.Parameter(tensor.clone(), requires_grad=False)
        else:
            module._buffers[leaf] = tensor.clone()
    if config.tie_word_embeddings:
        rank.lm_head.weight = rank.model.embed_tokens.weight
    return rank


def _expert_shard(full: nn.Module, local: nn.Module, leaf: str, place: RankPlace) -> torch.Tensor:
    first, count = local.local_experts
    if isinstance(full, Experts):
        w = full.model_order(leaf)[first : first + count]
        dim, a, b = expert_slice(leaf, w.shape[2 if leaf == "w2" else 1], place)
        return w.narrow(dim + 1, a, b - a)
    part = "packed" if leaf.endswith("packed") else "scale"
    if leaf.startswith("w2"):
        t = full.weights("w2", part)[first : first + count]
        _, a, b = expert_slice("w2", t.shape[2], place)
        return t[:, :, a:b]
    halves = []
    for w in ("w1", "w3"):
        t = full.weights(w, part)[first : first + count]
        _, a, b = expert_slice(w, t.shape[1], place)
        halves.append(t[:, a:b])
    return torch.cat(halves, dim=1)
