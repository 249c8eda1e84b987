"""Real training and evaluation of a user's LightningModule inside the simulator, without a Trainer.

Every virtual worker owns a deep copy of one LightningModule (its own parameters and the optimizer
its ``configure_optimizers`` returns) and a train loader from the shared datamodule for its rank,
so the simulator trains exactly what ``Trainer.fit`` would. Protocols see a replica as the flat
vector of :class:`~lightning_dist.model_vector.ModelVector`, the same unit the strategies exchange.

With one learner per machine (``hierarchy="node"``, :mod:`lightning_dist.sim.machines`) a learner is a
:class:`NodeReplica`: the ``L`` ranks of a machine in DDP over the machine, as one model and optimizer that
takes each step on the mean of the ranks' gradients.
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Optional

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader
from torchmetrics import Metric

from lightning_dist.data.sampler import part_size
from lightning_dist.model_vector import ModelVector
from lightning_dist.strategies._averaging import NonFiniteModelError


def check_finite(vector: Tensor, worker: int) -> None:
    """Refuse a NaN or infinite model before any average uses it, naming the worker (the strategies' error)."""
    if not bool(torch.isfinite(vector).all()):
        raise NonFiniteModelError(f"worker {worker} has a non-finite model; refusing to use it in the protocol")


def _first_optimizer(configured: Any) -> torch.optim.Optimizer:
    """The optimizer out of any of the forms ``configure_optimizers`` may return."""
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, dict):
        return _first_optimizer(configured["optimizer"])
    if isinstance(configured, (list, tuple)) and configured:
        return _first_optimizer(configured[0])
    raise TypeError(f"configure_optimizers must return an optimizer (or a form holding one); got {configured!r}")


def _schedulers(configured: Any, optimizer: torch.optim.Optimizer) -> list[tuple[Any, str, int]]:
    """The learning-rate schedulers of ``optimizer`` in ``configure_optimizers``'s result, as Lightning reads them:
    ``(scheduler, interval, frequency)``, interval ``"step"`` or ``"epoch"`` (Lightning's default)."""
    if isinstance(configured, dict):
        entries = [configured["lr_scheduler"]] if configured.get("lr_scheduler") is not None else []
    elif isinstance(configured, (list, tuple)) and len(configured) == 2 and isinstance(configured[1], (list, tuple)):
        entries = list(configured[1])  # ([optimizers], [schedulers])
    elif isinstance(configured, (list, tuple)) and configured and isinstance(configured[0], dict):
        return _schedulers(configured[0], optimizer)
    else:
        entries = []
    schedulers = []
    for entry in entries:
        config = entry if isinstance(entry, dict) else {"scheduler": entry}
        scheduler = config["scheduler"]
        if getattr(scheduler, "optimizer", None) is not optimizer:
            continue
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ValueError(
                "the simulator cannot run ReduceLROnPlateau: it steps on a monitored metric that workers do not log"
            )
        interval = config.get("interval", "epoch")
        if interval not in ("step", "epoch"):
            raise ValueError(f"a learning-rate scheduler's interval must be 'step' or 'epoch'; got {interval!r}")
        schedulers.append((scheduler, interval, int(config.get("frequency", 1))))
    return schedulers


class _LogRecorder:
    """Stands in for ``LightningModule.log`` outside a Trainer: keeps what the module logs."""

    def __init__(self) -> None:
        self.values: dict[str, list[tuple[float, int]]] = defaultdict(list)
        self.metrics: dict[str, Metric] = {}

    def __call__(self, name: str, value: Any, *args: Any, batch_size: Optional[int] = None, **kwargs: Any) -> None:
        if isinstance(value, Metric):
            self.metrics[name] = value
        else:
            number = value.detach() if isinstance(value, torch.Tensor) else value
            self.values[name].append((float(number), batch_size or 1))

    def results(self) -> dict[str, float]:
        """Per-example weighted means of logged values, and each logged Metric's ``compute()``."""
        results = {
            name: sum(value * weight for value, weight in entries) / sum(weight for _, weight in entries)
            for name, entries in self.values.items()
        }
        for name, metric in self.metrics.items():
            results[name] = float(metric.compute())
            metric.reset()
        self.values.clear()
        self.metrics.clear()
        return results


class _Batches:
    """A train loader read epoch after epoch, for ever."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        self.epoch = 0
        self._batches: Optional[Iterator] = None

    def next(self, epoch_ended: Callable[[int], None] = lambda epoch: None) -> Any:
        """The next batch; a new epoch (``set_epoch``, a fresh iterator, ``epoch_ended(epochs done)``) when one ends."""
        while True:
            if self._batches is None:
                if hasattr(self.loader.sampler, "set_epoch"):
                    self.loader.sampler.set_epoch(self.epoch)
                self._batches = iter(self.loader)
            try:
                return next(self._batches)
            except StopIteration:
                self._batches = None
                self.epoch += 1
                epoch_ended(self.epoch)


class Replica:
    """One worker's model, optimizer and stream of training batches (epochs continue forever)."""

    def __init__(self, template: L.LightningModule, loader: DataLoader) -> None:
        self.module = copy.deepcopy(template)
        self.module.train()
        self.module.log = _LogRecorder()  # training_step's self.log calls are not needed here
        configured = self.module.configure_optimizers()
        self.optimizer = _first_optimizer(configured)
        self.schedulers = _schedulers(configured, self.optimizer)
        self.vector = ModelVector(self.module)
        # What DDP all-reduces: the gradients of the parameters that require them.
        self._trainable = [parameter for parameter in self.vector.parameters if parameter.requires_grad]
        self._trainable_sizes = [parameter.numel() for parameter in self._trainable]
        self.loader = loader
        self._batches = _Batches(loader)
        self.steps = 0
        self._applied = {"step": 0, "epoch": 0}  # the optimizer's steps and the epochs its schedulers saw

    @property
    def part_size(self) -> Optional[int]:
        """``|D_j|``, the examples in this worker's part of the data (:func:`~lightning_dist.data.sampler.part_size`)."""
        return part_size(self.loader)

    @property
    def gradient_bytes(self) -> int:
        """Bytes of the gradients DDP all-reduces: the trainable parameters', in their dtype."""
        return sum(parameter.numel() * parameter.element_size() for parameter in self._trainable)

    def next_batch(self) -> Any:
        """The next training batch; a new epoch (``set_epoch``, a fresh iterator) when one ends."""
        return self._batches.next(lambda epoch: self._step_schedulers("epoch", epoch))

    def step(self, batch: Any) -> float:
        """One optimizer step on ``batch``; returns the training loss."""
        loss = self.compute_gradient(batch)
        self.apply_gradient()
        return loss

    def compute_gradient(self, batch: Any) -> float:
        """The first half of :meth:`step`: forward and backward on ``batch`` into the parameters' ``.grad``;
        returns the training loss."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._loss(batch)
        loss.backward()
        return float(loss.detach())

    def _loss(self, batch: Any) -> Tensor:
        """The training loss of ``batch`` (the module's ``training_step``), with its graph."""
        output = self.module.training_step(batch, self.steps)
        return output["loss"] if isinstance(output, dict) else output

    def apply_gradient(self, gradient: Optional[Tensor | Sequence[Tensor]] = None) -> None:
        """The second half of :meth:`step`: the optimizer's step with the gradient in ``.grad``, or with
        ``gradient`` put there first: the :meth:`gradients` flattened into one vector (DDP's mean, which every
        replica receives), or this replica's own gradient, one tensor per trainable parameter
        (:mod:`lightning_dist.sim.batched`), used as it is."""
        if isinstance(gradient, Tensor):
            with torch.no_grad():
                for parameter, chunk in zip(self._trainable, gradient.split(self._trainable_sizes)):
                    # A copy per replica: an optimizer may change its .grad in place.
                    parameter.grad = chunk.view_as(parameter).to(parameter.dtype, copy=True)
        elif gradient is not None:
            for parameter, own in zip(self._trainable, gradient, strict=True):
                parameter.grad = own
        self.optimizer.step()
        self.steps += 1
        self._applied["step"] = self.steps
        self._step_schedulers("step", self.steps)

    def reset_optimizer(self) -> None:
        """Forget the optimizer's state (momentum, Adam's moments and step counts), as a fresh optimizer would
        start: a worker that rejoins holds a new model, which its old state does not belong to. The learning
        rate schedulers keep their counts: the run's schedule goes on."""
        self.optimizer.state.clear()

    def _step_schedulers(self, interval: str, count: int) -> None:
        """Step the schedulers of ``interval`` after the ``count``-th step or epoch, every ``frequency`` (Lightning's rule);
        an epoch once, however many workers share the schedulers (:class:`SharedReplica`)."""
        if interval == "epoch":
            if count <= self._applied["epoch"]:
                return
            self._applied["epoch"] = count
        for scheduler, scheduler_interval, frequency in self.schedulers:
            if scheduler_interval == interval and count % frequency == 0:
                scheduler.step()

    def gradients(self) -> list[Tensor]:
        """The trainable parameters' ``.grad`` (not copies), in :class:`ModelVector`'s parameter order; zeros for
        a parameter the backward did not reach (what DDP all-reduces for it)."""
        return [parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
                for parameter in self._trainable]

    def get(self) -> Tensor:
        return self.vector.get()

    def set(self, vector: Tensor) -> None:
        self.vector.set(vector)


class SharedReplica(Replica):
    """A data-parallel worker whose model, optimizer and schedulers are another replica's, the ``leader``'s.

    Under DDP every replica holds the same model and optimizer state after every step (each applies the same
    mean gradient), so N copies of them are N times the memory for one state: 1024 simulated ranks of a
    1.3 M-parameter model with Adam would hold 21 GB. Here the workers share one; each keeps its own loader,
    batches and step count. A worker's gradient is computed on the shared model into fresh ``.grad`` tensors (the
    previous worker's stay with its :meth:`gradients`), which holds because a data-parallel step computes every
    gradient before the all-reduce and applies the mean after it. The first worker to apply a step's mean
    takes the optimizer step (and steps the schedulers); the others count it, as do the epoch schedulers: once per
    epoch, not once per worker.
    """

    def __init__(self, leader: Replica, loader: DataLoader) -> None:
        self.module, self.optimizer, self.schedulers = leader.module, leader.optimizer, leader.schedulers
        self.vector, self._trainable, self._trainable_sizes = leader.vector, leader._trainable, leader._trainable_sizes
        self._applied = leader._applied
        self.loader = loader
        self._batches = _Batches(loader)
        self.steps = 0

    def apply_gradient(self, gradient: Optional[Tensor] = None) -> None:
        """The shared optimizer's step with ``gradient`` once per step, by the first worker to apply it."""
        if self._applied["step"] > self.steps:
            self.steps += 1
            return
        super().apply_gradient(gradient)

    def reset_optimizer(self) -> None:
        raise RuntimeError("a shared replica's optimizer is every worker's: it cannot be reset for one of them")


class NodeReplica(Replica):
    """The learner of one machine under ``hierarchy="node"``: its ``L`` ranks' DDP as one replica.

    What DDP over the machine does (:mod:`lightning_dist.strategies._hierarchy`): every rank computes the
    gradient of its own batch, the gradients are all-reduced (mean), every rank applies the mean with its own
    optimizer, so the ranks stay identical; DDP broadcasts local rank 0's buffers (BatchNorm's running
    statistics) before each forward. Here one model holds them all: :meth:`next_batch` gives one batch per
    local rank (rank ``j``'s loader: ``loaders[j]``; epochs and the epoch schedulers follow local rank 0's),
    and a step runs forward and backward of each with the loss divided by ``L``, summed into ``.grad`` (the
    mean of the ranks' gradients, up to rounding), then one optimizer step. Every forward starts from the
    buffers the step started from, and the step ends with those local rank 0's forward left. The training loss
    is the mean of the ranks' losses.
    """

    def __init__(self, template: L.LightningModule, loaders: Sequence[DataLoader]) -> None:
        super().__init__(template, loaders[0])
        self.loaders = list(loaders)
        self._others = [_Batches(loader) for loader in loaders[1:]]

    @property
    def part_size(self) -> Optional[int]:
        """``|D_j|`` of the machine: its ranks' parts summed (None if one is unknown)."""
        sizes = [part_size(loader) for loader in self.loaders]
        return None if None in sizes else sum(sizes)

    def next_batch(self) -> list[Any]:
        """The next batch of every local rank, in local-rank order."""
        return [super().next_batch()] + [batches.next() for batches in self._others]

    def compute_gradient(self, batch: list[Any]) -> float:
        """Forward and backward of every local rank's batch, the mean of their gradients into ``.grad``; returns
        the mean of their losses."""
        self.optimizer.zero_grad(set_to_none=True)
        buffers = list(self.module.buffers())
        start = [buffer.detach().clone() for buffer in buffers]
        losses, first = [], start
        for index, ranks_batch in enumerate(batch):
            if index:
                _copy(buffers, start)  # DDP's broadcast before the forward: every rank's buffers are the node's
            loss = self._loss(ranks_batch)
            if index == 0:
                first = [buffer.detach().clone() for buffer in buffers]
            (loss / len(batch)).backward()
            losses.append(float(loss.detach()))
        _copy(buffers, first)
        return sum(losses) / len(losses)


@torch.no_grad()
def _copy(buffers: list[Tensor], values: list[Tensor]) -> None:
    for buffer, value in zip(buffers, values):
        buffer.copy_(value)


class Evaluator:
    """Runs the module's ``validation_step`` over the validation batches for any model vector.

    The returned metrics are what the module logs (``val_loss``, ``val_acc`` for the embedded
    models), reduced as Lightning reduces them at epoch end: tensors by their per-example mean,
    torchmetrics Metrics by ``compute()``. A validation DataLoader is re-batched in batches of
    ``batch_size`` (same dataset, order and collate function).
    """

    def __init__(self, template: L.LightningModule, batches: Iterable[Any], batch_size: int = 1024) -> None:
        self.module = copy.deepcopy(template)
        self.module.eval()
        self.recorder = _LogRecorder()
        self.module.log = self.recorder
        self.vector = ModelVector(self.module)
        if isinstance(batches, DataLoader) and batches.batch_size is not None and batches.batch_size < batch_size:
            # Per-example means and Metric counts do not depend on the batch size; large batches make
            # the many evaluations of a simulation (every worker, every few steps) cheap.
            batches = DataLoader(batches.dataset, batch_size=batch_size, collate_fn=batches.collate_fn)
        self.batches = list(batches)

    @torch.no_grad()
    def __call__(self, vector: Tensor) -> dict[str, float]:
        if not bool(torch.isfinite(vector).all()):
            return {"val_loss": math.nan}
        self.vector.set(vector)
        for index, batch in enumerate(self.batches):
            self.module.validation_step(batch, index)
        return self.recorder.results()
