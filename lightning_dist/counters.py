"""Resuming a checkpoint at another world size: the rule for per-rank counters that strategies and callbacks share.

A checkpoint written by ``m`` processes holds ``m`` copies of each per-rank counter (bytes sent,
messages, exchanges, ...). Resumed by ``m'`` processes, the counters are kept in total, so that a
sum over ranks goes on from the checkpoint's: rank ``r < min(m, m')`` keeps its own, new ranks start
at zero, and when ranks go away their counts are added to rank 0's. Used by the local-update
strategies (``strategies/_resize.py``), DataGossip and CD-GraB.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

Number = TypeVar("Number", int, float)


def counters_kept_in_total(saved: Sequence[Sequence[Number]], rank: int, world_size: int) -> list[Number]:
    """Rank ``rank``'s counters at ``world_size`` from ``saved[r]``, the counters saved rank ``r`` wrote.

    Every ``saved[r]`` lists the same counters in the same order; the result lists them likewise.
    """
    if rank >= len(saved):
        return [type(value)(0) for value in saved[0]]
    kept = [saved[rank]] + (list(saved[world_size:]) if rank == 0 else [])
    return [sum(values) for values in zip(*kept)]
