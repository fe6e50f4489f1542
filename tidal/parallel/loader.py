"""Sharded loading: each rank reads only its slices of the safetensors files (``get_slice``), so no
rank reads, or holds, the whole model. Same checks as ``tidal.model.checkpoint.load_model`` (inventory,
shapes and dtypes from the headers before any data), same in-memory formats (dense or packed experts)."""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch

from tidal.model.checkpoint import (
    CheckpointError, _check, _install, _layout, _materialise_packed, _open, _one_thread, read_config,
    resolve_quantization,
)
from tidal.model.kimi import KimiForCausalLM
from tidal.model.moe import Experts, PackedExperts
from tidal.ops.mxfp import E8M0_NAN, dequantize_mxfp4
from tidal.parallel.groups import Collectives, RankPlace
from tidal.parallel.shard import build_rank_model, expert_slice, full_shapes, take, tensor_slice

log = logging.getLogger("tidal.load")


def _read(piece: object, shape: tuple[int, ...], where: tuple[int, int, int] | None) -> torch.Tensor:
    """This rank's part of one on-disk tensor through its safetensors slice (only those bytes)."""
    if where is None:
        return piece[tuple(slice(None) for _ in shape)] if shape else piece[:]  # type: ignore[index]
    dim, start, stop = where
    index = [slice(None)] * len(shape)
    index[dim] = slice(min(start, shape[dim]), min(stop, shape[dim]))
    return piece[tuple(index)]  # type: ignore[index]


def load_rank_model(
    model_dir: str | Path, place: RankPlace, comm: Collectives, dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu", quantization: str | None = None,
) -> KimiForCausalLM:
    """This rank's model (``tidal.parallel.shard.build_rank_model``) filled from ``model_dir``.
    ``quantization`` as ``load_model``'s ("mxfp4": experts packed; None: the checkpoint's format)."""
    root = Path(model_dir)
    config = read_config(root)
    layout = _layout(config)
    device = torch.device(device)
    keep_packed = resolve_quantization(config, quantization) == "mxfp4"
    with torch.device("meta"):
        model = build_rank_model(config, place, comm, packed=keep_packed).to_dtype(dtype)
    if keep_packed:
        _materialise_packed(model, device)
    targets = model.state_dict(keep_vars=True)
    shapes = full_shapes(config)
    start, nbytes = time.perf_counter(), 0
    filled: dict[str, torch.Tensor] = {}
    pending: dict[tuple[str, int], torch.Tensor] = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(_one_thread())
        ckpt = _open(stack, root)
        _check(ckpt, config, layout)
        for name, (spec, src) in layout.items():
            module_name, _, leaf = src.param.rpartition(".")
            if src.expert is not None:
                experts = model.get_submodule(module_name)
                first, count = experts.local_experts or (0, config.num_experts)
                if not first <= src.expert < first + count:
                    continue  # another rank's expert: never read
                where = expert_slice(leaf, spec.shape[1 if leaf == "w2" else 0], place)
                tensor = _read(ckpt.slice(name), spec.shape, where)
                nbytes += tensor.numel() * tensor.element_size()
                _put_expert(experts, leaf, src.expert - first, src.part, tensor, filled, pending, targets,
                            src.param, device, name, ckpt)
                continue
            target = targets[src.param]
            full_shape = shapes[src.param]
            where = tensor_slice(src.param, full_shape, config, place)
            if leaf == "A_log" or spec.min_length:  # a few floats, stored in another shape: read whole
                tensor = take(ckpt.read(name)[: spec.shape[0]].reshape(full_shape) if spec.min_length
                              else ckpt.read(name).reshape(full_shape), where)
            else:
                tensor = _read(ckpt.slice(name), spec.shape, where)
                if where is not None:  # zero-pad a vocabulary shard that runs past the end
                    tensor = take(tensor, (where[0], 0, where[2] - where[1]))
            nbytes += tensor.numel() * tensor.element_size()
            out = filled.setdefault(src.param, torch.empty(target.shape, dtype=target.dtype, device=device))
            out.copy_(tensor.reshape(target.shape))
    _install(model, filled)
    model.loaded_bytes = nbytes  # type: ignore[assignment]
    seconds = max(time.perf_counter() - start, 1e-9)
    log.info("rank %d loaded its shard of %s: %.3f GB in %.3f s, %.3f GB/s", place.rank, root, nbytes / 1e9,
             seconds, nbytes / 1e9 / seconds)
    return model


def _put_expert(experts: torch.nn.Module, leaf: str, e: int, part: str, tensor: torch.Tensor,
                filled: dict[str, torch.Tensor], pending: dict[tuple[str, int], torch.Tensor],
                targets: dict[str, torch.Tensor], param: str, device: torch.device, name: str, ckpt: object) -> None:
    """One local expert's slice into the rank's packed or dense experts."""
    if isinstance(experts, PackedExperts):
        if part == "weight":
            experts.set_expert_weights(leaf, e, tensor.to(torch.float32))
            return
        if part == "scale" and bool((tensor == E8M0_NAN).any()):
            raise CheckpointError(f"tensor '{name}' in {ckpt.file(name)}: scale byte 255 (E8M0 NaN)")  # type: ignore[attr-defined]
        experts.target(leaf, part)[e].copy_(tensor)
        return
    assert isinstance(experts, Experts)
    target = targets[param]
    out = filled.setdefault(param, torch.empty(target.shape, dtype=target.dtype, device=device))
    if part == "weight":
        out[e].copy_(tensor)
        return
    other = pending.pop((param, e), None)
    if other is None:
        pending[(param, e)] = tensor
        return
    packed, scales = (tensor, other) if part == "packed" else (other, tensor)
    out[e].copy_(dequantize_mxfp4(packed, scales, target.dtype))
