"""What a running simulation holds that its protocol reads and changes: the workers' replicas, who is present,
the simulator and the results so far (:class:`RunState`, the base of :class:`~lightning_dist.sim.simulation.Simulation`).

A protocol (:mod:`lightning_dist.sim.protocols`) is set up with the running simulation and uses these helpers. They
live in a base class of their own so that the protocols name the type they are given without importing the run
loop, which imports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from torch import Tensor

from lightning_dist.algorithms.averaging import running_average
from lightning_dist.sim.churn import Churn
from lightning_dist.sim.engine import Simulator
from lightning_dist.sim.replica import Replica


@dataclass
class SimulationResult:
    """What a run produced: global rows, per-worker rows and a summary (see :mod:`lightning_dist.sim.report`)."""

    rows: list[dict[str, float]] = field(default_factory=list)
    worker_rows: list[dict[str, float]] = field(default_factory=list)
    waits: list[dict[str, float]] = field(default_factory=list)
    """Every time a worker waited for the protocol: worker, step, virtual start and seconds waited."""
    churn: list[dict[str, Any]] = field(default_factory=list)
    """Every leave and join: worker, virtual time, event ("leave" or "join") and, for a join, the step it goes on
    after (``position``)."""
    summary: dict[str, Any] = field(default_factory=dict)


class RunState:
    """The state of a running simulation that protocols use; :class:`~lightning_dist.sim.simulation.Simulation`
    fills it in when a run starts."""

    num_workers: int
    """The workers the protocol sees: every rank, or one learner per machine under a hierarchy."""
    max_steps: int
    server: int
    """The node index of a protocol's server or coordinator (``num_workers``)."""
    churn: Optional[Churn]
    replicas: list[Replica]
    dataset_sizes: Tensor
    present: list[bool]
    positions: list[int]
    """The last step each worker finished."""
    simulator: Simulator
    result: SimulationResult
    _in_flight: list[Optional[Tensor]]

    def consensus(self, weights: Optional[Sequence[float]] = None) -> Tensor:
        """The mean of the present workers' models (:meth:`worker_model`), weighted by ``weights`` (one per worker,
        e.g. ``dataset_sizes``) if given; of all workers' models while none is present."""
        workers = self.present_workers() or list(range(self.num_workers))
        chosen = None if weights is None else [weights[rank] for rank in workers]
        # One model at a time: thousands of workers' models are never held together.
        return running_average((self.worker_model(rank) for rank in workers), chosen)

    def present_workers(self) -> list[int]:
        """The workers present now (all of them without churn), ascending."""
        return [rank for rank in range(self.num_workers) if self.present[rank]]

    def worker_model(self, rank: int) -> Tensor:
        """Worker ``rank``'s model as of now: without the training step it is still taking.

        A step with a modelled duration changes the replica only when it ends (:meth:`Node.execute`);
        a measured one changes it at its start, so its worker keeps the model from before the step
        until the step's interval ends.
        """
        before = self._in_flight[rank]
        return before if before is not None else self.replicas[rank].get()

    def record_wait(self, rank: int, step: int, start: float) -> None:
        """Record that worker ``rank`` waited for the protocol at step ``step`` from virtual time ``start``
        until now (nothing if no time passed)."""
        now = self.simulator.env.now
        if now > start:
            self.result.waits.append({"worker": rank, "step": step, "start": start, "seconds": now - start})
