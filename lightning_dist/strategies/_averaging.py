"""The averaging half of :class:`~lightning_dist.strategies.local_update.LocalUpdateStrategy`: full
synchronizations, the consensus's average and the refusal of non-finite replicas.

A full synchronization replaces every replica by the mean of all replicas (with ``compression`` the common model
plus the compressed mean of the deltas from it; with DiLoCo's outer optimizer the outer step from it) in place, a
bucket of :data:`~lightning_dist.algorithms.averaging.AVERAGE_BUCKET` entries at a time
(:mod:`lightning_dist.strategies._bucketed_average`): flat and uncompressed by pipelined all-reduces, otherwise
each bucket's :class:`~lightning_dist.strategies._fragment_exchange.FragmentExchange` (its node chunks, its own
compressed state) in turn. The consensus (:meth:`ReplicaAveraging.average_all`), which validation and checkpoints
take, is a whole-model average.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_dist.algorithms.averaging import accumulation_dtype, all_finite
from lightning_dist.algorithms.outer import OuterStep
from lightning_dist.strategies._bucketed_average import average_in_place as bucketed_average
from lightning_dist.strategies._bucketed_average import bucket_bounds, synchronize_buckets
from lightning_dist.strategies._fragment_exchange import FragmentExchange, Lanes, exchanges


class NonFiniteModelError(RuntimeError):
    """A replica's parameters are NaN or infinite; averaging it would poison every rank."""


class ReplicaAveraging:
    """Average the replicas: mixed into ``LocalUpdateStrategy`` ahead of ``ReplicaCheckpoints``.

    Uses the strategy's model vector, communicators (``comm``, the hierarchy), the codec of full synchronizations
    (``_sync_codec``) and their buckets (``_buckets``, made at set-up by :meth:`full_sync_buckets`).
    """

    def full_sync_buckets(self) -> list[FragmentExchange] | None:
        """The buckets a compressed or hierarchical full synchronization exchanges in turn, with their compressed
        state (:func:`~lightning_dist.strategies._bucketed_average.synchronize_buckets`); None when it is flat and
        uncompressed (averaged by pipelined all-reduces)."""
        if self._hierarchy is None and self._sync_codec is None:
            return None
        vector = self.model_vector
        return exchanges(bucket_bounds(vector.numel), vector.num_parameters, self._hierarchy, self._sync_codec,
                         self.root_device, self.compression_state_device)

    @property
    def compression_state_device(self) -> torch.device | None:
        """Where compressed synchronizations keep their state between exchanges (None: the model's device)."""
        return None

    def set_common_model(self, vector: Tensor) -> None:
        """Every replica now holds ``vector``: at the start and at the end of ``fit``, and at a resume.
        The next compressed synchronization sends the deltas from it."""
        self.model_vector.set(vector)
        self._replicas_in_sync = True
        if self._sync_codec is not None and self._buckets is not None:
            for bucket in self._buckets:
                bucket.hold(vector[bucket.start:bucket.stop], copy=True)

    def average_all(self, purpose: str) -> Tensor:
        """The mean of all replicas (an all-reduce); raises if any replica is non-finite.

        The sum runs in :func:`accumulation_dtype` (float32 for bfloat16/float16 models, so the
        all-reduce moves twice their bytes) and the mean is rounded to the model's dtype once.
        """
        local = self.model_vector.get()
        if self._hierarchy is not None:  # the nodes' models: chunk by chunk between nodes, the same on every rank
            mean = self._hierarchy.mean(local, purpose)
            if not bool(torch.isfinite(mean).all()):
                self.raise_if_non_finite(local)
            return mean
        total = self.comm.all_reduce_sum_(self.start_sum(local), purpose)
        if not bool(torch.isfinite(total).all()):
            self.raise_if_non_finite(local)
        return (total / self.comm.world_size).to(local.dtype)

    def synchronize_in_place(self, purpose: str, outer: OuterStep | None = None) -> None:
        """A full synchronization: every replica becomes the mean of all replicas (with ``compression`` the common
        model plus the compressed mean of the deltas from it), or DiLoCo's ``outer`` step from it, a bucket at a
        time, with a few buckets of extra memory, never a model's (:mod:`~lightning_dist.strategies.
        _bucketed_average`); raises, naming them, if any replica is non-finite."""
        def step(start: int, mean: Tensor) -> Tensor:  # on the outer state's device (the host with state_device)
            assert outer is not None
            reference = outer.reference
            return outer.step_range(start, mean.to(reference.device, reference.dtype))

        combine = None if outer is None else step
        if self._buckets is None:
            bucketed_average(self.model_vector, self.comm, purpose, self.raise_if_non_finite, combine,
                             None if outer is None else outer.bucket)
        else:
            if self._sync_codec is not None:  # before a non-finite delta turns a block's scale non-finite
                self.raise_unless_finite(self.model_vector.all_finite())
            synchronize_buckets(self.model_vector, self._buckets, Lanes(self.comm, self._hierarchy), purpose,
                                self.raise_if_non_finite, combine)
        self._replicas_in_sync = True

    @staticmethod
    def start_sum(local: Tensor) -> Tensor:
        """A running sum of models that starts at ``local``: a copy in :func:`accumulation_dtype`."""
        return local.to(accumulation_dtype(local.dtype), copy=True)

    def raise_if_non_finite(self, local: Tensor) -> None:
        """Collective check: raise the same error on every rank if any rank's vector is non-finite."""
        self.raise_unless_finite(all_finite(local))

    def raise_unless_finite(self, finite: bool) -> None:
        """Collective check: raise the same error on every rank, naming the ranks, if any rank's ``finite`` is false."""
        flag = torch.tensor([finite], dtype=torch.uint8, device=self.root_device)
        flags = self.comm.all_gather(flag, purpose="protocol").view(-1).tolist()
        self.raise_for_ranks([rank for rank, finite in enumerate(flags) if not finite])

    def raise_for_ranks(self, bad_ranks: Sequence[int], step: int | None = None) -> None:
        """Raise naming ``bad_ranks`` (if any), non-finite after local ``step`` (default: the latest)."""
        if bad_ranks:
            raise NonFiniteModelError(
                f"rank(s) {list(bad_ranks)} hold non-finite parameters after local step "
                f"{self._local_steps if step is None else step}; "
                "refusing to average them into the other replicas"
            )
