"""What DDP's gradient-compression hooks hand every rank, computed in one process for the simulator.

The baselines a DDP user turns on first on a slow network (``benchmarks/language_model/ddp_hooks.py`` runs the
real hooks of ``torch.distributed.algorithms.ddp_comm_hooks``); the simulator needs their math and
bytes for workers that all live in one process:

- ``fp16`` (``default_hooks.fp16_compress_hook``): every rank casts its gradient to float16, then
  divides it by the number of ranks in float16 (``buffer.to(torch.float16).div_(world_size)``, in that
  order: a gradient beyond float16's largest finite value, 65504, is infinite before the division);
  the all-reduce sums those in float16; every rank casts the sum back. :func:`fp16_mean`.
- PowerSGD (Vogels et al., NeurIPS 2019, Algorithm 1 with error feedback and warm start, as
  ``powerSGD_hook`` runs it): each gradient matrix ``M_i`` (a parameter's gradient viewed as
  ``shape[0] x rest``, plus the rank's error ``e_i``) is approximated by a rank-``r`` product
  ``P Q^T``: ``P = orth(sum_i M_i Q)`` (an all-reduce of ``n x r``), ``Q = mean_i M_i^T P`` (an
  all-reduce of ``m x r``); ``e_i = M_i - P Q^T``; ``Q`` starts the next step from this one
  (warm start). Matrices too small to gain (``(n + m) r * 2 >= n m``, torch's
  ``min_compression_rate=2``) and vectors go through a plain all-reduce of their mean. The first
  ``start_iter`` steps are plain all-reduces (DDP builds its buckets in the first one).
  :class:`PowerSGD`.

Departures from the hook, none of which changes the bytes: the hook works bucket by bucket on
flat buffers where this works tensor by tensor (the same matrices: the hook also views each
gradient as ``shape[0] x rest``); the initial ``Q`` comes from a seeded generator of this module,
not the hook's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

FLOAT16 = 2


def fp16_mean(gradients: Sequence[Sequence[Tensor]]) -> list[Tensor]:
    """``fp16_compress_hook``'s result: per parameter, ``sum_i fp16(g_i) / m`` in float16 (each term cast, then
    divided, rounded as the hook rounds it), summed in worker order, back in the gradients' dtype."""
    workers = len(gradients)
    means = []
    for parts in zip(*gradients):
        total = torch.zeros_like(parts[0], dtype=torch.float16)
        for part in parts:
            total += part.to(torch.float16, copy=True).div_(workers)
        means.append(total.to(parts[0].dtype))
    return means


def _orthogonalize(matrix: Tensor) -> Tensor:
    """Gram-Schmidt on the columns (as the hook's ``_orthogonalize`` with epsilon 0)."""
    columns = []
    for column in matrix.T:
        for previous in columns:
            column = column - (column @ previous) * previous
        columns.append(column / torch.linalg.vector_norm(column))
    return torch.stack(columns, dim=1)


def compressible(shape: torch.Size, rank: int) -> bool:
    """Whether the hook compresses a gradient of ``shape``: a matrix view that gains at least 2x at ``rank``."""
    if len(shape) < 2:
        return False
    n, m = shape[0], shape.numel() // shape[0]
    r = min(n, m, rank)
    return (n + m) * r * 2 < n * m


class PowerSGD:
    """PowerSGD across ``workers`` workers held in one process, for gradients of ``shapes``.

    Args:
        shapes: the parameters' gradient shapes, in order.
        workers: how many workers' gradients each call receives.
        rank: ``matrix_approximation_rank`` (``r``).
        start_iter: steps before compression starts (plain all-reduces until then); the hook's
            ``start_powerSGD_iter``.
        seed: seeds the initial ``Q`` of every matrix.
    """

    def __init__(self, shapes: Sequence[torch.Size], workers: int, rank: int = 1, start_iter: int = 2,
                 seed: int = 0) -> None:
        self.shapes = [torch.Size(shape) for shape in shapes]
        self.workers, self.rank, self.start_iter = workers, rank, start_iter
        self.compressed = [compressible(shape, rank) for shape in self.shapes]
        generator = torch.Generator().manual_seed(seed)
        self.q: dict[int, Tensor] = {}
        for index, shape in enumerate(self.shapes):
            if self.compressed[index]:
                n, m = shape[0], shape.numel() // shape[0]
                self.q[index] = _orthogonalize(torch.randn(m, min(n, m, rank), generator=generator))
        self.errors: dict[tuple[int, int], Tensor] = {}
        self.steps = 0

    def mean(self, gradients: Sequence[Sequence[Tensor]]) -> list[Tensor]:
        """The mean gradient every worker applies this step (``gradients[i]`` is worker ``i``'s, per parameter)."""
        self.steps += 1
        means = []
        for index, parts in enumerate(zip(*gradients)):
            if self.steps <= self.start_iter or not self.compressed[index]:
                means.append(sum(part.to(torch.float32) for part in parts).div_(self.workers).to(parts[0].dtype))
                continue
            n = parts[0].shape[0]
            matrices = [part.to(torch.float32).reshape(n, -1) + self.errors.get((index, worker), 0.0)
                        for worker, part in enumerate(parts)]
            p = _orthogonalize(sum(matrix @ self.q[index] for matrix in matrices))
            q = sum(matrix.T @ p for matrix in matrices) / self.workers
            approximation = p @ q.T
            for worker, matrix in enumerate(matrices):
                self.errors[index, worker] = matrix - approximation
            self.q[index] = q
            means.append(approximation.reshape(parts[0].shape).to(parts[0].dtype))
        return means

    def nbytes(self, dtype_bytes: int = 4) -> int:
        """Bytes the step's all-reduces reduce once compression runs: the uncompressed gradients, then every ``P``
        and every ``Q`` (each a ring all-reduce of that size)."""
        return sum(self.phase_nbytes(dtype_bytes))

    def phase_nbytes(self, dtype_bytes: int = 4) -> list[int]:
        """The bytes of the hook's three all-reduces, one after the other, once compression runs: the uncompressed
        gradients (``torch``'s ``powerSGD_hook`` all-reduces them, an empty tensor if there are none), every ``P``
        (``n x r`` per matrix), then every ``Q`` (``m x r``), computed from the reduced ``P``."""
        uncompressed = p_bytes = q_bytes = 0
        for index, shape in enumerate(self.shapes):
            if self.compressed[index]:
                n, m = shape[0], shape.numel() // shape[0]
                rank = min(n, m, self.rank)
                p_bytes, q_bytes = p_bytes + n * rank * 4, q_bytes + m * rank * 4
            else:
                uncompressed += shape.numel() * dtype_bytes
        return [uncompressed, p_bytes, q_bytes]
