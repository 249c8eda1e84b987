"""DownpourSGD's parameter server resumed in another layout (one process): rebuilt whole, then re-cut.

A checkpoint's server state is built as a run writes it: flat, one ``GlobalModel`` on rank 0 (the protocol state);
under ``hierarchy="node"``, one shard per local rank of node 0 holding its chunk of the model, in the worker states
``worker_state_dict`` builds. Every rank of the resumed layout then goes through the strategy's resize hooks as
``load_model_state_dict`` calls them, and the ranks that serve build their ``GlobalModel`` as ``on_train_start`` does.
"""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_dist.algorithms.parameter_server import GlobalModel, push_message
from lightning_dist.algorithms.subset_average import chunk_bounds
from lightning_dist.comm import CommStats
from lightning_dist.model_vector import ModelVector
from lightning_dist.strategies import DownpourSGDStrategy
from lightning_dist.strategies._downpour_resize import server_shard, whole_server_state
from lightning_dist.strategies._hierarchy import NodeHierarchy

ROUNDS = 3


def module() -> nn.Module:
    """14 parameters, then 4 floating-point buffers (BatchNorm's running statistics): chunks of 2, 3 and 4 ranks per
    node end inside the parameters, straddle the buffers' start, or hold buffers only."""
    return nn.Sequential(nn.Linear(4, 2), nn.BatchNorm1d(2))


NUMEL, NUM_PARAMETERS = ModelVector(module()).numel, ModelVector(module()).num_parameters


def chunks(per_node: int | None) -> list[tuple[int, int]]:
    """The servers' bounds: the whole model flat, chunk ``j`` on local rank ``j`` under a hierarchy."""
    return list(chunk_bounds(NUMEL, list(range(per_node or 1))).values())


def chunk_parameters(start: int, stop: int) -> int:
    return max(0, min(stop, NUM_PARAMETERS) - start)


def diverged(hierarchy: str | None, nodes: int, per_node: int) -> bool:
    """Whether :func:`saved_checkpoint`'s shards end at different versions (one node's pushes are never stale)."""
    return hierarchy is not None and nodes > 1 and per_node > 1


def saved_checkpoint(hierarchy: str | None, nodes: int, per_node: int) -> tuple[dict, list[dict], list[GlobalModel]]:
    """The protocol state, every rank's worker state and the servers of a run of ``nodes x per_node`` ranks (flat:
    every rank a learner) after ``ROUNDS`` synchronous rounds of pushes with random updates and buffers. Under a
    hierarchy of several nodes and ranks per node the shards' versions and counters then differ, as asynchronous
    pushes with ``max_staleness`` can make them: one more push of node 0, accepted by shard 1, refused by shard 0."""
    generator = torch.Generator().manual_seed(nodes * 10 + per_node)
    learners = nodes if hierarchy else nodes * per_node
    bounds = chunks(per_node if hierarchy else None)
    start = torch.randn(NUMEL, generator=generator)
    start[NUM_PARAMETERS:] = start[NUM_PARAMETERS:].abs() + 1
    servers = [GlobalModel(start[a:b], chunk_parameters(a, b), learners) for a, b in bounds]

    def push(learner_servers: list[tuple[int, GlobalModel]]) -> None:
        for index, server in learner_servers:
            a, b = bounds[index]
            pulled = server.vector
            local = pulled + 0.1 * torch.randn(b - a, generator=generator)
            local[chunk_parameters(a, b):] = torch.rand(b - a - chunk_parameters(a, b), generator=generator) + 1
            server.push_round([(push_message(local, pulled, chunk_parameters(a, b)), server.version, learner)
                               for learner in range(learners)])

    for _ in range(ROUNDS):
        push(list(enumerate(servers)))
    if diverged(hierarchy, nodes, per_node):
        servers[0].refuse(servers[0].version - 1)
        a, b = bounds[1]
        update = torch.cat([0.1 * torch.randn(chunk_parameters(a, b), generator=generator),
                            servers[1].vector[chunk_parameters(a, b):]])
        servers[1].push(update, servers[1].version, 0)
    workers = []
    for rank in range(nodes * per_node):
        node, local = divmod(rank, per_node)
        served = servers[local] if hierarchy else servers[0]
        worker = {"pulled": served.vector.clone(), "pulled_version": served.version, "steps_since_push": 0,
                  "rejected_pushes": 0, "pushes": ROUNDS, "ps_comm": CommStats().state_dict()}
        if hierarchy:
            worker.update(local_rank=local, server_shard=servers[local].state_dict() if node == 0 else None)
        workers.append(worker)
    return {"server": servers[0].state_dict()}, workers, servers


def resumed(protocol: dict, workers: list[dict], hierarchy: str | None, nodes: int, per_node: int,
            consensus: torch.Tensor) -> tuple[list[DownpourSGDStrategy], list[GlobalModel]]:
    """Every rank of a ``nodes x per_node`` run resumed from the checkpoint (its model the checkpoint's consensus),
    and the servers its serving ranks start (node 0's local ranks in order, or rank 0 alone flat)."""
    strategies, servers = [], []
    for rank in range(nodes * per_node):
        node, local = divmod(rank, per_node)
        strategy = DownpourSGDStrategy(parallel_devices=[torch.device("cpu")] * per_node, hierarchy=hierarchy)
        strategy.num_nodes = nodes
        strategy._vector = ModelVector(module())
        strategy.model_vector.set(consensus)
        strategy._comm = SimpleNamespace(rank=rank, world_size=nodes * per_node)
        strategy._ps_comm = SimpleNamespace(stats=None)
        if hierarchy:
            strategy._hierarchy = NodeHierarchy(None, SimpleNamespace(rank=local, world_size=per_node),
                                                SimpleNamespace(rank=node, world_size=nodes))
        strategy.load_protocol_state_dict(strategy.resized_protocol_state(protocol, len(workers)))
        strategy.load_worker_state_dict(strategy.resized_worker_state(workers, len(workers)))
        if (node if hierarchy else rank) == 0:  # on_train_start of the ranks that serve
            server = GlobalModel(strategy._pulled, strategy.learner_num_parameters(), strategy.num_learners)
            if strategy._restored_server is not None:
                server.load_state_dict(strategy._restored_server)
            servers.append(server)
        strategies.append(strategy)
    return strategies, servers


LAYOUTS = {"2x2": ("node", 2, 2), "1x4": ("node", 1, 4), "flat 4": (None, 1, 4), "2x1": ("node", 2, 1),
           "1x2": ("node", 1, 2), "2x3": ("node", 2, 3), "3x2": ("node", 3, 2), "flat 3": (None, 1, 3),
           "flat 2": (None, 1, 2)}
CHANGES = [("2x2", "1x4"), ("flat 4", "2x2"), ("2x2", "2x1"), ("2x2", "flat 4"), ("2x2", "1x2"), ("1x2", "2x2"),
           ("2x3", "3x2"), ("flat 3", "flat 2")]


@pytest.mark.parametrize(("saved_layout", "layout"), CHANGES, ids=[f"{a} -> {b}" for a, b in CHANGES])
def test_the_server_is_rebuilt_whole_and_cut_for_the_new_layout(saved_layout, layout):
    """The new servers, in shard order, hold the saved global model (the shards' vectors concatenated, the
    checkpoint's consensus), every one at the saved servers' largest version, which every rank pulled; each
    worker's buffer entry, one per learner now present, is the global model's buffers of its chunk; the counters
    are saved shard 0's (every shard counts every push), on the server of rank 0."""
    saved_hierarchy, saved_nodes, saved_per_node = LAYOUTS[saved_layout]
    hierarchy, nodes, per_node = LAYOUTS[layout]
    protocol, workers, saved = saved_checkpoint(*LAYOUTS[saved_layout])
    saved_vector = torch.cat([server.vector for server in saved])
    strategies, servers = resumed(protocol, workers, *LAYOUTS[layout], consensus=saved_vector)

    assert len(servers) == (per_node if hierarchy else 1)
    assert torch.equal(torch.cat([server.vector for server in servers]), saved_vector)
    version = max(server.version for server in saved)
    if diverged(*LAYOUTS[saved_layout]):
        assert saved[0].version < saved[1].version == version  # the rule: the largest
    assert [server.version for server in servers] == [version] * len(servers)
    assert all(strategy._pulled_version == version for strategy in strategies)
    learners = nodes if hierarchy else nodes * per_node
    for server, (a, b) in zip(servers, chunks(per_node if hierarchy else None)):
        assert server.num_parameters == chunk_parameters(a, b)
        assert torch.equal(server.worker_buffers, server.vector[server.num_parameters:].repeat(learners, 1))
    for key in ("accepted", "rejected", "staleness_sum", "staleness_max"):  # shard 0's: every shard counts every push
        assert getattr(servers[0], key) == getattr(saved[0], key)
        assert all(getattr(server, key) == 0 for server in servers[1:])
    saved_learners = saved_nodes if saved_hierarchy else saved_nodes * saved_per_node
    assert servers[0].accepted == ROUNDS * saved_learners


def test_the_recut_shards_serve_as_one_server():
    """2 x 2 -> 3 x 2: a synchronous round of the three nodes' pushes, chunk by chunk on the new shards, moves the
    global model exactly as one server holding the rebuilt whole does (buffers included: the mean over the entries,
    the pushers' replaced)."""
    protocol, workers, saved = saved_checkpoint("node", 2, 2)
    saved_vector = torch.cat([server.vector for server in saved])
    _, shards = resumed(protocol, workers, "node", 3, 2, consensus=saved_vector)
    whole = GlobalModel(saved_vector, NUM_PARAMETERS, 3)
    whole.load_state_dict(whole_server_state(protocol["server"], workers, NUMEL, 3))
    generator = torch.Generator().manual_seed(1)
    locals_ = [saved_vector + torch.rand(NUMEL, generator=generator) for _ in range(2)]
    whole.push_round([(push_message(local, saved_vector, NUM_PARAMETERS), whole.version, node)
                      for node, local in enumerate(locals_)])
    for shard, (a, b) in zip(shards, chunks(2)):
        shard.push_round([(push_message(local[a:b], saved_vector[a:b], shard.num_parameters), shard.version, node)
                          for node, local in enumerate(locals_)])
    assert torch.equal(torch.cat([shard.vector for shard in shards]), whole.vector)
    assert [shard.version for shard in shards] == [whole.version] * 2


def test_a_server_saved_before_it_started_stays_none_and_the_workers_pull_version_zero():
    """A checkpoint written before the servers started holds none: every new server starts from the consensus."""
    _, workers, _ = saved_checkpoint("node", 2, 2)
    workers = [{**worker, "server_shard": None} for worker in workers]
    strategies, _ = resumed({"server": None}, workers, None, 1, 3, consensus=torch.zeros(NUMEL))
    assert all(strategy._restored_server is None and strategy._pulled_version == 0 for strategy in strategies)
    assert server_shard(None, 2, 1) is None


def test_compression_mirrors_are_not_kept():
    """The reply mirrors belong to the old workers; the strategy restarts them at the checkpoint's consensus."""
    protocol, workers, _ = saved_checkpoint(None, 1, 2)
    protocol["server"]["replies"] = {"mirrors": torch.zeros(2, NUMEL)}
    assert "replies" not in whole_server_state(protocol["server"], workers, NUMEL, 3)


def test_what_cannot_be_mapped_is_refused_by_name():
    """A hierarchical checkpoint missing a local rank's shard while holding another's, or a server of another model."""
    protocol, workers, _ = saved_checkpoint("node", 2, 2)
    lacking = [{**worker, "server_shard": None} if worker["local_rank"] == 1 else worker for worker in workers]
    with pytest.raises(ValueError, match=r"holds the server shards of local ranks \[0\] but not of \[1\]"):
        whole_server_state(protocol["server"], lacking, NUMEL, 2)
    with pytest.raises(ValueError, match=rf"its 2 shard\(s\) hold \[9, 9\] elements, not the chunks of this model's "
                                         rf"{NUMEL + 1}"):
        whole_server_state(protocol["server"], workers, NUMEL + 1, 2)
