"""DiLoCo's outer step in the simulator's protocols: the models the strategies would produce from the same replicas.

Expected models follow DiLoCo's Algorithm 1 (Douillard et al. 2023) with Nesterov SGD, lr 0.7, mu 0.9:
``Delta_t = theta_{t-1} - mean``, ``b_t = mu b_{t-1} + Delta_t``, ``theta_t = theta_{t-1} - lr (Delta_t + mu b_t)``.
"""

import json
from pathlib import Path

import pytest
import torch
import yaml

from lightning_dist.algorithms.averaging import weighted_average
from lightning_dist.algorithms.outer import OuterStep, diloco_outer_optimizer
from lightning_dist.cli import main
from lightning_dist.model_vector import ModelVector
from lightning_dist.sim import DynamicAveraging, PeriodicAveraging
from sim.helpers import simulation

REPO = Path(__file__).resolve().parents[2]
LR, MU = 0.7, 0.9
OUTER = {"class_path": "torch.optim.SGD", "init_args": {"lr": LR, "momentum": MU, "nesterov": True}}


class BeforeAndAfter:
    """Mixin: every worker's model as it enters the protocol after each step, and as it leaves it."""

    def setup(self, simulation):
        super().setup(simulation)
        self.before, self.after = {}, {}

    def after_step(self, node, rank, step):
        replica = self.simulation.replicas[rank]
        self.before[step, rank] = replica.get()
        yield from super().after_step(node, rank, step)
        self.after[step, rank] = replica.get()


class RecordingPeriodic(BeforeAndAfter, PeriodicAveraging):
    pass


class RecordingDynamic(BeforeAndAfter, DynamicAveraging):
    pass


def _nesterov(theta, buffer, mean):
    delta = theta - mean
    buffer = delta if buffer is None else MU * buffer + delta
    return theta - LR * (delta + MU * buffer), buffer


@pytest.mark.parametrize("topology", ["server", "strategy"])
def test_periodic_rounds_are_the_outer_steps_the_strategy_takes_from_the_same_replicas(topology):
    workers, period, rounds = 3, 4, 3
    protocol = RecordingPeriodic(period=period, topology=topology, outer_optimizer=OUTER)
    sim = simulation(protocol, workers=workers, max_steps=period * rounds)
    start = ModelVector(sim.model).get()
    sim.run()
    size = sim.replicas[0].vector.num_parameters
    # The strategy's path: each rank steps an OuterStep from the common start with the round's mean.
    strategy = OuterStep(start[:size], diloco_outer_optimizer)
    theta, buffer = start[:size].double(), None
    for step in range(period, period * rounds + 1, period):
        mean = weighted_average([protocol.before[step, rank] for rank in range(workers)])
        expected = strategy.step(mean)
        for rank in range(workers):
            assert torch.equal(protocol.after[step, rank], expected)
        # ... which is Algorithm 1's Nesterov step, and the next round starts from it.
        theta, buffer = _nesterov(theta, buffer, mean[:size].double())
        torch.testing.assert_close(expected[:size].double(), theta, rtol=0, atol=1e-5)
        assert (expected - mean).abs().max() > 1e-3
        theta = expected[:size].double()
    assert protocol.metrics()["outer/steps"] == rounds
    assert all(torch.equal(replica.get(), expected) for replica in sim.replicas)  # the run ends on a round


@pytest.mark.parametrize("topology", ["server", "strategy"])
def test_dynamic_full_syncs_take_the_outer_step_from_the_reference(topology):
    """A tiny threshold: every check is a full synchronization (violation counter), each an outer step from r."""
    workers, check_every = 3, 5
    protocol = RecordingDynamic(divergence_threshold=1e-12, check_every=check_every, topology=topology,
                                outer_optimizer=OUTER)
    sim = simulation(protocol, workers=workers, max_steps=15)
    start = ModelVector(sim.model).get()
    sim.run()
    assert protocol.counts["full_syncs"] == 3
    size = sim.replicas[0].vector.num_parameters
    theta, buffer = start[:size].double(), None
    for step in (5, 10, 15):
        mean = weighted_average([protocol.before[step, rank] for rank in range(workers)])
        theta, buffer = _nesterov(theta, buffer, mean[:size].double())
        after = protocol.after[step, 0]
        assert all(torch.equal(after, protocol.after[step, rank]) for rank in range(1, workers))
        torch.testing.assert_close(after[:size].double(), theta, rtol=0, atol=1e-5)
        theta = after[:size].double()
    assert all(torch.equal(reference, after[:size]) for reference in protocol.references)  # each worker's r
    assert protocol.metrics()["outer/steps"] == 3


@pytest.mark.parametrize("topology", ["server", "strategy"])
def test_the_calibrations_full_sync_takes_the_outer_step_from_the_initial_model(topology):
    """Delta measured at step 5: the calibration's full synchronization is the first outer step, from the start."""
    workers = 3
    protocol = RecordingDynamic(check_every=5, calibration_steps=5, topology=topology, outer_optimizer=OUTER)
    sim = simulation(protocol, workers=workers, max_steps=5)
    start = ModelVector(sim.model).get()
    sim.run()
    size = sim.replicas[0].vector.num_parameters
    mean = weighted_average([protocol.before[5, rank] for rank in range(workers)])
    theta, _ = _nesterov(start[:size].double(), None, mean[:size].double())
    after = protocol.after[5, 0]
    assert all(torch.equal(after, protocol.after[5, rank]) for rank in range(1, workers))
    torch.testing.assert_close(after[:size].double(), theta, rtol=0, atol=1e-5)
    assert (after - mean).abs().max() > 1e-3
    assert all(torch.equal(reference, after[:size]) for reference in protocol.references)
    assert protocol.counts["full_syncs"] == 1 and protocol.metrics()["outer/steps"] == 1


def test_outer_optimizer_from_a_sim_yaml(tmp_path):
    """``protocol: {name: periodic, outer_optimizer: {class_path, init_args}}`` in a sim config runs DiLoCo."""
    config = yaml.safe_load((REPO / "configs/sim/periodic.yaml").read_text())
    config["protocol"] = {"name": "periodic", "period": 3, "outer_optimizer": OUTER}
    path = tmp_path / "diloco.yaml"
    path.write_text(yaml.safe_dump(config))
    main(["simulate", "--config", str(path), "--workers", "3", "--max_steps", "6", "--eval_every", "3",
          "--model.init_args.hidden_size", "16", "--out", str(tmp_path / "run")])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    recorded = summary["protocol"]["outer_optimizer"]
    assert recorded["class_path"] == "torch.optim.SGD" and OUTER["init_args"].items() <= recorded["init_args"].items()
    assert summary["protocol_metrics"]["outer/steps"] == 2


def test_sim_protocols_refuse_an_outer_optimizer_with_fedavg_or_a_bad_one():
    with pytest.raises(ValueError, match="client_fraction=1"):
        PeriodicAveraging(period=2, client_fraction=0.5, outer_optimizer=OUTER)
    with pytest.raises(ValueError, match="class_path"):
        DynamicAveraging(outer_optimizer={"class_path": "torch.optim.NoSuch"})
