"""DownpourSGD's parameter server in the simulator, synchronous or asynchronous (papers 000, 001).

The same :class:`~lightning_dist.algorithms.parameter_server.GlobalModel` as
:class:`~lightning_dist.strategies.DownpourSGDStrategy` lives on a server node (node ``N``). Every
``push_every`` steps a worker sends its accumulated update (with its buffers, ``push_message``)
and waits for the global model. The asynchronous server applies each update on arrival and answers
that worker at once; the synchronous one (paper 001's SSGD) waits for every worker's update of the
round, applies their mean as one server version and sends the model back to all workers, one after
the other through its send port. Buffers and the float32 master follow ``GlobalModel``'s rules.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from lightning_dist.algorithms.arguments import check_flag, check_steps
from lightning_dist.algorithms.parameter_server import (
    GlobalModel,
    check_finite,
    check_max_staleness,
    push_message,
)
from lightning_dist.sim.engine import Node
from lightning_dist.sim.protocols.base import Program, Protocol


class ParameterServer(Protocol):
    """Args:
    push_every: local steps between pushes (DESIGN 3.5's default 5); ``>= 1``.
    synchronous: a barrier per round (paper 001's synchronous mode) instead of asynchronous pushes.
    max_staleness: drop updates staler than this many server versions; None keeps all.
    """

    name = "parameter_server"
    num_servers = 1
    arguments = ("push_every", "synchronous", "max_staleness")

    def __init__(self, push_every: int = 5, synchronous: bool = False, max_staleness: Optional[int] = None) -> None:
        self.push_every = check_steps("push_every", push_every, "local steps between pushes")
        self.synchronous = check_flag("synchronous", synchronous)
        check_max_staleness(max_staleness)
        self.max_staleness = max_staleness

    def setup(self, simulation) -> None:  # type: ignore[no-untyped-def]
        super().setup(simulation)
        initial = simulation.replicas[0].get()
        self.num_parameters = simulation.replicas[0].vector.num_parameters
        self.store = GlobalModel(initial, self.num_parameters, simulation.num_workers, self.max_staleness)
        self.rounds = simulation.max_steps // self.push_every
        self.pulled = [initial] * simulation.num_workers
        self.versions = [0] * simulation.num_workers
        self.published = (self.store.vector.clone(), self.store.version)

    def after_step(self, node: Node, rank: int, step: int) -> Program:
        if step % self.push_every:
            return
        replica = self.simulation.replicas[rank]
        update = push_message(replica.get(), self.pulled[rank], self.num_parameters)
        node.send(self.simulation.server, (update, self.versions[rank]), tag="push")
        message = yield node.recv(source=self.simulation.server, tag="pull")
        vector, version = message.payload
        replica.set(vector)
        # The replica as it now is, in the model's dtype (see push_message).
        self.pulled[rank], self.versions[rank] = replica.get(), version

    def server(self, node: Node) -> Program:
        workers = self.simulation.num_workers
        if self.synchronous:
            for _ in range(self.rounds):
                updates = {}
                for _ in range(workers):
                    message = yield node.recv(tag="push")
                    check_finite(message.payload[0], message.source)
                    updates[message.source] = message.payload
                ordered = [(*updates[rank], rank) for rank in range(workers)]
                yield from node.execute(self.store.push_round, ordered, kind="aggregate")
                self.publish()
                for rank in range(workers):
                    node.send(rank, self.published, tag="pull")
            return
        for _ in range(self.rounds * workers):
            message = yield node.recv(tag="push")
            update, pulled_version = message.payload
            check_finite(update, message.source)
            yield from node.execute(self.store.push, update, pulled_version, message.source, kind="aggregate")
            self.publish()
            node.send(message.source, self.published, tag="pull")

    def publish(self) -> None:
        """Make the server's model as of the end of its aggregation the one workers and evaluations see.

        With a measured duration ``execute`` runs the aggregation at the start of its interval; an
        evaluation inside that interval must still see the model from before it.
        """
        self.published = (self.store.vector.clone(), self.store.version)

    def global_model(self) -> Tensor:
        return self.published[0]

    def metrics(self) -> dict[str, float]:
        return self.store.metrics()
