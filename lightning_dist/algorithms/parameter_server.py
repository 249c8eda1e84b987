"""DownpourSGD's parameter server, as plain torch: the global model and how pushed updates change it.

DownpourSGD (Dean et al., NIPS 2012) is the base algorithm of paper 000 (DataGossip, section 3,
Figure 1) and the asynchronous parameter server of paper 001. Each worker trains its own replica
and, every ``push_every`` steps, sends its *accumulated update* (its parameters minus those it
last pulled) to the parameter server, which adds it to the global model as it arrives and answers
with the current global model. Nothing here knows about processes or Lightning: the strategy
(``lightning_dist.strategies.downpour``) moves the tensors, the simulator calls the same code.

Staleness of an update (paper 001, section 3): the number of other updates the server applied
between the worker's pull and its push, ``version_now - version_pulled``. An optional bound drops
updates staler than ``max_staleness``; the worker then continues from the current global model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


def check_max_staleness(max_staleness: int | None) -> None:
    """Raise a ValueError naming ``max_staleness`` unless it is None or an integer >= 0."""
    if max_staleness is not None and (
        isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0
    ):
        raise ValueError(f"max_staleness must be None or an integer >= 0 (server versions); got {max_staleness!r}")


def accumulated_update(local: Tensor, pulled: Tensor) -> Tensor:
    """The update a Downpour worker pushes: ``local - pulled``.

    For plain SGD this is ``-lr * sum of gradients`` since the pull (the reference repo's
    accumulator); taking the difference of models makes it right for any optimizer.
    """
    return local - pulled


@dataclass
class PushOutcome:
    """What the server did with one pushed update."""

    accepted: bool
    staleness: int
    version: int


class GlobalModel:
    """The server's model: ``initial + sum of accepted updates``, with a version per accepted update.

    Args:
        vector: the initial global model (copied).
        max_staleness: drop updates whose staleness exceeds this; ``None`` accepts every update.
    """

    def __init__(self, vector: Tensor, max_staleness: int | None = None) -> None:
        check_max_staleness(max_staleness)
        self.vector = vector.detach().clone()
        self.max_staleness = max_staleness
        self.version = 0
        self.accepted = 0
        self.rejected = 0
        self.staleness_sum = 0
        self.staleness_max = 0

    def staleness(self, pulled_version: int) -> int:
        if not 0 <= pulled_version <= self.version:
            raise ValueError(f"pulled_version must be in [0, {self.version}]; got {pulled_version}")
        return self.version - pulled_version

    def too_stale(self, pulled_version: int) -> bool:
        """Whether an update based on ``pulled_version`` would be dropped (the worker must re-pull)."""
        return self.max_staleness is not None and self.staleness(pulled_version) > self.max_staleness

    def push(self, update: Tensor, pulled_version: int) -> PushOutcome:
        """Apply ``update`` (w <- w + update) unless it is too stale; bump the version if applied."""
        if self.too_stale(pulled_version):
            return self.refuse(pulled_version)
        staleness = self.staleness(pulled_version)
        self.vector += update.to(self.vector.device, self.vector.dtype)
        self.version += 1
        self.accepted += 1
        self.staleness_sum += staleness
        self.staleness_max = max(self.staleness_max, staleness)
        return PushOutcome(True, staleness, self.version)

    def refuse(self, pulled_version: int) -> PushOutcome:
        """Count an update dropped for staleness; the global model is unchanged."""
        self.rejected += 1
        return PushOutcome(False, self.staleness(pulled_version), self.version)

    def push_round(self, updates: Sequence[tuple[Tensor, int]]) -> list[PushOutcome]:
        """Synchronous Downpour: apply one round's updates in the given (rank) order.

        A fixed order makes the float sum, and so a synchronous run, reproducible bit for bit.
        """
        return [self.push(update, pulled_version) for update, pulled_version in updates]

    def metrics(self, prefix: str = "downpour/") -> dict[str, float]:
        mean = self.staleness_sum / self.accepted if self.accepted else 0.0
        return {
            f"{prefix}version": float(self.version),
            f"{prefix}accepted": float(self.accepted),
            f"{prefix}rejected_stale": float(self.rejected),
            f"{prefix}staleness_mean": mean,
            f"{prefix}staleness_max": float(self.staleness_max),
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "vector": self.vector.clone(),
            "version": self.version,
            "accepted": self.accepted,
            "rejected": self.rejected,
            "staleness_sum": self.staleness_sum,
            "staleness_max": self.staleness_max,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["vector"].shape != self.vector.shape:
            raise ValueError(
                f"global model in the checkpoint has shape {tuple(state['vector'].shape)}; this model's is "
                f"{tuple(self.vector.shape)}"
            )
        self.vector.copy_(state["vector"])
        for key in ("version", "accepted", "rejected", "staleness_sum", "staleness_max"):
            setattr(self, key, int(state[key]))


def check_finite(update: Tensor, rank: int) -> None:
    """Refuse a non-finite update before it reaches the global model, naming the rank that sent it."""
    if not bool(torch.isfinite(update).all()):
        raise NonFiniteUpdateError(rank)


class NonFiniteUpdateError(RuntimeError):
    """A worker pushed NaN or infinite values; applying them would poison every replica."""

    def __init__(self, rank: int) -> None:
        super().__init__(f"rank {rank} pushed a non-finite update; refusing to apply it to the global model")
        self.rank = rank
