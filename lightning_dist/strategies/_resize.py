"""Resuming a local-update strategy's checkpoint at another world size: which saved rank each rank takes after.

A checkpoint holds one replica per process that wrote it (model vector, optimizer state, RNG states,
counters). Resumed by ``m'`` processes after ``m`` wrote it:

- every replica starts from the checkpoint's consensus, the model its ``state_dict`` holds (the
  average of the ``m`` replicas; :meth:`LocalUpdateStrategy.lightning_module_state_dict`), so the
  replicas are in sync and no rank's local progress counts more than another's;
- rank ``r`` takes its optimizer state and RNG states from saved rank ``r mod m``, the nearest rank
  that exists: Adam's moments are per-parameter statistics of the gradients a rank saw, and a rank
  that keeps its index keeps its own; a new rank borrows those of a rank with a similar stream,
  which is closer to the truth than zeros that restart the bias correction;
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


def nearest_saved_rank(rank: int, written_by: int) -> int:
    """The saved rank whose optimizer and RNG state ``rank`` resumes with: ``rank mod written_by``."""
    return rank % written_by


def resized_comm_stats(states: Sequence[Mapping[str, Any]], rank: int, world_size: int) -> CommStats:
    """Rank ``rank``'s counters at ``world_size`` from every saved rank's ``CommStats.state_dict()``: its own,
    zeros for a new rank, and on rank 0 also those of the saved ranks that no longer exist (so the sum over
    ranks is the checkpoint's)."""
    saved = [CommStats.from_state_dict(state) for state in states]
    total = counters_kept_in_total([stats.to_vector() for stats in saved], rank, world_size)
    return CommStats.from_vector(total, saved[0].syncs)
