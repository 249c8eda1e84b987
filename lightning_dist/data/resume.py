"""Resume a train loader part-way through its epoch: its next iteration starts at a given batch.

Lightning restores a fit's progress mid-epoch (its batch count) but not a plain ``DataLoader``'s position: the
epoch's data starts again from its first batch while the count goes on, so the first batches are read twice and the
last as many never. A replica group that joins a run in progress (``fault_tolerance``) takes a live peer's position,
and must read its own shard from there. The loader's sampler is wrapped in place, so the loader, its length and
``set_epoch`` stay Lightning's.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sized
from typing import Any

from torch.utils.data import BatchSampler, Sampler


class SkipOnce(Sampler[Any]):
    """``sampler``'s indices, the first ``count`` of its next iteration left out; every later one whole. Its length
    stays ``sampler``'s: Lightning counts the batches it skips as done already."""

    def __init__(self, sampler: Sampler[Any], count: int) -> None:
        self.sampler = sampler
        self.count = count

    def __iter__(self) -> Iterator[Any]:
        count, self.count = self.count, 0
        return itertools.islice(iter(self.sampler), count, None)

    def __len__(self) -> int:
        assert isinstance(self.sampler, Sized)
        return len(self.sampler)


def start_at_batch(loader: Any, batches: int) -> bool:
    """Make ``loader``'s next iteration start at batch ``batches`` (its sampler's iteration, set to this epoch by
    Lightning, from index ``batches * batch_size``); False, and ``loader`` untouched, when it batches otherwise than
    through torch's ``BatchSampler`` (a custom batch sampler, an iterable dataset)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    if type(batch_sampler) is not BatchSampler:
        return False
    if batches > 0:
        batch_sampler.sampler = SkipOnce(batch_sampler.sampler, batches * batch_sampler.batch_size)
    return True
