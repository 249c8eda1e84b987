"""The train loader DataGossip hands to Lightning: local batches with foreign batches woven in.

Two small pieces:

- :class:`IndexRecorder` wraps the batch sampler of Lightning's prepared train loader and
  remembers the index list of every batch it yields, first in first out. The DataLoader fetches
  batches in sampler order (``in_order=True``), so the n-th batch that comes out of the loader
  holds the n-th index list, with or without worker processes that prefetch ahead. This is how
  the callback knows which dataset indices a batch's per-example losses belong to without
  touching the user's Dataset.
- :class:`WovenLoader` iterates a DataLoader built on that recorder and yields one batch of
  foreign records after every ``weave_every`` local batches (paper 000's record weaving;
  inserted, never replacing a local batch), and reports the resulting number of batches as its
  length, so Lightning's ``num_training_batches`` counts the inserted batches.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any, Callable, Optional, Protocol

import torch
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, Sampler

FOREIGN = None
"""Tag of a foreign batch in :attr:`WovenLoader.tags` (local batches are tagged with their indices)."""


class ForeignRecords(Protocol):
    """What the woven loader asks of the records it weaves in (:class:`~lightning_dist.callbacks.DataGossip`):
    how often, whether any arrived, and the next batch of them."""

    weave_every: int

    @property
    def has_foreign_records(self) -> bool: ...

    def next_foreign_batch(self, collate_fn: Callable[[list[Any]], Any], batch_size: Optional[int]) -> Any: ...


class IndexRecorder(Sampler[list[int]]):
    """Yields the batches of ``batch_sampler`` unchanged and queues each one's index list."""

    def __init__(self, batch_sampler: Any) -> None:
        self.batch_sampler = batch_sampler
        self.pending: deque[list[int]] = deque()

    def __iter__(self) -> Iterator[list[int]]:
        # A new pass starts a new epoch: index lists prefetched for an epoch that was cut short
        # (limit_train_batches, a -1 from on_train_batch_start) belong to no batch any more.
        self.pending.clear()
        for batch in self.batch_sampler:
            batch = [int(index) for index in batch]
            self.pending.append(batch)
            yield batch

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __getattr__(self, name: str) -> Any:
        # Forward `sampler`, `batch_size`, `drop_last`, `set_epoch`, ... so that Lightning (which
        # calls `set_epoch` on `loader.batch_sampler.sampler`) and users see the wrapped sampler.
        if name in ("batch_sampler", "pending") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.batch_sampler, name)


def local_pool(loader: DataLoader) -> Optional[Tensor]:
    """The dataset indices this rank reads in the current epoch, when that is free to compute."""
    sampler = getattr(loader.batch_sampler, "sampler", None)
    # DistributedSamplers draw from their own generator seeded by (seed, epoch): iterating them has
    # no side effects. Lightning's DistributedSamplerWrapper iterates the user's sampler, which may
    # draw from the global RNG, so it is left alone.
    if isinstance(sampler, DistributedSampler) and type(sampler).__name__ != "DistributedSamplerWrapper":
        return torch.tensor(sorted({int(index) for index in sampler}), dtype=torch.int64)
    return None


def owned_records(loader: DataLoader) -> Optional[Tensor]:
    """The dataset indices this rank's sampler holds for good (its ``part``, as ``PartitionSampler`` has);
    None for a sampler that deals out a fresh split every epoch, or that does not say."""
    part = getattr(getattr(loader.batch_sampler, "sampler", None), "part", None)
    return None if part is None else torch.as_tensor(part, dtype=torch.int64)


def examples_per_epoch(loader: DataLoader) -> int:
    """How many examples this rank reads per epoch: its sampler's length, else its batches times the batch size."""
    sampler = getattr(loader.batch_sampler, "sampler", None)
    try:
        return len(sampler)  # type: ignore[arg-type]
    except TypeError:
        return len(loader.batch_sampler) * (getattr(loader.batch_sampler, "batch_size", None) or 1)


def check_train_loader(loader: object) -> DataLoader:
    """Raise a clear error unless ``loader`` is a DataLoader whose batches DataGossip can track."""
    if type(loader) is not DataLoader:
        raise ValueError(
            "DataGossip needs the train dataloader to be a torch.utils.data.DataLoader (it rebuilds the loader "
            f"around the same dataset, sampler and collate_fn to track example indices); got {type(loader).__name__}. "
            "DataLoader subclasses, CombinedLoader and other iterables are not supported"
        )
    if isinstance(loader.dataset, IterableDataset):
        raise ValueError(
            "DataGossip needs a map-style train dataset (records are read as dataset[i]); got an IterableDataset"
        )
    if loader.batch_sampler is None:
        raise ValueError(
            "DataGossip needs a batching train DataLoader (batch_size or batch_sampler); got batch_size=None"
        )
    return loader


class WovenLoader:
    """Local batches of ``source`` (Lightning's prepared train loader) plus foreign batches.

    After every ``gossip.weave_every`` local batches, if the gossip holds foreign records, one
    batch of them is yielded; its length is the number of local batches plus those insertions.
    Each yielded batch is tagged in :attr:`tags` (its index list, or ``FOREIGN``) so the callback
    can tell which batch a training step saw.
    """

    def __init__(self, source: DataLoader, gossip: ForeignRecords) -> None:
        self.source = check_train_loader(source)
        self.recorder = IndexRecorder(source.batch_sampler)
        # Same dataset, collate_fn and worker settings; only the batch sampler is wrapped. Batches
        # must come out in sampler order for the recorder to pair them with their index lists.
        self.loader = DataLoader(
            source.dataset,
            batch_sampler=self.recorder,
            num_workers=source.num_workers,
            collate_fn=source.collate_fn,
            pin_memory=source.pin_memory,
            timeout=source.timeout,
            worker_init_fn=source.worker_init_fn,
            multiprocessing_context=source.multiprocessing_context,
            generator=source.generator,
            prefetch_factor=source.prefetch_factor,
            persistent_workers=source.persistent_workers,
            pin_memory_device=source.pin_memory_device,
            in_order=True,
        )
        self.gossip = gossip
        self.tags: deque[Optional[list[int]]] = deque()

    # -- what Lightning and users look up on a train loader ------------------------------------

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def sampler(self) -> Any:
        # Lightning's prepared sampler (e.g. its DistributedSampler): Lightning calls set_epoch on it.
        return self.source.sampler

    @property
    def batch_sampler(self) -> IndexRecorder:
        return self.recorder

    @property
    def batch_size(self) -> Optional[int]:
        return getattr(self.recorder.batch_sampler, "batch_size", None)

    @property
    def collate_fn(self) -> Callable[[list[Any]], Any]:
        return self.loader.collate_fn

    @property
    def num_workers(self) -> int:
        return self.loader.num_workers

    @property
    def worker_init_fn(self) -> Any:
        return self.loader.worker_init_fn

    @worker_init_fn.setter
    def worker_init_fn(self, value: Any) -> None:
        # Lightning sets this after the strategy processed the loader (seed_everything(workers=True)).
        self.loader.worker_init_fn = value

    # -- iteration -----------------------------------------------------------------------------

    @property
    def num_local_batches(self) -> int:
        return len(self.loader)

    def num_foreign_batches(self) -> int:
        """Foreign batches per epoch: one after every ``weave_every`` local batches, if any are held."""
        return self.num_local_batches // self.gossip.weave_every if self.gossip.has_foreign_records else 0

    def __len__(self) -> int:
        return self.num_local_batches + self.num_foreign_batches()

    def __iter__(self) -> Iterator[Any]:
        self.tags.clear()
        weave_every = self.gossip.weave_every
        for count, batch in enumerate(self.loader, start=1):
            self.tags.append(self.recorder.pending.popleft())
            yield batch
            # The foreign buffer changes only at epoch starts, so this inserts exactly
            # num_foreign_batches() batches, matching __len__.
            if count % weave_every == 0 and self.gossip.has_foreign_records:
                self.tags.append(FOREIGN)
                yield self.gossip.next_foreign_batch(self.collate_fn, self.batch_size)
