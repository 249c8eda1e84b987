"""Batched workers (``Simulation(batched_workers=k)``): the steps computed together equal the per-worker path.

Every local-update protocol, flat and with one learner per machine, on the embedded MLP and a small
TransformerLM: the same losses, models, bytes and protocol decisions as the per-worker run, within float32
rounding; the steps really are computed together; what vmap cannot do is refused by name."""

import pytest
import torch
from torch import nn

from lightning_dist.algorithms.averaging import running_average, weighted_average
from lightning_dist.data import StdlibTextDataModule
from lightning_dist.models import MLPClassifier, TransformerLM
from lightning_dist.sim import (
    Churn, DataParallel, DynamicAveraging, NetworkModel, ParameterServer, PeriodicAveraging, SegmentedGossip, Simulation,
    SpeedModel,
)
from sim.helpers import simulation
from workers.downpour import BatchNormClassifier

PROTOCOLS = {
    "periodic": lambda: PeriodicAveraging(period=4),
    "fedavg": lambda: PeriodicAveraging(period=4, client_fraction=0.5, seed=1),
    "diloco": lambda: PeriodicAveraging(period=4,
                                        outer_optimizer="lightning_dist.algorithms.outer.diloco_outer_optimizer"),
    "dynamic": lambda: DynamicAveraging(divergence_threshold=0.05, check_every=2, seed=3),
    "dynamic_measured": lambda: DynamicAveraging(check_every=2, calibration_steps=4),
    "gossip": lambda: SegmentedGossip(segments=2, replicas=2, period=3),
    "downpour": lambda: ParameterServer(push_every=3),
}


def runs(protocol, **kwargs):
    """The per-worker run and the batched run of ``protocol`` (a factory), each with its simulation."""
    out = []
    for batched in (None, 64):
        sim = simulation(protocol(), batched_workers=batched, **kwargs)
        out.append((sim, sim.run()))
    return out


def assert_same_run(per_worker, batched, atol):
    (sim_a, result_a), (sim_b, result_b) = per_worker, batched
    assert result_a.summary["bytes"] == result_b.summary["bytes"]
    assert result_a.summary["bytes_by_node"] == result_b.summary["bytes_by_node"]
    assert result_a.summary["protocol_metrics"] == result_b.summary["protocol_metrics"]
    assert [wait["step"] for wait in result_a.waits] == [wait["step"] for wait in result_b.waits]
    for replica_a, replica_b in zip(sim_a.replicas, sim_b.replicas):
        assert replica_b.steps == replica_a.steps
        assert torch.allclose(replica_a.get(), replica_b.get(), rtol=0, atol=atol)
    for row_a, row_b in zip(result_a.rows, result_b.rows):
        assert row_a["time"] == row_b["time"] and row_a["steps"] == row_b["steps"]
        assert row_b["val_loss"] == pytest.approx(row_a["val_loss"], abs=atol)


@pytest.mark.parametrize("name", sorted(PROTOCOLS))
def test_every_local_update_protocol_runs_batched_as_it_runs_worker_by_worker(name):
    per_worker, batched = runs(PROTOCOLS[name], workers=6, max_steps=12, eval_every=4)
    assert_same_run(per_worker, batched, atol=1e-5)
    counts = batched[1].summary["batched"]
    # Every step went through vmap, several workers' at a time.
    assert counts["steps"] == 6 * 12 and counts["calls"] < counts["steps"] / 2


def test_one_learner_per_machine_runs_batched_as_it_runs_learner_by_learner():
    per_worker, batched = runs(PROTOCOLS["periodic"], workers=8, max_steps=8, ranks_per_node=2, hierarchy="node",
                               intra_node=NetworkModel(latency=1e-5, node_mbit=2000))
    assert_same_run(per_worker, batched, atol=1e-5)
    assert batched[1].summary["batched"]["steps"] == 4 * 8


@pytest.mark.parametrize("name", ["periodic", "dynamic"])
def test_workers_leaving_mid_step_and_joining_run_batched_as_worker_by_worker(name):
    """A step in progress at a leave is lost either way; the joiner starts from what the protocol gives it."""
    arguments = {"periodic": {"period": 4}, "dynamic": {"divergence_threshold": 0.05, "check_every": 2}}[name]
    protocol = {"periodic": PeriodicAveraging, "dynamic": DynamicAveraging}[name]
    churn = Churn(fraction=0.5, leave_rate=8.0, mean_absence=0.03, seed=3)
    per_worker, batched = runs(lambda: protocol(topology="server", **arguments), workers=4, max_steps=24, churn=churn)
    assert per_worker[1].churn == batched[1].churn and len(batched[1].churn) >= 4
    assert_same_run(per_worker, batched, atol=1e-5)


def test_a_transformer_runs_batched_within_float32_rounding():
    """The issue's workload, small: attention's batched kernels sum in another order than one model's."""
    results = []
    for batched in (None, 8):
        torch.manual_seed(0)
        data = StdlibTextDataModule(block_size=16, batch_size=4, max_val_sequences=8)
        data.setup("fit")
        model = TransformerLM(vocab_size=data.vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=16)
        sim = Simulation(model, data, PeriodicAveraging(period=3), workers=4, max_steps=6,
                         network=NetworkModel(latency=0.001, node_mbit=100),
                         speed=SpeedModel(step_seconds=0.01, aggregate_seconds=0.0), eval_every=3,
                         batched_workers=batched)
        results.append((sim, sim.run()))
    assert_same_run(*results, atol=1e-4)


def test_groups_hold_at_most_batched_workers_replicas():
    sim = simulation(PROTOCOLS["periodic"](), workers=6, max_steps=4, batched_workers=4)
    counts = sim.run().summary["batched"]
    assert counts["steps"] == 24 and counts["calls"] >= 24 / 4


class Dropout(MLPClassifier):
    def __init__(self) -> None:
        super().__init__(num_features=64, hidden_size=16)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return super().forward(self.drop(x))


class Unused(MLPClassifier):
    def __init__(self) -> None:
        super().__init__(num_features=64, hidden_size=16)
        self.spare = nn.Linear(2, 2)


def test_what_vmap_cannot_do_is_refused_by_name():
    speed = SpeedModel(step_seconds=0.01, aggregate_seconds=0.0)
    with pytest.raises(ValueError, match="batched_workers must"):
        simulation(PeriodicAveraging(period=2), batched_workers=0)
    with pytest.raises(ValueError, match="local-update protocol; protocol 'ddp'"):
        simulation(DataParallel(), batched_workers=4)
    with pytest.raises(ValueError, match="modelled speed.step_seconds"):
        simulation(PeriodicAveraging(period=2), batched_workers=4, speed=SpeedModel())
    with pytest.raises(ValueError, match=r"running statistics of .*BatchNorm1d"):
        Simulation(BatchNormClassifier(num_features=64, num_classes=10), _digits(), PeriodicAveraging(period=2), workers=2, max_steps=2,
                   speed=speed, batched_workers=2)
    with pytest.raises(ValueError, match="without random operations"):
        Simulation(Dropout(), _digits(), PeriodicAveraging(period=2), workers=2, max_steps=2, speed=speed,
                   batched_workers=2).run()
    with pytest.raises(ValueError, match="not reached: spare.weight, spare.bias"):
        Simulation(Unused(), _digits(), PeriodicAveraging(period=2), workers=2, max_steps=2, speed=speed,
                   batched_workers=2).run()


def _digits():
    from lightning_dist.data import DigitsDataModule

    return DigitsDataModule(batch_size=16)


@pytest.mark.parametrize("count", [1, 3, 4, 40])
def test_the_running_average_is_the_stacked_one_within_rounding(count):
    generator = torch.Generator().manual_seed(count)
    models = [torch.randn(1000, generator=generator) for _ in range(count)]
    weights = [float(index + 1) for index in range(count)]
    kept = [model.clone() for model in models]
    for chosen in (None, weights):
        running, stacked = running_average(iter(models), chosen), weighted_average(models, chosen)
        if count <= 4:
            assert torch.equal(running, stacked)
        assert torch.allclose(running, stacked, rtol=0, atol=count * 1e-7)
    assert all(torch.equal(model, copy) for model, copy in zip(models, kept))  # the models are not changed
