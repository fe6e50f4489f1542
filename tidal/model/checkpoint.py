"""Read and write Kimi-K3 / Kimi Linear safetensors checkpoints (spec §5.3, §7).

The model's state_dict names are Kimi Linear's checkpoint names. On disk, K3 prefixes every name with
``language_model.``; routed experts are stored one tensor per expert (dense, or compressed-tensors
MXFP4 ``weight_packed``/``weight_scale``) where the model stacks them; KDA ``A_log`` changes shape; tied
embeddings omit ``lm_head.weight``. :func:`expected_tensors` is the single description of that layout;
the loader checks a checkpoint against it before copying anything and names tensor and file in every
error.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import logging
import os
import re
import struct
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from tidal.config import EXPERT_FORMATS, ConfigError, ModelConfig, parse_dtype
from tidal.model.kimi import FP32_PARAMS, KimiForCausalLM
from tidal.model.layers import compute_dtype
from tidal.model.moe import PackedExperts, pack_experts
from tidal.model.mapped import MappedFiles, coalesce
from tidal.model.readahead import EarlyReads, read_ahead, read_block, read_budget
from tidal.ops.mxfp import BLOCK, E8M0_NAN, dequantize_mxfp4, quantize_mxfp4

log = logging.getLogger("tidal.load")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
K3_PREFIX = "language_model."
# K3's vision model, stored under these names without the language_model. prefix: loaded when the
# config has a vision_config, else accepted and skipped (a text-only serving of the checkpoint).
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
MXFP4 = "mxfp4-pack-quantized"
# Kept at (at least) float32 on disk. K3 also keeps its conv weights and o_norm in float32.
K3_FP32_ON_DISK = FP32_PARAMS + ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "o_norm.weight")
PROGRESS_SECONDS = 2.0

KINDS = (
    "embedding", "lm_head", "kda", "mla", "dense_mlp", "shared_experts", "routed_experts",
    "router", "norm", "attn_res", "latent_proj", "vision",
)

_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_FLOAT_ON_DISK = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


class CheckpointError(ValueError):
    """A checkpoint tidal cannot load; the message names the tensor and the file."""


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: its shape and dtype on disk and what part of the model it is.

    ``min_length``: a 1-D vector of at least ``shape[0]`` values (K3's A_log ships 128 for 96 heads)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str
    min_length: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class _Source:
    """Where a checkpoint tensor lives in the model: a state_dict entry, one expert of a stacked
    expert tensor, and which MXFP4 part ("weight" = plain tensor, "packed", "scale")."""

    param: str
    expert: int | None = None
    part: str = "weight"


# ---- the layout ----------------------------------------------------------------------------------


def expected_tensors(config: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor a checkpoint for ``config`` holds, by on-disk name (vision tensors excluded)."""
    return {name: spec for name, (spec, _) in _layout(config).items()}


def checkpoint_prefix(config: ModelConfig) -> str:
    return K3_PREFIX if config.model_type == "kimi_k3" else ""


@functools.lru_cache(maxsize=8)
def meta_model(config: ModelConfig) -> KimiForCausalLM:
    """The whole model of ``config`` on the meta device, built once per config (a build costs a
    load a tenth of a second): read its names and shapes, never change it."""
    with torch.device("meta"):
        return KimiForCausalLM(config)


_LAYOUTS: dict[ModelConfig, dict[str, tuple[TensorSpec, _Source]]] = {}


def _layout(config: ModelConfig, model: KimiForCausalLM | None = None) -> dict[str, tuple[TensorSpec, _Source]]:
    """On-disk name -> (spec, source), in model order (experts of one weight stay together); the
    last few configs' are kept. ``model``: a meta KimiForCausalLM of ``config`` (any dtype, experts
    dense) to read the names and shapes from, where the caller builds one anyway."""
    out = _LAYOUTS.get(config)
    if out is None:
        if model is None:
            model = meta_model(config)
        if len(_LAYOUTS) >= 8:
            _LAYOUTS.pop(next(iter(_LAYOUTS)))
        out = _LAYOUTS[config] = _layout_of(config, model)
    return out


def _layout_of(config: ModelConfig, model: KimiForCausalLM) -> dict[str, tuple[TensorSpec, _Source]]:
    disk = parse_dtype(config.torch_dtype)
    wide = compute_dtype(disk)
    keep_wide = K3_FP32_ON_DISK if config.model_type == "kimi_k3" else FP32_PARAMS
    prefix = checkpoint_prefix(config)
    out: dict[str, tuple[TensorSpec, _Source]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        kind = _kind(config, name)
        shape = tuple(t.shape)
        if kind == "vision":
            out[name] = (TensorSpec(shape, disk, kind), _Source(name))
            continue
        dtype = wide if any(name == k or name.endswith("." + k) for k in keep_wide) else disk
        if kind == "routed_experts":
            base = name.rsplit(".", 1)
            for e in range(shape[0]):
                stem = f"{prefix}{base[0]}.{e}.{base[1]}"
                out_f, in_f = shape[1:]
                if config.expert_format == MXFP4:
                    out[f"{stem}.weight_packed"] = (
                        TensorSpec((out_f, in_f // 2), torch.uint8, kind), _Source(name, e, "packed"))
                    out[f"{stem}.weight_scale"] = (
                        TensorSpec((out_f, in_f // BLOCK), torch.uint8, kind), _Source(name, e, "scale"))
                else:
                    out[f"{stem}.weight"] = (TensorSpec((out_f, in_f), dtype, kind), _Source(name, e))
        elif name.endswith(".A_log"):
            n = t.numel()
            if config.model_type == "kimi_k3":
                spec = TensorSpec((n,), dtype, kind, min_length=True)
            else:
                spec = TensorSpec((1, 1, *shape), dtype, kind)  # [1, 1, H, 1] (or [1, 1, 1, K])
            out[prefix + name] = (spec, _Source(name))
        else:
            out[prefix + name] = (TensorSpec(shape, dtype, kind), _Source(name))
    return out


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _kind(config: ModelConfig, name: str) -> str:
    if name.startswith(VISION_PREFIXES):
        return "vision"
    if name == "model.embed_tokens.weight":
        return "embedding"
    if name == "lm_head.weight":
        return "lm_head"
    if re.search(r"(^|\.)(self_attention|mlp|output_attn)_res_(norm|proj)\.", name):
        return "attn_res"
    m = _LAYER.match(name)
    if m and ".self_attn." in name:
        return "kda" if config.is_kda_layer(int(m.group(1))) else "mla"
    for part, kind in (
        (".block_sparse_moe.experts.", "routed_experts"),
        (".block_sparse_moe.gate.", "router"),
        (".block_sparse_moe.shared_experts.", "shared_experts"),
        (".block_sparse_moe.routed_expert_", "latent_proj"),
        (".mlp.", "dense_mlp"),
    ):
        if part in name:
            return kind
    if name == "model.norm.weight" or name.endswith("layernorm.weight"):
        return "norm"
    raise AssertionError(f"model tensor '{name}' has no checkpoint kind; teach tidal.model.checkpoint._kind")


# ---- opening a checkpoint ------------------------------------------------------------------------


@dataclass
class _Checkpoint:
    """Open safetensors handles and which file holds each tensor."""

    root: Path
    inventory: str  # the file that lists the tensors (single file or index), for messages
    handles: dict[str, Any]
    where: dict[str, str]
    on_disk: dict[str, str] = field(default_factory=dict)  # layout name -> the name in the file, where they differ
    headers: dict[str, tuple[int, dict[str, Any]]] = field(default_factory=dict)  # file -> (data start, header)
    fds: dict[str, int] = field(default_factory=dict)  # file -> descriptor, open for the whole load
    mapped: MappedFiles = field(default_factory=MappedFiles)

    def file(self, name: str) -> Path:
        return self.root / self.where[name]

    def disk_name(self, name: str) -> str:
        return self.on_disk.get(name, name)

    def slice(self, name: str) -> Any:
        return self.handles[self.where[name]].get_slice(self.disk_name(name))

    def info(self, name: str) -> tuple[int, tuple[int, ...], torch.dtype]:
        """(file offset of the data, shape, dtype) of tensor ``name`` as the file's header says."""
        start, header = self.headers[self.where[name]]
        info = header[self.disk_name(name)]
        return start + info["data_offsets"][0], tuple(info["shape"]), _ST_DTYPES[info["dtype"]]

    def view(self, name: str, shape: tuple[int, ...], dtype: torch.dtype,
             part: tuple[int, int, int] | None = None) -> torch.Tensor | None:
        """Tensor ``name`` (or its ``part`` = (dim, start, stop): a range of rows, or of a matrix's
        columns, a view with the file's row stride) as a tensor of ``shape`` and ``dtype`` that is a
        view of the file's mapping (``tidal.model.mapped``), or None where its bytes are not that
        tensor's bytes (another dtype, a part past the end, misaligned). Column ranges are 16-bit
        (as stacked experts, MAPPED_EXPERT_DTYPES) or MXFP4 codes and scales (uint8) only."""
        offset, disk_shape, disk_dtype = self.info(name)
        if disk_dtype != dtype:
            return None
        nbytes = dtype.itemsize
        for s in disk_shape:
            nbytes *= s
        path = self.root / self.where[name]
        if part is not None and part[0] == 1:
            dim, start, stop = part
            if len(disk_shape) != 2 or stop > disk_shape[1] or dtype not in (*MAPPED_EXPERT_DTYPES, torch.uint8) \
                    or tuple(shape) != (disk_shape[0], stop - start):
                return None
            isz, cols = dtype.itemsize, disk_shape[1]
            span = ((disk_shape[0] - 1) * cols + stop - start) * isz
            flat = self.mapped.view(path, offset + start * isz, span, (span // isz,), dtype)
            return None if flat is None else flat.as_strided(tuple(shape), (cols, 1))
        if part is not None:
            if part[0] != 0 or not disk_shape or part[2] > disk_shape[0]:
                return None
            row = nbytes // disk_shape[0]
            offset, nbytes = offset + part[1] * row, (part[2] - part[1]) * row
        return self.mapped.view(path, offset, nbytes, shape, dtype)

    def file_order(self, names: list[str]) -> list[str]:
        """``names`` in the order their bytes lie on disk (file, then offset): the reads then follow
        each file front to back, as ``cat`` does, and the kernel's read-ahead streams it."""
        return sorted(names, key=lambda n: (self.where[n], self.info(n)[0]))

    def read(self, name: str, where: tuple[int, int, int] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor ``name``, or its ``(dim, start, stop)`` slice (clamped to the tensor), read with
        plain file reads (``tidal.model.readahead.read_block``) into ``out`` (its dtype and element
        count) or a fresh buffer: copying out of the memory map instead would make its pages
        resident too, peak RSS twice the weights. Safe to call from several threads at once."""
        file = self.where[name]
        offset, shape, dtype = self.info(name)
        dim = lo = hi = None
        if where is not None:
            dim, lo, hi = where[0], min(where[1], shape[where[0]]), min(where[2], shape[where[0]])
        try:
            return read_block(self.root / file, offset, shape, dtype, dim, lo or 0, hi or 0, out=out, fd=self.fds[file])
        except EOFError:
            raise CheckpointError(f"tensor '{name}' in {self.root / file} ends past the end of the file") from None


def _data_start(path: Path) -> tuple[int, dict[str, Any]]:
    """(offset of the data section, header) of a safetensors file, already opened and checked."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


HEADER_THREADS = 8


def _read_headers(root: Path, files: list[str]) -> dict[str, tuple[int, dict[str, Any]]]:
    """:func:`_data_start` of every file, HEADER_THREADS at a time: a header read from a cold disk is
    a round trip of milliseconds, and one file after another they cost a checkpoint of tens of
    shards a tenth of a second or more before its first byte of data is read. A file that cannot be
    read as a header (missing, short, malformed) is left out, for ``safe_open`` to diagnose."""

    def header(file: str) -> tuple[int, dict[str, Any]] | None:
        path = root / file
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(8)
                n = struct.unpack("<Q", head)[0] if len(head) == 8 else size
                if n > size - 8:
                    return None
                parsed = json.loads(f.read(n))
            return (8 + n, parsed) if isinstance(parsed, dict) else None
        except (OSError, ValueError):
            return None

    with ThreadPoolExecutor(max(1, min(HEADER_THREADS, len(files))), thread_name_prefix="tidal-header") as pool:
        return {file: h for file, h in zip(files, pool.map(header, files)) if h is not None}


def read_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    try:
        return ModelConfig.from_file(path)
    except ConfigError as e:
        if str(path) in str(e):
            raise
        raise ConfigError(f"{path}: {e}") from None


def _diagnose(path: Path, error: Exception, names: list[str]) -> CheckpointError:
    """Explain why safetensors could not open ``path``, naming the tensors it cannot supply."""
    detail = str(error)
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            header_len = struct.unpack("<Q", raw)[0] if len(raw) == 8 else None
            size = path.stat().st_size
            if header_len is not None and 8 + header_len <= size:
                header = json.loads(f.read(header_len))
                data = size - 8 - header_len
                cut = [k for k, v in header.items() if k != "__metadata__" and v["data_offsets"][1] > data]
                if cut:
                    return CheckpointError(
                        f"{path}: truncated or corrupt safetensors file: tensor '{cut[0]}' "
                        f"({len(cut)} tensor(s) in all) ends past the end of the file ({detail})"
                    )
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
        pass
    which = f"tensor '{names[0]}'" + (f" and {len(names) - 1} more" if len(names) > 1 else "") if names else "its tensors"
    return CheckpointError(f"{path}: corrupt or truncated safetensors file, cannot read {which} ({detail})")


def _open_file(stack: contextlib.ExitStack, path: Path, names: list[str]) -> Any:
    try:
        return stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
    except Exception as e:  # safetensors raises its own error type for every malformed file
        raise _diagnose(path, e, names) from None


def checkpoint_files(root: Path) -> list[Path]:
    """The checkpoint's safetensors files in name order (the order a load reads them), from its
    index alone; [] where that cannot tell (``_open`` then names the problem)."""
    if (root / SINGLE_FILE).is_file():
        return [root / SINGLE_FILE]
    try:
        return [root / f for f in sorted(set(json.loads((root / INDEX_FILE).read_text())["weight_map"].values()))]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def _open(stack: contextlib.ExitStack, root: Path) -> _Checkpoint:
    """The checkpoint's files opened (safetensors handles for the checks, a descriptor and the
    header of each file for the reads), closed by ``stack``."""
    ckpt = _open_handles(stack, root)
    for file in ckpt.handles:
        ckpt.fds[file] = os.open(root / file, os.O_RDONLY)
        stack.callback(os.close, ckpt.fds[file])
        if file not in ckpt.headers:
            ckpt.headers[file] = _data_start(root / file)
    return ckpt


def _open_handles(stack: contextlib.ExitStack, root: Path) -> _Checkpoint:
    single, index = root / SINGLE_FILE, root / INDEX_FILE
    if single.is_file():
        handle = _open_file(stack, single, [])
        return _Checkpoint(root, SINGLE_FILE, {SINGLE_FILE: handle}, {k: SINGLE_FILE for k in handle.keys()})
    if not index.is_file():
        raise CheckpointError(f"{root}: neither {SINGLE_FILE} nor {INDEX_FILE} is there; no tensors to load")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map must map tensor names to file names")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index}: not a safetensors index with a 'weight_map' ({e})") from None
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    headers = _read_headers(root, list(by_file))  # then safe_open finds each header in the page cache
    handles = {}
    for file, names in by_file.items():
        path = root / file
        if not path.is_file():
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            raise CheckpointError(f"{path}: shard missing from disk; {index.name} puts tensor '{names[0]}'{more} there")
        handles[file] = _open_file(stack, path, names)
        present = set(handles[file].keys())
        for name in names:
            if name not in present:
                raise CheckpointError(f"tensor '{name}' is listed in {index} but absent from {path}")
        for name in present - set(names):
            if not name.startswith(VISION_PREFIXES):
                raise CheckpointError(f"unexpected tensor '{name}' in {path}: not listed in {index}")
    return _Checkpoint(root, INDEX_FILE, handles, dict(weight_map), headers=headers)


# transformers' kimi_linear renames every ``.mlp.`` to ``.block_sparse_moe.`` when it saves
# (conversion_mapping.py reverses its load-time rename), so a fine-tuned Kimi Linear checkpoint names
# the dense layers' MLP ``block_sparse_moe.{gate,up,down}_proj``. Layout name part -> on-disk part.
TRANSFORMERS_RENAMES = {"dense_mlp": (".mlp.", ".block_sparse_moe.")}


def _adopt_transformers_names(ckpt: _Checkpoint, layout: dict[str, tuple[TensorSpec, _Source]]) -> None:
    """Read a tensor under the name transformers' save_pretrained gives it when the checkpoint lacks
    the canonical name; a checkpoint holding both spellings is ambiguous and rejected."""
    for name, (spec, _) in layout.items():
        rename = TRANSFORMERS_RENAMES.get(spec.kind)
        if rename is None:
            continue
        alias = name.replace(*rename)
        if alias not in ckpt.where:
            continue
        if name in ckpt.where:
            raise CheckpointError(
                f"tensor '{name}' is in {ckpt.file(name)} and again as '{alias}' in {ckpt.file(alias)}; "
                "keep one of the two spellings"
            )
        ckpt.where[name] = ckpt.where.pop(alias)
        ckpt.on_disk[name] = alias


def _check(ckpt: _Checkpoint, config: ModelConfig, layout: dict[str, tuple[TensorSpec, _Source]]) -> None:
    """Inventory, shapes and dtypes, from the headers only, before any data is read."""
    _adopt_transformers_names(ckpt, layout)
    for name in ckpt.where:
        if name not in layout and not (config.model_type == "kimi_k3" and config.vision is None
                                       and name.startswith(VISION_PREFIXES)):
            raise CheckpointError(
                f"unexpected tensor '{name}' in {ckpt.file(name)}: not part of a {config.model_type} "
                f"model with this config.json (expert format {config.expert_format})"
            )
    for name, (spec, src) in layout.items():
        if name not in ckpt.where:
            raise CheckpointError(f"missing tensor '{name}': not in {ckpt.root / ckpt.inventory}")
        piece = ckpt.slice(name)
        shape, dtype_name = tuple(piece.get_shape()), piece.get_dtype()
        dtype = _ST_DTYPES.get(dtype_name)
        if src.part in ("packed", "scale"):
            ok_dtype = dtype == torch.uint8
        else:
            ok_dtype = dtype in _FLOAT_ON_DISK
        if not ok_dtype:
            want = "uint8" if src.part in ("packed", "scale") else "a float dtype"
            raise CheckpointError(f"tensor '{ckpt.disk_name(name)}' in {ckpt.file(name)} has dtype {dtype_name}, expected {want}")
        if spec.min_length:
            if len(shape) != 1 or shape[0] < spec.shape[0]:
                raise CheckpointError(
                    f"tensor '{ckpt.disk_name(name)}' in {ckpt.file(name)} has shape {list(shape)}, "
                    f"expected a 1-D vector of at least {spec.shape[0]} values"
                )
        elif shape != spec.shape:
            raise CheckpointError(
                f"tensor '{ckpt.disk_name(name)}' in {ckpt.file(name)} has shape {list(shape)}, expected {list(spec.shape)}"
            )


# ---- loading -------------------------------------------------------------------------------------


class _Progress:
    """A log line at most every PROGRESS_SECONDS and a final GB/s line: a long load is never silent."""

    def __init__(self, root: Path, total_tensors: int) -> None:
        self.root, self.total = root, total_tensors
        self.start = self.last = time.perf_counter()
        self.tensors = self.bytes = 0

    def add(self, t: torch.Tensor) -> None:
        self.tensors += 1
        self.bytes += t.numel() * t.element_size()
        now = time.perf_counter()
        if now - self.last >= PROGRESS_SECONDS:
            self.last = now
            log.info(
                "loading %s: %d/%d tensors, %.2f GB, %.1f s",
                self.root, self.tensors, self.total, self.bytes / 1e9, now - self.start,
            )

    def done(self) -> None:
        seconds = max(time.perf_counter() - self.start, 1e-9)
        log.info(
            "loaded %s: %d tensors, %d bytes (%.3f GB) read in %.3f s, %.3f GB/s",
            self.root, self.tensors, self.bytes, self.bytes / 1e9, seconds, self.bytes / 1e9 / seconds,
        )


@contextlib.contextmanager
def _one_thread():
    """Copies out of the memory map are bandwidth-bound: one thread runs them at memory speed, while
    torch's multi-threaded copy stalls on its thread barrier whenever another process holds a core
    (measured: 1 GB in 0.9 s with one thread, 5.4 s with two next to a busy process)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def without_gc(load: Callable[..., Any]) -> Callable[..., Any]:
    """``load`` with Python's cyclic garbage collector paused while it runs. A load allocates many
    small objects (the model's modules, the views), and when that tips the collector into a full
    collection, the collection walks every object of the process (torch's imports: hundreds of
    thousands), which costs more than the load of a small model itself. The load's own objects are
    freed by reference counting (its buffers are in no cycle); the collector resumes after it.
    ``tests/test_packed_experts.py`` bounds a load's peak resident memory with the pause on."""

    @functools.wraps(load)
    def paused(*args: Any, **kwargs: Any) -> Any:
        was = gc.isenabled()
        gc.disable()
        try:
            return load(*args, **kwargs)
        finally:
            if was:
                gc.enable()

    return paused


QUANTIZATIONS = ("mxfp4",)
# vLLM's --safetensors-load-strategy: "lazy" maps the files (a weight whose disk bytes are its bytes
# is a view of the file's pages, tidal.model.mapped), "eager" reads every weight into memory of its own.
LOAD_STRATEGIES = ("lazy", "eager")


def use_mmap_for(strategy: str) -> bool:
    """``use_mmap`` of a ``--safetensors-load-strategy``; an unknown one is an error naming the choices."""
    if strategy not in LOAD_STRATEGIES:
        raise ValueError(f"safetensors_load_strategy {strategy!r} is not supported; choose one of {list(LOAD_STRATEGIES)}")
    return strategy == "lazy"


def resolve_quantization(config: ModelConfig, quantization: str | None) -> str | None:
    """The experts' in-memory format for serving (vLLM's ``--quantization``): "mxfp4" when asked or
    when the checkpoint's ``quantization_config`` says so, else None (dense experts)."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not supported; choose one of {list(QUANTIZATIONS)}")
    if quantization == "mxfp4" and not config.num_experts:
        raise ValueError("quantization 'mxfp4' packs routed experts, and this model has none")
    if quantization is None and config.expert_format == MXFP4 and config.num_experts:
        return "mxfp4"
    return quantization


@without_gc
def load_model(
    model_dir: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
    quantization: str | None = None, use_mmap: bool = True,
) -> KimiForCausalLM:
    """Read config.json and the safetensors weights into a model in ``dtype`` (FP32_PARAMS stay at
    float32 or wider, as ``KimiForCausalLM.to_dtype``), on ``device``. The model is built on the meta
    device and each parameter is allocated once.

    ``quantization`` None: routed experts dense in ``dtype`` (MXFP4 ones dequantised exactly).
    "mxfp4": routed experts kept packed (:class:`~tidal.model.moe.PackedExperts`): an MXFP4
    checkpoint's codes and scales are copied as they are, a dense checkpoint's experts are quantised
    from their float32 values (the rounding of ``tidal quantize``); no dense copy is ever made.

    ``use_mmap`` (CPU): a weight whose bytes on disk are its bytes in memory is a view of the file's
    mapping, read into the page cache during the load (``tidal.model.mapped``); the others, and
    every weight with ``use_mmap=False``, are read into memory of their own."""
    root = Path(model_dir)
    config = read_config(root)
    device = torch.device(device)
    keep_packed = quantization is not None and resolve_quantization(config, quantization) == "mxfp4"
    with contextlib.ExitStack() as stack:
        stack.enter_context(_one_thread())
        # every file front to back, as this load reads them, from before the files are even opened
        early = EarlyReads((path, 0, path.stat().st_size) for path in checkpoint_files(root))
        stack.callback(early.close)
        ckpt = _open(stack, root)
        with torch.device("meta"):
            model = KimiForCausalLM(config)
            layout = _layout(config, model)
            model.to_dtype(dtype)
            if keep_packed:
                pack_experts(model)
        _check(ckpt, config, layout)
        targets = model.state_dict(keep_vars=True)  # before any module holds experts apart (its state_dict copies)
        apart: dict[str, torch.Tensor] = {}
        if use_mmap and device.type == "cpu" and keep_packed:
            apart = map_packed_experts(ckpt, model, _packed_experts(layout), {})
        if keep_packed:
            _materialise_packed(model, device)
        progress = _Progress(root, len(layout))
        filled: dict[str, torch.Tensor] = {}
        pending: dict[tuple[str, int], torch.Tensor] = {}  # MXFP4 half waiting for its other half
        direct: set[str] = set()
        views: dict[str, torch.Tensor] = {}
        slots: dict[str, list[int]] = {}
        if use_mmap and device.type == "cpu":
            views = _map_weights(ckpt, layout, targets, filled)
            views.update(apart)
            if not keep_packed:
                slots = map_experts(ckpt, targets, filled, views, _stacked_experts(layout), {})

        def reads() -> Iterator[tuple[str, int, Callable[[], torch.Tensor]]]:
            for name in ckpt.file_order(list(layout)):
                spec, src = layout[name]
                if name in views:  # mapped: the load reads its pages into the page cache
                    yield name, 0, views[name]
                    continue
                dest = _destination(model, targets, filled, ckpt, name, spec, src, keep_packed, device, slots)
                if dest is not None:  # read straight into the model: no buffer in flight
                    direct.add(name)
                    yield name, 0, functools.partial(ckpt.read, name, None, dest)
                else:
                    yield name, spec.nbytes, functools.partial(ckpt.read, name)

        budget = read_budget(sum(spec.nbytes for spec, _ in layout.values()))
        early.stop()
        for name, tensor in read_ahead(coalesce(reads(), ckpt.mapped), budget):  # later tensors are read while this one converts
            if isinstance(name, tuple):  # a span of mapped weights, populated
                for t in tensor:
                    progress.add(t)
                check_mapped_scales(ckpt, layout, name, tensor)
                continue
            spec, src = layout[name]
            progress.add(tensor)
            if name in direct:
                if src.part == "scale":
                    _check_scales(ckpt, name, tensor)
                continue
            if keep_packed and src.expert is not None:
                _load_packed(model, ckpt, name, src, tensor)
                continue
            target = targets[src.param]
            out = _filled(filled, src.param, target, device)
            if src.expert is None:
                if spec.min_length:
                    tensor = tensor[: spec.shape[0]]
                out.copy_(tensor.reshape(target.shape))
                continue
            at = expert_slot(slots, src.param, src.expert)
            if src.part == "weight":
                out[at].copy_(tensor)
                continue
            tensor = tensor.to(device)
            other = pending.pop((src.param, src.expert), None)
            if other is None:
                pending[(src.param, src.expert)] = tensor
                continue
            packed, scales = (tensor, other) if src.part == "packed" else (other, tensor)
            try:
                out[at].copy_(dequantize_mxfp4(packed, scales, target.dtype))
            except ValueError as e:
                scale_name = name if src.part == "scale" else name.replace(".weight_packed", ".weight_scale")
                raise CheckpointError(f"tensor '{scale_name}' in {ckpt.file(scale_name)}: {e}") from None
    _install(model, filled, slots)
    progress.done()
    return model


def _map_weights(ckpt: _Checkpoint, layout: dict[str, tuple[TensorSpec, _Source]], targets: dict[str, torch.Tensor],
                 filled: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Make every parameter whose checkpoint bytes are its bytes a view of the file's mapping, in
    ``filled``; returns checkpoint name -> view. Routed experts, which the model stacks while the
    file holds them one by one, are :func:`map_experts`'s."""
    views: dict[str, torch.Tensor] = {}
    for name, (spec, src) in layout.items():
        if src.expert is None and not spec.min_length:
            target = targets[src.param]
            view = ckpt.view(name, tuple(target.shape), target.dtype)
            if view is not None:
                views[name] = filled[src.param] = view
    return views


def _packed_experts(layout: dict[str, tuple[TensorSpec, _Source]], local: Callable[[str], tuple[int, int] | None]
                    = lambda param: None) -> dict[str, dict[str, list[tuple[str, str]]]]:
    """Experts module -> leaf (w1/w2/w3) -> (packed, scale) checkpoint names of each expert it holds
    (``local`` as :func:`_stacked_experts`'), for MXFP4 experts."""
    names: dict[tuple[str, str, int], dict[str, str]] = {}
    for name, (spec, src) in layout.items():
        if src.expert is None or src.part not in ("packed", "scale"):
            continue
        first, count = local(src.param) or (0, None)
        if src.expert < first or (count is not None and src.expert >= first + count):
            continue
        module, _, leaf = src.param.rpartition(".")
        names.setdefault((module, leaf, src.expert), {})[src.part] = name
    out: dict[str, dict[str, list[tuple[str, str]]]] = {}
    for (module, leaf, _), pair in sorted(names.items()):
        out.setdefault(module, {}).setdefault(leaf, []).append((pair["packed"], pair["scale"]))
    return out


def map_packed_experts(ckpt: _Checkpoint, model: KimiForCausalLM, experts: dict[str, dict[str, list[tuple[str, str]]]],
                       parts: dict[str, tuple[int, int, int]]) -> dict[str, torch.Tensor]:
    """Leave MXFP4 experts in the file's mapping: every PackedExperts module of ``experts`` (from
    :func:`_packed_experts`) all of whose codes and scales map holds them apart
    (``PackedExperts.use_matrices``: one view per expert and weight, wherever the file put it);
    returns checkpoint name -> view. ``parts``: checkpoint name -> the (dim, start, stop) a rank
    holds (rows of w1/w3, columns of w2); absent: all of it. A module with a tensor that does not
    map is left to the copying load."""
    out: dict[str, torch.Tensor] = {}
    for module_name, leaves in experts.items():
        module = model.get_submodule(module_name)
        if not isinstance(module, PackedExperts):
            continue
        matrices: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        views: dict[str, torch.Tensor] = {}
        for leaf, pairs in leaves.items():
            for pair in pairs:
                got = []
                for name in pair:
                    _, shape, _ = ckpt.info(name)
                    part = parts.get(name)
                    held = list(shape)
                    if part is not None:
                        held[part[0]] = part[2] - part[1]
                    view = ckpt.view(name, tuple(held), torch.uint8, part) if len(shape) == 2 else None
                    if view is None:
                        break
                    views[name] = view
                    got.append(view)
                if len(got) != 2:
                    break
                matrices.setdefault(leaf, []).append((got[0], got[1]))
        try:
            module.use_matrices(matrices)
        except ValueError:  # a tensor that did not map, or not this module's shapes
            continue
        out.update(views)
    return out


def check_mapped_scales(ckpt: _Checkpoint, layout: dict[str, tuple[TensorSpec, _Source]], names: tuple[str, ...],
                        views: tuple[torch.Tensor, ...]) -> None:
    """The scale check of :func:`_check_scales` for a span of mapped weights (after populating it)."""
    for name, view in zip(names, views):
        if layout[name][1].part == "scale":
            _check_scales(ckpt, name, view)


def _stacked_experts(layout: dict[str, tuple[TensorSpec, _Source]], local: Callable[[str], tuple[int, int] | None]
                     = lambda param: None) -> dict[str, dict[str, list[str]]]:
    """Experts module -> leaf (w1/w2/w3) -> checkpoint name of each expert it holds (``local(param)``:
    (first, count) of a rank's experts, else all), for dense experts stored one tensor each."""
    out: dict[str, dict[str, list[str]]] = {}
    for name, (spec, src) in layout.items():
        if src.expert is None or src.part != "weight":
            continue
        first, count = local(src.param) or (0, None)
        if src.expert < first or (count is not None and src.expert >= first + count):
            continue
        module, _, leaf = src.param.rpartition(".")
        out.setdefault(module, {}).setdefault(leaf, []).append(name)
    return out


def map_experts(ckpt: _Checkpoint, targets: dict[str, torch.Tensor], filled: dict[str, torch.Tensor],
                views: dict[str, torch.Tensor], experts: dict[str, dict[str, list[str]]],
                parts: dict[str, tuple[int, int, int]]) -> dict[str, list[int]]:
    """Stacked expert weights as strided views of the file's mapping, in ``filled`` (each expert's
    checkpoint name -> its matrix in ``views``); returns module -> ``Experts.slots`` where the file's
    order is not the experts' own.

    safetensors sorts a file's tensors by name, so an expert's w1, w2 and w3 lie back to back and
    the experts follow each other in the names' order (0, 1, 10, 11, ..., 2, ...).
    One weight of every expert is then a run of equal size at a constant stride: a [E, out, in] view
    with dim 0 in file order, expert e at slots[e]. Each weight (w1, w2, w3) is mapped on its own, so
    a module whose weights a shard boundary separates still maps every weight held in one file.
    ``parts``: checkpoint name -> the (dim, start, stop) a rank holds of it (rows of w1/w3, columns
    of w2 under tensor parallelism: a view with the file's row stride); absent: the whole matrix. A
    weight whose experts are not so placed (another dtype, two files, another order than the
    module's other weights) is left to the copying load, which writes expert e at slots[e] too."""
    slots_of: dict[str, list[int]] = {}
    for module, leaves in experts.items():
        order: list[int] | None = None
        plans: dict[str, tuple[str, int, int, int, int]] = {}
        for leaf, by_expert in leaves.items():
            files = {ckpt.where[n] for n in by_expert}
            if len(files) != 1:
                continue
            leaf_order = sorted(range(len(by_expert)), key=lambda e: ckpt.info(by_expert[e])[0])
            if order is not None and leaf_order != order:
                continue
            plan = _strided(ckpt, [by_expert[e] for e in leaf_order], parts, targets[f"{module}.{leaf}"])
            if plan is not None:
                order = leaf_order
                plans[leaf] = (files.pop(), *plan)
        if order is None:
            continue
        slots = [0] * len(order)
        for pos, e in enumerate(order):
            slots[e] = pos
        mapped = False
        for leaf, (file, first, stride, row_stride, run) in plans.items():
            target = targets[f"{module}.{leaf}"]
            isz = target.dtype.itemsize
            nbytes = (len(order) - 1) * stride + run
            span = ckpt.mapped.view(ckpt.root / file, first, nbytes, (nbytes // isz,), target.dtype)
            if span is None:
                continue
            view = span.as_strided((len(order), *target.shape[1:]), (stride // isz, row_stride, 1))
            filled[f"{module}.{leaf}"] = view
            for e, name in enumerate(leaves[leaf]):
                views[name] = view[slots[e]]
            mapped = True
        if mapped and order != sorted(order):
            slots_of[module] = slots
    return slots_of


def _strided(ckpt: _Checkpoint, names: list[str], parts: dict[str, tuple[int, int, int]],
             target: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(file offset of the first, stride between experts in bytes, row stride in elements, bytes one
    expert's part spans) of the experts' matrices ``names`` (in file order) as parts of ``target``
    [E, out, in], or None where they are not equal parts at one stride."""
    if target.dtype not in MAPPED_EXPERT_DTYPES:
        return None
    isz = target.dtype.itemsize
    offsets, row_stride = [], 0
    for name in names:
        offset, shape, dtype = ckpt.info(name)
        if dtype != target.dtype or len(shape) != 2:
            return None
        dim, start, stop = parts.get(name, (0, 0, shape[0]))
        held = (shape[0], stop - start) if dim else (stop - start, shape[1])
        if stop > shape[dim] or held != tuple(target.shape[1:]):
            return None
        offsets.append(offset + (start if dim else start * shape[1]) * isz)
        row_stride = shape[1]
    out_f, in_f = target.shape[1:]
    run = ((out_f - 1) * row_stride + in_f) * isz
    stride = offsets[1] - offsets[0] if len(offsets) > 1 else out_f * row_stride * isz
    if any(b - a != stride for a, b in zip(offsets, offsets[1:])) or stride < out_f * row_stride * isz \
            or stride % isz or offsets[0] % isz:
        return None
    return offsets[0], stride, row_stride, run


# Stacked experts are mapped in 16-bit dtypes only: float32 experts multiply through MKL, whose sums
# depend on the weight's address modulo 64 (measured: a mapped expert 40 bytes past a 64-byte line
# gave other float32 results than its aligned copy), and safetensors does not align tensors.
MAPPED_EXPERT_DTYPES = (torch.bfloat16, torch.float16)


def expert_slot(slots: dict[str, list[int]], param: str, expert: int) -> int:
    """Where expert ``expert`` of stacked weight ``param`` lies along its dim 0 (see map_experts)."""
    at = slots.get(param.rpartition(".")[0])
    return expert if at is None else at[expert]


def _filled(filled: dict[str, torch.Tensor], param: str, target: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The loaded tensor of model parameter ``param``, allocated (unfilled) on first use."""
    out = filled.get(param)
    if out is None:
        out = filled[param] = torch.empty(target.shape, dtype=target.dtype, device=device)
    return out


def _destination(model: KimiForCausalLM, targets: dict[str, torch.Tensor], filled: dict[str, torch.Tensor],
                 ckpt: _Checkpoint, name: str, spec: TensorSpec, src: _Source, keep_packed: bool,
                 device: torch.device, slots: dict[str, list[int]]) -> torch.Tensor | None:
    """Where checkpoint tensor ``name``'s bytes go as they are (a CPU tensor of the same dtype and
    element count: its parameter, one expert of a stacked or packed parameter), or None when they
    must be converted first (another dtype, MXFP4 to dense or dense to MXFP4, a vector cut short)."""
    if device.type != "cpu" or spec.min_length:
        return None
    on_disk = ckpt.info(name)[2]
    if src.expert is not None and keep_packed:
        if src.part == "weight":
            return None
        module_name, _, leaf = src.param.rpartition(".")
        return model.get_submodule(module_name).target(leaf, src.part)[src.expert]
    target = targets[src.param]
    if src.part != "weight" or on_disk != target.dtype:
        return None
    out = _filled(filled, src.param, target, device)
    return out if src.expert is None else out[expert_slot(slots, src.param, src.expert)]


def _check_scales(ckpt: _Checkpoint, name: str, scales: torch.Tensor) -> None:
    """MXFP4 scales as loaded: byte 255 (E8M0 NaN) is refused, naming tensor, file and index."""
    if bool((scales == E8M0_NAN).any()):
        where = tuple(int(i) for i in (scales == E8M0_NAN).nonzero()[0])
        raise CheckpointError(f"tensor '{name}' in {ckpt.file(name)}: scale byte 255 (E8M0 NaN) at index {where}")


def _materialise_packed(model: KimiForCausalLM, device: torch.device) -> None:
    """Give every PackedExperts uninitialised uint8 buffers on ``device`` (the loader fills them),
    except those holding their matrices apart (mapped)."""
    for module in model.modules():
        if isinstance(module, PackedExperts) and not module.apart:
            for name, buf in module._buffers.items():
                module._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype, device=device)


def _load_packed(model: KimiForCausalLM, ckpt: _Checkpoint, name: str, src: _Source, tensor: torch.Tensor) -> None:
    """One expert's checkpoint tensor into its PackedExperts slice: codes and scales as they are
    (scale byte 255, NaN, refused), a dense weight quantised from float32."""
    module_name, _, leaf = src.param.rpartition(".")
    experts = model.get_submodule(module_name)
    assert isinstance(experts, PackedExperts)
    if src.part == "weight":
        experts.set_expert_weights(leaf, src.expert, tensor.to(torch.float32))
        return
    if src.part == "scale":
        _check_scales(ckpt, name, tensor)
    experts.target(leaf, src.part)[src.expert].copy_(tensor)


def _install(model: KimiForCausalLM, tensors: dict[str, torch.Tensor], slots: dict[str, list[int]] | None = None) -> None:
    """Replace the meta parameters and buffers by the loaded tensors, then re-tie embeddings; each
    Experts module in ``slots`` holds its experts in that order (``Experts.slots``)."""
    for module_name, at in (slots or {}).items():
        model.get_submodule(module_name).slots = at
    for name, tensor in tensors.items():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        if leaf in module._parameters:
            module._parameters[leaf] = nn.Parameter(tensor, requires_grad=module._parameters[leaf].requires_grad)
        else:
            module._buffers[leaf] = tensor
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"tensors not covered by the checkpoint layout (still on meta): {left[:5]}")


# ---- writing -------------------------------------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _config_json(config: ModelConfig) -> dict[str, Any]:
    data = config.to_dict()
    text = data.get("text_config", data)
    data.pop("quantization_config", None)
    text.pop("quantization_config", None)
    if config.expert_format == MXFP4:
        text["quantization_config"] = {"quant_method": "compressed-tensors", "format": MXFP4}
    return data


def _shards(layout: dict[str, tuple[TensorSpec, _Source]], max_bytes: int | None) -> list[list[str]]:
    """Tensors in layout order, cut greedily so each shard stays under max_bytes (a bigger unit
    gets a shard of its own). A unit is one tensor, or all the routed experts of one layer: their
    file then lays each stacked weight's experts at one stride, which the loader maps as one view
    (``map_experts``), where a cut among them would leave that layer's experts to the copying load."""
    if max_bytes is None:
        return [list(layout)]
    units: list[list[str]] = []
    unit_of_module: dict[str, list[str]] = {}
    for name, (spec, src) in layout.items():
        if src.expert is None:
            units.append([name])
            continue
        module = src.param.rpartition(".")[0]
        if module not in unit_of_module:
            unit_of_module[module] = []
            units.append(unit_of_module[module])
        unit_of_module[module].append(name)
    shards: list[list[str]] = [[]]
    size = 0
    for unit in units:
        nbytes = sum(layout[name][0].nbytes for name in unit)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(unit)
        size += nbytes
    return shards


def save_model(
    model: KimiForCausalLM,
    out_dir: str | Path,
    *,
    expert_format: str | None = None,
    max_shard_bytes: int | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write config.json and safetensors in the layout :func:`load_model` reads: one
    ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` plus an index when
    ``max_shard_bytes`` is given. ``dtype`` (default: the model's) is the trunk dtype on disk;
    ``expert_format`` (default: the config's) "mxfp4-pack-quantized" quantises the routed experts.
    Earlier model files in out_dir are removed so the directory holds exactly one checkpoint."""
    dtype = dtype or model.dtype
    expert_format = expert_format or model.config.expert_format
    if expert_format not in EXPERT_FORMATS:
        raise ValueError(f"expert_format {expert_format!r} is not one of {EXPERT_FORMATS}")
    config = model.config.replace(expert_format=expert_format, torch_dtype=_dtype_name(dtype))
    layout = _layout(config)
    state = model.state_dict()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in [out / SINGLE_FILE, out / INDEX_FILE, *out.glob("model-*-of-*.safetensors")]:
        old.unlink(missing_ok=True)
    shards = _shards(layout, max_shard_bytes)
    files = [SINGLE_FILE] if max_shard_bytes is None else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]
    quantized: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for file, names in zip(files, shards):
        tensors = {name: _disk_tensor(model, state, quantized, *layout[name]) for name in names}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
    if max_shard_bytes is not None:
        index = {
            "metadata": {"total_size": sum(spec.nbytes for spec, _ in layout.values())},
            "weight_map": {name: file for file, names in zip(files, shards) for name in names},
        }
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(_config_json(config), indent=2))
    return out


def _disk_tensor(
    model: KimiForCausalLM, state: dict[str, torch.Tensor], quantized: dict[str, tuple[torch.Tensor, torch.Tensor]],
    spec: TensorSpec, src: _Source,
) -> torch.Tensor:
    """The on-disk tensor for one layout entry, on the CPU (expert slices are copied: safetensors
    refuses tensors that share storage).
    MXFP4 experts are quantised once per stacked weight; only the latest one is kept. Packed experts
    are written as they are (or dequantised, for a dense checkpoint)."""
    if src.param not in state and src.expert is not None:
        module_name, _, leaf = src.param.rpartition(".")
        experts = model.get_submodule(module_name)
        assert isinstance(experts, PackedExperts)
        codes, scales = (t.cpu() for t in experts.expert_matrices(leaf, src.expert))
        if src.part == "weight":
            return dequantize_mxfp4(codes, scales, spec.dtype)
        return (codes if src.part == "packed" else scales).clone()
    t = state[src.param].detach()
    if src.part == "weight":
        if src.expert is None:
            return t.reshape(spec.shape).to("cpu", spec.dtype).contiguous()
        return t[src.expert].to("cpu", spec.dtype, copy=True)
    if src.param not in quantized:
        quantized.clear()
        quantized[src.param] = tuple(x.cpu() for x in quantize_mxfp4(t))  # type: ignore[assignment]
    packed, scales = quantized[src.param]
    return (packed if src.part == "packed" else scales)[src.expert].clone()

