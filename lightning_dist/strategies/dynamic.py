"""Dynamic model averaging (paper 004, Kamp et al., ECML-PKDD 2018, Algorithm 1)."""

from __future__ import annotations

import math
import time
from typing import Any, Mapping, Optional

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from lightning_dist.algorithms.arguments import (
    check_compression,
    check_dynamic_schedule,
    check_outer_optimizer,
    check_sync_overhead,
)
from lightning_dist.algorithms.averaging import (
    accumulated_nbytes,
    accumulation_dtype,
    calibrated_threshold,
    calibration_periods,
    plan_balancing,
    probed_period,
    squared_distance_sum,
    sync_probe,
)
from lightning_dist.algorithms.compression import encoded_chunks_nbytes
from lightning_dist.algorithms.outer import OuterOptimizerFactory, OuterStep
from lightning_dist.strategies._outer import build_outer_step, load_outer_state, outer_state
from lightning_dist.model_vector import VectorRange
from lightning_dist.strategies._subset_average import SubsetAverage
from lightning_dist.strategies.local_update import LocalUpdateStrategy


class DynamicAveragingStrategy(LocalUpdateStrategy):
    """Average models only when they drift apart.

    Every ``check_every`` optimizer steps each rank tests its local condition
    ``||f_i - r||^2 <= divergence_threshold`` against the reference model ``r`` (the last full
    average). The test result is one all-gather of a float per rank. When some ranks violate it,
    they form the balancing set ``B``; while the mean of ``B`` still violates the condition, ``B``
    is augmented by ``2 |B|`` random ranks (the authors' DynamicHedgeSync), up to a full
    synchronization once it would reach half of all ranks. The violation counter forces a full
    synchronization once ``m`` violations have accumulated. A full synchronization is one
    all-reduce and also replaces ``r``. Balancing leaves the global mean unchanged and, when it
    ends, every local condition holds, so the divergence is at most the threshold.

    Where paper 004 balances through a coordinator that receives every member's model, here the
    members average among themselves with no hot spot (:mod:`lightning_dist.algorithms.subset_average`):
    each owns a chunk of the running sum, the ranks a round adds send each owner their piece of it,
    the owners measure their chunks of the mean against ``r`` (8 bytes per rank decide the round),
    and once the mean lies within the threshold each owner sends its chunk of the mean to the other
    members. A member sends less than ``2 + 1.5 rho / |B_j|`` model sizes per balancing (``B_j`` the set that
    added it; ``rho`` is 2 for bfloat16 and float16 models, whose partial sums travel in float32, else 1) and
    receives about two plus, in each growth round it takes part in, at most ``2/3 + rho / |B_k|`` (its chunk of the
    ``2 |B_(k-1)|`` added models and of the partial sums): at 256 learners a violator alone whose set grows 1, 3, 9,
    27, 81 receives 3.67 model sizes (the bound in full: :mod:`lightning_dist.algorithms.subset_average`); ranks
    outside ``B`` send only their distances.

    The threshold. ``divergence_threshold`` is paper 004's absolute ``Delta`` (squared L2 over all
    flattened parameters); the authors' MNIST scripts used 0.1 to 1.0 for small CNNs, which is orders
    of magnitude off for other models (a 1.3M-parameter transformer drifts by 7 in 10 steps). So by
    default (None) the run measures it. After its first step every rank times two probe
    all-reduces, of 8 bytes and of an eighth of a rank's bytes in a full synchronization (at most
    64 MiB; under ``hierarchy="node"`` of the largest chunk a rank carries, so every rank probes the same
    size: :func:`~lightning_dist.algorithms.averaging.sync_probe`), which give a full
    synchronization's time (:func:`~lightning_dist.algorithms.averaging.estimated_sync_seconds`);
    at the first check after that step (the second step with ``check_every=1``: a step must have been
    timed) the ranks share those times and their mean step time (one all-gather) and
    pick the period: the shortest multiple of ``check_every``, at most ``calibration_steps``, over
    which a synchronization costs at most ``sync_overhead`` times the computing
    (:func:`~lightning_dist.algorithms.averaging.probed_period`). The replicas train alone for that
    many steps (to that check if it comes later); the mean of their ``||f_i - r||^2`` then becomes ``Delta`` and a full
    synchronization starts the dynamic protocol. ``Delta`` is the divergence of the periodic
    protocol worth running on this network, which paper 004's Theorem 5 says dynamic averaging
    matches with less communication: on a slow network (or a large model) the period is long and
    ``Delta`` large, on a fast one short. Both are logged and kept in checkpoints. Afterwards the
    replicas synchronize when they have drifted as far as they did over that period at the start.
    ``sync_overhead=None`` takes ``calibration_steps`` as the period with no probe, so a seeded run
    replays exactly.

    With ``compression`` (:class:`LocalUpdateStrategy`), full synchronizations send compressed
    deltas from the model of the last full synchronization; a balancing set's averaging (a partial
    synchronization) still sends its members' models in their dtype.

    Choices where the paper is silent: the distance covers parameters only (not buffers);
    floating-point buffers are averaged with the parameters; optimizer state (momentum) stays
    local, as in the authors' platform.

    DiLoCo's outer step at full synchronizations (our extension, with ``outer_optimizer``): the
    reference model ``r`` is the model every replica held after the last full synchronization, and
    balancing never changes the mean of all replicas, so ``Delta = r - mean`` is the replicas' joint
    progress since then, DiLoCo's outer gradient (Douillard et al. 2023, Algorithm 1) with ``r`` as
    its anchor. A full synchronization then sets ``r`` and every replica to
    ``OuterOpt(r, Delta)`` (:class:`~lightning_dist.algorithms.outer.OuterStep`, stepped on every
    rank with the same mean) instead of the mean; partial synchronizations (balancing) stay plain
    means of their members. Validation and checkpoints between full synchronizations see the plain
    mean, as without the option.

    Args:
        divergence_threshold: ``Delta > 0``, or None (default) to measure it in the run as above.
        check_every: ``b >= 1``, optimizer steps between local-condition checks. Default 10
            (paper 004's MNIST study).
        calibration_steps: with ``divergence_threshold=None``, the local steps whose drift sets
            ``Delta``, a multiple of ``check_every``; not used when ``divergence_threshold`` is set.
            The longest period whose drift can become ``Delta``. Default 100.
        sync_overhead: with ``divergence_threshold=None``, the largest share of computing time a full
            synchronization may cost at the period whose drift becomes ``Delta``; None takes
            ``calibration_steps``. Default 0.25: on the package's language model it took the drift of 20
            steps at 100 Mbit/s and of 70-100 at 20 Mbit/s, and 30-40 steps (Delta 2-6) on a digits MLP,
            each near the best threshold a sweep found there (docs/results/averaging.md and language-model.md).
        seed: seeds the random augmentation of the balancing set (the same on every rank).
        outer_optimizer: None (default): a full synchronization hands out the mean. Otherwise the
            outer optimizer applied there, built from a list of tensors, as in
            :class:`~lightning_dist.strategies.PeriodicAveragingStrategy` (e.g. ``{class_path:
            torch.optim.SGD, init_args: {lr: 0.7, momentum: 0.9, nesterov: true}}`` in a YAML).
        **kwargs: passed to :class:`LocalUpdateStrategy` (Lightning's DDP arguments).
    """

    fault_tolerance_unsupported = (
        ": its synchronizations are not windows a quorum can close. Every check_every steps all learners gather their "
        "local conditions and the violators' balancing set grows among named learners round by round; a learner lost "
        "inside a round leaves the set's other members waiting for its pieces, and a quorum per check would put a "
        "Lighthouse round trip into every check. Use PeriodicAveragingStrategy (periodic averaging or DiLoCo) with "
        "fault_tolerance")

    strategy_name = "dynamic_avg"

    def __init__(
        self,
        divergence_threshold: Optional[float] = None,
        check_every: int = 10,
        calibration_steps: int = 100,
        sync_overhead: Optional[float] = 0.25,
        seed: int = 0,
        outer_optimizer: Optional[OuterOptimizerFactory] = None,
        **kwargs: Any,
    ) -> None:
        divergence_threshold, check_every, calibration_steps = check_dynamic_schedule(
            divergence_threshold, check_every, calibration_steps
        )
        sync_overhead = check_sync_overhead(sync_overhead)
        outer_optimizer = check_outer_optimizer(outer_optimizer)
        check_compression(kwargs.get("compression"), "dynamic averaging (its balancing rounds' sizes and "
                          "exchanges are not yet sparse)")
        super().__init__(seed=seed, **kwargs)
        self.divergence_threshold = divergence_threshold
        self.check_every = check_every
        self.calibration_steps = calibration_steps
        self.sync_overhead = sync_overhead
        self.outer_optimizer = outer_optimizer
        self._threshold = divergence_threshold  # the Delta in use: None until calibrated
        # While Delta is to be measured: the local steps whose drift it will be (None until chosen), the step at
        # which r was set, and this process's probe times and (step, time) once it has probed.
        self._calibration_period: int | None = None if sync_overhead is not None else calibration_steps
        self._reference_step = 0
        self._probes = (math.nan, math.nan)
        self._probe_parts = math.nan  # a full synchronization's bytes over the probe's
        self._clock: tuple[int, float] | None = None
        self._outer: OuterStep | None = None
        self._reference: Tensor | None = None
        self._violation_counter = 0
        self._checks = 0
        self._violations = 0
        self._full_syncs = 0
        self._partial_syncs = 0

    def on_replicas_initialized(self, vector: Tensor) -> None:
        self._reference = self.model_vector.parameters_of(vector).clone()
        self._outer = build_outer_step(self.outer_optimizer, self._reference)

    @property
    def reference(self) -> Tensor:
        if self._reference is None:
            raise RuntimeError("DynamicAveragingStrategy has no reference model before setup")
        return self._reference

    @property
    def threshold(self) -> float | None:
        """The ``Delta`` in use: ``divergence_threshold``, or the measured one (None until measured)."""
        return self._threshold

    def after_local_step(self, step: int) -> None:
        if self._threshold is None:
            self._calibrate(step)
            return
        if step % self.check_every != 0:
            return
        self._checks += 1
        distances = self._gather_distances()
        violators = [rank for rank, value in enumerate(distances) if value > self._threshold]
        if violators:
            self._violations += len(violators)
            self._resolve(violators)

    def _gather_distances(self) -> list[float]:
        """Every learner's ``||f_i - r||^2`` (one all-gather among learners: ranks, or nodes under a hierarchy, whose
        ranks all hold the node's model); raises naming those whose distance is not finite."""
        distances = self.learners.all_gather(self._distance().view(1), purpose="protocol").view(-1).tolist()
        self.raise_for_ranks([rank for rank, value in enumerate(distances) if not math.isfinite(value)])
        return distances

    def _distance(self) -> Tensor:
        """This rank's ``||f_i - r||^2`` as a 0-d float64 tensor on its device, NaN if a float buffer is not finite."""
        # Parameter by parameter against views of the reference, in float64 chunks: no copy of the
        # whole model (the flat vector is built only when models move).
        vector = self.model_vector
        distance = squared_distance_sum(zip(vector.parameters, vector.parameter_views(self.reference)))
        if vector.buffers:
            # The distance covers parameters only, but balancing averages buffers too: a non-finite buffer makes this
            # rank's distance NaN, so the check names it instead of averaging it into the set's mean.
            finite = torch.stack([torch.isfinite(buffer).all() for buffer in vector.buffers]).all()
            distance = torch.where(finite, distance, torch.full_like(distance, math.nan))
        return distance

    def _calibrate(self, step: int) -> None:
        """While ``Delta`` is to be measured (class docstring): probe after this process's first step, choose the
        period at the first check after it (a check at which at least one step has been timed: with
        ``check_every=1``, or a resume at a check, the first step is a check too, and its step time would be
        undefined), and once the replicas have trained alone for it, measure ``Delta`` (one all-gather of the
        distances) and run the full synchronization that starts the protocol. Whether to choose depends on step
        numbers alone, the same on every rank, as the choice's all-gather needs."""
        if self._clock is None:
            if self._calibration_period is None:
                self._probes = self._probe()
            self._clock = (step, time.perf_counter())
        if step % self.check_every != 0:
            return
        if self._calibration_period is None:
            if step == self._clock[0]:
                return
            self._calibration_period = self._choose_period(step)
        trained_alone = step - self._reference_step
        if trained_alone < self._calibration_period:
            return
        self._checks += 1
        self._threshold = calibrated_threshold(self._gather_distances(), trained_alone)
        rank_zero_info(
            f"{type(self).__name__}: divergence threshold Delta = {self._threshold:.6g}, the replicas' mean "
            f"||f_i - r||^2 after {trained_alone} local steps; a full synchronization starts the dynamic protocol"
        )
        self._full_sync()

    def _probe(self) -> tuple[float, float]:
        """This rank's times of an 8-byte all-reduce and of the probe of :func:`sync_probe` (after an untimed 8-byte
        one that lines the ranks up). The values read back make the time include an accelerator's work. The probe
        is sized from the model and the ranks per learner, the same on every rank (under a hierarchy from the
        largest chunk, not this rank's), so every rank takes the same ``parts`` into :meth:`_choose_period`."""
        vector = self.model_vector  # sizes only: no flat copy of the model
        learners, compression = self.learners, self.compression

        def sync_bytes(numel: int) -> int:  # what a rank carrying numel entries sends in a full synchronization
            return (accumulated_nbytes(numel, vector.dtype) if compression is None
                    else encoded_chunks_nbytes(numel, learners.world_size, compression))

        probe_elements, self._probe_parts = sync_probe(
            vector.numel, self.comm.world_size // learners.world_size, accumulated_nbytes(1, vector.dtype), sync_bytes
        )
        probe = torch.zeros(probe_elements, dtype=accumulation_dtype(vector.dtype), device=self.root_device)
        small = torch.zeros(1, dtype=torch.float64, device=self.root_device)
        learners.all_reduce_sum_(small, "protocol")
        times = []
        for tensor in (small, probe):
            started = time.perf_counter()
            float(learners.all_reduce_sum_(tensor, "protocol")[0])
            times.append(time.perf_counter() - started)
        return times[0], times[1]

    def _choose_period(self, step: int) -> int:
        """The period every rank takes (:func:`probed_period` of the all-gathered probe and step times, and of
        ``parts``, the same on every rank); ``step`` comes after the clock's first step."""
        assert self._clock is not None and step > self._clock[0]
        first_step, started = self._clock
        step_seconds = (time.perf_counter() - started) / (step - first_step)
        local = torch.tensor([*self._probes, step_seconds], dtype=torch.float64, device=self.root_device)
        rows = self.comm.all_gather(local, purpose="protocol").view(self.comm.world_size, -1).tolist()
        periods = calibration_periods(self.check_every, self.calibration_steps)
        latency, probe, steps = ([row[column] for row in rows] for column in range(3))
        assert self.sync_overhead is not None
        parts = self._probe_parts
        period = probed_period(periods, steps, latency, probe, self.sync_overhead, parts)
        rank_zero_info(
            f"{type(self).__name__}: Delta will be the replicas' drift over {period} local steps: of "
            f"{periods[0]}-{periods[-1]}, the shortest in which a full synchronization (probed: {min(latency):.3g} s "
            f"for 8 bytes, {min(probe):.3g} s for 1/{parts:.3g} of a rank's synchronization) costs at most "
            f"sync_overhead={self.sync_overhead:g} of the computing ({sum(steps) / len(steps):.3g} s a step), "
            "else the longest"
        )
        return period

    def _resolve(self, violators: list[int]) -> None:
        """Run the balancing (``plan_balancing``) among learners: a partial set by :class:`SubsetAverage`, a full
        synchronization by the all-reduce. Under a hierarchy the learners are nodes: each rank averages its part of
        the set's models with its slice group, the parts' distances add up in the node, and a member node
        all-gathers the parts of the mean."""
        threshold = self._threshold
        assert threshold is not None
        learners = self.learners
        reference = self.learner_part(self.reference)
        hierarchy, vector = self._hierarchy, self.model_vector
        offset = 0 if hierarchy is None else hierarchy.own_bounds(vector.numel)[0]  # this rank's part of the model
        # Made at the first round (a set that is every learner from the start, every one violated or the counter
        # says so, goes straight to the full synchronization); it reads this rank's part of the model slice by slice.
        balancing: SubsetAverage | None = None

        def mean_within_threshold(balancing_set: list[int], newly_added: list[int]) -> bool:
            nonlocal balancing
            if balancing is None:
                balancing = SubsetAverage(learners, VectorRange(self.model_vector, offset, self.learner_numel()),
                                          "protocol")
            balancing.reduce(balancing_set, newly_added)
            if len(balancing_set) == 1:
                return False  # the mean of one violator is its own model, which the check found violating
            return self.learner_sum(balancing.squared_distance(reference), "protocol") <= threshold

        balancing_set, self._violation_counter = plan_balancing(
            violators, learners.world_size, self._violation_counter, self._generator, mean_within_threshold
        )
        if len(balancing_set) == learners.world_size:
            self._full_sync()
            return
        assert balancing is not None, "a partial balancing set comes from at least one round"
        # A member writes the pieces of the set's mean into its part as they arrive; under a hierarchy every rank of
        # a member node is a member, and the node then shares its parts.
        if balancing.gather_into(lambda start, values: vector.set_range(offset + start, values)) and hierarchy:
            hierarchy.share_parts(vector, "protocol")
        self._partial_syncs += 1
        self._syncs += 1

    def _full_sync(self) -> None:
        """Every replica and ``r`` become the mean of all replicas (the all-reduce), or DiLoCo's outer step from it."""
        self.synchronize_in_place("protocol", self._outer)  # a bucket at a time, never a copy of the model
        self.model_vector.get_range(0, self.reference.numel(), out=self.reference)
        self._full_syncs += 1
        self._syncs += 1

    def on_replicas_averaged(self, vector: Tensor) -> None:
        """Every replica holds ``vector`` (the end of ``fit``): a full synchronization in all but name, so, as
        after one (paper 004), ``r`` becomes that model and the violation counter starts again."""
        self._reference = self.model_vector.parameters_of(vector).clone()
        self._violation_counter = 0
        self._reference_step = self._local_steps  # a Delta still to be measured is the drift from here

    def protocol_state_dict(self) -> dict[str, Any]:
        return {
            "reference": self.reference.cpu(),
            "divergence_threshold": self._threshold,
            "calibration_period": self._calibration_period,
            "reference_step": self._reference_step,
            "violation_counter": self._violation_counter,
            "checks": self._checks,
            "violations": self._violations,
            "full_syncs": self._full_syncs,
            "partial_syncs": self._partial_syncs,
            **outer_state(self._outer),
        }

    def load_protocol_state_dict(self, state: Mapping[str, Any]) -> None:
        self._reference = state["reference"].to(self.root_device)
        self._threshold = self._threshold_to_resume(state)
        if state.get("calibration_period") is not None:  # chosen before the checkpoint (or None: to be chosen)
            self._calibration_period = state["calibration_period"]
        self._reference_step = state.get("reference_step", 0)
        self._violation_counter = state["violation_counter"]
        self._checks = state["checks"]
        self._violations = state["violations"]
        self._full_syncs = state["full_syncs"]
        self._partial_syncs = state["partial_syncs"]
        load_outer_state(self._outer, state, type(self).__name__)

    def _threshold_to_resume(self, state: Mapping[str, Any]) -> float | None:
        """The checkpoint's ``Delta`` (measured or set), unless this run sets another one explicitly."""
        saved = state.get("divergence_threshold")
        if self.divergence_threshold is not None and saved is not None and saved != self.divergence_threshold:
            rank_zero_info(
                f"{type(self).__name__}: the checkpoint's divergence threshold {saved:.6g} is replaced by "
                f"divergence_threshold={self.divergence_threshold:.6g} as this run sets it"
            )
        return self.divergence_threshold if self.divergence_threshold is not None else saved

    def resized_protocol_state(self, state: Mapping[str, Any], written_by: int) -> Mapping[str, Any]:
        """Every replica starts from the checkpoint's consensus, a full synchronization in all but name: so, as
        after one, ``r`` becomes that model and the violation counter starts at 0. Kept: the threshold (measured
        or set: the drift per step does not depend on the number of ranks), the counts and DiLoCo's outer state
        (its own anchor and momentum). A threshold still to be measured is measured from the consensus: the
        period, if chosen, counts from there."""
        consensus = self.model_vector.parameters_of(self.model_vector.get()).cpu()
        return {**state, "reference": consensus, "violation_counter": 0, "reference_step": self._local_steps}

    def protocol_metrics(self) -> dict[str, float]:
        return {
            "dynamic/checks": float(self._checks),
            "dynamic/violations": float(self._violations),
            "dynamic/full_syncs": float(self._full_syncs),
            "dynamic/partial_syncs": float(self._partial_syncs),
            **({} if self._threshold is None else {"dynamic/divergence_threshold": self._threshold}),
            **({} if self.divergence_threshold is not None or self._calibration_period is None
               else {"dynamic/calibration_period": self._calibration_period}),
            **({} if self._outer is None else self._outer.metrics()),
        }
