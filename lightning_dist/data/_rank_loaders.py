"""What this package's data modules share: a train loader per rank, asked of the Trainer or of the simulator."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, TypeVar

import lightning as L
from torch.utils.data import DataLoader

T = TypeVar("T")


class RankLoaderDataModule(L.LightningDataModule, ABC):
    """A data module whose train loader is built for a given rank of a given number of replicas.

    Lightning asks ``train_dataloader()`` inside a fit, where the Trainer knows the rank; the simulator asks
    ``train_loader(num_replicas, rank)`` for each of its virtual workers, all in one process. Each data module
    chooses its sampler there (its partition of the examples, or CD-GraB's order).
    """

    def train_dataloader(self) -> DataLoader:
        """This rank's loader as the strategy shards data (``distributed_sampler_kwargs``, as Lightning's own sampler
        would: under ``fault_tolerance`` the shard of the replica group, not of this job's ranks)."""
        trainer = self.trainer
        if trainer is None:
            return self.train_loader(1, 0)
        shard = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {
            "num_replicas": trainer.world_size, "rank": trainer.global_rank}
        return self.train_loader(shard["num_replicas"], shard["rank"])

    @abstractmethod
    def train_loader(self, num_replicas: int, rank: int) -> DataLoader:
        """The train loader of rank ``rank`` of ``num_replicas``."""


def require_setup(owner: object, dataset: Optional[T]) -> T:
    """``dataset``, or the error a datamodule raises when a loader is asked for before ``setup``."""
    if dataset is None:
        raise RuntimeError(f"{type(owner).__name__}.setup() must run before its dataloaders are requested")
    return dataset
