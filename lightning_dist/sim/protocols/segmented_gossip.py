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
``NetworkModel(half_duplex_links=True)`` models that (measured in ``benchmarks/simulator/paper002.py``).

Churn (``topology="server"``, :mod:`lightning_dist.sim.churn`) follows paper 002's own rules
(section 4.2). The shared plan no longer tells a provider whom to serve, so pulls become the
paper's requests (8 bytes per segment), sent "even before the local update starts": a worker
requests round ``r + 1``'s segments once it has aggregated round ``r``, from its plan row with
every peer it marks offline replaced (:func:`~lightning_dist.algorithms.segmented_gossip.requested_providers`).
A provider serves a request from its model as it ended the round's local update, at once if it
got there, else when it does (the latest such model if it is already past that round).

- A puller finds a provider unreachable when its request reaches a worker that is away, or when
  the provider leaves before its segments have arrived (the connection drops). It marks it
  offline, requests those segments from another worker
  (:func:`~lightning_dist.algorithms.segmented_gossip.substitute_provider`) and stops pulling
  from it; with no other worker left it aggregates the segment over fewer providers.
- A provider that finds a puller away cancels its request and marks it offline.
- A flag is removed when communication is re-established: a request from the worker, or its
  segments arriving.
- A joiner gets the worker list (everyone, no flags; paper 002's registration server is not
  modelled), requests every segment of the latest round any present worker reached, from its
  plan row for that round, and aggregates them without a local model
  (:func:`~lightning_dist.algorithms.segmented_gossip.aggregate_pulled`); it trains from there,
  at that round's step. Its requests put it back on its providers' lists.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from lightning_dist.algorithms.segmented_gossip import (
    aggregate,
    aggregate_pulled,
    check_gossip_arguments,
    default_replicas,
    mixed_from_pulls,
    pack_segments,
    pull_plan,
    requested_providers,
    segment_bounds,
    substitute_provider,
    transfers,
)
from lightning_dist.sim.engine import Message, Node
from lightning_dist.sim.protocols.base import Program, Protocol, all_finite, check_topology
from lightning_dist.sim.replica import check_finite


class SegmentedGossip(Protocol):
    """Args:
    segments: ``S >= 1``, segments per model; 1 is plain gossip. Default 10 (paper 002).
    replicas: ``R`` peers each segment is pulled from, in ``[1, workers - 1]``. None (default): 2 (paper 002),
        or ``workers - 1`` where that is fewer, as the strategy.
    period: ``tau >= 1``, local steps between rounds. Default 40.
    seed: seeds the pull plans.
    topology: ``"server"`` (the segments only) or ``"strategy"`` (also the strategy's all-gathered
        finiteness flags before each round).
    """

    name = "segmented_gossip"
    arguments = ("segments", "replicas", "period", "seed", "topology")

    def __init__(
        self, segments: int = 10, replicas: int | None = None, period: int = 40, seed: int = 0, topology: str = "server"
    ) -> None:
        check_gossip_arguments(segments, replicas, period)
        self.segments = segments
        self.replicas = replicas
        self.period = period
        self.seed = seed
        self.topology = check_topology(topology)

    def validate(self, num_workers: int, max_steps: int) -> None:
        if self.replicas is None and num_workers >= 2:
            self.replicas = default_replicas(num_workers - 1)
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
        self.churn = simulation.churn is not None
        workers, absent = simulation.num_workers, set(range(simulation.num_workers)) - set(simulation.present_workers())
        # Under churn (section 4.2), per worker: the peers it marks offline (the initial worker list leaves out
        # those away at the start), its model as it ended its latest local update, its requests for the round
        # it pulls next ({segment: providers still owed}, with what arrived), the requests it holds as a
        # provider ({(puller, round): segments}) and its draws of substitutes.
        self.offline = [absent - {rank} for rank in range(workers)]
        initial = simulation.replicas[0].get()
        self.boundary: list[tuple[int, Tensor]] = [(0, initial)] * workers
        self.pull_round = [0] * workers
        self.owed: list[dict[int, set[int]]] = [{} for _ in range(workers)]
        self.pulled: list[list[dict[int, Tensor]]] = [[] for _ in range(workers)]
        self.requests: list[dict[tuple[int, int], list[int]]] = [{} for _ in range(workers)]
        self.sending: list[dict[int, tuple[int, int]]] = [{} for _ in range(workers)]  # served, not yet arrived
        self._transfers = itertools.count()
        self._substitutes = [torch.Generator().manual_seed(self.seed * 1_000_003 + rank + 1) for rank in range(workers)]
        self.counts = {"unreachable": 0, "substituted": 0}

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
        if self.churn:
            yield from self._churn_round(node, rank, round_index)
            return
        plan, links = self.plan(round_index)
        replica = self.simulation.replicas[rank]
        local = replica.get()
        if self.topology == "strategy":
            workers = list(range(self.simulation.num_workers))
            yield from all_finite(node, round_index, workers, local, "to exchange them")
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
        self.rounds_done = max(self.rounds_done, round_index)

    # ------------------------------------------------------------------ churn (paper 002, section 4.2)

    def _churn_round(self, node: Node, rank: int, round_index: int) -> Program:
        """A round under churn: serve the requests held for it, pull what was requested, aggregate, request the next."""
        replica = self.simulation.replicas[rank]
        local = replica.get()
        check_finite(local, rank)
        self.boundary[rank] = (round_index, local)
        self._serve_held(rank)
        if self.pull_round[rank] != round_index:  # the first round: nothing was requested before it
            self._request_round(rank, round_index)
        pulled = yield from self._pull(node, rank, round_index)
        merged = yield from node.execute(
            aggregate_pulled, local, pulled, self.bounds, self.simulation.dataset_sizes, rank, kind="aggregate"
        )
        replica.set(merged)
        self.rounds_done = max(self.rounds_done, round_index)
        if (round_index + 1) * self.period <= self.simulation.max_steps:
            self._request_round(rank, round_index + 1)

    def join(self, node: Node, rank: int) -> Program:
        """Pull every segment of the latest round a present worker reached and aggregate them without a local
        model; go on from that round's step (section 4.2)."""
        others = [peer for peer in self.simulation.present_workers() if peer != rank]
        round_index = max((self.boundary[peer][0] for peer in others), default=0)
        self.offline[rank] = set()  # the worker list it gets: everyone
        replica = self.simulation.replicas[rank]
        self._request_round(rank, round_index)
        pulled = yield from self._pull(node, rank, round_index)
        merged = yield from node.execute(aggregate_pulled, replica.get(), pulled, self.bounds,
                                         self.simulation.dataset_sizes, rank, False, kind="aggregate")
        replica.set(merged)
        self.boundary[rank] = (round_index, merged)
        self._serve_held(rank)  # requests that reached it while it was joining (its old model was too old)
        if (round_index + 1) * self.period <= self.simulation.max_steps:
            self._request_round(rank, round_index + 1)
        return round_index * self.period

    def _serve_held(self, rank: int) -> None:
        """Serve the requests ``rank`` holds for rounds its latest model has reached."""
        for (puller, wanted), segments in list(self.requests[rank].items()):
            if wanted <= self.boundary[rank][0]:
                self._serve(rank, puller, wanted, segments)

    def _request_round(self, rank: int, round_index: int) -> None:
        """Send ``rank``'s requests for ``round_index``: its plan row (round 1's for round 0, a joiner's) with the
        peers it marks offline replaced."""
        plan, _ = self.plan(max(round_index, 1))
        chosen = requested_providers(plan[rank], rank, self.offline[rank], self.simulation.num_workers,
                                     self._substitutes[rank])
        self.pull_round[rank] = round_index
        self.owed[rank] = {segment: set(providers) for segment, providers in enumerate(chosen)}
        self.pulled[rank] = [{} for _ in self.bounds]
        by_provider: dict[int, list[int]] = {}
        for segment, providers in enumerate(chosen):
            for provider in providers:
                by_provider.setdefault(provider, []).append(segment)
        for provider, segments in by_provider.items():
            self._request(rank, provider, round_index, segments)

    def _request(self, puller: int, provider: int, round_index: int, segments: list[int]) -> None:
        """A request message; what it does happens when it arrives (:meth:`_request_arrived`)."""
        self.simulation.simulator.network.post(
            puller, provider, 8 * len(segments), lambda: self._request_arrived(puller, provider, round_index, segments)
        )

    def _request_arrived(self, puller: int, provider: int, round_index: int, segments: list[int]) -> None:
        present = self.simulation.present
        if not present[provider]:  # unreachable: the puller marks it offline and asks another worker
            self._unreachable(puller, provider, round_index)
            return
        self.offline[provider].discard(puller)  # a request from it: it is online (section 4.2's newcomer rule)
        held = self.requests[provider].setdefault((puller, round_index), [])
        held.extend(segments)
        if self.boundary[provider][0] >= round_index:
            self._serve(provider, puller, round_index, held)

    def _serve(self, provider: int, puller: int, round_index: int, segments: list[int]) -> None:
        """Send ``segments`` of the provider's latest local-update result; a puller that is away is cancelled."""
        del self.requests[provider][(puller, round_index)]
        if not self.simulation.present[puller]:
            self.offline[provider].add(puller)
            return
        payload = pack_segments(self.boundary[provider][1], self.bounds, segments)
        target = self.simulation.simulator.nodes[puller]
        message = Message(provider, ("segments", round_index), (list(segments), payload), payload.nbytes,
                          target.now)
        transfer = next(self._transfers)
        self.sending[provider][transfer] = (puller, round_index)

        def arrive() -> None:
            self.sending[provider].pop(transfer, None)
            target.deliver(message)

        self.simulation.simulator.network.post(provider, puller, payload.nbytes, arrive)

    def _unreachable(self, puller: int, provider: int, round_index: int) -> None:
        """Tell ``puller`` (at once, no bytes) that ``provider`` failed it for ``round_index``."""
        target = self.simulation.simulator.nodes[puller]
        target.deliver(Message(provider, ("unreachable", round_index), None, 0, target.now))

    def _pull(self, node: Node, rank: int, round_index: int) -> Program:
        """Wait for the requested segments of ``round_index``, replacing every provider found unreachable;
        returns ``[{provider: segment}]`` per segment."""
        owed, pulled = self.owed[rank], self.pulled[rank]
        while any(owed.values()):
            message = yield node.recv_any((("segments", round_index), ("unreachable", round_index)))
            provider = message.source
            if message.tag[0] == "segments":
                self.offline[rank].discard(provider)
                segments, payload = message.payload
                sizes = [self.bounds[segment][1] - self.bounds[segment][0] for segment in segments]
                for segment, chunk in zip(segments, payload.split(sizes)):
                    if provider in owed[segment]:
                        owed[segment].discard(provider)
                        pulled[segment][provider] = chunk
                continue
            self.counts["unreachable"] += 1
            self.offline[rank].add(provider)
            load: dict[int, int] = {}
            for segment_providers in (*owed.values(), *pulled):
                for peer in segment_providers:
                    load[peer] = load.get(peer, 0) + 1
            again: dict[int, list[int]] = {}
            for segment, providers in owed.items():
                if provider not in providers:
                    continue
                providers.discard(provider)
                other = substitute_provider(rank, providers | pulled[segment].keys(), load, self.offline[rank],
                                            self.simulation.num_workers, self._substitutes[rank])
                if other is not None:
                    providers.add(other)
                    load[other] = load.get(other, 0) + 1
                    again.setdefault(other, []).append(segment)
                    self.counts["substituted"] += 1
            for other, segments in again.items():
                self._request(rank, other, round_index, segments)
        return pulled

    def leave(self, rank: int) -> None:
        """A provider that leaves fails every puller it holds or sends a request of (they find it unreachable). Its
        own requests stay with its providers, which cancel them when they find it away (:meth:`_serve`)."""
        for puller, round_index in [*self.requests[rank], *self.sending[rank].values()]:
            self._unreachable(puller, rank, round_index)
        self.requests[rank].clear()
        self.sending[rank].clear()
        self.owed[rank], self.pulled[rank], self.pull_round[rank] = {}, [], 0

    def global_model(self) -> Tensor:
        """The ``|D_j|``-weighted mean of the replicas, as :class:`~lightning_dist.strategies.SegmentedGossipStrategy`
        evaluates and checkpoints it (paper 002's global model)."""
        return self.simulation.consensus(self.simulation.dataset_sizes.tolist())

    def metrics(self) -> dict[str, float]:
        churn = {f"segmented_gossip/{key}": float(value) for key, value in self.counts.items()} if self.churn else {}
        return {"segmented_gossip/rounds": float(self.rounds_done), **churn}
