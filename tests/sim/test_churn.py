"""Workers leaving and joining in the simulator: the schedule, and what a leave does under every protocol."""

import math

import pytest
import torch

from lightning_dist.sim import (
    Churn,
    DataParallel,
    DynamicAveraging,
    NetworkModel,
    ParameterServer,
    PeriodicAveraging,
    SegmentedGossip,
    SpeedModel,
)
from sim.helpers import simulation

PROTOCOLS = {  # every protocol the simulator has, as (class, arguments)
    "ddp": (DataParallel, {}),
    "periodic": (PeriodicAveraging, {"period": 4}),
    "fedavg": (PeriodicAveraging, {"period": 4, "client_fraction": 0.5}),
    "diloco": (PeriodicAveraging, {"period": 4,
                                   "outer_optimizer": "lightning_dist.algorithms.outer.diloco_outer_optimizer"}),
    "dynamic_avg": (DynamicAveraging, {"divergence_threshold": 0.01, "check_every": 2}),
    "dynamic_avg_measured": (DynamicAveraging, {"check_every": 2, "calibration_steps": 4}),  # Delta at step 4
    "segmented_gossip": (SegmentedGossip, {"segments": 3, "replicas": 2, "period": 4}),
    "parameter_server_async": (ParameterServer, {"push_every": 2}),
    "parameter_server_sync": (ParameterServer, {"push_every": 2, "synchronous": True}),
}


def make(name, mixin=None):
    cls, arguments = PROTOCOLS[name]
    if mixin is not None:
        cls = type(f"{mixin.__name__}{cls.__name__}", (mixin, cls), {})
    return cls(**arguments)


class RecordLeave:
    """Mixin: what the leaving worker had sent and done at the instant it left."""

    def setup(self, simulation):
        super().setup(simulation)
        self.at_leave = {}

    def leave(self, rank):
        network = self.simulation.simulator.network
        self.at_leave[rank] = {"time": network.env.now, "bytes": network.bytes_sent[rank],
                               "messages": network.messages_sent[rank], "steps": self.simulation.replicas[rank].steps}
        super().leave(rank)


@pytest.mark.parametrize("name", sorted(PROTOCOLS))
def test_a_leaving_worker_stops_computing_and_sending_and_the_others_go_on(name):
    protocol = make(name, RecordLeave)
    sim = simulation(protocol, workers=4, max_steps=12, churn=Churn(absences={1: [(0.045, None)]}))
    result = sim.run()
    left = protocol.at_leave[1]
    assert left["time"] == pytest.approx(0.045)
    network = sim.simulator.network
    # Nothing computed or sent after the leave: counters as they were at that instant.
    assert sim.replicas[1].steps == left["steps"] < 12
    assert network.bytes_sent[1] == left["bytes"] and network.messages_sent[1] == left["messages"]
    assert all(row["steps"] == left["steps"] and row["present"] == 0.0
               for row in result.worker_rows if row["worker"] == 1 and row["time"] >= 0.045)
    # The others finished all their steps without it.
    assert [sim.replicas[rank].steps for rank in (0, 2, 3)] == [12, 12, 12]
    assert result.churn == [{"worker": 1, "time": pytest.approx(0.045), "event": "leave"}]
    assert result.summary["churn"]["leaves"] == 1 and result.summary["churn"]["joins"] == 0
    assert math.isfinite(result.rows[-1]["val_loss"])


@pytest.mark.parametrize("name", sorted(PROTOCOLS))
def test_every_protocol_runs_with_random_churn_and_every_worker_finishes(name):
    churn = Churn(fraction=0.5, leave_rate=8.0, mean_absence=0.03, seed=3)
    sim = simulation(make(name), workers=4, max_steps=24, churn=churn)
    result = sim.run()
    joined = [event for event in result.churn if event["event"] == "joined"]
    # A joiner may leave again before it is admitted: then it joined but never trained in that life.
    assert result.summary["churn"]["leaves"] >= 2 and result.summary["churn"]["joins"] >= len(joined) >= 2
    assert all(sim.positions[rank] == 24 for rank in range(4))
    assert all(sim.present)
    assert math.isfinite(result.rows[-1]["val_loss"])


def test_a_step_in_progress_at_the_leave_is_lost():
    sim = simulation(PeriodicAveraging(period=100), workers=2, max_steps=10,
                     churn=Churn(absences={1: [(0.035, None)]}), speed=SpeedModel(step_seconds=0.01))
    sim.run()
    assert sim.replicas[1].steps == 3  # steps 1-3 ended by 0.03; step 4 would have ended at 0.04
    assert sim.replicas[0].steps == 10


def test_a_parameter_server_drops_a_leaving_workers_push_on_the_wire():
    class Replies(ParameterServer):
        def setup(self, simulation):
            super().setup(simulation)
            self.replies = []

        def _reply(self, node, rank):
            self.replies.append((rank, node.now))
            yield from super()._reply(node, rank)

    protocol = Replies(push_every=2)
    # A push (a 6 kB model) takes 47.5 ms at 1 Mbit/s. Both workers push at 0.02 s; the server's receive port
    # takes worker 0's first, so worker 1's is on the wire from 0.0675 s to 0.115 s: it leaves at 0.1 s.
    sim = simulation(protocol, workers=2, max_steps=8, network=NetworkModel(latency=0.001, node_mbit=1),
                     churn=Churn(absences={1: [(0.1, None)]}))
    sim.run()
    push = protocol._bytes(sim.replicas[0].get())
    assert sim.simulator.network.bytes_sent[1] == push  # posted (counted) before the leave ...
    assert [rank for rank, _ in protocol.replies] == [0, 0, 0, 0]  # ... never applied nor answered
    assert protocol.store.accepted == 4 and protocol.store.version == 4


def test_the_random_schedule_is_seeded():
    churn = Churn(fraction=0.3, leave_rate=0.5, mean_absence=2.0, seed=5)
    again = Churn(fraction=0.3, leave_rate=0.5, mean_absence=2.0, seed=5)
    other = Churn(fraction=0.3, leave_rate=0.5, mean_absence=2.0, seed=6)

    def first(schedule, count=5):
        return {worker: [next(iterator) for _ in range(count)] for worker in schedule.churning(32)
                for iterator in [schedule.intervals(worker, 32)]}

    assert len(churn.churning(32)) == round(0.3 * 32) == 10
    assert first(churn) == first(again)
    assert first(churn) != first(other)
    assert list(churn.intervals(min(set(range(32)) - set(churn.churning(32))), 32)) == []
    # Exponential presences of mean 1 / leave_rate and absences of mean mean_absence.
    iterator = churn.intervals(churn.churning(32)[0], 32)
    pairs = [next(iterator) for _ in range(4000)]
    absences = [join - leave for leave, join in pairs]
    presences = [leave - previous for (leave, _), previous in zip(pairs, [0.0] + [join for _, join in pairs])]
    assert sum(absences) / len(absences) == pytest.approx(2.0, rel=0.05)
    assert sum(presences) / len(presences) == pytest.approx(2.0, rel=0.05)


def test_a_run_with_random_churn_is_deterministic():
    def run():
        churn = Churn(fraction=0.5, leave_rate=8.0, mean_absence=0.03, seed=2)
        result = simulation(SegmentedGossip(segments=3, replicas=2, period=4), workers=5, max_steps=20,
                            churn=churn, speed=SpeedModel(step_seconds=0.01, aggregate_seconds=0.001, jitter=0.2)).run()
        return result.rows, result.churn, result.waits

    first, second = run(), run()
    assert first == second and len(first[1]) >= 4


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"fraction": 1.5, "leave_rate": 1.0}, r"churn.fraction must lie in \[0, 1\]"),
        ({"fraction": 0.5, "leave_rate": 0.0}, "churn.leave_rate must be a finite number > 0"),
        ({"fraction": 0.5}, "churn.leave_rate must be given"),
        ({"fraction": 0.5, "leave_rate": 1.0, "mean_absence": -1.0}, "churn.mean_absence must be a finite number > 0"),
        ({"fraction": 0.5, "leave_rate": 1.0, "seed": -1}, "churn.seed must be an integer >= 0"),
        ({}, "either absences"),
        ({"absences": {1: [(1.0, 2.0)]}, "fraction": 0.5}, "either absences"),
        ({"absences": {1: [(1.0, 2.0)]}, "leave_rate": 1.0}, "belong to random churn"),
        ({"absences": {1: [(-1.0, 2.0)]}}, r"churn.absences\[1\]\[0\] leave must be a finite number >= 0"),
        ({"absences": {1: [(2.0, 2.0)]}}, r"churn.absences\[1\]\[0\] join must be a finite number > 2"),
        ({"absences": {1: [(1.0, 3.0), (2.0, 4.0)]}}, r"churn.absences\[1\]\[1\] leave must be a finite number > 3"),
        ({"absences": {1: [(1.0, None), (2.0, 4.0)]}}, "only the last absence may have join None"),
        ({"absences": {1: [1.0]}}, r"churn.absences\[1\]\[0\] must be a \(leave, join\) pair"),
        ({"absences": {-1: [(1.0, 2.0)]}}, "keys must be worker indices"),
    ],
)
def test_bad_schedules_are_refused_naming_the_parameter(arguments, message):
    with pytest.raises(ValueError, match=message):
        Churn(**arguments)


def test_a_simulation_refuses_churn_it_cannot_run():
    with pytest.raises(ValueError, match=r"churn.absences names worker 4; workers are in \[0, 3\]"):
        simulation(DataParallel(), workers=4, churn=Churn(absences={4: [(1.0, None)]}))
    with pytest.raises(ValueError, match="churn needs a modelled speed.step_seconds"):
        simulation(DataParallel(), workers=4, churn=Churn(absences={1: [(1.0, None)]}), speed=SpeedModel())
    for protocol in (PeriodicAveraging(topology="strategy"), DynamicAveraging(topology="strategy"),
                     ParameterServer(topology="strategy"), SegmentedGossip(replicas=1, topology="strategy")):
        with pytest.raises(ValueError, match="topology must be 'server' for protocol .* with churn"):
            simulation(protocol, workers=4, churn=Churn(fraction=0.5, leave_rate=1.0))
    with pytest.raises(TypeError, match="churn must be a lightning_dist.sim.Churn"):
        simulation(DataParallel(), workers=4, churn={"fraction": 0.5})


def test_without_leaves_a_churn_schedule_changes_nothing_but_gossips_requests():
    """fraction=0: the same models for every protocol; segmented gossip then sends its requests (8 bytes a segment)."""
    for name in ("ddp", "periodic", "dynamic_avg", "parameter_server_sync", "segmented_gossip"):
        plain = simulation(make(name), workers=4, max_steps=8)
        plain.run()
        churned = simulation(make(name), workers=4, max_steps=8, churn=Churn(fraction=0.0, leave_rate=1.0))
        churned.run()
        for before, after in zip(plain.replicas, churned.replicas):
            assert torch.equal(before.get(), after.get())
        requests = 4 * 2 * 3 * 2 * 8 if name == "segmented_gossip" else 0  # workers * rounds * S * R * 8 bytes
        assert churned.simulator.network.total_bytes == plain.simulator.network.total_bytes + requests
