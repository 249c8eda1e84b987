"""Worker for DownpourSGD tests: one Lightning fit under torchrun, results per rank.

Spec keys: ``strategy`` kwargs, ``data``, ``trainer`` (extra Trainer arguments), optional
``slow`` (``{"rank": r, "seconds": s}``: sleep before every batch of that rank), ``raise_at``
(``{"rank": r, "step": s}``), ``nan`` (``{"rank": r, "step": s}``), ``checkpoint_dir``,
``ckpt_path``, ``batchnorm`` (``{"lr": a}``: train :class:`BatchNormClassifier` with Adam instead
of the plain MLP); ``runs``: a list of such specs' overrides, each with a ``name``, fitted in turn in one launch
(results under ``out/<name>``). Usage: see tests/helpers/launch.py.
"""

import json
import os
import sys
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

from lightning_dist import DownpourSGDStrategy
from lightning_dist.data.datamodules import DigitsDataModule
from lightning_dist.models import MLPClassifier


class RecordingDownpour(DownpourSGDStrategy):
    """Also sums the updates the server applied from this rank (for the server invariant): each accepted push, divided
    by its staleness plus one when staleness-aware (the reply's version is one past the version the push found)."""

    def _push(self) -> None:
        update = self.model_vector.get().cpu() - self._pulled
        rejected_before, pulled_version = self._rejected_pushes, self._pulled_version
        super()._push()
        if self._rejected_pushes == rejected_before:
            staleness_plus_one = self._pulled_version - pulled_version if self.staleness_aware else 1
            applied = update.double() / staleness_plus_one
            self.accepted_sum = getattr(self, "accepted_sum", torch.zeros_like(applied)) + applied


class BatchNormClassifier(MLPClassifier):
    """The MLP with BatchNorm1d after each hidden layer, trained with Adam: running statistics to keep right."""

    def __init__(self, num_features: int, num_classes: int, hidden_size: int = 32, lr: float = 0.01) -> None:
        super().__init__(num_features=num_features, num_classes=num_classes, hidden_size=hidden_size, learning_rate=lr)
        self.net = nn.Sequential(
            nn.Linear(num_features, hidden_size), nn.BatchNorm1d(hidden_size), nn.ReLU(),
            nn.Linear(hidden_size, hidden_size), nn.BatchNorm1d(hidden_size), nn.ReLU(),
            nn.Linear(hidden_size, num_classes),
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)


class RunningStatistics(Callback):
    """At every validation (which runs on the server's model): that model, its smallest running variance, val_loss."""

    def __init__(self) -> None:
        self.min_running_var: list[float] = []
        self.val_loss: list[float] = []
        self.validated: list[torch.Tensor] = []

    def on_validation_end(self, trainer, pl_module):
        # Still on the evaluated model; ModelCheckpoint saves later, at the training epoch's end.
        self.validated.append(trainer.strategy.model_vector.get().clone())
        variances = [m.running_var for m in pl_module.modules() if isinstance(m, nn.BatchNorm1d)]
        if variances:
            self.min_running_var.append(float(torch.cat(variances).min()))
        if "val_loss" in trainer.callback_metrics:
            self.val_loss.append(float(trainer.callback_metrics["val_loss"]))


class Timing(Callback):
    def __init__(self, slow: dict | None) -> None:
        self.slow = slow
        self.batch_end_times: list[float] = []
        self.start_vector = None

    def on_train_start(self, trainer, pl_module):
        self.start_vector = trainer.strategy.model_vector.get().clone()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.slow and trainer.global_rank == self.slow["rank"]:
            time.sleep(self.slow["seconds"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batch_end_times.append(time.perf_counter())


class Fail(Callback):
    def __init__(self, rank: int, step: int, nan: bool) -> None:
        self.rank, self.step, self.nan = rank, step, nan

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            if not self.nan:
                raise RuntimeError(f"injected failure on rank {self.rank}")
            with torch.no_grad():
                next(pl_module.parameters()).fill_(float("nan"))


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    if "runs" not in spec:
        fit(spec)
    for overrides in spec.get("runs", []):  # several fits in one launch, each into out/<name>
        out = Path(spec["out"]) / overrides["name"]
        out.mkdir(exist_ok=True)
        fit({**spec, **overrides, "out": str(out)})


def fit(spec: dict) -> None:
    out = Path(spec["out"])
    L.seed_everything(spec.get("seed", 0), workers=True)
    strategy = RecordingDownpour(**spec.get("strategy", {}))
    datamodule = DigitsDataModule(**spec.get("data", {}))
    torch.manual_seed(1000 + int(os.environ.get("RANK", "0")))  # the strategy must make replicas identical
    if "batchnorm" in spec:
        model = BatchNormClassifier(datamodule.num_features, datamodule.num_classes, **spec["batchnorm"])
    else:
        model = MLPClassifier(num_features=datamodule.num_features, num_classes=datamodule.num_classes,
                              **spec.get("model", {}))
    timing = Timing(spec.get("slow"))
    statistics = RunningStatistics()
    callbacks = [timing, statistics]
    for key in ("raise_at", "nan"):
        if key in spec:
            callbacks.append(Fail(spec[key]["rank"], spec[key]["step"], nan=key == "nan"))
    if spec.get("checkpoint_dir"):
        callbacks.append(ModelCheckpoint(dirpath=spec["checkpoint_dir"], save_top_k=-1, every_n_epochs=1,
                                         filename="{epoch}-{step}"))
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=bool(spec.get("checkpoint_dir")),
        callbacks=callbacks, num_sanity_val_steps=0, deterministic=True, **spec.get("trainer", {}),
    )
    error = None
    start = time.perf_counter()
    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=spec.get("ckpt_path"))
        if spec.get("save_after_fit"):  # as a user who goes on training later would
            trainer.save_checkpoint(out / "after_fit.ckpt")
    except Exception as exc:  # reported to the test, which asserts on it
        error = f"{type(exc).__name__}: {exc}"
    result = {"error": error, "rank": trainer.global_rank, "fit_s": time.perf_counter() - start,
              "batch_end_times": [t - start for t in timing.batch_end_times]}
    if error is None:
        strategy = trainer.strategy
        result.update(
            vector=strategy.model_vector.get(),
            start_vector=timing.start_vector,
            comm=strategy.comm_stats,
            server=strategy.protocol_state_dict()["server"],
            metrics=strategy.protocol_metrics(),
            pushes=strategy._syncs,
            accepted_sum=getattr(strategy, "accepted_sum", None),
            push_residual=None if strategy._pushes is None else strategy._pushes.residual,
            global_step=trainer.global_step,
            callback_metrics={k: float(v) for k, v in trainer.callback_metrics.items()},
            min_running_var=statistics.min_running_var,
            val_losses=statistics.val_loss,
            validated=statistics.validated,
        )
    torch.save(result, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
