"""DownpourSGD's transport: a server thread on rank 0 and a client on every other rank, over Gloo.

Why this shape:

- The server is a thread on rank 0 (which also trains), so a Downpour run needs no extra task
  slot under SLURM or torchrun. Rank 0's own worker calls the server directly, without bytes.
- All traffic is point-to-point on a dedicated Gloo group, also when the model trains with NCCL:
  the server waits for *any* worker (``recv`` without a source), which NCCL cannot do, and
  Lightning's collectives on WORLD never interleave with it.
- Messages carry a tag: headers (4 int64: kind, rank, pulled version, spare) use ``HEADER_TAG``,
  model vectors ``VECTOR_TAG``, so a receive from any source can only match a header.
- One push is one round trip: the worker sends header + update, the server applies it and sends
  back header + global model. With ``max_staleness`` set, the worker first sends only the header;
  the server answers ``STALE`` with the current model (the worker re-pulls and drops its stale
  update, no update bytes sent) or ``GO``, then the update follows. The bound is checked again
  when the update is applied: versions applied while it travelled (rank 0's own pushes) can make
  it too stale, and the server then drops it and answers ``STALE`` as well.
- Synchronous mode collects one update from every active worker, applies their mean as one
  server version (``GlobalModel.push_round``, in rank order: reproducible float sums) and only
  then answers all of them: a barrier per round.
- Vectors on the wire are in the server's master dtype (float32 for a bf16/fp16 model): a push
  is ``push_message`` (parameter update, then absolute buffers), a reply the global model; the
  worker converts the reply into its model's dtype. With ``compression`` a push is that message
  compressed by the worker and a reply the compressed change since the worker's mirror
  (:mod:`lightning_dist.algorithms.compressed_pushes`): the server decodes pushes and encodes
  replies; rank 0's own worker calls the server directly and sends no bytes, but gets its reply encoded as
  every worker does and continues from its mirror (so a synchronous round ends on one model everywhere).
- Failure: a worker that raises sends ``ABORT``; the server then answers every later request, and
  every worker blocked in a synchronous round, with ``ABORTED`` naming the failed rank, so all
  ranks stop with a clear error instead of waiting forever.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dist.algorithms.compressed_pushes import CompressedReplies
from lightning_dist.algorithms.parameter_server import GlobalModel, NonFiniteUpdateError, PushOutcome, check_finite
from lightning_dist.comm import Communicator

HEADER_TAG, VECTOR_TAG = 17, 18
# Worker -> server kinds.
PUSH, DONE, ABORT = 1, 2, 3
# Server -> worker statuses.
APPLIED, STALE, ABORTED, GO = 1, 2, 3, 4
SERVER_RANK = 0


class DownpourAbortedError(RuntimeError):
    """Another rank (or the server) failed, so this rank stops too."""


class Reply(NamedTuple):
    """The server's answer to a push: whether it was applied, and the global model to continue from."""

    applied: bool
    version: int
    staleness: int
    vector: Tensor


def _header(*values: int) -> Tensor:
    return torch.tensor(list(values) + [0] * (4 - len(values)), dtype=torch.int64)


class _Channel:
    """Tagged, counted point-to-point messages on the parameter-server group (CPU tensors); ranks are the group's."""

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.group = comm.group
        self._send_lock = threading.Lock()

    def send(self, tensor: Tensor, dst: int, tag: int) -> None:
        # Two threads of rank 0 (server and trainer) may answer workers; one send at a time.
        with self._send_lock:
            dist.send(tensor.contiguous(), dst=self.comm.global_rank(dst), group=self.group, tag=tag)
            # Under the communicator's level: under hierarchy="node" the group is a slice, one rank per node (node 0's
            # local rank j serves local rank j of every other node), so every peer is on another node: inter_node.
            # A flat run's group counts no level. A server's own rank pushes by local calls, sending nothing.
            self.comm.stats.record("protocol", tensor.numel() * tensor.element_size(), 1, self.comm.level)

    def recv_header(self, src: int | None = None) -> tuple[int, list[int]]:
        header = torch.empty(4, dtype=torch.int64)
        sender = dist.recv(header, src=None if src is None else self.comm.global_rank(src), group=self.group,
                           tag=HEADER_TAG)
        return self.comm.group_rank(sender), header.tolist()

    def recv_vector(self, like: Tensor, src: int) -> Tensor:
        vector = torch.empty_like(like)
        dist.recv(vector, src=self.comm.global_rank(src), group=self.group, tag=VECTOR_TAG)
        return vector


class ParameterServer:
    """Rank 0's side: the global model, a thread serving the other ranks, direct calls for rank 0.

    Args:
        comm: communicator on the dedicated Gloo group (holding every rank).
        model: the global model and its update rule.
        synchronous: collect one update per active worker per round and answer them together.
        replies: with compression, decodes the other ranks' pushes and encodes their replies.
    """

    def __init__(self, comm: Communicator, model: GlobalModel, synchronous: bool,
                 replies: CompressedReplies | None = None) -> None:
        self.model = model
        self.synchronous = synchronous
        self.replies = replies
        self._channel = _Channel(comm)
        self._state = threading.Condition()
        self._remote = set(range(comm.world_size)) - {SERVER_RANK}
        self._local_active = True
        self._round: dict[int, tuple[Tensor, int]] = {}
        self._rounds_done = 0
        self._local_reply: Reply | None = None
        self._abort_reason: str | None = None
        self._failed_rank = -1
        self._thread = threading.Thread(target=self._serve, name="downpour-parameter-server", daemon=True)

    @property
    def bounded(self) -> bool:
        return self.model.max_staleness is not None

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------------ rank 0's own worker

    def push_local(self, update: Tensor, pulled_version: int) -> Reply:
        """Rank 0's push: applied at once (async) or when the round is complete (sync). Its reply is what a remote
        worker's would be: with compression, encoded against rank 0's mirror (no bytes travel)."""
        try:
            check_finite(update, SERVER_RANK)
        except NonFiniteUpdateError as exc:
            self.abort(str(exc), SERVER_RANK)
            raise
        with self._state:
            self._raise_if_aborted()
            if not self.synchronous:
                outcome = self.model.push(update, pulled_version, SERVER_RANK)
                return self._as_sent(SERVER_RANK, self._reply_of(outcome, self.model.vector.clone()))
            self._round[SERVER_RANK] = (update, pulled_version)
            round_number = self._rounds_done
            self._complete_round_if_ready()
            while self._rounds_done == round_number and self._abort_reason is None:
                self._state.wait()
            self._raise_if_aborted()
            assert self._local_reply is not None
            return self._as_sent(SERVER_RANK, self._local_reply)

    def version(self) -> int:
        """The global model's version now (no copy of the model)."""
        with self._state:
            return self.model.version

    def snapshot(self) -> tuple[Tensor, int]:
        """A consistent copy of the global model and its version."""
        with self._state:
            return self.model.vector.clone(), self.model.version

    def state_dict(self) -> dict:
        """The global model's state and, with compression, the reply mirrors (taken under one lock: they agree)."""
        with self._state:
            state = self.model.state_dict()
            if self.replies is not None:
                state["replies"] = self.replies.state_dict()
            return state

    def metrics(self) -> dict[str, float]:
        with self._state:
            return self.model.metrics()

    def finish_local(self, timeout: float | None = None) -> None:
        """Rank 0 has trained its last step: wait until every other worker is done, then stop."""
        with self._state:
            self._local_active = False
            self._complete_round_if_ready()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise DownpourAbortedError(f"the parameter server still had workers after {timeout} s")
        with self._state:
            self._raise_if_aborted()

    def abort(self, reason: str, failed_rank: int = SERVER_RANK) -> None:
        """Stop the protocol: every waiting and every later request is answered ``ABORTED``."""
        with self._state:
            self._abort_locked(reason, failed_rank)

    def close(self, timeout: float) -> None:
        """After an exception on rank 0: keep answering ``ABORTED`` until the workers are told, then stop."""
        self._local_active = False
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------ the server thread

    def _serve(self) -> None:
        try:
            while True:
                with self._state:
                    if not self._remote:
                        return
                sender, (kind, _, pulled_version, _) = self._channel.recv_header()
                if kind == PUSH:
                    self._serve_push(sender, pulled_version)
                elif kind == DONE:
                    with self._state:
                        self._remote.discard(sender)
                        self._complete_round_if_ready()
                elif kind == ABORT:
                    with self._state:
                        self._remote.discard(sender)
                        self._abort_locked(f"rank {sender} stopped with an exception", sender)
                else:
                    raise RuntimeError(f"parameter server received an unknown message kind {kind} from rank {sender}")
        except BaseException as exc:  # noqa: BLE001 - reported to rank 0's trainer, never swallowed
            with self._state:
                self._abort_locked(f"the parameter server on rank {SERVER_RANK} failed: {exc!r}", SERVER_RANK)

    def _serve_push(self, sender: int, pulled_version: int) -> None:
        if self.bounded:
            with self._state:
                aborted = self._abort_reason is not None
                stale = not aborted and not self.synchronous and self.model.too_stale(pulled_version)
                vector = self.model.vector.clone() if stale else None
                if aborted:
                    self._tell_aborted(sender)
                    return
                if stale:
                    outcome = self.model.refuse(pulled_version)
            if stale:
                assert vector is not None
                self._send_reply(sender, self._reply_of(outcome, vector))
                return
            self._channel.send(_header(GO), sender, HEADER_TAG)
        if self.replies is None:
            update = self._channel.recv_vector(self.model.vector, sender)
        else:
            update = self.replies.decode_push(self._channel.recv_vector(self.replies.push_like(), sender))
        with self._state:
            if self._abort_reason is not None:
                self._tell_aborted(sender)
                return
            try:
                check_finite(update, sender)
            except NonFiniteUpdateError as exc:
                self._abort_locked(str(exc), sender)
                self._tell_aborted(sender)
                return
            if self.synchronous:
                self._round[sender] = (update, pulled_version)
                self._complete_round_if_ready()
                return
            outcome = self.model.push(update, pulled_version, sender)
            vector = self.model.vector.clone()
        self._send_reply(sender, self._reply_of(outcome, vector))

    # ------------------------------------------------------------ helpers (state lock held)

    def _complete_round_if_ready(self) -> None:
        if not self.synchronous or not self._round or self._abort_reason is not None:
            return
        participants = set(self._remote) | ({SERVER_RANK} if self._local_active else set())
        if not participants <= set(self._round):
            return
        ranks = sorted(self._round)
        outcomes = self.model.push_round([(*self._round[rank], rank) for rank in ranks])
        vector = self.model.vector.clone()
        self._round.clear()
        for rank, outcome in zip(ranks, outcomes):
            # Every rank continues from the round's result, so from its version.
            reply = Reply(outcome.accepted, self.model.version, outcome.staleness, vector)
            if rank == SERVER_RANK:
                self._local_reply = reply
            else:
                self._send_reply(rank, reply)
        self._rounds_done += 1
        self._state.notify_all()

    def _abort_locked(self, reason: str, failed_rank: int) -> None:
        if self._abort_reason is None:
            self._abort_reason = reason
            self._failed_rank = failed_rank
        for rank in [rank for rank in self._round if rank != SERVER_RANK]:
            self._tell_aborted(rank)
        self._round.clear()
        self._state.notify_all()

    def _tell_aborted(self, rank: int) -> None:
        # A told worker raises and sends nothing more, so the server stops waiting for it.
        self._channel.send(_header(ABORTED, self._failed_rank), rank, HEADER_TAG)
        self._remote.discard(rank)

    def _raise_if_aborted(self) -> None:
        if self._abort_reason is not None:
            raise DownpourAbortedError(f"DownpourSGD stopped: {self._abort_reason}")

    def _reply_of(self, outcome: PushOutcome, vector: Tensor) -> Reply:
        return Reply(outcome.accepted, outcome.version, outcome.staleness, vector)

    def _as_sent(self, rank: int, reply: Reply) -> Reply:
        """``reply`` with its vector as it goes to ``rank``: the global model, or with compression its encoding
        against ``rank``'s mirror (which moves as the worker's will)."""
        return reply if self.replies is None else reply._replace(vector=self.replies.encode_reply(rank, reply.vector))

    def _send_reply(self, rank: int, reply: Reply) -> None:
        self._channel.send(_header(APPLIED if reply.applied else STALE, reply.version, reply.staleness), rank,
                           HEADER_TAG)
        self._channel.send(self._as_sent(rank, reply).vector, rank, VECTOR_TAG)


class ParameterServerClient:
    """A worker's side (every rank but 0): push the accumulated update, receive the global model.

    Args:
        comm: communicator on the dedicated Gloo group.
        bounded: the server bounds staleness (a header round trip before each update).
        reply_like: an empty tensor of a reply's size and dtype (the global model, or a compressed reply).
    """

    def __init__(self, comm: Communicator, bounded: bool, reply_like: Tensor) -> None:
        self._channel = _Channel(comm)
        self._rank = comm.rank
        self._bounded = bounded
        self._reply_like = reply_like
        self.closed = False

    def push(self, update: Tensor, pulled_version: int) -> Reply:
        self._channel.send(_header(PUSH, self._rank, pulled_version), SERVER_RANK, HEADER_TAG)
        if self._bounded:
            header = self._receive_header()
            if header[0] == GO:
                self._channel.send(update, SERVER_RANK, VECTOR_TAG)
                header = self._receive_header()
        else:
            self._channel.send(update, SERVER_RANK, VECTOR_TAG)
            header = self._receive_header()
        status, version, staleness, _ = header
        vector = self._channel.recv_vector(self._reply_like, SERVER_RANK)
        return Reply(status == APPLIED, version, staleness, vector)

    def done(self) -> None:
        self._channel.send(_header(DONE, self._rank), SERVER_RANK, HEADER_TAG)
        self.closed = True

    def abort(self) -> None:
        """Best effort: tell the server this rank failed (it may be gone already)."""
        if self.closed:
            return
        self.closed = True
        try:
            self._channel.send(_header(ABORT, self._rank), SERVER_RANK, HEADER_TAG)
        except Exception:  # noqa: BLE001 - the rank is failing already; the original error matters
            pass

    def _receive_header(self) -> list[int]:
        _, header = self._channel.recv_header(SERVER_RANK)
        if header[0] == ABORTED:
            self.closed = True
            failed = f"rank {header[1]} failed" if header[1] >= 0 else "another rank failed"
            raise DownpourAbortedError(f"DownpourSGD stopped: {failed}; see that rank's error")
        return header
