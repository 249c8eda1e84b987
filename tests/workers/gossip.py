"""Worker for DataGossip tests: Lightning fits under torchrun (Gloo), results written per rank.

Spec keys: ``strategy`` (a registered name, or ``{"class": ..., "kwargs": ...}`` from
lightning_dist), ``gossip`` (DataGossip kwargs; ``timeout_s`` becomes ``timeout``), ``data``
(DigitsDataModule kwargs), ``trainer`` (extra Trainer kwargs), ``checkpoint_dir``, ``ckpt_path``
(``"epoch=N"`` picks the checkpoint of epoch N in ``checkpoint_dir``), ``log_dir`` (a CSVLogger),
``fail`` (``{"rank": r, "epoch": e}``: raise on rank r right after DataGossip started the
exchange of epoch e, then exit 1), ``delay`` (``{"rank": r, "seconds": s}``: sleep on rank r for
s seconds before DataGossip's end of epoch 0, or ``{epoch: seconds}`` for several epochs),
``model`` (``"scalar_loss"`` or ``"short_losses"``: a training_step DataGossip must refuse),
``dtype_rank`` (that rank's features are float64), ``plain_loader`` (a shuffling DataLoader
without a sampler); ``ckpt_path`` may also be a path. Each result holds the loss history the fit
started from (``start_history``) and the last validation accuracy (``val_acc``). ``runs``: a list of spec overrides fitted one after another in the same
processes (starting ranks costs more than these fits); the result file then holds a list.
Usage: see tests/helpers/launch.py.
"""

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

import lightning_dist
from lightning_dist.callbacks import DataGossip
from lightning_dist.data.datamodules import DigitsDataModule
from lightning_dist.models import MLPClassifier


class ScalarLoss(MLPClassifier):
    """Returns a bare loss tensor, as most LightningModules do: DataGossip must refuse it."""

    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx)["loss"]


class ShortLosses(MLPClassifier):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        return {"loss": out["loss"], "per_example_loss": out["per_example_loss"][:-1]}


MODELS = {None: MLPClassifier, "scalar_loss": ScalarLoss, "short_losses": ShortLosses}


class Float64Digits(DigitsDataModule):
    """Digits whose features are float64 on one rank: records differ in dtype across ranks."""

    def __init__(self, dtype_rank: int, **kwargs):
        super().__init__(**kwargs)
        self.dtype_rank = dtype_rank

    def setup(self, stage=None):
        super().setup(stage)
        if self.trainer.global_rank == self.dtype_rank:
            self.train_set.features = self.train_set.features.double()


class PlainLoaderDigits(DigitsDataModule):
    """A train loader without a distributed sampler: Lightning must still inject its DistributedSampler."""

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)


class Delay(Callback):
    """Placed before DataGossip: makes one rank reach some epoch ends (and its exchanges) late."""

    def __init__(self, rank: int, seconds: float | dict) -> None:
        self.rank = rank
        self.seconds = {int(epoch): s for epoch, s in seconds.items()} if isinstance(seconds, dict) else {0: seconds}

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.global_rank == self.rank:
            time.sleep(self.seconds.get(trainer.current_epoch, 0))


class Fail(Callback):
    """Placed after DataGossip: raises while this rank's exchange waits for the others."""

    def __init__(self, rank: int, epoch: int) -> None:
        self.rank, self.epoch = rank, epoch

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.global_rank == self.rank and trainer.current_epoch == self.epoch:
            raise RuntimeError(f"injected failure on rank {self.rank}")


class Recorder(Callback):
    """Placed after DataGossip: what each epoch trained on, what was sent and what was received."""

    def __init__(self, gossip: DataGossip, datamodule: DigitsDataModule) -> None:
        self.gossip, self.datamodule = gossip, datamodule
        self.epochs: list[dict] = []
        self.last_epoch_batches: list[dict] = []
        self.start_history: dict | None = None

    def on_train_epoch_start(self, trainer, pl_module):
        if not self.epochs:  # what the fit starts from: on a resume, the loss history the checkpoint gave this rank
            self.start_history = self.gossip.loss_history.state_dict()
        records = self.gossip.foreign_records
        self.epochs.append({
            "epoch": trainer.current_epoch,
            "num_training_batches": trainer.num_training_batches,
            "foreign_exchange_id": self.gossip.foreign_exchange_id,
            "foreign_x": torch.stack([x for x, _ in records]) if records else None,
            "foreign_y": torch.stack([y for _, y in records]) if records else None,
            "batches": 0, "foreign_batches": 0, "local_examples": 0,
        })
        self.foreign_before = self.gossip.foreign_batches
        self.last_epoch_batches = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        epoch = self.epochs[-1]
        epoch["batches"] += 1
        foreign = self.gossip.foreign_batches > self.foreign_before
        self.foreign_before = self.gossip.foreign_batches
        x, y = batch
        if foreign:
            epoch["foreign_batches"] += 1
        else:
            epoch["local_examples"] += len(y)
        self.last_epoch_batches.append({"foreign": foreign, "x": x.clone(), "y": y.clone(),
                                        "loss": outputs["per_example_loss"].clone()})

    def on_train_epoch_end(self, trainer, pl_module):
        epoch = self.epochs[-1]
        epoch["exchange_id"] = self.gossip.last_exchange_id
        indices = self.gossip.selected_indices
        epoch["selected_indices"] = None if indices is None else indices.clone()
        if indices is not None:
            dataset = self.datamodule.train_set
            epoch["selected_x"] = torch.stack([dataset[int(i)][0] for i in indices])
            epoch["selected_y"] = torch.stack([dataset[int(i)][1] for i in indices])


def build(spec: dict, rank: int):
    gossip_kwargs = dict(spec.get("gossip", {}))
    if "timeout_s" in gossip_kwargs:
        gossip_kwargs["timeout"] = timedelta(seconds=gossip_kwargs.pop("timeout_s"))
    gossip = DataGossip(**gossip_kwargs)
    data = spec.get("data", {})
    if "dtype_rank" in spec:
        datamodule = Float64Digits(spec["dtype_rank"], **data)
    else:
        datamodule = (PlainLoaderDigits if spec.get("plain_loader") else DigitsDataModule)(**data)
    torch.manual_seed(1000 + rank)  # replicas start different; ddp and dynamic_avg make them equal
    model = MODELS[spec.get("model")](num_features=datamodule.num_features, num_classes=datamodule.num_classes,
                                      **spec.get("model_kwargs", {}))
    recorder = Recorder(gossip, datamodule)
    callbacks = []
    if "delay" in spec:
        callbacks.append(Delay(**spec["delay"]))
    callbacks += [gossip, recorder]
    if "fail" in spec:
        callbacks.append(Fail(**spec["fail"]))
    if spec.get("checkpoint_dir"):
        callbacks.append(ModelCheckpoint(dirpath=spec["checkpoint_dir"], save_top_k=-1, every_n_epochs=1,
                                         filename="{epoch}-{step}"))
    strategy = spec["strategy"]
    if isinstance(strategy, dict):
        strategy = getattr(lightning_dist, strategy["class"])(**strategy.get("kwargs", {}))
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy,
        logger=CSVLogger(spec["log_dir"], name="", version="") if spec.get("log_dir") else False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=bool(spec.get("checkpoint_dir")),
        callbacks=callbacks, num_sanity_val_steps=0, deterministic=True, **spec.get("trainer", {}),
    )
    return trainer, model, datamodule, gossip, recorder


def fit(spec: dict, rank: int) -> dict:
    L.seed_everything(spec.get("seed", 0), verbose=False)
    trainer, model, datamodule, gossip, recorder = build(spec, rank)
    error = None
    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=spec.get("ckpt_path"))
    except Exception as exc:  # reported to the test, which asserts on it
        error = f"{type(exc).__name__}: {exc}"
    result = {"error": error, "rank": trainer.global_rank, "epochs": recorder.epochs}
    if error is None:
        history = gossip.loss_history
        sampler = trainer.train_dataloader.sampler
        partition = getattr(sampler, "part", torch.arange(len(datamodule.train_set)))
        result.update(
            weights=torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]),
            state=gossip.rank_state_dict(),
            variance=history.variance(),
            partition=torch.as_tensor(partition),
            labels=datamodule.train_set.labels.clone(),
            features=datamodule.train_set.features.clone(),
            last_epoch_batches=recorder.last_epoch_batches,
            metrics=gossip.metrics(),
            catch_up=gossip.catch_up_exchanges,
            global_step=trainer.global_step,
            sampler=type(sampler).__name__,
            start_history=recorder.start_history,
            val_acc=float(trainer.callback_metrics["val_acc"]) if "val_acc" in trainer.callback_metrics else None,
        )
    return result


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    rank = int(os.environ["RANK"])
    results = []
    for overrides in spec.get("runs", [{}]):
        run = {**spec, **overrides}
        if str(run.get("ckpt_path", "")).startswith("epoch="):
            (run["ckpt_path"],) = map(str, Path(run["checkpoint_dir"]).glob(f"{run['ckpt_path']}-*.ckpt"))
            run["checkpoint_dir"] = None
        started = time.monotonic()
        result = fit(run, rank)
        result["seconds"] = time.monotonic() - started
        results.append(result)
        # Written after every run, so that the runs before a hanging one still report.
        torch.save(results if "runs" in spec else result, out / f"rank{rank}.pt")
        if result["error"] is not None and "fail" in run:
            sys.exit(1)  # like an uncaught exception: torchrun must see the failure


if __name__ == "__main__":
    main()
