"""Worker of ``benchmarks/large_model/run.py``: one row (a strategy on the large model) under torchrun, Gloo on CPU.

Usage (normally through ``run.py``, which sets ``MALLOC_MMAP_THRESHOLD_``: :mod:`benchmarks.large_model.memory`)::

    torchrun --nproc_per_node=2 benchmarks/large_model/worker.py spec.json

Spec keys: ``name``, ``out`` (rank 0's JSON result), ``preset`` (:meth:`TransformerLM.preset`, its ``block_size``
unchanged), ``seq_len`` and ``batch_size`` (``StdlibTextDataModule``'s windows: ``batch_size`` windows of ``seq_len``
bytes a step), ``steps`` (optimizer steps), ``seed``, ``repeats``, and ``strategy``: ``{"class": "ddp"}``
(Lightning's ``DDPStrategy``) or ``{"class": <a lightning_dist strategy>, "kwargs": {...}, "outer": "diloco" |
None}`` (``"diloco"``: :func:`diloco_outer_optimizer`).

Every rank, in its own process, in two phases:

1. **Training** (``fit``, ``steps`` optimizer steps): :class:`~benchmarks.large_model.memory.PeakRSS` is reset right
   after the first optimizer step (a hook on the optimizer: AdamW's state exists by then) and read at the end of the
   last training batch, after its protocol step, before Lightning's end of ``fit``: the window holds every step after
   the first and every synchronization of the run (the periods are chosen so). Also recorded: the resident set at
   the reset (the model, its gradients, AdamW's moments, DDP's buckets), the strategy's own tensors at the end of
   the window (:func:`~benchmarks.large_model.memory.state_nbytes`), every ``after_local_step`` (the protocol after
   an optimizer step) timed after a barrier on the default group, so both ranks start it together, with whether it
   synchronized (the strategy's sync counter moving: a full synchronization, or a fragment merged), and the step
   time (between the optimizer's steps, less the protocol's time).
2. **Paired timing** (after ``fit``, on the strategy's own process group, which stays usable until the next fit):
   ``repeats`` times, one full synchronization, then ``torch.distributed.all_reduce`` of a float32 tensor of the
   model vector's length (the bytes an uncompressed full synchronization sums; allocated once, one untimed
   all-reduce first), each after a barrier. A full synchronization is ``after_local_step`` called for the steps of
   one round, ``period`` consecutive steps (``check_every`` for dynamic averaging, each of whose replicas is first
   moved by a rank-dependent constant, so that its check finds every rank past the threshold): streaming's four
   fragment exchanges included, with no training step to hide behind. Alternating the two puts them under the same
   load from other processes. DDP has no synchronization to time (its gradient all-reduce runs inside backward):
   its row times the all-reduce alone.

Rank 0 gathers every rank's record (an all-gather of objects on the default group) and writes ``out``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy

import lightning_dist
from lightning_dist.algorithms.outer import diloco_outer_optimizer
from lightning_dist.data import StdlibTextDataModule
from lightning_dist.model_vector import ModelVector
from lightning_dist.models import TransformerLM

from benchmarks.large_model.memory import PeakRSS, state_nbytes


TIMEOUT = timedelta(minutes=3)
"""Every collective's bound: a rank that failed makes the other stop within it, not torch's 30 minutes."""


def make_strategy(spec: dict[str, Any]) -> Any:
    """The row's strategy on Gloo: Lightning's DDP, or a lightning_dist strategy with its keyword arguments."""
    if spec["class"] == "ddp":
        return DDPStrategy(process_group_backend="gloo", timeout=TIMEOUT)
    kwargs = dict(spec.get("kwargs", {}))
    if spec.get("outer") == "diloco":
        kwargs["outer_optimizer"] = diloco_outer_optimizer
    return getattr(lightning_dist, spec["class"])(process_group_backend="gloo", timeout=TIMEOUT, **kwargs)


class Measure(Callback):
    """Opens the memory window after the first optimizer step, closes it after the last batch; times steps."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.meter = PeakRSS()
        self.record: dict[str, Any] = {}
        self.step_ends: list[float] = []
        self.protocol: list[dict[str, Any]] = []
        self.phase = "training"

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for optimizer in trainer.optimizers:
            optimizer.register_step_post_hook(self._after_optimizer_step)
        strategy = trainer.strategy
        if hasattr(strategy, "after_local_step"):
            original = strategy.after_local_step

            def timed(step: int) -> None:
                dist.barrier()
                syncs = strategy._syncs
                started = time.perf_counter()
                original(step)
                self.protocol.append({"step": step, "seconds": time.perf_counter() - started,
                                      "synced": strategy._syncs - syncs, "phase": self.phase})

            strategy.after_local_step = timed  # called as self.after_local_step(...) by optimizer_step

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.step_ends.append(time.perf_counter())
        if len(self.step_ends) == 1:
            self.record["rss_window_start"] = self.meter.reset()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step < self.steps:
            return
        self.record["peak_rss"] = self.meter.peak()
        self.record["rss_window_end"] = self.meter.current()
        self.record["state_bytes"] = state_nbytes(trainer.strategy, pl_module, trainer.optimizers)


def round_steps(strategy: Any) -> int:
    """Optimizer steps from one full synchronization to the next: ``period``, or ``check_every`` (dynamic)."""
    return int(getattr(strategy, "period", None) or strategy.check_every)


def timed_all_reduce(tensor: torch.Tensor, group: Any) -> float:
    dist.barrier(group=group)
    started = time.perf_counter()
    dist.all_reduce(tensor, group=group)
    return time.perf_counter() - started


def paired_timing(strategy: Any, model: torch.nn.Module, measure: Measure, numel: int, repeats: int,
                  rank: int) -> dict[str, Any]:
    """Phase 2 of the module docstring: ``repeats`` times a full synchronization, then the all-reduce."""
    group = strategy.comm.group if hasattr(strategy, "comm") else None
    tensor = torch.ones(numel, dtype=torch.float32)
    dist.all_reduce(tensor, group=group)
    allreduce_s, sync_s, synced = [], [], []
    measure.phase = "paired"
    step = int(strategy._local_steps) if hasattr(strategy, "after_local_step") else 0
    for _ in range(repeats):
        if hasattr(strategy, "after_local_step"):
            length = round_steps(strategy)
            if type(strategy).__name__ == "DynamicAveragingStrategy":
                with torch.no_grad():
                    next(model.parameters()).add_(1e-2 * (rank + 1))
            first = len(measure.protocol)
            for step in range(step + 1, step + 1 + length):
                strategy.after_local_step(step)
            entries = measure.protocol[first:]
            sync_s.append(sum(entry["seconds"] for entry in entries))
            synced.append(sum(entry["synced"] for entry in entries))
        allreduce_s.append(timed_all_reduce(tensor, group))
    return {"allreduce_s": allreduce_s, "paired_sync_s": sync_s, "paired_synced": synced}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    record: dict[str, Any] = {"rank": rank, "error": None}
    try:
        L.seed_everything(spec["seed"], verbose=False)
        model = TransformerLM.preset(spec["preset"])
        vector = ModelVector(model)
        record.update(parameters=model.num_parameters, model_bytes=vector.numel * vector.dtype.itemsize,
                      vector_numel=vector.numel)
        datamodule = StdlibTextDataModule(block_size=spec["seq_len"], batch_size=spec["batch_size"],
                                          max_val_sequences=1, seed=spec["seed"])
        steps = int(spec["steps"])
        measure = Measure(steps)
        strategy = make_strategy(spec["strategy"])
        trainer = L.Trainer(
            accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy, max_steps=steps,
            limit_train_batches=steps, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[measure],
            logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        )
        started = time.perf_counter()
        trainer.fit(model, datamodule=datamodule)
        record["fit_s"] = time.perf_counter() - started
        protocol = {entry["step"]: entry for entry in measure.protocol}
        ends = measure.step_ends
        # Between two optimizer steps: the protocol of the first (if any), then the next batch's forward and backward
        # and the optimizer's step; the step time leaves the protocol out.
        record["step_s"] = [ends[i] - ends[i - 1] - protocol.get(i, {"seconds": 0.0})["seconds"]
                            for i in range(1, len(ends))]
        record.update(measure.record, global_step=trainer.global_step)
        record.update(paired_timing(strategy, model, measure, vector.numel, int(spec["repeats"]), rank))
        record["protocol"] = measure.protocol
    except BaseException as exc:  # reported per rank; the driver marks the row failed
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc()[-3000:]
    records: list[Any] = [None] * int(os.environ["WORLD_SIZE"])
    try:
        dist.all_gather_object(records, record)
    except Exception:  # noqa: BLE001 - the group is gone after a failure: write this rank's own record
        records = [record if r == rank else {"rank": r, "error": "no record (the group failed)"}
                   for r in range(len(records))]
    if rank == 0 or record["error"] is not None:
        out = Path(spec["out"]) if rank == 0 else Path(f"{spec['out']}.rank{rank}")
        out.write_text(json.dumps({"name": spec["name"], "ranks": records}, indent=1))
    sys.stdout.flush()
    os._exit(0 if record["error"] is None else 1)


if __name__ == "__main__":
    main()
