"""DataGossip's checkpoint state: every rank's part, gathered to rank 0, and given back on resume,
by the same number of processes or another (:func:`resized_rank_state`).

:class:`GossipCheckpoint` is mixed into :class:`~lightning_dist.callbacks.DataGossip` and works on
its attributes; the hooks that decide when to save and restore stay there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_dist.counters import counters_kept_in_total
from lightning_dist.algorithms.selection import LossHistory, merge_histories
from lightning_dist.callbacks._exchange import all_gather_rows, wire_bytes

_STATE_FORMAT = 1


class GossipCheckpoint:
    """``state_dict`` / ``load_state_dict`` of DataGossip (see its docstring, "Checkpoints")."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's state gathered with every other rank's to rank 0 (a collective on all ranks)."""
        local = self.rank_state_dict()
        if self._control_group is None or self._abandoned or not dist.is_initialized():
            # After a failure the peers may be gone: keep what this rank knows.
            return {"format": _STATE_FORMAT, "world_size": self._world_size, "ranks": None,
                    "rank": self._rank, "local": local}
        gathered: Optional[list[Any]] = [None] * self._world_size if self._rank == 0 else None
        dist.gather_object(local, gathered, dst=0, group=self._control_group)
        return {"format": _STATE_FORMAT, "world_size": self._world_size, "ranks": gathered}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Applied when the train loader is set up: the history's size and the record format are
        # known only then.
        self._loaded_state = state_dict

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's part of the checkpoint state (what ``state_dict`` gathers to rank 0)."""
        self._record_losses()
        pending = None
        if self._inflight is not None:
            pending = self._inflight.payload.clone()
        return {
            "history": self._history.state_dict() if self._history is not None else None,
            "generator": self._generator.get_state(),
            "foreign_rows": self._foreign_rows,
            "foreign_order": self._foreign_order.clone(),
            "foreign_position": self._foreign_position,
            "received": None if self._received is None else self._received[1].clone(),
            "pending": pending,
            "last_payload": self._last_payload,
            "selected_indices": self.selected_indices,
            "record_format": self._codec.describe() if self._codec is not None else None,
            "counters": {
                "bytes_sent": self.bytes_sent,
                "exchanges": self.exchanges,
                "dropped_exchanges": self.dropped_exchanges,
                "foreign_batches": self.foreign_batches,
                "catch_up_exchanges": self.catch_up_exchanges,
            },
        }

    def _restore(self, state: Mapping[str, Any], owned: Optional[Tensor]) -> None:
        """Apply a loaded state on every rank, then replay the exchange that was in flight (collective).

        ``owned``: the dataset indices this rank's sampler holds for good (None: it deals out a fresh
        split every epoch, or does not say), for a checkpoint written by another number of processes.
        """
        assert self._history is not None and self._codec is not None
        ranks = state.get("ranks")
        if ranks is None:
            rank_zero_warn("DataGossip: the checkpoint holds no per-rank DataGossip state (written after a failure); "
                           "starting with empty loss histories and foreign buffers")
            return
        if len(ranks) == self._world_size:
            local = ranks[self._rank]
        else:
            local = resized_rank_state(ranks, self._rank, self._world_size, owned)
        if local["record_format"] is not None and local["record_format"] != self._codec.describe():
            raise ValueError(
                f"the checkpoint's records were {local['record_format']}; this dataset's are {self._codec.describe()}"
            )
        if local["history"] is not None:
            self._history.load_state_dict(local["history"])
        if local["generator"] is not None:
            self._generator.set_state(local["generator"])
        self._foreign_rows = local["foreign_rows"]
        self._foreign_records = self._codec.decode(self._foreign_rows) if self._foreign_rows is not None else []
        self._foreign_order = local["foreign_order"].clone()
        self._foreign_position = int(local["foreign_position"])
        self._last_payload = local["last_payload"]
        self.selected_indices = local["selected_indices"]
        for name, value in local["counters"].items():
            setattr(self, name, int(value))
        # The exchange in flight when the checkpoint was written is replayed if every rank had one
        # (each re-sends its own payload, so every rank receives what the uninterrupted run
        # received); otherwise the newest finished result is adopted, or nothing.
        has_pending = torch.tensor([local["pending"] is not None], dtype=torch.int64)
        dist.all_reduce(has_pending, op=dist.ReduceOp.MIN, group=self._control_group)
        if int(has_pending):
            payload = local["pending"]
            gathered = all_gather_rows(payload, self._data_group, self._world_size)
            self._calls += 1
            self.bytes_sent += wire_bytes(payload, self._world_size)
            self._adopt(gathered, self._calls)
        elif local["received"] is not None:
            self._adopt(local["received"], 0)


def resized_rank_state(
    ranks: Sequence[Mapping[str, Any]], rank: int, world_size: int, owned: Optional[Tensor]
) -> dict[str, Any]:
    """Rank ``rank``'s part of a checkpoint written by ``len(ranks)`` processes, for a run of ``world_size``.

    The rule (issue 18): the rank keeps the loss history of the records it now owns, taken from
    every saved rank's history (:func:`~lightning_dist.algorithms.selection.merge_histories`):
    with a fixed partition (``owned``, e.g. ``PartitionSampler.part`` at the new world size) the
    entries of exactly those records, unchanged; with a sampler that deals out a fresh split every
    epoch (``owned`` None), where every rank reads every record over the epochs, the history of all
    records. The foreign buffer, a finished exchange not yet adopted and the exchange in flight are
    dropped: the saved ranks selected them for the old partition and the old ranks' buffers, and an
    all-gather of the old ranks cannot be replayed by another number. The first epoch after the
    resume therefore trains on local records only, like a run's first epoch, and exchanges start
    again at its end. A rank that existed keeps its selector RNG; a new rank starts from its seed,
    as in a fresh run. The counters are kept in total (``lightning_dist/counters.py``).
    """
    histories = []
    for saved in ranks:
        if saved["history"] is not None:
            history = LossHistory(int(saved["history"]["num_records"]))
            history.load_state_dict(saved["history"])
            histories.append(history)
    names = list(ranks[0]["counters"])
    counters = counters_kept_in_total([[saved["counters"][name] for name in names] for saved in ranks], rank, world_size)
    formats = [saved["record_format"] for saved in ranks if saved["record_format"] is not None]
    return {
        "history": merge_histories(histories, owned).state_dict() if histories else None,
        "generator": ranks[rank]["generator"] if rank < len(ranks) else None,
        "foreign_rows": None,
        "foreign_order": torch.zeros(0, dtype=torch.int64),
        "foreign_position": 0,
        "received": None,
        "pending": None,
        "last_payload": None,
        "selected_indices": None,
        "record_format": formats[0] if formats else None,
        "counters": dict(zip(names, counters)),
    }
