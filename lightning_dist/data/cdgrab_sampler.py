"""The sampler of CD-GraB (paper 003): a fixed random partition, read in an order decided per epoch.

In paper 003 each worker owns a fixed subset of the data and only the order in which it reads
that subset changes between epochs. :class:`CDGraBSampler` does that: it shuffles the dataset
once with ``seed``, drops the remainder so every rank gets the same number ``n`` of examples, a
multiple of the per-rank batch size (the paper discards it too; pairs and lockstep steps need
it), and gives rank ``r`` the ``r``-th block. Each epoch it yields that block in the epoch's
order: a seeded random permutation in epoch 0 and, with ``order="random"``, in every epoch
(distributed random reshuffling, D-RR, the paper's baseline); with ``order="balanced"`` the
:class:`~lightning_dist.callbacks.CDGraB` callback installs each next epoch's order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sized
from typing import Any, Optional

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.utils.data import DistributedSampler

from lightning_dist.algorithms.arguments import check_count

ORDERS = ("balanced", "random")


class CDGraBSampler(DistributedSampler):
    """Drop-in replacement for :class:`~torch.utils.data.DistributedSampler` with per-epoch decided orders.

    Use it in the train dataloader with the same ``batch_size``::

        sampler = CDGraBSampler(dataset, batch_size=16)  # world size and rank from torch.distributed
        DataLoader(dataset, batch_size=16, sampler=sampler)

    and add :class:`~lightning_dist.callbacks.CDGraB` to the Trainer's callbacks. It subclasses
    ``DistributedSampler``, so Lightning leaves it in place (no ``use_distributed_sampler=False``
    needed) and calls :meth:`set_epoch` before every epoch.

    Args:
        dataset: map-style dataset with a length.
        batch_size: examples per step on each rank (the loader's ``batch_size``); even, because
            CD-GraB balances consecutive examples in pairs.
        num_replicas: as for ``DistributedSampler`` (default: from the process group).
        rank: as for ``DistributedSampler`` (default: from the process group).
        order: ``"balanced"`` (orders come from the ``CDGraB`` callback from epoch 1 on) or
            ``"random"`` (a fresh seeded permutation every epoch: D-RR).
        seed: seeds the partition and the random permutations; must be the same on every rank.

    Attributes:
        dropped: examples left out of every epoch (``len(dataset)`` modulo ``batch_size * num_replicas``).
        local_indices: this rank's dataset indices, in block order (order positions index into it).
        permutation: the current epoch's order, positions into ``local_indices``.
    """

    def __init__(
        self,
        dataset: Sized,
        batch_size: int,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        order: str = "balanced",
        seed: int = 0,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, seed=seed, drop_last=True)
        batch_size = check_count("batch_size", batch_size, 2)
        if batch_size % 2:
            raise ValueError(
                f"batch_size must be even (CD-GraB balances consecutive examples of a batch in pairs); got {batch_size}"
            )
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}; got {order!r}")
        check_count("seed", seed, 0)
        self.batch_size = batch_size
        self.order = order
        global_batch = batch_size * self.num_replicas
        usable = len(dataset) // global_batch * global_batch
        if usable == 0:
            raise ValueError(
                f"the dataset has {len(dataset)} examples, fewer than one step of batch_size={batch_size} on each of "
                f"{self.num_replicas} ranks ({global_batch})"
            )
        self.dropped = len(dataset) - usable
        self.num_samples = usable // self.num_replicas
        self.total_size = usable
        shuffled = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:usable]
        self.local_indices = shuffled[self.rank * self.num_samples : (self.rank + 1) * self.num_samples]
        self.permutation = self.random_permutation(0)
        self._next: Optional[tuple[int, Tensor]] = None
        self._start = 0
        if self.dropped:
            rank_zero_info(
                f"CDGraBSampler: {self.dropped} of {len(dataset)} examples are left out of every epoch, so that each of "
                f"{self.num_replicas} ranks reads {self.num_samples} examples in whole batches of {batch_size}"
            )

    def random_permutation(self, epoch: int) -> Tensor:
        """The seeded random order of ``epoch`` on this rank (positions into :attr:`local_indices`): epoch 0's,
        every epoch's with ``order="random"``, and where CD-GraB resumed at another world size."""
        seed = int(np.random.SeedSequence([self.seed, epoch, self.rank]).generate_state(1, np.uint64)[0] >> 1)
        generator = torch.Generator().manual_seed(seed)
        return torch.randperm(self.num_samples, generator=generator)

    def __iter__(self) -> Iterator[int]:
        start, self._start = self._start, 0
        return iter(self.local_indices[self.permutation[start:]].tolist())

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Select the order of ``epoch``: installed by :meth:`install_next_order`, else seeded random.

        With ``order="balanced"`` only epoch 0 is random; a later epoch without an installed order
        means no ``CDGraB`` callback decided it, which is an error rather than a silent D-RR run.
        """
        epoch = check_count("epoch", epoch, 0)
        if epoch == self.epoch:
            return
        if self._next is not None and self._next[0] == epoch:
            self.permutation = self._next[1]
        elif self.order == "random" or epoch == 0:
            self.permutation = self.random_permutation(epoch)
        else:
            raise RuntimeError(
                f"CDGraBSampler(order='balanced') has no order for epoch {epoch}: add the CDGraB callback to the "
                "Trainer, or use order='random' for random reshuffling"
            )
        self._next = None
        self.epoch = epoch

    def install_next_order(self, epoch: int, permutation: Tensor) -> None:
        """Make ``permutation`` (positions into :attr:`local_indices`) the order of ``epoch`` from its ``set_epoch`` on."""
        self._next = (check_count("epoch", epoch, 0), self._check_permutation(permutation))

    def resume_at(self, epoch: int, permutation: Tensor, start: int) -> None:
        """Continue ``epoch`` in ``permutation`` after its first ``start`` examples (a mid-epoch resume).

        The next iteration skips them; ``len`` stays the epoch's full length, which is what
        Lightning expects of a loader that it resumes at batch ``start / batch_size``.
        """
        self.permutation = self._check_permutation(permutation)
        self.epoch = check_count("epoch", epoch, 0)
        self._next = None
        self._start = check_count("start", start, 0, self.num_samples)

    def _check_permutation(self, permutation: Tensor) -> Tensor:
        permutation = torch.as_tensor(permutation, dtype=torch.int64).cpu()
        if permutation.shape != (self.num_samples,) or not torch.equal(
            permutation.sort().values, torch.arange(self.num_samples)
        ):
            raise ValueError(f"permutation must be a permutation of range({self.num_samples}); got {permutation!r}")
        return permutation

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "permutation": self.permutation.clone(), "start": self._start}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.resume_at(state_dict["epoch"], state_dict["permutation"], state_dict["start"])
