"""One rank's end of a window between replica groups under ``fault_tolerance``: quorum, exchange (all groups,
FedAvg's drawn ones, compressed or not), commit or roll back to the committed model.

The option's design, and what each step means for a group that is lost, behind or joining, is in
:mod:`lightning_dist.strategies._fault_tolerance`; this is the window itself, over a
:class:`~lightning_dist.comm.quorum.QuorumCommunicator` and the strategy's buckets.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from lightning_dist.algorithms.outer import OuterStep
from lightning_dist.comm.quorum import Membership, QuorumCommunicator
from lightning_dist.model_vector import ModelVector
from lightning_dist.strategies._bucketed_average import average_subset_in_place, bucket_bounds
from lightning_dist.strategies._fragment_exchange import FragmentExchange, Lanes, exchanges

log = logging.getLogger(__name__)

Select = Callable[[list[int]], list[int]]
"""FedAvg's draw for a window: the contributing replica groups -> those that average (sorted)."""


class FaultTolerantWindows:
    """One rank's end of a window between replica groups: quorum, exchange, commit or roll back (module docstring).

    Args:
        vector: the model as one vector.
        lanes: the job's communicator and the hierarchy whose ``inter_node`` is the :class:`QuorumCommunicator`.
        buckets: the strategy's buckets of a full synchronization, with their compressed state under
            ``compression`` (the state its checkpoints keep).
        anchor_device: where the committed model lives between windows (the host by default).
        check_finite: a collective inside the group that raises, naming the ranks, if this rank's model is not
            finite (a group never sends a non-finite model; the error stops it, and the others go on without it).
        group_any: a collective inside the group: whether any of its ranks' flags is true. torchft heals each
            local rank on its own (from the group its local rank maps to); the group contributes only if none was.
        max_retries: how many windows in a row may be discarded during training before the job fails (a join at
            set-up is not counted: it waits for the others).
    """

    def __init__(self, vector: ModelVector, lanes: Lanes, buckets: list[FragmentExchange], anchor_device: torch.device,
                 check_finite: Callable[[], None], group_any: Callable[[bool], bool], max_retries: int) -> None:
        assert lanes.hierarchy is not None and isinstance(lanes.hierarchy.inter_node, QuorumCommunicator)
        self.vector = vector
        self.lanes = lanes
        self.quorum: QuorumCommunicator = lanes.hierarchy.inter_node
        self.check_finite = check_finite
        self.group_any = group_any
        self.buckets = buckets
        self.compresses = any(bucket.compressed is not None for bucket in buckets)
        # A run's first window averages exactly: the groups' start models (equal only when seeded alike) have no
        # common model yet to send deltas from.
        self.exact = buckets if not self.compresses else exchanges(
            [(bucket.start, bucket.stop) for bucket in buckets], vector.num_parameters, lanes.hierarchy, None,
            vector.parameters[0].device, None)
        self.chunks: tuple[int, int] | None = None  # (rank, groups) the compressed exchanges' chunks are cut for
        self.all_averaged = True  # whether the last window averaged every contributing group (not a FedAvg round)
        self.averaged: list[int] | None = None  # the groups FedAvg's round averaged in the last window
        self.anchor = vector.get().to(anchor_device, copy=True)
        self.commits = 0
        self.discarded = 0
        self.max_retries = max_retries
        self.discarded_in_a_row = 0  # during training
        self.last_committed = False
        self.healed_here = False  # whether torchft healed this rank in the last window's quorum
        self.catching_up = False  # whether this window's replica trained from a model the others had left
        self.unshown = False
        self.quorum.on_membership = self._log_membership

    def window(self, purpose: str, outer: OuterStep | None, select: Select | None = None) -> bool:
        """End a window: quorum, exchange, commit (True) or roll back to the anchor (False). ``select``: FedAvg's
        draw of the groups that average a window among those that contribute (None: all of them), used when a
        contributing group ends a ``"protocol"`` window (a group healed here may be ending its ``"setup"``, and a
        group its ``"final"``, while the others end a protocol window: they all follow the same vote)."""
        self.quorum.begin_window()
        self.healed_here = self.quorum.healed
        self.quorum.healed = self.group_any(self.quorum.healed)
        contributes = not (self.quorum.healed or self.catching_up)  # catching_up: the same on every rank of the job
        self.catching_up = False
        if contributes:
            self.check_finite()
        else:  # its replica: its committed model (the peer's if it has taken it; a FedAvg round may leave it out)
            self.vector.set(self.anchor)
        self.quorum.count_contributors(contributes, self.anchor.device,
                                       vote=select is not None and purpose == "protocol")
        contributors = self._agree_on_the_quorum()
        self.averaged = None
        members = self._members(select) if select is not None and self.quorum.voted else None
        self.all_averaged = members is None
        # torchft's step, the same on every group in the quorum: all compress, or none.
        compressed = self.compresses and self.quorum.committed_before()
        rollback = self._prepare_compressed(contributes) if compressed else None
        self._exchange(purpose, members, contributors, contributes, compressed)
        committed = self.quorum.commit() and contributors > 0
        self._commit_or_roll_back(committed, outer, compressed, rollback)
        self.last_committed = committed
        if purpose != "setup":
            self._count_retries(committed)
        return committed

    def _count_retries(self, committed: bool) -> None:
        """Fail the job once ``max_retries`` windows in a row were discarded during training (``committed`` is the
        same on every rank of the group, so all of its ranks fail together), naming the last one's reason."""
        self.discarded_in_a_row = 0 if committed else self.discarded_in_a_row + 1
        if self.discarded_in_a_row > self.max_retries:
            raise RuntimeError(
                f"replica group {self.quorum.group}: {self.discarded_in_a_row} windows in a row were discarded, more "
                f"than TorchFT(max_retries={self.max_retries}); the last because {self._discard_reason()}")

    def _discard_reason(self) -> str:
        if self.quorum.failed():
            return f"its exchange failed ({self.quorum.manager.errored()})"
        membership = self.quorum.membership
        return (f"it met {membership.groups} group(s) ({membership.contributors} contributing), fewer than "
                f"min_replicas, or another rank of its group failed" if membership is not None else
                "no quorum formed")

    def _agree_on_the_quorum(self) -> int:
        """One view of the window's quorum on every rank of the job: that of its first rank whose first all-reduce
        succeeded (FedAvg's vote, the contributing groups and their count); returns the count.

        A failure can reach some of a job's ranks only: local rank ``j`` exchanges with the other groups' local
        rank ``j``. Each rank's own view would then send its ranks down different branches (a plain mean on one,
        FedAvg's subset on another) whose collectives inside the job never pair, and the job would crash at its
        timeout. Following one view, the job's ranks issue the same collectives; the exchange stays a no-op where
        it failed, and ``should_commit`` discards the window on every rank."""
        quorum = self.quorum
        world = self.lanes.world
        if world.world_size == 1:
            return quorum.contributors
        view = torch.zeros(2 + quorum.groups, dtype=torch.float64)
        if not quorum.failed():
            view[0], view[1] = 1.0, float(quorum.voted)
            for group, rank in quorum.contributing.items():
                view[2 + group] = rank + 1.0
        views = world.all_gather(view.to(self.vector.parameters[0].device), "protocol").cpu()
        succeeded = views[:, 0].nonzero().flatten()
        if len(succeeded) > 0:
            first = views[int(succeeded[0])]
            quorum.voted = bool(first[1] > 0.5)
            quorum.contributing = {group: int(first[2 + group]) - 1 for group in range(quorum.groups)
                                   if first[2 + group] > 0.5}
            quorum.contributors = len(quorum.contributing)
        return quorum.contributors

    def _exchange(self, purpose: str, members: list[int] | None, contributors: int, contributes: bool,
                  compressed: bool) -> None:
        """The window's mean written into the model, bucket by bucket (FedAvg's drawn ``members``: theirs only)."""
        if members is not None:  # FedAvg's round: the members' mean on the members, the others keep their replicas
            average_subset_in_place(self.vector, self.exact, self.lanes, members, purpose)
            return
        for bucket in self.buckets if compressed else self.exact:
            fragment = self.vector.get_range(bucket.start, bucket.stop)
            mean = bucket.mean(self.lanes, fragment, purpose, contributors, contributes)
            self.vector.set_range(bucket.start, mean)

    def _commit_or_roll_back(self, committed: bool, outer: OuterStep | None, compressed: bool,
                             rollback: list[dict[str, Any]] | None) -> None:
        """Committed: the outer step from the mean, the result the new anchor (and the compressed deltas' common
        model). Discarded: the model back at the anchor and the residuals as they were before the window."""
        for start, stop in bucket_bounds(self.vector.numel, None if outer is None else outer.bucket):
            if committed:
                if outer is not None:
                    mean = self.vector.get_range(start, stop, dtype=outer.reference.dtype).to(outer.reference.device)
                    self.vector.set_range(start, outer.step_range(start, mean))
                self.anchor[start:stop].copy_(self.vector.get_range(start, stop))
            else:
                self.vector.set_range(start, self.anchor[start:stop])
        if committed and self.compresses:  # the next deltas are taken from the committed model
            for bucket in self.buckets:
                bucket.hold(self.anchor[bucket.start:bucket.stop], copy=True)
            if compressed:
                self.chunks = (self.quorum.rank, self.quorum.world_size)
        elif rollback is not None:  # the residuals as they were: the discarded window's deltas were never applied
            for bucket, state in zip(self.buckets, rollback):
                bucket.load_state_dict(state)
        self.unshown = True
        if committed:
            self.commits += 1
        else:
            self.discarded += 1
            log.warning("lightning_dist: replica group window discarded (%s): every replica is back at the last "
                        "committed model", self._discard_reason())

    def _members(self, select: Select) -> list[int] | None:
        """FedAvg's participants in this window as ranks of the quorum, None when every contributing group is one.
        ``select`` runs in every group, also where the window has failed: each draw advances the groups' shared
        generator the same, so they agree on the next one."""
        groups = select(sorted(self.quorum.contributing))
        if self.quorum.contributors == 0 or len(groups) == self.quorum.contributors:
            return None
        self.averaged = groups
        return sorted(self.quorum.contributing[group] for group in groups)

    def _prepare_compressed(self, contributes: bool) -> list[dict[str, Any]]:
        """Before a compressed exchange: its state to restore if the window is discarded (references: the exchange
        replaces the residuals, it does not change them in place); a healed group's deltas from the committed model
        it received, its residuals (a window the others discarded) at zero; the chunks cut anew if the quorum's
        groups changed since the last committed compressed window."""
        rollback = [bucket.state_dict() for bucket in self.buckets]
        recut = self.chunks != (self.quorum.rank, self.quorum.world_size)
        for bucket in self.buckets:
            if not contributes:
                bucket.restart(self.anchor[bucket.start:bucket.stop])
            elif recut:
                bucket.recut()
        return rollback

    def _log_membership(self, before: Membership | None, now: Membership) -> None:
        log.warning("lightning_dist: quorum %s: %d replica group(s), %d contributing (was %s)", now.quorum_id,
                    now.groups, now.contributors, "none" if before is None else f"{before.groups}")

    def metrics(self) -> dict[str, float]:
        """``ft/*`` counters for the loggers and the progress bar: the groups now, commits, discarded windows."""
        membership = self.quorum.membership
        return {"ft/groups": float(0 if membership is None else membership.groups),
                "ft/commits": float(self.commits), "ft/discarded": float(self.discarded)}
