"""NCCL's all-reduce and all-gather under the simulator's network model (``Simulation(collectives="nccl")``): a ring
or a double binary tree, whichever NCCL's tuner predicts faster for the message's size and the ranks.

A GPU cluster's DDP runs NCCL, not Gloo's ring (:mod:`lightning_dist.sim.collectives`, the default
``collectives="gloo_ring"``, what the measured CPU runs use). NCCL times every algorithm with its own cost model
and runs the fastest; this module is that model reduced to the two algorithms a cluster without in-network
reduction has, over the simulator's :class:`~lightning_dist.sim.network_model.NetworkModel` (``network`` between
machines, ``intra`` between two ranks of a machine, as in :mod:`lightning_dist.sim.machines`). Sources:

- NVIDIA/nccl ``src/graph/tuning.cc`` (at commit b6475625): ``ncclTopoTuneModel`` gives each collective,
  algorithm and protocol a latency and a bandwidth, and ``ncclTopoGetAlgoTime`` predicts
  ``time = latency + nBytes / bandwidth``. The ring's latency is
  ``(nsteps - nInterSteps) * intraLat + nInterSteps * interLat`` with ``nsteps = 2 (nRanks - 1)`` for an all-reduce
  and ``nRanks - 1`` for an all-gather, ``nInterSteps = 2 nNodes`` and ``nNodes - 1``; the tree's is
  ``2 ((nRanks / nNodes - 1) * intraLat + log2i(nNodes) * interLat)``, a chain through the ranks of each machine and
  a binary tree over the machines, up and down. A bus bandwidth ``busBw`` (the link's) becomes the algorithm's
  bandwidth by ``busBw * nRanks / nsteps`` for the ring and ``busBw * 0.5`` for the tree, whose ``busBw`` is first
  cut to ``0.92`` of the link's (``if (a == NCCL_ALGO_TREE) busBw = std::min(busBw*.92, ...)``). Only the ring
  all-gathers (the tree is the all-reduce's alone).
- NVIDIA/nccl-tests ``doc/PERFORMANCE.md``: an all-reduce of ``S`` bytes over ``n`` ranks of bandwidth ``B`` each
  takes at best ``t = S * 2 (n - 1) / (n B)``, so ``busbw = algbw * 2 (n - 1) / n``; an all-gather ``(n - 1) / n``.
- NVIDIA/nccl issue 457 (its maintainer): for each size NCCL estimates the time of every algorithm and protocol
  "then take[s] the lowest"; per all-reduce of ``S`` bytes a ring rank sends and receives ``2 (N - 1) S / N``, a tree
  rank ``2 S``.

The model here, for ``N`` ranks on ``M`` machines, at most ``p`` of them on one machine, ``S`` bytes, one transfer's
rate ``B`` on the slowest level the collective crosses (``network`` if ``M > 1``, ``intra`` if ``p > 1``; ``min(node,
link)`` of that level) and the two levels' latencies ``l_inter``, ``l_intra``:

- **ring all-reduce**: ``2 (N - 1)`` steps of one ``S / N`` chunk, NCCL's ring ordered machine by machine (so a
  machine's interface carries one chunk per step and the slower level, usually between machines, sets the pace);
  ``h = min(2 M, 2 (N - 1))`` of a chunk's hops cross machines (twice around the ring, each of the ``M`` machine
  boundaries twice; every hop when each rank is a machine), the others stay inside one:
  ``(2 (N - 1) - h) l_intra + h l_inter + 2 (N - 1) (S / N) / B``. With one rank per machine this is Gloo's ring,
  ``2 (N - 1) (l + S / N / B)``. Where ranks share machines it is less than Gloo's (whose every step waits for the
  inter-node latency): NCCL pipelines small slices, so a step's latency is the hop's.
- **tree all-reduce** (the double binary tree): ``2 (p - 1) l_intra + 2 floor(log2 M) l_inter + 2 S / (0.92 B)``: a
  rank (a machine's interface) sends and receives ``2 S`` (the two trees each carry half, a rank is a leaf of one and
  inside the other), about the ring's ``2 (N - 1) S / N`` for many ranks, at 92% of the link, in ``2 log2 M`` hops
  between machines instead of ``2 M``.
- **NCCL's choice**: the lower of the two (the ring on a tie): the tree for small messages among many ranks, where
  the ring's ``2 (N - 1)`` latencies dominate; the ring for large ones, where the tree's slower bandwidth does.
  One rank per machine, the tree wins below ``S* = 2 l B (N - 1 - floor(log2 N)) / (2 / 0.92 - 2 (N - 1) / N)``.
- **ring all-gather** of ``b`` bytes per rank: ``N - 1`` steps of ``b``, ``h = M - 1`` hops between machines:
  ``(N - 1 - h) l_intra + h l_inter + (N - 1) b / B``.

Not modelled (each a refinement of ``tuning.cc`` this model leaves out): NCCL's protocols (LL, LL128, Simple) and
their bandwidth caps, the base latency of a call and the hardware latency tables (the simulator's ``latency`` is a
hop's), channels, the tree's correction factors for medium sizes and the ring's latency plateau, CollNet and NVLS,
the tree's 2-machine advantage (NVIDIA/nccl issue 946: half the traffic on the network), a link cap's parallel
lanes (a rank sends at one transfer's rate). ``half_duplex_links`` is Gloo's pair of processes taking turns;
NCCL's send and receive run at once, so it is ignored here. Collectives are only timed; bytes are counted as the
:class:`~lightning_dist.comm.Communicator` counts them (the ring's volume, whichever algorithm ran).
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_dist.sim.network_model import NetworkModel

COLLECTIVE_MODELS = ("gloo_ring", "nccl")
"""The cost models a simulation's collectives take: Gloo's ring (the default) or NCCL's ring and tree."""

TREE_BANDWIDTH = 0.92
"""The share of a link's bandwidth NCCL's tuner credits its tree with (``src/graph/tuning.cc``)."""


def check_collectives(value: object) -> str:
    """``collectives``: one of :data:`COLLECTIVE_MODELS`."""
    if not isinstance(value, str) or value not in COLLECTIVE_MODELS:
        raise ValueError(
            f"collectives must be one of {', '.join(repr(model) for model in COLLECTIVE_MODELS)} ('gloo_ring': Gloo's "
            f"ring, what CPU runs use; 'nccl': NCCL's ring or tree, whichever is faster, as on GPUs); got {value!r}"
        )
    return value


def _rate(network: NetworkModel, intra: NetworkModel, layout: Sequence[int]) -> float:
    """Bytes/s of one transfer on the slowest level the collective crosses (``inf`` without caps: no time)."""
    levels = ([network] if len(layout) > 1 else []) + ([intra] if max(layout) > 1 else [])
    return min(level.bytes_per_second for level in levels)


def ring_all_reduce_seconds(network: NetworkModel, intra: NetworkModel, layout: Sequence[int], nbytes: float) -> float:
    """NCCL's ring all-reduce of ``nbytes`` among ranks ``layout[m]`` of which sit on machine ``m``:
    ``(2 (N - 1) - h) l_intra + h l_inter + 2 (N - 1) (S / N) / B`` with ``h = min(2 M, 2 (N - 1))`` hops between
    machines (none on one machine)."""
    ranks, machines = sum(layout), len(layout)
    if ranks < 2:
        return 0.0
    steps = 2 * (ranks - 1)
    inter = min(2 * machines, steps) if machines > 1 else 0
    latency = (steps - inter) * intra.latency + inter * network.latency
    return latency + steps * (nbytes / ranks) / _rate(network, intra, layout)


def tree_all_reduce_seconds(network: NetworkModel, intra: NetworkModel, layout: Sequence[int], nbytes: float) -> float:
    """NCCL's double binary tree all-reduce of ``nbytes`` among ranks ``layout[m]`` of which sit on machine ``m``:
    ``2 (p - 1) l_intra + 2 floor(log2 M) l_inter + 2 S / (0.92 B)``."""
    if sum(layout) < 2:
        return 0.0
    depth = len(layout).bit_length() - 1  # floor(log2 M), NCCL's log2i
    latency = 2 * ((max(layout) - 1) * intra.latency + depth * network.latency)
    return latency + 2 * nbytes / (TREE_BANDWIDTH * _rate(network, intra, layout))


def all_reduce_seconds(
    network: NetworkModel, intra: NetworkModel, layout: Sequence[int], nbytes: float
) -> tuple[str, float]:
    """NCCL's all-reduce of ``nbytes`` among ranks ``layout[m]`` of which sit on machine ``m``: the algorithm its
    tuner picks (``"ring"`` or ``"tree"``, whichever it predicts faster; the ring on a tie) and that time."""
    ring = ring_all_reduce_seconds(network, intra, layout, nbytes)
    tree = tree_all_reduce_seconds(network, intra, layout, nbytes)
    return ("tree", tree) if tree < ring else ("ring", ring)


def all_gather_seconds(network: NetworkModel, intra: NetworkModel, layout: Sequence[int], nbytes: float) -> float:
    """NCCL's (ring) all-gather of ``nbytes`` per rank among ranks ``layout[m]`` of which sit on machine ``m``:
    ``(N - 1 - h) l_intra + h l_inter + (N - 1) b / B`` with ``h = M - 1`` hops between machines."""
    ranks = sum(layout)
    if ranks < 2:
        return 0.0
    steps, inter = ranks - 1, len(layout) - 1
    latency = (steps - inter) * intra.latency + inter * network.latency
    return latency + steps * nbytes / _rate(network, intra, layout)
