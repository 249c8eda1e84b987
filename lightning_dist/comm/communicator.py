"""The only place lightning_dist strategies call ``torch.distributed``; every send is counted.

Counting rule: a rank records the payload bytes it puts on the wire (headers excluded).
Point-to-point sends are exact. For collectives the totals summed over ranks are the volumes
of the bandwidth-optimal algorithms Gloo and NCCL use for large tensors: a broadcast delivers the
tensor once to each of the ``m - 1`` other ranks, an all-gather delivers each rank's tensor to
the ``m - 1`` others, a gather delivers each other rank's tensor once to the destination, a ring all-reduce moves ``2 (m - 1) / m`` of the tensor per rank.
``tests/comm/test_wire_bytes.py`` checks these counts against loopback traffic.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dist.comm.groups import destroy_group
from lightning_dist.comm.stats import CommStats


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class PendingGather:
    """A gather in flight: :meth:`wait` returns every rank's tensor stacked in rank order (None off the destination)."""

    def __init__(self, work: dist.Work, gathered: Tensor | None) -> None:
        self._work = work
        self._gathered = gathered

    def wait(self) -> Tensor | None:
        self._work.wait()
        return self._gathered


class Communicator:
    """Counted collectives and point-to-point transfers on one process group.

    The group must contain every rank (created with ``dist.new_group()`` on all ranks), so that
    group ranks equal global ranks. Strategies use their own group rather than WORLD because
    Lightning issues its own collectives on WORLD.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self._group = group
        self._closed = False
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size(group)
        if self.world_size != dist.get_world_size():
            raise ValueError("Communicator needs a process group that holds every rank")
        self.stats = CommStats()

    @property
    def group(self) -> dist.ProcessGroup | None:
        if self._closed:
            raise RuntimeError("this Communicator is closed: its process group was destroyed")
        return self._group

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Destroy the process group (not a collective); the counters stay readable."""
        if not self._closed:
            destroy_group(self._group)
            self._closed = True

    def all_gather(self, tensor: Tensor, purpose: str) -> Tensor:
        """Every rank's ``tensor``, stacked along a new first dimension in rank order."""
        gathered = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(gathered, tensor.contiguous(), group=self.group)
        self.stats.record(purpose, (self.world_size - 1) * _nbytes(tensor), self.world_size - 1)
        return torch.stack(gathered)

    def start_gather(self, tensor: Tensor, dst: int, purpose: str) -> PendingGather:
        """Start gathering every rank's ``tensor`` on ``dst`` without waiting; ``.wait()`` on the result gives the stack.

        The collective runs in the backend's own threads (Gloo) or stream (NCCL) while the caller
        goes on computing; ``tensor`` must not change until then. Counted at the senders: each of
        the ``m - 1`` other ranks sends its tensor once.
        """
        tensor = tensor.contiguous()
        gathered = tensor.new_empty(self.world_size, *tensor.shape) if self.rank == dst else None
        outputs = list(gathered.unbind(0)) if gathered is not None else None
        work = dist.gather(tensor, outputs, dst=dst, group=self.group, async_op=True)
        if self.rank != dst:
            self.stats.record(purpose, _nbytes(tensor), 1)
        return PendingGather(work, gathered)

    def all_reduce_sum_(self, tensor: Tensor, purpose: str) -> Tensor:
        """Sum ``tensor`` over all ranks in place."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        self._record_all_reduce(tensor, purpose)
        return tensor

    def _record_all_reduce(self, tensor: Tensor, purpose: str) -> None:
        # The ring's total 2 (m - 1) |t| split over ranks; rank 0 takes the remainder so the
        # sum over ranks is exact.
        total = 2 * (self.world_size - 1) * _nbytes(tensor)
        share = total // self.world_size + (total % self.world_size if self.rank == 0 else 0)
        self.stats.record(purpose, share, 2 * (self.world_size - 1))

    def broadcast_(self, tensor: Tensor, src: int, purpose: str) -> Tensor:
        """Overwrite ``tensor`` on every rank with ``src``'s copy. Counted at the source."""
        dist.broadcast(tensor, src=src, group=self.group)
        if self.rank == src:
            self.stats.record(purpose, (self.world_size - 1) * _nbytes(tensor), self.world_size - 1)
        return tensor

    def send(self, tensor: Tensor, destinations: Sequence[int], purpose: str) -> None:
        """Send ``tensor`` to each destination rank (one message each), waiting for completion."""
        tensor = tensor.contiguous()
        requests = [dist.isend(tensor, dst=dst, group=self.group) for dst in destinations]
        for request in requests:
            request.wait()
        self.stats.record(purpose, len(destinations) * _nbytes(tensor), len(destinations))

    def receive(self, like: Tensor, sources: Sequence[int]) -> list[Tensor]:
        """One tensor shaped like ``like`` from each source rank, in the order of ``sources``."""
        buffers = [torch.empty_like(like) for _ in sources]
        requests = [dist.irecv(buffer, src=src, group=self.group) for buffer, src in zip(buffers, sources)]
        for request in requests:
            request.wait()
        return buffers

    def exchange(
        self, sends: Sequence[tuple[Tensor, int]], receives: Sequence[tuple[Tensor, int]], purpose: str
    ) -> None:
        """One batch of point-to-point transfers: send each ``(tensor, dst)``, receive into each ``(buffer, src)``.

        All sends and receives are posted together (``batch_isend_irecv``) and waited for, so ranks
        that serve each other cannot deadlock. Counted at the sender: one message per send. Between
        one pair of ranks, receives must be listed in the order of the matching sends.
        """
        operations = [dist.P2POp(dist.isend, tensor.contiguous(), dst, group=self.group) for tensor, dst in sends]
        operations += [dist.P2POp(dist.irecv, buffer, src, group=self.group) for buffer, src in receives]
        if operations:
            for request in dist.batch_isend_irecv(operations):
                request.wait()
        self.stats.record(purpose, sum(_nbytes(tensor) for tensor, _ in sends), len(sends))

    def send_object(self, payload: bytes, destination: int, purpose: str, device: torch.device) -> None:
        """Send a byte string (length first, then the bytes) to one rank."""
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        self.send(torch.tensor([data.numel()], dtype=torch.int64, device=device), [destination], purpose)
        self.send(data, [destination], purpose)

    def receive_object(self, source: int, device: torch.device) -> bytes:
        (length,) = self.receive(torch.zeros(1, dtype=torch.int64, device=device), [source])
        (data,) = self.receive(torch.empty(int(length.item()), dtype=torch.uint8, device=device), [source])
        return data.cpu().numpy().tobytes()

    def summed_stats(
        self, syncs: int, device: torch.device, extra: CommStats | None = None, sum_syncs: bool = False
    ) -> CommStats:
        """Counters summed over all ranks (a collective: every rank must call it).

        ``extra`` adds another communicator's counters of this rank (e.g. a second group's).
        ``syncs`` is taken as is (it is the same on every rank) unless ``sum_syncs``. The
        reduction's own bytes are recorded under ``accounting`` before it runs, so the returned
        totals include it.
        """
        local = self.stats.to_vector()
        probe = torch.zeros(len(local) + 1, dtype=torch.int64, device=device)
        self._record_all_reduce(probe, "accounting")
        local = self.stats.to_vector()
        if extra is not None:
            local = [mine + theirs for mine, theirs in zip(local, extra.to_vector())]
        vector = torch.tensor(local + [syncs], dtype=torch.int64, device=device)
        dist.all_reduce(vector, op=dist.ReduceOp.SUM, group=self.group)
        values = vector.tolist()
        return CommStats.from_vector(values[:-1], values[-1] if sum_syncs else syncs)
