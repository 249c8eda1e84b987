"""Worker for multi-process strategy tests: one Lightning fit under torchrun, results per rank.

Usage: torchrun --nproc_per_node=N fit.py spec.json (see tests/helpers/launch.py). With ``runs`` (a list of
spec overrides, each with a ``name``), the fits run one after another in the same processes (starting ranks
costs more than these fits) and each writes ``<out>/<name>/rank<r>.pt``.
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
from lightning.pytorch.plugins.precision import MixedPrecision

import lightning_dist
import lightning_dist.algorithms.averaging as averaging
from lightning_dist.data.datamodules import DigitsDataModule
from lightning_dist.model_vector import ModelVector
from lightning_dist.models import MLPClassifier

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for helpers.user_models
from helpers.user_models import DigitsCNN, DigitsImages, in_other_units  # noqa: E402


DEFAULT_BUCKET = averaging.AVERAGE_BUCKET


class InjectNaN(Callback):
    """Turns one rank's parameters non-finite after a given step."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            with torch.no_grad():
                next(pl_module.parameters()).fill_(float("nan"))


class Stall(Callback):
    """One rank sleeps before its optimizer step ``step`` (0-based), as a rank stuck elsewhere would, while the others
    go on to the strategy's collective after that step (Lightning's own collective before each batch is passed)."""

    def __init__(self, rank: int, step: int, seconds: float) -> None:
        self.rank, self.step, self.seconds = rank, step, seconds

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            time.sleep(self.seconds)


def vector_of(trainer, pl_module) -> torch.Tensor:
    """The model as a vector: the strategy's view of it, or for Lightning's own strategies (DDP) the module's."""
    vector = getattr(trainer.strategy, "model_vector", None) or ModelVector(pl_module)
    return vector.get().clone()


class RecordStepZeroVector(Callback):
    def on_train_start(self, trainer, pl_module):
        self.start = vector_of(trainer, pl_module)


class RecordVectors(Callback):
    """This rank's model vector after every optimizer step (``record_vectors``: small models only)."""

    def __init__(self) -> None:
        self.vectors: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.vectors.append(vector_of(trainer, pl_module))


class RecordLossScale(Callback):
    """This rank's loss scale after the restore and at every checkpoint it saves (``precision="16-mixed"``)."""

    def __init__(self) -> None:
        self.restored, self.saved = None, {}

    def on_train_start(self, trainer, pl_module):
        self.restored = trainer.precision_plugin.scaler.get_scale()

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.saved[trainer.global_step] = trainer.precision_plugin.scaler.get_scale()


def loss_scaled(base: float) -> MixedPrecision:
    """fp16 autocast with a loss scaler on the CPU (Lightning's ``"16-mixed"`` turns into bf16 there), whose
    initial scale differs per rank, ``base * 2**rank``: each rank's scale follows its own gradients."""
    rank = int(os.environ.get("RANK", "0"))
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=base * 2**rank))


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    if "runs" not in spec:
        fit(spec)
    for overrides in spec.get("runs", []):
        out = Path(spec["out"]) / overrides["name"]
        out.mkdir(exist_ok=True)
        fit({**spec, **overrides, "out": str(out)})


def meet(key: str) -> None:
    """Wait until every rank of the launch is here, through torchrun's store. A fit whose process groups time out
    after seconds must not start them seconds apart: the ranks' imports and set-up take different times, and Gloo
    refuses a group whose ranks do not connect within the timeout."""
    store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                       timeout=timedelta(seconds=120))
    store.add(key, 1)
    while store.add(key, 0) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.01)


def fit(spec: dict) -> None:
    out = Path(spec["out"])
    L.seed_everything(spec.get("seed", 0) + 0, workers=True)
    strategy_spec = spec["strategy"]
    if isinstance(strategy_spec, str):
        strategy = strategy_spec
    else:
        kwargs = dict(strategy_spec.get("kwargs", {}))
        if "timeout_seconds" in strategy_spec:
            kwargs["timeout"] = timedelta(seconds=strategy_spec["timeout_seconds"])
        strategy = getattr(lightning_dist, strategy_spec["class"])(**kwargs)
    averaging.AVERAGE_BUCKET = spec.get("bucket", DEFAULT_BUCKET)  # buckets of a blocking average and outer step
    torch.manual_seed(1000 + int(os.environ.get("RANK", "0")))  # replicas must be made identical by the strategy
    if spec.get("user_model"):  # a module that is not the package's: BatchNorm, Dropout, Adam, StepLR
        datamodule, model = DigitsImages(), DigitsCNN()
    else:
        datamodule = DigitsDataModule(**spec.get("data", {}))
        model = MLPClassifier(num_features=datamodule.num_features, num_classes=datamodule.num_classes,
                              **spec.get("model", {}))
        if "units" in spec:  # the same training with every parameter stored `units` times larger
            model = in_other_units(model, spec["units"])
    callbacks = [RecordStepZeroVector()]
    recorder = RecordVectors() if spec.get("record_vectors") else None
    if recorder is not None:
        callbacks.append(recorder)
    if "nan" in spec:
        callbacks.append(InjectNaN(**spec["nan"]))
    if "stall" in spec:
        callbacks.append(Stall(**spec["stall"]))
    plugins = []
    if "loss_scale_base" in spec:
        plugins.append(loss_scaled(spec["loss_scale_base"]))
        callbacks.append(RecordLossScale())
    if spec.get("checkpoint_dir"):
        callbacks.append(ModelCheckpoint(dirpath=spec["checkpoint_dir"], save_top_k=-1, every_n_epochs=1, save_last=False,
                                         filename="{epoch}-{step}"))
    trainer = L.Trainer(
        accelerator="cpu", devices=spec.get("devices", int(os.environ["LOCAL_WORLD_SIZE"])),
        strategy=strategy, logger=spec.get("logger", False), enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=bool(spec.get("checkpoint_dir")), callbacks=callbacks, plugins=plugins,
        num_sanity_val_steps=0, deterministic=True, **spec.get("trainer", {}),
    )
    if isinstance(strategy_spec, dict) and "timeout_seconds" in strategy_spec:
        meet(f"lightning_dist_test/start/{spec.get('name', '')}")
    error = None
    started = time.perf_counter()
    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=spec.get("ckpt_path"))
    except Exception as exc:  # reported to the test, which asserts on it
        error = f"{type(exc).__name__}: {exc}"
    result = {"error": error, "rank": trainer.global_rank, "fit_seconds": time.perf_counter() - started}
    if error is None:
        result.update(
            vector=vector_of(trainer, model),
            start_vector=callbacks[0].start,
            global_step=trainer.global_step,
            num_training_batches=trainer.num_training_batches,
            callback_metrics={k: float(v) for k, v in trainer.callback_metrics.items()},
            step_vectors=None if recorder is None else torch.stack(recorder.vectors),
        )
        strategy = trainer.strategy
        if isinstance(strategy, lightning_dist.LocalUpdateStrategy):
            result.update(
                comm=strategy.comm_stats,
                local_comm=strategy.comm.stats,
                protocol=strategy.protocol_state_dict(),
                metrics=strategy.protocol_metrics(),
                syncs=strategy._syncs,
                local_steps=strategy._local_steps,
            )
        if plugins:
            scale = next(callback for callback in callbacks if isinstance(callback, RecordLossScale))
            result.update(restored_loss_scale=scale.restored, saved_loss_scales=scale.saved)
        if spec.get("validate_after"):
            result["validate"] = trainer.validate(model, datamodule=datamodule, verbose=False)
    torch.save(result, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
