"""DataGossip (paper 000, Dreher et al., EDBT 2022): exchange training records between ranks.

See :class:`DataGossip`. The selector math is in :mod:`lightning_dist.algorithms.selection`; the
loader that weaves foreign batches into the local ones is in ``_weaving.py``; records travel as
fixed-size byte rows (``_records.py``); the exchanges (select, all-gather, adopt, catch up) are in
``_exchange.py`` and the checkpoint state in ``_gossip_checkpoint.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import Tensor

from lightning_dist.algorithms.arguments import check_count, check_flag, check_number
from lightning_dist.algorithms.selection import (
    SELECTORS,
    SPL_GROWTH,
    SPL_INITIAL_THRESHOLD,
    LossHistory,
    spl_threshold,
)
from lightning_dist.callbacks._exchange import Exchange, GossipExchanges
from lightning_dist.callbacks._gossip_checkpoint import GossipCheckpoint
from lightning_dist.callbacks._loader_hook import TrainLoaderHook
from lightning_dist.callbacks._records import RecordCodec
from lightning_dist.callbacks._weaving import (
    FOREIGN,
    WovenLoader,
    check_train_loader,
    examples_per_epoch,
    local_pool,
    owned_records,
)
from lightning_dist.comm import check_timeout, destroy_group, new_group, strategy_timeout

_UNTAGGED = object()


class DataGossip(GossipExchanges, GossipCheckpoint, Callback):
    """Share a few training records between ranks after every epoch and train on them (paper 000).

    For skewed partitions (each rank holding a few classes), DataGossip lets every rank train on a
    small, changing sample of the other ranks' data. After each local epoch every rank selects
    ``records_per_exchange`` (``k``) of its records with a loss-based ``selector`` and all ranks
    exchange them by all-gather in a background thread; the records received replace the rank's
    foreign buffer. After every ``weave_every`` (``f``) local batches the rank trains on one batch
    of foreign records, inserted between local batches. It works with any strategy (``"ddp"``,
    ``"dynamic_avg"``, ``"downpour_sgd"``, ...) on two or more processes::

        trainer = L.Trainer(strategy="ddp", callbacks=[lightning_dist.DataGossip()])
        # fully asynchronous, as in the paper (asynchronous strategies only, see wait_for_exchange):
        trainer = L.Trainer(strategy="downpour_sgd", callbacks=[lightning_dist.DataGossip(wait_for_exchange=False)])

    **The one change to your LightningModule**: selectors rank records by their loss, so
    ``training_step`` must also return the per-example losses of the batch::

        per_example = F.cross_entropy(self(x), y, reduction="none")
        return {"loss": per_example.mean(), "per_example_loss": per_example.detach()}

    The DataModule needs no change. The train loader must be a ``torch.utils.data.DataLoader``
    over a map-style dataset with batching; records (what ``dataset[i]`` returns: tensors, numpy
    arrays or numbers, possibly in tuples, lists or dicts) must have the same shapes and dtypes on
    every rank. Foreign batches are batched with the loader's own ``collate_fn``.

    Args:
        records_per_exchange: ``k``, records each rank sends per exchange (paper default 5);
            between 1 and the size of the smallest local partition. Each rank receives
            ``k * (world_size - 1)`` records per exchange.
        weave_every: ``f``, local batches between two foreign batches (paper default 4, "a safe
            choice if the skew is unknown"; the paper recommends 1 for known skew). A foreign
            batch holds ``min(batch_size, k * (world_size - 1))`` records, cycling through the
            buffer in a shuffled order.
        selector: ``"active_bias"`` (paper default), ``"random"``, ``"hem"`` or ``"spl"``; see
            :mod:`lightning_dist.algorithms.selection`.
        spl_threshold: SPL's initial loss threshold (paper: 0.1).
        spl_growth: SPL's threshold growth factor per epoch (paper: 1.2).
        wait_for_exchange: True (default): the records selected after epoch ``e`` are trained
            on from epoch ``e + 1``; the exchange runs in the background while Lightning finishes
            epoch ``e`` (validation, checkpoints), and a rank waits at the start of ``e + 1`` only
            if it is still running. Every rank then trains the same number of batches in every
            epoch, which lockstep strategies need (ddp, dynamic_avg, periodic_avg: their per-step
            collectives must pair up), and runs and resumed runs are reproducible. With an
            asynchronous strategy a fast rank may wait there for the slowest rank's previous
            epoch end. False: the paper's fully asynchronous gossip: training never waits, each
            rank trains on new records from the first epoch that starts after they arrived, and
            a request while the previous exchange still runs is dropped. Ranks may then train
            different numbers of batches per epoch, so use it only with strategies that allow
            that (``downpour_sgd``); with lockstep strategies their collectives would get out of
            step and hang.
        seed: seeds each rank's selection and shuffling (with the rank, so ranks differ).
        timeout: timeout of the gossip process groups' operations; None (default): the strategy's
            ``timeout`` (torch's default for Gloo if the strategy has none).

    Attributes (this rank's):
        bytes_sent: record bytes this rank put on the wire: ``k * record_bytes * (world_size - 1)``
            per all-gather (a ring all-gather delivers each rank's rows to the others), including
            the replay of an in-flight exchange after a resume and the catch-up calls at the end.
        exchanges: exchanges started; ``dropped_exchanges``: requests dropped because the previous
            exchange was still running; ``catch_up_exchanges``: all-gathers issued at the end to
            even out the ranks' counts; ``foreign_batches``: foreign batches trained on.
        selected_indices: dataset indices of the records selected last.
        last_exchange_id, foreign_exchange_id: number (in this process, counted from 1) of the
            all-gather started last, and of the one whose records the foreign buffer holds.
        foreign_records, loss_history: the foreign buffer (decoded records) and the
            :class:`~lightning_dist.algorithms.selection.LossHistory`.

    The metrics ``gossip/bytes_sent``, ``gossip/exchanges``, ``gossip/dropped_exchanges``,
    ``gossip/foreign_batches``, ``gossip/foreign_records`` (and ``gossip/spl_threshold``) are
    logged through the Trainer's loggers after every epoch (rank 0's values with rank-zero
    loggers).

    How it fits into Lightning 2.6:

    - **Weaving.** Lightning builds the train loader in ``FitLoop.setup_data``: it requests it from
      the DataModule, injects a ``DistributedSampler`` where the loader has none, hands it to the
      strategy's ``process_dataloader`` hook, then measures its length and creates the first
      epoch's iterator. ``setup`` wraps that hook on the trainer's strategy (restored in
      ``teardown``), so DataGossip receives the fully prepared loader, before Lightning measures
      or iterates it, and returns a :class:`~lightning_dist.callbacks._weaving.WovenLoader`:
      a DataLoader over the same dataset, sampler, collate_fn and workers whose batch sampler
      records each batch's indices, and which inserts the foreign batches and counts them in its
      length. Lightning's sampler injection, ``set_epoch`` calls and samplers such as
      :class:`~lightning_dist.data.sampler.PartitionSampler` therefore work unchanged. Replacing
      the loader later (e.g. through ``CombinedLoader.flattened`` in ``on_train_start``) would
      be too late: Lightning creates the first epoch's iterator, and with worker processes
      already prefetches indices, inside ``setup_data``.
    - **Epoch length.** The foreign buffer changes only at epoch starts, so every epoch has a
      well-defined number of batches: local batches plus ``local // f`` foreign ones once records
      have arrived (none in the first epoch, as in the paper), the same on every rank with
      ``wait_for_exchange=True``. Lightning measures the train loader
      once per ``setup_data``; when the count changes (normally once, after the first exchange)
      ``on_train_epoch_start`` updates the fit loop's batch limit, ``num_training_batches`` and
      ``val_check_batch``, before Lightning creates that epoch's iterator.
    - **Exchanges and collective order.** Records travel over a dedicated Gloo group created in
      ``setup`` by all ranks, never WORLD (Lightning runs its own collectives there, and
      asynchronous strategies are not in lockstep); a second small Gloo group carries control
      traffic (set-up checks, the checkpoint gather, the final agreement). Collectives on a group
      must be issued the same number of times in the same order on every rank, but without
      waiting a dropped request makes ranks issue different numbers of all-gathers. So at the end
      of training
      (``on_train_end``) the ranks first agree, on the control group, on the largest number of
      all-gathers any rank issued; each rank then waits for its own exchange in flight and issues
      catch-up all-gathers until it reaches that number. Every rank issues its calls in order and
      each call completes once all ranks issued it, so all of them complete: no deadlock, and no
      thread left running. Pairing the n-th call of every rank also mid-training is harmless:
      whatever records a call carries are real records of that rank.
    - **Failures.** If training raises, ``on_exception`` issues no collective and does not wait
      for the exchange thread (a daemon): the other ranks may be gone. A rank whose peer died
      gets Gloo's "connection closed" error in its next collective and stops too.
    - **Checkpoints.** ``state_dict`` gathers every rank's state (loss history, selector RNG,
      foreign buffer, the payload of an exchange still in flight, counters) to rank 0, which
      writes the file; ``load_state_dict`` gives each rank its own part back when the loader is
      set up. An exchange in flight at the checkpoint is replayed on resume (all ranks re-send
      the same payloads) so that, with ``wait_for_exchange=True``, a resumed run continues
      exactly like the uninterrupted one. This holds for checkpoints written at the end of an
      epoch (``ModelCheckpoint``'s default when validation runs once per epoch); Lightning itself
      cannot resume the middle of an epoch exactly with a DataLoader that has no state.
    - **Resuming at another world size.** A checkpoint written by ``m`` processes resumes with
      ``m' != m``: each rank keeps the loss history of the records it now owns, taken from all
      saved ranks' histories: with a fixed partition (a sampler with a ``part``, as
      :class:`~lightning_dist.data.sampler.PartitionSampler`, rebuilt for ``m'`` ranks) the saved
      entries of exactly its new part, unchanged; with a sampler that deals out a fresh split every
      epoch, where every rank reads every record over the epochs, all records' (a record several
      ranks trained on gets the statistics of all its losses,
      :func:`~lightning_dist.algorithms.selection.merge_histories`). The foreign buffers and the
      exchange in flight are dropped (selected for the old ranks, and an all-gather of ``m``
      ranks cannot be replayed by ``m'``), so the first epoch after the resume trains on local
      records only, like a run's first epoch, and exchanges start again at its end. A rank that
      existed keeps its selector RNG, a new rank starts from its seed; the counters are kept in
      total (rank 0 takes those of ranks that went away). ``_gossip_checkpoint.resized_rank_state``.
    """

    def __init__(
        self,
        records_per_exchange: int = 5,
        weave_every: int = 4,
        selector: str = "active_bias",
        spl_threshold: float = SPL_INITIAL_THRESHOLD,
        spl_growth: float = SPL_GROWTH,
        wait_for_exchange: bool = True,
        seed: int = 0,
        timeout: Optional[timedelta] = None,
    ) -> None:
        super().__init__()
        self.records_per_exchange = check_count("records_per_exchange", records_per_exchange, 1)
        self.weave_every = check_count("weave_every", weave_every, 1)
        if selector not in SELECTORS:
            raise ValueError(f"selector must be one of {SELECTORS}; got {selector!r}")
        self.selector = selector
        self.spl_threshold = check_number("spl_threshold", spl_threshold, 0.0, strict=True)
        self.spl_growth = check_number("spl_growth", spl_growth, 1.0, strict=False)
        self.wait_for_exchange = check_flag("wait_for_exchange", wait_for_exchange)
        self.seed = check_count("seed", seed, 0)
        self.timeout = check_timeout(timeout)

        # Checkpointed, per rank.
        self.bytes_sent = 0
        self.exchanges = 0
        self.dropped_exchanges = 0
        self.foreign_batches = 0
        self.catch_up_exchanges = 0
        self.selected_indices: Optional[Tensor] = None
        self._history: Optional[LossHistory] = None
        self._generator = torch.Generator()
        self._seeded_rank: Optional[int] = None
        self._foreign_rows: Optional[Tensor] = None
        self._foreign_records: list[Any] = []
        self._foreign_order = torch.zeros(0, dtype=torch.int64)
        self._foreign_position = 0
        self._last_payload: Optional[Tensor] = None

        # Per process (not checkpointed).
        self._rank = 0
        self._world_size = 1
        self._data_group: Optional[dist.ProcessGroup] = None
        self._control_group: Optional[dist.ProcessGroup] = None
        self._calls = 0  # all-gathers issued on the current data group
        self._inflight: Optional[Exchange] = None
        self._received: Optional[tuple[int, Tensor]] = None  # finished exchange not adopted yet
        self._loaded_state: Optional[dict[str, Any]] = None
        self._codec: Optional[RecordCodec] = None
        self._pool: Optional[Tensor] = None
        self._woven: Optional[WovenLoader] = None
        self._tag: Any = _UNTAGGED
        self._unrecorded: list[tuple[Tensor, Tensor]] = []
        self._loader_hook: Optional[TrainLoaderHook] = None
        self._drained = False
        self._abandoned = False
        self.last_exchange_id: Optional[int] = None
        self.foreign_exchange_id: Optional[int] = None

    # ------------------------------------------------------------------ public read-only views

    @property
    def loss_history(self) -> Optional[LossHistory]:
        """This rank's loss history (None before the train loader is set up), up to date."""
        self._record_losses()
        return self._history

    @property
    def foreign_records(self) -> list[Any]:
        """The foreign records this rank currently trains on (other ranks' selections, in rank order)."""
        return list(self._foreign_records)

    @property
    def has_foreign_records(self) -> bool:
        return bool(self._foreign_records)

    def metrics(self) -> dict[str, float]:
        """This rank's ``gossip/*`` counters, as logged."""
        out = {
            "gossip/bytes_sent": float(self.bytes_sent),
            "gossip/exchanges": float(self.exchanges),
            "gossip/dropped_exchanges": float(self.dropped_exchanges),
            "gossip/foreign_batches": float(self.foreign_batches),
            "gossip/foreign_records": float(len(self._foreign_records)),
        }
        if self.selector == "spl" and self._history is not None:
            epoch = max(self._history.epochs_completed - 1, 0)
            out["gossip/spl_threshold"] = spl_threshold(epoch, self.spl_threshold, self.spl_growth)
        return out

    # ------------------------------------------------------------------ set-up

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            raise ValueError(
                "DataGossip exchanges records between processes and needs a distributed run with at least 2 "
                f"processes (devices * num_nodes >= 2); got world size {world}"
            )
        if is_param_in_hook_signature(pl_module.training_step, "dataloader_iter", explicit=True):
            raise ValueError(
                "DataGossip needs training_step(batch, batch_idx): with training_step(dataloader_iter) it cannot "
                "tell which examples a step trained on"
            )
        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        # Created by every rank, in the same order as any other group (setup runs on all ranks).
        # The previous fit's control group served its checkpoints until now.
        destroy_group(self._control_group)
        timeout = self.timeout if self.timeout is not None else strategy_timeout(trainer.strategy)
        self._data_group = new_group(backend="gloo", timeout=timeout)
        self._control_group = new_group(backend="gloo", timeout=timeout)
        self._calls = 0
        self._inflight = None
        self._received = None
        self._woven = None
        self._tag = _UNTAGGED
        self._unrecorded = []
        self._drained = False
        self._abandoned = False
        if self._seeded_rank != self._rank:
            self._generator.manual_seed(_rank_seed(self.seed, self._rank))
            self._seeded_rank = self._rank
        self._loader_hook = TrainLoaderHook(trainer, lambda loader: self._weave(trainer, loader))

    def _restore_strategy(self) -> None:
        if self._loader_hook is not None:
            self._loader_hook.remove()
            self._loader_hook = None

    def _weave(self, trainer: pl.Trainer, loader: object) -> WovenLoader:
        """Wrap Lightning's prepared train loader; runs on every rank inside ``FitLoop.setup_data``."""
        source = check_train_loader(loader)
        dataset = source.dataset
        self._pool = local_pool(source)
        partition = len(self._pool) if self._pool is not None else examples_per_epoch(source)
        first = int(self._pool[0]) if self._pool is not None and len(self._pool) else 0
        codec = RecordCodec(dataset[first])
        # Checked on every rank with every rank's numbers, so all ranks raise the same error.
        infos: list[Any] = [None] * self._world_size
        dist.all_gather_object(infos, (partition, codec.describe(), len(dataset)), group=self._control_group)
        smallest = min(info[0] for info in infos)
        if self.records_per_exchange > smallest:
            rank = min(range(self._world_size), key=lambda r: infos[r][0])
            raise ValueError(
                f"records_per_exchange must be between 1 and {smallest} (the examples in the smallest local "
                f"partition, on rank {rank}); got {self.records_per_exchange}"
            )
        if len({info[1] for info in infos}) > 1:
            formats = "; ".join(f"rank {r}: {info[1]}" for r, info in enumerate(infos))
            raise ValueError(
                "DataGossip needs foreign records with the structure, shapes and dtypes of local ones, but the "
                f"ranks' training records differ: {formats}"
            )
        if self._history is None or self._history.num_records != len(dataset):
            self._history = LossHistory(len(dataset))
            self._foreign_rows, self._foreign_records = None, []
        self._codec = codec
        woven = WovenLoader(source, self)
        if woven.num_local_batches < self.weave_every:
            rank_zero_warn(
                f"DataGossip(weave_every={self.weave_every}) exceeds the {woven.num_local_batches} local batches per "
                "epoch: no foreign batch will be trained on"
            )
        if self._loaded_state is not None:
            self._restore(self._loaded_state, owned_records(source))
            self._loaded_state = None
        self._woven = woven
        return woven

    # ------------------------------------------------------------------ training hooks

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._woven is None:
            return
        self._adopt_arrived(wait=self.wait_for_exchange)
        self._sync_epoch_length(trainer)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._woven is None:
            return
        if not self._woven.tags:
            raise RuntimeError("DataGossip: a training batch did not come from its train loader")
        self._tag = self._woven.tags.popleft()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        tag, self._tag = self._tag, _UNTAGGED
        if tag is _UNTAGGED or self._history is None:
            return
        if tag is FOREIGN:
            self.foreign_batches += 1  # foreign losses are not recorded: the records belong to other ranks
            return
        losses = _per_example_losses(outputs, len(tag), manual=not pl_module.automatic_optimization)
        if losses is not None:
            # Kept on the device until the epoch ends: copying to the host here would make every
            # step wait for the accelerator.
            self._unrecorded.append((torch.tensor(tag, dtype=torch.int64), losses))

    def _record_losses(self) -> None:
        """Move the losses collected since the last call into the loss history, in training order."""
        if self._unrecorded and self._history is not None:
            indices = torch.cat([indices for indices, _ in self._unrecorded])
            losses = torch.cat([losses.reshape(-1) for _, losses in self._unrecorded]).cpu()
            self._history.record(indices, losses)
        self._unrecorded = []

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._woven is None or self._history is None:
            return
        self._record_losses()
        self._history.end_epoch()
        if _is_last_epoch(trainer):
            pass  # nobody would train on what an exchange now brings
        elif self._inflight is not None and not self._inflight.done.is_set():
            self.dropped_exchanges += 1  # paper 000: a signal during a running exchange is ignored
        else:
            self._start_exchange()
        metrics = self.metrics()
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._drain()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Other ranks may be dead or stuck: no collective, no join. The exchange thread is a daemon
        # and errors out when its peers' connections close.
        self._abandoned = True
        self._restore_strategy()
        self._woven = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not self._abandoned:
            self._drain()  # fit ended without on_train_end (e.g. no training batches at all)
        self._restore_strategy()
        self._woven = None

    # ------------------------------------------------------------------ foreign batches

    def next_foreign_batch(self, collate_fn: Callable[[list[Any]], Any], batch_size: Optional[int]) -> Any:
        """The next ``min(batch_size, buffer size)`` foreign records, collated; cycles through the buffer."""
        count = len(self._foreign_records)
        size = count if batch_size is None else min(batch_size, count)
        positions = [(self._foreign_position + j) % count for j in range(size)]
        self._foreign_position = (self._foreign_position + size) % count
        return collate_fn([self._foreign_records[int(self._foreign_order[p])] for p in positions])

    def _sync_epoch_length(self, trainer: pl.Trainer) -> None:
        """Tell the fit loop how many batches this epoch has (the foreign batches may have appeared)."""
        loop = trainer.fit_loop
        combined = getattr(loop, "_combined_loader", None)
        if combined is None or not hasattr(loop, "max_batches"):
            raise RuntimeError(
                "DataGossip cannot find the fit loop's train loader (FitLoop._combined_loader); it is tested with "
                "Lightning 2.6 and this Lightning version changed its internals"
            )
        flattened = combined.flattened
        if len(flattened) != 1 or flattened[0] is not self._woven:
            raise ValueError(f"DataGossip supports exactly one train dataloader; got {len(flattened)}")
        assert self._woven is not None
        length = len(self._woven)
        limit = trainer.limit_train_batches
        # Lightning's own rule (_parse_num_batches): an int caps the batches, a float is a fraction.
        batches = min(length, limit) if isinstance(limit, int) else int(length * limit)
        if batches == loop.max_batches:
            return
        combined.limits = [batches]
        loop.max_batches = batches
        if getattr(trainer, "_val_check_time_interval", None) is None and isinstance(trainer.val_check_interval, float):
            trainer.val_check_batch = max(1, int(batches * trainer.val_check_interval))


# ---------------------------------------------------------------------------------------- helpers


def _per_example_losses(outputs: Any, batch_size: int, manual: bool = False) -> Optional[Tensor]:
    """The per-example losses in a training step's outputs; None for a step Lightning skipped.

    With manual optimization there are no skipped steps (``training_step`` returning None is the
    norm there), so missing losses are an error: the selector would never see a loss.
    """
    recipe = (
        "DataGossip ranks training records by their loss: training_step must return the batch loss and the "
        "per-example losses, e.g. per_example = F.cross_entropy(logits, y, reduction='none'); "
        "return {'loss': per_example.mean(), 'per_example_loss': per_example.detach()}"
    )
    if outputs is None:
        return None
    if not isinstance(outputs, Mapping):
        raise ValueError(f"{recipe}; got outputs of type {type(outputs).__name__}")
    if "per_example_loss" not in outputs:
        if outputs.get("loss") is None and not manual:
            return None  # training_step returned None: Lightning skipped the step
        manual_note = ", with manual optimization" if manual else ""
        raise ValueError(f"{recipe}; got outputs with keys {sorted(outputs)} (no 'per_example_loss'{manual_note})")
    losses = torch.as_tensor(outputs["per_example_loss"]).detach().reshape(-1)
    if losses.numel() != batch_size:
        raise ValueError(
            f"per_example_loss must hold one loss per example of the batch ({batch_size}); got {losses.numel()}"
        )
    return losses.float()


def _is_last_epoch(trainer: pl.Trainer) -> bool:
    max_epochs = trainer.max_epochs
    if max_epochs is not None and max_epochs >= 0 and trainer.current_epoch + 1 >= max_epochs:
        return True
    return trainer.max_steps is not None and trainer.max_steps >= 0 and trainer.global_step >= trainer.max_steps


def _rank_seed(seed: int, rank: int) -> int:
    return int(np.random.SeedSequence([seed, rank]).generate_state(1, dtype=np.uint64)[0] >> 1)
