"""A distributed sampler that gives each rank its part of a chosen partition (iid, class-sorted, ...).

Every rank yields the same number of indices per epoch, even when the parts have different sizes:
local-update and gossip strategies take one collective step per batch, so a rank that ran out of
batches early would leave the others waiting forever. What a rank yields per epoch is therefore not
the size of its part; :func:`part_size` gives that size (``|D_j|``, paper 002's aggregation weight).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any, Optional

import numpy as np
from numpy.typing import ArrayLike
from torch.utils.data import DataLoader, DistributedSampler

from lightning_dist.algorithms.arguments import check_count
from lightning_dist.data.partition import make_partition

RESHUFFLED = "reshuffled"
"""``partition`` value for no fixed split: every epoch the whole training set is shuffled anew and
dealt out to the ranks (what Lightning's own ``DistributedSampler`` does under DDP). Over the epochs
every rank sees every example, so each rank's examples are a fresh iid draw from the whole set, the
streaming setting of paper 004 (Kamp et al., section 2: each learner observes samples drawn iid from
one distribution). With a fixed part a local model can fit its own few examples and stop moving
while the average of such models is not fitted to the whole set."""


class PartitionSampler(DistributedSampler):
    """Yield the indices of this rank's part of ``make_partition(partition, labels, num_replicas, ...)``.

    Each epoch yields exactly ``len(dataset) // num_replicas`` indices on every rank. A shorter part is
    repeated (with a fresh shuffle per repetition when ``shuffle``); a longer part is shuffled and
    truncated, so a different subset is used each epoch. Without ``shuffle`` the part is read in
    order, each epoch continuing where the previous one stopped, so a longer part is still visited in
    full over several epochs. Shuffles are seeded by ``(seed, epoch, rank)``; the partition itself by
    ``seed`` alone, so all ranks agree on it.

    ``part_size`` is the number of examples in the part itself (what ``len(self)`` equalises away).

    This subclasses :class:`~torch.utils.data.DistributedSampler` so that Lightning, which only
    injects its own ``DistributedSampler`` into dataloaders whose sampler is not one, leaves it alone.
    """

    def __init__(
        self,
        dataset: Sized,
        labels: ArrayLike,
        num_replicas: int,
        rank: int,
        partition: str = "iid",
        dirichlet_alpha: float = 0.5,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        num_replicas = check_count("num_replicas", num_replicas, 1, len(dataset))
        rank = check_count("rank", rank, 0, num_replicas - 1)
        seed = check_count("seed", seed, 0)
        labels = np.asarray(labels)
        if len(labels) != len(dataset):
            raise ValueError(f"labels must have one entry per example ({len(dataset)}); got {len(labels)}")
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.part = _partition(dataset, labels, partition, num_replicas, seed, dirichlet_alpha)[rank]
        self.num_samples = len(dataset) // num_replicas
        self.total_size = self.num_samples * num_replicas

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            rng = np.random.default_rng([self.seed, self.epoch, self.rank])
            repeats = math.ceil(self.num_samples / len(self.part))
            indices = np.concatenate([rng.permutation(self.part) for _ in range(repeats)])[: self.num_samples]
        else:
            positions = (self.epoch * self.num_samples + np.arange(self.num_samples)) % len(self.part)
            indices = self.part[positions]
        return iter(indices.tolist())

    def __len__(self) -> int:
        return self.num_samples

    @property
    def part_size(self) -> int:
        """Examples in this rank's part, ``|D_j|``; each epoch cycles or truncates the part to ``len(self)``."""
        return len(self.part)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose shuffle (or, without shuffle, whose window of the part) to yield next."""
        self.epoch = check_count("epoch", epoch, 0)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.set_epoch(state_dict["epoch"])


_last_partition: Optional[tuple[Sized, np.ndarray, tuple[str, int, int, float], list[np.ndarray]]] = None


def _partition(dataset: Sized, labels: np.ndarray, partition: str, num_replicas: int, seed: int,
               dirichlet_alpha: float) -> list[np.ndarray]:
    """``make_partition(...)``, the last one reused while the same dataset with equal labels is split the same way:
    a simulation's thousands of ranks each ask for their part of one partition, which takes ``O(examples)`` to
    compute (10,000 ranks of a million examples: minutes)."""
    global _last_partition
    key = (partition, num_replicas, seed, dirichlet_alpha)
    if _last_partition is not None:
        last_dataset, last_labels, last_key, parts = _last_partition
        if last_dataset is dataset and last_key == key and np.array_equal(last_labels, labels):
            return parts
    parts = make_partition(partition, labels, num_replicas, seed=seed, alpha=dirichlet_alpha)
    _last_partition = (dataset, labels.copy(), key, parts)
    return parts


def part_size(loader: Any) -> Optional[int]:
    """``|D_j|``: how many training examples this rank's part of the data holds, read from its train loader.

    Paper 002 weights each rank's model by the size of its local data set (eq. 3). The rule:

    - the sampler's ``part_size`` when it has one (:class:`PartitionSampler`: its part, however many
      indices it yields per epoch to keep the ranks in step);
    - otherwise the examples the sampler yields per epoch, ``len(sampler)``: torch's
      ``DistributedSampler`` (``partition="reshuffled"``, or what Lightning injects) deals every rank an
      equal share of a fresh split each epoch, :class:`~lightning_dist.data.CDGraBSampler` reads its
      fixed part without the remainder it drops, and a rank's own sampler under
      ``use_distributed_sampler=False`` yields its own shard; a sampler that repeats or truncates its
      part should expose ``part_size``, or it is weighted by what it yields;
    - ``None`` (unknown) for anything else: not a ``DataLoader``, or a sampler without length (an
      ``IterableDataset``). Callers say so and weight such ranks equally.
    """
    if not isinstance(loader, DataLoader):
        return None
    sampler = getattr(loader.batch_sampler, "sampler", loader.sampler)
    declared = getattr(sampler, "part_size", None)
    if declared is not None:
        return int(declared)
    try:
        return len(sampler)
    except TypeError:
        return None


def rank_sampler(
    dataset: Sized,
    labels: ArrayLike,
    num_replicas: int,
    rank: int,
    partition: str,
    seed: int,
    dirichlet_alpha: float = 0.5,
) -> DistributedSampler:
    """The training sampler of rank ``rank``: a fresh split every epoch for :data:`RESHUFFLED`, else its
    part of ``partition`` (:class:`PartitionSampler`). Both give every rank the same number of examples."""
    if partition == RESHUFFLED:
        # drop_last: every rank takes the same number of steps (see PartitionSampler).
        return DistributedSampler(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
    return PartitionSampler(
        dataset, labels, num_replicas, rank, partition=partition, dirichlet_alpha=dirichlet_alpha, seed=seed, shuffle=True
    )
