"""Each protocol in the simulator does what its algorithms/ definition says, checked at a round."""

import math

import pytest
import torch

from lightning_dist.algorithms.averaging import weighted_average
from lightning_dist.algorithms.segmented_gossip import gossip_round
from lightning_dist.data import DigitsDataModule, make_partition
from lightning_dist.sim import (
    DynamicAveraging,
    NetworkModel,
    NonFiniteModelError,
    ParameterServer,
    PeriodicAveraging,
    SegmentedGossip,
    SpeedModel,
)
from sim.helpers import simulation
from workers.downpour import BatchNormClassifier


class Snapshots:
    """Mixin: keep every worker's model as it enters each communicating step (before the protocol)."""

    def after_step(self, node, rank, step):
        self.snapshots.setdefault(step, {})[rank] = self.simulation.replicas[rank].get()
        yield from super().after_step(node, rank, step)

    def setup(self, simulation):
        super().setup(simulation)
        self.snapshots = {}


class SnapshotGossip(Snapshots, SegmentedGossip):
    pass


class SnapshotPeriodic(Snapshots, PeriodicAveraging):
    pass


class SnapshotServer(Snapshots, ParameterServer):
    pass


def test_segmented_gossip_round_equals_gossip_round_of_the_models_entering_it():
    protocol = SnapshotGossip(segments=3, replicas=2, period=5)
    sim = simulation(protocol, workers=5, max_steps=5)
    sim.run()
    before = torch.stack([protocol.snapshots[5][rank] for rank in range(5)])
    plan, _ = protocol.plan(1)
    expected = gossip_round(before, plan, protocol.bounds, sim.dataset_sizes)
    after = torch.stack([replica.get() for replica in sim.replicas])
    assert torch.equal(after, expected)
    assert not torch.equal(after, before)
    # Each worker received S * R segments = R models' worth of elements.
    assert sim.simulator.network.total_bytes == 5 * 2 * before[0].nbytes


def test_segmented_gossip_weights_workers_by_their_true_part_sizes():
    """Dirichlet parts (unequal; every sampler yields the same count): paper 002's |D_j| are the part sizes,
    in the round and in the global model the run is scored by."""
    data = DigitsDataModule(batch_size=16, partition="dirichlet", seed=0)
    protocol = SnapshotGossip(segments=3, replicas=2, period=5)
    sim = simulation(protocol, workers=4, max_steps=5, datamodule=data)
    sim.run()
    sizes = [len(part) for part in make_partition("dirichlet", data.train_set.labels.numpy(), 4, seed=0, alpha=0.5)]
    assert sim.dataset_sizes.tolist() == sizes and len(set(sizes)) == 4
    before = torch.stack([protocol.snapshots[5][rank] for rank in range(4)])
    after = torch.stack([replica.get() for replica in sim.replicas])
    assert torch.equal(after, gossip_round(before, protocol.plan(1)[0], protocol.bounds, torch.tensor(sizes)))
    assert torch.equal(protocol.global_model(), weighted_average(list(after), sizes))
    assert not torch.allclose(protocol.global_model(), weighted_average(list(after)), rtol=0, atol=1e-4)


def test_averaging_protocols_score_the_plain_mean_as_their_strategies_do():
    data = DigitsDataModule(batch_size=16, partition="dirichlet", seed=0)
    protocol = PeriodicAveraging(period=100)
    sim = simulation(protocol, workers=3, max_steps=4, datamodule=data)
    sim.run()
    assert len(set(sim.dataset_sizes.tolist())) == 3
    assert torch.equal(protocol.global_model(), weighted_average([replica.get() for replica in sim.replicas]))


def test_periodic_averaging_replaces_every_model_by_the_mean():
    protocol = SnapshotPeriodic(period=4)
    sim = simulation(protocol, workers=3, max_steps=4)
    sim.run()
    mean = weighted_average([protocol.snapshots[4][rank] for rank in range(3)])
    for replica in sim.replicas:
        assert torch.equal(replica.get(), mean)


def test_fedavg_averages_only_the_round_participants():
    protocol = SnapshotPeriodic(period=4, client_fraction=0.5)
    sim = simulation(protocol, workers=4, max_steps=4)
    sim.run()
    participants = protocol.participants(1)
    assert len(participants) == 2
    mean = weighted_average([protocol.snapshots[4][rank] for rank in participants])
    for rank, replica in enumerate(sim.replicas):
        expected = mean if rank in participants else protocol.snapshots[4][rank]
        assert torch.equal(replica.get(), expected)


def test_synchronous_parameter_server_keeps_every_worker_on_the_global_model():
    protocol = ParameterServer(push_every=2, synchronous=True)
    sim = simulation(protocol, workers=3, max_steps=6)
    initial = sim.model.parameters()
    sim.run()
    for replica in sim.replicas:
        assert torch.equal(replica.get(), protocol.store.vector)
    assert protocol.store.version == 3  # one version per synchronous round
    assert not torch.equal(protocol.store.vector, torch.cat([p.detach().reshape(-1) for p in initial]))


def test_parameter_server_serves_the_mean_of_each_workers_latest_buffers():
    """BatchNorm statistics are not summed as deltas: the server keeps what each worker last reported."""
    protocol = SnapshotServer(push_every=4)
    sim = simulation(protocol, workers=3, max_steps=12)
    torch.manual_seed(0)
    sim.model = BatchNormClassifier(64, 10, hidden_size=16)
    sim.run()
    n = sim.replicas[0].vector.num_parameters
    latest = torch.stack([protocol.snapshots[12][rank][n:] for rank in range(3)])  # as pushed at the last step
    assert not torch.equal(latest[0], latest[1])
    assert torch.equal(protocol.store.worker_buffers, latest)
    assert torch.equal(protocol.store.vector[n:], latest.mean(0))


@pytest.mark.parametrize("aggregate_seconds", [0.5, None], ids=["modelled", "measured"])
def test_an_evaluation_during_the_servers_aggregation_sees_the_model_from_before_it(aggregate_seconds):
    """The server's node is 10^6 times slower: its first aggregation is still running when the run stops at
    0.2 s, so the global model the final evaluation scores is still the start model (measured durations run
    the aggregation at the start of its interval; the old code let the evaluation see its result)."""
    slow_server = {2: 1e6 if aggregate_seconds is None else 1.0}
    speed = SpeedModel(step_seconds=0.01, aggregate_seconds=aggregate_seconds, slowdown=slow_server)
    sim = simulation(ParameterServer(push_every=1), workers=2, max_steps=3, speed=speed, max_virtual_seconds=0.2)
    result = sim.run()
    assert result.rows[-1]["time"] == pytest.approx(0.2) and result.rows[-1]["steps"] == 2
    assert sim.protocol.store.version == (1 if aggregate_seconds is None else 0)  # the running aggregation
    assert result.rows[-1]["val_loss"] == result.rows[0]["val_loss"]


def test_async_parameter_server_lets_fast_workers_run_ahead_of_a_straggler():
    def finish_times(synchronous):
        speed = SpeedModel(step_seconds=0.01, aggregate_seconds=0.0, slowdown={0: 4.0})
        sim = simulation(ParameterServer(push_every=1, synchronous=synchronous), workers=3, max_steps=10, speed=speed)
        sim.run()
        last = {}
        for wait in sim.result.waits:
            last[wait["worker"]] = wait["start"] + wait["seconds"]
        return last

    asynchronous, synchronous = finish_times(False), finish_times(True)
    # Async: workers 1 and 2 finish their 10 steps in about 10 * 0.01 s, the straggler in about 10 * 0.04 s.
    assert asynchronous[1] < 0.15 and asynchronous[2] < 0.15 and asynchronous[0] > 0.4
    # Sync: every round waits for the straggler.
    assert min(synchronous.values()) > 0.4


def test_dynamic_averaging_never_syncs_under_a_huge_threshold_and_always_under_a_tiny_one():
    quiet = DynamicAveraging(divergence_threshold=1e9, check_every=5)
    sim = simulation(quiet, workers=4, max_steps=10)
    result = sim.run()
    assert quiet.counts == {"checks": 2, "violations": 0, "full_syncs": 0, "partial_syncs": 0}
    # Paper 004: a worker whose local condition holds sends nothing and does not wait.
    assert sim.simulator.network.total_bytes == 0 and result.waits == []

    eager = DynamicAveraging(divergence_threshold=1e-12, check_every=5)
    sim = simulation(eager, workers=4, max_steps=10)
    sim.run()
    assert eager.counts["full_syncs"] == 2
    first = sim.replicas[0].get()
    for replica in sim.replicas[1:]:
        assert torch.equal(replica.get(), first)
    assert torch.equal(eager.reference, sim.replicas[0].vector.parameters_of(first))


class PushWorkerZero(DynamicAveraging):
    """Worker 0's parameters move by a squared distance of 4 at step 5; every worker's model is kept as it
    enters the protocol after each step (``before``) and as it leaves it (``after``)."""

    def setup(self, simulation):
        super().setup(simulation)
        self.before, self.after = {}, {}

    def after_step(self, node, rank, step):
        replica = self.simulation.replicas[rank]
        if rank == 0 and step == 5:
            vector, count = replica.get(), replica.vector.num_parameters
            vector[:count] += (4.0 / count) ** 0.5
            replica.set(vector)
        self.before[rank, step] = replica.get()
        yield from super().after_step(node, rank, step)
        self.after[rank, step] = replica.get()


def test_dynamic_averaging_spends_time_and_bytes_only_on_the_balancing_set():
    """One violator (worker 0, squared distance 4 > Delta = 1): the coordinator adds 2 workers, whose mean with
    it lies within Delta (4 / 9). The 3 members wait and send their models and take their mean; the other 5
    send nothing and never wait, at either check."""
    protocol = PushWorkerZero(divergence_threshold=1.0, check_every=5, seed=3)
    sim = simulation(protocol, workers=8, max_steps=10)
    result = sim.run()
    assert protocol.counts == {"checks": 2, "violations": 1, "full_syncs": 0, "partial_syncs": 1}
    sent = sim.simulator.network.bytes_sent
    members = [rank for rank in range(8) if sent[rank]]
    waited = {wait["worker"]: wait["step"] for wait in result.waits}
    model_bytes = sim.replicas[0].get().nbytes
    assert len(members) == 3 and members[0] == 0 and sorted(waited) == members
    assert all(sent[rank] == model_bytes for rank in members)
    # The coordinator: a 1-byte request to each added worker, the mean to each member.
    assert sent[8] == 2 * 1 + 3 * model_bytes
    assert waited[0] == 5 and all(waited[rank] > 5 for rank in members[1:])  # answered after a later step
    # Each member's model is replaced by the mean of the models the members sent.
    mean = weighted_average([protocol.before[rank, waited[rank]] for rank in members])
    for rank in members:
        assert torch.equal(protocol.after[rank, waited[rank]], mean)


class PoisonWorker:
    """Mixin: worker 2's model turns NaN at step 3."""

    def after_step(self, node, rank, step):
        if rank == 2 and step == 3:
            replica = self.simulation.replicas[rank]
            replica.set(torch.full_like(replica.get(), math.nan))
        yield from super().after_step(node, rank, step)


@pytest.mark.parametrize(
    ("base", "arguments"),
    [
        (SegmentedGossip, {"segments": 2, "replicas": 1, "period": 3}),
        (PeriodicAveraging, {"period": 3}),
        (DynamicAveraging, {"divergence_threshold": 0.7, "check_every": 3, "calibration_steps": 3}),
        (DynamicAveraging, {"check_every": 3, "calibration_steps": 3}),  # Delta measured where worker 2 turns NaN
        (ParameterServer, {"push_every": 3}),
    ],
)
def test_a_non_finite_worker_stops_the_run_naming_it(base, arguments):
    protocol = type("Poisoned", (PoisonWorker, base), {})(**arguments)
    with pytest.raises((NonFiniteModelError, RuntimeError), match="2"):
        simulation(protocol, workers=3, max_steps=6, network=NetworkModel()).run()


def test_segmented_gossip_refuses_more_replicas_than_peers():
    with pytest.raises(ValueError, match="replicas"):
        simulation(SegmentedGossip(replicas=3), workers=3)
