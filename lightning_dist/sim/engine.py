"""Virtual time and virtual nodes: paper 001's Scheduler and Worker on top of simpy.

Paper 001 (section 3.3) runs every node as a coroutine under one scheduler that owns virtual time
and wakes a coroutine when the event it waits for (a timer, a message) is due. simpy's
:class:`~simpy.Environment` is exactly that scheduler (a heap of timed events, generator
processes, deterministic order for simultaneous events), so nodes here are simpy processes.

A node's process is a generator; it waits with ``yield``::

    def run(node):
        loss = yield from node.execute(replica.step)       # real compute; advances virtual time
        node.send(peer, tensor, tag="model")                # returns at once; the network moves it
        message = yield node.recv(source=peer, tag="model")
        mean = yield from node.all_reduce(key, members, tensor, combine)   # a collective among worker nodes
        yield node.sleep(0.5)

``execute`` runs the function for real and occupies the node for its duration in virtual time:
the measured wall time, or what the :class:`SpeedModel` says, for reproducible runs and for
stragglers. What the function changes becomes visible when that interval ends (see
:meth:`Node.execute`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, TypeVar

import numpy as np
import simpy
from torch import Tensor

from lightning_dist.sim.collectives import Collectives
from lightning_dist.sim.machines import Machines
from lightning_dist.sim.network import Network
from lightning_dist.sim.network_model import NetworkModel

T = TypeVar("T")


def payload_bytes(payload: Any) -> int:
    """Bytes a payload occupies on the wire: tensors by their storage, scalars 8 bytes, containers summed."""
    if isinstance(payload, Tensor):
        return payload.numel() * payload.element_size()
    if isinstance(payload, (bool, int, float)):
        return 8
    if payload is None or isinstance(payload, str):
        return 0
    if isinstance(payload, Mapping):
        return sum(payload_bytes(value) for value in payload.values())
    if isinstance(payload, (list, tuple)):
        return sum(payload_bytes(item) for item in payload)
    raise TypeError(f"cannot size a payload of type {type(payload).__name__}; pass nbytes explicitly")


@dataclass(frozen=True)
class Message:
    source: int
    tag: Hashable
    payload: Any
    nbytes: int
    sent_at: float


@dataclass
class SpeedModel:
    """How long ``execute`` takes in virtual time.

    Args:
        step_seconds: virtual seconds of one training step; None: the measured wall time of each
            call (realistic, but not reproducible).
        aggregate_seconds: virtual seconds of one aggregation on a server or coordinator; None:
            measured.
        slowdown: ``{node: factor}``, stragglers: that node's durations are multiplied by the factor.
        jitter: relative spread of modelled step times, each step drawn uniformly from
            ``step_seconds * [1 - jitter, 1 + jitter]`` with a per-node seeded generator; in [0, 1).
        seed: seeds the jitter.

    Kinds of ``execute``: ``"step"`` (a training step: forward, backward and the optimizer's
    update), ``"aggregate"`` (a server's or coordinator's averaging) and ``"update"`` (the optimizer's
    update run apart from the rest of its step, as DDP applies the all-reduced gradient): it is part
    of ``step_seconds`` when that is modelled (zero virtual seconds of its own), else its measured time.

    A run is deterministic when ``step_seconds`` and ``aggregate_seconds`` are both set: its virtual
    times; its losses, and through them what a protocol decides, also follow torch's kernels
    (:mod:`lightning_dist.sim.numerics`).
    """

    step_seconds: Optional[float] = None
    aggregate_seconds: Optional[float] = None
    slowdown: dict[int, float] = field(default_factory=dict)
    jitter: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("step_seconds", "aggregate_seconds"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be None (measured) or a finite number of seconds >= 0; got {value!r}")
        for node, factor in self.slowdown.items():
            if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
                raise ValueError(f"slowdown[{node}] must be a finite factor > 0; got {factor!r}")
        if not (isinstance(self.jitter, (int, float)) and 0 <= self.jitter < 1):
            raise ValueError(f"jitter must lie in [0, 1); got {self.jitter!r}")
        self._generators: dict[int, np.random.Generator] = {}

    @property
    def deterministic(self) -> bool:
        return self.step_seconds is not None and self.aggregate_seconds is not None

    def modelled(self, kind: str) -> bool:
        """Whether ``execute`` of ``kind`` ("step", "aggregate", "update") takes a modelled time, known first."""
        return (self.aggregate_seconds if kind == "aggregate" else self.step_seconds) is not None

    def duration(self, node: int, kind: str, measured: float) -> float:
        """Virtual seconds of one ``execute`` of ``kind`` ("step", "aggregate", "update") that took ``measured``."""
        modelled = self.aggregate_seconds if kind == "aggregate" else self.step_seconds
        if kind == "update" and modelled is not None:
            return 0.0
        seconds = measured if modelled is None else modelled
        if kind == "step" and modelled is not None and self.jitter:
            generator = self._generators.setdefault(node, np.random.default_rng([self.seed, node]))
            seconds *= 1 + self.jitter * (2 * generator.random() - 1)
        return seconds * self.slowdown.get(node, 1.0)


class Node:
    """A virtual computer: compute, a send port and a receive port (paper 001's Worker, Table 2)."""

    def __init__(self, simulator: Simulator, index: int, name: str) -> None:
        self.simulator = simulator
        self.index = index
        self.name = name
        self.mailbox = simpy.FilterStore(simulator.env)
        self.present = True
        """False while the node is away (:mod:`lightning_dist.sim.churn`): messages reaching it are lost."""
        self.compute_seconds = 0.0
        self.wall_compute_seconds = 0.0

    @property
    def now(self) -> float:
        return self.simulator.env.now

    def send(self, target: int, payload: Any, tag: Hashable = None, nbytes: Optional[int] = None) -> simpy.Event:
        """Post ``payload`` to node ``target``; returns an event that fires when it has arrived.

        The caller need not wait for it: sending is independent of compute. A message to the node
        itself (between two programs of one node, :meth:`Simulator.add_program`) is a local call:
        delivered at once, without bytes.
        """
        if target == self.index:
            self.mailbox.put(Message(self.index, tag, payload, 0, self.now))
            return self.simulator.env.event().succeed()
        size = payload_bytes(payload) if nbytes is None else nbytes
        message = Message(self.index, tag, payload, size, self.now)
        target_node = self.simulator.nodes[target]
        return self.simulator.network.post(self.index, target, size, lambda: target_node.deliver(message))

    def deliver(self, message: Message) -> None:
        """Put an arrived message in the mailbox; lost if the node is away (nobody is there to take it)."""
        if self.present:
            self.mailbox.put(message)

    def set_present(self, present: bool) -> None:
        """Mark the node away or back (:mod:`lightning_dist.sim.churn`). Either way its mailbox starts empty:
        what arrived before a leave is lost with the node, and waits its programs left behind (interrupted
        in a ``recv``) stay with the old mailbox instead of taking messages meant for the node's next life."""
        self.present = present
        self.mailbox = simpy.FilterStore(self.simulator.env)

    def recv(self, source: Optional[int] = None, tag: Hashable = None) -> simpy.Event:
        """An event whose value is the first arrived :class:`Message` matching ``source`` and ``tag``
        (None matches any), in arrival order."""
        return self.mailbox.get(lambda message: _matches(message, source, tag))

    def recv_any(self, tags: Sequence[Hashable]) -> simpy.Event:
        """An event whose value is the first arrived :class:`Message` whose tag is one of ``tags``."""
        return self.mailbox.get(lambda message: message.tag in tags)

    def recv_nowait(self, source: Optional[int] = None, tag: Hashable = None) -> Optional[Message]:
        """The first arrived matching message, removed from the mailbox; None if none has arrived."""
        for message in self.mailbox.items:
            if _matches(message, source, tag):
                self.mailbox.items.remove(message)
                return message
        return None

    def execute(self, fn: Callable[..., T], *args: Any, kind: str = "step") -> Generator[simpy.Event, Any, T]:
        """Run ``fn(*args)`` as this node's compute: the node is busy for its duration, and what ``fn``
        changes becomes visible when that interval ends. A learner of several ranks
        (:mod:`lightning_dist.sim.machines`) adds its gradient all-reduce to a training step's duration.

        Use as ``result = yield from node.execute(fn, ...)``. With a modelled duration
        (:meth:`SpeedModel.modelled`) the node waits first and runs ``fn`` at the end of its
        interval, so nothing that happens during the interval (an evaluation, another node) sees
        its effect early. A measured duration is known only once ``fn`` has run, so ``fn`` then runs
        at the start, and a reader that must not see its effect before the interval ends reads a
        copy taken before the call (the simulation does so for training steps).
        """
        speed, machines = self.simulator.speed, self.simulator.machines
        if kind == "step" and machines.step_bytes:
            self.simulator.network.count_level("intra_node", machines.step_bytes)
        if speed.modelled(kind):
            seconds = speed.duration(self.index, kind, 0.0) + machines.gradient_seconds(kind)
            yield self.simulator.env.timeout(seconds)
            result, measured = _timed(fn, args)
        else:
            result, measured = _timed(fn, args)
            seconds = speed.duration(self.index, kind, machines.compute_share(kind, measured))
            seconds += machines.gradient_seconds(kind)
            yield self.simulator.env.timeout(seconds)
        self.wall_compute_seconds += measured
        self.compute_seconds += seconds
        return result

    def all_reduce(
        self,
        key: Hashable,
        members: Sequence[int],
        payload: Any,
        combine: Callable[[list[Any]], T],
        nbytes: Optional[int] = None,
    ) -> Generator[simpy.Event, Any, T]:
        """Join the ring all-reduce ``key`` among ``members`` (node indices, every one must join with the same
        key, members and size); returns ``combine(payloads in member order)`` once the ring would have ended.

        Use as ``mean = yield from node.all_reduce(key, members, vector, combine)``. ``nbytes`` is the
        size of the tensor the ring reduces (default: ``payload``'s). Timing and byte counts:
        :mod:`lightning_dist.sim.collectives`.
        """
        size = payload_bytes(payload) if nbytes is None else nbytes
        collectives = self.simulator.collectives
        return (yield from collectives.join("all_reduce", key, self.index, members, payload, size, combine))

    def all_gather(
        self, key: Hashable, members: Sequence[int], payload: Any, nbytes: Optional[int] = None
    ) -> Generator[simpy.Event, Any, list[Any]]:
        """Join the ring all-gather ``key`` among ``members``; returns every member's payload in member order."""
        size = payload_bytes(payload) if nbytes is None else nbytes
        collectives = self.simulator.collectives
        return (yield from collectives.join("all_gather", key, self.index, members, payload, size, list))

    def sleep(self, seconds: float) -> simpy.Event:
        if not seconds >= 0:
            raise ValueError(f"seconds must be >= 0; got {seconds!r}")
        return self.simulator.env.timeout(seconds)


def _timed(fn: Callable[..., T], args: tuple[Any, ...]) -> tuple[T, float]:
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def _matches(message: Message, source: Optional[int], tag: Hashable) -> bool:
    return (source is None or message.source == source) and (tag is None or message.tag == tag)


class Simulator:
    """The scheduler: owns virtual time, the nodes and the network (paper 001, Table 3).

    ``machines`` says which nodes share a machine and its interface (:mod:`lightning_dist.sim.machines`); by
    default every node is a machine of its own under ``network``.
    """

    def __init__(self, network: NetworkModel, speed: Optional[SpeedModel] = None,
                 machines: Optional[Machines] = None) -> None:
        self.env = simpy.Environment()
        self.network_model = network
        self.machines = machines if machines is not None else Machines(network)
        self.speed = speed if speed is not None else SpeedModel()
        self.nodes: list[Node] = []
        self._programs: list[tuple[Node, Callable[[Node], Generator]]] = []
        self.network: Optional[Network] = None
        self.collectives: Optional[Collectives] = None
        self.processes: dict[int, list[simpy.Process]] = {}
        """The running processes of each node (its programs, and those :meth:`spawn` started)."""

    def add_node(self, name: str, program: Callable[[Node], Generator]) -> Node:
        """Add a node that runs ``program(node)`` (a generator function) when the simulation starts."""
        if self.network is not None:
            raise RuntimeError("nodes must be added before the simulation starts")
        node = Node(self, len(self.nodes), name)
        self.nodes.append(node)
        self._programs.append((node, program))
        return node

    def add_program(self, index: int, program: Callable[[Node], Generator]) -> None:
        """Also run ``program(node)`` on node ``index`` (a second thread of that computer, e.g. a server)."""
        if self.network is not None:
            raise RuntimeError("programs must be added before the simulation starts")
        self._programs.append((self.nodes[index], program))

    def start(self) -> None:
        self.network = Network(self.env, self.machines, len(self.nodes))
        self.collectives = Collectives(self.env, self.machines, self.network)
        for node, program in self._programs:
            self.spawn(node.index, program)

    def spawn(self, index: int, program: Callable[[Node], Generator]) -> simpy.Process:
        """Start ``program(node)`` on node ``index`` now (a worker that joins during the run)."""
        process = self.env.process(program(self.nodes[index]))
        self.processes.setdefault(index, []).append(process)
        return process

    def interrupt(self, index: int) -> None:
        """Stop every process of node ``index`` at the current virtual instant (a worker that leaves): each gets
        :class:`simpy.Interrupt` where it waits, before any other event of this instant resumes it."""
        for process in self.processes.pop(index, []):
            if process.is_alive:
                process.interrupt("left")

    def run(self, until: Optional[float] = None) -> float:
        """Run until no event is left (or virtual time ``until``); returns the virtual time reached."""
        if self.network is None:
            self.start()
        self.env.run(until=until)
        return self.env.now
