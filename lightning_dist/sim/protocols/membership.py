"""Who a server counts as present, under churn (:mod:`lightning_dist.sim.churn`).

A server or coordinator learns of a worker's leave the instant it happens (the connection drops; a
zero-byte ``LEFT`` notice wakes it) and of a join when the joiner's 1-byte ``JOIN`` request
arrives. Joiners of a round-based protocol (periodic averaging, FedAvg, DiLoCo, the synchronous
parameter server) wait for the round in progress to close and start from its result: admitting
them at once would make the round wait for their local steps, delaying every present worker.
Without churn no notice or request ever arrives and a server runs exactly as before.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING, Any

from lightning_dist.sim.engine import Message

if TYPE_CHECKING:
    from lightning_dist.sim.engine import Node
    from lightning_dist.sim.protocols.base import Program

LEFT = "left"  # simulation -> server: a worker left (zero bytes, at the leave instant)
JOIN = "join"  # joiner -> server: let me in (1 byte)
ADMIT = "admit"  # server -> joiner: the state it starts from
REQUEST_BYTES = 1


class Membership:
    """The workers a server counts as present, and the joiners waiting to be admitted."""

    def __init__(self, present: Iterable[int]) -> None:
        self.members = set(present)
        self.waiting: list[int] = []

    def leave(self, rank: int, server: Node) -> None:
        """Worker ``rank`` left: drop it now, and wake ``server`` with a ``LEFT`` notice."""
        self.members.discard(rank)
        if rank in self.waiting:
            self.waiting.remove(rank)
        server.deliver(Message(rank, LEFT, None, 0, server.now))

    def handle(self, message: Message) -> None:
        """A ``JOIN`` request registers its sender; a ``LEFT`` notice only woke the server."""
        if message.tag == JOIN and message.source not in self.waiting:
            self.waiting.append(message.source)

    def collect(self, node: Node, tag: Hashable, expected: Iterable[int]) -> Program:
        """Wait until every worker of ``expected`` has sent a message tagged ``tag`` or left; registers joiners
        meanwhile. Returns ``{source: payload}`` of the senders still present (a model whose worker left
        before the aggregation is not averaged)."""
        received: dict[int, Any] = {}
        while not (set(expected) & self.members) <= received.keys():
            message = yield node.recv_any((tag, JOIN, LEFT))
            if message.tag == tag:
                received[message.source] = message.payload
            else:
                self.handle(message)
        return {source: payload for source, payload in received.items() if source in self.members}

    def wait_for_members(self, node: Node, state: Any, nbytes: int) -> Program:
        """While no worker is present, admit each joiner as its request arrives (``state`` is what it starts from)."""
        while not self.members:
            self.handle((yield node.recv_any((JOIN, LEFT))))
            self.admit(node, state, nbytes)

    def serve_joins(self, node: Node, state: Any, nbytes: int) -> Program:
        """After the last round: admit every joiner at once, from ``state``, for ever."""
        while True:
            self.handle((yield node.recv_any((JOIN, LEFT))))
            self.admit(node, state, nbytes)

    def admit(self, node: Node, state: Any, nbytes: int) -> list[int]:
        """Send ``state`` (``nbytes`` on the wire) to every waiting joiner; they are members from now on."""
        while (message := node.recv_nowait(tag=JOIN)) is not None:  # requests that arrived while it was busy
            self.handle(message)
        admitted, self.waiting = self.waiting, []
        for rank in admitted:
            node.send(rank, state, tag=ADMIT, nbytes=nbytes)
            self.members.add(rank)
        return admitted


def request_admission(node: Node, server: int) -> Program:
    """A joiner's side: send ``JOIN`` to ``server`` and wait for its ``ADMIT``; returns the state it carries."""
    node.send(server, None, tag=JOIN, nbytes=REQUEST_BYTES)
    return (yield node.recv(source=server, tag=ADMIT)).payload
