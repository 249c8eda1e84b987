"""A simulator replica trains as Trainer.fit would: the learning-rate schedulers configure_optimizers returns
step after every optimizer step (interval "step") or every epoch of the worker's loader (Lightning's default)."""

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist.sim.replica import Replica


class Scheduled(L.LightningModule):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 1)
        self.form = form

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.linear(x) - y) ** 2).mean()

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.4)
        if self.form == "warmup":  # TransformerLM's warmup: lr * min(1, (s + 1) / 5) at step s
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
        if self.form == "every_other_step":
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            schedule = {"scheduler": scheduler, "interval": "step", "frequency": 2}
            return {"optimizer": optimizer, "lr_scheduler": schedule}
        if self.form == "epoch":
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)]
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)}


def replica(form):
    data = TensorDataset(torch.randn(12, 2), torch.randn(12, 1))
    return Replica(Scheduled(form), DataLoader(data, batch_size=4))  # 3 batches an epoch


def learning_rates(form, steps):
    worker = replica(form)
    rates = []
    for _ in range(steps):
        batch = worker.next_batch()  # as the simulation's workers do: the batch (and any epoch's end) first
        rates.append(worker.optimizer.param_groups[0]["lr"])
        worker.step(batch)
    return rates


def test_a_step_interval_warmup_sets_each_steps_learning_rate():
    assert learning_rates("warmup", 7) == pytest.approx([0.4 * min(1, (step + 1) / 5) for step in range(7)])


def test_a_step_interval_scheduler_steps_every_frequency_steps():
    assert learning_rates("every_other_step", 6) == pytest.approx([0.4, 0.4, 0.2, 0.2, 0.1, 0.1])


def test_a_scheduler_without_interval_steps_once_per_epoch_of_the_workers_loader():
    assert learning_rates("epoch", 7) == pytest.approx([0.4] * 3 + [0.04] * 3 + [0.004])


def test_reduce_on_plateau_is_refused_by_name():
    with pytest.raises(ValueError, match="ReduceLROnPlateau"):
        replica("plateau")
