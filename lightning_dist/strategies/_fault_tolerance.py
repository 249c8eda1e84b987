"""``fault_tolerance``: a lost replica group costs at most one synchronization window, not a restart.

Each replica group (a node under ``hierarchy="node"``, else a single rank) is its own torchrun job; a torchft
Lighthouse, started once, forms a quorum of the healthy groups at the end of every window
(:mod:`lightning_dist.comm.quorum`). Inside a group nothing changes (DDP under a hierarchy); between groups a
window ends as torchft's DiLoCo ends one (``torchft/local_sgd.py``), in this package's buckets:

1. **Quorum.** The healthy groups meet; a group that is behind (new, restarted, or whose last commit failed)
   receives the small part of an up-to-date peer's state right there (:meth:`ReplicaGroups.recovery_state`): the
   counters, the random generators and, for a group joining at the start of its ``fit``, Lightning's loops and
   schedulers (and its data's position in the epoch). The peer's state wins over a ``ckpt_path`` the job was
   started with.
2. **Exchange.** Every group that was not healed in this quorum or the one before contributes its replica; a
   healed one sends zeros and the mean divides by the contributors only. Each bucket's mean is written into the
   model as it arrives (no copy of the model on the device).
3. **Commit or roll back.** torchft's ``should_commit``: if the exchange completed on every rank of the group with
   at least ``min_replicas`` groups, DiLoCo's outer step runs from the mean and the result becomes the new
   committed model (the *anchor*, kept on the host as torchft keeps its backup); otherwise the model returns to
   the anchor and the window is discarded, said in the log. A group whose commit failed while others committed
   is behind, and is healed at the next quorum.

The window itself is :class:`~lightning_dist.strategies._replica_windows.FaultTolerantWindows`. FedAvg
(``client_fraction < 1``) draws each window's groups among those that contribute; the drawn ones average, the
others keep their replicas, and each group's committed model is its own. With ``compression`` every window but the
run's first sends compressed deltas from the committed model (residuals restored when a window is discarded,
chunks cut anew when the groups change).

**Heal outside the window.** The bulk of a healed group's state (the committed model, the protocol's state:
DiLoCo's outer momentum, and the optimizer state) never crosses inside the others' window: the peer publishes its
committed state once that window is committed (:meth:`ReplicaGroups.committed_state`), and the healed group's local
rank 0 fetches it in the background while every group trains the next window, over
:mod:`lightning_dist.comm.peer_state` (holders of the run's secret only; tensors and plain values only). The healed
group trains that window too (from the model it has, to keep Lightning's counters, schedulers and data in step with
the others) and sends zeros at its end, where it takes the fetched state first (:meth:`ReplicaGroups.complete_heal`)
and commits the window's outer step as every group does: from the next window on it contributes. The others wait
for it only if the fetch takes longer than their window. A fetch that fails has the group healed again at the next
quorum.

A group that dies inside a window is simply absent from the next quorum (its heartbeat stops), and the others
average without it: its window is the only work lost. A group that dies inside the exchange makes the exchange
fail for the others, which roll back that one window.

Validation and checkpoints between windows see the anchor, the last model every group agreed on (a consensus
over groups outside a window would be a collective the groups do not meet for); at a window's end that is the
average, as without the option (under FedAvg, the group's own committed model).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning.fabric.utilities.optimizer import _optimizer_to_device

from lightning_dist.algorithms.outer import OuterStep
from lightning_dist.comm import Communicator, new_group
from lightning_dist.comm.communicator import HOST
from lightning_dist.comm.nodes import NodeLayout
from lightning_dist.comm.quorum import (
    QuorumCommunicator,
    mark_ended,
    run_at_lighthouse,
    run_replica_prefix,
    torchft_manager,
    wait_for_lighthouse,
)
from lightning_dist.data.resume import start_at_batch
from lightning_dist.strategies._checkpoint import (
    CHECKPOINT_KEY,
    pack_replica,
    restore_rng_states,
    rng_states,
    unpack_replica,
)
from lightning_dist.strategies._fragment_exchange import Lanes
from lightning_dist.strategies._hierarchy import NodeHierarchy
from lightning_dist.strategies._outer import OUTER_KEY
from lightning_dist.strategies._replica_windows import FaultTolerantWindows, Select
from lightning_dist.strategies._torchft_option import TorchFT, run_tag

log = logging.getLogger(__name__)


FAULT_TOLERANCE_KEY = "fault_tolerance"
"""Where the option's state sits in ``protocol_state_dict``."""

JOIN_RETRY_S = 1.0
"""How long a group whose join at set-up did not hold waits before it asks for the next quorum."""

HEAL_ON_RANK_0 = object()
"""A heal pending on a rank other than the job's rank 0, which fetches the committed state for all of them."""


def lightning_training_state(trainer: pl.Trainer) -> dict[str, Any]:
    """What a group joining in the middle of a run takes from a peer besides the model and the protocol: the fit
    loop's progress and the learning-rate schedulers (Lightning's own checkpoint keys)."""
    return {"loops": {"fit_loop": trainer.fit_loop.state_dict()},
            "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
            "epoch": trainer.current_epoch, "global_step": trainer.global_step}


def joined_checkpoint(trainer: pl.Trainer, received: Mapping[str, Any]) -> dict[str, Any]:
    """A checkpoint in Lightning's format for the joining group's restore after set-up: its model as it is now and
    the peer's loops and schedulers (the optimizer state follows with the committed state: no restore of it)."""
    module = trainer.lightning_module
    return {"state_dict": module.state_dict(), "pytorch-lightning_version": pl.__version__, **received}


def on_host(state: Any) -> Any:
    """``state`` with every tensor copied to the host (what a peer sends must not change while it is sent)."""
    return apply_to_collection(state, Tensor, lambda tensor: tensor.detach().to("cpu", copy=True))


class ReplicaGroups:
    """``fault_tolerance`` in :class:`~lightning_dist.strategies.local_update.LocalUpdateStrategy`: mixed in ahead
    of its averaging; every method is a no-op or refusal without the option.

    A strategy that supports the option sets ``supports_fault_tolerance`` and ends its windows with
    :meth:`end_window`; the others refuse it by name when built.
    """

    supports_fault_tolerance = False
    fault_tolerance_unsupported = ""
    """What the strategy's refusal of ``fault_tolerance`` adds (why, or what it would take)."""

    def check_fault_tolerance(self, option: TorchFT | None) -> TorchFT | None:
        """``option`` if it is None, or a :class:`TorchFT` this strategy supports."""
        if option is None:
            return None
        if not isinstance(option, TorchFT):
            raise ValueError(f"fault_tolerance must be None or a lightning_dist.strategies.TorchFT; got {option!r}")
        if not self.supports_fault_tolerance:
            raise ValueError(f"{type(self).__name__} does not support fault_tolerance{self.fault_tolerance_unsupported}")
        return option

    def check_replica_group_layout(self) -> None:
        """Before launch: a job is one replica group, so it runs on one node, and without a hierarchy on one rank."""
        if self.num_nodes != 1:
            raise ValueError(
                f"fault_tolerance makes every replica group its own torchrun job on one node; got num_nodes="
                f"{self.num_nodes} (launch one job per node, each with TorchFT(replica_group=...) or REPLICA_GROUP_ID)"
            )
        if self.hierarchy is None and self.num_processes != 1:
            raise ValueError(
                f"fault_tolerance with hierarchy=None makes every rank a replica group, its own job of one process; "
                f"got devices={self.num_processes} (use hierarchy='node' for DDP among a group's ranks)"
            )
        self.fault_tolerance.check_environment()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Under ``fault_tolerance`` group ``g``'s ranks read shard ``g`` of ``num_replica_groups`` (each rank its
        part of it), as the ranks of node ``g`` would in one job; otherwise Lightning's."""
        if self.fault_tolerance is None:
            return super().distributed_sampler_kwargs  # type: ignore[misc]
        ranks = self.num_processes
        return {"num_replicas": self.fault_tolerance.num_replica_groups * ranks,
                "rank": self.fault_tolerance.group() * ranks + self.global_rank}

    def replica_group_hierarchy(self) -> NodeHierarchy:
        """The job's ranks as one node whose ``inter_node`` is torchft's quorum (every rank its own Manager, its
        chunk of the model exchanged with the same local rank of the other groups)."""
        option = self.fault_tolerance
        assert option is not None
        group = option.group()
        wait_for_lighthouse(option.lighthouse_address(), option.timeout)
        layout = NodeLayout((tuple(range(self.comm.world_size)),))
        node = Communicator(new_group(backend=self._get_process_group_backend(), timeout=self._timeout),
                            "intra_node", counted_by=self.comm)
        from lightning_dist.comm.peer_state import run_secret

        secret = run_secret()
        tag = run_tag(secret)
        make_manager = partial(
            torchft_manager, group_rank=self.comm.rank, group_world_size=self.comm.world_size,
            replica_id=f"{run_replica_prefix(tag)}{group}", lighthouse=option.lighthouse_address(),
            min_replicas=option.min_replicas, timeout=option.timeout, quorum_timeout=option.quorum_timeout,
            state_dict=self.recovery_state, load_state_dict=self.load_recovery_state, secret=secret,
            bind_address=option.bind_address)
        return NodeHierarchy(layout, node, QuorumCommunicator(make_manager, self.comm, option.timeout, group,
                                                             option.num_replica_groups, tag))

    def join_replica_groups(self) -> None:
        """The first window, at set-up: every group meets the others (a fresh run: the mean of the groups' start
        models; a restarted group: the live state of a peer once the others end their window). A group joining a run
        in progress has Lightning restore the peer's loops, schedulers and optimizer state after set-up, as from a
        checkpoint, and wins over a ``ckpt_path`` file (:meth:`load_checkpoint`).

        The join holds only if this group was healed from a peer, or if every group of the run took part (a fresh
        start, or every group resumed from its own file). Otherwise it is tried again at the next quorum, before
        training starts: groups restarted together form a quorum of their own while the live ones are inside a
        window, and committing there would have them train from their start models and count their steps from
        zero. A join whose window is discarded (another group lost inside it, or the peer's state never arrived) is
        tried again likewise: only at set-up can Lightning take a peer's loops. Tries end after ``quorum_timeout``."""
        assert self._hierarchy is not None
        assert self._buckets is not None  # made at set-up: the job always has a hierarchy
        option = self.fault_tolerance
        assert option is not None
        self._windows = FaultTolerantWindows(self.model_vector, Lanes(self.comm, self._hierarchy), self._buckets, HOST,
                                             lambda: self.raise_unless_finite(self.model_vector.all_finite()),
                                             self.group_any, option.max_retries)
        self._peer_checkpoint = None
        self._resume_data_position = False
        deadline = time.monotonic() + option.quorum_timeout.total_seconds()
        quorum = self._windows.quorum
        tries, ended_since = 0, None
        # should_commit's answer and whether any rank was healed (group_any in the window) are the same on every rank
        # of the job; the quorum's size is each rank's Manager's, so whether it was short is agreed (group_any).
        while not (self.end_window("setup") and (quorum.healed or not self.group_any(
                quorum.membership.groups != option.num_replica_groups))):
            reason = ("its window was discarded" if not self._windows.last_committed else
                      f"only {quorum.membership.groups} of {option.num_replica_groups} groups met and none was ahead")
            if self.group_any(time.monotonic() > deadline):
                raise RuntimeError(f"replica group {quorum.group} could not join the run within quorum_timeout "
                                   f"({option.quorum_timeout}): {reason} (a fresh run starts with every group; a "
                                   f"restarted group joins a live one)")
            ended = self.ended_run() if self.comm.rank == 0 else None  # the Lighthouse read once for the job
            ended_since = None if ended is None else ended_since or time.monotonic()
            if self.group_any(ended is not None and time.monotonic() - ended_since >= option.timeout.total_seconds()):
                raise RuntimeError(
                    f"replica group {quorum.group} was started again after its run ended: "
                    + (f"the run's groups ended their fit at step {ended} (their mark at the Lighthouse "
                       f"{option.lighthouse_address()}) and none of them is alive, so there is nothing to join; the "
                       f"run's final model is in their checkpoints. A new run of the same length that reuses this "
                       f"run's secret at this Lighthouse needs a secret of its own" if ended is not None else
                       "see the job's rank 0"))
            if tries % 60 == 0:  # the first, then about once a minute
                log.warning("lightning_dist: replica group %d: its join did not hold (%s); joining at the next window",
                            quorum.group, reason)
            tries += 1
            quorum.fall_behind()
            # The groups that met will meet again at once (torchft's fast quorum): wait for the others' window.
            time.sleep(JOIN_RETRY_S)
        joined, self._joined = self._joined, None
        if quorum.healed and joined is not None:
            self._syncs += 1  # the window it joined in, which the peer counts once it has ended it
            if joined["training"] is not None and joined["training"]["global_step"] > 0:
                trainer = self.lightning_module.trainer
                self._peer_checkpoint = joined_checkpoint(trainer, joined["training"])
                trainer._checkpoint_connector._loaded_checkpoint = self._peer_checkpoint
                self._resume_data_position = True

    def ended_run(self) -> int | None:
        """The step this run ended at if it has ended: its groups left their mark at the Lighthouse when their
        ``fit`` ended (:meth:`mark_run_ended`) at a step this trainer would not go past, and no other group of the
        run heartbeats. None otherwise, or if the Lighthouse's status cannot be read (the join then waits up to
        ``quorum_timeout``, as for a run in progress). The join fails once this has held for the option's
        ``timeout``: the groups of a new run that reuses a finished run's secret at its Lighthouse, with no larger
        ``max_steps``, must start within it of each other."""
        option = self.fault_tolerance
        assert option is not None and self._windows is not None
        run = run_at_lighthouse(option.lighthouse_address(), self._windows.quorum.run_tag,
                                option.timeout.total_seconds())
        if run is None or run.ended_at_step is None or run.live_groups - {option.group()}:
            return None
        max_steps = self.lightning_module.trainer.max_steps
        return None if 0 <= max_steps and run.ended_at_step < max_steps else run.ended_at_step

    def mark_run_ended(self) -> None:
        """At the end of ``fit`` (this group's last window is over), leave the mark :meth:`ended_run` reads: a
        group started again after the others ended fails at once, naming why, instead of waiting
        ``quorum_timeout`` for a quorum nobody will join. From the job's rank 0; a Lighthouse that is gone by
        now is only logged."""
        option = self.fault_tolerance
        if option is None or self._windows is None or self.comm.rank != 0:
            return
        step = self.lightning_module.trainer.global_step
        try:
            mark_ended(option.lighthouse_address(), self._windows.quorum.run_tag, step, option.timeout)
        except (RuntimeError, OSError) as error:  # torchft's client raises RuntimeError when it cannot connect
            log.warning("lightning_dist: replica group %d could not mark the run ended at step %d at the "
                        "Lighthouse: %s", option.group(), step, error)

    @property
    def lightning_restore_optimizer(self) -> bool:
        """Lightning's, but not while a heal's committed state is on its way: the optimizer state comes with it
        (a ``ckpt_path`` file's is older)."""
        return self._heal is None and super().lightning_restore_optimizer  # type: ignore[misc]

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's, except for a group that joined a run in progress at this ``fit``'s set-up: its peer's live
        state is newer than any file it was started with (``fit(ckpt_path=...)``, e.g. the ``last`` of a restarted
        job), so the peer's loops and schedulers win, and the model and optimizer state come with the peer's
        committed state; the file gives the rest (callbacks' state, the data module's), its replicas and protocol
        state are dropped."""
        saved = super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # type: ignore[misc]
        peer, self._peer_checkpoint = self._peer_checkpoint, None
        if peer is None:
            return saved
        log.warning("lightning_dist: replica group %d joined a run in progress: its peer's state (step %d) wins over "
                    "%s (step %s)", self.fault_tolerance.group(), peer["global_step"], checkpoint_path,
                    saved.get("global_step"))
        return {**{key: value for key, value in saved.items() if key != CHECKPOINT_KEY}, **peer}

    def process_dataloader(self, dataloader: object) -> object:
        """Lightning's, and for a group that joined a run in progress the train loader starts at the peer's batch
        of the epoch (:func:`~lightning_dist.data.resume.start_at_batch`): Lightning restores the peer's count
        but would read the group's shard from the epoch's start, its first batches twice and its last never."""
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        trainer = self.lightning_module.trainer
        if not (self._resume_data_position and trainer.training):
            return dataloader
        self._resume_data_position = False
        batch = trainer.fit_loop.epoch_loop.batch_progress.current.completed
        if not start_at_batch(dataloader, batch):
            log.warning("lightning_dist: replica group %d joined at batch %d of epoch %d, but its train loader "
                        "batches without torch's BatchSampler: it reads its shard from the epoch's start",
                        self.fault_tolerance.group(), batch, trainer.current_epoch)
        return dataloader

    def window_due(self) -> bool:
        """Whether this rank's window has ended and not yet been synchronized (the same on every rank: a count of
        optimizer steps)."""
        return False

    def end_due_window(self) -> None:
        """End the window that is due, if any: at the start of the next batch, before validation, or at the end of
        ``fit``. Not inside the optimizer step that ends it: there Lightning has not yet counted that step, its
        batch or its learning-rate schedulers as done, and a group joining then would take a state one step behind
        the model it receives."""
        if self._windows is not None and self.window_due():
            self.end_window("protocol")
            self._syncs += 1

    def end_window(self, purpose: str) -> bool:
        """End this window between the groups (:meth:`~lightning_dist.strategies._replica_windows.FaultTolerantWindows.window`); True if it was committed.

        First a heal received in the background is taken (:meth:`complete_heal`). After the window, a group that
        was a peer's source publishes its committed state, and a group healed here fetches it (or, if the window
        was discarded, is healed again at the next quorum)."""
        assert self._windows is not None
        self.complete_heal()
        self._asked_for_state = False
        committed = self._windows.window(purpose, self.fault_tolerant_outer_step(), self.fault_tolerant_selection())
        self._replicas_in_sync = True  # every replica holds its group's committed model
        quorum = self._windows.quorum
        if committed and self._asked_for_state and self.comm.rank == 0:
            state = self.committed_state()
            quorum.transport.publish(quorum.manager.current_step(), state)
            self.comm.stats.record("checkpoint", sum(t.numel() * t.element_size() for t in tensors_in(state)), 1,
                                   "inter_node")
        elif committed:
            quorum.transport.withdraw()
        if quorum.healed:
            if committed:
                self._heal = (quorum.transport.fetch_committed(quorum.manager.current_step(), quorum.timeout)
                              if self.comm.rank == 0 and self._windows.healed_here else HEAL_ON_RANK_0)
            else:
                quorum.fall_behind()
        return committed

    def complete_heal(self) -> None:
        """Take the committed state a heal fetched in the background (waiting for it if it has not arrived) on every
        rank of the job: local rank 0's, shared, as DDP keeps a group's ranks in step only from one state. The
        window now ending is then the group's last to send zeros. If the fetch failed, the group is healed again at
        the next quorum. A collective inside the job (whether a heal is pending is the same on every rank)."""
        heal, self._heal = self._heal, None
        if heal is None:
            return
        assert self._windows is not None
        state = None
        if heal is not HEAL_ON_RANK_0:
            try:
                state = heal.result()
            except (ConnectionError, PermissionError, ValueError, TimeoutError, RuntimeError) as error:
                log.warning("lightning_dist: replica group %d: its peer's committed state did not arrive (%s); it "
                            "is healed again at the next quorum", self.fault_tolerance.group(), error)
        if self.group_any(self.comm.rank == 0 and state is None):
            self._windows.quorum.fall_behind()
            return
        if self.comm.world_size > 1:
            if self.comm.rank == 0:
                payload = pack_replica(state)
                for rank in range(1, self.comm.world_size):
                    self.comm.send_object(payload, rank, "checkpoint", self.root_device)
            else:
                state = unpack_replica(self.comm.receive_object(0, self.root_device))
        self.load_protocol_state_dict(reference_from_committed(state["protocol"], self.model_vector.num_parameters))
        for optimizer, saved in zip(self.optimizers, state["optimizers"]):
            optimizer.load_state_dict(saved)
            _optimizer_to_device(optimizer, self.root_device)
        self.model_vector.set(self._windows.anchor)
        self._windows.catching_up = True

    def group_any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank of this job (an all-reduce of one integer inside it)."""
        total = self.comm.all_reduce_sum_(torch.tensor([int(flag)], dtype=torch.int64, device=self.root_device),
                                          "protocol")
        return bool(total[0] > 0)

    def fault_tolerant_selection(self) -> Select | None:
        """FedAvg's draw of the groups that average a window (None: every contributing group)."""
        return None

    def fault_tolerant_outer_step(self) -> OuterStep | None:
        """DiLoCo's outer step a committed window takes from the mean (None: the mean itself)."""
        return None

    def recovery_state(self) -> dict[str, Any]:
        """What this rank sends a group that is behind inside the quorum (torchft calls it in its quorum thread,
        while this rank's training thread waits for the quorum): counters, random generators and Lightning's
        training state, a few kilobytes on the host, counted under ``checkpoint``. The bulk follows outside the
        window (:meth:`committed_state`, published once the window is committed)."""
        trainer = self.lightning_module.trainer
        self._asked_for_state = True
        state = on_host({"generator": self._generator.get_state(), "rng": rng_states(self.root_device),
                         "local_steps": self._local_steps, "syncs": self._syncs,
                         "training": lightning_training_state(trainer) if self.optimizers else None})
        self.comm.stats.record("checkpoint", sum(t.numel() * t.element_size() for t in tensors_in(state)), 1,
                               "inter_node")
        return state

    def load_recovery_state(self, state: Mapping[str, Any]) -> None:
        """Take a peer's :meth:`recovery_state` (in torchft's quorum, before this window's exchange); Lightning's
        training state is kept for its restore after set-up if training has not started."""
        assert self._windows is not None
        self._local_steps, self._syncs = state["local_steps"], state["syncs"]
        self._generator.set_state(state["generator"])  # FedAvg's draws, the same in every group
        restore_rng_states(state["rng"], self.root_device)  # dropout and the like, as the peer's (groups seed alike)
        if not self.optimizers:
            self._joined = {"training": state["training"]}
        self._windows.quorum.healed = True

    def committed_state(self) -> dict[str, Any]:
        """What this rank publishes for a group it healed in this window's quorum, once the window is committed: the
        committed model and protocol state (DiLoCo's reference sent once) and this rank's optimizer state, copies
        on the host."""
        protocol = reference_as_committed(self.protocol_state_dict(), self.model_vector.num_parameters)
        return on_host({"protocol": protocol, "optimizers": [optimizer.state_dict() for optimizer in self.optimizers]})

    def show_fault_tolerance(self) -> None:
        """The groups in the last quorum, commits and discarded windows in the progress bar once a window has ended
        since they were last shown (no collective; from a training hook, as ``show_comm_stats``)."""
        module = self.lightning_module
        if self._windows is None or not self._windows.unshown or module.trainer.progress_bar_callback is None:
            return
        self._windows.unshown = False
        self.show_in_progress_bar(self.fault_tolerance_metrics())

    def fault_tolerance_state(self) -> dict[str, Any]:
        """The part of ``protocol_state_dict`` the option adds: the last committed model (the same on every rank and
        group), so a checkpoint written inside a window resumes with it, and under ``compression`` the quorum layout
        the owners' residuals were cut for."""
        if self._windows is None:
            return {}
        return {FAULT_TOLERANCE_KEY: {"anchor": self._windows.anchor, "chunks": self._windows.chunks}}

    def load_fault_tolerance_state(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`fault_tolerance_state`'s part; a checkpoint written with the option set otherwise is
        refused by name (its learners were other processes: jobs of replica groups, or one job)."""
        saved = state.get(FAULT_TOLERANCE_KEY)
        if (saved is None) != (self._windows is None):
            written, now = ("with", "without") if saved is not None else ("without", "with")
            raise ValueError(f"the checkpoint was written by {type(self).__name__} {written} fault_tolerance and is "
                             f"resumed {now} it; resume with the setting that wrote it")
        if saved is not None:
            self._windows.anchor.copy_(saved["anchor"])
            self._windows.chunks = None if saved.get("chunks") is None else tuple(saved["chunks"])

    def fault_tolerance_metrics(self) -> dict[str, float]:
        """``ft/*`` (the groups in the last quorum, commits, discarded windows) under ``fault_tolerance``."""
        return {} if self._windows is None else self._windows.metrics()


def reference_as_committed(protocol: Mapping[str, Any], num_parameters: int) -> Mapping[str, Any]:
    """``protocol`` without DiLoCo's reference when it is the committed model's parameters, as between windows
    (a window ends with the outer step's result, or back at the committed model) unless the model's dtype rounds it:
    sent once, not twice (a fifth of a heal's bytes under DiLoCo with Adam)."""
    outer, committed = protocol.get(OUTER_KEY), protocol.get(FAULT_TOLERANCE_KEY)
    if outer is None or committed is None:
        return protocol
    reference, anchor = outer["reference"], committed["anchor"][:num_parameters]
    if reference.dtype != anchor.dtype or not torch.equal(reference, anchor.to(reference.device)):
        return protocol
    return {**protocol, OUTER_KEY: {**outer, "reference": None}}


def reference_from_committed(protocol: Mapping[str, Any], num_parameters: int) -> Mapping[str, Any]:
    """Undo :func:`reference_as_committed` on the receiving side."""
    outer = protocol.get(OUTER_KEY)
    if outer is None or outer["reference"] is not None:
        return protocol
    return {**protocol, OUTER_KEY: {**outer, "reference": protocol[FAULT_TOLERANCE_KEY]["anchor"][:num_parameters]}}


def tensors_in(state: Any) -> list[Tensor]:
    """Every tensor in a nested state (dicts, lists, tuples)."""
    found: list[Tensor] = []
    apply_to_collection(state, Tensor, found.append)
    return found
