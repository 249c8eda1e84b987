"""One learner per machine (``hierarchy="node"``): a machine's ranks as DDP inside it, the protocol between machines.

Checked by hand on a linear model whose ranks read unequal batches: a node replica's step, periodic averaging of
nodes, DDP over nodes against flat DDP over every rank, a step's virtual time, the bytes by level, BatchNorm's
buffers, and every protocol running on node learners."""

import copy
import math

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist.algorithms.averaging import accumulated_nbytes, sync_probe
from lightning_dist.sim import (
    DataParallel, DynamicAveraging, NetworkModel, PeriodicAveraging, Simulation, SpeedModel, make_protocol,
)
from lightning_dist.sim.collectives import Collectives
from lightning_dist.sim.network_model import ring_all_gather_seconds, ring_all_reduce_seconds
from lightning_dist.sim.replica import NodeReplica, Replica
from sim.helpers import simulation
from sim.test_ddp import Regressor
from workers.downpour import BatchNormClassifier

NETWORK = NetworkModel(latency=0.002, node_mbit=8)
INTRA = NetworkModel(latency=0.00001, node_mbit=2000)
SPEED = SpeedModel(step_seconds=0.05, aggregate_seconds=0.0)
LR = 0.05


class RankShards(L.LightningDataModule):
    """Rank ``r`` of ``ranks`` reads its own 40 examples in order, in batches of ``2 + 2 r``."""

    def __init__(self, ranks: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(7)
        self.x = torch.randn(ranks * 40, 3, generator=generator)
        self.y = torch.randn(ranks * 40, 2, generator=generator)

    def batch(self, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s batch of its ``step``-th step (from 1, within the first epoch)."""
        size = 2 + 2 * rank
        start = rank * 40 + (step - 1) * size
        return self.x[start:start + size], self.y[start:start + size]

    def train_loader(self, num_replicas, rank):
        return DataLoader(TensorDataset(self.x[rank * 40:(rank + 1) * 40], self.y[rank * 40:(rank + 1) * 40]),
                          batch_size=2 + 2 * rank)

    def val_dataloader(self):
        return DataLoader(TensorDataset(self.x[:10], self.y[:10]), batch_size=10)


def mean_gradient_step(model: torch.Tensor, batches) -> torch.Tensor:
    """SGD on the mean of the batches' gradients of mean((W x + b - y)^2), written out (``model``: W then b)."""
    weight, bias = model[:6].view(2, 3), model[6:]
    gradients = []
    for x, y in batches:
        residual = x @ weight.T + bias - y
        gradients.append(torch.cat([(2 / residual.numel() * residual.T @ x).reshape(-1),
                                    2 / residual.numel() * residual.sum(0)]))
    return model - LR * sum(gradients) / len(gradients)


def run(protocol, workers=4, ranks_per_node=2, steps=4, hierarchy="node", speed=SPEED):
    torch.manual_seed(0)
    model = Regressor()
    sim = Simulation(model, RankShards(workers), protocol, workers=workers, max_steps=steps, network=NETWORK,
                     speed=speed, ranks_per_node=ranks_per_node, intra_node=INTRA, hierarchy=hierarchy)
    start = torch.cat([model.linear.weight.detach().reshape(-1), model.linear.bias.detach()])
    return start, sim, sim.run()


def test_a_node_replicas_step_is_sgd_on_the_mean_of_its_ranks_gradients():
    torch.manual_seed(0)
    data = RankShards(2)
    replica = NodeReplica(Regressor(), [data.train_loader(2, 0), data.train_loader(2, 1)])
    start = replica.get().clone()
    loss = replica.step(replica.next_batch())
    batches = [data.batch(0, 1), data.batch(1, 1)]  # 2 and 4 examples: a pooled mean would weigh them otherwise
    assert torch.allclose(replica.get(), mean_gradient_step(start, batches), rtol=0, atol=1e-7)
    weight, bias = start[:6].view(2, 3), start[6:]
    assert loss == pytest.approx(sum(float(((x @ weight.T + bias - y) ** 2).mean()) for x, y in batches) / 2)
    assert replica.part_size == 80


def test_periodic_averaging_of_nodes_averages_models_that_took_ddp_steps_inside_each_node():
    start, sim, _ = run(PeriodicAveraging(period=2, topology="strategy"), steps=4)
    data = RankShards(4)
    models = [start, start]
    for step in range(1, 5):
        models = [mean_gradient_step(models[node], [data.batch(2 * node + j, step) for j in range(2)])
                  for node in range(2)]
        if step % 2 == 0:
            models = [sum(models) / 2] * 2
    assert sim.num_workers == 2 and sim.num_ranks == 4
    for replica in sim.replicas:
        assert torch.allclose(replica.get(), models[0], rtol=0, atol=1e-6)


def test_ddp_over_two_nodes_of_two_ranks_equals_flat_ddp_over_four_ranks():
    start, nodes, _ = run(DataParallel(), steps=6)
    _, flat, _ = run(DataParallel(), steps=6, ranks_per_node=1, hierarchy=None)
    assert len(nodes.replicas) == 2 and len(flat.replicas) == 4
    assert not torch.allclose(flat.replicas[0].get(), start, rtol=0, atol=1e-2)
    for replica in nodes.replicas:
        assert torch.allclose(replica.get(), flat.replicas[0].get(), rtol=0, atol=1e-6)


def test_a_step_costs_its_compute_plus_the_gradient_all_reduce_inside_the_node():
    gradient_bytes = 8 * 4  # 6 weights and 2 biases in float32
    intra = ring_all_reduce_seconds(INTRA, 2, gradient_bytes)
    _, _, alone = run(PeriodicAveraging(period=100, topology="strategy"), steps=1)
    assert alone.summary["virtual_seconds"] == 0.05 + intra
    # DDP between nodes then all-reduces the gradient over the machines' interfaces; each node all-gathers it.
    _, _, ddp = run(DataParallel(), steps=1)
    between = ring_all_reduce_seconds(NETWORK, 2, gradient_bytes) + ring_all_gather_seconds(INTRA, 2, 16)
    assert ddp.summary["virtual_seconds"] == (0.05 + intra) + between


def test_a_measured_step_is_one_ranks_share_plus_the_all_reduce():
    _, sim, _ = run(PeriodicAveraging(period=100, topology="strategy"), steps=3, speed=SpeedModel())
    node = sim.simulator.nodes[0]
    intra = ring_all_reduce_seconds(INTRA, 2, 32)
    assert node.compute_seconds == pytest.approx(node.wall_compute_seconds / 2 + 3 * intra, rel=1e-9)


def test_bytes_by_level_follow_the_ring_formulas():
    """3 nodes of 2 ranks, 4 steps, 2 averaging rounds of the float32 model (32 bytes)."""
    _, sim, result = run(PeriodicAveraging(period=2, topology="strategy"), workers=6, steps=4)
    model_bytes, gradient_bytes, nodes, ranks = accumulated_nbytes(8, torch.float32), 32, 3, 2
    inter = 2 * 2 * (nodes - 1) * model_bytes  # a ring all-reduce between the 3 nodes per round
    gradients = nodes * 4 * 2 * (ranks - 1) * gradient_bytes  # every node's all-reduce, every step
    gathers = nodes * 2 * (ranks - 1) * ranks * math.ceil(model_bytes / ranks)  # every node's all-gather, every round
    assert result.summary["bytes_by_level"] == {"inter_node": inter, "intra_node": gradients + gathers}
    assert result.summary["bytes"] == sum(sim.simulator.network.bytes_sent) == inter
    assert result.rows[-1]["bytes_intra_node"] == gradients + gathers
    summary = result.summary
    assert (summary["workers"], summary["num_learners"], summary["ranks_per_node"], summary["hierarchy"]) == (
        6, 3, 2, "node")


def test_batchnorm_buffers_are_local_rank_zeros_after_a_step():
    """DDP broadcasts local rank 0's buffers before every forward: the node ends its step with the running
    statistics of local rank 0's batch, its parameters with the mean gradient."""
    torch.manual_seed(0)
    template = BatchNormClassifier(num_features=4, num_classes=2, hidden_size=8)
    generator = torch.Generator().manual_seed(3)
    loaders = [DataLoader(TensorDataset(torch.randn(8, 4, generator=generator) * (1 + 3 * rank),
                                        torch.randint(0, 2, (8,), generator=generator)), batch_size=4)
               for rank in range(2)]
    node = NodeReplica(template, loaders)
    rank0, rank1 = Replica(template, loaders[0]), Replica(copy.deepcopy(template), loaders[1])
    node.step(node.next_batch())
    rank0.step(rank0.next_batch())
    rank1.step(rank1.next_batch())
    for buffer, expected, other in zip(node.module.buffers(), rank0.module.buffers(), rank1.module.buffers()):
        assert torch.equal(buffer, expected)
        assert buffer.dtype != torch.float32 or not torch.equal(buffer, other)
    assert not torch.equal(node.vector.get()[:node.vector.num_parameters],
                           rank0.vector.get()[:rank0.vector.num_parameters])


@pytest.mark.parametrize(
    ("name", "arguments"),
    [("periodic", {"period": 3}), ("periodic", {"period": 3, "topology": "strategy", "compression": "int8"}),
     ("fedavg", {"period": 3, "client_fraction": 0.5, "topology": "strategy"}),
     ("dynamic_avg", {"divergence_threshold": 1e-4, "check_every": 2}),
     ("dynamic_avg", {"divergence_threshold": 1e-4, "check_every": 2, "topology": "strategy"}),
     ("segmented_gossip", {"segments": 2, "replicas": 1, "period": 3}),
     ("parameter_server", {"push_every": 2}), ("parameter_server", {"push_every": 2, "topology": "strategy"}),
     ("ddp", {})],
)
def test_every_protocol_runs_on_node_learners(name, arguments):
    result = simulation(make_protocol(name, **arguments), workers=4, max_steps=6, ranks_per_node=2,
                        intra_node=INTRA, hierarchy="node").run()
    summary = result.summary
    assert summary["num_learners"] == 2 and summary["steps"] == 12
    assert summary["bytes_by_level"]["inter_node"] == summary["bytes"] > 0
    assert summary["bytes_by_level"]["intra_node"] > 0
    assert math.isfinite(result.rows[-1]["val_loss"]) and result.rows[-1]["val_loss"] < result.rows[0]["val_loss"]


class OneFarLearner(DynamicAveraging):
    """At step 2 learner 0 is moved 1.0 away from its reference in every parameter (a squared distance of 8 against
    Delta = 1.5: it violates, and a set of 3 still may), so the check balances."""

    def after_step(self, node, rank, step):
        if step == 2 and rank == 0:
            replica = self.simulation.replicas[0]
            replica.set(torch.cat([self.references[0] + 1.0, replica.get()[self.references[0].numel():]]))
        yield from super().after_step(node, rank, step)


def recorded_collectives(monkeypatch):
    """``(kind, key, nbytes)`` of every all-reduce and all-gather node 0 joins from here on (every node joins each)."""
    joined = []
    original = Collectives.join

    def join(self, kind, key, index, members, payload, size, combine):
        if index == 0:
            joined.append((kind, key[0], size))
        return original(self, kind, key, index, members, payload, size, combine)

    monkeypatch.setattr(Collectives, "join", join)
    return joined


def test_dynamic_averagings_gathers_and_probes_carry_what_every_slice_group_sends(monkeypatch):
    """Under a hierarchy each of a node's L ranks gathers the 8-byte distance (and each round's 8-byte decision) over
    its slice group, and probes in it with the probe of sync_probe (from the largest chunk); the calibration's times
    are every rank's 24 bytes. The simulator's learner-level collectives carry what the L ranks send together: 8 L,
    24 L, and L probes (3 ranks per node: nodes of 3 ranks, 8 learners for a balancing set that can stay partial)."""
    ranks = 3
    joined = recorded_collectives(monkeypatch)
    run(OneFarLearner(divergence_threshold=1.5, check_every=2, topology="strategy"), workers=8 * ranks,
        ranks_per_node=ranks, steps=2)
    gathers = [(key, size) for kind, key, size in joined if kind == "all_gather"]
    assert {key for key, _ in gathers} == {"distance", "decision"}
    assert {size for _, size in gathers} == {8 * ranks}
    joined.clear()
    protocol = DynamicAveraging(check_every=2, calibration_steps=4, sync_overhead=1e-12, topology="strategy")
    run(protocol, workers=2 * ranks, ranks_per_node=ranks, steps=4)
    elements, parts = sync_probe(8, ranks, 4, lambda numel: accumulated_nbytes(numel, torch.float32))
    assert protocol.calibration.parts == parts == 3 * 4 / 4  # ceil(8 / 3) float32 entries, probed by one
    sizes = {key: size for kind, key, size in joined if key != "average"}
    assert sizes == {"probe": ranks * elements * 4, "calibration": 24 * ranks, "distance": 8 * ranks}
    assert [size for kind, key, size in joined if key == "probe"] == [8 * ranks, 8 * ranks, ranks * elements * 4]
