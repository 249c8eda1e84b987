"""Online pair balancing and example reordering of CD-GraB (paper 003; DESIGN section 3.7).

Plain torch, no process groups: the ``CDGraB`` callback, the herding-bound benchmark and the
simulator call these functions with whatever vectors they have.

Vocabulary. ``m`` ranks (paper: ``m`` workers) each read ``n`` local examples per epoch in an
order given by a permutation. Consecutive examples on a rank form pairs ``(2i, 2i+1)`` of that
order; a pair's *difference* is ``g_a - g_b`` of their (stale) per-example gradients. Online
pair balancing (paper 003, Algorithm 2, with the deterministic greedy sign rule of Lu et al.'s
GraB, their Algorithm 5, which paper 003 says it uses in practice) walks over the differences
in a fixed order, pair-major then rank (``d(pair 1, rank 1), d(pair 1, rank 2), ...``), with
one running sum ``s`` shared by all ranks; each difference gets sign ``+1`` if
``||s + d|| <= ||s - d||`` and ``s`` becomes ``s + sign * d``. Reordering (paper 003,
Algorithm 1 applied to pairs): a pair with sign ``+1`` sends its first example to the rank's
front list and its second to the back list, ``-1`` the other way round; the next epoch's order
is the front list followed by the reversed back list.

``ID-GraB`` (independent balancing, the paper's ablation) is the same code with one running sum
per rank, i.e. a :class:`PairBalancer` per rank over its own differences only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_dist.algorithms.arguments import check_count


def balance_signs_(running_sum: Tensor, differences: Tensor) -> Tensor:
    """Greedy signs for ``differences`` (``(k, d)``, in balancing order); updates ``running_sum`` in place.

    Sign ``+1`` iff ``||s + d|| <= ||s - d||``, i.e. iff ``<s, d> <= 0`` (the two are equal in exact
    arithmetic; the inner product is the cheaper form). Ties, including ``s = 0`` at the start of
    an epoch, go to ``+1`` as in the reference code. The loop has no host synchronisation: on a GPU
    the signs stay on the device and the kernels queue without waiting.

    Returns:
        ``(k,)`` int8 tensor of ``+1`` / ``-1`` on ``differences.device``.
    """
    if differences.dim() != 2 or running_sum.dim() != 1 or differences.shape[1] != running_sum.shape[0]:
        raise ValueError(
            f"differences must be (k, d) and running_sum (d,); got {tuple(differences.shape)} and "
            f"{tuple(running_sum.shape)}"
        )
    if differences.dtype != running_sum.dtype or differences.device != running_sum.device:
        raise ValueError(
            f"differences ({differences.dtype} on {differences.device}) must match running_sum's dtype and device "
            f"({running_sum.dtype} on {running_sum.device})"
        )
    if differences.device.type == "cpu":
        return _balance_on_host_(running_sum, differences)
    return _balance_on_device_(running_sum, differences)


def _balance_on_host_(running_sum: Tensor, differences: Tensor) -> Tensor:
    """The greedy loop with a Python branch, on NumPy views of the tensors.

    On small models the loop's cost is the per-operation overhead, not arithmetic; NumPy's is a
    fraction of torch's. ``running_sum`` is updated through a view that shares its memory.
    """
    total = running_sum.detach().numpy()
    rows = np.ascontiguousarray(differences.detach().numpy())
    signs = np.empty(rows.shape[0], dtype=np.int8)
    for index, row in enumerate(rows):
        if np.dot(total, row) > 0:
            total -= row
            signs[index] = -1
        else:
            total += row
            signs[index] = 1
    return torch.from_numpy(signs)


def _balance_on_device_(running_sum: Tensor, differences: Tensor) -> Tensor:
    """The same loop without reading any value back, so an accelerator never waits for the host."""
    signs = torch.empty(differences.shape[0], dtype=torch.int8, device=differences.device)
    for index, difference in enumerate(differences):
        # 1 - 2 * [<s, d> > 0]: +1 on ties.
        sign = 1 - 2 * (torch.dot(running_sum, difference) > 0).to(running_sum.dtype)
        running_sum.add_(difference * sign)
        signs[index] = sign.to(torch.int8)
    return signs


def reorder_positions(signs: Tensor) -> Tensor:
    """Next epoch's order, as positions in this epoch's order, from one rank's pair signs.

    ``signs[i]`` belongs to the pair at positions ``(2i, 2i+1)``. The first element of the pair
    goes to the front list when the sign is ``+1`` and to the back list when ``-1``; the other
    element the other way. Result: front list, then back list reversed (paper 003, Algorithm 1).
    For ``n`` positions the result is a permutation of ``range(2 * len(signs))``.
    """
    if signs.dim() != 1:
        raise ValueError(f"signs must be one-dimensional; got shape {tuple(signs.shape)}")
    first = torch.arange(0, 2 * signs.numel(), 2, device=signs.device)
    positive = signs > 0
    front = torch.where(positive, first, first + 1)
    back = torch.where(positive, first + 1, first)
    return torch.cat([front, back.flip(0)])


def parallel_herding_bound(vectors: Tensor, norm: float = float("inf")) -> float:
    """Paper 003, eq. 8: ``max_k || sum_{t <= k} sum_j z[t, j] ||`` for ``vectors`` of shape ``(n, m, d)``.

    ``vectors[t, j]`` is the ``t``-th vector in rank ``j``'s order; the prefix sums run over
    positions, summed across all ranks at each position. ``norm`` is the vector norm (``inf`` as
    in the herding literature and the reference simulation; ``2`` for the Euclidean one).
    """
    if vectors.dim() != 3:
        raise ValueError(f"vectors must be (n positions, m ranks, d); got shape {tuple(vectors.shape)}")
    prefix = vectors.sum(dim=1).cumsum(dim=0)
    return float(torch.linalg.vector_norm(prefix, ord=norm, dim=1).max())


class PairBalancer:
    """Online pair balancing over one epoch for ``ranks`` ranks sharing one running sum.

    Feed it the differences of each step with :meth:`step` (``(pairs, ranks, d)``, pairs in the
    order of the ranks' current epoch order); after the epoch's ``examples_per_rank / 2`` pairs,
    :meth:`next_positions` gives each rank's next order as positions in its current order, and
    :meth:`start_epoch` resets the sum for the next epoch (the reference code zeroes it at every
    epoch; no stale mean is carried over, which is the point of pair balancing).

    ``ranks = m`` is CD-GraB's coordinated balancer (run by the order server, rank 0, in the
    callback); ``ranks = 1`` on each rank's own differences is ID-GraB's independent one.

    Args:
        ranks: ranks whose differences share the running sum, ``>= 1``.
        examples_per_rank: examples each rank reads per epoch; even (pairs), ``>= 2``.
        dim: length of the difference vectors (the model's parameter count, or the projection's).
        dtype: of the running sum (the differences' dtype).
        device: of the running sum (the differences' device).
    """

    def __init__(
        self,
        ranks: int,
        examples_per_rank: int,
        dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value, minimum in (("ranks", ranks, 1), ("examples_per_rank", examples_per_rank, 2), ("dim", dim, 1)):
            check_count(name, value, minimum)
        if examples_per_rank % 2:
            raise ValueError(f"examples_per_rank must be even (examples are balanced in pairs); got {examples_per_rank}")
        self.ranks = ranks
        self.examples_per_rank = examples_per_rank
        self.running_sum = torch.zeros(dim, dtype=dtype, device=device)
        self.signs = torch.zeros(examples_per_rank // 2, ranks, dtype=torch.int8, device=device)
        self.pairs_done = 0

    @property
    def pairs_per_epoch(self) -> int:
        return self.examples_per_rank // 2

    @property
    def epoch_complete(self) -> bool:
        return self.pairs_done == self.pairs_per_epoch

    def start_epoch(self) -> None:
        """Forget the previous epoch: zero running sum, no signs."""
        self.running_sum.zero_()
        self.signs.zero_()
        self.pairs_done = 0

    def step(self, differences: Tensor) -> Tensor:
        """Balance the next ``pairs`` pairs of every rank; ``differences`` is ``(pairs, ranks, d)``.

        Returns their signs, ``(pairs, ranks)``.
        """
        if differences.dim() != 3 or differences.shape[1] != self.ranks or differences.shape[2] != self.running_sum.numel():
            raise ValueError(
                f"differences must be (pairs, {self.ranks}, {self.running_sum.numel()}); got {tuple(differences.shape)}"
            )
        pairs = differences.shape[0]
        if self.pairs_done + pairs > self.pairs_per_epoch:
            raise ValueError(
                f"an epoch has {self.pairs_per_epoch} pairs per rank; {self.pairs_done} were balanced and {pairs} more "
                "do not fit (a rank read more examples than its sampler holds)"
            )
        # Pair-major, then rank: (pairs, ranks, d) flattens to exactly that order.
        signs = balance_signs_(self.running_sum, differences.reshape(-1, differences.shape[2])).view(pairs, self.ranks)
        self.signs[self.pairs_done : self.pairs_done + pairs] = signs
        self.pairs_done += pairs
        return signs

    def next_positions(self) -> Tensor:
        """``(ranks, examples_per_rank)``: each rank's next order as positions in its current order."""
        if not self.epoch_complete:
            raise RuntimeError(
                f"the epoch is not complete: {self.pairs_done} of {self.pairs_per_epoch} pairs per rank were balanced"
            )
        return torch.stack([reorder_positions(self.signs[:, rank]) for rank in range(self.ranks)])

    def state_dict(self) -> dict[str, Any]:
        return {"running_sum": self.running_sum.clone(), "signs": self.signs.clone(), "pairs_done": self.pairs_done}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["signs"].shape != self.signs.shape or state["running_sum"].shape != self.running_sum.shape:
            raise ValueError(
                f"the balancer state is for {tuple(state['signs'].shape)} pairs x ranks and a {state['running_sum'].numel()}-d "
                f"sum; this balancer has {tuple(self.signs.shape)} and {self.running_sum.numel()}"
            )
        self.running_sum.copy_(state["running_sum"])
        self.signs.copy_(state["signs"])
        self.pairs_done = int(state["pairs_done"])


def balance_epoch(vectors: Tensor, coordinated: bool = True) -> Tensor:
    """One epoch of balancing on stored vectors; returns the next order, ``(n, m)`` positions.

    ``vectors`` is ``(n, m, d)``: rank ``j``'s ``t``-th vector in its current order. Pairs are
    formed from consecutive positions. ``coordinated`` is CD-GraB (one running sum over all ranks,
    pair-major then rank); otherwise ID-GraB (one sum per rank). Used by the herding-bound
    benchmark and the simulator, where all vectors of an epoch are at hand.
    """
    if vectors.dim() != 3 or vectors.shape[0] % 2:
        raise ValueError(f"vectors must be (n positions, m ranks, d) with n even (pairs); got {tuple(vectors.shape)}")
    positions, ranks, dim = vectors.shape
    differences = vectors[0::2] - vectors[1::2]  # (n / 2, m, d)
    if coordinated:
        balancer = PairBalancer(ranks, positions, dim, vectors.dtype, vectors.device)
        balancer.step(differences)
        return balancer.next_positions().T
    columns = []
    for rank in range(ranks):
        balancer = PairBalancer(1, positions, dim, vectors.dtype, vectors.device)
        balancer.step(differences[:, rank : rank + 1])
        columns.append(balancer.next_positions()[0])
    return torch.stack(columns, dim=1)


def apply_positions(vectors: Tensor, positions: Tensor) -> Tensor:
    """Reorder ``vectors`` (``(n, m, ...)``) per rank by ``positions`` (``(n, m)``) from :func:`balance_epoch`."""
    index = positions.view(*positions.shape, *([1] * (vectors.dim() - 2))).expand_as(vectors)
    return vectors.gather(0, index)
