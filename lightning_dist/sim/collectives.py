"""Collectives among worker nodes: all-reduce and all-gather, timed as Gloo's ring (the default) or NCCL's ring or tree.

Which cost model times them is ``Simulation(collectives=...)``: ``"gloo_ring"`` (the default, what the strategies
run on a Gloo group, as the measured CPU runs do; below) or ``"nccl"`` (what a GPU cluster's DDP runs: NCCL's ring,
ordered machine by machine, or its double binary tree, whichever NCCL's tuner predicts faster for the message size
and the members; :mod:`lightning_dist.sim.nccl`). Both time every collective of the protocols and of DDP alike;
a protocol's point-to-point messages keep the network model's own timing (:mod:`lightning_dist.sim.network`).
Either way the result comes once the last member has joined and the collective's duration has passed, and the
bytes are counted as below.

What Gloo does (torch 2.13's ``ProcessGroupGloo`` on CPU tensors calls ``gloo::allreduce`` and
``gloo::allgather`` with their default algorithms, ``gloo/allreduce.cc`` and ``gloo/allgather.cc``):

- **all-reduce** is the ring: a reduce-scatter, then an all-gather, around the ring
  ``rank -> rank - 1``. Each phase moves ``(N - 1) / N`` of the tensor out of every rank and
  into every rank, so each member sends and receives ``2 (N - 1) / N * M`` bytes; the textbook
  ring does it in ``2 (N - 1)`` steps of one ``M / N`` chunk each. (Gloo cuts chunks into
  segments of at most 1 MiB with two in flight, which hides part of the per-step latency; the
  bytes are the same.)
- **all-gather** is the ring too: ``N - 1`` steps, each forwarding one member's tensor, so every
  member sends and receives ``(N - 1) * b`` bytes.

Timing under ``"gloo_ring"``. The simulator does not move the chunks as messages (a 256-member ring
is 130,560 messages per all-reduce); once the last member has joined, every member waits for the
ring's duration under the :class:`~lightning_dist.sim.network_model.NetworkModel` and then receives
the result:

- all-reduce: ``2 (N - 1) * (M / N / rate + latency)``; all-gather: ``(N - 1) * (b / rate + latency)``,
  with ``rate`` the rate of one transfer (``min(node, link)``). In every step a member sends one
  chunk on one link and receives one on another, so each port carries one transfer at a time.
- With two members both neighbours are the same peer; under ``half_duplex_links`` (Gloo moves a
  pair's two directions one after the other) each step carries two chunks over that link:
  ``2 * chunk / rate + latency`` a step.

This is exactly what the same ring takes as chunk messages through the network model when no
other traffic crosses the members' ports (tested against a message-level ring; for two members
on half-duplex links the message-level ring overlaps one direction's latency with the other's
transfer, so there the formula is equal without latency and an upper bound with it). The collective
does not occupy the members' ports: traffic of other messages during it is not slowed by it.
The protocols that use it call it with every worker a member, so nothing else is in flight.
The reduction's own arithmetic costs no virtual time (it is a few additions per byte moved).

Bytes are counted as :class:`~lightning_dist.comm.Communicator` counts them, so simulated bytes
compare with a strategy's ``protocol`` bytes: an all-reduce records ``2 (N - 1) M`` bytes in total,
``floor`` of an equal share per member with the remainder on the first member, and ``2 (N - 1)``
messages per member; an all-gather ``(N - 1) b`` bytes and ``N - 1`` messages per member.

Machines of several ranks (:mod:`lightning_dist.sim.machines`): a ring step lasts as long as its slowest
port (:meth:`Machines.ring_step <lightning_dist.sim.machines.Machines.ring_step>`: a machine's interface
carries one chunk per ring edge leaving it, the edges inside machines go at the intra rate), and the ring's
bytes count as ``inter_node`` in the share of its edges that cross between machines, the rest as
``intra_node`` (under ``"nccl"`` the edges of its ring ordered machine by machine, also when the tree ran: the
Communicator counts the ring's volume whatever algorithm the backend picks). With one learner per machine the
result reaches the members once each machine has all-gathered it (``M`` of an all-reduce, the ``N b`` of an
all-gather), counted ``intra_node``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import simpy

from lightning_dist.sim.machines import Machines
from lightning_dist.sim.network import Network


@dataclass
class _Pending:
    kind: str
    members: tuple[int, ...]
    nbytes: int
    combine: Callable[[list[Any]], Any]
    done: simpy.Event
    payloads: dict[int, Any] = field(default_factory=dict)


class Collectives:
    """The collectives in progress on one simulator, each named by a key its members share."""

    def __init__(self, env: simpy.Environment, machines: Machines, network: Network) -> None:
        self.env = env
        self.machines = machines
        self.network = network
        self._pending: dict[Hashable, _Pending] = {}

    def join(
        self,
        kind: str,
        key: Hashable,
        node: int,
        members: Sequence[int],
        payload: Any,
        nbytes: int,
        combine: Callable[[list[Any]], Any],
    ) -> Generator[simpy.Event, Any, Any]:
        """Node ``node`` joins collective ``key`` of ``kind`` ("all_reduce" or "all_gather") with ``payload``.

        Every member must join with the same ``kind``, ``members`` and ``nbytes``. Once the last
        has joined, ``combine`` runs once on the payloads in member order; every member gets its
        result after the collective's duration.
        """
        members = tuple(members)
        if node not in members:
            raise ValueError(f"node {node} joins collective {key!r} but is not one of its members {list(members)}")
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = _Pending(kind, members, nbytes, combine, self.env.event())
        elif (pending.kind, pending.members, pending.nbytes) != (kind, members, nbytes):
            raise ValueError(
                f"collective {key!r}: node {node} joins as {kind} of {nbytes} bytes among {list(members)}, "
                f"others as {pending.kind} of {pending.nbytes} bytes among {list(pending.members)}"
            )
        if node in pending.payloads:
            raise ValueError(f"node {node} joins collective {key!r} twice")
        pending.payloads[node] = payload
        if len(pending.payloads) == len(members):
            del self._pending[key]
            self._start(pending)
        return (yield pending.done)

    def leave(self, node: int) -> None:
        """Node ``node`` left (:mod:`lightning_dist.sim.churn`): the collectives not yet started go on without it.

        It is removed from their members (its payload too, if it had joined); one whose remaining
        members have all joined starts now, one left without members is dropped. The protocol that
        names the members must drop the node from the members it passes from now on. A collective
        already running (its ring started) ends as computed, the leaver's payload included.
        """
        for key, pending in list(self._pending.items()):
            if node not in pending.members:
                continue
            pending.members = tuple(member for member in pending.members if member != node)
            pending.payloads.pop(node, None)
            if not pending.members:
                del self._pending[key]
            elif len(pending.payloads) == len(pending.members):
                del self._pending[key]
                self._start(pending)

    def _start(self, pending: _Pending) -> None:
        count = len(pending.members)
        result = pending.combine([pending.payloads[member] for member in pending.members])
        if pending.kind == "all_reduce":
            arrived = pending.nbytes
            total = 2 * (count - 1) * pending.nbytes
            shares = [total // count] * count
            shares[0] += total % count
            messages = 2 * (count - 1)
        else:
            arrived = count * pending.nbytes
            total = count * (count - 1) * pending.nbytes
            shares = [(count - 1) * pending.nbytes] * count
            messages = count - 1
        ring_seconds, crossing = self.machines.collective(pending.kind, pending.members, pending.nbytes)
        gather_seconds, gather_bytes = self.machines.arrival(pending.members[0], arrived)
        for member, share in zip(pending.members, shares):
            self.network.count(member, share, messages)
        inter = total * crossing // count
        self.network.count_level("inter_node", inter)
        self.network.count_level("intra_node", total - inter + count * gather_bytes)
        seconds = ring_seconds + gather_seconds
        self.env.timeout(seconds).callbacks.append(lambda _event: pending.done.succeed(result))
