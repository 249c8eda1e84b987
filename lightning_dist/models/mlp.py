"""A small MLP classifier used by the examples, configs and strategy tests.

It is deliberately plain (no dropout, no batch norm, SGD) so that a CPU run is deterministic and
replicas differ only through their data and the distributed algorithm under test.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import Tensor, nn
from torchmetrics.classification import MulticlassAccuracy

from lightning_dist.algorithms.arguments import check_count, check_number


class MLPClassifier(L.LightningModule):
    """Two hidden ReLU layers of ``hidden_size`` units, cross-entropy loss, SGD.

    Logs ``train_loss`` every step, ``val_loss``/``val_acc`` and ``test_loss``/``test_acc`` per epoch,
    averaged over all ranks. ``training_step`` returns ``{"loss": ..., "per_example_loss": ...}``,
    the form :class:`~lightning_dist.callbacks.DataGossip` needs.
    """

    def __init__(
        self,
        num_features: int = 40,
        num_classes: int = 10,
        hidden_size: int = 64,
        learning_rate: float = 0.1,
        momentum: float = 0.0,
    ) -> None:
        super().__init__()
        for name, value, minimum in (("num_features", num_features, 1), ("num_classes", num_classes, 2),
                                     ("hidden_size", hidden_size, 1)):
            check_count(name, value, minimum)
        check_number("learning_rate", learning_rate, 0.0, strict=True)
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must satisfy 0 <= momentum < 1; got {momentum!r}")
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(num_features, hidden_size),
            nn.ReLU(),
            nn.Linear(hidden_size, hidden_size),
            nn.ReLU(),
            nn.Linear(hidden_size, num_classes),
        )
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
        """The mean cross-entropy as ``loss``, plus each example's loss as ``per_example_loss``.

        ``per_example_loss`` (detached) is what :class:`lightning_dist.callbacks.DataGossip` records
        to select records; Lightning optimizes ``loss`` and ignores the other key.
        """
        per_example = self.per_example_loss(batch)
        loss = per_example.mean()
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return {"loss": loss, "per_example_loss": per_example.detach()}

    def per_example_loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        """Each example's cross-entropy, shape ``(batch_size,)``: what :class:`~lightning_dist.callbacks.CDGraB`
        differentiates per example (and what ``training_step`` averages)."""
        x, y = batch
        return nn.functional.cross_entropy(self(x), y, reduction="none")

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val", self.val_acc)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test", self.test_acc)

    def _evaluate(self, batch: tuple[Tensor, Tensor], stage: str, accuracy: MulticlassAccuracy) -> None:
        x, y = batch
        logits = self(x)
        # batch_size makes the epoch loss a per-example mean even when the last batch is short.
        self.log(f"{stage}_loss", nn.functional.cross_entropy(logits, y), sync_dist=True, batch_size=len(y))
        accuracy(logits, y)
        # The metric syncs its own counts across ranks when computed; sync_dist only matters for tensors.
        self.log(f"{stage}_acc", accuracy, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.learning_rate, momentum=self.hparams.momentum)
