"""The ``main`` of a worker that runs hand-set cases on real processes (see tests/helpers/launch.py)."""

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_dist.data.datamodules import DigitsDataModule
from lightning_dist.models import MLPClassifier


def run_cases(run_case: Callable[[dict[str, Any], int, int], Any]) -> None:
    """Under torchrun: ``run_case(case, rank, world_size)`` for every case of the spec file (``argv[1]``) on a Gloo
    group, the list of results saved to ``<out>/rank<r>.pt``."""
    spec = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = [run_case(case, rank, world_size) for case in spec["cases"]]
    torch.save(results, Path(spec["out"]) / f"rank{rank}.pt")
    dist.destroy_process_group()


def run_fits(run_case: Callable[[dict[str, Any], Path], dict[str, Any]]) -> None:
    """Under torchrun, for workers whose cases are whole ``Trainer.fit`` calls (Lightning sets up the group): every
    case of the spec file (``argv[1]``) in order, ``run_case(case, out)``'s record or the error it raised (the test
    asserts on it) saved to ``<out>/<case name>/rank<r>.pt``."""
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


class RecordStart(Callback):
    """The model vector every replica starts ``fit`` from (after the strategy made them identical)."""

    def on_train_start(self, trainer, pl_module):
        self.start = trainer.strategy.model_vector.get()


def fit_digits(strategy: Any, case: dict[str, Any], out: Path, ckpt_path: Path | None) -> dict[str, Any]:
    """``Trainer.fit`` of an MLP on the class-sorted digits with ``strategy`` (a recording subclass of a
    local-update strategy: ``records``), every rank's model seeded differently (the strategy must make them
    identical), ``case["trainer"]``'s Trainer arguments, a checkpoint every epoch into ``case["checkpoint_dir"]``
    (under ``out``) if given, resumed from ``ckpt_path``, and a checkpoint written after ``fit`` to
    ``case["save_after_fit"]`` (under ``out``) if given, as a user who goes on training later would; what the run
    recorded."""
    datamodule = DigitsDataModule(partition="class_sorted")
    torch.manual_seed(1000 + int(os.environ["RANK"]))
    model = MLPClassifier(num_features=datamodule.num_features, num_classes=datamodule.num_classes)
    start = RecordStart()
    callbacks: list[Callback] = [start]
    if case.get("checkpoint_dir"):
        callbacks.append(ModelCheckpoint(dirpath=out / case["checkpoint_dir"], save_top_k=-1, every_n_epochs=1,
                                         filename="{epoch}-{step}"))
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy, logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=bool(case.get("checkpoint_dir")),
        callbacks=callbacks, num_sanity_val_steps=0, deterministic=True, **case["trainer"],
    )
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    if case.get("save_after_fit"):
        trainer.save_checkpoint(out / case["save_after_fit"])
    return {
        "start": start.start,
        "vector": strategy.model_vector.get(),
        "num_parameters": strategy.model_vector.num_parameters,
        "records": strategy.records,
        "protocol": strategy.protocol_state_dict(),
        "metrics": strategy.protocol_metrics(),
        "comm": strategy.comm_stats,
        "local_steps": strategy._local_steps,
        "resumed_from": None if ckpt_path is None else torch.load(ckpt_path, weights_only=False)["global_step"],
    }
