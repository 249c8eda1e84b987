"""Machines of several ranks (GPUs) in the simulator: which ranks share a network interface, and what one learner
per machine costs inside it (``Simulation(ranks_per_node=L, intra_node=..., hierarchy=...)``, issue 28).

Real clusters are machines (nodes) of several GPUs: inside a machine the ranks talk over a fast link
(NVLink, PCIe, shared memory), between machines every machine has one network interface that its
ranks share. With ``ranks_per_node=L`` the simulation's ``network``
(:class:`~lightning_dist.sim.network.NetworkModel`) is the model of each machine's interface to the other
machines: ``node_mbit`` caps what a *machine* sends and, apart, what it receives, ``link_mbit`` each connection
(a pair of ranks), ``latency`` a message between machines. ``intra_node`` is the link between two ranks of one machine
(default ``NetworkModel()``: no cap, no latency). With ``L = 1`` every rank is a machine of its own and the
simulator is what it was.

**Flat** (``hierarchy=None``: every rank a learner, what the strategies run without a hierarchy). Rank ``r``
sits on machine ``r // L``; a server or coordinator node is a machine of its own. A transfer between ranks of
two machines holds the sender's machine's send port and the receiver's machine's receive port (under
``network``), so the ranks of a machine queue for its interface; a transfer between two ranks of one machine
holds their own ports inside the machine (under ``intra_node``) and neither waits for nor delays the
interface. A ring collective (:mod:`lightning_dist.sim.collectives`) runs over its members in member order,
each sending to the previous member, one chunk on every ring edge per step, and a step lasts as long as its
slowest port: a machine whose members have ``k`` edges leaving the machine sends ``k`` chunks through its one
interface (``k = 1`` when the members are numbered machine by machine), the edges inside machines go in
parallel at the intra rate. So a step is the largest of ``k_m * chunk / rate + latency`` over machines and,
if an edge stays inside a machine, ``chunk / intra rate + intra latency``. With a link cap a port carries
``floor(node / link)`` chunks at once and a link one (:func:`ring_rounds`); Gloo's two-member half-duplex
rule is the case of a link that carries both edges of a step. That is Gloo's ring (``collectives="gloo_ring"``,
the default); under ``collectives="nccl"`` the ring is ordered machine by machine and a hop's latency is its
level's, or NCCL's tree runs instead (:mod:`lightning_dist.sim.nccl`).

**One learner per machine** (``hierarchy="node"``, what :mod:`lightning_dist.strategies._hierarchy` runs):

- The ``L`` ranks of a machine are DDP over the machine. A learner's replica is a
  :class:`~lightning_dist.sim.replica.NodeReplica`: its ranks' batches, the mean of their gradients, one
  optimizer step, local rank 0's buffers. A training step costs one rank's compute (the ranks compute in
  parallel: a modelled ``step_seconds`` as it is; a measured step ran the ``L`` ranks' forward and backward
  one after the other here, so its duration, the one optimizer update included, is divided by ``L``) plus the
  ring all-reduce of the gradients inside the machine, ``ring_all_reduce_seconds(intra_node, L, gradient
  bytes)``, after the whole backward: DDP overlaps its buckets with the backward, so this is an upper bound,
  as for the ``ddp`` protocol. Under ``collectives="nccl"`` NCCL's model times it (its ring, the same time but
  for Gloo's half-duplex pairs), and the all-gather below.
- The protocol runs on one simulator node per learner, whose ports are the machine's interface. Local rank
  ``j`` carries chunk ``j`` of every exchange through that one interface, all ``L`` at once; together they take
  what one transfer of the whole takes, and a ring of ``N`` learners moves ``L`` slice rings of ``1/L`` of the
  chunks in the time of one of the whole. Gloo's half-duplex rule for a pair of processes does not apply
  between learners: their ``L`` pairs take turns independently and fill both directions of the interface.
- What reaches a learner (a message's arrival, a collective's result) is usable once the machine has
  all-gathered its ``L`` chunks: ``ring_all_gather_seconds(intra_node, L, ceil(nbytes / L))`` later, ``nbytes``
  the bytes that reached it (a message's, an all-reduce's tensor, an all-gather's every payload).

Bytes by level (:data:`lightning_dist.comm.stats.LEVELS`): ``inter_node`` crossed between machines,
``intra_node`` stayed inside one (``Network.bytes_by_level``). Flat: a ring's bytes split by its edges, a
transfer by where it went; ``bytes_sent`` per rank counts both. Hierarchy: ``bytes_sent`` per learner is what
its machine sent to others; inside, as the strategies' Communicator counts a ring, ``2 (L - 1)`` times the
gradient bytes per machine and step and ``(L - 1) L ceil(nbytes / L)`` per machine and all-gather.

Not modelled: a topology inside the machine (NVLink or NVSwitch is a plain capped link between every pair
of ranks; no PCIe switches, NUMA or GPUDirect); in a hierarchy the machine's own traffic (the gradient
all-reduce, the all-gathers) is timed by the collective model's formulas, not queued against itself. The
all-gather is charged on every arrival: a protocol that exchanges pieces in several phases (subset averaging's
reduce and gather, segmented gossip's segments from several peers) pays it at each, where the strategy
all-gathers once at the end, and a push reaching DownpourSGD's server thread on learner 0's machine pays it
too: upper bounds.
Workers that leave and join (churn) are refused with ``L > 1``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any, Optional

from lightning_dist.algorithms.arguments import check_count, check_hierarchy
from lightning_dist.sim import nccl
from lightning_dist.sim.network_model import (
    NetworkModel,
    ring_all_gather_seconds,
    ring_all_reduce_seconds,
    ring_step_seconds,
)

INTER, INTRA = "inter_node", "intra_node"


def check_machines(workers: int, ranks_per_node: object, hierarchy: object) -> tuple[int, Optional[str]]:
    """``ranks_per_node`` (an integer >= 1 that divides ``workers``, the ranks in all) and ``hierarchy``."""
    ranks_per_node = check_count("ranks_per_node", ranks_per_node, 1, meaning=" (ranks, e.g. GPUs, per machine)")
    if workers % ranks_per_node:
        raise ValueError(
            f"workers must be a multiple of ranks_per_node (every machine holds ranks_per_node ranks); "
            f"got workers={workers}, ranks_per_node={ranks_per_node}"
        )
    return ranks_per_node, check_hierarchy(hierarchy)


def ring_rounds(model: NetworkModel, ports: Counter, links: Counter) -> int:
    """Rounds of transmissions one ring step takes on one level: ``ports`` counts the chunks each send or
    receive port carries, ``links`` those of each link; a port carries ``model.lanes`` at once (no limit
    without a node cap), a link one."""
    lanes = model.lanes
    port_rounds = 1 if lanes is None else -(-max(ports.values()) // lanes)
    return max(port_rounds, max(links.values()))


class Machines:
    """Which simulator node sits on which machine, and what a learner of ``L`` ranks costs inside its machine.

    Args:
        network: each machine's interface to the other machines.
        intra_node: the link between two ranks of one machine; default no cap, no latency.
        ranks_per_node: ``L``.
        ranks: the ranks in all (flat: nodes ``0 .. ranks - 1``; hierarchy: ``ranks // L`` learner nodes).
        hierarchy: None (flat) or ``"node"`` (one learner per machine).
        gradient_bytes: bytes of a learner's gradients (its trainable parameters), all-reduced inside the
            machine every step under a hierarchy.
        collectives: the collectives' cost model, ``"gloo_ring"`` (Gloo's ring over the members in member order,
            :mod:`lightning_dist.sim.collectives`) or ``"nccl"`` (NCCL's ring or tree, :mod:`lightning_dist.sim.nccl`);
            it also times a learner's all-reduce and all-gathers inside its machine.

    Nodes past the ranks (or learners) are servers, each a machine of its own.
    """

    def __init__(
        self,
        network: NetworkModel,
        intra_node: Optional[NetworkModel] = None,
        ranks_per_node: int = 1,
        ranks: int = 0,
        hierarchy: Optional[str] = None,
        gradient_bytes: int = 0,
        collectives: str = "gloo_ring",
    ) -> None:
        self.gathers = hierarchy is not None and ranks_per_node > 1
        """Whether what reaches a learner waits for the machine's all-gather (and its steps for the all-reduce)."""
        # Half-duplex links are Gloo's pair of processes taking turns. A learner of L > 1 ranks exchanges over L
        # pairs of processes at once (its slice groups), whose turns interleave and fill both directions of the
        # machine's interface (measured: a 2-node periodic round on 2 x 2 ranks takes 2.4 s, one model's time
        # at 20 Mbit/s, not two).
        self.network = replace(network, half_duplex_links=False) if self.gathers else network
        self.intra = intra_node if intra_node is not None else NetworkModel()
        self.ranks_per_node = ranks_per_node
        self.hierarchy = hierarchy
        self.shared = ranks_per_node if hierarchy is None else 1
        """Simulator nodes per machine: ``L`` flat, 1 under a hierarchy (a node is a machine's learner)."""
        self.workers = ranks if hierarchy is None else ranks // ranks_per_node
        self.gradient_bytes = gradient_bytes
        self.collectives = nccl.check_collectives(collectives)

    def machine_of(self, node: int) -> int:
        if node < self.workers:
            return node // self.shared
        return self.workers // self.shared + node - self.workers

    def level(self, source: int, target: int) -> str:
        """Where a transfer from node ``source`` to node ``target`` goes: between machines or inside one."""
        return INTER if self.machine_of(source) != self.machine_of(target) else INTRA

    def model(self, level: str) -> NetworkModel:
        return self.network if level == INTER else self.intra

    def link(self, level: str, source: int, target: int) -> tuple[str, int, int]:
        """The link a transfer holds: the connection of the two processes (both directions one link when the
        level's model has half-duplex links, Gloo's pair taking turns). Two pairs of ranks between the same two
        machines are two connections: they share the machines' interfaces (the ports), not a link."""
        if self.model(level).half_duplex_links:
            source, target = min(source, target), max(source, target)
        return level, source, target

    # ------------------------------------------------------------------ a learner of L ranks (hierarchy)

    def arrival(self, target: int, nbytes: int) -> tuple[float, int]:
        """Seconds after ``nbytes`` reached node ``target`` until its machine has all-gathered them, and the bytes
        that all-gather moves inside the machine; ``(0, 0)`` but for a learner of several ranks."""
        if not self.gathers or target >= self.workers:
            return 0.0, 0
        chunk = math.ceil(nbytes / self.ranks_per_node)
        return self._inside("all_gather", chunk), (self.ranks_per_node - 1) * self.ranks_per_node * chunk

    def compute_share(self, kind: str, measured: float) -> float:
        """The part of a measured ``execute`` of ``kind`` that one rank takes: a learner's training step ran its
        ``L`` ranks one after the other here, while they compute in parallel."""
        return measured / self.ranks_per_node if self.gathers and kind == "step" else measured

    def gradient_seconds(self, kind: str) -> float:
        """What an ``execute`` of ``kind`` adds after its compute: a learner's gradient ring all-reduce inside its
        machine after a training step; nothing otherwise."""
        if not self.gathers or kind != "step":
            return 0.0
        return self._inside("all_reduce", self.gradient_bytes)

    def _inside(self, kind: str, nbytes: int) -> float:
        """A collective of ``kind`` among the ``L`` ranks of one machine under the chosen model (NCCL's ring, its
        tree never faster on one machine, is Gloo's ring over ``intra_node`` but for Gloo's half-duplex pairs)."""
        if self.collectives == "nccl":
            return self._nccl(kind, [self.ranks_per_node], nbytes)
        ring = ring_all_reduce_seconds if kind == "all_reduce" else ring_all_gather_seconds
        return ring(self.intra, self.ranks_per_node, nbytes)

    def _nccl(self, kind: str, layout: list[int], nbytes: float) -> float:
        """NCCL's collective of ``kind`` among ranks ``layout[m]`` of which sit on machine ``m``."""
        if kind == "all_reduce":
            return nccl.all_reduce_seconds(self.network, self.intra, layout, nbytes)[1]
        return nccl.all_gather_seconds(self.network, self.intra, layout, nbytes)

    @property
    def step_bytes(self) -> int:
        """Bytes a learner's gradient all-reduce moves inside its machine each step, as a ring is counted."""
        return 2 * (self.ranks_per_node - 1) * self.gradient_bytes if self.gathers else 0

    # ------------------------------------------------------------------ collectives among nodes

    def collective(self, kind: str, members: Sequence[int], nbytes: int) -> tuple[float, int]:
        """A collective of ``kind`` among ``members`` under the chosen model: its seconds and how many edges of its
        ring cross between machines (the share of its bytes counted ``inter_node``). ``"all_reduce"`` reduces
        ``nbytes``, ``"all_gather"`` gathers ``nbytes`` from every member.

        Gloo's ring runs over the members in their order: ``2 (N - 1)`` (all-reduce, chunks of ``nbytes / N``) or
        ``N - 1`` (all-gather, chunks of ``nbytes``) steps of :meth:`ring_step`. NCCL orders its ring machine by
        machine, so ``M`` of its edges cross when the members span ``M > 1`` machines, and times it, or its tree, by
        :mod:`lightning_dist.sim.nccl` from how many members sit on each machine.
        """
        count = len(members)
        if count < 2:
            return 0.0, 0
        if self.collectives == "nccl":
            layout = list(Counter(self.machine_of(member) for member in members).values())
            return self._nccl(kind, layout, nbytes), len(layout) if len(layout) > 1 else 0
        steps, chunk = (2 * (count - 1), nbytes / count) if kind == "all_reduce" else (count - 1, nbytes)
        step_seconds, crossing = self.ring_step(members, chunk)
        return steps * step_seconds, crossing

    def ring_step(self, members: Sequence[int], chunk_bytes: float) -> tuple[float, int]:
        """One step of a ring over ``members`` (two or more nodes, each sending to the previous member) moving
        ``chunk_bytes`` on every edge: its seconds and how many of its edges cross between machines."""
        if self.shared == 1:
            return ring_step_seconds(self.network, len(members), chunk_bytes), len(members)
        ports: dict[str, Counter] = {INTER: Counter(), INTRA: Counter()}
        links: dict[str, Counter] = {INTER: Counter(), INTRA: Counter()}
        for index, source in enumerate(members):
            target = members[index - 1]
            level = self.level(source, target)
            if level == INTER:
                ports[level][("send", self.machine_of(source))] += 1
                ports[level][("receive", self.machine_of(target))] += 1
            else:
                ports[level].update([("send", source), ("receive", target)])
            links[level][self.link(level, source, target)] += 1
        seconds = max(
            ring_rounds(model, ports[level], links[level]) * model.transmission_seconds(chunk_bytes) + model.latency
            for level, model in ((INTER, self.network), (INTRA, self.intra)) if links[level]
        )
        return seconds, sum(links[INTER].values())

    def config(self) -> dict[str, Any]:
        """What a run's summary records of the machines."""
        return {"ranks_per_node": self.ranks_per_node, "hierarchy": self.hierarchy, "intra_node": asdict(self.intra),
                "collectives": self.collectives}
