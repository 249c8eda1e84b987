"""Resuming a local-update strategy's checkpoint on another allocation: which saved rank each rank takes after.

A checkpoint holds one replica per process that wrote it (model vector, optimizer state, RNG states,
counters) and its layout: the hierarchy and the learners, each a list of global ranks (every rank a
learner, or under ``hierarchy="node"`` the ranks of one node, which hold the same model and optimizer
state). Resumed with the same learners, rank for rank, every rank continues from its own part, bit
for bit. Resumed with any other layout (another world size, or the same world size cut into other
nodes: ``2 x 2 -> 1 x 4``, flat 4 ``-> 2 x 2``, ``2 x 3 -> 3 x 2``), by ``m'`` processes after ``m``
wrote it:

- every replica starts from the checkpoint's consensus, the model its ``state_dict`` holds (the
  average of the replicas; :meth:`LocalUpdateStrategy.lightning_module_state_dict`), so the
  replicas are in sync, the ranks of a node hold one model, and no learner's local progress counts
  more than another's;
- learner ``i`` now takes after saved learner ``i mod K`` (of ``K``), and its ``j``-th rank after that
  learner's rank ``j mod L'`` (of ``L'``) for its optimizer state, the precision plugin's state (the
  loss scale) and RNG states (:func:`followed_saved_rank`): the ranks of a saved learner hold the same
  optimizer state, so the ranks of a node now start with one optimizer state, as DDP inside the node
  needs (different Adam moments would step their identical gradients apart). Adam's moments are
  per-parameter statistics of the gradients a learner saw; a learner that keeps its index keeps its
  own, a new one borrows those of a learner with a similar stream, which is closer to the truth than
  zeros that restart the bias correction;
- the communication counters (and any per-rank count a strategy keeps, e.g. DownpourSGD's pushes) are
  kept in total: rank ``r < min(m, m')`` keeps its own, new ranks start at zero, and when ranks go
  away their counters are added to rank 0's, so the summed ``comm_stats`` go on from where they stood
  (``lightning_dist/counters.py``, shared with the callbacks);
- the protocol's shared state is the strategy's to translate
  (:meth:`LocalUpdateStrategy.resized_protocol_state`), and refused by name where it has none; its
  per-rank state is reset unless the strategy says what carries over
  (:meth:`LocalUpdateStrategy.resized_worker_state`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning_dist.counters import counters_kept_in_total
from lightning_dist.comm import CommStats


def learner_groups(world_size: int, nodes: Sequence[Sequence[int]] | None) -> list[list[int]]:
    """The learners of a run as lists of global ranks: every rank alone, or the ``nodes`` (each in local-rank order,
    numbered as :class:`~lightning_dist.comm.nodes.NodeLayout` numbers them) under a hierarchy."""
    return [[rank] for rank in range(world_size)] if nodes is None else [list(ranks) for ranks in nodes]


def followed_saved_rank(rank: int, learners: Sequence[Sequence[int]], saved_learners: Sequence[Sequence[int]]) -> int:
    """The saved rank whose optimizer, precision and RNG states ``rank`` resumes with after a layout change: rank ``j``
    of learner ``i`` takes after rank ``j mod L'`` of saved learner ``i mod K`` (module docstring)."""
    index = next(index for index, ranks in enumerate(learners) if rank in ranks)
    saved = saved_learners[index % len(saved_learners)]
    return saved[list(learners[index]).index(rank) % len(saved)]


def resized_comm_stats(states: Sequence[Mapping[str, Any]], rank: int, world_size: int) -> CommStats:
    """Rank ``rank``'s counters at ``world_size`` from every saved rank's ``CommStats.state_dict()``: its own,
    zeros for a new rank, and on rank 0 also those of the saved ranks that no longer exist (so the sum over
    ranks is the checkpoint's)."""
    saved = [CommStats.from_state_dict(state) for state in states]
    total = counters_kept_in_total([stats.to_vector() for stats in saved], rank, world_size)
    return CommStats.from_vector(total, saved[0].syncs)
