"""Worker of the DownpourSGD benchmark: one fit under torchrun; rank 0 writes one JSON file.

Spec: ``strategy`` (DownpourSGDStrategy kwargs), ``data`` (DigitsDataModule kwargs), ``model``
(MLPClassifier kwargs), ``epochs``, ``seed``, ``slow`` (``{"rank": r, "seconds": s}``: that rank
sleeps before every batch, a straggler), ``snapshot_every_s``, ``out``.

No validation and no checkpoints during fit: those are epoch-end meeting points of all ranks and
would hide the difference between synchronous and asynchronous training. Instead a thread on
rank 0 copies the server's global model every ``snapshot_every_s`` seconds (with its version and
the time), and rank 0 evaluates the copies after fit.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_dist import DownpourSGDStrategy
from lightning_dist.data.datamodules import DigitsDataModule
from lightning_dist.models import MLPClassifier


class Straggler(Callback):
    def __init__(self, rank: int, seconds: float) -> None:
        self.rank, self.seconds = rank, seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank:
            time.sleep(self.seconds)


class StepClock(Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter())


class ServerSnapshots:
    """Rank 0: copy the global model every ``period`` seconds while fit runs."""

    def __init__(self, strategy: DownpourSGDStrategy, period: float, start: float) -> None:
        self.strategy, self.period, self.start = strategy, period, start
        self.snapshots: list[tuple[float, int, torch.Tensor]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            server = self.strategy._server
            if server is not None:
                vector, version = server.snapshot()
                self.snapshots.append((time.perf_counter() - self.start, version, vector))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    seed = int(spec.get("seed", 0))
    L.seed_everything(seed, workers=True, verbose=False)
    strategy = DownpourSGDStrategy(seed=seed, **spec["strategy"])
    datamodule = DigitsDataModule(seed=seed, **spec.get("data", {}))
    model = MLPClassifier(num_features=datamodule.num_features, num_classes=datamodule.num_classes, **spec.get("model", {}))
    clock = StepClock()
    callbacks: list[Callback] = [clock]
    if spec.get("slow"):
        callbacks.append(Straggler(spec["slow"]["rank"], spec["slow"]["seconds"]))
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy,
        max_epochs=int(spec["epochs"]), limit_val_batches=0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0, callbacks=callbacks,
    )
    start = time.perf_counter()
    snapshots = ServerSnapshots(strategy, float(spec.get("snapshot_every_s", 0.5)), start) if int(os.environ["RANK"]) == 0 else None
    trainer.fit(model, datamodule=datamodule)
    fit_s = time.perf_counter() - start
    steps = [t - start for t in clock.times]
    gathered: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(gathered, steps)
    if snapshots is not None:
        snapshots.stop()
        final = strategy.model_vector.get()
        snapshots.snapshots.append((fit_s, int(strategy.protocol_metrics()["downpour/version"]), final))
        x, y = datamodule.val_set.features, datamodule.val_set.labels
        curve = []
        with torch.no_grad():
            for seconds, version, vector in snapshots.snapshots:
                strategy.model_vector.set(vector)
                accuracy = float((model(x).argmax(dim=1) == y).float().mean())
                curve.append({"seconds": seconds, "version": version, "val_acc": accuracy})
        result = {
            "name": spec["name"], "params": spec["strategy"], "slow": spec.get("slow"), "world_size": trainer.world_size,
            "epochs": spec["epochs"], "fit_s": fit_s, "step_times": gathered, "curve": curve,
            "final_val_acc": curve[-1]["val_acc"], "server": strategy.protocol_metrics(),
            "protocol_bytes": strategy.comm_stats.protocol_bytes,
        }
        Path(spec["out"]).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
