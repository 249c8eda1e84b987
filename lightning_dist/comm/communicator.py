"""The only place lightning_dist strategies call ``torch.distributed``; every send is counted.

Counting rule: a rank records the payload bytes it puts on the wire (headers excluded).
Point-to-point sends are exact. For collectives the totals summed over ranks are the volumes
of the bandwidth-optimal algorithms Gloo and NCCL use for large tensors: a broadcast delivers the
tensor once to each of the ``m - 1`` other ranks, an all-gather delivers each rank's tensor to
the ``m - 1`` others, a gather delivers each other rank's tensor once to the destination, a ring all-reduce moves ``2 (m - 1) / m`` of the tensor per rank.
``tests/comm/test_wire_bytes.py`` checks these counts against loopback traffic.

Gloo moves host memory: its point-to-point calls take a tensor's address as a host buffer, so a
CUDA tensor sent over a Gloo group (``process_group_backend="gloo"`` with a GPU model, or
DownpourSGD's Gloo server group) would hand the socket a device pointer. On a group whose backend
for the tensor's device is Gloo, every operation therefore stages non-host tensors through host
memory (:func:`stages_through_host`): a host copy travels, and results come back on the caller's
device in the caller's dtype. NCCL groups move device tensors directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dist.comm.groups import destroy_group
from lightning_dist.comm.stats import CommStats, check_level


HOST = torch.device("cpu")


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def to_wire(tensor: Tensor, wire_device: torch.device) -> Tensor:
    """What travels for ``tensor`` on a group that takes tensors on ``wire_device``: ``tensor`` itself, contiguous, or
    its copy there (staged through the host for Gloo)."""
    return tensor.contiguous().to(wire_device)


def receive_buffer(buffer: Tensor, wire_device: torch.device) -> Tensor:
    """Where to receive into ``buffer`` on a group that takes tensors on ``wire_device``: ``buffer`` itself, or a
    contiguous buffer of its shape and dtype there, copied into ``buffer`` once the transfer completes."""
    return buffer if wire_device == buffer.device and buffer.is_contiguous() else torch.empty_like(
        buffer, device=wire_device, memory_format=torch.contiguous_format)


def stages_through_host(backend_config: str, device: torch.device) -> bool:
    """Whether tensors on ``device`` must travel through host memory on a group with ``backend_config``.

    ``backend_config`` is ``dist.get_backend_config(group)``: ``"cpu:gloo,cuda:gloo"`` for a Gloo
    group, ``"cuda:nccl"`` for NCCL, ``"cpu:gloo,cuda:nccl"`` for a mixed one, or a bare backend
    name for every device. A host tensor never stages; another device's stages when the backend
    that would carry it (its own entry, else the host's) is Gloo.
    """
    if device.type == "cpu":
        return False
    backends: dict[str, str] = {}
    for entry in backend_config.lower().split(","):
        device_type, _, backend = entry.strip().rpartition(":")
        backends[device_type or "*"] = backend
    backend = backends.get(device.type, backends.get("*", backends.get("cpu")))
    return backend == "gloo"


class CollectiveError(RuntimeError):
    """A transfer of the package that could not complete, named by its operation, purpose and group.

    Raised when the backend fails one (Gloo: a peer closed its connection, or the group's timeout passed while a
    peer was elsewhere), so a rank that waits for a peer that failed or took another path stops within the
    timeout with a message that says which exchange it was, instead of the backend's bare socket error.
    """


class Pending:
    """A collective in flight (``async_op``): :meth:`wait` waits for it, a backend failure raised as
    :class:`CollectiveError` naming it, and returns what ``finish`` makes of it (the result on the caller's device:
    a gather's stack, None off its destination, or an all-reduced tensor)."""

    def __init__(self, work: dist.Work, finish: Callable[[], Tensor | None], failing_as: Communicator,
                 operation: str, purpose: str) -> None:
        self._work = work
        self._finish = finish
        self._failing_as = failing_as
        self._operation = operation
        self._purpose = purpose

    def wait(self) -> Tensor | None:
        with self._failing_as.named(self._operation, self._purpose):
            self._work.wait()
        return self._finish()


class Communicator:
    """Counted collectives and point-to-point transfers on one process group.

    ``rank``, ``world_size`` and every peer named in a call are the group's own: for a group of every
    rank (``dist.new_group()`` on all ranks) they are the global ones; for a subgroup (the ranks of one
    node, or the ranks with one local rank on every node, :mod:`lightning_dist.comm.nodes`) they count
    within it. Strategies use their own groups rather than WORLD because Lightning issues its own
    collectives on WORLD.

    Args:
        group: the process group (None: WORLD).
        level: for a hierarchy's groups, ``"intra_node"`` or ``"inter_node"``: every byte sent is also
            counted under that level (:attr:`CommStats.bytes_by_level`).
        counted_by: count into that communicator's :attr:`stats` (whatever object it holds then), so a
            strategy's groups add up in the one set of counters it logs and checkpoints.
        timeout: the group's timeout, named when a transfer fails (:class:`CollectiveError`); by default
            ``counted_by``'s.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, level: str | None = None,
                 counted_by: Communicator | None = None, timeout: timedelta | None = None) -> None:
        self._group = group
        self._closed = False
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._global_ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world_size))
        self._stats = CommStats()
        self._counted_by = counted_by
        self.level = check_level(level)
        self._backend_config = dist.get_backend_config(group)
        self.timeout = timeout if timeout is not None or counted_by is None else counted_by.timeout

    @contextmanager
    def named(self, operation: str, purpose: str) -> Iterator[None]:
        """Run a transfer; a backend failure becomes a :class:`CollectiveError` naming it."""
        try:
            yield
        except RuntimeError as failure:  # torch's DistBackendError and Gloo's errors are RuntimeErrors
            if isinstance(failure, CollectiveError):
                raise
            group = f"{self.level} group" if self.level is not None else "group"
            waited = f"the group's timeout ({self.timeout}, the strategy's `timeout` argument)" if self.timeout else (
                "the group's timeout")
            raise CollectiveError(
                f"lightning_dist: the {operation} for {purpose!r} on rank {self.rank} of a {group} of "
                f"{self.world_size} ranks did not complete: another rank of the group failed or stopped, called "
                f"another transfer (ranks whose decisions differ), or did not arrive within {waited}. "
                f"Backend: {failure}"
            ) from failure

    @property
    def stats(self) -> CommStats:
        return self._counted_by.stats if self._counted_by is not None else self._stats

    @stats.setter
    def stats(self, stats: CommStats) -> None:
        if self._counted_by is not None:
            raise ValueError("this Communicator counts into another one's stats; set those")
        self._stats = stats

    def global_rank(self, rank: int) -> int:
        """The global rank of this group's ``rank`` (what torch's point-to-point calls take)."""
        return self._global_ranks[rank]

    def group_rank(self, global_rank: int) -> int:
        """This group's rank of the process with ``global_rank`` (what a receive from any source reports)."""
        return self._global_ranks.index(global_rank)

    def _record(self, purpose: str, num_bytes: int, num_messages: int) -> None:
        self.stats.record(purpose, num_bytes, num_messages, self.level)

    def wire_device(self, device: torch.device) -> torch.device:
        """Where a tensor on ``device`` travels on this group: the host if the group's backend is Gloo for it."""
        return HOST if stages_through_host(self._backend_config, device) else device

    def _to_wire(self, tensor: Tensor) -> Tensor:
        return to_wire(tensor, self.wire_device(tensor.device))

    def _receive_buffer(self, buffer: Tensor) -> Tensor:
        return receive_buffer(buffer, self.wire_device(buffer.device))

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
        wire = self._to_wire(tensor)
        gathered = [torch.empty_like(wire) for _ in range(self.world_size)]
        with self.named("all-gather", purpose):
            dist.all_gather(gathered, wire, group=self.group)
        self._record(purpose, (self.world_size - 1) * _nbytes(tensor), self.world_size - 1)
        return torch.stack(gathered).to(tensor.device)

    def start_gather(self, tensor: Tensor, dst: int, purpose: str) -> Pending:
        """Start gathering every rank's ``tensor`` on ``dst`` without waiting; ``.wait()`` on the result gives the stack.

        The collective runs in the backend's own threads (Gloo) or stream (NCCL) while the caller
        goes on computing; ``tensor`` must not change until then. Counted at the senders: each of
        the ``m - 1`` other ranks sends its tensor once.
        """
        wire = self._to_wire(tensor)
        gathered = wire.new_empty(self.world_size, *wire.shape) if self.rank == dst else None
        outputs = list(gathered.unbind(0)) if gathered is not None else None
        with self.named("gather", purpose):
            work = dist.gather(wire, outputs, dst=self.global_rank(dst), group=self.group, async_op=True)
        if self.rank != dst:
            self._record(purpose, _nbytes(tensor), 1)
        return Pending(work, lambda: None if gathered is None else gathered.to(tensor.device), self, "gather", purpose)

    def all_reduce_sum_(self, tensor: Tensor, purpose: str) -> Tensor:
        """Sum ``tensor`` over all ranks in place."""
        with self.named("all-reduce", purpose):
            self._all_reduce_sum_(tensor)
        self.record_all_reduce(tensor, purpose)
        return tensor

    def start_all_reduce_sum_(self, tensor: Tensor, purpose: str) -> Pending:
        """Start summing ``tensor`` over all ranks in place without waiting; ``.wait()`` on the result returns it.

        The all-reduce runs in the backend's threads (Gloo) or stream (NCCL) while the caller goes on (copying the
        next bucket in, say); ``tensor`` must not be touched until then. Counted as :meth:`all_reduce_sum_`.
        """
        wire = self._to_wire(tensor)
        with self.named("all-reduce", purpose):
            work = dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self.record_all_reduce(tensor, purpose)

        def finish() -> Tensor:
            if wire is not tensor:
                tensor.copy_(wire)
            return tensor

        return Pending(work, finish, self, "all-reduce", purpose)

    def _all_reduce_sum_(self, tensor: Tensor) -> None:
        wire = self._to_wire(tensor)
        dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=self.group)
        if wire is not tensor:
            tensor.copy_(wire)

    def record_all_reduce(self, tensor: Tensor, purpose: str) -> None:
        """Count an all-reduce of ``tensor`` on this group (one this communicator ran, or DDP's bucket)."""
        # The ring's total 2 (m - 1) |t| split over ranks; rank 0 takes the remainder so the
        # sum over ranks is exact.
        total = 2 * (self.world_size - 1) * _nbytes(tensor)
        share = total // self.world_size + (total % self.world_size if self.rank == 0 else 0)
        self._record(purpose, share, 2 * (self.world_size - 1))

    def broadcast_(self, tensor: Tensor, src: int, purpose: str) -> Tensor:
        """Overwrite ``tensor`` on every rank with ``src``'s copy. Counted at the source."""
        wire = self._to_wire(tensor)
        with self.named("broadcast", purpose):
            dist.broadcast(wire, src=self.global_rank(src), group=self.group)
        if wire is not tensor:
            tensor.copy_(wire)
        if self.rank == src:
            self._record(purpose, (self.world_size - 1) * _nbytes(tensor), self.world_size - 1)
        return tensor

    def send(self, tensor: Tensor, destinations: Sequence[int], purpose: str) -> None:
        """Send ``tensor`` to each destination rank (one message each), waiting for completion."""
        wire = self._to_wire(tensor)
        with self.named("send", purpose):
            requests = [dist.isend(wire, dst=self.global_rank(dst), group=self.group) for dst in destinations]
            for request in requests:
                request.wait()
        self._record(purpose, len(destinations) * _nbytes(tensor), len(destinations))

    def receive(self, like: Tensor, sources: Sequence[int], purpose: str = "protocol") -> list[Tensor]:
        """One tensor shaped like ``like`` (its dtype, on its device) from each source rank, in the order of ``sources``
        (``purpose`` names the transfer if it fails; a receive counts no bytes)."""
        buffers = [torch.empty(like.shape, dtype=like.dtype, device=self.wire_device(like.device)) for _ in sources]
        with self.named("receive", purpose):
            requests = [dist.irecv(buffer, src=self.global_rank(src), group=self.group)
                        for buffer, src in zip(buffers, sources)]
            for request in requests:
                request.wait()
        return [buffer.to(like.device) for buffer in buffers]

    def exchange(
        self, sends: Sequence[tuple[Tensor, int]], receives: Sequence[tuple[Tensor, int]], purpose: str
    ) -> None:
        """One batch of point-to-point transfers: send each ``(tensor, dst)``, receive into each ``(buffer, src)``.

        All sends and receives are posted together (``batch_isend_irecv``) and waited for, so ranks
        that serve each other cannot deadlock. Counted at the sender: one message per send. Between
        one pair of ranks, receives must be listed in the order of the matching sends.
        """
        staged = [(buffer, self._receive_buffer(buffer)) for buffer, _ in receives]
        # Receives first: Gloo sends a payload only once the peer has announced the matching receive, on the
        # same connection as the payloads. Posted after the sends, a rank's announcement queued behind its own
        # payload, so the two directions of a pair ran one after the other (measured: 1.85x the time of an
        # all-reduce among the same ranks at 20 Mbit/s, benchmarks/balancing_sync/run.py).
        operations = [dist.P2POp(dist.irecv, wire, self.global_rank(src), group=self.group)
                      for (_, wire), (_, src) in zip(staged, receives)]
        operations += [dist.P2POp(dist.isend, self._to_wire(tensor), self.global_rank(dst), group=self.group)
                       for tensor, dst in sends]
        if operations:
            with self.named("exchange", purpose):
                for request in dist.batch_isend_irecv(operations):
                    request.wait()
        for buffer, wire in staged:
            if wire is not buffer:
                buffer.copy_(wire)
        self._record(purpose, sum(_nbytes(tensor) for tensor, _ in sends), len(sends))

    def send_object(self, payload: bytes, destination: int, purpose: str, device: torch.device) -> None:
        """Send a byte string (length first, then the bytes) to one rank; ``device`` is where the group's backend
        takes tensors (the host for Gloo)."""
        device = self.wire_device(device)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        self.send(torch.tensor([data.numel()], dtype=torch.int64, device=device), [destination], purpose)
        self.send(data, [destination], purpose)

    def receive_object(self, source: int, device: torch.device, purpose: str = "checkpoint") -> bytes:
        device = self.wire_device(device)
        (length,) = self.receive(torch.zeros(1, dtype=torch.int64, device=device), [source], purpose)
        (data,) = self.receive(torch.empty(int(length.item()), dtype=torch.uint8, device=device), [source], purpose)
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
        self.record_all_reduce(probe, "accounting")
        local = self.stats.to_vector()
        if extra is not None:
            local = [mine + theirs for mine, theirs in zip(local, extra.to_vector())]
        vector = torch.tensor(local + [syncs], dtype=torch.int64, device=self.wire_device(device))
        with self.named("all-reduce", "accounting"):
            self._all_reduce_sum_(vector)
        values = vector.tolist()
        return CommStats.from_vector(values[:-1], values[-1] if sum_syncs else syncs)
