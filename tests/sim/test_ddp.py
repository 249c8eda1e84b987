"""The simulator's ddp protocol: every step the workers' gradients are all-reduced and every replica applies their
mean with its own optimizer, as Lightning's DDP does; the step waits for the ring all-reduce."""

import math

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist.sim import DataParallel, NetworkModel, NonFiniteModelError, Simulation, SpeedModel
from lightning_dist.sim.network_model import ring_all_reduce_seconds
from sim.helpers import simulation
from workers.downpour import BatchNormClassifier

WORKERS, STEPS = 3, 4


class Regressor(L.LightningModule):
    """A linear map 3 -> 2 with a mean squared error: its gradient is easy to write by hand."""

    def __init__(self, optimizer: str = "sgd", learning_rate: float = 0.05) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.optimizer_name, self.learning_rate = optimizer, learning_rate

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.linear(x) - y) ** 2).mean()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", ((self.linear(x) - y) ** 2).mean(), batch_size=len(x))

    def configure_optimizers(self):
        if self.optimizer_name == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.learning_rate)
        return torch.optim.SGD(self.parameters(), lr=self.learning_rate)


class UnequalBatches(L.LightningDataModule):
    """Rank r reads its own 40 examples in order, in batches of 2 + 2r (so the per-rank means are not a pooled mean)."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(7)
        self.x = torch.randn(WORKERS * 40, 3, generator=generator)
        self.y = torch.randn(WORKERS * 40, 2, generator=generator)

    def shard(self, rank):
        return self.x[rank * 40:(rank + 1) * 40], self.y[rank * 40:(rank + 1) * 40]

    @staticmethod
    def batch_size(rank):
        return 2 + 2 * rank

    def train_loader(self, num_replicas, rank):
        return DataLoader(TensorDataset(*self.shard(rank)), batch_size=self.batch_size(rank))

    def val_dataloader(self):
        return DataLoader(TensorDataset(self.x[:10], self.y[:10]), batch_size=10)


def run(optimizer, network=None, speed=None, steps=STEPS):
    torch.manual_seed(0)
    model = Regressor(optimizer)
    sim = Simulation(model, UnequalBatches(), DataParallel(), workers=WORKERS, max_steps=steps,
                     network=network or NetworkModel(latency=0.002, node_mbit=8),
                     speed=speed or SpeedModel(step_seconds=0.05, aggregate_seconds=0.0), eval_every=2)
    return model, sim, sim.run()


def test_replicas_stay_identical_and_follow_the_mean_of_the_workers_gradients_by_hand():
    model, sim, _ = run("sgd")
    data = UnequalBatches()
    weight, bias = model.linear.weight.detach().clone(), model.linear.bias.detach().clone()
    # The same steps with the gradient of the mean loss over all examples instead.
    pooled_weight, pooled_bias = weight.clone(), bias.clone()
    for step in range(STEPS):
        gradients_w, gradients_b, pooled = [], [], []
        for rank in range(WORKERS):
            x, y = data.shard(rank)
            size = data.batch_size(rank)
            x, y = x[step * size:(step + 1) * size], y[step * size:(step + 1) * size]
            # d/dW of mean((W x + b - y)^2) over the batch's B * 2 entries: 2 / (2 B) * (W x + b - y)^T x.
            residual = x @ weight.T + bias - y
            gradients_w.append(2 / residual.numel() * residual.T @ x)
            gradients_b.append(2 / residual.numel() * residual.sum(0))
            pooled.append((size, x, y))
        sizes = sum(size for size, _, _ in pooled)
        residuals = [(x @ pooled_weight.T + pooled_bias - y, x) for _, x, y in pooled]
        pooled_weight = pooled_weight - 0.05 * sum(2 / (2 * sizes) * residual.T @ x for residual, x in residuals)
        pooled_bias = pooled_bias - 0.05 * sum(2 / (2 * sizes) * residual.sum(0) for residual, _ in residuals)
        weight = weight - 0.05 * sum(gradients_w) / WORKERS
        bias = bias - 0.05 * sum(gradients_b) / WORKERS
    expected = torch.cat([weight.reshape(-1), bias])
    for replica in sim.replicas:
        assert torch.allclose(replica.get(), expected, rtol=0, atol=1e-6)
        assert torch.equal(replica.get(), sim.replicas[0].get())
    # DDP averages each rank's mean gradient: unequal batches make that differ from the pooled mean.
    assert not torch.allclose(weight, pooled_weight, rtol=0, atol=1e-3)


def test_adam_replicas_stay_identical_and_keep_identical_optimizer_state():
    model, sim, _ = run("adam", steps=6)
    start = torch.cat([model.linear.weight.detach().reshape(-1), model.linear.bias.detach()])
    first = sim.replicas[0]
    assert not torch.allclose(first.get(), start)
    for replica in sim.replicas[1:]:
        assert torch.equal(replica.get(), first.get())
        for parameter, reference in zip(replica.module.parameters(), first.module.parameters()):
            state, expected = replica.optimizer.state[parameter], first.optimizer.state[reference]
            assert torch.equal(state["exp_avg"], expected["exp_avg"])
            assert torch.equal(state["exp_avg_sq"], expected["exp_avg_sq"])


def test_every_step_waits_for_a_ring_all_reduce_of_the_gradient_and_counts_its_bytes():
    network = NetworkModel(latency=0.002, node_mbit=8)
    _, sim, result = run("sgd", network=network)
    gradient_bytes = 8 * 4  # 6 weights and 2 biases in float32
    ring = 2 * (WORKERS - 1) / WORKERS * gradient_bytes / (8 * 1e6 / 8) + 2 * (WORKERS - 1) * 0.002
    assert result.summary["virtual_seconds"] == pytest.approx(STEPS * (0.05 + ring), rel=1e-12)
    assert sim.simulator.network.total_bytes == STEPS * 2 * (WORKERS - 1) * gradient_bytes
    assert sorted((wait["worker"], wait["step"]) for wait in result.waits) == [
        (rank, step) for rank in range(WORKERS) for step in range(1, STEPS + 1)]
    assert all(wait["seconds"] == pytest.approx(ring, rel=1e-9) for wait in result.waits)


def test_a_non_finite_gradient_stops_the_run_naming_the_worker():
    class Poisoned(DataParallel):
        def train_step(self, node, rank, batch):
            if rank == 1:
                batch = (batch[0] * math.nan, batch[1])
            return (yield from super().train_step(node, rank, batch))

    torch.manual_seed(0)
    sim = Simulation(Regressor(), UnequalBatches(), Poisoned(), workers=WORKERS, max_steps=2,
                     speed=SpeedModel(step_seconds=0.01, aggregate_seconds=0.0))
    with pytest.raises(NonFiniteModelError, match="worker 1 has a non-finite gradient"):
        sim.run()


def test_a_module_with_floating_point_buffers_is_refused():
    torch.manual_seed(0)
    sim = simulation(DataParallel(), workers=2, max_steps=2)
    sim.model = BatchNormClassifier(num_features=64, num_classes=10)
    with pytest.raises(ValueError, match="floating-point buffers"):
        sim.run()


@pytest.mark.parametrize("hook", ["fp16", "powersgd"])
def test_a_compression_hook_moves_its_bytes_and_every_worker_applies_its_mean(hook):
    """The digits MLP, 3 workers, 5 steps: the replicas stay identical; fp16 reduces half the gradient bytes every
    step; PowerSGD (rank 1) plain bytes for its first 2 steps, then its factors and vectors only."""
    plain = simulation(DataParallel(), workers=WORKERS, max_steps=5)
    plain.run()
    sim = simulation(DataParallel(hook=hook), workers=WORKERS, max_steps=5)
    sim.run()
    for replica in sim.replicas[1:]:
        assert torch.equal(replica.get(), sim.replicas[0].get())
    assert not torch.equal(sim.replicas[0].get(), plain.replicas[0].get())
    step_bytes = plain.simulator.network.total_bytes / 5
    if hook == "fp16":
        assert sim.simulator.network.total_bytes == pytest.approx(plain.simulator.network.total_bytes / 2)
    else:
        compressed = sim.protocol.powersgd.nbytes()
        gradient_bytes = sum(p.numel() * 4 for p in sim.replicas[0].vector.parameters)
        assert compressed < gradient_bytes / 2
        ring = 2 * (WORKERS - 1)  # total bytes of a ring all-reduce of S bytes over all workers: 2 (m - 1) S
        assert sim.simulator.network.total_bytes == pytest.approx(2 * step_bytes + 3 * ring * compressed)


def test_bad_hook_arguments_are_named():
    with pytest.raises(ValueError, match="hook must be None, 'fp16' or 'powersgd'; got 'int8'"):
        DataParallel(hook="int8")
    with pytest.raises(ValueError, match="start_powerSGD_iter must be an integer >= 2"):
        DataParallel(hook="powersgd", start_powerSGD_iter=1)


class EqualBatches(UnequalBatches):
    """Every rank reads its 40 examples in batches of 4: its epochs end at the same steps as the others'."""

    @staticmethod
    def batch_size(rank):
        return 4


class ScheduledRegressor(Regressor):
    """Adam with a decay per step and a halving per epoch: the state a shared optimizer must step once."""

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=self.learning_rate)
        decay = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.99)
        halving = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return [optimizer], [{"scheduler": decay, "interval": "step"}, {"scheduler": halving, "interval": "epoch"}]


class IndependentReplicas(DataParallel):
    """DDP with a replica of its own for every worker: what sharing one must reproduce bit for bit."""

    identical_replicas = False


def scheduled_run(protocol, data, steps=25):
    torch.manual_seed(0)
    sim = Simulation(ScheduledRegressor(), data, protocol, workers=WORKERS, max_steps=steps,
                     network=NetworkModel(latency=0.002, node_mbit=8),
                     speed=SpeedModel(step_seconds=0.05, aggregate_seconds=0.0), eval_every=5)
    return sim, sim.run()


def test_ddp_workers_share_one_model_and_train_bit_for_bit_as_replicas_of_their_own():
    shared, shared_result = scheduled_run(DataParallel(), EqualBatches())
    independent, independent_result = scheduled_run(IndependentReplicas(), EqualBatches())
    assert all(replica.module is shared.replicas[0].module for replica in shared.replicas)
    assert len({id(replica.module) for replica in independent.replicas}) == WORKERS
    # 25 steps, 10 per epoch: 25 decays and two halvings (a worker's epoch ends when its next batch is drawn),
    # each once, not once per worker.
    assert shared.replicas[0].optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 0.99**25 / 4)
    assert [row["val_loss"] for row in shared_result.rows] == [row["val_loss"] for row in independent_result.rows]
    for replica, other in zip(shared.replicas, independent.replicas):
        assert replica.steps == other.steps == 25
        assert torch.equal(replica.get(), other.get())


def test_epochs_that_end_at_different_steps_keep_a_replica_per_worker():
    sim, _ = scheduled_run(DataParallel(), UnequalBatches(), steps=8)
    assert len({id(replica.module) for replica in sim.replicas}) == WORKERS


def test_powersgd_waits_for_its_three_all_reduces_one_after_the_other():
    """torch's powerSGD_hook all-reduces the uncompressed tensors, then every P, then every Q (computed from the
    reduced P): a compressed step waits for three rings, each with its latencies, not one of all the bytes."""
    network = NetworkModel(latency=0.001, node_mbit=100)
    sim = simulation(DataParallel(hook="powersgd"), workers=WORKERS, max_steps=4, network=network)
    result = sim.run()
    phases = sim.protocol.powersgd.phase_nbytes()
    assert len(phases) == 3 and sum(phases) == sim.protocol.powersgd.nbytes() and all(phases[1:])
    waits = {wait["step"]: wait["seconds"] for wait in result.waits if wait["worker"] == 0}
    assert waits[4] == pytest.approx(sum(ring_all_reduce_seconds(network, WORKERS, nbytes) for nbytes in phases))
    assert waits[4] > ring_all_reduce_seconds(network, WORKERS, sum(phases)) + 4 * (WORKERS - 1) * 0.001 - 1e-9
