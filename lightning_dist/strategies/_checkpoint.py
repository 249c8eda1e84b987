"""The checkpoint half of :class:`~lightning_dist.strategies.local_update.LocalUpdateStrategy`.

A local-update run has one replica per rank, so a checkpoint holds more than Lightning's one model:

- ``state_dict`` is the consensus (the average; a parameter server's global model in DownpourSGD),
  so the file loads as one model for inference or fine-tuning;
- under :data:`CHECKPOINT_KEY`, the protocol state (identical on every rank, saved once) and every
  rank's part: its replica, optimizer state, the precision plugin's state (the loss scaler of
  ``precision="16-mixed"``: with no gradient all-reduce tying them, each rank's scale follows its
  own gradients), communication counters, per-rank protocol state, the state of compressed
  exchanges (the common model and the error-feedback residuals) and RNG states. Each rank
  pickles its part on the host and sends it to rank 0, which writes the file.

The checkpoint also records its layout (the hierarchy and the learners as lists of global ranks).
Resumed with the same learners, rank for rank, every rank continues from its own part, bit for bit;
resumed with any other layout (another world size, or as many processes cut into other nodes), the
rule of :mod:`lightning_dist.strategies._resize` applies: every rank starts from the consensus, and
the ranks of a node from one saved learner's optimizer state.
"""

from __future__ import annotations

import io
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from lightning.fabric.utilities.optimizer import _optimizer_to_device
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_dist.comm import CommStats
from lightning_dist.strategies._resize import followed_saved_rank, learner_groups, resized_comm_stats

CHECKPOINT_KEY = "lightning_dist"


def pack_replica(state: Mapping[str, Any]) -> bytes:
    """A rank's checkpoint part as bytes for the trip to rank 0."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def unpack_replica(payload: bytes) -> dict[str, Any]:
    """:func:`pack_replica`'s bytes back, every tensor on the host whatever device it was saved from. Tensors and
    plain values only (``weights_only=True``): in a multi-node job the bytes come over the network."""
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)


def rng_states(device: torch.device) -> dict[str, Any]:
    """This process's random number generators (torch's, ``device``'s CUDA one, Python's, NumPy's) as tensors and
    plain values (what ``torch.load(weights_only=True)`` reads back)."""
    numpy_state = np.random.get_state()
    return {
        "torch_rng": torch.get_rng_state(),
        # This rank's GPU only: get_rng_state_all() would start a CUDA context on every visible GPU.
        "cuda_rng": [torch.cuda.get_rng_state(device)] if device.type == "cuda" else [],
        "python_rng": random.getstate(),
        "numpy_rng": {"keys": torch.from_numpy(numpy_state[1].astype(np.int64)), "rest": list(numpy_state[2:])},
    }


def restore_rng_states(states: Mapping[str, Any], device: torch.device) -> None:
    """Set the generators :func:`rng_states` read."""
    torch.set_rng_state(states["torch_rng"])
    if states["cuda_rng"]:
        (cuda_rng,) = states["cuda_rng"]
        torch.cuda.set_rng_state(cuda_rng, device)
    random.setstate(states["python_rng"])
    numpy_rng = states["numpy_rng"]
    np.random.set_state(("MT19937", numpy_rng["keys"].numpy().astype(np.uint32), *numpy_rng["rest"]))


class ReplicaCheckpoints:
    """Save and restore every rank's replica: mixed into ``LocalUpdateStrategy`` ahead of ``DDPStrategy``.

    Uses the strategy's model vector, communicator, counters and protocol hooks
    (``protocol_state_dict``, ``worker_state_dict``, ``resized_protocol_state`` and their loaders).
    """

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The consensus model (the average), so a checkpoint loads as one model for inference or fine-tuning."""
        module = self.lightning_module
        assert module is not None
        if not self._is_fitting() or self._replicas_in_sync or self._evaluation_stash is not None:
            return module.state_dict()
        local = self.model_vector.get()
        self.model_vector.set(self.consensus("final"))
        state = {key: value.clone() for key, value in module.state_dict().items()}
        self.model_vector.set(local)
        return state

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Add every rank's replica and the protocol state, then let rank 0 write the file."""
        if self._vector is not None:
            replicas = self._gather_replicas()
            if self.is_global_zero:
                checkpoint[CHECKPOINT_KEY] = {
                    "world_size": self.comm.world_size,
                    "hierarchy": self.hierarchy,
                    "learners": self.learner_groups(),
                    "local_steps": self._local_steps,
                    "syncs": self._syncs,
                    "replicas_in_sync": self._replicas_in_sync,
                    "generator": self._generator.get_state(),
                    "protocol": self.protocol_state_dict(),
                    "replicas": replicas,
                }
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def _replica_state(self) -> dict[str, Any]:
        """This rank's part of the checkpoint, every tensor on the host.

        Rank 0 holds all ranks' parts in its own process: a GPU tensor of rank k would be unpickled
        onto ``cuda:k`` there (a CUDA context and memory on another rank's GPU, an error where rank
        0 has fewer GPUs). Each rank moves its own state back to its device when it resumes.
        """
        return {
            "vector": (self._evaluation_stash if self._evaluation_stash is not None else self.model_vector.get()).cpu(),
            "optimizers": [apply_to_collection(optimizer.state_dict(), Tensor, Tensor.cpu) for optimizer in self.optimizers],
            "precision": apply_to_collection(self.precision_plugin.state_dict(), Tensor, Tensor.cpu),
            "comm": self.comm.stats.state_dict(),
            "worker": apply_to_collection(self.worker_state_dict(), Tensor, Tensor.cpu),
            "compression": apply_to_collection(self.compression_state_dict(), Tensor, Tensor.cpu),
            **rng_states(self.root_device),
        }

    def _gather_replicas(self) -> list[dict[str, Any]] | None:
        # Pickled per rank and sent to rank 0 point to point: optimizer states are nested dicts.
        local = self._replica_state()
        if not self.is_global_zero:
            self.comm.send_object(pack_replica(local), 0, "checkpoint", self.root_device)
            return None
        replicas = [local]
        for source in range(1, self.comm.world_size):
            replicas.append(unpack_replica(self.comm.receive_object(source, self.root_device)))
        return replicas

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        state = checkpoint.get(CHECKPOINT_KEY)
        # Only a resumed fit continues from the replicas; validate/test/predict(ckpt_path=...) use
        # the consensus in the checkpoint's state_dict, the model the run evaluated and logged.
        if state is None or not self._is_fitting():
            return
        written_by, in_place = state["world_size"], self._resumes_in_place(state)
        replica = self._followed_replica(state)
        # The checkpoint's state_dict, the same on every rank: what compressed exchanges restart from in a new layout.
        consensus = self.model_vector.get() if self.compression is not None else None
        # Global counters first: a strategy whose counts are per rank (DownpourSGD's pushes) sets its own below.
        self._local_steps = state["local_steps"]
        self._syncs = state["syncs"]
        if in_place:
            self.model_vector.set(replica["vector"].to(self.root_device))
            self._replicas_in_sync = state["replicas_in_sync"]
            self.comm.stats = CommStats.from_state_dict(replica["comm"])
            self.load_protocol_state_dict(state["protocol"])
            self.load_worker_state_dict(replica.get("worker", {}))
        else:  # strategies/_resize.py: every replica continues from the consensus the module now holds
            self._replicas_in_sync = True
            self.comm.stats = resized_comm_stats([saved["comm"] for saved in state["replicas"]], self.comm.rank,
                                                 self.comm.world_size)
            self.load_protocol_state_dict(self.resized_protocol_state(state["protocol"], written_by))
            workers = [saved.get("worker", {}) for saved in state["replicas"]]
            self.load_worker_state_dict(self.resized_worker_state(workers, written_by))
        self._resume_compression(replica.get("compression") if in_place else None, consensus)
        self._generator.set_state(state["generator"])
        restore_rng_states(replica, self.root_device)

    def learner_groups(self) -> list[list[int]]:
        """This run's learners as lists of global ranks (:func:`~lightning_dist.strategies._resize.learner_groups`)."""
        return learner_groups(self.comm.world_size, None if self._hierarchy is None else self._hierarchy.layout.nodes)

    def _saved_learners(self, state: Mapping[str, Any]) -> list[list[int]]:
        """The checkpoint's learners (a checkpoint written before layouts were recorded: every rank a learner)."""
        return state.get("learners") or learner_groups(state["world_size"], None)

    def _resumes_in_place(self, state: Mapping[str, Any]) -> bool:
        """Whether every rank continues from its own part: the checkpoint's hierarchy and learners, rank for rank."""
        return state.get("hierarchy") == self.hierarchy and self._saved_learners(state) == self.learner_groups()

    def _followed_replica(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """The saved part this rank resumes from: its own in place, else that of the saved rank it takes after."""
        rank = self.comm.rank
        if not self._resumes_in_place(state):
            rank = followed_saved_rank(rank, self.learner_groups(), self._saved_learners(state))
        return state["replicas"][rank]

    def compression_state_dict(self) -> dict[str, Any] | None:
        """This rank's compressed exchanges' state (residuals), its checkpoint part's ``"compression"``."""
        if self._sync_codec is None or self._buckets is None:
            return None
        return {"buckets": [bucket.state_dict() for bucket in self._buckets]}

    def _resume_compression(self, saved: Mapping[str, Any] | None, consensus: Tensor | None) -> None:
        """A compressed exchange's state: this rank's own in the same layout; else (another layout, or a checkpoint
        written without compression) deltas from the checkpoint's consensus, residuals at zero: the updates they
        held, a few quantization errors' worth, are dropped (the chunks they were owed are re-cut)."""
        if self._sync_codec is None or self._buckets is None:
            return
        if saved is not None and len(saved["buckets"]) != len(self._buckets):
            raise ValueError(
                f"the checkpoint's compressed state is cut into {len(saved['buckets'])} bucket(s) and this run's into "
                f"{len(self._buckets)}: resume with the lightning_dist.algorithms.averaging.AVERAGE_BUCKET that wrote it"
            )
        for index, bucket in enumerate(self._buckets):
            if saved is not None:
                bucket.load_state_dict(saved["buckets"][index])
            else:
                assert consensus is not None
                bucket.restart(consensus[bucket.start:bucket.stop])

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is None:
            super().load_optimizer_state_dict(checkpoint)
            return
        replica = self._followed_replica(state)
        for optimizer, optimizer_state in zip(self.optimizers, replica["optimizers"]):
            optimizer.load_state_dict(optimizer_state)
            _optimizer_to_device(optimizer, self.root_device)
        # Lightning restored rank 0's precision state on every rank just before (restore_training_state);
        # this rank's own replaces it.
        if "precision" in replica:
            self.precision_plugin.load_state_dict(replica["precision"])
