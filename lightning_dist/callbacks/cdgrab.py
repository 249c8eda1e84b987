"""CD-GraB (paper 003): coordinated per-rank example orders that keep gradient prefix sums small."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader

from lightning_dist.algorithms.averaging import accumulation_dtype
from lightning_dist.algorithms.balancing import PairBalancer
from lightning_dist.algorithms.projection import CountSketch
from lightning_dist.callbacks._cdgrab_checkpoint import CDGraBCheckpoint
from lightning_dist.callbacks._loader_hook import TrainLoaderHook
from lightning_dist.callbacks._per_example import METHODS as GRADIENT_METHODS
from lightning_dist.callbacks._per_example import GradientFunction, PerExampleLoss, make_per_example_gradients
from lightning_dist.comm import Communicator, check_timeout, destroy_group, new_group, strategy_timeout
from lightning_dist.comm.communicator import Pending
from lightning_dist.data.cdgrab_sampler import CDGraBSampler

MODES = ("coordinated", "independent")
# The rank that balances for all (paper 003's order server).
ORDER_SERVER = 0


class CDGraB(CDGraBCheckpoint, Callback):
    """Order each rank's examples for the next epoch by online pair balancing of their gradients (paper 003).

    Every training step, on every rank, this callback computes the per-example gradients of the
    batch (``torch.func``: vmap over grad, at the weights the step starts from; see
    ``per_example_gradients`` for a faster path), takes the differences of consecutive examples
    ``(0, 1), (2, 3), ...``, and gathers them on rank 0, the order server of paper 003, which runs
    online pair balancing (:mod:`lightning_dist.algorithms.balancing`): one running sum over all
    ranks' differences, pair-major then rank. At the end of the epoch the server broadcasts the
    signs; each rank's signs give its next order (front list, then reversed back list), which goes
    to its :class:`~lightning_dist.data.CDGraBSampler`. Epoch 0 reads a seeded random order.

    Use with ``strategy="ddp"`` (the paper's setting; Gloo or NCCL) or any strategy whose ranks
    step together, and a ``CDGraBSampler(order="balanced")`` in the train loader::

        sampler = CDGraBSampler(train_set, batch_size=16)
        loader = DataLoader(train_set, batch_size=16, sampler=sampler)
        trainer = L.Trainer(strategy="ddp", callbacks=[CDGraB()])

    **The per-example loss.** The callback differentiates a function returning each example's
    loss, shape ``(batch_size,)``: by default the module's ``per_example_loss(batch)`` method
    (:class:`~lightning_dist.models.MLPClassifier` has one), or ``loss_fn(module, batch)``.
    It is called on batches of one example under ``torch.func.vmap``: it must not log, and
    batch-dependent layers (BatchNorm in training mode) have no per-example gradient.

    The three orderings of the paper run on the same code: CD-GraB (this callback, default mode),
    ID-GraB (``mode="independent"``: each rank balances its own differences with its own running
    sum, nothing is exchanged), and D-RR (no callback, ``CDGraBSampler(order="random")``).

    Args:
        projection_dim: if set, gradients are first projected to this many dimensions by a
            count sketch (:class:`~lightning_dist.algorithms.projection.CountSketch`, seeded, the
            same on every rank): fewer bytes per gather and a smaller running sum, for large
            models. ``None`` (default, as the reference code): full gradients. ``>= 1``.
        mode: ``"coordinated"`` (CD-GraB) or ``"independent"`` (ID-GraB).
        loss_fn: ``loss_fn(module, batch) -> Tensor[batch_size]``; default ``module.per_example_loss``.
        per_example_gradients: how per-example gradients are computed. ``"auto"`` (default): when
            every trainable parameter belongs to an ``nn.Linear``, from one batched forward and a
            backward to the layers' outputs (``g_i x_i^T`` per example; exact, and several times
            cheaper than vmap on small models), after checking on the first batch of each fit that
            it agrees with torch.func (a warning and torch.func otherwise); torch.func for any other
            model. ``"vmap"``: always torch.func (vmap over grad).
        seed: seeds the projection.
        timeout: timeout of the callback's process groups; None (default): the strategy's ``timeout``
            (torch's default for the backend if the strategy has none).

    Requirements, checked when training starts (a ``ValueError`` on every rank otherwise): the
    train loader is a ``DataLoader`` with a ``CDGraBSampler(order="balanced")`` built for this
    world size and rank, and the loader's batch size equals the sampler's (even, the same on every
    rank); every epoch reads the whole sampler (no ``limit_train_batches`` below 1). The sampler
    drops the remainder of the dataset (logged with the number of examples dropped).

    Costs per step: the per-example gradients (one ``vmap(grad)`` over the batch, about one more
    forward and backward, or less, see ``per_example_gradients``), one gather to rank 0 of
    ``batch_size / 2`` difference vectors of ``d`` floats from every other rank (``d`` =
    trainable parameters or ``projection_dim``; an all-gather, which would let every rank
    balance, moves ``world_size`` times more), and on rank 0 ``world_size * batch_size / 2``
    sequential dot products. The gather runs in the background during the step and is balanced
    at the start of the next one (or at the epoch's end): the order is needed only for the next
    epoch. Per epoch: three broadcasts from rank 0 (the signs, ``world_size * examples / 2``
    bytes; the running sum; counters). Memory: the gradients of a batch, on rank 0 the gathered
    differences, one running sum of ``d``.

    Metrics, logged after every epoch through the Trainer's loggers (this rank's values):
    ``cdgrab/bytes_sent`` (bytes this rank sent: differences, and on rank 0 the broadcasts, counted
    as in :mod:`lightning_dist.comm`), ``cdgrab/seconds`` (time spent in the callback's step hook),
    ``cdgrab/running_sum_norm`` (the 2-norm of the running sum at the end of the epoch: what the
    balancing keeps small).

    Checkpoints: the state holds every rank's current order and position in the epoch, and the
    order server's signs and running sum (gathered to rank 0, which writes the file). Resuming at
    an epoch end or in the middle of an epoch (the sampler skips the examples already read)
    continues with the same orders as the uninterrupted run. A checkpoint written by another
    number of processes resumes too, with the partition of the new world size: the saved orders
    and the herding state (signs, running sum) belong to the old ranks' parts and are dropped, and
    ordering restarts from the sampler's seeded random permutation of the resumed epoch for each
    rank's new part (what D-RR reads), balanced again from there on, so the epoch after it is
    balanced. The sampler starts at the batch where Lightning resumes, which after a checkpoint
    written within an epoch is the old ranks' batch count (``_restore_resized`` gives the rule).
    ``bytes_sent`` and ``seconds`` are kept in total over the ranks (rank 0 takes those of ranks
    that went away).
    """

    def __init__(
        self,
        projection_dim: Optional[int] = None,
        mode: str = "coordinated",
        loss_fn: Optional[PerExampleLoss] = None,
        per_example_gradients: str = "auto",
        seed: int = 0,
        timeout: Optional[timedelta] = None,
    ) -> None:
        if projection_dim is not None and (
            isinstance(projection_dim, bool) or not isinstance(projection_dim, int) or projection_dim < 1
        ):
            raise ValueError(f"projection_dim must be None or an integer >= 1; got {projection_dim!r}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
        if loss_fn is not None and not callable(loss_fn):
            raise ValueError(f"loss_fn must be callable as loss_fn(module, batch); got {loss_fn!r}")
        if per_example_gradients not in GRADIENT_METHODS:
            raise ValueError(f"per_example_gradients must be one of {GRADIENT_METHODS}; got {per_example_gradients!r}")
        self.projection_dim = projection_dim
        self.mode = mode
        self.loss_fn = loss_fn
        self.per_example_gradients = per_example_gradients
        self.seed = seed
        self.timeout = check_timeout(timeout)
        self.bytes_sent = 0
        self.seconds = 0.0
        self._rank, self._world_size = 0, 1
        self._comm: Optional[Communicator] = None
        self._control_group: Optional[dist.ProcessGroup] = None
        self._loader_hook: Optional[TrainLoaderHook] = None
        self._sampler: Optional[CDGraBSampler] = None
        self._gradients: Optional[GradientFunction] = None
        self._projection: Optional[CountSketch] = None
        self._balancer: Optional[PairBalancer] = None
        self._first_non_finite: Optional[Tensor] = None  # per balanced rank: step of its first non-finite gradient
        # The epoch whose order the balancer's signs refer to, and that order.
        self._balanced_epoch = 0
        self._balanced_permutation: Optional[Tensor] = None
        # Between an epoch's end and the next epoch's first step (where Lightning resumes a checkpoint
        # written then: at the next epoch's start, whatever the world size).
        self._epoch_ended = False
        self._loaded_state: Optional[dict[str, Any]] = None
        # The gather of this rank's last differences, with their step, balanced at the next step.
        self._pending: Optional[tuple[Pending, int]] = None

    @property
    def coordinated(self) -> bool:
        return self.mode == "coordinated"

    @property
    def sampler(self) -> Optional[CDGraBSampler]:
        return self._sampler

    @property
    def balancer(self) -> Optional[PairBalancer]:
        return self._balancer

    def metrics(self) -> dict[str, float]:
        norm = float(self._balancer.running_sum.norm()) if self._balancer is not None else 0.0
        return {"cdgrab/bytes_sent": float(self.bytes_sent), "cdgrab/seconds": self.seconds,
                "cdgrab/running_sum_norm": norm}

    # ------------------------------------------------------------------ set-up

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        loss_fn = self.loss_fn
        if loss_fn is None:
            if not callable(getattr(pl_module, "per_example_loss", None)):
                raise ValueError(
                    f"CDGraB needs per-example losses: define per_example_loss(batch) -> Tensor of shape (batch_size,) "
                    f"on {type(pl_module).__name__}, or pass CDGraB(loss_fn=...) with loss_fn(module, batch)"
                )
            batch_norms = [name for name, layer in pl_module.named_modules() if isinstance(layer, _BatchNorm)]
            if batch_norms:
                # per_example_loss runs in training mode, where BatchNorm normalises each example with its
                # batch's statistics: there is no per-example gradient (torch.func fails on the first step).
                raise ValueError(
                    f"CDGraB needs per-example gradients, which BatchNorm layers in training mode do not have (each "
                    f"example's output depends on its whole batch); {type(pl_module).__name__} has BatchNorm at "
                    f"{batch_norms}: use GroupNorm or LayerNorm, or pass CDGraB(loss_fn=...) that evaluates those "
                    "layers in eval mode"
                )
            loss_fn = _module_per_example_loss
        self._gradients = make_per_example_gradients(pl_module, loss_fn, self.per_example_gradients)
        distributed = dist.is_available() and dist.is_initialized()
        self._rank, self._world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        if distributed:
            # Created by every rank in the same order; never WORLD, where Lightning runs its own collectives.
            timeout = self.timeout if self.timeout is not None else strategy_timeout(trainer.strategy)
            self._comm = Communicator(new_group(timeout=timeout))
            self._control_group = new_group(backend="gloo", timeout=timeout)
        self._loader_hook = TrainLoaderHook(trainer, self._attach)

    def _attach(self, loader: object) -> object:
        """Find the sampler of the train loader and check it (every rank; inside ``FitLoop.setup_data``)."""
        sampler = _find_sampler(loader)
        batch_size = _loader_batch_size(loader)
        if sampler.order != "balanced":
            raise ValueError(
                "CDGraB decides the orders of CDGraBSampler(order='balanced'); the train loader's sampler has "
                f"order={sampler.order!r} (random reshuffling runs without the callback)"
            )
        if (sampler.num_replicas, sampler.rank) != (self._world_size, self._rank):
            raise ValueError(
                f"the CDGraBSampler was built for num_replicas={sampler.num_replicas}, rank={sampler.rank}; this process "
                f"is rank {self._rank} of {self._world_size}"
            )
        if batch_size != sampler.batch_size:
            raise ValueError(
                f"the train loader's batch_size ({batch_size}) must equal the CDGraBSampler's batch_size "
                f"({sampler.batch_size}): CD-GraB pairs examples within a batch and steps all ranks together"
            )
        if self._control_group is not None:
            sizes: list[Any] = [None] * self._world_size
            dist.all_gather_object(sizes, (batch_size, sampler.num_samples), group=self._control_group)
            if len(set(sizes)) > 1:
                listing = ", ".join(f"rank {r}: batch_size={b}, {n} examples" for r, (b, n) in enumerate(sizes))
                raise ValueError(f"CDGraB needs the same batch_size and examples per rank on every rank; got {listing}")
        assert self._gradients is not None
        dim = self._gradients.num_parameters
        device = self._gradients.device
        # Differences and the running sum in at least float32: under precision="bf16-true" the gradients are
        # bfloat16, whose running sum would round at every step (and the host loop runs on NumPy, which has
        # no bfloat16). Read here, not in setup: the precision plugin converts the module in between.
        dtype = accumulation_dtype(self._gradients.dtype)
        if self.projection_dim is not None:
            self._projection = CountSketch(dim, self.projection_dim, seed=self.seed, device=device)
            dim = self.projection_dim
        ranks = self._world_size if self.coordinated else 1
        self._balancer = PairBalancer(ranks, sampler.num_samples, dim, dtype=dtype, device=device)
        self._first_non_finite = torch.full((ranks,), -1, dtype=torch.int64, device=device)
        self._sampler = sampler
        self._start_balancing_epoch()
        if self._loaded_state is not None:
            self._restore(self._loaded_state)
            self._loaded_state = None
        return loader

    # ------------------------------------------------------------------ training hooks

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._balancer is None or self._sampler is None:
            return
        expected = self._sampler.num_samples // self._sampler.batch_size
        if trainer.num_training_batches != expected:
            raise ValueError(
                f"CDGraB needs every epoch to read the whole CDGraBSampler ({expected} batches per rank) to reorder all "
                f"examples; this epoch has {trainer.num_training_batches} (limit_train_batches?)"
            )

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._balancer is None or self._gradients is None:
            return
        start = time.perf_counter()
        self._epoch_ended = False
        if self._balancer.epoch_complete:
            # Reset at the first step of the next epoch, not at the end of the last: a checkpoint
            # written in between must still hold the signs that decided the next order.
            self._start_balancing_epoch()
        gradients = self._gradients(batch).to(self._balancer.running_sum.dtype)
        if self._projection is not None:
            gradients = self._projection(gradients)
        differences = gradients[0::2] - gradients[1::2]  # (pairs, d)
        # Balance the previous step's differences (their gather had a whole step to arrive),
        # then send this step's. The order only matters at the epoch's end.
        self._balance_pending()
        if self.coordinated and self._comm is not None:
            before = self._comm.stats.bytes_sent
            self._pending = (self._comm.start_gather(differences, ORDER_SERVER, "protocol"), trainer.global_step)
            self.bytes_sent += self._comm.stats.bytes_sent - before
        else:
            self._balance(differences.unsqueeze(1), trainer.global_step)
        self.seconds += time.perf_counter() - start

    def _balance_pending(self) -> None:
        """Wait for the gather in flight, if any; the order server balances what it brought."""
        if self._pending is None:
            return
        pending, step = self._pending
        self._pending = None
        gathered = pending.wait()
        if gathered is not None:
            self._balance(gathered.transpose(0, 1), step)  # (ranks, pairs, d) -> pair-major

    def _sync_from_server(self) -> None:
        """Give every rank the order server's balancer state (broadcasts; a collective).

        Each rank's next order, the non-finite check and the checkpoint read it. Other ranks'
        balancers are not stepped during the epoch.
        """
        if self._comm is None or not self.coordinated:
            return
        assert self._balancer is not None and self._first_non_finite is not None
        before = self._comm.stats.bytes_sent
        counters = torch.cat([self._first_non_finite.new_tensor([self._balancer.pairs_done]), self._first_non_finite])
        for tensor in (self._balancer.signs, self._balancer.running_sum, counters):
            self._comm.broadcast_(tensor, ORDER_SERVER, "protocol")
        self._balancer.pairs_done = int(counters[0])
        self._first_non_finite = counters[1:].clone()
        self.bytes_sent += self._comm.stats.bytes_sent - before

    def _balance(self, differences: Tensor, step: int) -> None:
        """Feed ``(pairs, ranks, d)`` differences of ``step`` to the balancer."""
        assert self._balancer is not None and self._first_non_finite is not None
        # Checked at the epoch's end (reading a flag here would make every step wait for the
        # device); the step where a rank first went non-finite tells which rank started it.
        finite = torch.isfinite(differences).flatten(start_dim=2).all(dim=2).all(dim=0)
        newly = ~finite & (self._first_non_finite < 0)
        self._first_non_finite = torch.where(newly, step, self._first_non_finite)
        self._balancer.step(differences)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._balancer is None or self._sampler is None:
            return
        self._balance_pending()
        self._sync_from_server()
        self._raise_if_non_finite()
        self._install_next_order()
        self._epoch_ended = True
        for logger in trainer.loggers:
            logger.log_metrics(self.metrics(), step=trainer.global_step)

    def _start_balancing_epoch(self) -> None:
        """Balance the sampler's current epoch from now on: zero sum, no signs."""
        assert self._balancer is not None and self._sampler is not None
        self._balancer.start_epoch()
        self._balanced_epoch = self._sampler.epoch
        self._balanced_permutation = self._sampler.permutation

    def _install_next_order(self) -> None:
        assert self._balancer is not None and self._sampler is not None
        if self._balancer.epoch_complete:  # else stopped mid-epoch (max_steps): no next epoch to order
            self._sampler.install_next_order(self._balanced_epoch + 1, self._next_permutation(self._balanced_permutation))

    def _next_permutation(self, permutation: Tensor) -> Tensor:
        """The next epoch's order from this epoch's ``permutation`` and the balancer's signs."""
        assert self._balancer is not None
        row = self._rank if self.coordinated else 0
        return permutation[self._balancer.next_positions()[row].cpu()]

    def _raise_if_non_finite(self) -> None:
        assert self._first_non_finite is not None
        first = self._first_non_finite.cpu()
        if bool((first < 0).all()):
            return
        step = int(first[first >= 0].min())
        ranks = (first == step).nonzero().view(-1).tolist() if self.coordinated else [self._rank]
        raise FloatingPointError(
            f"CDGraB: non-finite per-example gradients on rank(s) {ranks} from step {step} on; the example orders "
            "cannot be balanced"
        )

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Peers may be gone: drop the gather in flight and keep the groups (no collective here).
        self._pending = None
        self._detach()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self._pending is not None:
            self._balance_pending()  # stopped mid-epoch (max_steps): let the last gather finish
        if self._comm is not None:
            self._comm.close()
        destroy_group(self._control_group)
        self._comm, self._control_group = None, None
        self._detach()

    def _detach(self) -> None:
        if self._loader_hook is not None:
            self._loader_hook.remove()
            self._loader_hook = None


def _module_per_example_loss(module: Any, batch: Any) -> Tensor:
    return module.per_example_loss(batch)


def _find_sampler(loader: object) -> CDGraBSampler:
    if not isinstance(loader, DataLoader):
        raise ValueError(f"CDGraB needs a torch.utils.data.DataLoader as train loader; got {type(loader).__name__}")
    for candidate in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
        if isinstance(candidate, CDGraBSampler):
            return candidate
    raise ValueError(
        "CDGraB needs the train loader to sample with lightning_dist.data.CDGraBSampler (it installs each epoch's "
        f"order there); got sampler {type(loader.sampler).__name__}"
    )


def _loader_batch_size(loader: DataLoader) -> Optional[int]:
    if loader.batch_size is not None:
        return loader.batch_size
    return getattr(loader.batch_sampler, "batch_size", None)
