"""Protocols with ``topology="strategy"``: the same models as the server topology, with the messages and the time
of what the lightning_dist strategy moves (ring all-reduce, star through the lowest participant)."""

import pytest
import torch

from lightning_dist.algorithms.averaging import weighted_average
from lightning_dist.sim import NetworkModel, NonFiniteModelError, PeriodicAveraging, SpeedModel
from sim.helpers import simulation

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
    assert waits[coordinator] == pytest.approx(gather + 2 * transfer + LATENCY + AGGREGATE)


@pytest.mark.parametrize("client_fraction", [1.0, 0.5])
def test_a_non_finite_worker_stops_the_strategy_topology_naming_it(client_fraction):
    class Poisoned(PeriodicAveraging):
        def after_step(self, node, rank, step):
            if rank == 2 and step == 3:
                replica = self.simulation.replicas[rank]
                replica.set(torch.full_like(replica.get(), float("nan")))
            yield from super().after_step(node, rank, step)

    protocol = Poisoned(period=3, client_fraction=client_fraction, topology="strategy")
    with pytest.raises(NonFiniteModelError, match="2"):
        simulation(protocol, workers=4, max_steps=6).run()


def test_an_unknown_topology_is_refused_by_name():
    with pytest.raises(ValueError, match="topology must be one of"):
        PeriodicAveraging(topology="ring")
