"""Full synchronizations in place, a bucket at a time: every replica becomes the mean without a copy of the model.

Blocking synchronizations used to flatten the model (a copy), sum it in the accumulation dtype (a second) and
divide (a third) before writing the mean back: three model-sized temporaries, 1.2 GB for a 100M-parameter float32
model, six model sizes with int8 compression. Here the model vector is cut into buckets of
:data:`~lightning_dist.algorithms.averaging.AVERAGE_BUCKET` elements, each copied, averaged, optionally moved by
DiLoCo's outer step (:meth:`~lightning_dist.algorithms.outer.OuterStep.step_range`) and written back:

- flat and uncompressed (:func:`average_in_place`): each bucket all-reduced in the accumulation dtype, the next
  bucket's copy overlapping it;
- compressed or under a hierarchy (:func:`synchronize_buckets`): each bucket exchanged in turn by its
  :class:`~lightning_dist.strategies._fragment_exchange.FragmentExchange` (its chunks between nodes, its own
  compressed state: the codec's definition applied bucket by bucket);
- a subset of the learners, FedAvg's round (:func:`average_subset_in_place`): each bucket's reduce into the
  members' chunks and all-gather in turn.

A model under one bucket is synchronized by one exchange of the same bytes, so the arithmetic and the bytes counted
are those of the whole-vector synchronization, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lightning_dist.algorithms import averaging
from lightning_dist.algorithms.averaging import accumulation_dtype, all_finite
from lightning_dist.comm import Communicator
from lightning_dist.comm.communicator import Pending
from lightning_dist.model_vector import ModelVector
from lightning_dist.strategies._fragment_exchange import FragmentExchange, Lanes

Combine = Callable[[int, Tensor], Tensor]
"""``(start, mean)`` -> what the replicas hold at ``[start, start + len(mean))`` (may overwrite ``mean``)."""


def bucket_bounds(numel: int, bucket: int | None = None) -> list[tuple[int, int]]:
    """``[start, stop)`` of the buckets of a model vector of ``numel`` elements: ``bucket`` (default
    ``AVERAGE_BUCKET``) each, the last one shorter (one empty bucket for an empty vector)."""
    bucket = averaging.AVERAGE_BUCKET if bucket is None else bucket
    return [(start, min(start + bucket, numel)) for start in range(0, max(numel, 1), bucket)]


def average_in_place(vector: ModelVector, comm: Communicator, purpose: str,
                     raise_if_non_finite: Callable[[Tensor], None], combine: Combine | None = None,
                     bucket: int | None = None) -> None:
    """Set ``vector``'s model to the mean over ``comm``'s ranks (or ``combine`` of it), a bucket at a time.

    The sum runs in the accumulation dtype; each bucket's mean is rounded to the model's dtype as it is written
    back. Pipelined in two buffers, as DDP overlaps its buckets: bucket ``k + 1`` is copied in while bucket ``k``'s
    all-reduce runs, and written back while bucket ``k + 2``'s runs. A bucket whose sum is non-finite (the same sum,
    so the same decision, on every rank) calls ``raise_if_non_finite`` on this rank's bucket, a collective that
    names the ranks, once the all-reduce in flight has finished; the replicas are then left averaged up to that
    bucket, and the run stops. ``bucket`` defaults to ``AVERAGE_BUCKET`` (an outer step's ranges must be its
    buckets: :attr:`OuterStep.bucket <lightning_dist.algorithms.outer.OuterStep.bucket>`).
    """
    bucket = averaging.AVERAGE_BUCKET if bucket is None else bucket
    # Two buffers, reused in turn by every bucket: a new tensor per bucket would come on top of the last one, whose
    # memory the backend holds until it releases the finished all-reduce (Gloo does so from its own thread).
    size = min(bucket, vector.numel)
    buffers = [torch.empty(size, dtype=accumulation_dtype(vector.dtype), device=vector.parameters[0].device)
               for _ in range(min(2, -(-vector.numel // size)))]
    in_flight: tuple[int, Pending] | None = None
    for index, start in enumerate([*range(0, vector.numel, bucket), None]):
        pending = None
        if start is not None:
            stop = min(start + bucket, vector.numel)
            total = vector.get_range(start, stop, out=buffers[index % len(buffers)][:stop - start])
            pending = comm.start_all_reduce_sum_(total, purpose)
        if in_flight is not None:
            _finish(vector, comm, *in_flight, raise_if_non_finite, combine, pending)
        in_flight = None if start is None else (start, pending)


def _finish(vector: ModelVector, comm: Communicator, start: int, pending: Pending,
            raise_if_non_finite: Callable[[Tensor], None], combine: Combine | None, next_pending: Pending | None) -> None:
    """Write back the bucket at ``start`` once its sum has arrived (or stop the run, naming the ranks)."""
    total = pending.wait()
    if not all_finite(total):
        if next_pending is not None:
            next_pending.wait()  # no collective may start on the group while another is in flight
        raise_if_non_finite(vector.get_range(start, start + total.numel()))
    mean = total.div_(comm.world_size)
    vector.set_range(start, mean if combine is None else combine(start, mean))


def synchronize_buckets(vector: ModelVector, buckets: list[FragmentExchange], lanes: Lanes, purpose: str,
                        raise_if_non_finite: Callable[[Tensor], None], combine: Combine | None = None) -> None:
    """Set ``vector``'s model to the mean over the learners (or ``combine`` of it), one of ``buckets`` at a time.

    Each bucket's mean (:meth:`FragmentExchange.mean`) is the same on every rank, so is the decision that it is
    non-finite: then ``raise_if_non_finite`` names the ranks (a collective), the replicas left synchronized up to
    that bucket. With compression the caller checks the replicas first (a non-finite delta must not reach a
    residual). The buckets' compressed deltas are taken from the result next time.
    """
    for bucket in buckets:
        mean = bucket.mean(lanes, vector.get_range(bucket.start, bucket.stop), purpose)
        if not all_finite(mean):  # the model still holds this rank's bucket: the exchange summed a copy
            raise_if_non_finite(vector.get_range(bucket.start, bucket.stop))
        synchronized = mean if combine is None else combine(bucket.start, mean)
        vector.set_range(bucket.start, synchronized)
        bucket.hold(synchronized)


def average_subset_in_place(vector: ModelVector, buckets: list[FragmentExchange], lanes: Lanes, members: Sequence[int],
                            purpose: str) -> None:
    """Set the ``members`` learners' replicas to their mean, one of ``buckets`` at a time; the others' stay. The mean
    is formed entry by entry, so the buckets change no value (the caller has checked every replica is finite)."""
    for bucket in buckets:
        mean = bucket.subset_mean(lanes, vector.get_range(bucket.start, bucket.stop), members, purpose)
        if mean is not None:
            vector.set_range(bucket.start, mean)
