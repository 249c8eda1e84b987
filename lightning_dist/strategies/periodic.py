"""Periodic model averaging and FedAvg, the baselines of paper 004 (section 4, ``sigma_b``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Optional

from torch import Tensor

import torch

from lightning_dist.algorithms.arguments import (
    check_client_fraction,
    check_option,
    check_outer_optimizer,
    check_steps,
)
from lightning_dist.algorithms.averaging import sample_participants
from lightning_dist.algorithms.outer import OuterOptimizerFactory, OuterStep
from lightning_dist.algorithms.sparse_compression import SparseCodec
from lightning_dist.algorithms.streaming import StreamingPlan
from lightning_dist.comm import Communicator, new_group
from lightning_dist.comm.nodes import node_groups
from lightning_dist.strategies._bucketed_average import average_subset_in_place, bucket_bounds
from lightning_dist.strategies._fragment_exchange import FragmentExchange, Lanes, exchanges
from lightning_dist.strategies._hierarchy import NodeHierarchy
from lightning_dist.strategies._outer import build_outer_step, load_outer_state, outer_state
from lightning_dist.strategies._streaming import StreamingSync
from lightning_dist.strategies.local_update import LocalUpdateStrategy


class PeriodicAveragingStrategy(LocalUpdateStrategy):
    """Every ``period`` optimizer steps, replace the participating replicas by their mean.

    With ``client_fraction=1`` (periodic averaging, ``sigma_b`` of paper 004) every rank takes part
    and the mean is one all-reduce. With ``client_fraction=C < 1`` (FedAvg, McMahan et al. 2017)
    a seeded random set of ``max(round(C * m), 1)`` ranks takes part; they average among themselves
    with no rank carrying more than its share (each owns a chunk of the sum: a reduce, then an
    all-gather, :mod:`lightning_dist.algorithms.subset_average`). The others keep training their own
    models.

    DiLoCo (Douillard et al. 2023): with an ``outer_optimizer``, the mean is not handed out as it is.
    Every rank keeps the reference model ``theta`` all replicas started the round from; at the end of
    the round ``Delta = theta - mean`` is the outer gradient, ``theta <- OuterOpt(theta, Delta)``
    (:class:`~lightning_dist.algorithms.outer.OuterStep`) and every replica continues from the new
    ``theta``. The exchange is the same all-reduce; each rank steps its own copy of the outer
    optimizer with the same mean, so the copies stay identical without further bytes. Between
    averagings, validation and a checkpoint see the plain mean of the replicas, as without the
    option: it is the inner optimizers' joint progress since ``theta``, and an outer step there
    would either change the training run (momentum committed for part of a round) or score a
    model training never continues from. At the end of every round, and so after a ``fit`` that
    ends on one, every rank holds the outer step's result (choose ``max_steps`` and the validation
    interval as multiples of ``period`` to score exactly those).

    Args:
        period: optimizer steps between averagings (``b`` in paper 004). Default 10, the
            period of paper 004's MNIST comparison.
        client_fraction: fraction ``C`` of ranks taking part in each averaging, in (0, 1].
        seed: seeds the choice of participants (the same on every rank).
        outer_optimizer: None (default) for plain averaging; otherwise builds DiLoCo's outer
            optimizer from a list of tensors, like Lightning's ``OptimizerCallable``: in Python
            :func:`~lightning_dist.algorithms.outer.diloco_outer_optimizer` or
            ``functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)``; in a
            LightningCLI YAML ``{class_path: torch.optim.SGD, init_args: {lr: 0.7, momentum: 0.9,
            nesterov: true}}``. Needs ``client_fraction=1``: the outer gradient assumes every averaged
            replica started the round from the reference, which FedAvg's non-participants, training
            on from their own models, did not (refused with a ValueError).
        fragments: Streaming DiLoCo's ``P`` (Douillard et al. 2025; :mod:`lightning_dist.algorithms.streaming`):
            the model is cut into ``P`` nearly equal fragments, synchronized in turn every ``period / P`` steps
            (each one every ``period`` steps); ``period`` must be a multiple of ``P``. Default 1.
        fragment_sync_delay: the paper's ``tau``: a fragment's exchange starts ``tau`` steps before it is merged
            and runs in the background, overlapping those steps of computation; ``0 <= tau < period / P``.
            Default 0 (blocking).
        fragment_update_alpha: the paper's ``alpha``: at a merge the replica keeps ``alpha`` of its own fragment
            and takes ``1 - alpha`` of the synchronized one, in [0, 1]. Default 0 (torchft's; the paper uses 0.5
            with ``tau >= 1``, to keep the progress made while the exchange was in flight).
        state_device: None (default): the outer optimizer's and compression's state live with the model.
            ``"cpu"``: DiLoCo's reference and outer-optimizer state (two model copies) and, with ``compression``,
            the common model and error-feedback residuals (about 2.5) live in host memory, off the GPU, at the cost
            of moving each bucket's mean (blocking) or fragment's state (streaming) to the host and back per
            synchronization.

            With ``fragments``, ``fragment_sync_delay`` or ``fragment_update_alpha`` away from its default,
            averaging runs fragment by fragment through :class:`~lightning_dist.strategies._streaming.StreamingSync`
            (never more than one fragment of extra memory for an exchange); with ``P = 1``, ``tau = 0`` and
            ``alpha = 0`` it equals the blocking average (and DiLoCo's outer step) bit for bit. Needs
            ``client_fraction=1`` (a FedAvg round's participants are drawn per round, not per fragment). A blocking
            synchronization averages (and steps DiLoCo) a bucket at a time, compressed or not, flat or under a
            hierarchy (:mod:`~lightning_dist.strategies._bucketed_average`).
        **kwargs: passed to :class:`LocalUpdateStrategy` (Lightning's DDP arguments).
    """

    strategy_name = "periodic_avg"
    supports_fault_tolerance = True

    def __init__(
        self,
        period: int = 10,
        client_fraction: float = 1.0,
        seed: int = 0,
        outer_optimizer: Optional[OuterOptimizerFactory] = None,
        fragments: int = 1,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        state_device: Optional[str] = None,
        **kwargs: Any,
    ) -> None:
        period = check_steps("period", period, "optimizer steps between averagings")
        client_fraction = check_client_fraction(client_fraction)
        outer_optimizer = check_outer_optimizer(outer_optimizer, client_fraction)
        plan = StreamingPlan(period, fragments, fragment_sync_delay, fragment_update_alpha)
        state_device = check_option("state_device", state_device, ("cpu",), "where the outer optimizer's and compression's state lives")
        streams = plan.streaming  # the fragment engine; blocking synchronizations go a bucket at a time
        if streams and client_fraction < 1:
            raise ValueError(
                f"fragments, fragment_sync_delay and fragment_update_alpha need client_fraction=1 (got "
                f"{client_fraction}): FedAvg draws a round's participants for the whole model"
            )
        if client_fraction < 1 and kwargs.get("compression") is not None:
            raise ValueError(
                f"compression needs client_fraction=1 (got {client_fraction}): FedAvg's rounds average a subset of "
                "the ranks, whose models share no common model to send deltas from"
            )
        if isinstance(kwargs.get("compression"), SparseCodec) and (streams or kwargs.get("fault_tolerance") is not None):
            raise ValueError(
                "compression=SparseCodec(...) is built for blocking synchronizations without fault_tolerance yet "
                f"(got fragments={fragments}, fault_tolerance={kwargs.get('fault_tolerance')!r}); use 'int8' there")
        if kwargs.get("fault_tolerance") is not None and streams:
            raise ValueError(
                "fault_tolerance supports blocking synchronizations (periodic averaging, FedAvg and DiLoCo, compressed "
                f"or not); got fragments={fragments}, fragment_sync_delay={fragment_sync_delay}, "
                f"fragment_update_alpha={fragment_update_alpha} (streaming between replica groups is not built yet)"
            )
        super().__init__(seed=seed, **kwargs)
        self.period = period
        self.client_fraction = client_fraction
        self.outer_optimizer = outer_optimizer
        self.plan = plan
        self.state_device = state_device
        self.streams = streams
        self._outer: OuterStep | None = None
        self._streaming: StreamingSync | None = None
        self._background: Lanes | None = None

    def setup_environment(self) -> None:
        """Lightning's and the base's; with ``fragment_sync_delay > 0`` also the groups exchanges in flight run on."""
        super().setup_environment()
        if self._background is not None:
            self._background.close()
            self._background = None
        if self.streams and self.plan.delay > 0:
            backend = self._get_process_group_backend()
            world = Communicator(new_group(backend=backend, timeout=self._timeout), timeout=self._timeout)
            hierarchy = None
            if self._hierarchy is not None:
                node_group, slice_group = node_groups(self._hierarchy.layout, backend, self._timeout)
                hierarchy = NodeHierarchy(self._hierarchy.layout, Communicator(node_group, "intra_node", counted_by=world),
                                          Communicator(slice_group, "inter_node", counted_by=world))
            self._background = Lanes(world, hierarchy)

    def full_sync_buckets(self) -> list[FragmentExchange] | None:
        """None when streaming: each fragment keeps its own exchange (:class:`StreamingSync`)."""
        return None if self.streams else super().full_sync_buckets()

    @property
    def compression_state_device(self) -> torch.device | None:
        return None if self.state_device is None else torch.device(self.state_device)

    def on_replicas_initialized(self, vector: Tensor) -> None:
        if not self.streams:
            start = self.model_vector.parameters_of(vector)
            self._outer = build_outer_step(self.outer_optimizer, start if self.state_device is None
                                           else start.to(self.state_device))
            return
        self._streaming = StreamingSync(
            self.plan, self.model_vector, Lanes(self.comm, self._hierarchy), self._background, self.compression,
            self.outer_optimizer, None if self.state_device is None else torch.device(self.state_device),
            self.raise_for_ranks)

    def after_local_step(self, step: int) -> None:
        if self._streaming is not None:
            if self._streaming.after_step(step):
                self._syncs += 1
                # One fragment taken whole: every replica now holds the same model.
                self._replicas_in_sync = self.plan.fragments == 1 and self.plan.alpha == 0
            return
        if step % self.period != 0 or self.fault_tolerance is not None:  # fault_tolerance: window_due
            return
        learners = self.learners.world_size  # ranks, or nodes under a hierarchy
        participants = sample_participants(learners, self.client_fraction, self._generator)
        if len(participants) == learners:
            self.synchronize_in_place("protocol", self._outer)  # a bucket at a time, never a copy of the model
        else:  # FedAvg's round: the participants (under a hierarchy, their nodes' ranks) a bucket at a time
            self.raise_unless_finite(self.model_vector.all_finite())
            vector = self.model_vector
            buckets = exchanges(bucket_bounds(vector.numel), vector.num_parameters, self._hierarchy, None,
                                self.root_device, None)
            average_subset_in_place(vector, buckets, Lanes(self.comm, self._hierarchy), participants, "protocol")
        self._syncs += 1

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self._streaming is not None:  # every rank: the exchange in flight is saved with its result
            self._streaming.collect()
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def on_train_end(self) -> None:
        # fit ends between an exchange's start and its merge: merged now rather than lost, and counted now; a run
        # resumed from a checkpoint written after fit passes the plan's merge step (StreamingSync.merged_early)
        if self._streaming is not None and self._streaming.merge_early():
            self._syncs += 1
        super().on_train_end()

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        if self._background is not None:
            self._background.close()

    def protocol_state_dict(self) -> dict[str, Any]:
        if self._streaming is not None:
            return {"streaming": self._streaming.state_dict()}
        return {**outer_state(self._outer), **self.fault_tolerance_state()}

    def load_protocol_state_dict(self, state: Mapping[str, Any]) -> None:
        if ("streaming" in state) != self.streams:
            written, now = ("with", "without") if "streaming" in state else ("without", "with")
            raise ValueError(
                f"the checkpoint was written by {type(self).__name__} {written} fragments/fragment_sync_delay/"
                f"fragment_update_alpha/state_device and is resumed {now}; resume with the settings that wrote it"
            )
        if self._streaming is not None:
            self._streaming.load_state_dict(state["streaming"], type(self).__name__)
            return
        load_outer_state(self._outer, state, type(self).__name__)
        self.load_fault_tolerance_state(state)

    def worker_state_dict(self) -> dict[str, Any]:
        return {} if self._streaming is None else self._streaming.worker_state_dict()

    def load_worker_state_dict(self, state: Mapping[str, Any]) -> None:
        if self._streaming is not None:
            self._streaming.load_worker_state_dict(state)

    def resized_protocol_state(self, state: Mapping[str, Any], written_by: int) -> Mapping[str, Any]:
        """Kept: the rounds count global steps, and DiLoCo's reference and outer momentum are one model's; so are
        streaming's exchange in flight (its mean, merged into every replica) and its record of an exchange merged
        early (every replica continues from the consensus, which holds that merge)."""
        return state

    def window_due(self) -> bool:
        return not self._replicas_in_sync and self._local_steps > 0 and self._local_steps % self.period == 0

    def fault_tolerant_outer_step(self) -> OuterStep | None:
        return self._outer

    def fault_tolerant_selection(self) -> Callable[[list[int]], list[int]] | None:
        """FedAvg's draw among the replica groups that contribute to a window (:func:`sample_participants` of
        ``num_replica_groups`` with the groups present: with every group present, the draw without the option)."""
        if self.client_fraction == 1:
            return None
        groups = self.num_learners  # num_replica_groups
        return lambda present: sample_participants(groups, self.client_fraction, self._generator, present)

    def protocol_metrics(self) -> dict[str, float]:
        if self._streaming is not None:
            return self._streaming.metrics()
        return {**self.fault_tolerance_metrics(), **({} if self._outer is None else self._outer.metrics())}
