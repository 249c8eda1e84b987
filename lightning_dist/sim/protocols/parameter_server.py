"""DownpourSGD's parameter server in the simulator, synchronous or asynchronous (papers 000, 001).

The same :class:`~lightning_dist.algorithms.parameter_server.GlobalModel` as
:class:`~lightning_dist.strategies.DownpourSGDStrategy` lives on a server node (node ``N``). Every
``push_every`` steps a worker sends its accumulated update (with its buffers, ``push_message``)
and waits for the global model. The asynchronous server applies each update on arrival and answers
that worker at once; the synchronous one (paper 001's SSGD) waits for every worker's update of the
round, applies their mean as one server version and sends the model back to all workers, one after
the other through its send port. Buffers and the float32 master follow ``GlobalModel``'s rules.

``topology="strategy"`` places the server as :class:`~lightning_dist.strategies.DownpourSGDStrategy`
does: a thread on worker 0's node, which also trains. Worker 0's pushes and replies are local calls
(no bytes, no transfer), so ``N - 1`` workers use the network, all through worker 0's ports. Every
push and reply carries the strategy's 32-byte header, and a worker's last step its ``DONE`` header. The
asynchronous server thread takes one push at a time, as the strategy's ``_serve`` does: it reads a push's header,
then receives its update (a 0-byte notice starts the transfer: Gloo moves a message once its receive is posted),
and answers with a blocking send before it reads the next header (modelled as the reply's arrival), so pushes
and replies take turns on worker 0's interface. (On a real network the kernel's socket buffers let a reply's last
bytes drain while the next push arrives: the measured time lies between this and full overlap,
``docs/results/simulator-validation.md``.)
``max_staleness`` is refused there: the strategy's header round trip before a possibly stale
update is not modelled.

``compression`` (``"bf16"`` or ``"int8"``) compresses pushes and replies as the strategy does, with
:mod:`lightning_dist.algorithms.compressed_pushes`' classes (a worker's residual and mirror, the
server's mirror per worker) and their bytes; with ``topology="strategy"`` worker 0's local calls stay
exact, as the strategy's rank 0's. A reply says whether the push was applied: a worker whose push
was too stale keeps the residual owed from its earlier pushes, as the strategy's workers do.

Churn (``topology="server"``, :mod:`lightning_dist.sim.churn`): the server keeps serving. A
leaving worker's push still on the wire is dropped; the synchronous server's rounds wait for the
workers present and apply the mean of the updates of those present at the aggregation. A joiner
sends a 1-byte request and starts from the published global model: at once, going on from its own
step, with the asynchronous server; when the round in progress closes, at that round's step, with
the synchronous one.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from lightning_dist.algorithms.arguments import check_compression, check_flag, check_steps
from lightning_dist.algorithms.compressed_pushes import CompressedPushes, CompressedReplies
from lightning_dist.algorithms.parameter_server import (
    GlobalModel,
    check_finite,
    check_max_staleness,
    push_message,
)
from lightning_dist.sim.engine import Node
from lightning_dist.sim.protocols.base import Program, Protocol, check_topology
from lightning_dist.sim.protocols.membership import JOIN, LEFT, Membership, request_admission

HEADER_BYTES = 4 * 8  # the strategy's header: kind, rank, version, spare as int64 (strategies/parameter_server.py)


class ParameterServer(Protocol):
    """Args:
    push_every: local steps between pushes (DESIGN 3.5's default 5); ``>= 1``.
    synchronous: a barrier per round (paper 001's synchronous mode) instead of asynchronous pushes.
    max_staleness: drop updates staler than this many server versions; None keeps all.
    staleness_aware: divide each asynchronous update by its staleness plus one, as the strategy does by
        default (:mod:`lightning_dist.algorithms.parameter_server`); False adds it in full (paper 001's ASGD).
    topology: ``"server"`` (a server node of its own) or ``"strategy"`` (the strategy's server thread on
        worker 0's node).
    compression: None, ``"bf16"`` or ``"int8"``: pushes and replies compressed, as the strategy's.
    """

    name = "parameter_server"
    arguments = ("push_every", "synchronous", "max_staleness", "staleness_aware", "topology", "compression")

    def __init__(
        self,
        push_every: int = 5,
        synchronous: bool = False,
        max_staleness: Optional[int] = None,
        staleness_aware: bool = True,
        topology: str = "server",
        compression: Optional[str] = None,
    ) -> None:
        self.push_every = check_steps("push_every", push_every, "local steps between pushes")
        self.synchronous = check_flag("synchronous", synchronous)
        check_max_staleness(max_staleness)
        self.max_staleness = max_staleness
        self.staleness_aware = check_flag("staleness_aware", staleness_aware)
        self.topology = check_topology(topology)
        if self.topology == "strategy" and max_staleness is not None:
            raise ValueError(
                "max_staleness must be None with topology='strategy': the strategy's header round trip before "
                f"a stale update is not modelled; got max_staleness={max_staleness!r}"
            )
        self.num_servers = 1 if self.topology == "server" else 0
        self.server_on_worker = None if self.topology == "server" else 0
        self.header_bytes = 0 if self.topology == "server" else HEADER_BYTES
        self.compression = check_compression(compression, "the simulated parameter server's pushes and replies")

    def setup(self, simulation) -> None:  # type: ignore[no-untyped-def]
        super().setup(simulation)
        initial = simulation.replicas[0].get()
        self.num_parameters = simulation.replicas[0].vector.num_parameters
        self.store = GlobalModel(initial, self.num_parameters, simulation.num_workers, self.max_staleness,
                                 self.staleness_aware)
        self.rounds = simulation.max_steps // self.push_every
        self.pulled = [initial] * simulation.num_workers
        self.versions = [0] * simulation.num_workers
        self.applied = [True] * simulation.num_workers  # whether the server applied each worker's last push
        self.published = (self.store.vector.clone(), self.store.version)
        self.server_node = simulation.server if self.topology == "server" else self.server_on_worker
        self.membership = Membership(simulation.present_workers())
        self.pushes: dict[int, CompressedPushes] = {}
        self.replies = None
        if self.compression is not None:
            self.replies = CompressedReplies(self.compression, initial, self.num_parameters, simulation.num_workers)
            self.pushes = {rank: CompressedPushes(self.compression, initial, self.num_parameters)
                           for rank in range(simulation.num_workers) if rank != self.server_on_worker}

    def leave(self, rank: int) -> None:
        self.membership.leave(rank, self.simulation.simulator.nodes[self.server_node])

    def join(self, node: Node, rank: int) -> Program:
        """Start from the published global model: at once, from the worker's own step (asynchronous), or when the
        round in progress closes, at its step (synchronous)."""
        (vector, version), round_index = yield from request_admission(node, self.server_node)
        replica = self.simulation.replicas[rank]
        replica.set(vector)
        self.pulled[rank], self.versions[rank] = replica.get(), version
        if self.replies is not None:  # the joiner received the model in full: both mirrors restart from it
            self.pushes[rank] = CompressedPushes(self.compression, vector, self.num_parameters)
            self.replies.mirrors[rank] = vector.to(self.replies.mirrors.dtype)
        return self.simulation.positions[rank] if round_index is None else round_index * self.push_every

    def after_step(self, node: Node, rank: int, step: int) -> Program:
        if step % self.push_every:
            return
        replica = self.simulation.replicas[rank]
        update = push_message(replica.get(), self.pulled[rank], self.num_parameters)
        pushes = self.pushes.get(rank)
        if pushes is not None:
            update = pushes.encode_push(update)
        if self._takes_turns(rank):
            # The strategy's header first; the update moves once the server thread asks for it (see _take_push).
            node.send(self.server_node, (None, self.versions[rank]), tag="push", nbytes=HEADER_BYTES)
            yield node.recv(source=self.server_node, tag="ready")
            node.send(self.server_node, update, tag="update", nbytes=update.nbytes)
        else:
            node.send(self.server_node, (update, self.versions[rank]), tag="push", nbytes=self._bytes(update))
        message = yield node.recv(source=self.server_node, tag="pull")
        vector, version, applied = message.payload
        if pushes is not None:
            if not applied:  # too stale: the update is dropped, the residual owed from earlier pushes stays owed
                pushes.refused()
            vector = pushes.decode_reply(vector)
        replica.set(vector)
        # The replica as it now is, in the model's dtype (see push_message).
        self.pulled[rank], self.versions[rank] = replica.get(), version

    def finish(self, node: Node, rank: int) -> Program:
        """With ``topology="strategy"`` a worker off the server's node tells the server thread it is done: the
        strategy's 32-byte ``DONE`` header (``ParameterServerClient.done``)."""
        if self.topology == "strategy" and rank != self.server_on_worker:
            node.send(self.server_node, None, tag="done", nbytes=HEADER_BYTES)
        yield from ()

    def server(self, node: Node) -> Program:
        membership = self.membership
        if self.synchronous:
            for round_index in range(1, self.rounds + 1):
                yield from membership.wait_for_members(node, (self.published, round_index - 1), self._admit_bytes)
                updates = yield from membership.collect(node, "push", sorted(membership.members))
                updates = {rank: (self._decoded(rank, update), version) for rank, (update, version) in updates.items()}
                for rank, (update, _) in updates.items():
                    check_finite(update, rank)
                if updates:  # else every worker left before its push arrived: the round changes nothing
                    ordered = [(*updates[rank], rank) for rank in sorted(updates)]
                    outcomes = yield from node.execute(self.store.push_round, ordered, kind="aggregate")
                    self.publish()
                    for rank, outcome in zip(sorted(updates), outcomes):
                        self.applied[rank] = outcome.accepted
                        if rank in membership.members:
                            yield from self._reply(node, rank)
                membership.admit(node, (self.published, round_index), self._admit_bytes)
            yield from membership.serve_joins(node, (self.published, self.rounds), self._admit_bytes)
        while True:
            message = yield node.recv_any(("push", JOIN, LEFT))
            if message.tag != "push":
                membership.handle(message)
                membership.admit(node, (self.published, None), self._admit_bytes)
                continue
            update, pulled_version = message.payload
            if self._takes_turns(message.source):
                update = yield from self._take_push(node, message.source)
            update = self._decoded(message.source, update)
            check_finite(update, message.source)
            outcome = yield from node.execute(self.store.push, update, pulled_version, message.source,
                                              kind="aggregate")
            self.publish()
            self.applied[message.source] = outcome.accepted
            yield from self._reply(node, message.source)

    def _takes_turns(self, rank: int) -> bool:
        """Whether ``rank``'s pushes reach the asynchronous server thread one at a time (``topology="strategy"``, a
        worker off the server's node)."""
        return self.topology == "strategy" and not self.synchronous and rank != self.server_on_worker

    def _take_push(self, node: Node, rank: int) -> Program:
        """The strategy's server thread takes one push at a time: it reads a push's header, then receives its update
        (Gloo moves a message once its receive is posted: a 0-byte notice here), applies it and sends the reply
        before it reads the next header. So pushes and replies take turns on the server's interface instead of
        streaming in while it replies."""
        node.send(rank, None, tag="ready", nbytes=0)
        return (yield node.recv(source=rank, tag="update")).payload

    @property
    def _admit_bytes(self) -> int:
        """A joiner's state: the published model and its version."""
        return self._bytes(self.published[0])

    def _bytes(self, vector: Tensor) -> int:
        """A push's or reply's bytes: the vector and its version (8 bytes; a reply's applied-or-refused status rides in
        that word, as in the strategy's header), or the strategy's header."""
        return vector.nbytes + (self.header_bytes or 8)

    def _decoded(self, rank: int, update: Tensor) -> Tensor:
        """``rank``'s push as ``push_message`` made it (decoded if it was compressed)."""
        return update if rank not in self.pushes else self.replies.decode_push(update)

    def _reply(self, node: Node, rank: int) -> Program:
        """Send the published model to ``rank`` (compressed against its mirror if ``rank`` compresses) and whether its
        push was applied; the strategy's server thread waits for the send to finish."""
        vector, version = self.published
        if rank in self.pushes:
            vector = self.replies.encode_reply(rank, vector)
        sent = node.send(rank, (vector, version, self.applied[rank]), tag="pull", nbytes=self._bytes(vector))
        if self.topology == "strategy":
            yield sent

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
