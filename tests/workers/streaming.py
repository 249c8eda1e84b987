"""Worker for the streaming-synchronization tests: several fits in one torchrun launch, records per rank.

Usage: torchrun --nproc_per_node=N streaming.py spec.json (see tests/helpers/launch.py). Spec keys: ``cases``,
run in order as separate ``Trainer.fit`` calls in the same processes, each ``{"name", "kwargs", "trainer",
"outer"?, "checkpoint_dir"?, "resume"?, "memory"?, "bucket"?}`` (``kwargs`` of ``PeriodicAveragingStrategy``;
``outer``: DiLoCo's Nesterov SGD, lr 0.7, momentum 0.9; ``resume``: a glob, relative to ``out``, of a checkpoint an
earlier case or launch wrote; ``memory``: record the allocator's peak of bytes allocated by the protocol after every
step; ``bucket``: ``AVERAGE_BUCKET`` for the case (averaging's and DiLoCo's outer step's)); ``out``. Each case writes ``<out>/<name>/rank<r>.pt``:
its error, or the start vector, this rank's vector before and after the protocol at every step (and its peak), the
final vector, the protocol state and the counters.
"""

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_dist.algorithms.averaging as averaging
from lightning_dist import PeriodicAveragingStrategy
from lightning_dist.data.datamodules import DigitsDataModule
from lightning_dist.models import MLPClassifier


def allocated_peak(kineto_results: Any) -> int:
    """The most bytes the allocator held at once for allocations made in a profiled window, from the profiler's
    memory events (each allocation's and each free's size, in time order)."""
    events = sorted((event.start_ns(), event.nbytes()) for event in kineto_results.events() if event.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


class RecordingPeriodic(PeriodicAveragingStrategy):
    """The strategy under test, recording this rank's vector around the protocol after every optimizer step."""

    records: list[dict[str, Any]]
    measure_memory = False

    def after_local_step(self, step: int) -> None:
        before = self.model_vector.get()
        peak = None
        if self.measure_memory:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
                super().after_local_step(step)
            peak = allocated_peak(prof.profiler.kineto_results)
        else:
            super().after_local_step(step)
        self.records.append({"step": step, "before": before, "after": self.model_vector.get(), "peak_bytes": peak})


class RecordStart(Callback):
    def on_train_start(self, trainer, pl_module):
        self.start = trainer.strategy.model_vector.get()


DEFAULT_BUCKET = averaging.AVERAGE_BUCKET


def run_case(case: dict[str, Any], out: Path) -> dict[str, Any]:
    L.seed_everything(0, workers=True)
    kwargs = dict(case["kwargs"])
    if case.get("outer"):
        kwargs["outer_optimizer"] = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
    strategy = RecordingPeriodic(**kwargs)
    strategy.records = []
    strategy.measure_memory = bool(case.get("memory"))
    averaging.AVERAGE_BUCKET = case.get("bucket", DEFAULT_BUCKET)
    datamodule = DigitsDataModule(partition="class_sorted")
    torch.manual_seed(1000 + int(os.environ["RANK"]))  # replicas must be made identical by the strategy
    model = MLPClassifier(num_features=datamodule.num_features, num_classes=datamodule.num_classes)
    start = RecordStart()
    callbacks: list[Callback] = [start]
    if case.get("checkpoint_dir"):
        callbacks.append(ModelCheckpoint(dirpath=out / case["checkpoint_dir"], save_top_k=-1, every_n_epochs=1,
                                         filename="{epoch}-{step}"))
    ckpt_path = None
    if case.get("resume"):
        (ckpt_path,) = sorted(out.parent.glob(case["resume"]))
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=bool(case.get("checkpoint_dir")),
        callbacks=callbacks, num_sanity_val_steps=0, deterministic=True, **case["trainer"],
    )
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    return {
        "start": start.start,
        "vector": strategy.model_vector.get(),
        "num_parameters": strategy.model_vector.num_parameters,
        "records": strategy.records,
        "protocol": strategy.protocol_state_dict(),
        "metrics": strategy.protocol_metrics(),
        "comm": strategy.comm_stats,
        "local_steps": strategy._local_steps,
        "resumed_from": None if ckpt_path is None else str(ckpt_path),
    }


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    rank = int(os.environ["RANK"])
    for case in spec["cases"]:
        case_out = out / case["name"]
        case_out.mkdir(parents=True, exist_ok=True)
        try:
            record = {"error": None, **run_case(case, out)}
        except Exception as exc:  # the test asserts on it
            record = {"error": f"{type(exc).__name__}: {exc}"}
        torch.save(record, case_out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
