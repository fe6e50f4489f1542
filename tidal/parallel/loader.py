"""Sharded loading: each rank reads only its slices of the safetensors files (``get_slice``), so no
rank reads, or holds, the whole model. Same checks as ``tidal.model.checkpoint.load_model`` (inventory,
shapes and dtypes from the headers before any data), same in-memory formats (dense or packed experts)."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from tidal.model.checkpoint import (
    TensorSpec, _check, _check_scales, _Checkpoint, _filled, _install, _layout, _materialise_packed, _open,
    _one_thread, _packed_experts, _Source, _stacked_experts, check_mapped_scales, expert_slot, map_experts,
    map_packed_experts, read_config, resolve_quantization, without_gc,
)
from tidal.model.kimi import KimiForCausalLM
from tidal.model.mapped import coalesce
from tidal.model.moe import Experts, PackedExperts
from tidal.model.readahead import EarlyReads, read_ahead, read_budget
from tidal.ops.mxfp import dequantize_mxfp4
from tidal.parallel.groups import Collectives, RankPlace
from tidal.parallel.shard import build_rank_model, expert_config, expert_slice, full_shapes, take, tensor_slice

log = logging.getLogger("tidal.load")


@without_gc
def load_rank_model(
    model_dir: str | Path, place: RankPlace, comm: Collectives, dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu", quantization: str | None = None,
    progress: Callable[[int], None] | None = None, use_mmap: bool = True,
) -> KimiForCausalLM:
    """This rank's model (``tidal.parallel.shard.build_rank_model``) filled from ``model_dir``.
    ``quantization`` as ``load_model``'s ("mxfp4": experts packed; None: the checkpoint's format).
    Only this rank's slices are read, on a thread ahead of the copies (``tidal.model.readahead``);
    ``progress(bytes read so far)`` after each tensor (the launcher shows one display for all ranks).
    ``use_mmap``: as ``load_model``'s (whole tensors and row ranges are views of the mapped file)."""
    root = Path(model_dir)
    config = read_config(root)
    layout = _layout(config)
    device = torch.device(device)
    keep_packed = resolve_quantization(config, quantization) == "mxfp4"
    shapes = full_shapes(config)
    start, nbytes = time.perf_counter(), 0
    filled: dict[str, torch.Tensor] = {}
    pending: dict[tuple[str, int], torch.Tensor] = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(_one_thread())
        ckpt = _open(stack, root)
        _check(ckpt, config, layout)
        wheres: dict[str, tuple[int, int, int] | None] = {}
        direct: set[str] = set()
        plan = []  # (name, where, bytes of the slice, read whole), in file order
        count = expert_config(config, place).num_experts
        first = place.ep_rank * count  # this rank's experts: first .. first + count - 1 (Experts.local_experts)
        for name in ckpt.file_order(list(layout)):
            spec, src = layout[name]
            module_name, _, leaf = src.param.rpartition(".")
            if src.expert is not None:
                if not first <= src.expert < first + count:
                    continue  # another rank's expert: never read
                where = expert_slice(leaf, spec.shape[1 if leaf == "w2" else 0], place)
            else:
                where = tensor_slice(src.param, shapes[src.param], config, place)
            wheres[name] = where
            whole = leaf == "A_log" or spec.min_length  # a few floats, stored in another shape: read whole
            part = spec.nbytes if whole or where is None else spec.nbytes * (where[2] - where[1]) // spec.shape[where[0]]
            plan.append((name, where, part, whole))
        # this rank's slices in the order it reads them, while it builds its model
        early = EarlyReads((root / file, offset, nbytes) for file, offset, nbytes in
                           (_extent(ckpt, name, None if whole else where) for name, where, _, whole in plan))
        stack.callback(early.close)
        with torch.device("meta"):
            model = build_rank_model(config, place, comm, packed=keep_packed).to_dtype(dtype)
        views: dict[str, torch.Tensor] = {}  # this rank's expert matrices mapped from the file
        slots: dict[str, list[int]] = {}

        def local(param: str) -> tuple[int, int] | None:
            return model.get_submodule(param.rpartition(".")[0]).local_experts

        parts = {name: where for name, where in wheres.items()
                 if layout[name][1].expert is not None and where is not None
                 and (where[1], where[2]) != (0, layout[name][0].shape[where[0]])}
        mapped = use_mmap and device.type == "cpu"
        targets = model.state_dict(keep_vars=True)  # before any module holds experts apart (its state_dict copies)
        if mapped and keep_packed:  # each local expert's codes and scales where the file holds them
            views = map_packed_experts(ckpt, model, _packed_experts(layout, local), parts)
        if keep_packed:
            _materialise_packed(model, device)
        if mapped and not keep_packed:
            slots = map_experts(ckpt, targets, filled, views, _stacked_experts(layout, local), parts)

        def reads() -> Iterator[tuple[str, int, Callable[[], torch.Tensor]]]:
            for name, where, part, whole in plan:
                spec, src = layout[name]
                view = None
                if use_mmap and device.type == "cpu" and src.expert is None and not whole:
                    target = targets[src.param]
                    view = ckpt.view(name, tuple(target.shape), target.dtype, where)
                if view is not None:
                    filled[src.param] = view
                view = views.get(name, view)
                if view is not None:  # mapped: the load reads its pages into the page cache
                    yield name, 0, view
                    continue
                dest = None if whole else _destination(model, targets, filled, ckpt, name, spec, src, where,
                                                       keep_packed, device, slots)
                if dest is not None:  # read straight into the rank's tensor: no buffer in flight
                    direct.add(name)
                    yield name, 0, functools.partial(ckpt.read, name, where, dest)
                else:
                    yield name, part, functools.partial(ckpt.read, name, None if whole else where)

        budget = read_budget(sum(part for _, _, part, _ in plan))
        early.stop()
        for name, tensor in read_ahead(coalesce(reads(), ckpt.mapped), budget):  # later slices are read while this one converts
            if isinstance(name, tuple):  # a span of mapped weights, populated
                nbytes += sum(t.numel() * t.element_size() for t in tensor)
                if progress is not None:
                    progress(nbytes)
                check_mapped_scales(ckpt, layout, name, tensor)
                continue
            spec, src = layout[name]
            module_name, _, leaf = src.param.rpartition(".")
            where = wheres[name]
            nbytes += tensor.numel() * tensor.element_size()
            if progress is not None:
                progress(nbytes)
            if name in direct:
                if src.part == "scale":
                    _check_scales(ckpt, name, tensor)
                continue
            if src.expert is not None:
                experts = model.get_submodule(module_name)
                first = (experts.local_experts or (0, 0))[0]
                _put_expert(experts, leaf, src.expert - first, src.part, tensor, filled, pending, targets,
                            src.param, device, name, ckpt, slots)
                continue
            target = targets[src.param]
            full_shape = shapes[src.param]
            if leaf == "A_log" or spec.min_length:
                tensor = take(tensor[: spec.shape[0]].reshape(full_shape) if spec.min_length
                              else tensor.reshape(full_shape), where)
            elif where is not None:  # zero-pad a vocabulary shard that runs past the end
                tensor = take(tensor, (where[0], 0, where[2] - where[1]))
            _filled(filled, src.param, target, device).copy_(tensor.reshape(target.shape))
    _install(model, filled, slots)
    model.loaded_bytes = nbytes  # type: ignore[assignment]
    seconds = max(time.perf_counter() - start, 1e-9)
    log.debug("rank %d loaded its shard of %s: %.3f GB in %.3f s, %.3f GB/s", place.rank, root, nbytes / 1e9,
             seconds, nbytes / 1e9 / seconds)
    return model


def _extent(ckpt: _Checkpoint, name: str, where: tuple[int, int, int] | None) -> tuple[str, int, int]:
    """(file, offset, bytes) that this rank's part ``where`` of tensor ``name`` spans in its file
    (a column range: from its first element to its last, the other columns between included)."""
    offset, shape, dtype = ckpt.info(name)
    row = dtype.itemsize
    for s in shape[1:]:
        row *= s
    if where is None or not shape:
        return ckpt.where[name], offset, row * (shape[0] if shape else 1)
    dim, lo, hi = where[0], where[1], min(where[2], shape[where[0]])
    if dim == 0:
        return ckpt.where[name], offset + lo * row, max(0, hi - lo) * row
    inner = row // shape[1]  # bytes per element of dims past 1
    return ckpt.where[name], offset + lo * inner, max(0, (shape[0] - 1) * row + (hi - lo) * inner)


def _destination(model: KimiForCausalLM, targets: dict[str, torch.Tensor], filled: dict[str, torch.Tensor],
                 ckpt: _Checkpoint, name: str, spec: TensorSpec, src: _Source, where: tuple[int, int, int] | None,
                 keep_packed: bool, device: torch.device, slots: dict[str, list[int]]) -> torch.Tensor | None:
    """Where this rank's slice of checkpoint tensor ``name`` goes as it is read (same dtype, a
    contiguous CPU tensor: its parameter, one local expert, the real rows of a vocabulary shard
    whose padding rows are zeroed here), or None when it must be converted first."""
    if device.type != "cpu":
        return None
    module_name, _, leaf = src.param.rpartition(".")
    on_disk = ckpt.info(name)[2]
    if src.expert is not None:
        experts = model.get_submodule(module_name)
        e = src.expert - (experts.local_experts or (0, 0))[0]
        if isinstance(experts, PackedExperts):
            return None if src.part == "weight" else experts.target(leaf, src.part)[e]
        out = _filled(filled, src.param, targets[src.param], device)
        return out[expert_slot(slots, src.param, e)] if src.part == "weight" and on_disk == out.dtype else None
    target = targets[src.param]
    if on_disk != target.dtype:
        return None
    out = _filled(filled, src.param, target, device)
    if where is not None and where[2] > spec.shape[where[0]]:  # a vocabulary shard past the end
        real = max(0, spec.shape[where[0]] - where[1])
        out.narrow(where[0], real, out.shape[where[0]] - real).zero_()
        return out.narrow(where[0], 0, real)
    return out


def _put_expert(experts: torch.nn.Module, leaf: str, e: int, part: str, tensor: torch.Tensor,
                filled: dict[str, torch.Tensor], pending: dict[tuple[str, int], torch.Tensor],
                targets: dict[str, torch.Tensor], param: str, device: torch.device, name: str, ckpt: object,
                slots: dict[str, list[int]]) -> None:
    """One local expert's slice into the rank's packed or dense experts (dense: at its slot)."""
    if isinstance(experts, PackedExperts):
        if part == "weight":
            experts.set_expert_weights(leaf, e, tensor.to(torch.float32))
            return
        if part == "scale":
            _check_scales(ckpt, name, tensor)  # type: ignore[arg-type]
        experts.target(leaf, part)[e].copy_(tensor)
        return
    assert isinstance(experts, Experts)
    out = _filled(filled, param, targets[param], device)
    e = expert_slot(slots, param, e)
    if part == "weight":
        out[e].copy_(tensor)
        return
    other = pending.pop((param, e), None)
    if other is None:
        pending[(param, e)] = tensor
        return
    packed, scales = (tensor, other) if part == "packed" else (other, tensor)
    out[e].copy_(dequantize_mxfp4(packed, scales, out.dtype))
