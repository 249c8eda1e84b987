"""Worker of the Lightning compatibility matrix: one column (a strategy or callback), every cell in turn.

Usage: torchrun --nproc_per_node=N matrix.py spec.json (see tests/helpers/launch.py). Spec keys:
``column`` (a key of ``COLUMNS``), ``cells`` (keys of ``CELLS``, run in this order as separate
``Trainer.fit`` calls in the same processes), ``out``. Each cell writes ``<out>/<cell>/rank<r>.pt``
as soon as it ends: its error (``"Type: message"``) or what the test checks (steps, syncs, final
weights, logged metrics, what the cell ran after fit). A cell that runs longer than
``CELL_SECONDS`` writes a ``TIMEOUT`` record and ends the process, so a hang names its cell.
"""

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for helpers.user_models

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ProgressBar
from lightning.pytorch.loggers import Logger

import lightning_dist
from lightning_dist.algorithms.outer import diloco_outer_optimizer
from helpers.user_models import DigitsCNN, DigitsImages
from lightning_dist.strategies.local_update import LocalUpdateStrategy

CELL_SECONDS = 60
STRAGGLER_SECONDS = 0.1
LIMIT = 6  # training batches per epoch in most cells
UNEQUAL_SHARDS = (320, 192, 256)  # examples per rank: 10, 6 and 8 batches of 32

# column -> (strategy, callback): strategies with periods of 2 steps so a handful of steps syncs.
# The averaging strategies take a cell's STRATEGY_KWARGS.
COLUMNS: dict[str, tuple[Any, Any]] = {
    "dynamic_avg": (lambda **kw: lightning_dist.DynamicAveragingStrategy(divergence_threshold=0.05, check_every=2, **kw),
                    None),
    "periodic_avg": (lambda **kw: lightning_dist.PeriodicAveragingStrategy(period=2, **kw), None),
    "fedavg": (lambda **kw: lightning_dist.PeriodicAveragingStrategy(period=2, client_fraction=0.5, **kw), None),
    "downpour_sgd": (lambda: lightning_dist.DownpourSGDStrategy(push_every=2), None),
    "segmented_gossip": (lambda: lightning_dist.SegmentedGossipStrategy(segments=4, replicas=1, period=2), None),
    "datagossip": (lambda: lightning_dist.PeriodicAveragingStrategy(period=2),
                   lambda: lightning_dist.DataGossip(records_per_exchange=4, weave_every=2)),
    "cdgrab": (lambda: "ddp", lambda: lightning_dist.CDGraB()),
    # One learner per node (2 nodes x 2 ranks): DDP inside each node, the protocol or callback on top.
    "periodic_node": (lambda **kw: lightning_dist.PeriodicAveragingStrategy(period=2, hierarchy="node", **kw), None),
    "datagossip_node": (lambda: lightning_dist.PeriodicAveragingStrategy(period=2, hierarchy="node"),
                        lambda: lightning_dist.DataGossip(records_per_exchange=4, weave_every=2)),
    "cdgrab_node": (lambda: lightning_dist.PeriodicAveragingStrategy(period=2, hierarchy="node"),
                    lambda: lightning_dist.CDGraB()),
}

# cell -> strategy kwargs, for the columns whose strategy takes them
STRATEGY_KWARGS: dict[str, dict[str, Any]] = {
    "outer_optimizer": {"outer_optimizer": diloco_outer_optimizer},  # DiLoCo's outer step on a BatchNorm CNN with Adam
}

# cell -> (Trainer kwargs, DigitsCNN kwargs, DigitsImages kwargs)
CELLS: dict[str, tuple[dict, dict, dict]] = {
    "accumulate_grad_batches": ({"accumulate_grad_batches": 2, "limit_train_batches": 8}, {}, {}),
    "gradient_clip_val": ({"gradient_clip_val": 1.0, "limit_train_batches": LIMIT}, {}, {}),
    "bf16_mixed": ({"precision": "bf16-mixed", "limit_train_batches": LIMIT}, {}, {}),
    "manual_optimization": ({"limit_train_batches": LIMIT}, {"optimization": "manual"}, {}),
    "two_optimizers": ({"limit_train_batches": LIMIT}, {"optimization": "two_optimizers"}, {}),
    "checkpoint_best": ({"limit_train_batches": LIMIT, "max_epochs": 2}, {}, {}),
    "evaluate_after_fit": ({"limit_train_batches": LIMIT}, {}, {}),
    "val_check_interval": ({"limit_train_batches": 8, "val_check_interval": 0.5}, {}, {}),
    "val_check_interval_time": ({"limit_train_batches": LIMIT, "val_check_interval": {"seconds": 1}}, {}, {}),
    "max_steps": ({"max_steps": 5, "max_epochs": -1}, {}, {}),
    "outer_optimizer": ({"limit_train_batches": 8, "max_epochs": 2}, {}, {}),
    # A user's own progress bar and a logger, validation twice per epoch; "_off": the same without a bar.
    "progress_bar": ({"limit_train_batches": 8, "val_check_interval": 0.5, "log_every_n_steps": 2,
                      "enable_progress_bar": True}, {}, {}),
    "progress_bar_off": ({"limit_train_batches": 8, "val_check_interval": 0.5, "log_every_n_steps": 2}, {}, {}),
    "limit_train_batches": ({"limit_train_batches": 0.25, "max_epochs": 2}, {}, {}),
    "iterable_dataset": ({}, {}, {"train": "iterable", "batch_size": 64}),
    "iterable_dataset_unsized": ({}, {}, {"train": "iterable_unsized", "batch_size": 64}),
    "unequal_batches": ({"use_distributed_sampler": False}, {}, {"train": "unequal"}),
    "batchnorm": ({"limit_train_batches": LIMIT}, {"norm": "batch"}, {}),
}


class Recorder(Callback):
    """Training batches of every epoch, and the model every validation during fit evaluated (read before
    the strategy puts the rank's own replica back) with its logged score."""

    def __init__(self) -> None:
        self.validations: list[dict[str, Any]] = []
        self.batches_per_epoch: list[float] = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.batches_per_epoch.append(float(trainer.num_training_batches))

    def on_validation_end(self, trainer, pl_module):
        if trainer.state.fn == "fit":
            self.validations.append({"state": _state(pl_module), "val_loss": float(trainer.callback_metrics["val_loss"]),
                                     "global_step": trainer.global_step})


class BarRecorder(ProgressBar):
    """A user's own progress bar: what it shows after every training batch, next to the strategy's counters then."""

    def __init__(self) -> None:
        super().__init__()
        self.shown: list[dict[str, Any]] = []

    def disable(self) -> None:
        pass

    def enable(self) -> None:
        pass

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        stats = trainer.strategy.comm_stats
        self.shown.append({"bar": dict(self.get_metrics(trainer, pl_module)), "protocol_bytes": stats.protocol_bytes,
                           "syncs": stats.syncs})


class UserBarValue(Callback):
    """A user who puts a value of their own in the progress bar, from the hook the strategies log in."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        pl_module.log("user_value", float(batch_idx), prog_bar=True)


class RecordingLogger(Logger):
    """Every call the loggers get: (step, metrics)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.calls.append((step, {name: float(value) for name, value in metrics.items()}))


class Straggler(Callback):
    """Rank 1 sleeps before every batch, so the other ranks reach each validation first."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 1:
            time.sleep(STRAGGLER_SECONDS)


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


def _metrics(results: list[dict]) -> list[dict[str, float]]:
    return [{name: float(value) for name, value in result.items()} for result in results]


def run_cell(column: str, cell: str, out: Path, rank: int) -> dict[str, Any]:
    make_strategy, make_callback = COLUMNS[column]
    trainer_kwargs, module_kwargs, data_kwargs = (dict(part) for part in CELLS[cell])
    strategy_kwargs = STRATEGY_KWARGS.get(cell, {})
    if column.startswith("datagossip"):
        # Records are exchanged after an epoch and woven into the next: two epochs, so they are.
        # manual_optimization keeps the module's default (training_step returns nothing), which DataGossip refuses.
        module_kwargs["per_example_outputs"] = cell != "manual_optimization"
        if "max_steps" not in trainer_kwargs:
            trainer_kwargs["max_epochs"] = 2
    if column.startswith("cdgrab"):
        # CD-GraB reorders whole epochs and refuses partial ones: short epochs instead of a batch limit.
        module_kwargs.setdefault("norm", "group")
        data_kwargs.setdefault("train", "cdgrab")
        if cell != "limit_train_batches":
            trainer_kwargs.pop("limit_train_batches", None)
    if data_kwargs.get("train") == "unequal":
        data_kwargs["shards"] = UNEQUAL_SHARDS
    L.seed_everything(0)
    torch.manual_seed(100 + rank)  # replicas start different: the strategy must make them equal
    model = DigitsCNN(**module_kwargs)
    datamodule = DigitsImages(**data_kwargs)
    recorder = Recorder()
    callbacks: list[Callback] = [recorder]
    if make_callback is not None:
        callbacks.insert(0, make_callback())
    checkpoint = None
    if cell == "checkpoint_best":
        if column == "downpour_sgd":
            # Its ranks are not in step: the best checkpoint must still hold the model that scored best.
            callbacks.append(Straggler())
        checkpoint = ModelCheckpoint(dirpath=out / "checkpoints", monitor="val_loss", mode="min", save_top_k=1)
        callbacks.append(checkpoint)
    logger: RecordingLogger | bool = False
    if cell.startswith("progress_bar"):
        logger = RecordingLogger()
        callbacks.append(UserBarValue())
        if trainer_kwargs.get("enable_progress_bar"):
            callbacks.append(BarRecorder())
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy=make_strategy(**strategy_kwargs),
        logger=logger, enable_model_summary=False, enable_checkpointing=checkpoint is not None, callbacks=callbacks,
        num_sanity_val_steps=0, **{"max_epochs": 1, "enable_progress_bar": False, **trainer_kwargs},
    )
    trainer.fit(model, datamodule=datamodule)
    strategy = trainer.strategy
    record: dict[str, Any] = {
        "global_step": trainer.global_step,
        "num_training_batches": float(trainer.num_training_batches),
        "state": _state(model),
        "parameter_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "callback_metrics": {name: float(value) for name, value in trainer.callback_metrics.items()},
        "validations": recorder.validations,
        "batches_per_epoch": recorder.batches_per_epoch,
        "clipped_norms": model.clipped_norms,
        "progress_bar_metrics": dict(trainer.progress_bar_metrics),
    }
    if isinstance(logger, RecordingLogger):
        record["logged"] = logger.calls
    if trainer.progress_bar_callback is not None:
        record["shown"] = trainer.progress_bar_callback.shown
    if isinstance(strategy, LocalUpdateStrategy):
        record.update(local_steps=strategy._local_steps, syncs=strategy.comm_stats.syncs,
                      comm=strategy.comm_stats, protocol=strategy.protocol_metrics())
    if make_callback is not None:
        record["callback"] = callbacks[0].metrics()
    if cell == "checkpoint_best":
        record["best_model_path"] = checkpoint.best_model_path
        record["best_model_score"] = float(checkpoint.best_model_score)
        record["validate_best"] = _metrics(trainer.validate(model, datamodule=datamodule, ckpt_path="best", verbose=False))
    if cell == "evaluate_after_fit":
        record["validate"] = _metrics(trainer.validate(model, datamodule=datamodule, verbose=False))
        record["test"] = _metrics(trainer.test(model, datamodule=datamodule, verbose=False))
        predictions = trainer.predict(model, datamodule=datamodule)
        record["predictions"] = {
            "index": torch.cat([batch["index"] for batch in predictions]),
            "prediction": torch.cat([batch["prediction"] for batch in predictions]),
        }
        record["state_after_evaluation"] = _state(model)
    return record


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    rank = int(os.environ["RANK"])
    for cell in spec["cells"]:
        cell_out = out / cell
        cell_out.mkdir(parents=True, exist_ok=True)
        path = cell_out / f"rank{rank}.pt"

        def hung(cell=cell, path=path):
            torch.save({"error": f"TIMEOUT: cell {cell} did not end within {CELL_SECONDS} s"}, path)
            os._exit(3)

        watchdog = threading.Timer(CELL_SECONDS, hung)
        watchdog.daemon = True
        watchdog.start()
        try:
            record = {"error": None, **run_cell(spec["column"], cell, cell_out, rank)}
        except Exception as exc:  # the test asserts on it
            record = {"error": f"{type(exc).__name__}: {exc}"}
        watchdog.cancel()
        torch.save(record, path)


if __name__ == "__main__":
    main()
