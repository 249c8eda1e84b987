"""The simulator's network model (paper 001, section 3.2, with paper 002's per-link caps).

Paper 001 models a node with a *send port* and a *receive port* that work independently of
compute and of each other: sending to several targets is serialized, and so is receiving from
several sources. A transfer of ``b`` bytes occupies the sender's send port, the link and the
receiver's receive port for ``b / bandwidth`` seconds (its transmission time) and arrives
``latency`` seconds after its last byte left, so a lone transfer takes ``latency + b / bandwidth``.

Paper 002 caps bandwidth per node (100 Mbit/s) and per link (10 Mbit/s): a node can then feed
``node / link`` links at full link speed at once. So a port has ``lanes = floor(node / link)``
(at least 1) serial lanes; each transfer runs at ``min(node, link)`` on one lane. Without a link
cap a port has one lane at node speed (paper 001's serialized model); without a node cap the
links are the only limit. ``half_duplex_links`` makes the two directions of a link share it,
which is what Gloo does between a pair of processes (measured in ``benchmarks/segmented_gossip/run.py``).

Pending transfers are scanned in the order they were posted and each starts as soon as its
sender, link and receiver are all free, the scan-and-notify of paper 001's Sender Walker: a busy
receiver does not hold up the sender's other transfers.

Machines of several ranks (:mod:`lightning_dist.sim.machines`): a port is then a machine's interface
(under the model above, shared by the machine's ranks) or a rank's port inside its machine (under the
intra-node model), a link joins two machines or two ranks of one machine, and a transfer takes the model
of where it goes. A learner of several ranks receives a message once its machine has all-gathered it.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import simpy

from lightning_dist.comm.stats import LEVELS

from lightning_dist.sim.machines import Machines
from lightning_dist.sim.network_model import NetworkModel

@dataclass
class Transfer:
    source: int
    target: int
    nbytes: int
    deliver: Callable[[], Any]
    done: simpy.Event
    sequence: int
    model: NetworkModel
    send_port: int
    receive_port: int
    link: tuple[str, int, int]
    delay: float
    """Seconds from the last byte leaving to the arrival: the latency, and a learner machine's all-gather."""
    started: bool = False
    cancelled: bool = False


class Network:
    """Moves messages between the nodes of one :class:`simpy.Environment` under the ``machines``' models
    (:class:`~lightning_dist.sim.machines.Machines`: one :class:`NetworkModel`, every node a machine, unless
    machines hold several ranks).

    Counts every byte and message, per sending node and in total, and bytes by level (``bytes_by_level``:
    ``inter_node`` between machines, ``intra_node`` inside one).

    Waiting transfers are indexed by send port, receive port and link. A transfer can only become ready
    when one of those frees up, so a finished transmission looks only at the transfers waiting for
    its ports or its link, in posting order, and stops looking at each group once its resource is taken
    again. That is the same choice as scanning every waiting transfer in posting order (paper 001's
    Sender Walker), without the cost that grows with the square of the nodes.
    """

    def __init__(self, env: simpy.Environment, machines: Machines, num_nodes: int) -> None:
        self.env = env
        self.machines = machines
        # Ports 0 .. M-1: the machines' interfaces; M + node: the node's port inside its machine.
        self._machine = [machines.machine_of(node) for node in range(num_nodes)]
        self._intra_port = max(self._machine, default=-1) + 1
        lanes = [machines.network.lanes] * self._intra_port + [machines.intra.lanes] * num_nodes
        self._send_free = list(lanes)
        self._receive_free = list(lanes)
        self._busy_links: set[tuple[str, int, int]] = set()
        self._by_send_port: dict[int, dict[int, Transfer]] = defaultdict(dict)
        self._by_receive_port: dict[int, dict[int, Transfer]] = defaultdict(dict)
        self._by_link: dict[tuple[str, int, int], dict[int, Transfer]] = defaultdict(dict)
        self._sending: dict[int, dict[int, Transfer]] = defaultdict(dict)  # started, not yet transmitted, by source
        self._sequence = itertools.count()
        self.bytes_sent = [0] * num_nodes
        self.messages_sent = [0] * num_nodes
        self.bytes_by_level = dict.fromkeys(LEVELS, 0)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_sent)

    def count(self, node: int, nbytes: int, messages: int) -> None:
        """Count bytes and messages that ``node`` sends in a collective (:mod:`lightning_dist.sim.collectives`),
        whose transfers are timed as a whole rather than posted one by one (its levels: :meth:`count_level`)."""
        self.bytes_sent[node] += nbytes
        self.messages_sent[node] += messages

    def count_level(self, level: str, nbytes: int) -> None:
        """Count ``nbytes`` moved at ``level`` (``inter_node`` or ``intra_node``) outside :meth:`post`."""
        self.bytes_by_level[level] += nbytes

    def post(self, source: int, target: int, nbytes: int, deliver: Callable[[], Any]) -> simpy.Event:
        """Queue a transfer; ``deliver`` runs at arrival, when the returned event also fires."""
        if source == target:
            raise ValueError(f"node {source} cannot send a message to itself")
        machines = self.machines
        level = machines.level(source, target)
        model = machines.model(level)
        gather_seconds, gather_bytes = machines.arrival(target, nbytes)
        self.bytes_sent[source] += nbytes
        self.messages_sent[source] += 1
        self.bytes_by_level[level] += nbytes
        self.bytes_by_level["intra_node"] += gather_bytes
        send_port, receive_port = self._ports(level, source, target)
        transfer = Transfer(source, target, nbytes, deliver, self.env.event(), next(self._sequence), model,
                            send_port, receive_port, machines.link(level, source, target),
                            model.latency + gather_seconds)
        # Nothing was freed, so no other waiting transfer became ready: only this one can start now.
        if self._ready(transfer):
            self._start(transfer)
        else:
            for index, key in ((self._by_send_port, send_port), (self._by_receive_port, receive_port),
                               (self._by_link, transfer.link)):
                index[key][transfer.sequence] = transfer
        return transfer.done

    def _ports(self, level: str, source: int, target: int) -> tuple[int, int]:
        """The send and receive ports of a transfer: the machines' interfaces, or the nodes' ports inside one."""
        if level == "inter_node":
            return self._machine[source], self._machine[target]
        return self._intra_port + source, self._intra_port + target

    def drop(self, source: int) -> None:
        """Node ``source`` stops sending (it left, :mod:`lightning_dist.sim.churn`): its transfers are cancelled.

        Queued transfers never leave (their bytes and messages are uncounted); those in transmission
        stop now, free their ports and link at once and never arrive (their bytes stay counted: they
        were on the wire). Their ``done`` events never fire. Transfers to ``source`` go on and are lost
        on arrival (:meth:`Node.deliver`), as a sender only learns that its peer is gone by trying.
        """
        for port in (self._machine[source], self._intra_port + source):
            for transfer in [queued for queued in self._by_send_port[port].values() if queued.source == source]:
                self.bytes_sent[source] -= transfer.nbytes
                self.messages_sent[source] -= 1
                self.bytes_by_level[self.machines.level(source, transfer.target)] -= transfer.nbytes
                self.bytes_by_level["intra_node"] -= self.machines.arrival(transfer.target, transfer.nbytes)[1]
                transfer.cancelled = transfer.started = True  # started: the wake-up scans skip it
                del self._by_send_port[port][transfer.sequence]
                self._by_receive_port[transfer.receive_port].pop(transfer.sequence, None)
                self._by_link[transfer.link].pop(transfer.sequence, None)
        for transfer in list(self._sending[source].values()):
            transfer.cancelled = True
            self._release(transfer)

    def _send_room(self, port: int) -> bool:
        free = self._send_free[port]
        return free is None or free > 0

    def _receive_room(self, port: int) -> bool:
        free = self._receive_free[port]
        return free is None or free > 0

    def _ready(self, transfer: Transfer) -> bool:
        return (
            self._send_room(transfer.send_port)
            and self._receive_room(transfer.receive_port)
            and transfer.link not in self._busy_links
        )

    def _start(self, transfer: Transfer) -> None:
        transfer.started = True
        self._by_send_port[transfer.send_port].pop(transfer.sequence, None)
        self._by_receive_port[transfer.receive_port].pop(transfer.sequence, None)
        self._by_link[transfer.link].pop(transfer.sequence, None)
        self._occupy(transfer, -1)
        self._sending[transfer.source][transfer.sequence] = transfer
        self.env.timeout(transfer.model.transmission_seconds(transfer.nbytes)).callbacks.append(
            lambda _event: self._transmitted(transfer)
        )

    def _occupy(self, transfer: Transfer, change: int) -> None:
        if self._send_free[transfer.send_port] is not None:
            self._send_free[transfer.send_port] += change
        if self._receive_free[transfer.receive_port] is not None:
            self._receive_free[transfer.receive_port] += change
        if change < 0:
            self._busy_links.add(transfer.link)
        else:
            self._busy_links.discard(transfer.link)

    def _transmitted(self, transfer: Transfer) -> None:
        if transfer.cancelled:  # dropped in transmission; its resources were freed then
            return
        self._release(transfer)
        self.env.timeout(transfer.delay).callbacks.append(lambda _event: self._arrive(transfer))

    def _release(self, transfer: Transfer) -> None:
        """The transfer's last byte left (or it was cancelled): free its ports and link, start what waits for them."""
        del self._sending[transfer.source][transfer.sequence]
        self._occupy(transfer, +1)
        self._wake(transfer)

    def _wake(self, finished: Transfer) -> None:
        """Start, in posting order, the waiting transfers that the freed ports and link allow."""
        groups = [
            (lambda: self._send_room(finished.send_port), list(self._by_send_port[finished.send_port].values())),
            (lambda: self._receive_room(finished.receive_port),
             list(self._by_receive_port[finished.receive_port].values())),
            (lambda: finished.link not in self._busy_links, list(self._by_link[finished.link].values())),
        ]
        positions = [0] * len(groups)
        while True:
            earliest = None
            for group, (has_room, waiting) in enumerate(groups):
                if not has_room():
                    continue
                while positions[group] < len(waiting) and waiting[positions[group]].started:
                    positions[group] += 1
                if positions[group] < len(waiting) and (
                    earliest is None
                    or waiting[positions[group]].sequence < groups[earliest][1][positions[earliest]].sequence
                ):
                    earliest = group
            if earliest is None:
                return
            candidate = groups[earliest][1][positions[earliest]]
            positions[earliest] += 1
            if self._ready(candidate):
                self._start(candidate)

    @staticmethod
    def _arrive(transfer: Transfer) -> None:
        transfer.deliver()
        transfer.done.succeed()
