"""Averaging the replicas in place, a bucket at a time: a full synchronization without a copy of the model.

Blocking periodic averaging used to flatten the model (a copy), sum it in the accumulation dtype (a second) and
divide (a third) before writing the mean back: three model-sized temporaries, 1.2 GB for a 100M-parameter float32
model. Here each bucket of :data:`~lightning_dist.algorithms.averaging.AVERAGE_BUCKET` elements is copied,
all-reduced, divided in place, optionally moved by DiLoCo's outer step
(:meth:`~lightning_dist.algorithms.outer.OuterStep.step_range`) and written back; a model under one bucket is
averaged by one all-reduce of the same bytes, so the arithmetic and the bytes counted are those of the whole-vector
average, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lightning_dist.algorithms import averaging
from lightning_dist.algorithms.averaging import accumulation_dtype, all_finite
from lightning_dist.comm import Communicator
from lightning_dist.model_vector import ModelVector

Combine = Callable[[int, Tensor], Tensor]
"""``(start, mean)`` -> what the replicas hold at ``[start, start + len(mean))`` (may overwrite ``mean``)."""


def average_in_place(vector: ModelVector, comm: Communicator, purpose: str,
                     raise_if_non_finite: Callable[[Tensor], None], combine: Combine | None = None,
                     bucket: int | None = None) -> None:
    """Set ``vector``'s model to the mean over ``comm``'s ranks (or ``combine`` of it), a bucket at a time.

    The sum runs in the accumulation dtype; each bucket's mean is rounded to the model's dtype as it is written
    back. A bucket whose sum is non-finite (the same sum, so the same decision, on every rank) calls
    ``raise_if_non_finite`` on this rank's bucket, a collective that names the ranks; the replicas are then left
    averaged up to that bucket, and the run stops. ``bucket`` defaults to ``AVERAGE_BUCKET`` (an outer step's
    ranges must be its buckets: :attr:`OuterStep.bucket <lightning_dist.algorithms.outer.OuterStep.bucket>`).
    """
    bucket = averaging.AVERAGE_BUCKET if bucket is None else bucket
    # One buffer for every bucket: a bucket's memory is not handed back to the allocator while the backend still
    # holds the finished all-reduce of the one before (Gloo releases it from its own thread), so each new bucket
    # would come on top of it.
    buffer = torch.empty(min(bucket, vector.numel), dtype=accumulation_dtype(vector.dtype),
                         device=vector.parameters[0].device)
    for start in range(0, vector.numel, bucket):
        stop = min(start + bucket, vector.numel)
        total = vector.get_range(start, stop, out=buffer[:stop - start])
        comm.all_reduce_sum_(total, purpose)
        if not all_finite(total):
            raise_if_non_finite(vector.get_range(start, stop))
        mean = total.div_(comm.world_size)
        vector.set_range(start, mean if combine is None else combine(start, mean))
