"""A seeded random projection that keeps inner products in expectation: the count sketch.

CD-GraB's balancing only looks at inner products ``<s, d>`` of the running sum with gradient
differences (``algorithms/balancing.py``), so it can run on projected vectors: fewer bytes to
all-gather every step and a smaller running sum (paper 003, D.1.2; DESIGN 3.7). A dense Gaussian
Johnson-Lindenstrauss matrix would need ``d x k`` floats, as large as ``k`` models; the count
sketch (Charikar, Chen and Farach-Colton 2002; the sparse JL transform with one non-zero per
column) maps coordinate ``i`` to one bucket ``h(i)`` with a random sign ``sigma(i)``:
``(Px)[b] = sum_{i: h(i) = b} sigma(i) x[i]``. It stores two length-``d`` vectors, costs one
pass over ``x``, and ``E[<Px, Py>] = <x, y>``.

Reproducible on every device: each bucket is the sum of its coordinates in increasing coordinate
order, rounded after every addition. ``index_add_`` does exactly that on the host; on CUDA it adds
with atomics in whatever order threads arrive, so two runs of the same step could give different
projections, signs and example orders. Off the host the sketch therefore sorts the coordinates by
bucket once (stably) and reduces each bucket with ``torch.segment_reduce``, whose kernel walks a
segment sequentially in one thread: the same additions in the same order as the host.
"""

from __future__ import annotations

import torch
from torch import Tensor


class CountSketch:
    """Project ``d``-dimensional vectors to ``k`` dimensions; the same seed gives the same map on every rank.

    Args:
        input_dim: ``d >= 1``.
        output_dim: ``k >= 1``.
        seed: seeds the buckets and signs.
        device: where the map lives (that of the vectors to project).
    """

    def __init__(self, input_dim: int, output_dim: int, seed: int = 0, device: torch.device | str = "cpu") -> None:
        for name, value in (("input_dim", input_dim), ("output_dim", output_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        generator = torch.Generator().manual_seed(seed)
        self.input_dim = input_dim
        self.output_dim = output_dim
        self.buckets = torch.randint(output_dim, (input_dim,), generator=generator).to(device)
        self.signs = (torch.randint(2, (input_dim,), generator=generator) * 2 - 1).to(device)
        # Coordinates grouped by bucket, in increasing order within a bucket (a stable sort), and the
        # bucket sizes: what the segmented reduction off the host walks through.
        self._order = torch.sort(self.buckets, stable=True).indices
        self._sorted_signs = self.signs[self._order]
        self._lengths = torch.bincount(self.buckets, minlength=output_dim)

    def __call__(self, vectors: Tensor) -> Tensor:
        """``(..., d) -> (..., k)``."""
        if vectors.shape[-1] != self.input_dim:
            raise ValueError(f"expected vectors of length {self.input_dim}; got shape {tuple(vectors.shape)}")
        if vectors.device.type == "cpu":
            return self._project_on_host(vectors)
        return self._project_on_device(vectors)

    def _project_on_host(self, vectors: Tensor) -> Tensor:
        """``index_add_``: sequential in coordinate order on the host, and the faster of the two there."""
        out = vectors.new_zeros(*vectors.shape[:-1], self.output_dim)
        return out.index_add_(-1, self.buckets, vectors * self.signs.to(vectors.dtype))

    def _project_on_device(self, vectors: Tensor) -> Tensor:
        """The same sums without atomics: coordinates sorted by bucket, one sequential sum per bucket.

        The data is laid out ``(d, rows)`` so that the reduction's output has two dimensions: then
        ``segment_reduce`` runs its one-thread-per-segment loop (a one-dimensional output would go
        to a tree reduction, deterministic too but in another order than the host's).
        """
        rows = vectors.reshape(-1, self.input_dim)
        grouped = rows.index_select(1, self._order) * self._sorted_signs.to(vectors.dtype)
        sums = torch.segment_reduce(grouped.t().contiguous(), "sum", lengths=self._lengths, axis=0, unsafe=True)
        return sums.t().reshape(*vectors.shape[:-1], self.output_dim)
