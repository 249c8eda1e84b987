"""DownpourSGD's parameter server resumed in another layout: rebuilt whole from the checkpoint, then re-cut.

A checkpoint holds the server in the layout that wrote it: flat, one server on rank 0 (the protocol
state's ``"server"``, a :meth:`~lightning_dist.algorithms.parameter_server.GlobalModel.state_dict`);
under ``hierarchy="node"``, one shard per local rank ``j`` on node 0, holding chunk ``j`` of the model
vector (:func:`~lightning_dist.algorithms.subset_average.chunk_bounds` over the ranks per node), each in
the worker state of the rank that served it (``"server_shard"``, with its ``"local_rank"``). Resumed in
any other layout (another world size, or as many processes cut into other nodes), the rule is:

1. **Rebuild** the whole global model's server (:func:`whole_server_state`): the flat server, or the
   shards in local-rank order, their vectors concatenated (each must span its chunk's bounds).
2. **Keep** what still means something: the global model (the float32 master), its version (under a
   hierarchy the shards' largest: shards of one synchronous run advance together; in an asynchronous
   one a shard that refused a stale push lags, and the largest lets no shard's version go backwards),
   and the counters (accepted and rejected pushes, staleness): every shard counts every push, so shard
   0's, the ones the strategy logs, are the whole server's and go on from the checkpoint's.
3. **Reset** what belongs to the old workers: every worker's buffer entry (BatchNorm statistics) is
   the global model's buffers, one entry per learner now present (a rank, or a node under a
   hierarchy), as a worker's before its first push, so the buffers' mean is unchanged; the reply
   mirrors of compressed pushes are dropped (the strategy restarts them all at the checkpoint's
   consensus, as every worker restarts from that model).
4. **Cut** it for this run (:func:`server_shard`): flat, the whole server on rank 0; under a hierarchy
   of ``L`` ranks per node, shard ``j`` is chunk ``j`` of ``L``. Every shard has the whole's version;
   shard 0 (the server on rank 0) carries the counters and the others start at zero, as rank 0 keeps
   the counters of ranks that went away (``lightning_dist/counters.py``).

The checkpoint's consensus, its ``state_dict``, is the same global model (DownpourSGD's consensus is
the server's model, rounded to the model's dtype), so the workers, which restart from it, and the
rebuilt server start from one model. Refused by name: a hierarchical checkpoint that lacks some local
rank's shard while holding others, and a server of another model size than this run's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_dist.algorithms.subset_average import chunk_bounds

# GlobalModel.state_dict()'s counters: every shard counts every push, so shard 0's (the server on rank 0, whose
# counters the strategy logs) are the whole server's.
_COUNTERS = ("accepted", "rejected", "staleness_sum", "staleness_max")


def saved_servers(server: Mapping[str, Any] | None,
                  workers: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]] | None:
    """The checkpoint's servers in shard order: ``[server]`` when flat, node 0's shards by local rank under a
    hierarchy (the workers' states then hold ``"server_shard"``; the protocol's ``server`` is shard 0 again);
    None if it was written before a server started (every one is None)."""
    if not any("server_shard" in worker for worker in workers):
        return None if server is None else [server]
    shards = {int(worker["local_rank"]): worker["server_shard"] for worker in workers
              if worker.get("server_shard") is not None}
    if not shards:
        return None
    ranks_per_node = 1 + max(int(worker["local_rank"]) for worker in workers)
    missing = sorted(set(range(ranks_per_node)) - set(shards))
    if missing:
        raise ValueError(
            f"DownpourSGDStrategy cannot rebuild the checkpoint's parameter server: it holds the server shards of "
            f"local ranks {sorted(shards)} but not of {missing} (of {ranks_per_node} ranks per node)"
        )
    return [shards[local] for local in range(ranks_per_node)]


def whole_server_state(server: Mapping[str, Any] | None, workers: Sequence[Mapping[str, Any]], numel: int,
                       learners: int) -> dict[str, Any] | None:
    """The whole global model's server state (a ``GlobalModel.state_dict()`` for ``learners`` workers) from a
    checkpoint's protocol ``server`` and saved ``workers`` (``worker_state_dict()`` of every saved rank), by the
    module's rule; None if the checkpoint has no server state (the server then starts from the consensus).
    ``numel`` is this run's model vector length."""
    servers = saved_servers(server, workers)
    if servers is None:
        return None
    widths = [saved["vector"].numel() for saved in servers]
    bounds = list(chunk_bounds(sum(widths), list(range(len(servers)))).values())
    if sum(widths) != numel or widths != [stop - start for start, stop in bounds]:
        raise ValueError(
            f"DownpourSGDStrategy cannot rebuild the checkpoint's parameter server: its {len(servers)} shard(s) hold "
            f"{widths} elements, not the chunks of this model's {numel}"
        )
    vector = torch.cat([saved["vector"] for saved in servers])
    num_buffers = sum(saved["worker_buffers"].shape[1] for saved in servers)
    return {
        "vector": vector,
        "worker_buffers": vector[numel - num_buffers:].repeat(learners, 1),
        "version": max(int(saved["version"]) for saved in servers),
        **{key: int(servers[0][key]) for key in _COUNTERS},
    }


def server_shard(whole: Mapping[str, Any] | None, shards: int, index: int) -> dict[str, Any] | None:
    """Shard ``index`` of ``shards`` of :func:`whole_server_state`'s ``whole`` (``shards=1``: the whole server): chunk
    ``index`` of its vector and of its workers' buffer entries, at its version, with the counters on shard 0 only."""
    if whole is None:
        return None
    vector, worker_buffers = whole["vector"], whole["worker_buffers"]
    start, stop = chunk_bounds(vector.numel(), list(range(shards)))[index]
    first_buffer = vector.numel() - worker_buffers.shape[1]  # the buffers' columns of this chunk, if any
    columns = slice(max(start, first_buffer) - first_buffer, max(stop, first_buffer) - first_buffer)
    counters = {key: whole[key] if index == 0 else 0 for key in _COUNTERS}
    return {
        "vector": vector[start:stop].clone(),
        "worker_buffers": worker_buffers[:, columns].clone(),
        "version": whole["version"],
        **counters,
    }
