"""What a protocol is to the simulator: per-worker code after each step, and optional server nodes."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator
from typing import TYPE_CHECKING, Any, Optional

import simpy
import torch
from torch import Tensor

from lightning_dist.algorithms.averaging import weighted_average
from lightning_dist.sim.replica import NonFiniteModelError, check_finite

if TYPE_CHECKING:
    from lightning_dist.sim.engine import Node
    from lightning_dist.sim.run_state import RunState

Program = Generator[simpy.Event, Any, Any]

TOPOLOGIES = ("server", "strategy")
"""Where a protocol's averaging runs: ``"server"`` on a server or coordinator node ``N`` (the papers'
setting); ``"strategy"`` among the workers as the lightning_dist strategy moves it (ring all-reduces,
subsets averaged in their members' chunks, all-gathered flags and distances)."""


def check_topology(value: object) -> str:
    if value not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {list(TOPOLOGIES)}; got {value!r}")
    return value  # type: ignore[return-value]


def all_finite(node: Node, key: Any, workers: list[int], local: Tensor, refusing: str) -> Program:
    """The strategies' check before an exchange: every worker all-gathers a 1-byte finiteness flag, and all raise,
    naming the workers whose model is non-finite, before anything is ``refusing`` (e.g. "to average them")."""
    flags = yield from node.all_gather(("finite", key), workers, bool(torch.isfinite(local).all()), nbytes=1)
    if not all(flags):
        raise NonFiniteModelError(
            f"workers {[worker for worker, finite in enumerate(flags) if not finite]} have non-finite models; "
            f"refusing {refusing}"
        )


def checked_mean(models: list[Tensor]) -> Tensor:
    """The mean of the workers' models (in worker order), refusing a non-finite one by its worker: what an
    all-reduce of every worker's model gives."""
    mean = weighted_average(models)
    if not bool(torch.isfinite(mean).all()):  # a non-finite model makes the mean non-finite: find whose
        for worker, model in enumerate(models):
            check_finite(model, worker)
        raise NonFiniteModelError("the mean of the workers' finite models overflowed")
    return mean


class Protocol(ABC):
    """A communication protocol run by the virtual workers (and by ``num_servers`` extra nodes).

    Workers are nodes ``0 .. N-1`` and train their replicas; a server or coordinator, when the
    protocol has one, is node ``N``. The math comes from ``lightning_dist.algorithms``; a protocol
    only decides which node holds which vector and which messages travel.
    """

    name: str
    num_servers: int = 0
    identical_replicas: bool = False
    """Whether every worker's model and optimizer state are the same after every step (DDP's): then the workers
    share one (:class:`~lightning_dist.sim.replica.SharedReplica`) unless workers leave and join."""
    server_on_worker: Optional[int] = None
    """With no server node of its own: the worker whose node also runs :meth:`server` (DownpourSGD's server
    thread on rank 0)."""

    def setup(self, simulation: RunState) -> None:
        """Called once before the simulation starts, when replicas and the data are ready."""
        self.simulation = simulation

    def validate(self, num_workers: int, max_steps: int) -> None:
        """Raise a ValueError naming the parameter when this protocol cannot run on ``num_workers``."""

    def check_churn(self) -> None:
        """Raise a ValueError when this protocol cannot run with workers leaving and joining.

        ``topology="strategy"`` moves what the lightning_dist strategy moves, and the strategies
        cannot lose or gain a rank without a restart (docs/launching.md, "Workers that leave and join"), so
        churn takes the papers' setting, ``topology="server"``.
        """
        if getattr(self, "topology", "server") == "strategy":
            raise ValueError(
                f"topology must be 'server' for protocol {self.name!r} with churn: 'strategy' moves what the "
                "lightning_dist strategy moves, and the strategies cannot lose or gain a rank without a restart; "
                "got topology='strategy'"
            )

    def leave(self, rank: int) -> None:
        """Worker ``rank`` left at this instant (its programs were interrupted, its transfers dropped): forget
        what waited for it. Called before the collectives drop it (:meth:`Collectives.leave`)."""

    def join(self, node: Node, rank: int) -> Program:
        """Bring worker ``rank``, back at this instant, into the protocol, as ``yield from``: set the model it
        starts from and return the last step it counts as done (it trains on from the next)."""
        raise NotImplementedError(f"protocol {self.name!r} does not support churn")

    def train_step(self, node: Node, rank: int, batch: Any) -> Program:
        """Worker ``rank``'s training step on ``batch``, as ``yield from``; returns the training loss.

        One optimizer step of the worker's own replica, its compute timed by ``execute``. A protocol
        that exchanges gradients rather than models (DDP) overrides it and records its waiting with
        :meth:`RunState.record_wait <lightning_dist.sim.run_state.RunState.record_wait>`.
        """
        replica, batched = self.simulation.replicas[rank], self.simulation.batched_steps
        if batched is None:
            return (yield from node.execute(replica.step, batch))
        return (yield from node.execute(batched.finish, batched.submit(replica, batch)))

    @abstractmethod
    def after_step(self, node: Node, rank: int, step: int) -> Program:
        """Runs on worker ``rank`` after its optimizer step number ``step`` (from 1); may communicate."""

    def finish(self, node: Node, rank: int) -> Program:
        """Runs on worker ``rank`` after its last step; a protocol whose peers may still need the
        worker's model keeps serving them here. Nothing by default."""
        yield from ()

    def server(self, node: Node) -> Program:
        """The program of the server node (protocols with ``num_servers == 1`` or a ``server_on_worker``)."""
        raise RuntimeError(f"protocol {self.name!r} has no server node")

    def global_model(self) -> Tensor:
        """The model the run is scored by: the plain mean of the replicas (what the averaging strategies
        evaluate and checkpoint) unless the protocol weights them or holds a global model of its own."""
        return self.simulation.consensus()

    def metrics(self) -> dict[str, float]:
        """Protocol counters reported with the results."""
        return {}

    def config(self) -> dict[str, Any]:
        """The protocol's name and arguments, as written in a config."""
        return {"name": self.name, **{key: value for key, value in vars(self).items() if key in self.arguments}}

    arguments: tuple[str, ...] = ()
