"""Segmented gossip (paper 002) in the simulator: no server, only worker-to-worker pulls.

Every ``period`` steps a worker draws the round's pull plan from the seed all workers share
(:func:`~lightning_dist.algorithms.segmented_gossip.pull_plan`), sends each of its pullers the
segments that :func:`~lightning_dist.algorithms.segmented_gossip.transfers` assigns to that link,
waits for the segments it pulls, and aggregates them
(:func:`~lightning_dist.algorithms.segmented_gossip.aggregate`), exactly as
:class:`~lightning_dist.strategies.SegmentedGossipStrategy` does between processes. With the
network model's per-link and per-node caps this is paper 002's setting.

``topology="strategy"`` adds what the strategy sends besides the segments: before every round all
workers all-gather a 1-byte finiteness flag (``raise_if_non_finite``, a meeting of all workers).
With the default, ``"server"`` (the papers' setting; gossip has no server), only the segments
travel and models are checked in place. Gloo moves a pair's two directions one after the other:
``NetworkModel(half_duplex_links=True)`` models that (measured in ``benchmarks/sim_paper002.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dist.algorithms.segmented_gossip import (
    aggregate,
    check_gossip_arguments,
    mixed_from_pulls,
    pack_segments,
    pull_plan,
    segment_bounds,
    transfers,
)
from lightning_dist.sim.engine import Node
from lightning_dist.sim.protocols.base import Program, Protocol, check_topology
from lightning_dist.sim.replica import NonFiniteModelError, check_finite


class SegmentedGossip(Protocol):
    """Args:
    segments: ``S >= 1``, segments per model; 1 is plain gossip. Default 10 (paper 002).
    replicas: ``R`` peers each segment is pulled from, in ``[1, workers - 1]``. Default 2.
    period: ``tau >= 1``, local steps between rounds. Default 40.
    seed: seeds the pull plans.
    topology: ``"server"`` (the segments only) or ``"strategy"`` (also the strategy's all-gathered
        finiteness flags before each round).
    """

    name = "segmented_gossip"
    arguments = ("segments", "replicas", "period", "seed", "topology")

    def __init__(
        self, segments: int = 10, replicas: int = 2, period: int = 40, seed: int = 0, topology: str = "server"
    ) -> None:
        check_gossip_arguments(segments, replicas, period)
        self.segments = segments
        self.replicas = replicas
        self.period = period
        self.seed = seed
        self.topology = check_topology(topology)

    def validate(self, num_workers: int, max_steps: int) -> None:
        if num_workers < 2 or self.replicas > num_workers - 1:
            raise ValueError(
                f"replicas must be in [1, workers - 1] = [1, {num_workers - 1}] (distinct peers per segment); "
                f"got replicas={self.replicas} with {num_workers} workers"
            )

    def setup(self, simulation) -> None:  # type: ignore[no-untyped-def]
        super().setup(simulation)
        self._generator = torch.Generator().manual_seed(self.seed)
        self._plans: list[tuple[Tensor, dict[tuple[int, int], list[int]]]] = []
        self.bounds = segment_bounds(simulation.replicas[0].get().numel(), self.segments)
        self.rounds_done = 0

    def plan(self, round_index: int) -> tuple[Tensor, dict[tuple[int, int], list[int]]]:
        """The pull plan of round ``round_index`` (from 1) and its links, drawn in round order."""
        while len(self._plans) < round_index:
            plan = pull_plan(self.simulation.num_workers, self.segments, self.replicas, self._generator)
            self._plans.append((plan, transfers(plan)))
        return self._plans[round_index - 1]

    def after_step(self, node: Node, rank: int, step: int) -> Program:
        if step % self.period:
            return
        round_index = step // self.period
        plan, links = self.plan(round_index)
        replica = self.simulation.replicas[rank]
        local = replica.get()
        if self.topology == "strategy":
            workers = list(range(self.simulation.num_workers))
            finite = bool(torch.isfinite(local).all())
            flags = yield from node.all_gather(("finite", round_index), workers, finite, nbytes=1)
            if not all(flags):
                raise NonFiniteModelError(
                    f"workers {[worker for worker, ok in enumerate(flags) if not ok]} have non-finite models; "
                    "refusing to exchange them"
                )
        check_finite(local, rank)
        tag = ("segments", round_index)
        pulls = {}
        for (provider, puller), segments in links.items():
            if provider == rank:
                node.send(puller, pack_segments(local, self.bounds, segments), tag=tag)
            elif puller == rank:
                pulls[provider] = segments
        received = {}
        for _ in pulls:
            message = yield node.recv(tag=tag)
            received[message.source] = (pulls[message.source], message.payload)
        mixed = mixed_from_pulls(local, plan[rank], self.bounds, received)
        sizes = self.simulation.dataset_sizes
        merged = yield from node.execute(
            aggregate, local, mixed, plan[rank], self.bounds, sizes, rank, kind="aggregate"
        )
        replica.set(merged)
        if rank == 0:
            self.rounds_done += 1

    def global_model(self) -> Tensor:
        """The ``|D_j|``-weighted mean of the replicas, as :class:`~lightning_dist.strategies.SegmentedGossipStrategy`
        evaluates and checkpoints it (paper 002's global model)."""
        return self.simulation.consensus(self.simulation.dataset_sizes.tolist())

    def metrics(self) -> dict[str, float]:
        return {"segmented_gossip/rounds": float(self.rounds_done)}
