"""CD-GraB's checkpoint state: every rank's order, position and balancer, gathered to rank 0, and given back
on resume, by the same number of processes or another (``_restore_resized``).

:class:`CDGraBCheckpoint` is mixed into :class:`~lightning_dist.callbacks.CDGraB` and works on its attributes;
the hooks that decide when to save and restore stay there (see its docstring, "Checkpoints").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch.distributed as dist
from torch import Tensor

from lightning_dist.counters import counters_kept_in_total

_STATE_FORMAT = 1


class CDGraBCheckpoint:
    """``state_dict`` / ``load_state_dict`` of CD-GraB."""

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's part of the checkpoint: its sampler's order and position, the balancer, the counters."""
        if self._sampler is None or self._balancer is None:
            return {}
        # Every rank issued the gather in flight before any rank reached this hook.
        self._balance_pending()
        self._sync_from_server()
        return {
            "epoch": self._balanced_epoch,
            "permutation": self._balanced_permutation.clone(),
            "balancer": {k: v.cpu() if isinstance(v, Tensor) else v for k, v in self._balancer.state_dict().items()},
            "first_non_finite": self._first_non_finite.cpu() if self._first_non_finite is not None else None,
            "bytes_sent": self.bytes_sent,
            "seconds": self.seconds,
            "epoch_ended": self._epoch_ended,
        }

    def state_dict(self) -> dict[str, Any]:
        """Every rank's state, gathered to rank 0 (a collective on all ranks while training)."""
        local = self.rank_state_dict()
        if self._control_group is None:
            return {"format": _STATE_FORMAT, "ranks": [local]}
        gathered: Optional[list[Any]] = [None] * self._world_size if self._rank == 0 else None
        dist.gather_object(local, gathered, dst=0, group=self._control_group)
        return {"format": _STATE_FORMAT, "ranks": gathered}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Applied when the train loader is set up: the sampler exists only then.
        self._loaded_state = state_dict

    def _restore(self, state: Mapping[str, Any]) -> None:
        assert self._sampler is not None and self._balancer is not None
        ranks = state["ranks"]
        if len(ranks) != self._world_size:
            self._restore_resized(ranks)
            return
        local = ranks[self._rank]
        if not local:
            return  # saved before training started
        device = self._balancer.running_sum.device
        self._balancer.load_state_dict({k: v.to(device) if isinstance(v, Tensor) else v for k, v in local["balancer"].items()})
        if local["first_non_finite"] is not None:
            self._first_non_finite = local["first_non_finite"].to(device)
        self.bytes_sent = local["bytes_sent"]
        self.seconds = local["seconds"]
        self._epoch_ended = bool(local.get("epoch_ended", False))  # absent from checkpoints before issue 18
        self._balanced_epoch, self._balanced_permutation = local["epoch"], local["permutation"]
        if self._balancer.epoch_complete:
            # Saved after the epoch's last step: continue with the next epoch's order, decided again
            # from the signs. Set now, not left for set_epoch: a loader with worker processes
            # reads the sampler when Lightning creates the iterator, before set_epoch on a resume.
            self._sampler.resume_at(local["epoch"] + 1, self._next_permutation(local["permutation"]), start=0)
        else:
            self._sampler.resume_at(local["epoch"], local["permutation"], start=2 * self._balancer.pairs_done)

    def _restore_resized(self, ranks: Sequence[Mapping[str, Any]]) -> None:
        """Resume a checkpoint written by another number of processes: a seeded random order for the new partition.

        The saved orders and signs are positions in the old ranks' parts, which no longer exist, so
        the herding state (signs, running sum) is dropped. The epoch Lightning resumes is read in
        the sampler's seeded random permutation of that epoch for this rank's new part (the one
        D-RR would read), from the batch Lightning resumes it at. Lightning counts batches, not
        examples: after a checkpoint written in an epoch (``every_n_train_steps``) that has read
        ``k`` batches, it resumes that epoch, or the next one when ``k`` was the whole epoch, at
        batch ``k`` if the epoch has more than ``k`` batches at the new world size, and otherwise
        the next epoch from its start (the interrupted one is then over: nothing of it is read).
        After a checkpoint written at an epoch's end it starts the next epoch. Balancing goes on
        from there with a zero running sum, the pairs before it counting as sign ``+1``, and
        decides the next epoch's order.
        """
        assert self._sampler is not None and self._balancer is not None
        if not ranks[0]:
            return  # saved before training started
        saved = ranks[0]  # the order server's signs and epoch progress, the same on every rank
        counters = counters_kept_in_total([[r["bytes_sent"], r["seconds"]] for r in ranks], self._rank, self._world_size)
        self.bytes_sent, self.seconds = counters
        pairs_per_epoch, pairs_done = saved["balancer"]["signs"].shape[0], int(saved["balancer"]["pairs_done"])
        size = self._sampler.batch_size
        done, batches = 2 * pairs_done // size, self._sampler.num_samples // size
        complete = pairs_done == pairs_per_epoch
        if saved.get("epoch_ended", False):
            epoch, start = saved["epoch"] + 1, 0
        elif done < batches:
            epoch, start = saved["epoch"] + int(complete), done
        else:
            epoch, start = (saved["epoch"] + 1, 0) if complete else (saved["epoch"], batches)
        permutation = self._sampler.random_permutation(epoch)
        pairs_skipped = start * size // 2
        self._balancer.start_epoch()
        self._balancer.signs[:pairs_skipped] = 1
        self._balancer.pairs_done = pairs_skipped
        self._balanced_epoch, self._balanced_permutation = epoch, permutation
        self._sampler.resume_at(epoch, permutation, start=start * size)
