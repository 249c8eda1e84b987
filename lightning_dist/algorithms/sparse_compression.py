"""Sparse low-bit exchanges with error feedback: SparseLoCo's compression of a pseudo-gradient.

SparseLoCo (Sarfi, Thérien, Lidin and Belilovsky 2025, arXiv 2508.15706, Algorithm 1) sends, after each window of
``H`` local steps, a few entries of each rank's pseudo-gradient ``Delta_r = theta - theta_r`` instead of all of it:

- ``e_r <- beta * e_r + Delta_r``: the error-feedback accumulator, decayed by ``beta``, which stands in for
  DiLoCo's outer momentum;
- ``Delta_hat_r = Q(TopK(e_r))``: the ``k`` entries of largest magnitude of every chunk of ``e_r``, their values
  quantized to ``bits`` bits;
- ``e_r <- e_r - Delta_hat_r``: what was not sent, or sent rounded, stays for the next window;
- ``Delta = mean_r Delta_hat_r`` and ``theta <- theta - alpha * Delta``.

:class:`SparseCodec` is ``Q(TopK(.))`` with its wire format. The exchange around it is
:mod:`lightning_dist.algorithms.compression`'s, the package's int8 and bf16 exchanges' with this codec: each rank
sends each chunk owner the sparse encoding of its accumulator's chunk (``decay`` is ``beta``), each owner sums the
pieces it receives, encodes its chunk of the mean the same way (keeping what that drops as its own residual) and
sends it to every rank. That is where this departs from the paper, whose ranks all-gather their sparse updates:
an all-gather sends every rank's ``k`` entries to every other, ``(R - 1)`` times the payload per rank, which grows
with the learners (127 payloads at 128 nodes); the owners' re-encoding keeps a rank's bytes at about two payloads
whatever the number of learners, at the price of a second compression of the mean.

The wire format of a vector of ``n`` elements, cut into chunks of ``chunk`` elements (the last one shorter), each
keeping ``k = ceil(density * length)`` entries:

- the ``k`` positions of every chunk, each in ``ceil(log2(chunk))`` bits, packed end to end;
- their values: with ``bits=32`` float32 as they are; else a ``bits``-bit code per value and, per chunk, a table
  of ``2**bits`` float32 levels. A chunk that keeps at most ``2**bits`` distinct values has a level for each
  (exact); another's kept values are sorted and cut into ``2**bits`` runs of (nearly) equal count, each run's
  level the mean of its values, to which its values decode.

Where this departs from the paper's code (``tplr-ai/SparseLoCo``): its 2-bit quantizer maps values by their
distance from the mean in units of the standard deviation; equal-count runs need no such parameter and keep each
level the mean of what it stands for, so the rounding error of a chunk sums to zero. Ties in magnitude go to the
lower position (a stable sort), so every rank picks the same entries from the same values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor


SPARSE_BITS = (1, 2, 3, 4, 8, 32)
"""The value widths :class:`SparseCodec` offers: a table of ``2**bits`` levels per chunk, or float32 (32)."""


class SparseEncoded(NamedTuple):
    """One vector in :class:`SparseCodec`'s wire format: packed ``positions`` and ``codes`` (uint8), and the chunks'
    ``levels`` (float32, ``chunks x 2**bits``; with 32 bits the values themselves, one row per chunk)."""

    positions: Tensor
    codes: Tensor
    levels: Tensor

    def nbytes(self) -> int:
        """The bytes this encoding puts on the wire."""
        return sum(part.numel() * part.element_size() for part in self)


def pack_bits(values: Tensor, width: int) -> Tensor:
    """Non-negative integers below ``2**width``, ``width`` bits each, packed end to end into uint8 (last byte padded
    with zeros), least significant bit first."""
    shifts = torch.arange(width, device=values.device)
    bits = (values.to(torch.int64)[:, None] >> shifts) & 1
    flat = torch.nn.functional.pad(bits.reshape(-1), (0, -bits.numel() % 8))
    return (flat.view(-1, 8) << torch.arange(8, device=values.device)).sum(dim=1).to(torch.uint8)


def unpack_bits(packed: Tensor, width: int, count: int) -> Tensor:
    """The ``count`` integers (int64) :func:`pack_bits` packed ``width`` bits each into ``packed``."""
    bits = (packed.to(torch.int64)[:, None] >> torch.arange(8, device=packed.device)) & 1
    fields = bits.reshape(-1)[: count * width].view(count, width)
    return (fields << torch.arange(width, device=packed.device)).sum(dim=1)


@dataclass(frozen=True)
class SparseCodec:
    """``Q(TopK(.))``: per chunk of ``chunk`` elements, the ``ceil(density * length)`` entries of largest magnitude,
    their values at ``bits`` bits (see the module); a strategy's ``compression=SparseCodec(...)``.

    Args:
        density: the fraction of each chunk's entries sent, in ``(0, 1]`` (SparseLoCo: 0.01-0.03).
        bits: the width of a sent value, one of :data:`SPARSE_BITS` (SparseLoCo: 2; 32 sends float32 values).
        chunk: elements per chunk, in ``[2, 65536]`` (SparseLoCo's chunks hold 4096): the unit ``k`` is taken in, and
            what sets a position's width (``ceil(log2(chunk))`` bits).
        decay: ``beta``, what the error-feedback accumulator keeps of itself at each exchange, in ``(0, 1]``.
            Default 1: nothing not sent is lost, only delayed (classic error feedback, as the package's int8 and
            bf16 exchanges); SparseLoCo decays it (``beta < 1``), the accumulator then standing in for DiLoCo's outer
            momentum.
    """

    density: float
    bits: int = 2
    chunk: int = 4096
    decay: float = 1.0

    def __post_init__(self) -> None:
        for name, meaning in (("density", "the fraction of each chunk sent"),
                              ("decay", "what the error-feedback accumulator keeps of itself")):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                    or not 0 < value <= 1):
                raise ValueError(f"{name} must be a number in (0, 1] ({meaning}); got {value!r}")
        if self.bits not in SPARSE_BITS or isinstance(self.bits, bool):
            raise ValueError(f"bits must be one of {SPARSE_BITS} (the width of a sent value); got {self.bits!r}")
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or not 2 <= self.chunk <= 65536:
            raise ValueError(f"chunk must be an integer in [2, 65536] (elements per chunk of top-k); got "
                             f"{self.chunk!r}")

    @property
    def position_bits(self) -> int:
        return max(1, math.ceil(math.log2(self.chunk)))

    def kept(self, length: int) -> int:
        """How many entries a chunk of ``length`` elements keeps."""
        return min(length, math.ceil(self.density * length))

    def blocks(self, num_elements: int) -> list[tuple[int, int, int]]:
        """A vector of ``num_elements`` as ``(start, chunks, length)`` blocks of equal chunks: the full chunks, then
        the last, shorter one if any (each block's chunks are sorted as one matrix)."""
        full, rest = divmod(num_elements, self.chunk)
        return ([(0, full, self.chunk)] if full else []) + ([(full * self.chunk, 1, rest)] if rest else [])

    def nbytes(self, num_elements: int) -> int:
        """The bytes :meth:`encode` puts on the wire for a vector of ``num_elements``: the same for every vector of
        that size, so the byte count of an exchange is known before it runs."""
        return self.empty(num_elements, torch.device("meta")).nbytes()

    def empty(self, num_elements: int, device: torch.device | None = None) -> SparseEncoded:
        """Buffers to receive the encoding of a vector of ``num_elements`` into."""
        blocks = self.blocks(num_elements)
        kept = sum(chunks * self.kept(length) for _, chunks, length in blocks)
        chunks = sum(chunks for _, chunks, _ in blocks)
        positions = torch.empty(-(-kept * self.position_bits // 8), dtype=torch.uint8, device=device)
        if self.bits == 32:
            return SparseEncoded(positions, torch.empty(0, dtype=torch.uint8, device=device),
                                 torch.empty(kept, dtype=torch.float32, device=device))
        return SparseEncoded(positions, torch.empty(-(-kept * self.bits // 8), dtype=torch.uint8, device=device),
                             torch.empty(chunks, 2 ** self.bits, dtype=torch.float32, device=device))

    def encode(self, vector: Tensor) -> SparseEncoded:
        """``vector`` (1-D, any float dtype, finite) in the wire format."""
        if vector.dim() != 1 or vector.numel() == 0:
            raise ValueError(f"sparse compression takes a non-empty 1-D vector; got shape {tuple(vector.shape)}")
        values = vector.to(torch.float32)
        bad = (~torch.isfinite(values)).nonzero()
        if bad.numel():
            raise ValueError(f"sparse compression: the vector holds {values[bad[0, 0]].item()} at element "
                             f"{bad[0, 0].item()} (only finite values can be sent)")
        positions, codes, levels = [], [], []
        for start, chunks, length in self.blocks(values.numel()):
            matrix = values[start:start + chunks * length].view(chunks, length)
            order = torch.sort(matrix.abs(), dim=1, descending=True, stable=True).indices[:, :self.kept(length)]
            chosen = matrix.gather(1, order)  # ties in magnitude: the lower position first (stable)
            positions.append(order.reshape(-1))
            if self.bits == 32:
                levels.append(chosen.reshape(-1))
                continue
            code, level = equal_count_levels(chosen, 2 ** self.bits)
            codes.append(code.reshape(-1))
            levels.append(level)
        position_code = pack_bits(torch.cat(positions), self.position_bits)
        if self.bits == 32:
            return SparseEncoded(position_code, values.new_empty(0, dtype=torch.uint8), torch.cat(levels))
        return SparseEncoded(position_code, pack_bits(torch.cat(codes), self.bits), torch.cat(levels))

    def decode(self, encoded: SparseEncoded, num_elements: int) -> Tensor:
        """The dense float32 vector of ``num_elements`` ``encoded`` stands for (zero where nothing was sent)."""
        device = encoded.positions.device
        starts, rows = [], []
        for start, chunks, length in self.blocks(num_elements):
            first = start // self.chunk
            row = torch.arange(first, first + chunks, device=device).repeat_interleave(self.kept(length))
            rows.append(row)
            starts.append(start + (row - first) * length)
        row, start = torch.cat(rows), torch.cat(starts)
        positions = unpack_bits(encoded.positions, self.position_bits, row.numel())
        if self.bits == 32:
            values = encoded.levels
        else:
            values = encoded.levels[row, unpack_bits(encoded.codes, self.bits, row.numel())]
        dense = torch.zeros(num_elements, dtype=torch.float32, device=device)
        dense[start + positions] = values
        return dense


def equal_count_levels(values: Tensor, levels: int) -> tuple[Tensor, Tensor]:
    """Per row of ``values`` (chunks x kept): each value's code in ``[0, levels)`` and the row's ``levels``
    float32 levels. A row with at most ``levels`` distinct values gets one level per value (exact); another has its
    values sorted and cut into ``levels`` runs of (nearly) equal count, a value's code its run and a run's level
    the mean of its values. Unused levels are 0."""
    rows, kept = values.shape
    ordered, order = torch.sort(values, dim=1, stable=True)
    new_value = torch.ones_like(ordered, dtype=torch.int64)
    new_value[:, 1:] = (ordered[:, 1:] != ordered[:, :-1]).to(torch.int64)
    distinct_rank = new_value.cumsum(dim=1) - 1  # each sorted value's rank among the row's distinct values
    runs = torch.div(torch.arange(kept, device=values.device) * levels, kept, rounding_mode="floor")
    few = distinct_rank[:, -1:] < levels  # rows whose distinct values fit the levels
    code = torch.empty_like(order).scatter_(1, order, torch.where(few, distinct_rank, runs.expand(rows, kept)))
    sums = values.new_zeros(rows, levels).scatter_add_(1, code, values)
    counts = values.new_zeros(rows, levels).scatter_add_(1, code, torch.ones_like(values))
    return code, torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
