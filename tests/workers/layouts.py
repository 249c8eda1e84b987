"""Worker of the layout matrix (tests/strategies/test_layouts.py): every case one Lightning fit, in turn.

Usage: torchrun ... layouts.py spec.json (tests/helpers/launch.py's ``run_nodes``). Spec: ``cases``, each a dict
with ``name``, ``strategy`` (a class of ``lightning_dist`` and its kwargs, ``outer`` for DiLoCo's outer
optimizer), ``checkpoint_dir`` (write a checkpoint after step ``CHECKPOINT_STEP``) or ``ckpt_path`` (resume
from one), optionally ``max_steps`` and ``model`` (TinyVarianceMLP's arguments). The model is
:class:`helpers.user_models.TinyVarianceMLP` (BatchNorm on inputs of tiny variance, a frozen parameter, Adam).
Each case writes ``<out>/<name>/rank<r>.pt``: its error, or after every optimizer step
this rank's model before and after the protocol ran and the strategy's synchronization counters (the first
entry of ``counters`` as the fit started).
"""

import json
import math
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for helpers.user_models

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_dist
from helpers.user_models import TinyVarianceMLP
from lightning_dist.algorithms.outer import diloco_outer_optimizer
from lightning_dist.data.datamodules import DigitsDataModule

MAX_STEPS = 10
BATCHES_PER_EPOCH = 5
CHECKPOINT_STEP = 6  # between two synchronizations of a period of 4


class RecordSteps(Callback):
    """After every optimizer step: the model as the protocol found it and as it left it, and its counters."""

    def __init__(self) -> None:
        self.before, self.after, self.counters = [], [], []

    @staticmethod
    def counters_of(strategy) -> dict:
        return {"syncs": strategy._syncs, "full": getattr(strategy, "_full_syncs", None),
                "partial": getattr(strategy, "_partial_syncs", None)}

    def on_train_start(self, trainer, pl_module):
        strategy = trainer.strategy
        self.start = strategy.model_vector.get().clone()
        self.initial = self.counters_of(strategy)  # after a resume: the checkpoint's
        protocol = strategy.after_local_step

        def recorded(step: int) -> None:
            self.before.append(strategy.model_vector.get().clone())
            protocol(step)
            self.counters.append(self.counters_of(strategy))

        strategy.after_local_step = recorded

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after.append(trainer.strategy.model_vector.get().clone())


def fit(case: dict, out: Path) -> None:
    L.seed_everything(0, workers=True)
    # A hang surfaces as a named error within a minute (the first case's bound is also WORLD's, Lightning's group).
    kwargs = {"timeout": timedelta(seconds=60), **case["strategy"].get("kwargs", {})}
    if case["strategy"].get("outer"):
        kwargs["outer_optimizer"] = diloco_outer_optimizer
    if kwargs.get("compression") == "sparse":  # SparseLoCo's codec: 10% of each 64-element chunk at 2 bits
        kwargs["compression"] = lightning_dist.SparseCodec(density=0.1, bits=2, chunk=64, decay=0.9)
    strategy = getattr(lightning_dist, case["strategy"]["class"])(**kwargs)
    torch.manual_seed(1000 + int(os.environ["RANK"]))  # replicas must be made identical by the strategy
    recorder = RecordSteps()
    callbacks = [recorder]
    if case.get("checkpoint_dir"):
        callbacks.append(ModelCheckpoint(dirpath=case["checkpoint_dir"], every_n_train_steps=CHECKPOINT_STEP,
                                         save_top_k=-1, filename="{step}"))
    result = {"error": None}
    started = time.perf_counter()
    try:  # a refusal by name comes from the Trainer's construction
        trainer = L.Trainer(
            accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
            num_nodes=int(os.environ["GROUP_WORLD_SIZE"]), strategy=strategy, logger=False, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=bool(case.get("checkpoint_dir")), callbacks=callbacks,
            num_sanity_val_steps=0, deterministic=True, max_steps=case.get("max_steps", MAX_STEPS),
            limit_train_batches=BATCHES_PER_EPOCH, limit_val_batches=2,
        )
        trainer.fit(TinyVarianceMLP(**case.get("model", {})), datamodule=DigitsDataModule(partition="class_sorted"),
                    ckpt_path=case.get("ckpt_path"))
    except Exception as exc:  # reported to the test, which asserts on it
        result["error"] = f"{type(exc).__name__}: {exc}"
    if result["error"] is None:
        result.update(
            start=recorder.start, before=torch.stack(recorder.before), after=torch.stack(recorder.after),
            counters=[recorder.initial] + recorder.counters, final=trainer.strategy.model_vector.get().clone(),
            val_loss=float(trainer.callback_metrics.get("val_loss", math.nan)),
            num_parameters=trainer.strategy.model_vector.num_parameters,
            comm=trainer.strategy.comm_stats, global_step=trainer.global_step,
        )
    result["seconds"] = time.perf_counter() - started
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"rank{int(os.environ['RANK'])}.pt")


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    for case in spec["cases"]:
        fit(case, Path(spec["out"]) / case["name"])
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
