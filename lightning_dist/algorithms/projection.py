"""A seeded random projection that keeps inner products in expectation: the count sketch.

CD-GraB's balancing only looks at inner products ``<s, d>`` of the running sum with gradient
differences (``algorithms/balancing.py``), so it can run on projected vectors: fewer bytes to
all-gather every step and a smaller running sum (paper 003, D.1.2; DESIGN 3.7). A dense Gaussian
Johnson-Lindenstrauss matrix would need ``d x k`` floats, as large as ``k`` models; the count
sketch (Charikar, Chen and Farach-Colton 2002; the sparse JL transform with one non-zero per
column) maps coordinate ``i`` to one bucket ``h(i)`` with a random sign ``sigma(i)``:
``(Px)[b] = sum_{i: h(i) = b} sigma(i) x[i]``. It stores two length-``d`` vectors, costs one
pass over ``x``, and ``E[<Px, Py>] = <x, y>``.
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

    def __call__(self, vectors: Tensor) -> Tensor:
        """``(..., d) -> (..., k)``."""
        if vectors.shape[-1] != self.input_dim:
            raise ValueError(f"expected vectors of length {self.input_dim}; got shape {tuple(vectors.shape)}")
        out = vectors.new_zeros(*vectors.shape[:-1], self.output_dim)
        return out.index_add_(-1, self.buckets, vectors * self.signs.to(vectors.dtype))
