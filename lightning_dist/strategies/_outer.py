"""The ``outer_optimizer`` option the averaging strategies share: DiLoCo's outer step in their checkpoints.

The math is :class:`lightning_dist.algorithms.outer.OuterStep`; a strategy builds one on every rank
when its replicas are initialized and steps it, on every rank, with the same average, so all ranks
hold the same reference and optimizer state without exchanging them. These helpers put that state
in the strategy's ``protocol_state_dict`` (identical on every rank) and take it back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from lightning_dist.algorithms import averaging
from lightning_dist.algorithms.outer import OuterOptimizerFactory, OuterStep

OUTER_KEY = "outer"


def build_outer_step(factory: OuterOptimizerFactory | None, start: Tensor) -> OuterStep | None:
    """An :class:`OuterStep` from the common start model's parameters, or None without an outer optimizer; its
    pieces are the buckets a blocking synchronization averages (``AVERAGE_BUCKET``, read now)."""
    return None if factory is None else OuterStep(start, factory, averaging.AVERAGE_BUCKET)


def outer_state(outer: OuterStep | None) -> dict[str, Any]:
    """The part of ``protocol_state_dict`` the outer step adds (nothing without one)."""
    return {} if outer is None else {OUTER_KEY: outer.state_dict()}


def load_outer_state(outer: OuterStep | None, state: Mapping[str, Any], strategy: str) -> None:
    """Restore :func:`outer_state`'s part; refuse a checkpoint written with the option set differently.

    Resuming DiLoCo without its reference and momentum, or dropping them, would not continue the run
    that wrote the checkpoint, so it is refused by name rather than silently changed.
    """
    saved = state.get(OUTER_KEY)
    if (saved is None) != (outer is None):
        written, now = ("with", "without") if outer is None else ("without", "with")
        raise ValueError(
            f"the checkpoint was written by {strategy} {written} an outer_optimizer and is resumed {now} one; "
            "resume with the outer_optimizer setting that wrote it"
        )
    if outer is not None:
        outer.load_state_dict(saved)
