"""Worker of the CD-GraB benchmark: Lightning DDP fits under torchrun, one JSON file from rank 0.

Usage (normally through ``benchmarks/cdgrab/run.py``)::

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node=4 --master_addr=127.0.0.1 \
        --master_port=PORT benchmarks/cdgrab/worker.py spec.json

``spec.json`` holds ``name``, ``out`` (the JSON file to write) and ``runs``: fits to run one after
the other in this launch (the same processes and process group), each with ``name``, ``task``
(``"logreg"`` or ``"mlp"``), ``method`` (``"cdgrab"``, ``"drr"`` or ``"idgrab"``), ``seed``,
``epochs``, ``learning_rate``, ``momentum``, ``batch_size`` (per rank), ``data`` (the task's data
arguments, see :func:`load_arrays`) and, for ``mlp``, ``hidden_size``. The launch's peak RSS per
rank (``memory``) covers all its fits: the driver puts one method per launch.

The three methods share everything but the example order: the same data (generated with
``data["seed"]``, fixed across seeds), the same fixed random partition of the training set over the
ranks (``CDGraBSampler``, seeded with ``seed``), the same initial weights (``seed``), the same
optimizer. ``drr``: ``CDGraBSampler(order="random")`` and no callback (distributed random
reshuffling); ``cdgrab``: ``CDGraB()`` (coordinated); ``idgrab``: ``CDGraB(mode="independent")``.

Per epoch, rank 0 records (``curve``):

- ``train_loss`` / ``train_acc``: loss and accuracy of the model on the **entire** training split
  (paper 003's "full train loss"), ``test_loss`` / ``test_acc`` on the held-out split; computed by
  rank 0 in one forward pass after the epoch's last step, while the other ranks wait at a barrier
  (not part of the epoch time);
- ``epoch_s``: wall time of the epoch's training (``on_train_epoch_start`` to the end of
  ``on_train_epoch_end`` of the callbacks before the recorder, so CD-GraB's end-of-epoch reorder
  counts), on rank 0; every rank's times come in ``per_rank``;
- ``cdgrab_s``: seconds spent in CD-GraB's per-step hook this epoch (``cdgrab/seconds``), and
  the parts, timed by wrapping the callback's objects (no library change): ``grad_s`` (the
  per-example gradients), ``gather_s`` (the gather of the differences to rank 0 on the training
  thread: its launch and ``gather_wait_s``, the wait before balancing)
  and ``balance_s`` (the sequential online pair balancing). The last step's wait and balancing
  happen in ``on_train_epoch_end``: in these parts and the epoch time, not in ``cdgrab_s``.
  ``cdgrab_bytes``: the bytes this rank sent (differences to the order server; the server's
  broadcasts); ``running_sum_norm``.

Memory (``memory``): peak RSS (``ru_maxrss``) of every rank before and after fit, and the sizes of
the callback's buffers as actually allocated: the per-example gradient matrix, the gathered
differences, the running sum and the sign table.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.common.report import write_json
from lightning_dist import CDGraB, CDGraBSampler
from lightning_dist.models import MLPClassifier


# ---------------------------------------------------------------- data


def load_arrays(task: str, data: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, y_train, x_test, y_test)`` of the task; depends only on ``data``, not on the run's seed.

    ``logreg``: scikit-learn ``make_classification``, a binary tabular task shaped like paper 003's
    HMDA mortgage data (18 features), ``n_samples`` rows, 5 % of labels flipped (so the optimum has
    non-zero per-example gradients, as in real data), features standardized with the train
    statistics, 80/20 split. ``mlp``: MNIST-1D with ``num_samples`` examples, 80/20 split.
    """
    seed = int(data.get("seed", 0))
    if task == "logreg":
        from sklearn.datasets import make_classification
        from sklearn.model_selection import train_test_split

        x, y = make_classification(
            n_samples=int(data["n_samples"]), n_features=18, n_informative=10, n_redundant=4,
            n_clusters_per_class=2, flip_y=0.05, class_sep=1.0, random_state=seed,
        )
        x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
        mean, std = x_train.mean(axis=0), x_train.std(axis=0) + 1e-8
        return (x_train - mean) / std, y_train, (x_test - mean) / std, y_test
    if task == "mlp":
        from lightning_dist.data.datamodules import MNIST1DDataModule

        module = MNIST1DDataModule(num_samples=int(data["num_samples"]), seed=seed, val_fraction=0.2)
        return module._load_arrays()
    raise ValueError(f"unknown task {task!r}")


class OrderedDataModule(L.LightningDataModule):
    """In-memory train/test tensors; the train loader samples with ``CDGraBSampler(order=order, seed=seed)``."""

    def __init__(
        self, arrays: tuple[np.ndarray, ...], batch_size: int, order: str, seed: int, float_labels: bool
    ) -> None:
        super().__init__()
        x_train, y_train, x_test, y_test = arrays
        label_dtype = torch.float32 if float_labels else torch.int64
        self.x_train = torch.as_tensor(np.asarray(x_train, dtype=np.float32))
        self.y_train = torch.as_tensor(np.asarray(y_train)).to(label_dtype)
        self.x_test = torch.as_tensor(np.asarray(x_test, dtype=np.float32))
        self.y_test = torch.as_tensor(np.asarray(y_test)).to(label_dtype)
        self.batch_size, self.order, self.seed = batch_size, order, seed
        self.sampler: Optional[CDGraBSampler] = None

    def train_dataloader(self) -> DataLoader:
        dataset = TensorDataset(self.x_train, self.y_train)
        self.sampler = CDGraBSampler(dataset, self.batch_size, self.trainer.world_size, self.trainer.global_rank,
                                     order=self.order, seed=self.seed)
        return DataLoader(dataset, batch_size=self.batch_size, sampler=self.sampler, num_workers=0)


# ---------------------------------------------------------------- models


class LogisticRegression(L.LightningModule):
    """Binary logistic regression: one linear unit, binary cross-entropy on the logit, SGD with momentum."""

    def __init__(self, num_features: int, learning_rate: float, momentum: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.linear = nn.Linear(num_features, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x).squeeze(-1)

    def per_example_loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        return nn.functional.binary_cross_entropy_with_logits(self(x), y, reduction="none")

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self.per_example_loss(batch).mean()

    def evaluate(self, x: Tensor, y: Tensor) -> tuple[float, float]:
        logits = self(x)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, y)
        return float(loss), float(((logits > 0).float() == y).float().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.learning_rate, momentum=self.hparams.momentum)


def evaluate_classifier(model: nn.Module, x: Tensor, y: Tensor) -> tuple[float, float]:
    logits = model(x)
    return float(nn.functional.cross_entropy(logits, y)), float((logits.argmax(dim=1) == y).float().mean())


# ---------------------------------------------------------------- timing wrappers


class Timers:
    """Seconds on the training thread per part of the callback's step, and the largest buffer of each kind.

    ``gather_s`` is all the time the background gather (``start_gather``) takes on the training
    thread: its launch plus the ``wait()`` before the differences are balanced (``gather_wait_s``,
    also counted in ``gather_s``).
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {"grad_s": 0.0, "gather_s": 0.0, "gather_wait_s": 0.0, "balance_s": 0.0}
        self.max_bytes: dict[str, int] = {"per_example_gradients": 0, "gathered_differences": 0}

    def record_size(self, key: str, tensor: Tensor) -> None:
        self.max_bytes[key] = max(self.max_bytes[key], tensor.numel() * tensor.element_size())

    def wrap(self, function: Callable[..., Tensor], key: str, size_key: Optional[str] = None) -> Callable[..., Tensor]:
        def timed(*args: Any, **kwargs: Any) -> Tensor:
            start = time.perf_counter()
            result = function(*args, **kwargs)
            self.seconds[key] += time.perf_counter() - start
            if size_key is not None:
                self.record_size(size_key, result)
            return result

        return timed

    def wrap_start(self, start_gather: Callable[..., Any]) -> Callable[..., Any]:
        """``start_gather`` timed, returning a pending gather whose ``wait()`` is timed too."""
        timers = self

        class TimedPending:
            def __init__(self, inner: Any) -> None:
                self._inner = inner

            def wait(self) -> Tensor:
                begin = time.perf_counter()
                result = self._inner.wait()
                elapsed = time.perf_counter() - begin
                timers.seconds["gather_s"] += elapsed
                timers.seconds["gather_wait_s"] += elapsed
                if result is not None:  # on the order server only
                    timers.record_size("gathered_differences", result)
                return result

        def timed(*args: Any, **kwargs: Any) -> Any:
            begin = time.perf_counter()
            pending = TimedPending(start_gather(*args, **kwargs))
            self.seconds["gather_s"] += time.perf_counter() - begin
            return pending

        return timed


class _TimedGradients:
    """Stands in for the callback's ``PerExampleGradients``: same call, timed, sizes recorded."""

    def __init__(self, inner: Any, timers: Timers) -> None:
        self._inner = inner
        self._call = timers.wrap(inner, "grad_s", "per_example_gradients")

    def __call__(self, batch: Any) -> Tensor:
        return self._call(batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class TimedCDGraB(CDGraB):
    """``CDGraB`` unchanged, with its three per-step parts timed (instance-level wrappers, no library change)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timers = Timers()
        self._balancer_wrapped = False

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "fit":
            return
        self._gradients = _TimedGradients(self._gradients, self.timers)
        if self._comm is not None:
            self._comm.start_gather = self.timers.wrap_start(self._comm.start_gather)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._balancer is not None and not self._balancer_wrapped:  # created when the train loader is set up
            self._balancer.step = self.timers.wrap(self._balancer.step, "balance_s")
            self._balancer_wrapped = True
        super().on_train_epoch_start(trainer, pl_module)


# ---------------------------------------------------------------- recording


class EpochStart(Callback):
    """First in the callback list: starts the epoch clock."""

    def __init__(self) -> None:
        self.start = 0.0

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = time.perf_counter()


class EpochRecorder(Callback):
    """Last in the callback list: stops the epoch clock, evaluates on rank 0, then a barrier on all ranks."""

    def __init__(self, clock: EpochStart, datamodule: OrderedDataModule, evaluate: Callable[..., tuple[float, float]],
                 cdgrab: Optional[TimedCDGraB]) -> None:
        self.clock, self.datamodule, self.evaluate, self.cdgrab = clock, datamodule, evaluate, cdgrab
        self.epochs: list[dict[str, Any]] = []
        self._train_s = 0.0
        self._previous = {key: 0.0 for key in self._cdgrab_counters()}

    def _cdgrab_counters(self) -> dict[str, float]:
        keys = ["cdgrab_s", *Timers().seconds, "cdgrab_bytes"]
        if self.cdgrab is None:
            return {key: 0.0 for key in keys}
        return {"cdgrab_s": self.cdgrab.seconds, **self.cdgrab.timers.seconds,
                "cdgrab_bytes": float(self.cdgrab.bytes_sent)}

    def record_initial(self, pl_module: L.LightningModule) -> None:
        """Epoch "-1": the initial model (rank 0), so every curve starts from the same point."""
        self.epochs.append({"epoch": -1, "train_s": 0.0, **self._losses(pl_module)})

    def _losses(self, pl_module: L.LightningModule) -> dict[str, float]:
        dm = self.datamodule
        was_training = pl_module.training
        pl_module.eval()
        with torch.no_grad():
            train_loss, train_acc = self.evaluate(pl_module, dm.x_train, dm.y_train)
            test_loss, test_acc = self.evaluate(pl_module, dm.x_test, dm.y_test)
        pl_module.train(was_training)
        return {"train_loss": train_loss, "train_acc": train_acc, "test_loss": test_loss, "test_acc": test_acc}

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        epoch_s = time.perf_counter() - self.clock.start
        self._train_s += epoch_s
        counters = self._cdgrab_counters()
        record: dict[str, Any] = {
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
            "epoch_s": epoch_s,
            "train_s": self._train_s,
            **{key: counters[key] - self._previous[key] for key in counters},
            "running_sum_norm": self.cdgrab.metrics()["cdgrab/running_sum_norm"] if self.cdgrab is not None else 0.0,
        }
        self._previous = counters
        record["rss_mib"] = current_rss_mib()
        if trainer.is_global_zero:
            record.update(self._losses(pl_module))
        self.epochs.append(record)
        dist.barrier()  # the other ranks wait for rank 0's evaluation outside their epoch clocks


# ---------------------------------------------------------------- main


def current_rss_mib() -> float:
    """Resident set size now (``/proc/self/statm``): per epoch, to tell steady use from growth."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return float("nan")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def fit_one(spec: dict[str, Any], arrays: tuple[np.ndarray, ...]) -> dict[str, Any]:
    """One fit (one entry of the launch's ``runs``); returns rank 0's record (``{}`` on the other ranks)."""
    task, method, seed = spec["task"], spec["method"], int(spec["seed"])
    L.seed_everything(seed, workers=True, verbose=False)
    order = "random" if method == "drr" else "balanced"
    datamodule = OrderedDataModule(arrays, int(spec["batch_size"]), order, seed, float_labels=task == "logreg")
    lr, momentum = float(spec["learning_rate"]), float(spec["momentum"])
    if task == "logreg":
        model: L.LightningModule = LogisticRegression(datamodule.x_train.shape[1], lr, momentum)
        evaluate = lambda module, x, y: module.evaluate(x, y)  # noqa: E731
    else:
        model = MLPClassifier(num_features=datamodule.x_train.shape[1], num_classes=10,
                              hidden_size=int(spec.get("hidden_size", 64)), learning_rate=lr, momentum=momentum)
        evaluate = evaluate_classifier
    cdgrab: Optional[TimedCDGraB] = None
    if method == "cdgrab":
        cdgrab = TimedCDGraB(mode="coordinated", seed=seed)
    elif method == "idgrab":
        cdgrab = TimedCDGraB(mode="independent", seed=seed)
    elif method != "drr":
        raise ValueError(f"unknown method {method!r}")
    clock = EpochStart()
    recorder = EpochRecorder(clock, datamodule, evaluate, cdgrab)
    callbacks: list[Callback] = [clock] + ([cdgrab] if cdgrab is not None else []) + [recorder]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy="ddp",
        max_epochs=int(spec["epochs"]),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        deterministic=True,
        callbacks=callbacks,
    )
    recorder.record_initial(model)  # same weights on every rank (seeded); the DDP broadcast changes nothing
    start = time.perf_counter()
    trainer.fit(model, datamodule=datamodule)
    fit_s = time.perf_counter() - start
    local = {
        "epoch_s": [e["epoch_s"] for e in recorder.epochs if e["epoch"] >= 0],
        "cdgrab_s": [e["cdgrab_s"] for e in recorder.epochs if e["epoch"] >= 0],
        "cdgrab_bytes": [e["cdgrab_bytes"] for e in recorder.epochs if e["epoch"] >= 0],
        "peak_rss_mib": peak_rss_mib(),
        "fit_s": fit_s,
    }
    gathered: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(gathered, local)
    if not trainer.is_global_zero:
        return {}
    sampler = datamodule.sampler
    buffers: dict[str, Any] = {}
    if cdgrab is not None and cdgrab.balancer is not None:
        balancer = cdgrab.balancer
        buffers = {
            **cdgrab.timers.max_bytes,
            "running_sum": balancer.running_sum.numel() * balancer.running_sum.element_size(),
            "signs": balancer.signs.numel() * balancer.signs.element_size(),
        }
    return {
        "name": spec["name"],
        "task": task,
        "method": method,
        "seed": seed,
        "epochs": int(spec["epochs"]),
        "learning_rate": lr,
        "momentum": momentum,
        "batch_size": int(spec["batch_size"]),
        "data": spec["data"],
        "hidden_size": spec.get("hidden_size"),
        "world_size": trainer.world_size,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "train_examples": int(datamodule.x_train.shape[0]),
        "test_examples": int(datamodule.x_test.shape[0]),
        "examples_per_rank": sampler.num_samples if sampler is not None else None,
        "dropped": sampler.dropped if sampler is not None else None,
        "steps_per_epoch": trainer.num_training_batches,
        "fit_s": fit_s,
        "curve": recorder.epochs,
        "per_rank": gathered,
        "cdgrab_buffers_bytes": buffers,
    }


def main() -> None:
    torch.set_num_threads(1)  # 4 ranks on 2 cores: more threads per rank only contend
    spec = json.loads(Path(sys.argv[1]).read_text())
    cache: dict[str, tuple[np.ndarray, ...]] = {}
    for run in spec["runs"]:
        key = json.dumps([run["task"], run["data"]], sort_keys=True)
        if key not in cache:
            cache[key] = load_arrays(run["task"], run["data"])
    rss_before = peak_rss_mib()
    runs = [fit_one(run, cache[json.dumps([run["task"], run["data"]], sort_keys=True)]) for run in spec["runs"]]
    local = {"peak_rss_mib": peak_rss_mib(), "peak_rss_before_fit_mib": rss_before}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    if dist.get_rank() == 0:
        result = {
            "name": spec["name"],
            "world_size": dist.get_world_size(),
            "memory": {"peak_rss_mib": [r["peak_rss_mib"] for r in gathered],
                       "peak_rss_before_fit_mib": [r["peak_rss_before_fit_mib"] for r in gathered]},
            "runs": runs,
        }
        write_json(Path(spec["out"]), result)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
