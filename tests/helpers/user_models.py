"""What a user brings to lightning_dist: their own LightningModule and DataModule, not this package's.

:class:`DigitsCNN` is a small CNN on scikit-learn's 8x8 digits with BatchNorm and Dropout, trained
with Adam and a StepLR schedule: the kind of module issue 16 found DownpourSGD's NaN with. It can
train with Lightning's automatic optimization, manual optimization with one optimizer, or manual
optimization with two optimizers (features and head, each with its own schedule), and it logs
``val_loss``/``val_acc``/``test_loss`` with ``sync_dist=True`` as Lightning's docs recommend.

:class:`DigitsImages` serves the digits as ``(1, 8, 8)`` images: a map-style train set (Lightning
injects its DistributedSampler), an IterableDataset sharded by rank (with or without ``__len__``),
or unequal per-rank shards for runs with ``use_distributed_sampler=False``. The validation set has
360 images, a multiple of 2 and 3, so every rank's shard has the same size and the mean of the
ranks' means (``sync_dist``) is the mean over the whole set that one process computes.

:func:`evaluate` scores a module in one process the way ``validation_step`` does.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

NUM_TRAIN = 1437  # digits: 1797 images, 360 held out
VAL_BATCH = 60
CDGRAB_EXAMPLES = 384


@lru_cache(maxsize=1)
def digits_tensors() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Train and validation images ``(n, 1, 8, 8)`` in [0, 1] and labels: a fixed stratified split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_train, x_val, y_train, y_val = train_test_split(
        digits.images / 16.0, digits.target, test_size=360, stratify=digits.target, random_state=0
    )

    def images(x: Any) -> Tensor:
        return torch.tensor(x, dtype=torch.float32).unsqueeze(1)

    return images(x_train), torch.tensor(y_train), images(x_val), torch.tensor(y_val)


class DigitsCNN(L.LightningModule):
    """Conv-BN-ReLU-pool twice, dropout, a linear head; Adam with StepLR.

    Args:
        optimization: ``"automatic"``, ``"manual"`` (one optimizer, stepped in ``training_step``)
            or ``"two_optimizers"`` (manual: Adam on the convolutions, Adam on the head).
        per_example_outputs: ``training_step`` returns ``{"loss", "per_example_loss"}`` (the
            one change DataGossip asks of a module) instead of the loss.
        lr: Adam's learning rate.
        norm: ``"batch"`` (BatchNorm2d) or ``"group"`` (GroupNorm, what CD-GraB's per-example
            gradients need: BatchNorm in training mode mixes the examples of a batch).
    """

    def __init__(self, optimization: str = "automatic", per_example_outputs: bool = False, lr: float = 0.01,
                 norm: str = "batch") -> None:
        super().__init__()
        if optimization not in ("automatic", "manual", "two_optimizers"):
            raise ValueError(f"optimization must be automatic, manual or two_optimizers; got {optimization!r}")
        self.save_hyperparameters()
        self.automatic_optimization = optimization == "automatic"
        def normalization(channels: int) -> nn.Module:
            return nn.BatchNorm2d(channels) if norm == "batch" else nn.GroupNorm(4, channels)

        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), normalization(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), normalization(16), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.25), nn.Linear(16 * 2 * 2, 10))
        self.clipped_norms: list[tuple[float, float]] = []  # total gradient norm before and after each clipping

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Any:
        x, y = batch
        per_example = F.cross_entropy(self(x), y, reduction="none")
        loss = per_example.mean()
        self.log("train_loss", loss)
        if not self.automatic_optimization:
            optimizers = self.optimizers()
            optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
            schedulers = self.lr_schedulers()
            schedulers = schedulers if isinstance(schedulers, list) else [schedulers]
            for optimizer in optimizers:
                optimizer.zero_grad()
            self.manual_backward(loss)
            for optimizer in optimizers:
                optimizer.step()
            if self.trainer.is_last_batch:
                for scheduler in schedulers:
                    scheduler.step()
            loss = loss.detach()
        if self.hparams.per_example_outputs:
            return {"loss": loss, "per_example_loss": per_example.detach()}
        return loss if self.automatic_optimization else None

    def per_example_loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        """Each example's loss: what CD-GraB differentiates per example."""
        x, y = batch
        return F.cross_entropy(self(x), y, reduction="none")

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None,
                                    gradient_clip_algorithm: Any = None) -> None:
        before = self._gradient_norm()
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        if gradient_clip_val:
            self.clipped_norms.append((before, self._gradient_norm()))

    def _gradient_norm(self) -> float:
        return float(torch.stack([p.grad.detach().norm() for p in self.parameters() if p.grad is not None]).norm())

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def predict_step(self, batch: tuple[Tensor, Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
        x, _, index = batch
        return {"index": index, "prediction": self(x).argmax(dim=1)}

    def _evaluate(self, batch: tuple[Tensor, Tensor], stage: str) -> None:
        x, y = batch
        logits = self(x)
        self.log(f"{stage}_loss", F.cross_entropy(logits, y), sync_dist=True, batch_size=len(y))
        self.log(f"{stage}_acc", (logits.argmax(dim=1) == y).float().mean(), sync_dist=True, batch_size=len(y))

    def configure_optimizers(self) -> Any:
        lr = self.hparams.lr
        if self.hparams.optimization == "two_optimizers":
            optimizers = [torch.optim.Adam(self.features.parameters(), lr=lr),
                          torch.optim.Adam(self.head.parameters(), lr=lr / 2)]
            return optimizers, [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in optimizers]
        optimizer = torch.optim.Adam(self.parameters(), lr=lr)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)}


class _RankShard(IterableDataset):
    """This rank's examples ``rank, rank + m, ...`` (equal counts), streamed in a new seeded order each pass."""

    def __init__(self, x: Tensor, y: Tensor) -> None:
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        usable = len(x) // world * world
        self.x, self.y = x[rank:usable:world], y[rank:usable:world]
        self.passes = 0

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.passes))
        self.passes += 1
        for i in order.tolist():
            yield self.x[i], self.y[i]


class _SizedRankShard(_RankShard):
    def __len__(self) -> int:
        return len(self.x)


class _Indexed(Dataset):
    def __init__(self, x: Tensor, y: Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        return self.x[i], self.y[i], torch.tensor(i)


class DigitsImages(L.LightningDataModule):
    """The digits as images, for the user's own train loop.

    Args:
        batch_size: training batch size.
        train: ``"map"`` (a TensorDataset, shuffled; Lightning shards it), ``"iterable"`` (an
            IterableDataset of this rank's shard with ``__len__``), ``"iterable_unsized"`` (the same
            without ``__len__``), ``"unequal"`` (rank ``r`` reads the first ``shards[r]``
            examples; for ``use_distributed_sampler=False``) or ``"cdgrab"`` (a
            ``CDGraBSampler(order="balanced")`` over the first ``CDGRAB_EXAMPLES`` images, for the
            CDGraB callback).
        shards: examples per rank for ``"unequal"``.
    """

    def __init__(self, batch_size: int = 32, train: str = "map", shards: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.train = train
        self.shards = shards

    def train_dataloader(self) -> DataLoader:
        x, y, _, _ = digits_tensors()
        if self.train in ("iterable", "iterable_unsized"):
            shard = _SizedRankShard(x, y) if self.train == "iterable" else _RankShard(x, y)
            return DataLoader(shard, batch_size=self.batch_size)
        if self.train == "cdgrab":
            from lightning_dist.data import CDGraBSampler

            dataset = TensorDataset(x[:CDGRAB_EXAMPLES], y[:CDGRAB_EXAMPLES])  # short epochs: CD-GraB orders whole ones
            sampler = CDGraBSampler(dataset, batch_size=self.batch_size)
            return DataLoader(dataset, batch_size=self.batch_size, sampler=sampler)
        if self.train == "unequal":
            count = self.shards[dist.get_rank()]
            return DataLoader(TensorDataset(x[:count], y[:count]), batch_size=self.batch_size, shuffle=True)
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        _, _, x, y = digits_tensors()
        return DataLoader(TensorDataset(x, y), batch_size=VAL_BATCH)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        _, _, x, y = digits_tensors()
        return DataLoader(_Indexed(x, y), batch_size=VAL_BATCH)


@torch.no_grad()
def evaluate(module: nn.Module, precision: str = "32") -> dict[str, float]:
    """``val_loss`` and ``val_acc`` of ``module`` over the whole validation set, in one process, in eval mode.

    Per batch of ``VAL_BATCH``, then the mean over batches, as Lightning reduces ``self.log``.
    """
    _, _, x, y = digits_tensors()
    module.eval()
    losses, accuracies = [], []
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        for start in range(0, len(x), VAL_BATCH):
            logits = module(x[start : start + VAL_BATCH]).float()
            target = y[start : start + VAL_BATCH]
            losses.append(F.cross_entropy(logits, target))
            accuracies.append((logits.argmax(dim=1) == target).float().mean())
    return {"val_loss": float(torch.stack(losses).mean()), "val_acc": float(torch.stack(accuracies).mean())}


@torch.no_grad()
def predict(module: nn.Module) -> Tensor:
    """The predicted class of every validation image, in one process."""
    _, _, x, _ = digits_tensors()
    module.eval()
    return module(x).argmax(dim=1)


class _Divide(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, stored: Tensor) -> Tensor:
        return stored / self.scale


def in_other_units(module: nn.Module, scale: float) -> nn.Module:
    """``module`` with every parameter stored ``scale`` times larger and divided by ``scale`` where it is used.

    The function it computes is unchanged; SGD on the stored parameters with its learning rate times ``scale**2``
    follows the same trajectory of the used weights (the gradient of a stored parameter is ``1/scale`` times the
    used weight's, and its step moves the used weight by ``1/scale`` of its own), while every squared distance between
    stored parameters is ``scale**2`` times larger: the same training in other units.
    """
    from torch.nn.utils import parametrize

    for layer in [sub for sub in module.modules() if isinstance(sub, nn.Linear)]:
        for name in ("weight", "bias"):
            with torch.no_grad():
                getattr(layer, name).mul_(scale)
            parametrize.register_parametrization(layer, name, _Divide(scale))
    return module


class TinyVarianceMLP(L.LightningModule):
    """An MLP a user might write, with what broke last round's options: a BatchNorm on un-normalized inputs of tiny
    variance (``x * 1e-3``; by default ``momentum=None`` tracks the cumulative average, so the running variance is
    about 1e-7 from the first step; torch's 0.1 decays to it from 1 over a few hundred steps), a frozen parameter (``requires_grad=False``, in the model but never stepped) and Adam.
    A running variance quantized in an int8 block with the parameters' deltas decodes below zero: NaN evaluation."""

    def __init__(self, num_features: int = 64, num_classes: int = 10, hidden: int = 32, lr: float = 0.01,
                 optimizer: str = "adam", momentum: float | None = None) -> None:
        super().__init__()
        self.lr, self.optimizer = lr, optimizer
        self.norm = nn.BatchNorm1d(num_features, momentum=momentum)
        self.hidden = nn.Linear(num_features, hidden)
        self.frozen_shift = nn.Parameter(torch.linspace(-0.5, 0.5, hidden), requires_grad=False)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.relu(self.hidden(self.norm(x * 1e-3)) + self.frozen_shift))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True, batch_size=len(y))

    def configure_optimizers(self) -> Any:
        trained = (p for p in self.parameters() if p.requires_grad)
        return torch.optim.Adam(trained, lr=self.lr) if self.optimizer == "adam" else torch.optim.SGD(trained, lr=self.lr)
