"""One range of the model vector averaged between learners: a streaming fragment, or a bucket of a blocking
synchronization.

A large model is never exchanged whole. Streaming synchronization (:mod:`lightning_dist.strategies._streaming`)
exchanges one fragment at a time, in the background; a blocking synchronization that is compressed or runs under a
hierarchy exchanges the model a bucket at a time, in turn (:func:`~lightning_dist.strategies._bucketed_average.
synchronize_buckets`). Both take a copy of the range ``[start, stop)`` (:meth:`ModelVector.get_range
<lightning_dist.model_vector.ModelVector.get_range>`), hand it to :meth:`FragmentExchange.mean` and write back what
it returns, so one range of extra memory is in use at a time, never a model's.

What a range needs for its exchange lives here: under a hierarchy each rank carries its chunk of the range between
nodes (:meth:`NodeHierarchy.part <lightning_dist.strategies._hierarchy.NodeHierarchy.part>`) and the node gathers
the chunks of the mean; with compression the range keeps its own :class:`CompressedAverage` (the range's common
model and error-feedback residuals, :mod:`lightning_dist.algorithms.compression` applied to the range), in
``state_device`` memory between exchanges (``"cpu"``: the host, as torchft keeps its backup) and on the model's
device during one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_dist.algorithms.averaging import accumulation_dtype
from lightning_dist.comm import Communicator
from lightning_dist.strategies._compressed_average import CompressedAverage
from lightning_dist.strategies._hierarchy import NodeHierarchy
from lightning_dist.strategies._subset_average import average_subset


@dataclass
class Lanes:
    """The communicators one exchange runs on: every rank (the finiteness check), and the hierarchy if any."""

    world: Communicator
    hierarchy: NodeHierarchy | None

    @property
    def learners(self) -> Communicator:
        return self.world if self.hierarchy is None else self.hierarchy.inter_node

    def close(self) -> None:
        self.world.close()
        if self.hierarchy is not None:
            self.hierarchy.close()


class FragmentExchange:
    """The range ``[start, stop)`` of the model vector, its first ``num_parameters`` entries parameters, averaged
    between learners (see the module docstring).

    Args:
        start, stop: the range in the model vector.
        num_parameters: how many of the range's entries are parameters (the rest are buffers).
        hierarchy: the node hierarchy, whose layout cuts the range into the node's chunks (None: flat).
        codec: the ``compression`` codec, or None (the range is averaged by an all-reduce in the accumulation dtype).
        device: the model's device, where exchanges run.
        state_device: where the compressed exchange's state lives between exchanges.
    """

    def __init__(self, start: int, stop: int, num_parameters: int, hierarchy: NodeHierarchy | None, codec: str | None,
                 device: torch.device, state_device: torch.device) -> None:
        self.start, self.stop = start, stop
        self.num_parameters = num_parameters
        self.hierarchy = hierarchy
        self.device, self.state_device = device, state_device
        self.compressed = None if codec is None else CompressedAverage(codec)

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def part(self, fragment: Tensor) -> Tensor:
        """The piece of the range (``fragment``, its values) this rank exchanges between learners: all of it, or its
        chunk in the node."""
        return fragment if self.hierarchy is None else self.hierarchy.part(fragment, self.numel)

    def part_num_parameters(self) -> int:
        """How many of :meth:`part`'s entries are parameters."""
        if self.hierarchy is None:
            return self.num_parameters
        part_start, part_stop = self.hierarchy.own_bounds(self.numel)
        return max(0, min(part_stop, self.num_parameters) - part_start)

    def mean(self, lanes: Lanes, fragment: Tensor, purpose: str, contributors: int | None = None,
             contributes: bool = True) -> Tensor:
        """The mean over learners of their ``fragment`` (this rank's copy of the range, which it may overwrite), the
        same on every rank: the common model plus the compressed mean of the deltas with compression. The caller has
        checked that every rank's copy is finite when compressing (a non-finite delta turns a block's scale, and with
        it the mean, non-finite).

        ``contributors`` (default: every learner) is how many learners the mean is of; a learner that does not
        ``contribute`` (under ``fault_tolerance``, a replica group healed in this window: its window trained from a
        model the others have left) takes part in the exchange with zeros, or a zero delta compressed."""
        part = self.part(fragment)
        learners = lanes.learners
        if self.compressed is not None:
            self.compressed.to(self.device)  # from state_device for the exchange, and back (no copy when they agree)
            try:
                mean_part = self.compressed.average(learners, part, self.part_num_parameters(), purpose, contributors,
                                                    contributes)
            finally:
                self.compressed.to(self.state_device)
        else:  # ``fragment`` is the caller's copy: summed in place when it is in the accumulation dtype already
            total = part.to(accumulation_dtype(part.dtype))
            if not contributes:
                total.zero_()
            total = learners.all_reduce_sum_(total, purpose)
            mean_part = total.div_(contributors or learners.world_size).to(part.dtype)
        return mean_part if lanes.hierarchy is None else lanes.hierarchy.whole(mean_part, fragment.numel(), purpose)

    def subset_mean(self, lanes: Lanes, fragment: Tensor, members: Sequence[int], purpose: str) -> Tensor | None:
        """The mean of the ``members`` learners' ``fragment`` on their ranks, None on the others (every rank calls it
        with the same members): :func:`~lightning_dist.strategies._subset_average.average_subset` of the parts,
        gathered in the node under a hierarchy (a node's ranks are members together)."""
        mean = average_subset(lanes.learners, self.part(fragment), members, purpose)
        if mean is None or lanes.hierarchy is None:
            return mean
        return lanes.hierarchy.whole(mean, fragment.numel(), purpose)

    def hold(self, synchronized: Tensor, copy: bool = False) -> None:
        """Every replica's range now derives from ``synchronized`` (the range's new common model): the next
        compressed deltas are taken from it. ``synchronized`` is kept unless ``copy`` (the caller goes on using it)."""
        if self.compressed is not None:
            part = self.part(synchronized)
            # Under a hierarchy the part is a view of the whole range: a copy of the part alone (or its move to
            # state_device, itself a copy).
            copy = (copy or self.hierarchy is not None) and part.device == self.state_device
            self.compressed.hold(part.to(self.state_device), copy=copy)

    def restart(self, fragment: Tensor) -> None:
        """A fresh start from ``fragment`` (the range of a checkpoint's consensus in another layout): residuals at
        zero."""
        if self.compressed is not None:
            self.compressed.restart(self.part(fragment).to(self.state_device))

    def recut(self) -> None:
        """The learners changed (under ``fault_tolerance``): the compressed exchange's chunks are cut anew
        (:meth:`CompressedAverage.recut`)."""
        if self.compressed is not None:
            self.compressed.recut()

    def state_dict(self) -> dict[str, Any] | None:
        """This rank's compressed state of the range (None without compression)."""
        return None if self.compressed is None else self.compressed.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.compressed is not None
        self.compressed.load_state_dict(state, self.state_device)


def exchanges(bounds: list[tuple[int, int]], num_parameters: int, hierarchy: NodeHierarchy | None, codec: str | None,
              device: torch.device, state_device: torch.device | None) -> list[FragmentExchange]:
    """A :class:`FragmentExchange` for each range of ``bounds`` of a model vector whose first ``num_parameters``
    entries are parameters."""
    return [FragmentExchange(start, stop, max(0, min(stop, num_parameters) - start), hierarchy, codec, device,
                             state_device or device) for start, stop in bounds]
