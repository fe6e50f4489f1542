"""Where each expert's MXFP4 weight rows are: the table the packed-expert kernels read.

Stacked experts hold one weight of all experts in two tensors, packed [E, N, K/2] and scales
[E, N, K/32]. A checkpoint stores every expert's w1, w2 and w3 apart (``experts.{e}.w1.weight_packed``
...), and a loader that leaves them in the file's mapping (``tidal.model.checkpoint``) has one
packed and one scale matrix per expert and weight, wherever the file put them: gate (w1) and up
(w3) with w2 between them, the experts in the names' order, a rank's experts among the others.
:class:`ExpertTable` describes both: expert e's N output rows are ``parts`` parts of N / parts rows,
part p's rows start at address ``packed[e, p]`` (scales: ``scales[e, p]``) and follow each other at
``packed_stride`` (``scale_stride``) bytes, which is longer than a row where a tensor-parallel rank
holds a range of each row's columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Matrices = tuple[torch.Tensor, torch.Tensor]  # (packed [rows, K/2], scales [rows, K/32]), uint8


@dataclass(frozen=True, eq=False)
class ExpertTable:
    """One MXFP4 weight of E experts (N output rows, K inputs) as addresses (see the module)."""

    packed: torch.Tensor  # int64 [E, parts]: address of each part's first packed row
    scales: torch.Tensor  # int64 [E, parts]: address of each part's first scale row
    rows: int  # N
    cols: int  # K
    packed_stride: int  # bytes from one packed row to the next
    scale_stride: int
    matrices: tuple[tuple[Matrices, ...], ...]  # [E][parts]: the tensors the addresses point into

    @property
    def parts(self) -> int:
        return self.packed.shape[1]

    @property
    def num_experts(self) -> int:
        return self.packed.shape[0]

    @classmethod
    def stacked(cls, packed: torch.Tensor, scales: torch.Tensor) -> "ExpertTable":
        """The table of stacked experts packed [E, N, K/2], scales [E, N, K/32] (one part each)."""
        return cls.of_parts([[(packed[e], scales[e])] for e in range(packed.shape[0])])

    @classmethod
    def of_parts(cls, experts: list[list[Matrices]]) -> "ExpertTable":
        """The table of ``experts[e][p]`` = (packed, scales) of part p of expert e: CPU uint8 matrices
        of one shape with unit column stride and one row stride; a clear error otherwise."""
        if not experts or not experts[0]:
            raise ValueError("an expert table needs at least one expert and one part")
        packed0, scales0 = experts[0][0]
        shape, scale_shape = tuple(packed0.shape), tuple(scales0.shape)
        if len(shape) != 2 or len(scale_shape) != 2 or shape[0] != scale_shape[0] or shape[1] * 2 != scale_shape[1] * 32:
            raise ValueError(f"expert matrices {list(shape)} / scales {list(scale_shape)}: expected [rows, K/2] and "
                             "[rows, K/32] uint8")
        strides = (packed0.stride(0), scales0.stride(0))
        for e, parts in enumerate(experts):
            if len(parts) != len(experts[0]):
                raise ValueError(f"expert {e} has {len(parts)} parts, expert 0 {len(experts[0])}")
            for p, (packed, scales) in enumerate(parts):
                for t, want in ((packed, shape), (scales, scale_shape)):
                    if t.dtype != torch.uint8 or t.device.type != "cpu" or tuple(t.shape) != want \
                            or (t.shape[1] > 1 and t.stride(1) != 1):
                        raise ValueError(f"expert {e} part {p}: {t.dtype} {list(t.shape)} on {t.device}, expected "
                                         f"CPU uint8 {list(want)} with unit column stride")
                if (packed.stride(0), scales.stride(0)) != strides and shape[0] > 1:
                    raise ValueError(f"expert {e} part {p}: row strides {(packed.stride(0), scales.stride(0))}, "
                                     f"expert 0 {strides}")
        return cls(
            packed=torch.tensor([[m.data_ptr() for m, _ in parts] for parts in experts], dtype=torch.int64),
            scales=torch.tensor([[s.data_ptr() for _, s in parts] for parts in experts], dtype=torch.int64),
            rows=shape[0] * len(experts[0]), cols=shape[1] * 2, packed_stride=strides[0], scale_stride=strides[1],
            matrices=tuple(tuple(parts) for parts in experts),
        )

    def __reduce__(self) -> tuple:
        """Copies and pickles rebuild the table from (copies of) its matrices: the addresses are
        this process's, of these tensors, and would point at the originals' memory."""
        return (ExpertTable.of_parts, ([list(parts) for parts in self.matrices],))

    def expert(self, e: int) -> Matrices:
        """Expert e's whole (packed [N, K/2], scales [N, K/32]), its parts one after the other (a
        copy where there are several parts)."""
        parts = self.matrices[e]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([m for m, _ in parts]), torch.cat([s for _, s in parts])
