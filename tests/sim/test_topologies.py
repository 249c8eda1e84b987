"""Protocols with ``topology="strategy"``: the same models as the server topology, with the messages and the time
of what the lightning_dist strategy moves (ring all-reduce, star through the lowest participant)."""

import pytest
import torch

from lightning_dist.algorithms.averaging import weighted_average
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
from sim.test_protocols import PoisonWorker, PushWorkerZero

MEGABIT = 1e6 / 8
STEP, AGGREGATE, LATENCY, MBIT = 0.01, 0.003, 0.002, 4


def run(protocol, workers, max_steps):
    sim = simulation(protocol, workers=workers, max_steps=max_steps,
                     network=NetworkModel(latency=LATENCY, node_mbit=MBIT),
                     speed=SpeedModel(step_seconds=STEP, aggregate_seconds=AGGREGATE))
    return sim, sim.run()


class Snapshots(PeriodicAveraging):
    """Keeps every worker's model as it enters each round."""

    def setup(self, simulation):
        super().setup(simulation)
        self.snapshots = {}

    def after_step(self, node, rank, step):
        if step % self.period == 0:
            self.snapshots.setdefault(step, {})[rank] = self.simulation.replicas[rank].get()
        yield from super().after_step(node, rank, step)


def test_periodic_all_reduce_gives_the_server_topologys_models_in_the_ring_time():
    workers, period, rounds = 5, 3, 2
    server_sim, _ = run(PeriodicAveraging(period=period), workers, period * rounds)
    protocol = Snapshots(period=period, topology="strategy")
    sim, result = run(protocol, workers, period * rounds)
    for replica, reference in zip(sim.replicas, server_sim.replicas):
        assert torch.equal(replica.get(), reference.get())
    mean = weighted_average([protocol.snapshots[period][rank] for rank in range(workers)])
    assert not torch.equal(protocol.snapshots[period][0], mean)
    model_bytes = sim.replicas[0].get().nbytes  # float32: the sum travels in float32 too
    ring = 2 * (workers - 1) / workers * model_bytes / (MBIT * MEGABIT) + 2 * (workers - 1) * LATENCY
    assert result.summary["virtual_seconds"] == pytest.approx(rounds * (period * STEP + ring), rel=1e-12)
    assert sim.simulator.network.total_bytes == rounds * 2 * (workers - 1) * model_bytes
    assert len(sim.simulator.nodes) == workers  # no server node
    # The server topology's first round: 5 uploads into the server's port, one aggregation, 5 downloads out of it.
    transfer = model_bytes / (MBIT * MEGABIT)
    server_round = workers * transfer + LATENCY + AGGREGATE + workers * transfer + LATENCY
    _, one_round = run(PeriodicAveraging(period=period), workers, period)
    assert one_round.summary["virtual_seconds"] == pytest.approx(period * STEP + server_round)
    assert server_round > 1.5 * ring


def test_fedavg_as_the_strategy_meets_for_the_flags_then_averages_through_the_lowest_participant():
    workers, period = 6, 4
    protocol = Snapshots(period=period, client_fraction=0.5, topology="strategy", seed=1)
    sim, result = run(protocol, workers, period)
    participants = protocol.participants(1)
    assert len(participants) == 3 and participants[0] != 0
    mean = weighted_average([protocol.snapshots[period][rank] for rank in participants])
    for rank, replica in enumerate(sim.replicas):
        assert torch.equal(replica.get(), mean if rank in participants else protocol.snapshots[period][rank])
    model_bytes = sim.replicas[0].get().nbytes
    coordinator = participants[0]
    flags = workers - 1  # every worker all-gathers a 1-byte flag
    expected = [flags + (model_bytes if rank in participants[1:] else 0) for rank in range(workers)]
    expected[coordinator] += 2 * model_bytes
    assert sim.simulator.network.bytes_sent == expected
    gather = (workers - 1) * (1 / (MBIT * MEGABIT) + LATENCY)
    transfer = model_bytes / (MBIT * MEGABIT)
    waits = {wait["worker"]: wait["seconds"] for wait in result.waits}
    assert waits[0] == pytest.approx(gather)  # a non-participant only meets the others
    # Two uploads through the coordinator's receive port, its aggregation, two downloads out of its send port.
    star = 2 * transfer + LATENCY + AGGREGATE + 2 * transfer + LATENCY
    assert max(waits[rank] for rank in participants[1:]) == pytest.approx(gather + star)
    assert waits[coordinator] == pytest.approx(gather + star)  # its sends return once they are done


@pytest.mark.parametrize(
    ("base", "arguments"),
    [
        (PeriodicAveraging, {"period": 3}),
        (PeriodicAveraging, {"period": 3, "client_fraction": 0.5}),
        (DynamicAveraging, {"check_every": 3}),
        (SegmentedGossip, {"segments": 2, "replicas": 1, "period": 3}),
    ],
)
def test_a_non_finite_worker_stops_the_strategy_topology_naming_it(base, arguments):
    protocol = type("Poisoned", (PoisonWorker, base), {})(topology="strategy", **arguments)
    with pytest.raises(NonFiniteModelError, match=r"\[2\]|worker 2"):
        simulation(protocol, workers=4, max_steps=6).run()


def test_an_unknown_topology_is_refused_by_name():
    with pytest.raises(ValueError, match="topology must be one of"):
        PeriodicAveraging(topology="ring")


class PushedDynamic(PushWorkerZero):
    """PushWorkerZero (worker 0 moves by a squared distance of 4 at step 5), run as the strategy runs it."""

    def __init__(self, **arguments):
        super().__init__(topology="strategy", **arguments)


def test_dynamic_averaging_as_the_strategy_meets_at_every_check_and_balances_through_the_lowest_violator():
    """One violator (worker 0) coordinates: its own model fails the condition (decision 1), the round adds 2
    workers, which send their models, the mean of the 3 lies within Delta (decision 2), and the coordinator sends
    it to the 2. Every worker all-gathers 8 bytes per check and waits for both decisions; only the 3 move."""
    workers = 8
    protocol = PushedDynamic(divergence_threshold=1.0, check_every=5, seed=3)
    sim, result = run(protocol, workers, 10)
    assert protocol.counts == {"checks": 2, "violations": 1, "full_syncs": 0, "partial_syncs": 1}
    model_bytes = sim.replicas[0].get().nbytes
    sent = sim.simulator.network.bytes_sent
    gathers = 2 * (workers - 1) * 8
    added = [rank for rank in range(1, workers) if sent[rank] > gathers]
    assert len(added) == 2 and all(sent[rank] == gathers + model_bytes for rank in added)
    assert sent[0] == gathers + 2 * (workers - 1) * 1 + 2 * model_bytes
    assert all(sent[rank] == gathers for rank in range(workers) if rank not in [0, *added])
    members = [0, *added]
    mean = weighted_average([protocol.before[rank, 5] for rank in members])
    for rank in range(workers):
        assert torch.equal(protocol.after[rank, 5], mean if rank in members else protocol.before[rank, 5])
    waits = {(wait["worker"], wait["step"]): wait["seconds"] for wait in result.waits}
    starts = {(wait["worker"], wait["step"]): wait["start"] for wait in result.waits}
    gather = (workers - 1) * (8 / (MBIT * MEGABIT) + LATENCY)
    # Step 10 (no violator): the gather ends for everyone when the last arrival's gather would.
    ends = [starts[rank, 10] + waits[rank, 10] for rank in range(workers)]
    assert ends == pytest.approx([max(starts[rank, 10] for rank in range(workers)) + gather] * workers)
    # Step 5, by hand: the gather; the coordinator aggregates its own model and sends its 7 decisions, rank k's
    # arriving k byte-times later; the first added rank's model arrives after its decision, the second's right
    # after it (the coordinator's receive port); the second aggregation; the second decisions; the two means.
    decision, transfer = 1 / (MBIT * MEGABIT), model_bytes / (MBIT * MEGABIT)
    first, second = added
    decided = gather + AGGREGATE + first * decision + LATENCY + 2 * transfer + LATENCY + AGGREGATE
    for rank in range(1, workers):
        if rank not in members:
            assert waits[rank, 5] == pytest.approx(decided + rank * decision + LATENCY)
    means_leave = decided + (workers - 1) * decision  # the decisions leave the send port first
    assert waits[first, 5] == pytest.approx(means_leave + transfer + LATENCY)
    assert waits[second, 5] == pytest.approx(means_leave + 2 * transfer + LATENCY)
    assert waits[0, 5] == pytest.approx(waits[second, 5])  # its sends return once they are done


def test_dynamic_averaging_as_the_strategy_all_reduces_a_full_synchronisation_forced_by_the_violation_counter():
    workers = 4
    protocol = DynamicAveraging(divergence_threshold=1e-9, check_every=3, topology="strategy")
    sim, result = run(protocol, workers, 6)
    assert protocol.counts == {"checks": 2, "violations": 8, "full_syncs": 2, "partial_syncs": 0}
    model_bytes = sim.replicas[0].get().nbytes
    per_check = workers * (workers - 1) * 8 + 2 * (workers - 1) * model_bytes  # the gather and the ring
    assert sim.simulator.network.total_bytes == 2 * per_check
    gather = (workers - 1) * (8 / (MBIT * MEGABIT) + LATENCY)
    ring = 2 * (workers - 1) * (model_bytes / workers / (MBIT * MEGABIT) + LATENCY)
    assert result.summary["virtual_seconds"] == pytest.approx(2 * (3 * STEP + gather + ring), rel=1e-12)
    final = sim.replicas[0].get()
    assert all(torch.equal(replica.get(), final) for replica in sim.replicas)
    parameters = final[: sim.replicas[0].vector.num_parameters]
    assert all(torch.equal(reference, parameters) for reference in protocol.references)


@pytest.mark.parametrize("workers", [3, 4])
def test_synchronous_parameter_server_as_the_strategy_serves_from_worker_zeros_node(workers):
    """One round: the other workers' pushes (update + 32-byte header) queue at worker 0's receive port, worker 0's
    own push is a local call, one aggregation, then the server thread's blocking replies in rank order. The global
    model is the server topology's."""
    push_every = 3
    reference, _ = run(ParameterServer(push_every=push_every, synchronous=True), workers, push_every)
    protocol = ParameterServer(push_every=push_every, synchronous=True, topology="strategy")
    sim, result = run(protocol, workers, push_every)
    assert len(sim.simulator.nodes) == workers
    assert torch.equal(protocol.global_model(), reference.protocol.global_model())
    for replica in sim.replicas:
        assert torch.equal(replica.get(), protocol.global_model().to(replica.get().dtype))
    message = sim.replicas[0].get().nbytes + 32
    assert sim.simulator.network.bytes_sent == [(workers - 1) * message] + [message] * (workers - 1)
    transfer = message / (MBIT * MEGABIT)
    uploads = (workers - 1) * transfer + LATENCY
    waits = {wait["worker"]: wait["seconds"] for wait in result.waits}
    assert waits[0] == pytest.approx(uploads + AGGREGATE)
    for rank in range(1, workers):
        assert waits[rank] == pytest.approx(uploads + AGGREGATE + rank * (transfer + LATENCY))
    assert sim.simulator.network.total_bytes < reference.simulator.network.total_bytes * (workers - 1) / workers + 1e3


def test_asynchronous_parameter_server_as_the_strategy_costs_worker_zero_no_bytes():
    workers, push_every, steps = 3, 2, 6
    protocol = ParameterServer(push_every=push_every, topology="strategy")
    sim, _ = run(protocol, workers, steps)
    message = sim.replicas[0].get().nbytes + 32
    pushes = steps // push_every
    assert sim.simulator.network.bytes_sent == [(workers - 1) * pushes * message] + [pushes * message] * (workers - 1)
    assert protocol.store.version == workers * pushes


def test_parameter_server_as_the_strategy_refuses_max_staleness():
    with pytest.raises(ValueError, match="max_staleness must be None with topology='strategy'"):
        ParameterServer(max_staleness=2, topology="strategy")


def test_segmented_gossip_as_the_strategy_adds_the_finiteness_meeting_before_each_round():
    workers, period, rounds = 5, 3, 2
    reference, reference_result = run(SegmentedGossip(segments=2, replicas=2, period=period), workers, period * rounds)
    protocol = SegmentedGossip(segments=2, replicas=2, period=period, topology="strategy")
    sim, result = run(protocol, workers, period * rounds)
    for replica, expected in zip(sim.replicas, reference.replicas):
        assert torch.equal(replica.get(), expected.get())
    flags = rounds * (workers - 1)  # 1 byte to each other worker per round
    assert sim.simulator.network.bytes_sent == [sent + flags for sent in reference.simulator.network.bytes_sent]
    gather = (workers - 1) * (1 / (MBIT * MEGABIT) + LATENCY)
    assert result.summary["virtual_seconds"] == pytest.approx(
        reference_result.summary["virtual_seconds"] + rounds * gather, rel=1e-9)
