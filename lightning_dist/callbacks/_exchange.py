"""DataGossip's record exchanges: select, all-gather in a background thread, adopt, and drain at the end.

:class:`GossipExchanges` is mixed into :class:`~lightning_dist.callbacks.DataGossip` and works on
its attributes; the Lightning hooks that call it stay there (see its docstring, "Exchanges and
collective order"). A resumed run replays the exchange that was in flight at the checkpoint with
:func:`all_gather_rows` (``_gossip_checkpoint.py``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dist.algorithms.selection import select_records
from lightning_dist.comm import destroy_group


@dataclass
class Exchange:
    """One all-gather of this rank's selected records, run by a background thread."""

    call_id: int  # position of this all-gather among this process's calls on the data group
    payload: Tensor  # (k, record_nbytes) uint8
    indices: Tensor
    done: threading.Event = field(default_factory=threading.Event)
    thread: Optional[threading.Thread] = None
    gathered: Optional[Tensor] = None  # (world_size, k, record_nbytes)
    error: Optional[BaseException] = None


def run_exchange(exchange: Exchange, group: Optional[dist.ProcessGroup], world_size: int) -> None:
    """The exchange thread's body: the all-gather, with its result or error left on ``exchange``."""
    try:
        exchange.gathered = all_gather_rows(exchange.payload, group, world_size)
    except BaseException as error:  # reported to the training thread at the next epoch start
        exchange.error = error
    finally:
        exchange.done.set()


def all_gather_rows(payload: Tensor, group: Optional[dist.ProcessGroup], world_size: int) -> Tensor:
    """Every rank's ``payload`` rows, stacked in rank order: ``(world_size, k, record_nbytes)``."""
    gathered = [torch.empty_like(payload) for _ in range(world_size)]
    dist.all_gather(gathered, payload.contiguous(), group=group)
    return torch.stack(gathered)


def wire_bytes(payload: Tensor, world_size: int) -> int:
    """Bytes this rank puts on the wire for one all-gather of ``payload``."""
    # Ring all-gather: each rank's rows travel to each of the other world_size - 1 ranks once.
    return payload.numel() * payload.element_size() * (world_size - 1)


class GossipExchanges:
    """Starting, finishing and adopting DataGossip's exchanges, and the final catch-up (collectives)."""

    def _adopt(self, gathered: Tensor, call_id: int) -> None:
        """Replace the foreign buffer by the other ranks' rows of an all-gather."""
        assert self._codec is not None
        rows = torch.cat([gathered[r] for r in range(self._world_size) if r != self._rank])
        self._foreign_rows = rows.clone()
        self._foreign_records = self._codec.decode(self._foreign_rows)
        self._foreign_order = torch.randperm(len(rows), generator=self._generator)
        self._foreign_position = 0
        self.foreign_exchange_id = call_id

    def _adopt_arrived(self, wait: bool) -> None:
        exchange = self._inflight
        if exchange is not None and (wait or exchange.done.is_set()):
            self._finish(exchange)
        if self._received is not None:
            call_id, gathered = self._received
            self._received = None
            self._adopt(gathered, call_id)

    def _finish(self, exchange: Exchange) -> None:
        """Wait for ``exchange`` (normally done already) and keep its result for adoption."""
        assert exchange.thread is not None
        exchange.thread.join()
        self._inflight = None
        self._raise_if_failed(exchange)
        assert exchange.gathered is not None
        self._received = (exchange.call_id, exchange.gathered)

    def _raise_if_failed(self, exchange: Exchange) -> None:
        if exchange.error is not None:
            raise RuntimeError(
                f"DataGossip's record exchange failed on rank {self._rank}: {exchange.error}"
            ) from exchange.error

    def _select(self) -> Tensor:
        assert self._history is not None
        k = self.records_per_exchange
        eligible = self._history.seen.clone()
        # Until k distinct local records were trained on (an epoch cut short), also allow the
        # records the sampler assigns to this rank; as a last resort any record.
        if int(eligible.sum()) < k and self._pool is not None:
            eligible[self._pool] = True
        if int(eligible.sum()) < k:
            eligible[:] = True
        return select_records(self.selector, self._history, eligible, k, self._generator,
                              self.spl_threshold, self.spl_growth)

    def _start_exchange(self) -> None:
        assert self._woven is not None and self._codec is not None
        if self._inflight is not None:
            self._finish(self._inflight)  # done: its result waits for the next epoch start
        indices = self._select()
        dataset = self._woven.dataset
        payload = self._codec.encode([dataset[int(i)] for i in indices], indices.tolist())
        self.selected_indices = indices
        self._last_payload = payload
        self._calls += 1
        exchange = Exchange(call_id=self._calls, payload=payload, indices=indices)
        exchange.thread = threading.Thread(
            target=run_exchange, args=(exchange, self._data_group, self._world_size),
            name=f"DataGossip-exchange-{self._calls}", daemon=True,
        )
        self.exchanges += 1
        self.bytes_sent += wire_bytes(payload, self._world_size)
        self.last_exchange_id = exchange.call_id
        self._inflight = exchange
        exchange.thread.start()

    def _drain(self) -> None:
        """Make every rank's number of all-gathers equal, then release the data group (a collective)."""
        if self._drained or self._abandoned or self._data_group is None or self._control_group is None:
            return
        self._drained = True
        target = torch.tensor([self._calls], dtype=torch.int64)
        dist.all_reduce(target, op=dist.ReduceOp.MAX, group=self._control_group)
        if self._inflight is not None:
            exchange = self._inflight
            assert exchange.thread is not None
            exchange.thread.join()  # completes: every rank reaches at least this call number
            self._inflight = None
            self._raise_if_failed(exchange)
        assert self._codec is not None or int(target) == self._calls
        while self._calls < int(target):
            # The content does not matter (training is over and nobody adopts it); any well-formed
            # rows do, and the last selection is at hand.
            payload = self._last_payload if self._last_payload is not None else \
                torch.zeros(self.records_per_exchange, self._codec.record_nbytes, dtype=torch.uint8)
            all_gather_rows(payload, self._data_group, self._world_size)
            self._calls += 1
            self.catch_up_exchanges += 1
            self.bytes_sent += wire_bytes(payload, self._world_size)
        # Once every rank got here, no rank has a call left on the data group: release it.
        dist.barrier(group=self._control_group)
        destroy_group(self._data_group)
        self._data_group = None
