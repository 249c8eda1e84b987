"""Worker of the averaging benchmarks: one Lightning fit under torchrun, one JSON file from rank 0.

Usage (normally through ``benchmarks/averaging/run.py``)::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node=8 --master_addr=127.0.0.1 \
        --master_port=PORT benchmarks/averaging/worker.py spec.json

``spec.json`` holds ``name``, ``strategy`` (``{"class": ..., "kwargs": {...}}``), ``data``
(the datamodule's arguments), ``model`` (MLPClassifier arguments), ``epochs``, ``seed``,
``out`` (the JSON file to write), ``dataset`` (``"mnist1d"``, the default, or ``"digits"``), and
optionally ``drift`` (a list of ``{"epoch": E, "permutation": [...]}``: from the start of epoch
``E`` every split returns ``permutation[y]``, until the next entry's epoch) and ``probe`` (record,
on every rank, the squared distance ``||f_i - r||^2`` that dynamic averaging tests at each check,
before the check acts; used to calibrate the divergence thresholds).

Per epoch, rank 0 records the validation accuracy of the averaged model (``val_acc``) and the
communication counters summed over ranks (``CommStats``), read through the collective
``strategy.refresh_comm_stats()`` which a callback calls on every rank at ``on_train_epoch_end``
(after that epoch's validation).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from benchmarks.common.report import write_json
import lightning_dist
from lightning_dist.data.datamodules import DigitsDataModule, MNIST1DDataModule
from lightning_dist.models import MLPClassifier


def with_eval_batch_size(base: type) -> type:
    """``base`` (an ArrayDataModule) whose validation loader uses ``eval_batch_size`` (same metrics).

    Validation runs every epoch on the averaged model; with small batches it would take longer
    than the training epoch itself. Accuracy counts and the per-example mean loss do not depend on
    the batch size.
    """

    class EvalBatched(base):
        def __init__(self, eval_batch_size: int | None = None, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.eval_batch_size = eval_batch_size

        def val_dataloader(self) -> DataLoader:
            loader = super().val_dataloader()
            if self.eval_batch_size is None:
                return loader
            return DataLoader(loader.dataset, batch_size=self.eval_batch_size, num_workers=0)

    return EvalBatched


DATASETS = {"mnist1d": MNIST1DDataModule, "digits": DigitsDataModule}


class EpochRecorder(Callback):
    """Per epoch: validation metrics and communication counters summed over ranks (a collective)."""

    def __init__(self) -> None:
        self.epochs: list[dict[str, Any]] = []
        self._start = time.perf_counter()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        strategy = trainer.strategy
        stats = strategy.refresh_comm_stats()  # collective: runs on every rank
        metrics = trainer.callback_metrics
        record = {
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
            "val_acc": float(metrics["val_acc"]) if "val_acc" in metrics else math.nan,
            "val_loss": float(metrics["val_loss"]) if "val_loss" in metrics else math.nan,
            "protocol_bytes": stats.protocol_bytes,
            "bytes_sent": stats.bytes_sent,
            "bytes_by_purpose": dict(stats.bytes_by_purpose),
            "messages": stats.messages,
            "syncs": stats.syncs,
            "wall_s": time.perf_counter() - self._start,
            **strategy.protocol_metrics(),
        }
        self.epochs.append(record)


class LabelDrift(Callback):
    """Concept drift: from the start of each scheduled epoch, relabel every split (on every rank) through that
    entry's permutation."""

    def __init__(self, schedule: list[dict[str, Any]]) -> None:
        self.permutations = {int(entry["epoch"]): entry["permutation"] for entry in schedule}

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch in self.permutations:
            trainer.datamodule.set_label_permutation(self.permutations[trainer.current_epoch])


def probe_class(base: type) -> type:
    """``base`` (DynamicAveragingStrategy) that also records each check's local distance, pre-check."""

    class Probe(base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.probe_distances: list[float] = []

        def after_local_step(self, step: int) -> None:
            if step % self.check_every == 0:
                local = self.model_vector.parameters_of(self.model_vector.get()).double()
                self.probe_distances.append(float(torch.sum((local - self.reference.double()) ** 2)))
            super().after_local_step(step)

    return Probe


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    seed = int(spec.get("seed", 0))
    L.seed_everything(seed, workers=True, verbose=False)
    strategy_cls = getattr(lightning_dist, spec["strategy"]["class"])
    if spec.get("probe"):
        strategy_cls = probe_class(strategy_cls)
    strategy = strategy_cls(seed=seed, **spec["strategy"].get("kwargs", {}))
    datamodule = with_eval_batch_size(DATASETS[spec.get("dataset", "mnist1d")])(seed=seed, **spec.get("data", {}))
    model = MLPClassifier(num_features=datamodule.num_features, num_classes=datamodule.num_classes, **spec.get("model", {}))
    recorder = EpochRecorder()
    callbacks: list[Callback] = [recorder]
    if spec.get("drift"):
        callbacks.append(LabelDrift(spec["drift"]))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=strategy,
        max_epochs=int(spec["epochs"]),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        deterministic=True,
        callbacks=callbacks,
        log_every_n_steps=int(spec.get("log_every_n_steps", 50)),
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=datamodule)
    fit_s = time.perf_counter() - start
    strategy = trainer.strategy
    final_stats = strategy.refresh_comm_stats()  # after on_train_end's final average
    distances = None
    if spec.get("probe"):
        gathered: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(gathered, strategy.probe_distances)
        distances = gathered
    if trainer.is_global_zero:
        last = recorder.epochs[-1]
        result = {
            "name": spec["name"],
            "strategy": spec["strategy"]["class"],
            "params": spec["strategy"].get("kwargs", {}),
            "world_size": trainer.world_size,
            "epochs": spec["epochs"],
            "seed": seed,
            "data": spec.get("data", {}),
            "model": spec.get("model", {}),
            "drift": spec.get("drift"),
            "num_parameters": strategy.model_vector.num_parameters,
            "final_val_acc": last["val_acc"],
            "protocol_bytes": last["protocol_bytes"],
            "bytes_sent": last["bytes_sent"],
            "bytes_sent_after_fit": final_stats.bytes_sent,
            "bytes_by_purpose_after_fit": dict(final_stats.bytes_by_purpose),
            "syncs": final_stats.syncs,
            "protocol_metrics": strategy.protocol_metrics(),
            "fit_s": fit_s,
            "curve": recorder.epochs,
        }
        if distances is not None:
            result["probe_distances"] = distances
        write_json(Path(spec["out"]), result)
    # Tear the process groups down explicitly: leaving them to interpreter exit occasionally
    # aborted a rank with "terminate called without an active exception" after the result was written.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
