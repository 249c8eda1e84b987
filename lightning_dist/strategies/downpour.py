"""DownpourSGD (Dean et al. 2012; the base algorithm of paper 000), ``strategy="downpour_sgd"``.

Every rank trains its own replica. Every ``push_every`` optimizer steps it sends its accumulated
update to a parameter server and continues from the global model the server sends back, without
waiting for the other ranks (``synchronous=False``). The server, a thread on rank 0, applies
updates as they arrive, or the mean of each round's updates with ``synchronous=True``; it keeps
floating-point buffers (BatchNorm statistics) as the mean of the ranks' latest ones, not as sums
of deltas, and its global model in float32 whatever the model's dtype
(``lightning_dist.algorithms.parameter_server``; transport in
``lightning_dist.strategies.parameter_server``).

Asynchrony needs one change to Lightning's loop. Lightning 2.6 broadcasts a SIGTERM flag from
rank 0 before every training batch (``_TrainingEpochLoop._broadcast_sigterm_tensor``), a
lockstep collective that makes every rank wait for the slowest. For Downpour runs only, this
strategy replaces it on its own trainer's loop by nothing: torchrun and SLURM deliver SIGTERM to
every rank, and Lightning already stops a rank that received it after the current batch. If a
Lightning upgrade moves that broadcast, ``setup`` raises instead of silently running in lockstep
(and the slow-rank test in ``tests/strategies/test_downpour.py`` fails).

What stays synchronous: validation and checkpoints at epoch ends (Lightning's own collectives),
which evaluate and save the server's global model, and the end of ``fit``, where every rank
waits for the others and receives the final global model.

With ``hierarchy="node"`` a node is one worker (DDP inside it) and the server is sharded the way the
hierarchy cuts exchanges: local rank ``j`` of every node pushes chunk ``j`` of the node's model to a
server thread on node 0's local rank ``j``, over a Gloo group of the ranks with that local rank
(Dean et al.'s parameter server is sharded too). Shards apply pushes independently, so a node's model
after a push is assembled (an all-gather inside the node) from chunks at their shards' own versions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dist.counters import counters_kept_in_total
from lightning_dist.algorithms.arguments import check_compression, check_flag, check_steps
from lightning_dist.algorithms.averaging import accumulation_dtype
from lightning_dist.algorithms.compressed_pushes import CompressedPushes, CompressedReplies, reply_nbytes
from lightning_dist.algorithms.parameter_server import GlobalModel, check_max_staleness, push_message
from lightning_dist.comm import CommStats, Communicator, new_group
from lightning_dist.strategies._downpour_resize import server_shard, whole_server_state
from lightning_dist.strategies._resize import resized_comm_stats
from lightning_dist.strategies.local_update import LocalUpdateStrategy
from lightning_dist.strategies.parameter_server import SERVER_RANK, ParameterServer, ParameterServerClient

_SIGTERM_BROADCAST = "_broadcast_sigterm_tensor"


class DownpourSGDStrategy(LocalUpdateStrategy):
    """Asynchronous parameter-server training (DownpourSGD).

    A checkpoint resumed in another layout (another number of processes, or as many cut into other
    nodes: :mod:`lightning_dist.strategies._resize`) keeps the server's state, which is one model's
    whoever pushed to it: the server is rebuilt whole from the checkpoint's (the flat server, or the
    hierarchy's shards) and cut for this run (one server on rank 0, or one shard per local rank of
    node 0), keeping the global model (in its float32 master), its version and the server's counters
    (accepted, rejected, staleness) in total (:mod:`lightning_dist.strategies._downpour_resize`).
    What belongs to a worker is reset: every rank starts from the checkpoint's model (the global
    model), as pulled at the server's version with no steps since a push, and the server's
    per-worker buffer entries are the global model's buffers for each learner now present (a
    worker's entry before its first push). Ranks take saved ranks' optimizer and RNG states
    (:func:`~lightning_dist.strategies._resize.followed_saved_rank`); pushes, rejected pushes and
    bytes are kept in total.

    Args:
        push_every: optimizer steps between pushes (``n_push`` of paper 000's DownpourSGD, default
            5, the paper's "update frequency").
        synchronous: if True, the server waits for one update from every rank, applies their mean
            (paper 001's synchronous SGD) and only then answers (a barrier per round), so
            synchronous and asynchronous training run the same code.
        max_staleness: if set, an update based on a global model more than ``max_staleness``
            versions old is dropped and the worker re-pulls the current model before going on
            (staleness = server versions between the worker's pull and its push; a synchronous
            round is one version and its updates have staleness 0, so none is dropped there).
            None (default) applies every update, as DownpourSGD does.
        staleness_aware: the server divides each asynchronous update by its staleness plus one
            (Zhang et al., IJCAI 2016; :mod:`lightning_dist.algorithms.parameter_server`), so m
            workers pushing in turn move the global model about as far as one synchronous round does
            per unit of time. Default True: added in full (False, Dean et al.'s and paper 001's rule)
            the updates of 4 ranks training the package's language model with AdamW ended at loss 3.28
            where the averaging strategies passed 2.68. No effect with ``synchronous=True``
            (staleness 0).
        compression: None (default): pushes and replies travel in float32. ``"bf16"`` or ``"int8"``: a
            push is the update in that format with error feedback, a reply the global model's change
            since what the worker holds (:mod:`lightning_dist.algorithms.compressed_pushes`): half or
            about a quarter of the bytes through the server's port. Rank 0's own pushes are local
            calls and stay exact.
        finish_timeout: seconds rank 0 waits at the end of ``fit`` for the other ranks to finish
            their last steps.
        **kwargs: passed to :class:`LocalUpdateStrategy` (``seed`` and Lightning's DDP arguments).
    """

    fault_tolerance_unsupported = (
        ": its learners push to and pull from parameter-server shards asynchronously, so no window ends everywhere "
        "at once for a quorum to close, and a lost shard is part of the global model lost. Use "
        "PeriodicAveragingStrategy (periodic averaging or DiLoCo) with fault_tolerance")

    strategy_name = "downpour_sgd"

    def __init__(
        self,
        push_every: int = 5,
        synchronous: bool = False,
        max_staleness: int | None = None,
        staleness_aware: bool = True,
        compression: str | None = None,
        finish_timeout: float = 1800.0,
        **kwargs: Any,
    ) -> None:
        check_steps("push_every", push_every, "optimizer steps between pushes")
        check_flag("synchronous", synchronous)
        check_max_staleness(max_staleness)
        check_flag("staleness_aware", staleness_aware)
        if not (isinstance(finish_timeout, (int, float)) and finish_timeout > 0):
            raise ValueError(f"finish_timeout must be a number of seconds > 0; got {finish_timeout!r}")
        codec = check_compression(compression, "DownpourSGDStrategy's pushes and replies (lightning_dist.algorithms.compressed_pushes)")
        # Not the base class's compressed full synchronizations: Downpour has none (its consensus is a broadcast).
        super().__init__(**kwargs)
        self.compression = codec
        self.push_every = push_every
        self.synchronous = synchronous
        self.max_staleness = max_staleness
        self.staleness_aware = staleness_aware
        self.finish_timeout = float(finish_timeout)
        self._ps_comm: Communicator | None = None
        self._server: ParameterServer | None = None
        self._client: ParameterServerClient | None = None
        self._pulled: Tensor | None = None
        self._pulled_version = 0
        self._steps_since_push = 0
        self._rejected_pushes = 0
        self._pushes: CompressedPushes | None = None
        self._restarted_mirror: Tensor | None = None
        self._restored_server: Mapping[str, Any] | None = None
        self._checkpoint_server_state: dict[str, Any] | None = None
        self._final_server_state: dict[str, Any] | None = None
        self._final_server_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------ set-up

    def setup_environment(self) -> None:
        super().setup_environment()
        # Gloo whatever the model's backend: the server receives from any rank, which NCCL cannot.
        if self._ps_comm is not None:
            self._ps_comm.close()
        if self._hierarchy is None:
            self._ps_comm = Communicator(new_group(backend="gloo", timeout=self._timeout))
        else:  # one server shard per local rank: the ranks of that local rank, one per node
            group, _ = dist.new_subgroups_by_enumeration(self._hierarchy.layout.slices(), timeout=self._timeout,
                                                         backend="gloo")
            self._ps_comm = Communicator(group, level="inter_node")

    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        epoch_loop = trainer.fit_loop.epoch_loop
        if not callable(getattr(epoch_loop, _SIGTERM_BROADCAST, None)):
            raise RuntimeError(
                f"DownpourSGDStrategy cannot make this Lightning version asynchronous: "
                f"{type(epoch_loop).__name__}.{_SIGTERM_BROADCAST} (the per-step SIGTERM broadcast of "
                "Lightning 2.6) is gone, so the per-step synchronization may have moved; pin lightning 2.6"
            )
        # Every rank receives SIGTERM itself (torchrun, SLURM); Lightning stops it after the batch.
        setattr(epoch_loop, _SIGTERM_BROADCAST, lambda: None)

    def on_replicas_initialized(self, vector: Tensor) -> None:
        self._pulled = self.learner_part(vector).detach().cpu().clone()
        self._pulled_version = 0
        self._steps_since_push = 0
        if self.compression is not None:
            self._pushes = CompressedPushes(self.compression, self._pulled, self.learner_num_parameters())

    def on_train_start(self) -> None:
        super().on_train_start()
        ps_comm = self._require_ps_comm()
        if ps_comm.rank == SERVER_RANK:
            assert self._pulled is not None
            num_parameters = self.learner_num_parameters()
            model = GlobalModel(self._pulled, num_parameters, ps_comm.world_size, self.max_staleness,
                                self.staleness_aware)
            if self._restored_server is not None:
                model.load_state_dict(self._restored_server)
            replies = None
            if self.compression is not None:
                mirror = self._pulled if self._restarted_mirror is None else self._restarted_mirror
                replies = CompressedReplies(self.compression, mirror, num_parameters, ps_comm.world_size)
                if self._restarted_mirror is None and self._restored_server is not None:
                    replies.load_state_dict(self._restored_server["replies"])
            self._server = ParameterServer(ps_comm, model, self.synchronous, replies)
            self._server.start()
        else:
            assert self._pulled is not None
            if self.compression is None:
                reply_like = torch.empty(self._pulled.numel(), dtype=accumulation_dtype(self._pulled.dtype))
            else:
                num_parameters = self.learner_num_parameters()
                num_bytes = reply_nbytes(num_parameters, self._pulled.numel() - num_parameters, self.compression)
                reply_like = torch.empty(num_bytes, dtype=torch.uint8)
            self._client = ParameterServerClient(ps_comm, self.max_staleness is not None, reply_like)
        # No push may reach the server before it exists and holds the restored state.
        dist.barrier(group=self.comm.group)

    # ------------------------------------------------------------------ the protocol

    def after_local_step(self, step: int) -> None:
        self._steps_since_push += 1
        if self._steps_since_push >= self.push_every:
            self._push()

    def _push(self) -> None:
        assert self._pulled is not None
        local = self.learner_part(self.model_vector.get()).cpu()
        message = push_message(local, self._pulled, self.learner_num_parameters())
        remote = self._server is None  # the server's own worker pushes by a local call: no bytes, its push exact
        if not remote:
            reply = self._server.push_local(message, self._pulled_version)
        else:
            assert self._client is not None
            reply = self._client.push(self._pushes.encode_push(message) if self._pushes is not None else message,
                                      self._pulled_version)
        if not reply.applied:
            self._rejected_pushes += 1
            if remote and self._pushes is not None:  # too stale, at the header or on arrival: the residual stays owed
                self._pushes.refused()
        # Every worker continues from its mirror of the encoded reply with compression, the server's own one too.
        vector = reply.vector if self._pushes is None else self._pushes.decode_reply(reply.vector)
        self.model_vector.set(self.learner_whole(vector.to(self.root_device), "protocol"))
        # What the replica now holds (the float32 reply rounded to the model's dtype), so the next
        # update is exactly the local change and the server's float32 bits are never pushed back.
        self._pulled = self.learner_part(self.model_vector.get()).cpu()
        self._pulled_version = reply.version
        self._steps_since_push = 0
        self._syncs += 1

    def consensus(self, purpose: str) -> Tensor:
        """The server's global model once every rank's updates so far are in, broadcast from rank 0.

        Every rank calls this after its last push, and a push returns once the server applied it;
        the barrier makes rank 0 wait for that before its snapshot. Without it a slower rank's last
        update could land between the validation's snapshot and the checkpoint's, and the best
        checkpoint would hold another model than the one that scored best.
        """
        like = self.learner_part(self.model_vector.get())
        if self._server is not None or self._client is not None:
            dist.barrier(group=self.comm.group)
        if self._server is not None:
            vector, _ = self._server.snapshot()
            vector = vector.to(like.device, like.dtype)
        else:
            vector = torch.empty_like(like)
        # Each shard's part from its server (node 0's ranks under a hierarchy), then the parts inside every node.
        return self.learner_whole(self.learners.broadcast_(vector, src=SERVER_RANK, purpose=purpose), purpose)

    def on_train_end(self) -> None:
        if self._server is not None or self._client is not None:
            if self._steps_since_push > 0:
                self._push()
            if self._server is not None:
                self._server.finish_local(self.finish_timeout)
            else:
                assert self._client is not None
                self._client.done()
        self._replicas_in_sync = False  # every rank now takes the final global model
        super().on_train_end()
        if self._server is not None:
            self._final_server_state = self._server.state_dict()
            self._final_server_metrics = self._server.metrics()
        self._server = None
        self._client = None

    def on_replicas_averaged(self, vector: Tensor) -> None:
        """Every replica now holds the server's final model: it is what each rank last pulled.

        Paper 000's update is the local model minus the parameters at the last pull, which the local
        model started from. Left at the reply to the rank's own last push, a fit resumed from a
        checkpoint written after this ``fit`` would push ``final - pulled``: every update the other
        ranks pushed since, a second time. The version comes from the server (8 bytes from rank 0).
        """
        version = torch.tensor([self._server.version() if self._server is not None else 0], device=self.root_device)
        self.learners.broadcast_(version, src=SERVER_RANK, purpose="final")  # this rank's shard's version
        self._pulled = self.learner_part(vector).detach().cpu().clone()
        self._pulled_version = int(version.item())
        self._steps_since_push = 0

    def on_exception(self, exception: BaseException) -> None:
        if self._client is not None:
            self._client.abort()
        if self._server is not None:
            self._server.abort(f"rank {SERVER_RANK} stopped with {type(exception).__name__}: {exception}")
            self._server.close(timeout=30.0)
        super().on_exception(exception)
        if self._ps_comm is not None:
            self._ps_comm.close()

    # ------------------------------------------------------------------ counters and state

    def sum_comm_stats(self) -> CommStats:
        extra = self._ps_comm.stats if self._ps_comm is not None else None
        return self.comm.summed_stats(self._syncs, self.root_device, extra=extra, sum_syncs=True)

    def log_progress(self) -> None:
        """Mid-epoch logging without a collective (ranks are not in step): rank 0's server counters.

        The counters summed over ranks (``comm/*``) are logged after each validation and at the
        end of ``fit``, where all ranks meet anyway.
        """
        if self._server is not None:
            self.log_metrics(self.protocol_metrics())

    def on_validation_end(self) -> None:
        super().on_validation_end()
        if self._is_fitting():
            self.log_comm_stats()

    def protocol_metrics(self) -> dict[str, float]:
        metrics = {"downpour/rejected_pushes_local": float(self._rejected_pushes)}
        metrics.update(self._server.metrics() if self._server is not None else self._final_server_metrics)
        return metrics

    def lightning_module_state_dict(self) -> dict[str, Any]:
        # All ranks are here (Lightning saves on every rank) and none is pushing: take the server
        # state now so the checkpoint's global model, server state and worker states agree.
        if self._is_fitting() and (self._server is not None or self._client is not None):
            dist.barrier(group=self.comm.group)
            if self._server is not None:
                self._checkpoint_server_state = self._server.state_dict()
        return super().lightning_module_state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)
        self._checkpoint_server_state = None  # taken for this checkpoint only

    def _server_state(self) -> dict[str, Any] | None:
        """This rank's server (shard) state: as of the checkpoint's barrier while one is written, else now."""
        if self._checkpoint_server_state is not None:
            return self._checkpoint_server_state
        return self._server.state_dict() if self._server is not None else self._final_server_state

    def protocol_state_dict(self) -> dict[str, Any]:
        return {"server": self._server_state()}

    def load_protocol_state_dict(self, state: Mapping[str, Any]) -> None:
        self._restored_server = state["server"]

    def resized_protocol_state(self, state: Mapping[str, Any], written_by: int) -> Mapping[str, Any]:
        """The saved server as it is: a hierarchical checkpoint holds its other shards in the workers' states, so
        :meth:`resized_worker_state`, which sees them, rebuilds and re-cuts the server (:mod:`._downpour_resize`)."""
        return state

    def resized_worker_state(self, saved: Sequence[Mapping[str, Any]], written_by: int) -> Mapping[str, Any]:
        """A worker continues from the model it now holds (the checkpoint's), pulled at the server's version, with
        no steps since a push; its pushes, rejected pushes and bytes on the server's group are kept in total. Its
        ``server_shard`` is the server it serves in this layout (:mod:`._downpour_resize`): the whole server rebuilt
        from the checkpoint's (the protocol's server, loaded just before, or the saved shards) and cut for this run:
        the whole flat, chunk ``j`` on local rank ``j`` under a hierarchy (used on the ranks that serve)."""
        rank, world_size = self.comm.rank, self.world_size
        pushes, rejected = counters_kept_in_total(
            [[worker["pushes"], worker["rejected_pushes"]] for worker in saved], rank, world_size)
        whole = whole_server_state(self._restored_server, saved, self.model_vector.numel, self.num_learners)
        if self._hierarchy is None:
            server = server_shard(whole, 1, 0)
        else:
            server = server_shard(whole, self._hierarchy.node.world_size, self._hierarchy.node.rank)
        return {
            "pulled": self.learner_part(self.model_vector.get()).cpu(),
            "pulled_version": 0 if server is None else int(server["version"]),
            "steps_since_push": 0,
            "rejected_pushes": rejected,
            "pushes": pushes,
            "ps_comm": resized_comm_stats([worker["ps_comm"] for worker in saved], rank, world_size).state_dict(),
            "server_shard": server,
        }

    def worker_state_dict(self) -> dict[str, Any]:
        ps_stats = self._ps_comm.stats.state_dict() if self._ps_comm is not None else None
        state = {
            "pulled": None if self._pulled is None else self._pulled.clone(),
            "pulled_version": self._pulled_version,
            "steps_since_push": self._steps_since_push,
            "rejected_pushes": self._rejected_pushes,
            "pushes": self._syncs,
            "ps_comm": ps_stats,
        }
        if self._hierarchy is not None:  # the server is sharded: each shard's state with the rank that serves it
            state.update(local_rank=self._hierarchy.node.rank, server_shard=self._server_state())
        return state

    def load_worker_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("pulled") is not None:
            self._pulled = state["pulled"].clone()
        self._pulled_version = int(state.get("pulled_version", 0))
        self._steps_since_push = int(state.get("steps_since_push", 0))
        self._rejected_pushes = int(state.get("rejected_pushes", 0))
        self._syncs = int(state.get("pushes", self._syncs))  # per rank: ranks push at their own pace
        if state.get("ps_comm") is not None:
            self._require_ps_comm().stats = CommStats.from_state_dict(state["ps_comm"])
        if "server_shard" in state:  # under a hierarchy the rank's own shard; re-cut in another layout
            self._restored_server = state["server_shard"]

    def compression_state_dict(self) -> dict[str, Any] | None:
        """This worker's push residual and mirror (the server's mirrors are in the protocol state)."""
        return None if self._pushes is None else self._pushes.state_dict()

    def _resume_compression(self, saved: Mapping[str, Any] | None, consensus: Tensor | None) -> None:
        """The worker's own residual and mirror at the same world size; else (another world size, or a checkpoint
        written without compression) every mirror, the workers' and the server's, restarts at the checkpoint's
        consensus with no residual, as every worker restarts from that model (its residual, a few quantization
        errors' worth of pushed updates, is dropped with the rest of its unpushed progress)."""
        if self._pushes is None:
            return
        if saved is not None:
            self._pushes.load_state_dict(dict(saved))
            self._restarted_mirror = None
        else:
            assert consensus is not None
            self._pushes = CompressedPushes(self.compression, self.learner_part(consensus).cpu(),
                                            self.learner_num_parameters())
            self._restarted_mirror = self._pushes.mirror.clone()

    def _require_ps_comm(self) -> Communicator:
        if self._ps_comm is None:
            raise RuntimeError("DownpourSGDStrategy is not set up: its parameter-server group does not exist yet")
        return self._ps_comm
