"""Shared base of the local-update strategies: each rank trains its own replica.

Subclasses (periodic averaging, FedAvg, dynamic averaging) only say what happens after an
optimizer step; this class does the Lightning plumbing they share:

- no DistributedDataParallel wrapper, so there is no per-step gradient all-reduce;
- identical start: rank 0's weights are broadcast once;
- validation during fit sees the average of the replicas, and training resumes from each
  rank's own replica afterwards, so evaluating never changes the training trajectory;
- after ``fit`` every rank holds the average; checkpoints hold the average as ``state_dict``
  plus every rank's replica, optimizer state, RNG state and the protocol state, so a resumed
  run continues exactly where it stopped;
- a rank whose model turns non-finite stops the run, named, before anything is averaged;
- full synchronizations go a bucket at a time, never copying the model (the averaging half,
  :mod:`lightning_dist.strategies._averaging`; the checkpoint half is :mod:`lightning_dist.strategies._checkpoint`);
- every byte goes through ``lightning_dist.comm.Communicator`` and ``comm/*`` is logged.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer

from lightning_dist.algorithms.arguments import check_compression, check_hierarchy
from lightning_dist.algorithms.sparse_compression import SparseCodec
from lightning_dist.comm import CommStats, Communicator, check_timeout, new_group, restart_scoped_store
from lightning_dist.model_vector import ModelVector
from lightning_dist.strategies._averaging import ReplicaAveraging
from lightning_dist.strategies._checkpoint import ReplicaCheckpoints
from lightning_dist.strategies._fault_tolerance import ReplicaGroups
from lightning_dist.strategies._torchft_option import TorchFT
from lightning_dist.strategies._replica_windows import FaultTolerantWindows
from lightning_dist.strategies._fragment_exchange import FragmentExchange
from lightning_dist.strategies._hierarchy import NodeHierarchy


DEFAULT_TIMEOUT = timedelta(minutes=10)
"""The strategies' default bound on one collective (torch's is 30 minutes)."""


class LocalUpdateStrategy(ReplicaGroups, ReplicaAveraging, ReplicaCheckpoints, DDPStrategy):
    """Base for strategies that train one replica per rank and exchange models, not gradients.

    Args:
        seed: seeds the protocol's random choices (shared by all ranks, so every rank draws the
            same choices without exchanging them).
        compression: None (default): a full synchronization all-reduces the models in their dtype.
            ``"bf16"`` or ``"int8"``: it sends each replica's delta from the common model (the one
            all replicas held after the previous full synchronization) in that format, with error
            feedback, and every replica ends with the same model
            (:mod:`lightning_dist.algorithms.compression`): half or about a quarter of float32's
            bytes. A :class:`~lightning_dist.algorithms.sparse_compression.SparseCodec` sends each chunk's
            largest entries at a few bits (SparseLoCo's exchange: about a hundredth of float32's bytes at 2% and
            2 bits), so far with :class:`~lightning_dist.strategies.PeriodicAveragingStrategy`'s blocking
            synchronizations only (plain, DiLoCo, ``hierarchy="node"``). Validation, checkpoints and the end of
            ``fit`` still see the exact average.
        hierarchy: None (default): every rank is a learner. ``"node"``: the ranks of a node train one
            replica with DDP (gradients all-reduced inside the node every step) and the protocol runs
            between nodes, each of a node's ranks carrying its chunk of the model
            (:mod:`lightning_dist.strategies._hierarchy`). Nodes come from the cluster environment
            (torchrun, SLURM) and must all hold ``devices`` ranks.
        fault_tolerance: None (default): a failed rank ends the run. A :class:`~lightning_dist.strategies.TorchFT`:
            every replica group (a node with ``hierarchy="node"``, else one rank) is its own torchrun job, and the
            protocol runs between groups through torchft, so a lost group costs the others at most one window and a
            restarted one rejoins with the live state from a peer (:mod:`lightning_dist.strategies._fault_tolerance`).
            Strategies that do not support it refuse it by name.
        process_group_backend: ``"gloo"`` or ``"nccl"``; Lightning picks from the accelerator
            when None.
        timeout: how long a rank waits in one collective or transfer, Lightning's and this strategy's own process
            groups': a rank that failed, stopped or took another path makes the others raise
            :class:`~lightning_dist.comm.CollectiveError` naming the exchange within this time (on Gloo; NCCL's
            watchdog aborts the process instead). Default 10 minutes, not torch's 30; raise it where one
            synchronization of the model takes longer (a 1 GB float32 model crosses a 20 Mbit/s link in about 7
            minutes).
        start_method: how Lightning launches processes when it launches them itself.
    """

    def __init__(
        self,
        seed: int = 0,
        compression: str | SparseCodec | None = None,
        hierarchy: str | None = None,
        fault_tolerance: TorchFT | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=check_timeout(timeout),
            start_method=start_method,
        )
        self.seed = seed
        self.compression = check_compression(compression)
        # The codec of full synchronizations (a subclass without them, DownpourSGD, keeps its own and passes none).
        self._sync_codec = self.compression
        self._buckets: list[FragmentExchange] | None = None
        self.hierarchy = check_hierarchy(hierarchy)
        self._hierarchy: NodeHierarchy | None = None
        self.fault_tolerance = self.check_fault_tolerance(fault_tolerance)
        self._windows: FaultTolerantWindows | None = None
        self._joined: dict[str, Any] | None = None
        self._peer_checkpoint: dict[str, Any] | None = None
        self._heal: Any = None  # a heal's committed state on its way (fault_tolerance: _fault_tolerance.py)
        self._asked_for_state = False
        self._resume_data_position = False
        self._comm: Communicator | None = None
        self._vector: ModelVector | None = None
        self._generator = torch.Generator().manual_seed(seed)
        self._local_steps = 0
        self._syncs = 0
        self._replicas_in_sync = True
        self._evaluation_stash: Tensor | None = None
        self._summed_stats = CommStats()
        self._last_logged_step = -1
        self._shown_stats: CommStats | None = None

    # ------------------------------------------------------------------ set-up

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_processes

    def _configure_launcher(self) -> None:
        # Runs while the Trainer is built, before any process is launched.
        if self.fault_tolerance is not None:
            self.check_replica_group_layout()
        elif self.world_size < 2:
            raise ValueError(
                f"{type(self).__name__} averages models across processes and needs at least 2 "
                f"(devices * num_nodes >= 2); got devices={self.num_processes}, num_nodes={self.num_nodes}"
            )
        super()._configure_launcher()

    def setup_distributed(self) -> None:
        """Lightning's, except that under torchrun the default group's keys are private to the restart round.

        See :func:`lightning_dist.comm.restart_scoped_store`: without it a process group restarted
        by ``torchrun --max-restarts`` can read a dead process's address and fail to connect.
        """
        store = None if torch.distributed.is_initialized() else restart_scoped_store(self._timeout)
        if store is not None:
            self.set_world_ranks()
            device_id = self.root_device if self.root_device.type != "cpu" else None
            _init_dist_connection(self.cluster_environment, self._get_process_group_backend(),
                                  timeout=self._timeout, store=store, device_id=device_id)
        # Lightning's own steps; its _init_dist_connection finds the group made above and returns.
        super().setup_distributed()

    def setup_environment(self) -> None:
        super().setup_environment()
        # A group of our own: Lightning issues its own collectives on WORLD. The previous fit's
        # group stays usable until here (e.g. for ``trainer.save_checkpoint`` after ``fit``).
        if self._comm is not None:
            self._comm.close()
        if self._hierarchy is not None:
            self._hierarchy.close()
        self._comm = Communicator(new_group(backend=self._get_process_group_backend(), timeout=self._timeout),
                                  timeout=self._timeout)
        if self.fault_tolerance is not None:
            self._hierarchy = self.replica_group_hierarchy()
        elif self.hierarchy is not None:
            self._hierarchy = NodeHierarchy.create(
                self._comm, self.cluster_environment.node_rank(), self.num_processes, self.num_nodes,
                self._get_process_group_backend(), self._timeout, self.root_device)

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # Replicas are broadcast in setup; a checkpoint then overwrites them per rank.
        return True

    def configure_ddp(self) -> None:
        """Start every replica from rank 0's weights; wrap in DistributedDataParallel only inside a node (``hierarchy``)."""
        assert self.model is not None
        self._vector = ModelVector(self.model)
        vector = self._vector.get()
        self.comm.broadcast_(vector, src=0, purpose="setup")
        self._buckets = self.full_sync_buckets()
        self.set_common_model(vector)
        self.on_replicas_initialized(vector)
        if self.fault_tolerance is not None:
            self.join_replica_groups()
        if self.hierarchy is not None:
            self.model = self._hierarchy.wrap(self.model, self.determine_ddp_device_ids())

    @property
    def comm(self) -> Communicator:
        if self._comm is None:
            raise RuntimeError(f"{type(self).__name__} is not set up: its process group does not exist yet")
        return self._comm

    @property
    def model_vector(self) -> ModelVector:
        if self._vector is None:
            raise RuntimeError(f"{type(self).__name__} is not set up for fitting: it has no model vector yet")
        return self._vector

    @property
    def num_learners(self) -> int:
        """How many learners train: every rank, or one per node under a hierarchy, or the replica groups under
        ``fault_tolerance`` (known before set-up)."""
        if self.fault_tolerance is not None:
            return self.fault_tolerance.num_replica_groups
        return self.world_size if self.hierarchy is None else self.num_nodes

    @property
    def learners(self) -> Communicator:
        """The communicator among learners: every rank, or with ``hierarchy="node"`` this rank's slice group (the
        ranks of this local rank, one per node; its rank is the node's index), over which it carries its part of
        every model exchange (:meth:`learner_part`)."""
        return self.comm if self._hierarchy is None else self._hierarchy.inter_node

    def learner_part(self, vector: Tensor) -> Tensor:
        """The part of a model-sized ``vector`` this rank exchanges with other learners: all of it, or under a
        hierarchy its node chunk (``vector`` may be the parameters only, a reference model)."""
        return vector if self._hierarchy is None else self._hierarchy.part(vector, self.model_vector.numel)

    def learner_numel(self) -> int:
        """How many elements of the model vector :meth:`learner_part` holds."""
        if self._hierarchy is None:
            return self.model_vector.numel
        start, stop = self._hierarchy.own_bounds(self.model_vector.numel)
        return stop - start

    def learner_num_parameters(self) -> int:
        """How many of :meth:`learner_part`'s elements are parameters (the model vector's first ``num_parameters``)."""
        if self._hierarchy is None:
            return self.model_vector.num_parameters
        start, stop = self._hierarchy.own_bounds(self.model_vector.numel)
        return max(0, min(stop, self.model_vector.num_parameters) - start)

    def learner_whole(self, part: Tensor, purpose: str) -> Tensor:
        """The model whose :meth:`learner_part` this rank holds (under a hierarchy an all-gather inside the node)."""
        return part if self._hierarchy is None else self._hierarchy.whole(part, self.model_vector.numel, purpose)

    def learner_sum(self, value: float, purpose: str) -> float:
        """A learner's total of a quantity its ranks measured on their parts (under a hierarchy, summed in the node)."""
        return value if self._hierarchy is None else self._hierarchy.node_sum(value, self.root_device, purpose)

    # ------------------------------------------------------------ subclass API

    def on_replicas_initialized(self, vector: Tensor) -> None:
        """Called on every rank once all replicas equal ``vector`` (the common start model)."""

    def on_replicas_averaged(self, vector: Tensor) -> None:
        """Called on every rank once every replica was set to ``vector``, the consensus, outside the protocol
        (at the end of ``fit``)."""

    @abstractmethod
    def after_local_step(self, step: int) -> None:
        """The protocol: called on every rank after its ``step``-th optimizer step (1-based)."""

    def protocol_state_dict(self) -> dict[str, Any]:
        """Protocol state shared by all ranks (identical on every rank)."""
        return {}

    def load_protocol_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``protocol_state_dict`` returned."""

    def protocol_metrics(self) -> dict[str, float]:
        """Extra protocol counters to log next to ``comm/*``."""
        return {}

    def resized_protocol_state(self, state: Mapping[str, Any], written_by: int) -> Mapping[str, Any]:
        """``protocol_state_dict`` of a checkpoint written by ``written_by`` processes, for this world size.

        Called on every rank before :meth:`resized_worker_state`. Refused unless a strategy says how its
        protocol state carries over (every strategy of this package does; strategies/_resize.py).
        """
        raise ValueError(
            f"{type(self).__name__} cannot resume at another world size: it does not say how its protocol state "
            f"carries over (override resized_protocol_state); the checkpoint was written by {written_by} processes, "
            f"this run has {self.world_size} (devices * num_nodes)"
        )

    def worker_state_dict(self) -> dict[str, Any]:
        """Protocol state of this rank only (saved per rank, next to its replica)."""
        return {}

    def load_worker_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``worker_state_dict`` returned on this rank."""

    def resized_worker_state(self, saved: Sequence[Mapping[str, Any]], written_by: int) -> Mapping[str, Any]:
        """This rank's ``worker_state_dict`` from the ``written_by`` saved ranks' (``saved[k]`` is rank ``k``'s).

        Called when resuming at another world size, after the protocol state is loaded and while the
        replica holds the checkpoint's consensus. Empty by default: a rank's own protocol state is reset.
        """
        return {}

    def consensus(self, purpose: str) -> Tensor:
        """The one model every rank evaluates, checkpoints and ends ``fit`` with (a collective).

        The average of the replicas here (under ``fault_tolerance`` the last model the groups committed); a parameter
        server's global model in DownpourSGD.
        """
        if self._windows is not None:
            self.complete_heal()  # a healed group's committed model is the one its peer published
            return self._windows.anchor.to(self.root_device, copy=True)
        return self.average_all(purpose)

    # ------------------------------------------------------------ Lightning hooks

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._hierarchy is not None:  # a node is one learner, its BatchNorm statistics included
            self._hierarchy.share_buffers(self.model_vector.buffers)
        self._local_steps += 1
        self._replicas_in_sync = False
        self.after_local_step(self._local_steps)
        return output

    def on_train_start(self) -> None:
        super().on_train_start()
        self._shown_stats = None  # Lightning empties the progress bar's metrics at the start of every fit
        self.check_batches_per_rank(self.lightning_module.trainer)

    def check_batches_per_rank(self, trainer: pl.Trainer) -> None:
        """Refuse, on every rank, a fit whose ranks would not validate and finish together (a collective).

        Ranks meet in every averaging, every validation (the consensus) and at the end of ``fit``; a
        rank whose epoch ends early would pair its collectives with another rank's and hang or mix
        models. So every rank must run the same number of training batches per epoch (compared here:
        one all-gather of an integer) and decide to validate on the batch count, not on its own clock.
        """
        seconds = getattr(trainer, "_val_check_time_interval", None)
        if seconds is not None:
            raise ValueError(
                f"{type(self).__name__} does not support a time-based val_check_interval "
                f"(every {seconds:g} s): each rank would decide on its own clock when to validate, while "
                "validation averages the replicas, a collective; use a float or an int val_check_interval"
            )
        batches = trainer.num_training_batches
        local = torch.tensor([-1 if batches == float("inf") else int(batches)], dtype=torch.int64, device=self.root_device)
        counts = self.comm.all_gather(local, purpose="setup").view(-1).tolist()
        unsized = [rank for rank, count in enumerate(counts) if count < 0]
        if unsized:
            raise ValueError(
                f"{type(self).__name__} needs the same number of training batches per epoch on every rank, but the train "
                f"loader of rank(s) {unsized} has no length (an IterableDataset without __len__), so a rank whose data "
                "ends first could not be told from the others: define __len__ (the same on every rank) or set "
                "Trainer(limit_train_batches=<int>)"
            )
        if len(set(counts)) > 1:
            listing = ", ".join(f"rank {rank}: {count}" for rank, count in enumerate(counts))
            raise ValueError(
                f"{type(self).__name__} needs the same number of training batches per epoch on every rank (ranks meet "
                f"to average, validate and end fit); got unequal batches per rank ({listing}), e.g. from "
                "use_distributed_sampler=False with unequal shards: give every rank the same number of batches "
                "(Lightning's distributed sampler does) or set Trainer(limit_train_batches=<int>) to at most the smallest"
            )

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self.end_due_window()
        trainer = self.lightning_module.trainer
        if trainer.global_step != self._last_logged_step and trainer.global_step % trainer.log_every_n_steps == 0:
            self._last_logged_step = trainer.global_step
            self.log_progress()
        self.show_comm_stats()
        self.show_fault_tolerance()

    def log_progress(self) -> None:
        """Logging every ``log_every_n_steps`` during training: the summed counters (a collective)."""
        self.log_comm_stats()

    def show_comm_stats(self) -> None:
        """Show ``comm_stats`` (as of its last refresh) in the progress bar: ``comm_MB``, ``syncs``; no collective.

        ``LightningModule.log(prog_bar=True, logger=False)`` from this training hook is Lightning's public route to
        ``trainer.progress_bar_metrics``, which every progress bar shows; the loggers do not get these keys (they
        get ``comm/*``). Logged only when the counters were refreshed since last shown (the bar keeps the last
        value, and one ``log`` costs more than a small model's step), never without a progress bar. As float64 on
        the host: exact, and no device synchronization when Lightning reads the bar's values after every batch.
        """
        module = self.lightning_module
        if module.trainer.progress_bar_callback is None or self._summed_stats is self._shown_stats:
            return
        self._shown_stats = self._summed_stats
        self.show_in_progress_bar(self._summed_stats.progress_bar_metrics())

    def show_in_progress_bar(self, metrics: dict[str, float]) -> None:
        """``metrics`` in the progress bar only (``log(prog_bar=True, logger=False)`` from a training hook)."""
        for name, value in metrics.items():
            self.lightning_module.log(name, torch.tensor(value, dtype=torch.float64), prog_bar=True, logger=False,
                                      on_step=True, on_epoch=False, batch_size=1)

    def on_validation_start(self) -> None:
        super().on_validation_start()
        if self._is_fitting():
            self.end_due_window()
        if self._is_fitting() and not self._replicas_in_sync:
            self._evaluation_stash = self.model_vector.get()
            self.model_vector.set(self.consensus("evaluation"))

    def on_validation_end(self) -> None:
        super().on_validation_end()
        if self._evaluation_stash is not None:
            self.model_vector.set(self._evaluation_stash)
            self._evaluation_stash = None

    def on_train_end(self) -> None:
        super().on_train_end()
        self.end_due_window()
        if self._windows is not None and not (self._replicas_in_sync and self._windows.all_averaged):
            self.end_window("final")  # every group ends fit with a window of all (after FedAvg's round too)
        if not self._replicas_in_sync:
            consensus = self.consensus("final")
            self.set_common_model(consensus)
            self.on_replicas_averaged(consensus)
        self.mark_run_ended()
        self.log_comm_stats()

    def on_exception(self, exception: BaseException) -> None:
        # Other ranks may be blocked in a collective with us; tear the group down so they fail
        # fast instead of waiting for the timeout.
        super().on_exception(exception)
        if self._comm is not None:
            self._comm.close()
        if self._hierarchy is not None:
            self._hierarchy.close()

    def _is_fitting(self) -> bool:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return trainer is not None and trainer.state.fn == TrainerFn.FITTING and self._vector is not None

    # ------------------------------------------------------------ counters

    @property
    def comm_stats(self) -> CommStats:
        """Communication summed over all ranks, as of the last logging point (and end of fit)."""
        return self._summed_stats

    def refresh_comm_stats(self) -> CommStats:
        """Sum the counters over ranks now. A collective: call it on every rank at the same point."""
        self._summed_stats = self.sum_comm_stats()
        return self._summed_stats

    def sum_comm_stats(self) -> CommStats:
        """This rank's part of ``refresh_comm_stats`` (the collective that sums the counters)."""
        return self.comm.summed_stats(self._syncs, self.root_device)

    def log_comm_stats(self) -> None:
        """Sum the counters over ranks (a collective) and log them through the Trainer's loggers."""
        self.refresh_comm_stats()
        if self.is_global_zero:
            self.log_metrics({**self._summed_stats.metrics(), **self.protocol_metrics()})

    def log_metrics(self, metrics: dict[str, float]) -> None:
        """Send ``metrics`` to the Trainer's loggers at the current global step (no collective)."""
        trainer = self.lightning_module.trainer
        if trainer is not None:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
