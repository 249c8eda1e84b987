"""Dynamic averaging (paper 004, Algorithm 1) in the simulator, with a coordinator node (node ``N``).

Every ``check_every`` steps each worker tests its local condition ``||f_i - r||^2 <= Delta``
against its copy of the reference model ``r``. A worker whose condition holds sends nothing and
trains on at once. A violator sends its model to the coordinator and waits for the balanced one.

The coordinator's side, Algorithm 1 read event by event and under churn, is
:mod:`lightning_dist.sim.protocols.dynamic_coordinator`.

The threshold. ``divergence_threshold`` sets ``Delta``. None (the default) measures it as
:class:`~lightning_dist.strategies.DynamicAveragingStrategy` does: the workers train alone, with no
check and no message, until their step ``calibration_steps`` (a multiple of ``check_every``); at that
check ``Delta`` becomes the mean of the workers' ``||f_i - r||^2``
(:func:`~lightning_dist.algorithms.averaging.calibrated_threshold`) and a full synchronisation starts
the protocol, whose later checks use that ``Delta``. With the coordinator, every worker at its
calibration step sends its model and its drift (8 bytes more) and waits; once the coordinator holds
the report of every worker present, it sets ``Delta`` to their mean drift, averages the models (one
aggregation), takes the mean as the reference (after DiLoCo's outer step, with ``outer_optimizer``)
and sends every reporter the mean and ``Delta`` (8 bytes more), a full synchronisation. With
``topology="strategy"`` (below) the calibration check is the check's 8-byte all-gather, from which
every worker computes the same ``Delta``, then the all-reduce of a full synchronisation (the path of
one the violation counter forces), with no balancing at that check. ``threshold`` holds the ``Delta``
in use (None until measured), and :meth:`DynamicAveraging.metrics` reports it once known. That is the
rule with ``sync_overhead=None``. With ``sync_overhead`` set (default 0.25) the calibration check comes
after the period each worker chooses from probes of the network and its step time
(:mod:`lightning_dist.sim.protocols.dynamic_calibration`), not after ``calibration_steps``: the shortest
multiple of ``check_every``, at most ``calibration_steps``, over which a synchronisation costs at most
that share of the computing, as the strategy chooses it.

``topology="strategy"`` instead moves what :class:`~lightning_dist.strategies.DynamicAveragingStrategy`
moves, with no coordinator node; every worker meets the others at every check:

- Every worker all-gathers its ``||f_i - r||^2`` (8 bytes, a ring all-gather of all workers), so
  all learn the violators at the same instant. Without violators everyone trains on. Under a
  hierarchy each of a learner's ``L`` ranks gathers it over its slice group, as the strategy's ranks
  do: ``8 L`` bytes per learner, and so for every 8-byte gather below.
- Every worker runs :func:`~lightning_dist.algorithms.averaging.balancing_rounds` with its own copy
  of the shared seeded generator and violation counter, as the strategy's ranks do, and the rounds
  average the set without a hot spot (:mod:`lightning_dist.sim.protocols.subset_average`, the plan
  of :mod:`lightning_dist.algorithms.subset_average`): every member owns a contiguous chunk. In each
  round the ranks it added send each owner the piece of their model in its chunk, and so do the
  previous round's owners with their partial sums; each owner adds what reaches it (one
  aggregation). Then every worker, member or not, all-gathers its 8-byte share of
  ``||mean(f_B) - r||^2`` (the owners' chunks of the mean against ``r``, 0 elsewhere): the sum
  decides the round. A round of one violator moves nothing and decides nothing (its mean is its
  own violating model).
- A full synchronisation (forced by the violation counter, or the augmentation reaching half of
  the workers) is one ring all-reduce of all models. A partial set ends with each owner sending
  its chunk of the mean to every other member. A member sends less than ``2 + 1.5 rho / |B_j|``
  model sizes per balancing and receives about two plus at most ``2/3 + rho / |B_k|`` per growth
  round (the bound of :mod:`lightning_dist.algorithms.subset_average`); a non-member only the
  8-byte gathers.
  Virtual time: each phase is timed as the strategy's exchange, and each owner's summing is one
  aggregation (:mod:`lightning_dist.sim.protocols.subset_average`).
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor

from lightning_dist.algorithms.arguments import (
    check_dynamic_schedule,
    check_outer_optimizer,
    check_sync_overhead,
    outer_optimizer_config,
)
from lightning_dist.algorithms.averaging import (
    accumulated_nbytes,
    balancing_rounds,
    calibrated_threshold,
    local_condition_holds,
    squared_distance,
)
from lightning_dist.algorithms.compression import encoded_chunks_nbytes
from lightning_dist.algorithms.outer import OuterStep
from lightning_dist.sim.engine import Node
from lightning_dist.sim.protocols.base import Program, Protocol, check_topology, checked_mean
from lightning_dist.sim.protocols.compressed import CompressedSync, check_simulated_compression
from lightning_dist.sim.protocols.dynamic_calibration import Calibration
from lightning_dist.sim.protocols.dynamic_coordinator import (
    BALANCED,
    CALIBRATED,
    DRIFT,
    FLOAT_BYTES,
    MODEL,
    REQUEST,
    DynamicCoordinator,
)
from lightning_dist.sim.protocols.membership import Membership, request_admission
from lightning_dist.sim.protocols.subset_average import SubsetAverage
from lightning_dist.sim.replica import NonFiniteModelError


class DynamicAveraging(DynamicCoordinator, Protocol):
    """Args:
    divergence_threshold: ``Delta > 0``, squared L2 distance to the reference; None (default) to measure it in
        the run, as :class:`~lightning_dist.strategies.DynamicAveragingStrategy` does (module docstring).
    check_every: ``b >= 1``, steps between local-condition checks; default 10.
    calibration_steps: with ``divergence_threshold=None``, the longest period whose drift can set ``Delta``, a
        multiple of ``check_every``; default 100, the strategy's. Not used when ``divergence_threshold`` is set.
    sync_overhead: with ``divergence_threshold=None``, the largest share of the computing a synchronisation may
        cost over the period whose drift becomes ``Delta``; None takes ``calibration_steps``. Default 0.25, the
        strategy's.
    seed: seeds the augmentation of the balancing set.
    topology: ``"server"`` (a coordinator node, Algorithm 1 event by event) or ``"strategy"`` (the
        strategy's all-gathered distances, and balancing by a reduce into the members' chunks).
    outer_optimizer: None, or DiLoCo's outer optimizer applied at full synchronisations with ``r`` as
        the anchor, as :class:`~lightning_dist.strategies.DynamicAveragingStrategy` does (one shared
        :class:`~lightning_dist.algorithms.outer.OuterStep`, stepped once per full synchronisation,
        at no virtual time); written as for :class:`PeriodicAveraging`.

    Attributes:
        threshold: the ``Delta`` in use: ``divergence_threshold``, or the measured one (None until measured).
        calibration_period: the local steps whose mean drift the measured ``Delta`` is (None until measured).
    """

    name = "dynamic_avg"
    arguments = (
        "divergence_threshold", "check_every", "calibration_steps", "sync_overhead", "seed", "topology", "outer_optimizer",
        "compression",
    )

    def __init__(
        self,
        divergence_threshold: float | None = None,
        check_every: int = 10,
        calibration_steps: int = 100,
        sync_overhead: float | None = 0.25,
        seed: int = 0,
        topology: str = "server",
        outer_optimizer: object = None,
        compression: str | None = None,
    ) -> None:
        self.divergence_threshold, self.check_every, self.calibration_steps = check_dynamic_schedule(
            divergence_threshold, check_every, calibration_steps
        )
        self.sync_overhead = check_sync_overhead(sync_overhead)
        self.threshold = self.divergence_threshold
        self.calibration_period: int | None = None
        self.seed = seed
        self.topology = check_topology(topology)
        self.num_servers = 1 if self.topology == "server" else 0
        self._outer_factory = check_outer_optimizer(outer_optimizer)
        self.outer_optimizer = outer_optimizer_config(outer_optimizer)
        self.compression = check_simulated_compression(compression, self.topology,
                                                       sparse_unsupported="simulated dynamic averaging")

    def setup(self, simulation) -> None:  # type: ignore[no-untyped-def]
        super().setup(simulation)
        self._generator = torch.Generator().manual_seed(self.seed)
        initial = simulation.replicas[0]
        self.reference = initial.vector.parameters_of(initial.get()).clone()
        self.references = [self.reference] * simulation.num_workers
        self.reference_model = initial.get()  # the reference with the buffers: what a joiner starts from
        self.threshold = self.divergence_threshold
        # The Delta each worker checks with: a measured one only once the calibration's result reached it.
        self._thresholds = [self.divergence_threshold] * simulation.num_workers
        self.calibration_period = None
        model = self.reference_model
        # topology="strategy": a learner's L ranks each carry a slice of every exchange (the 8-byte gathers too).
        self._slices = simulation.ranks_per_node if simulation.hierarchy and self.topology == "strategy" else 1

        def sync_bytes(numel: int) -> int:  # a full synchronisation's: a model to the coordinator, or the all-reduce's
            if self.topology == "server":
                return numel * model.element_size()
            if self.compression is None:
                return accumulated_nbytes(numel, model.dtype)
            return encoded_chunks_nbytes(numel, simulation.num_workers, self.compression)

        element_size = model.element_size() if self.topology == "server" else accumulated_nbytes(1, model.dtype)
        self.calibration = Calibration(self.check_every, self.calibration_steps, self.sync_overhead,
                                       simulation.num_workers, model.numel(), element_size, sync_bytes, self._slices)
        self.membership = Membership(simulation.present_workers())
        self.outer = None if self._outer_factory is None else OuterStep(self.reference, self._outer_factory)
        self.compressed = (None if self.compression is None
                           else CompressedSync(self.compression, self.reference_model,
                                               simulation.replicas[0].vector.num_parameters, simulation.num_workers))
        self.violation_counter = 0
        self.balancings = 0
        self._answered = [0] * simulation.num_workers  # the last balancing each worker took part in
        self.counts = {"checks": 0, "violations": 0, "full_syncs": 0, "partial_syncs": 0}
        # topology="strategy": each worker's copy of the shared generator and violation counter.
        self._generators = [torch.Generator().manual_seed(self.seed) for _ in range(simulation.num_workers)]
        self._counters = [0] * simulation.num_workers

    # ------------------------------------------------------------------ workers

    def after_step(self, node: Node, rank: int, step: int) -> Program:
        if self._thresholds[rank] is None:
            server = self.simulation.server if self.topology == "server" else None
            yield from self.calibration.step(node, rank, step, list(range(self.simulation.num_workers)), server)
        if self.topology == "strategy":
            if step % self.check_every == 0 and not self._calibrating(rank, step):
                yield from self._check_as_strategy(node, rank, step)
            return
        if self._pending_request(node, rank):
            yield from self._send_model(node, rank, violated=False)
        if step % self.check_every or self._calibrating(rank, step):
            return
        threshold = self._thresholds[rank]
        if threshold is None:
            yield from self._report_drift(node, rank, step)
            return
        self.counts["checks"] = max(self.counts["checks"], self._check_number(step))
        replica = self.simulation.replicas[rank]
        parameters = replica.vector.parameters_of(replica.get())
        if not local_condition_holds(parameters, self.references[rank], threshold):
            yield from self._send_model(node, rank, violated=True)

    def finish(self, node: Node, rank: int) -> Program:
        """After its last step a worker still answers requests: its model stays part of the average. One without
        ``Delta`` past ``calibration_steps`` (back after its report was lost) first reports: the calibration
        waits for it."""
        position = self.simulation.positions[rank]
        if self._thresholds[rank] is None and not self.calibration.trains_alone(rank, position):
            yield from self._report_drift(node, rank, position)
        while True:
            request = yield node.recv(source=self.simulation.server, tag=REQUEST)
            if request.payload > self._answered[rank]:
                yield from self._send_model(node, rank, violated=False)

    def leave(self, rank: int) -> None:
        self.membership.leave(rank, self.simulation.simulator.nodes[self.simulation.server])

    def join(self, node: Node, rank: int) -> Program:
        """Start from the reference model (also as the worker's reference) and with ``Delta`` once measured, going
        on from the worker's own step."""
        model, self._thresholds[rank] = yield from request_admission(node, self.simulation.server)
        if self._thresholds[rank] is None:
            self.calibration.restart(rank)
        self.simulation.replicas[rank].set(model)
        self.references[rank] = self._parameters(model).clone()
        return self.simulation.positions[rank]

    def _calibrating(self, rank: int, step: int) -> bool:
        """Whether worker ``rank`` still trains alone at ``step``: it has no ``Delta`` yet (one to be measured) and
        ``step`` comes before its calibration check (``calibration_steps``, or the first check at or after the
        period it chose)."""
        return self._thresholds[rank] is None and self.calibration.trains_alone(rank, step)

    def _check_number(self, step: int) -> int:
        """The checks made up to the one at ``step``: from ``check_every`` on, or from the calibration check on
        when ``Delta`` is measured (it included, as the strategy counts them)."""
        first = self.check_every if self.divergence_threshold is not None else self.calibration.check_step
        return (step - first) // self.check_every + 1

    def _pending_request(self, node: Node, rank: int) -> bool:
        """Whether a request of a balancing this worker has not answered yet has arrived (taken from
        the mailbox). Requests that its own report answered arrive first and are dropped."""
        while (request := node.recv_nowait(source=self.simulation.server, tag=REQUEST)) is not None:
            if request.payload > self._answered[rank]:
                return True
        return False

    def _send_model(self, node: Node, rank: int, violated: bool) -> Program:
        """Send this worker's model to the coordinator, wait, and take the balanced model."""
        replica = self.simulation.replicas[rank]
        model = replica.get()
        node.send(self.simulation.server, (model, violated), tag=MODEL, nbytes=model.nbytes)
        message = yield node.recv(source=self.simulation.server, tag=BALANCED)
        balancing, mean, full_sync = message.payload
        self._answered[rank] = balancing
        self._take(rank, mean, full_sync)

    def _report_drift(self, node: Node, rank: int, step: int) -> Program:
        """The calibration check: send the coordinator this worker's model and ``||f_i - r||^2``, wait, and take the
        mean (a full synchronisation) and the measured ``Delta``."""
        self.counts["checks"] = max(self.counts["checks"], self._check_number(step))
        model = self.simulation.replicas[rank].get()
        drift = squared_distance(self._parameters(model), self.references[rank])
        node.send(self.simulation.server, (model, drift), tag=DRIFT, nbytes=model.nbytes + FLOAT_BYTES)
        message = yield node.recv(source=self.simulation.server, tag=CALIBRATED)
        mean, self._thresholds[rank] = message.payload
        self._take(rank, mean, full_sync=True)

    def _take(self, rank: int, mean: Tensor, full_sync: bool) -> None:
        """Member ``rank`` replaces its model by the balanced ``mean``; a full synchronisation also makes it
        the worker's reference model."""
        replica = self.simulation.replicas[rank]
        replica.set(mean)
        if full_sync:
            self.references[rank] = replica.vector.parameters_of(mean).clone()

    def _check_as_strategy(self, node: Node, rank: int, step: int) -> Program:
        """One check as the strategy runs it on every rank (see the module docstring)."""
        check = step // self.check_every
        workers = list(range(self.simulation.num_workers))
        local = self.simulation.replicas[rank].get()
        distance = squared_distance(self._parameters(local), self.references[rank])
        distances = yield from node.all_gather(("distance", check), workers, distance, nbytes=8 * self._slices)
        non_finite = [worker for worker, value in enumerate(distances) if not math.isfinite(value)]
        if non_finite:
            raise NonFiniteModelError(f"workers {non_finite} have non-finite models; refusing to average them")
        if rank == 0:
            self.counts["checks"] = self._check_number(step)
        threshold = self._thresholds[rank]
        if threshold is None:  # the calibration check: every worker measures the same Delta from the same drifts
            self.calibration_period = self.calibration.period
            self._thresholds[rank] = self.threshold = calibrated_threshold(distances, self.calibration_period)
            yield from self._full_sync_as_strategy(node, rank, workers, local, check)
            return
        violators = [worker for worker, value in enumerate(distances) if value > threshold]
        if rank == 0:
            self.counts["violations"] += len(violators)
        if not violators:
            return
        rounds = balancing_rounds(violators, len(workers), self._counters[rank], self._generators[rank])
        balancing = SubsetAverage(node, local)
        try:
            members, added = next(rounds)
            for round_index in itertools.count():
                yield from balancing.reduce(members, added, tag=("reduce", check, round_index))
                if len(members) == 1:
                    within = False  # the mean of one violator is its own model, which the check found violating
                else:
                    within = yield from self._mean_within(node, workers, balancing, rank, (check, round_index))
                members, added = rounds.send(within)
        except StopIteration as done:
            members, self._counters[rank] = done.value
        if len(members) == len(workers):
            yield from self._full_sync_as_strategy(node, rank, workers, local, check)
            return
        if rank == 0:
            self.counts["partial_syncs"] += 1
        mean = yield from balancing.gather(tag=("gather", check))
        if mean is not None:
            self._take(rank, mean, full_sync=False)

    def _full_sync_as_strategy(self, node: Node, rank: int, workers: list[int], local: Tensor, check: int) -> Program:
        """A full synchronisation as the strategy runs it: one ring all-reduce of every model (in the accumulation
        dtype), DiLoCo's outer step from the mean if any; the result is every worker's model and reference."""
        if rank == 0:
            self.counts["full_syncs"] += 1
        if self.compressed is not None:
            mean = yield from self.compressed.synchronize(node, ("average", check), workers, local, self.outer)
        else:
            nbytes = accumulated_nbytes(local.numel(), local.dtype)
            combine = checked_mean if self.outer is None else lambda models: self.outer.step(checked_mean(models))
            mean = yield from node.all_reduce(("average", check), workers, local, combine, nbytes=nbytes)
        self._take(rank, mean, full_sync=True)

    def _mean_within(
        self, node: Node, workers: list[int], balancing: SubsetAverage, rank: int, key: tuple[int, int]
    ) -> Program:
        """Whether the mean of the balancing set lies within ``Delta``: every worker all-gathers its 8-byte share
        of the distance (the owners' chunks, 0 elsewhere), and all add them up in worker order."""
        share = balancing.share(self.references[rank])
        shares = yield from node.all_gather(("decision", *key), workers, share, nbytes=8 * self._slices)
        total = math.fsum(shares)
        return math.isfinite(total) and total <= self._thresholds[rank]

    def _parameters(self, vector: Tensor) -> Tensor:
        return self.simulation.replicas[0].vector.parameters_of(vector)

    def metrics(self) -> dict[str, float]:
        threshold = {} if self.threshold is None else {"dynamic/divergence_threshold": self.threshold}
        if self.divergence_threshold is None and self.calibration_period is not None:
            threshold["dynamic/calibration_period"] = self.calibration_period
        outer = {} if self.outer is None else self.outer.metrics()
        return {**{f"dynamic/{key}": float(value) for key, value in self.counts.items()}, **threshold, **outer}
