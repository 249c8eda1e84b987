"""Under churn the averaging protocols average the workers present, and a joiner starts from the right model.

Hand-computed from the models the workers held (unequal: each trained on its own data), not from the code.
"""

import pytest
import torch

from lightning_dist.sim import (
    Churn,
    DataParallel,
    DynamicAveraging,
    NetworkModel,
    ParameterServer,
    PeriodicAveraging,
    Simulation,
    SpeedModel,
)
from sim.helpers import simulation
from sim.test_ddp import Regressor, UnequalBatches


class Record:
    """Mixin: every worker's model as it enters each protocol step, and what a joiner starts from."""

    def setup(self, simulation):
        super().setup(simulation)
        self.snapshots, self.joined = {}, {}

    def after_step(self, node, rank, step):
        self.snapshots.setdefault(step, {})[rank] = self.simulation.replicas[rank].get()
        yield from super().after_step(node, rank, step)

    def join(self, node, rank):
        position = yield from super().join(node, rank)
        self.joined[rank] = (self.simulation.replicas[rank].get(), position)
        if hasattr(self, "references"):  # dynamic averaging: the joiner's reference model
            self.joined_reference = self.references[rank].clone()
        return position


def recorded(cls, **arguments):
    return type(f"Recorded{cls.__name__}", (Record, cls), {})(**arguments)


def test_periodic_averaging_averages_the_present_workers_and_a_joiner_starts_from_the_next_mean():
    # Worker 2 is away at round 1 (steps 1-5), comes back during round 2 (steps 6-10), takes part in round 3.
    protocol = recorded(PeriodicAveraging, period=5)
    sim = simulation(protocol, workers=3, max_steps=15, churn=Churn(absences={2: [(0.0, 0.072)]}))
    result = sim.run()
    first = protocol.snapshots[5]
    assert sorted(first) == [0, 1] and not torch.equal(first[0], first[1])
    second = protocol.snapshots[10]
    assert sorted(second) == [0, 1]
    assert protocol.participants(1) == [0, 1] and protocol.participants(3) == [0, 1, 2]
    round2 = (second[0] + second[1]) / 2
    model, position = protocol.joined[2]
    assert position == 10 and torch.allclose(model, round2, rtol=0, atol=1e-7)
    assert [event["position"] for event in result.churn if event["event"] == "joined"] == [10]
    third = protocol.snapshots[15]
    assert sorted(third) == [0, 1, 2]
    expected = (third[0] + third[1] + third[2]) / 3
    for replica in sim.replicas:
        assert torch.allclose(replica.get(), expected, rtol=0, atol=1e-7)


def test_periodic_averaging_leaver_is_not_averaged():
    protocol = recorded(PeriodicAveraging, period=5)
    sim = simulation(protocol, workers=3, max_steps=5, churn=Churn(absences={2: [(0.035, None)]}))
    sim.run()
    entering = protocol.snapshots[5]
    assert sorted(entering) == [0, 1]
    mean = (entering[0] + entering[1]) / 2
    for rank in (0, 1):
        assert torch.allclose(sim.replicas[rank].get(), mean, rtol=0, atol=1e-7)
    with_leaver = (entering[0] + entering[1] + sim.replicas[2].get()) / 3
    assert not torch.allclose(mean, with_leaver, rtol=0, atol=1e-4)
    assert torch.allclose(sim.protocol.global_model(), mean, rtol=0, atol=1e-7)  # scored over the present


def test_fedavg_draws_its_participants_among_the_present_workers():
    protocol = PeriodicAveraging(period=4, client_fraction=0.75)
    sim = simulation(protocol, workers=4, max_steps=20, churn=Churn(absences={3: [(0.015, None)]}))
    sim.run()
    # Round 1 was drawn when the server opened it, at 0 s: 3 of the 4 workers. Each later round is drawn when the
    # previous one closes: round(0.75 * 3) = 2 of the 3 present (3 of 4 had all stayed), never the leaver.
    assert len(protocol.participants(1)) == 3
    rounds = [protocol.participants(index) for index in range(2, 6)]
    assert all(len(chosen) == 2 and 3 not in chosen for chosen in rounds)
    assert len({tuple(chosen) for chosen in rounds}) > 1


def test_dynamic_averaging_full_sync_is_over_the_present_workers():
    """Both present workers violate at step 5 (worker 0's report arrives first and opens the balancing; its
    augmentation reaches half of the 2 present workers): a full synchronisation to the mean of the two present."""
    protocol = recorded(DynamicAveraging, divergence_threshold=1e-9, check_every=5)
    sim = simulation(protocol, workers=3, max_steps=5, churn=Churn(absences={2: [(0.035, None)]}))
    sim.run()
    entering = protocol.snapshots[5]
    mean = (entering[0] + entering[1]) / 2
    for rank in (0, 1):
        assert torch.allclose(sim.replicas[rank].get(), mean, rtol=0, atol=1e-7)
    assert torch.allclose(protocol.reference, mean, rtol=0, atol=1e-7)  # no buffers: parameters = model
    assert protocol.counts["full_syncs"] == 1 and protocol.counts["partial_syncs"] == 0


def test_a_dynamic_averaging_joiner_starts_from_the_reference_model():
    protocol = recorded(DynamicAveraging, divergence_threshold=1e-9, check_every=5)
    sim = simulation(protocol, workers=3, max_steps=8, churn=Churn(absences={2: [(0.035, 0.072)]}))
    result = sim.run()
    entering = protocol.snapshots[5]
    reference = (entering[0] + entering[1]) / 2  # the full synchronisation of check 1, at about 0.05 s
    model, position = protocol.joined[2]
    assert torch.allclose(model, reference, rtol=0, atol=1e-7)
    assert not torch.allclose(model, protocol.snapshots[3][2], rtol=0, atol=1e-4)  # not the model it left with
    assert torch.equal(protocol.joined_reference, model)
    assert position == 3 == [event["position"] for event in result.churn if event["event"] == "joined"][0]


def test_synchronous_parameter_server_applies_the_mean_update_of_the_present_workers():
    protocol = recorded(ParameterServer, push_every=5, synchronous=True)
    sim = simulation(protocol, workers=3, max_steps=5, churn=Churn(absences={2: [(0.035, None)]}))
    start = sim.model  # the template every replica copied
    sim.run()
    initial = torch.cat([parameter.detach().reshape(-1) for parameter in start.parameters()])
    entering = protocol.snapshots[5]
    expected = initial + ((entering[0] - initial) + (entering[1] - initial)) / 2
    assert torch.allclose(protocol.store.vector, expected, rtol=0, atol=1e-7)
    assert protocol.store.version == 1 and protocol.store.accepted == 2


class Published:
    """Mixin: every model the server published, by version."""

    def setup(self, simulation):
        super().setup(simulation)
        self.history = {0: self.published[0]}

    def publish(self):
        super().publish()
        self.history[self.published[1]] = self.published[0]


@pytest.mark.parametrize("synchronous", [False, True])
def test_a_parameter_server_joiner_starts_from_the_published_global_model(synchronous):
    cls = type("Recorded", (Record, Published, ParameterServer), {})
    protocol = cls(push_every=2, synchronous=synchronous)
    sim = simulation(protocol, workers=3, max_steps=12, churn=Churn(absences={2: [(0.0, 0.033)]}))
    sim.run()
    model, position = protocol.joined[2]
    matching = [v for v, vector in protocol.history.items() if torch.equal(vector.to(model.dtype), model)]
    assert matching and max(matching) > 0
    # Asynchronous: at once, from its own step (0); synchronous: when the round in progress closes, at its step.
    assert position == (0 if not synchronous else 2 * max(matching))


def test_ddp_all_reduces_among_the_present_workers_and_a_joiner_takes_the_model_by_hand():
    """Worker 2 leaves during step 1 (its step is lost) and comes back: the steps before it returns apply the mean
    gradient of workers 0 and 1, the later ones of all three, worker 2 reading on from its second batch."""
    steps = 6
    torch.manual_seed(0)
    model = Regressor()
    sim = Simulation(model, UnequalBatches(), DataParallel(), workers=3, max_steps=steps,
                     network=NetworkModel(latency=0.002, node_mbit=8),
                     speed=SpeedModel(step_seconds=0.05, aggregate_seconds=0.0),
                     churn=Churn(absences={2: [(0.03, 0.12)]}))
    result = sim.run()
    position = [event["position"] for event in result.churn if event["event"] == "joined"][0]
    assert 1 <= position < steps - 1
    data = UnequalBatches()
    weight, bias = model.linear.weight.detach().clone(), model.linear.bias.detach().clone()
    for step in range(1, steps + 1):
        members = [0, 1] if step <= position else [0, 1, 2]
        gradients_w, gradients_b = [], []
        for rank in members:
            index = step - 1 if rank < 2 else step - position  # worker 2 took batch 0 for its lost step
            x, y = data.shard(rank)
            size = data.batch_size(rank)
            x, y = x[index * size:(index + 1) * size], y[index * size:(index + 1) * size]
            residual = x @ weight.T + bias - y
            gradients_w.append(2 / residual.numel() * residual.T @ x)
            gradients_b.append(2 / residual.numel() * residual.sum(0))
        weight = weight - 0.05 * sum(gradients_w) / len(members)
        bias = bias - 0.05 * sum(gradients_b) / len(members)
    expected = torch.cat([weight.reshape(-1), bias])
    for replica in sim.replicas:
        assert torch.allclose(replica.get(), expected, rtol=0, atol=1e-6)
    assert torch.equal(sim.replicas[2].get(), sim.replicas[0].get())
    assert sim.replicas[2].steps == steps - position and sim.replicas[0].steps == steps
