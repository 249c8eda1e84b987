"""DownpourSGD's parameter server, as plain torch: the global model and how pushed updates change it.

DownpourSGD (Dean et al., NIPS 2012) is the base algorithm of paper 000 (DataGossip, section 3,
Figure 1) and the asynchronous parameter server of paper 001. Each worker trains its own replica
and, every ``push_every`` steps, sends its *accumulated update* (its parameters minus those it
last pulled) to the parameter server and continues from the global model the server answers with.
Nothing here knows about processes or Lightning: the strategy (``lightning_dist.strategies.downpour``)
moves the tensors, the simulator calls the same code.

The server's rules:

- **Asynchronous** (paper 001, section 2.2.2, ASGD): each update is added as it arrives, one server
  version per update: in full, ``w <- w + u`` (Dean et al.; paper 001), or, with
  ``staleness_aware``, divided by its staleness plus one, ``w <- w + u / (tau + 1)`` (Zhang et al.,
  "Staleness-aware Async-SGD", IJCAI 2016, whose learning rate ``alpha / tau`` counts tau from 1).
  With m workers pushing in turn an update is about m - 1 versions stale, so in full the server
  moves m times as far per unit of time as a synchronous round (the mean of m updates) would, in
  directions computed from models up to m - 1 versions old: with AdamW's fixed-size steps on the
  package's language model that ended at loss 3.28 where every averaging method passed 2.68 (and
  the simulator agreed: 3.04); scaled, the simulator reached 2.31. An update with staleness 0 is
  applied in full, so a lone fast worker is not slowed.
- **Synchronous** (paper 001, section 2.2.1, SSGD: "the parameter server obtains the gradient
  average and updates the parameters"): one round takes one update from every worker, all computed
  from the same global version, and applies their mean, ``w <- w + (1/m) sum_i u_i``; the round is
  one server version, so every update of a round has staleness 0.
- **Buffers are not updates.** A model vector (:class:`~lightning_dist.model_vector.ModelVector`)
  holds parameters, then floating-point buffers such as BatchNorm's running mean and variance.
  Those are exponential moving averages, not sums of steps: adding m workers' deltas of them
  overshoots, and a running variance goes below zero (NaN evaluation). So a worker sends, after its
  parameter update, its *absolute* buffer values (the same number of elements: no extra bytes), the
  server remembers every worker's latest reported buffers, and the global model's buffer part is
  their mean. It is always a convex combination of buffers some worker really computed, so a
  variance stays positive; before a worker's first push its entry is the initial model's buffers.
- **Float32 master.** The global model and every sum are kept in float32 (float64 stays float64),
  whatever dtype the model trains in: adding bf16 updates to a bf16 vector loses every update
  smaller than the vector's rounding step. Workers compute their update in that dtype too and
  convert the model the server sends back into their own dtype.

Staleness of an update (paper 001, section 3): the number of server versions between the worker's
pull and its push, ``version_now - version_pulled``. An optional bound drops updates staler than
``max_staleness``; the worker then continues from the current global model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_dist.algorithms.averaging import accumulation_dtype


def check_max_staleness(max_staleness: int | None) -> None:
    """Raise a ValueError naming ``max_staleness`` unless it is None or an integer >= 0."""
    if max_staleness is not None and (
        isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0
    ):
        raise ValueError(f"max_staleness must be None or an integer >= 0 (server versions); got {max_staleness!r}")


def push_message(local: Tensor, pulled: Tensor, num_parameters: int) -> Tensor:
    """What a Downpour worker pushes: its accumulated update, then its absolute buffers.

    The first ``num_parameters`` elements are ``local - pulled`` (for plain SGD, ``-lr`` times the
    gradients summed since the pull, the reference repo's accumulator; the difference of models
    makes it right for any optimizer); the rest are ``local``'s buffers as they are. ``pulled``
    must be the replica exactly as the worker set it from the server's reply (in the model's
    dtype), so that a worker that did not move pushes a zero update. Computed in
    :func:`~lightning_dist.algorithms.averaging.accumulation_dtype`, where the difference of two bf16/fp16 vectors is exact.
    """
    dtype = accumulation_dtype(local.dtype)
    local = local.to(dtype)
    update = local[:num_parameters] - pulled[:num_parameters].to(dtype)
    return torch.cat([update, local[num_parameters:]])


@dataclass
class PushOutcome:
    """What the server did with one pushed update."""

    accepted: bool
    staleness: int
    version: int


class GlobalModel:
    """The server's model in its master dtype, with a version per applied update or round.

    Parameters: ``initial + sum of accepted updates`` (asynchronous) or ``+ the mean of each
    round's`` (synchronous). Buffers: the mean over workers of each one's latest reported buffers.

    Args:
        vector: the initial global model (copied, in :func:`~lightning_dist.algorithms.averaging.accumulation_dtype`).
        num_parameters: how many leading elements of ``vector`` are parameters; the rest are buffers
            (``ModelVector.num_parameters``).
        workers: number of workers that push (one buffer entry each).
        max_staleness: drop updates whose staleness exceeds this; ``None`` accepts every update.
        staleness_aware: divide each update by its staleness plus one (see the module docstring);
            False adds it in full, as DownpourSGD and paper 001's ASGD do.
    """

    def __init__(self, vector: Tensor, num_parameters: int, workers: int, max_staleness: int | None = None,
                 staleness_aware: bool = False) -> None:
        check_max_staleness(max_staleness)
        if not 0 <= num_parameters <= vector.numel():
            raise ValueError(f"num_parameters must be in [0, {vector.numel()}] (the vector's length); got {num_parameters}")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an integer >= 1; got {workers!r}")
        self.vector = vector.detach().to(accumulation_dtype(vector.dtype), copy=True)
        self.num_parameters = num_parameters
        self.worker_buffers = self.vector[num_parameters:].repeat(workers, 1)
        self.max_staleness = max_staleness
        self.staleness_aware = staleness_aware
        self.version = 0
        self.accepted = 0
        self.rejected = 0
        self.staleness_sum = 0
        self.staleness_max = 0

    @property
    def workers(self) -> int:
        return self.worker_buffers.shape[0]

    def staleness(self, pulled_version: int) -> int:
        if not 0 <= pulled_version <= self.version:
            raise ValueError(f"pulled_version must be in [0, {self.version}]; got {pulled_version}")
        return self.version - pulled_version

    def too_stale(self, pulled_version: int) -> bool:
        """Whether an update based on ``pulled_version`` would be dropped (the worker must re-pull)."""
        return self.max_staleness is not None and self.staleness(pulled_version) > self.max_staleness

    def push(self, message: Tensor, pulled_version: int, rank: int) -> PushOutcome:
        """Asynchronous: apply ``rank``'s :func:`push_message` (scaled if ``staleness_aware``) unless it is too
        stale (one version)."""
        return self.push_round([(message, pulled_version, rank)])[0]

    def push_round(self, messages: Sequence[tuple[Tensor, int, int]]) -> list[PushOutcome]:
        """Apply ``(message, pulled_version, rank)`` triples as one server step: the mean of their updates.

        Synchronous Downpour passes one round (every worker's push, all pulled from the same
        version, so each has staleness 0); asynchronous Downpour passes one push at a time. Updates
        staler than ``max_staleness`` are dropped, the others' parameter updates (each divided by its
        staleness plus one if ``staleness_aware``: 1 in a synchronous round) are averaged and
        added (``w <- w + mean``), their buffers replace the senders' entries, and the version
        advances by one if any was applied. The mean is taken in the given order, so a round in rank
        order gives the same floats on every run.
        """
        outcomes, updates = [], []
        for message, pulled_version, rank in messages:
            if not 0 <= rank < self.workers:
                raise ValueError(f"rank must be in [0, {self.workers - 1}]; got {rank}")
            staleness = self.staleness(pulled_version)
            if self.too_stale(pulled_version):
                self.rejected += 1
                outcomes.append(PushOutcome(False, staleness, self.version))
                continue
            message = message.to(self.vector.device, self.vector.dtype)
            update = message[: self.num_parameters]
            updates.append(update / (staleness + 1) if self.staleness_aware else update)
            self.worker_buffers[rank] = message[self.num_parameters :]
            self.accepted += 1
            self.staleness_sum += staleness
            self.staleness_max = max(self.staleness_max, staleness)
            outcomes.append(PushOutcome(True, staleness, self.version + 1))
        if updates:
            self.vector[: self.num_parameters] += updates[0] if len(updates) == 1 else torch.stack(updates).mean(0)
            self.vector[self.num_parameters :] = self.worker_buffers.mean(0)
            self.version += 1
        return outcomes

    def refuse(self, pulled_version: int) -> PushOutcome:
        """Count an update dropped for staleness before its bytes were sent; the global model is unchanged."""
        self.rejected += 1
        return PushOutcome(False, self.staleness(pulled_version), self.version)

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
            "worker_buffers": self.worker_buffers.clone(),
            "version": self.version,
            "accepted": self.accepted,
            "rejected": self.rejected,
            "staleness_sum": self.staleness_sum,
            "staleness_max": self.staleness_max,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key, value, mine in (("global model", state["vector"], self.vector),
                                 ("worker buffers", state["worker_buffers"], self.worker_buffers)):
            if value.shape != mine.shape:
                raise ValueError(
                    f"{key} in the checkpoint has shape {tuple(value.shape)}; this model and world size give "
                    f"{tuple(mine.shape)}"
                )
            mine.copy_(value)
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
