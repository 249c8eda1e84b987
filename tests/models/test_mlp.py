"""MLPClassifier: shapes, hyperparameters, argument checks, and that it learns digits in 3 epochs."""

import lightning as L
import pytest
import torch

from lightning_dist.data.datamodules import DigitsDataModule
from lightning_dist.models import MLPClassifier


def fit_digits(seed: int = 0) -> tuple[MLPClassifier, L.Trainer, DigitsDataModule]:
    L.seed_everything(seed, verbose=False)
    datamodule = DigitsDataModule(batch_size=32, seed=seed)
    # lr=0.1 without momentum ends near 0.80 after 3 epochs; momentum gets 0.92-0.96 over seeds 0-2.
    model = MLPClassifier(datamodule.num_features, datamodule.num_classes, learning_rate=0.05, momentum=0.9)
    trainer = L.Trainer(max_epochs=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, datamodule=datamodule)
    return model, trainer, datamodule


def test_forward_shape_and_hparams():
    model = MLPClassifier(num_features=7, num_classes=3, hidden_size=5)
    assert model(torch.zeros(4, 7)).shape == (4, 3)
    assert dict(model.hparams) == dict(num_features=7, num_classes=3, hidden_size=5, learning_rate=0.1, momentum=0.0)
    assert sum(isinstance(m, torch.nn.Linear) for m in model.modules()) == 3


def test_learns_digits_and_reports_metrics():
    model, trainer, datamodule = fit_digits()
    assert {"train_loss", "val_loss", "val_acc"} <= set(trainer.callback_metrics)
    val_acc = float(trainer.callback_metrics["val_acc"])
    assert val_acc > 0.8
    (tested,) = trainer.test(model, datamodule=datamodule, verbose=False)
    assert tested["test_acc"] == pytest.approx(val_acc)
    assert tested["test_loss"] > 0


def test_training_is_deterministic():
    first, _, _ = fit_digits(seed=1)
    second, _, _ = fit_digits(seed=1)
    for a, b in zip(first.parameters(), second.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs, parameter",
    [
        (dict(num_features=0), "num_features"),
        (dict(num_classes=1), "num_classes"),
        (dict(hidden_size=2.5), "hidden_size"),
        (dict(learning_rate=0.0), "learning_rate"),
        (dict(momentum=1.0), "momentum"),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs, parameter):
    with pytest.raises(ValueError, match=parameter):
        MLPClassifier(**kwargs)
