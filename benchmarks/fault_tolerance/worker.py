"""Worker of ``benchmarks/fault_tolerance/overhead.py``: DiLoCo on the language model, with or without
``fault_tolerance``, every synchronization window timed.

    torchrun --nproc_per_node=2 worker.py spec.json          # without the option: one job of 2 ranks
    torchrun --nproc_per_node=1 worker.py spec.json GROUP    # with it: one job per replica group

The model, data and optimizers are ``configs/lm/diloco.yaml``'s (``TransformerLM``, 1.3M parameters, AdamW, outer
SGD with Nesterov momentum), for ``spec["max_steps"]`` steps of ``spec["period"]``. Every window is timed where it
runs: ``synchronize_in_place`` without the option (inside the optimizer step), ``end_window`` with it (the quorum,
the exchange and the commit). Rank 0 of each job writes ``{"windows_s": [...], "steps_s": [...], "fit_s": ...}``
to ``<out>/<name>.<group>.json``.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lightning_dist import PeriodicAveragingStrategy, TorchFT
from lightning_dist.data import StdlibTextDataModule
from lightning_dist.models import TransformerLM

OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 160, "dropout": 0.0, "learning_rate": 0.002, "weight_decay": 0.1,
         "warmup_steps": 20}


class StepClock(Callback):
    """Every training batch's duration, from its start to its end (a window ending at a batch's start included)."""

    def __init__(self) -> None:
        self.steps_s: list[float] = []
        self._began = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._began = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.steps_s.append(time.perf_counter() - self._began)


def timed(method: Any, durations: list[float]) -> Any:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            durations.append(time.perf_counter() - began)
    return wrapper


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    group = int(sys.argv[2]) if len(sys.argv) > 2 else None
    torch.set_num_threads(1)
    L.seed_everything(spec["seed"], workers=True, verbose=False)
    datamodule = StdlibTextDataModule(block_size=128, batch_size=32, partition="contiguous", seed=spec["seed"])
    model = TransformerLM(vocab_size=datamodule.vocab_size, block_size=128, **MODEL)
    outer = functools.partial(torch.optim.SGD, **OUTER)
    windows_s: list[float] = []
    if group is None:
        strategy = PeriodicAveragingStrategy(period=spec["period"], outer_optimizer=outer)
        strategy.synchronize_in_place = timed(strategy.synchronize_in_place, windows_s)
        devices = spec["groups"]
    else:
        option = TorchFT(num_replica_groups=spec["groups"], replica_group=group, lighthouse=spec["lighthouse"],
                         timeout=timedelta(seconds=60))
        strategy = PeriodicAveragingStrategy(period=spec["period"], outer_optimizer=outer, fault_tolerance=option)
        strategy.end_window = timed(strategy.end_window, windows_s)
        devices = 1
    clock = StepClock()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=spec["max_steps"],
                        callbacks=[clock], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    began = time.perf_counter()
    trainer.fit(model, datamodule=datamodule)
    if trainer.global_rank == 0:
        result = {"windows_s": windows_s, "steps_s": clock.steps_s, "fit_s": time.perf_counter() - began,
                  "bytes": strategy.comm_stats.bytes_sent, "metrics": strategy.protocol_metrics()}
        Path(spec["out"], f"{spec['name']}.{'job' if group is None else group}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
