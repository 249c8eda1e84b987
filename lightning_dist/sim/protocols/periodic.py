"""Periodic averaging and FedAvg in the simulator (paper 004's baselines, paper 002's FedAvg).

Every ``period`` steps the participants of the round (all workers, or FedAvg's seeded
``max(round(C * m), 1)`` drawn by :func:`~lightning_dist.algorithms.averaging.sample_participants`)
replace their models by their mean (:func:`~lightning_dist.algorithms.averaging.weighted_average`);
the others keep training. ``topology`` says which messages carry it:

- ``"server"`` (default): the participants send their models to an aggregation server (node
  ``N``, paper 002's FedAvg setting), which sends back the mean after one aggregation.
- ``"strategy"``: what :class:`~lightning_dist.strategies.PeriodicAveragingStrategy` moves. With
  every worker taking part, one ring all-reduce of the models summed in
  :func:`~lightning_dist.algorithms.averaging.accumulation_dtype` (float32 for a bf16 model: twice
  its bytes), :mod:`lightning_dist.sim.collectives`; no server node. With ``C < 1``, every worker
  first all-gathers a 1-byte finiteness flag (a meeting of all workers each round), then the
  participants average among themselves with no hot spot, as the strategy's ``average_subset``
  does (:mod:`lightning_dist.sim.protocols.subset_average`, the plan of
  :mod:`lightning_dist.algorithms.subset_average`): every participant owns a contiguous chunk,
  receives the others' pieces of their models in it and sums them (one aggregation), then sends
  its chunk of the mean to every other participant. Each participant sends and receives about
  ``2 (|P| - 1) / |P|`` model sizes; each phase is timed as the strategy's exchange.

Both give the same models (for ``C < 1`` up to the last bit: the strategy's chunks are summed piece by
piece in participant order, the server stacks the models); only the time and the bytes of a round differ.

Churn (``topology="server"``, :mod:`lightning_dist.sim.churn`): the server averages the workers
present. A round's participants are drawn from the workers present when it is first needed; the
server waits for those still present and averages the models of those present at the
aggregation. A joiner sends a 1-byte request, waits for the round in progress to close and starts
from its mean (the last average), at that round's step (:mod:`~lightning_dist.sim.protocols.membership`).

DiLoCo (``outer_optimizer``): the round's mean goes through the strategy's outer step
(:class:`~lightning_dist.algorithms.outer.OuterStep`, one shared copy: the strategy's ranks step
identical copies with the same mean) and every worker continues from its result. The outer step
is element-wise and costs no virtual time (it is not modelled apart from the aggregation).

Streaming synchronization (``fragments``, ``fragment_sync_delay``, ``fragment_update_alpha``; Streaming DiLoCo,
:mod:`lightning_dist.algorithms.streaming`): the model is synchronized in ``P`` fragments in turn, every
``period / P`` steps, each exchange started ``tau`` steps before its merge and overlapping them, the merge keeping
``alpha`` of the worker's own fragment (:mod:`lightning_dist.sim.protocols.streaming`). Plain averaging or DiLoCo
(an outer step per fragment), with or without ``compression``; needs ``topology="strategy"`` and ``C = 1``. With
``P = 1``, ``tau = 0`` and ``alpha = 0`` (the defaults) the synchronization is the blocking one above.
"""

from __future__ import annotations

import torch

from lightning_dist.algorithms.arguments import (
    check_client_fraction,
    check_outer_optimizer,
    check_steps,
    outer_optimizer_config,
)
from lightning_dist.algorithms.averaging import accumulated_nbytes, sample_participants, weighted_average
from lightning_dist.algorithms.outer import OuterStep
from lightning_dist.algorithms.streaming import StreamingPlan
from lightning_dist.sim.engine import Node
from lightning_dist.sim.protocols.base import Program, Protocol, all_finite, check_topology, checked_mean
from lightning_dist.sim.protocols.compressed import CompressedSync, check_simulated_compression
from lightning_dist.sim.protocols.membership import Membership, request_admission
from lightning_dist.sim.protocols.streaming import StreamingSync
from lightning_dist.sim.protocols.subset_average import SubsetAverage
from lightning_dist.sim.replica import check_finite


class PeriodicAveraging(Protocol):
    """Args:
    period: local steps between averagings (``b`` in paper 004); default 10; ``>= 1``.
    client_fraction: FedAvg's ``C`` in (0, 1]; 1 is periodic averaging.
    seed: seeds the choice of participants.
    topology: ``"server"`` (an aggregation server, paper 002) or ``"strategy"`` (the strategy's
        all-reduce, or for ``C < 1`` its reduce into the participants' chunks and all-gather of the mean).
    outer_optimizer: None (plain averaging), or DiLoCo's outer optimizer as the strategy takes it; in
        a config ``{class_path: torch.optim.SGD, init_args: {lr: 0.7, momentum: 0.9, nesterov: true}}``
        or an import path such as ``lightning_dist.algorithms.outer.diloco_outer_optimizer``. Needs ``C = 1``.
    compression: None, ``"bf16"`` or ``"int8"``: the strategy's compressed synchronization
        (:mod:`lightning_dist.sim.protocols.compressed`). Needs ``C = 1`` and ``topology="strategy"``.
    fragments: ``P``, the fragments the model is synchronized in, one every ``period / P`` steps in turn; default 1;
        ``period`` must be a multiple.
    fragment_sync_delay: ``tau``, steps a fragment's exchange overlaps, from its start to its merge;
        ``0 <= tau < period / P``; default 0.
    fragment_update_alpha: the share of a worker's own fragment kept at a merge, in ``[0, 1]``; default 0.
        Other than ``P = 1, tau = 0, alpha = 0`` (streaming) needs ``C = 1`` and ``topology="strategy"``.
    """

    name = "periodic"
    arguments = ("period", "client_fraction", "seed", "topology", "outer_optimizer", "compression", "fragments",
                 "fragment_sync_delay", "fragment_update_alpha")

    def __init__(
        self,
        period: int = 10,
        client_fraction: float = 1.0,
        seed: int = 0,
        topology: str = "server",
        outer_optimizer: object = None,
        compression: str | None = None,
        fragments: int = 1,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
    ) -> None:
        self.period = check_steps("period", period, "local steps between averagings")
        self.client_fraction = check_client_fraction(client_fraction)
        self.seed = seed
        self.topology = check_topology(topology)
        self.num_servers = 1 if self.topology == "server" else 0
        self._outer_factory = check_outer_optimizer(outer_optimizer, self.client_fraction)
        self.outer_optimizer = outer_optimizer_config(outer_optimizer)
        self.compression = check_simulated_compression(compression, self.topology, self.client_fraction)
        self.plan = StreamingPlan(self.period, fragments, fragment_sync_delay, fragment_update_alpha)
        self.fragments, self.fragment_sync_delay = self.plan.fragments, self.plan.delay
        self.fragment_update_alpha = float(self.plan.alpha)
        if self.plan.streaming and (self.topology != "strategy" or self.client_fraction < 1):
            raise ValueError(
                "fragments, fragment_sync_delay and fragment_update_alpha (streaming synchronization) need "
                "topology='strategy' and client_fraction=1 (the strategy's full synchronization, in fragments); got "
                f"topology={self.topology!r}, client_fraction={self.client_fraction}"
            )

    def setup(self, simulation) -> None:  # type: ignore[no-untyped-def]
        super().setup(simulation)
        self._generator = torch.Generator().manual_seed(self.seed)
        self._participants: list[list[int]] = []
        self.rounds = simulation.max_steps // self.period
        start = simulation.replicas[0]
        self.last_mean = start.get()
        self.membership = Membership(simulation.present_workers())
        self.outer = (
            None if self._outer_factory is None
            else OuterStep(start.vector.parameters_of(start.get()), self._outer_factory)
        )
        self.compressed = (None if self.compression is None
                           else CompressedSync(self.compression, self.last_mean, start.vector.num_parameters,
                                               simulation.num_workers))
        self.streaming = self.streaming_sync() if self.plan.streaming else None

    def streaming_sync(self) -> StreamingSync:
        """The fragments' exchanges (:mod:`lightning_dist.sim.protocols.streaming`) from the start model."""
        start = self.simulation.replicas[0]
        return StreamingSync(self.plan, self.last_mean, start.vector.num_parameters, self.simulation.num_workers,
                             self._outer_factory, self.compression)

    def participants(self, round_index: int) -> list[int]:
        """Participants of round ``round_index`` (from 1), drawn in round order from the shared seed among the
        workers present when the round is first needed (all workers without churn)."""
        while len(self._participants) < round_index:
            members = sorted(self.membership.members)
            drawn = sample_participants(len(members), self.client_fraction, self._generator) if members else []
            self._participants.append([members[index] for index in drawn])
        return self._participants[round_index - 1]

    def leave(self, rank: int) -> None:
        self.membership.leave(rank, self.simulation.simulator.nodes[self.simulation.server])

    def join(self, node: Node, rank: int) -> Program:
        """Start from the mean of the round in progress when it closes (the last mean if none is), at its step."""
        mean, round_index = yield from request_admission(node, self.simulation.server)
        self.simulation.replicas[rank].set(mean)
        return round_index * self.period

    def after_step(self, node: Node, rank: int, step: int) -> Program:
        if self.streaming is not None:
            yield from self.streaming.after_step(node, rank, step, self.simulation.replicas[rank])
            return
        if step % self.period:
            return
        round_index = step // self.period
        if self.topology == "server":
            mean = yield from self._through_server(node, rank, round_index)
        else:
            mean = yield from self._as_strategy(node, rank, round_index)
        if mean is not None:
            self.simulation.replicas[rank].set(mean)

    def finish(self, node: Node, rank: int) -> Program:
        """Streaming: the exchange in flight after the last step merged (and its wait recorded), as the strategy does
        at the end of ``fit``."""
        if self.streaming is not None:
            started = node.now
            yield from self.streaming.finish(node, rank, self.simulation.replicas[rank])
            self.simulation.record_wait(rank, self.simulation.max_steps, started)

    def _through_server(self, node: Node, rank: int, round_index: int) -> Program:
        """A participant's model to the server and the mean back; None for the others."""
        if rank not in self.participants(round_index):
            return None
        node.send(self.simulation.server, self.simulation.replicas[rank].get(), tag=("model", round_index))
        message = yield node.recv(source=self.simulation.server, tag=("mean", round_index))
        return message.payload

    def _as_strategy(self, node: Node, rank: int, round_index: int) -> Program:
        """The strategy's round: all-reduce of every model, or the finiteness all-gather then the participants'
        reduce into their chunks and all-gather of the mean; returns the mean on participants, None elsewhere."""
        participants = self.participants(round_index)
        workers = list(range(self.simulation.num_workers))
        local = self.simulation.replicas[rank].get()
        if len(participants) == len(workers) and self.compressed is not None:
            return (yield from self.compressed.synchronize(node, ("average", round_index), workers, local, self.outer))
        if len(participants) == len(workers):
            nbytes = accumulated_nbytes(local.numel(), local.dtype)
            combine = checked_mean if self.outer is None else lambda models: self.outer.step(checked_mean(models))
            return (yield from node.all_reduce(("average", round_index), workers, local, combine, nbytes=nbytes))
        yield from all_finite(node, round_index, workers, local, "to average them")
        averaging = SubsetAverage(node, local)
        yield from averaging.reduce(participants, participants, tag=("reduce", round_index))
        return (yield from averaging.gather(tag=("gather", round_index)))

    def server(self, node: Node) -> Program:
        membership, nbytes = self.membership, self.last_mean.nbytes
        for round_index in range(1, self.rounds + 1):
            yield from membership.wait_for_members(node, (self.last_mean, round_index - 1), nbytes)
            participants = self.participants(round_index)
            models = yield from membership.collect(node, ("model", round_index), participants)
            for rank, model in models.items():
                check_finite(model, rank)
            if models:  # else every participant left before its model arrived: the round keeps the last mean
                mean = yield from node.execute(weighted_average, [models[rank] for rank in participants
                                                                  if rank in models], kind="aggregate")
                if self.outer is not None:
                    mean = self.outer.step(mean)
                for rank in participants:
                    if rank in membership.members:
                        node.send(rank, mean, tag=("mean", round_index))
                self.last_mean = mean
            membership.admit(node, (self.last_mean, round_index), nbytes)
        yield from membership.serve_joins(node, (self.last_mean, self.rounds), nbytes)

    def metrics(self) -> dict[str, float]:
        if self.streaming is not None:
            return self.streaming.metrics()
        return {} if self.outer is None else self.outer.metrics()
