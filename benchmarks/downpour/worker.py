"""Worker of the DownpourSGD benchmark: one fit under torchrun; rank 0 writes one JSON file.

Spec: ``strategy`` (DownpourSGDStrategy kwargs), ``data`` (DigitsDataModule kwargs), ``model``
(MLPClassifier kwargs), ``epochs``, ``seed``, ``slow`` (``{"rank": r, "seconds": s}``: that rank
sleeps before every batch, a straggler), ``gossip`` (DataGossip kwargs; the callback is added
when present), ``snapshot_every_s``, ``out``.

Every rank times each training batch (see ``StepClock``) and tells local batches from the
foreign batches DataGossip inserts, so the callback's cost per local step can be told apart from
the cost of training on more batches; the time spent inside each of DataGossip's training hooks
(loss bookkeeping per batch, selection and encoding per epoch, adopting received records, and the
end-of-training agreement in ``on_train_end``, which mostly waits for the slowest rank) is summed
per rank as well.

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

from benchmarks.common.report import write_json
from lightning_dist import DataGossip, DownpourSGDStrategy
from lightning_dist.data.datamodules import DigitsDataModule
from lightning_dist.models import MLPClassifier


class Straggler(Callback):
    def __init__(self, rank: int, seconds: float) -> None:
        self.rank, self.seconds = rank, seconds

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank:
            time.sleep(self.seconds)


class StepClock(Callback):
    """End time of every batch, and how long each local and each foreign batch took.

    A batch's duration runs from the end of the previous batch (or the start of training) to its
    own end, so the durations add up to the whole training time: fetching and collating the
    batch, Lightning's loop, every callback hook, and per-epoch work (which falls on the first
    batch of the next epoch) all count. Placed after DataGossip in the callback list, so its
    ``on_train_batch_end`` sees the callback's ``foreign_batches`` counter already updated for
    the batch that just ended.
    """

    def __init__(self, gossip: DataGossip | None) -> None:
        self.gossip = gossip
        self.times: list[float] = []
        self.local_durations: list[float] = []
        self.foreign_durations: list[float] = []
        self._last_end = 0.0
        self._foreign_before = 0

    def on_train_start(self, trainer, pl_module):
        self._last_end = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._foreign_before = self.gossip.foreign_batches if self.gossip is not None else 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        now = time.perf_counter()
        self.times.append(now)
        foreign = self.gossip is not None and self.gossip.foreign_batches > self._foreign_before
        (self.foreign_durations if foreign else self.local_durations).append(now - self._last_end)
        self._last_end = now


GOSSIP_HOOKS = ("on_train_epoch_start", "on_train_batch_start", "on_train_batch_end", "on_train_epoch_end",
                "on_train_end")


def time_hooks(gossip: DataGossip) -> dict[str, float]:
    """Wrap DataGossip's training hooks on this instance; the returned dict sums each hook's seconds."""
    spent = dict.fromkeys(GOSSIP_HOOKS, 0.0)
    for name in GOSSIP_HOOKS:
        original = getattr(gossip, name)

        def timed(*args, _original=original, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                spent[_name] += time.perf_counter() - start

        setattr(gossip, name, timed)  # Lightning looks hooks up on the instance
    return spent


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
    gossip = DataGossip(seed=seed, **spec["gossip"]) if spec.get("gossip") else None
    hook_seconds = time_hooks(gossip) if gossip is not None else {}
    clock = StepClock(gossip)
    callbacks: list[Callback] = [clock] if gossip is None else [gossip, clock]
    if spec.get("slow"):
        callbacks.insert(0, Straggler(spec["slow"]["rank"], spec["slow"]["seconds"]))
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
    durations: list[Any] = [None] * trainer.world_size
    gossip_metrics = gossip.metrics() if gossip is not None else None
    dist.all_gather_object(durations, {"local": clock.local_durations, "foreign": clock.foreign_durations,
                                       "gossip": gossip_metrics, "hook_s": hook_seconds})
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
            "epochs": spec["epochs"], "seed": seed, "data": spec.get("data"), "gossip": spec.get("gossip"),
            "fit_s": fit_s, "step_times": gathered, "batch_durations": durations, "curve": curve,
            "final_val_acc": curve[-1]["val_acc"], "server": strategy.protocol_metrics(),
            "protocol_bytes": strategy.comm_stats.protocol_bytes,
        }
        write_json(Path(spec["out"]), result)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
