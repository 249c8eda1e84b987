"""Dynamic averaging's measured threshold in the simulator (``divergence_threshold=None``), in both topologies.

The workers train alone until ``calibration_steps``; there ``Delta`` becomes the mean of their ``||f_i - r||^2``
and a full synchronisation starts the protocol, as :class:`~lightning_dist.strategies.DynamicAveragingStrategy`
runs it. ``Delta`` is recomputed here from the workers' models as they entered the protocol, and the bytes and
virtual seconds of the calibration by hand.
"""

import json
from pathlib import Path

import pytest
import torch
import yaml

from lightning_dist.algorithms.averaging import weighted_average
from lightning_dist.cli import main
from lightning_dist.model_vector import ModelVector
from lightning_dist.sim import Churn, DynamicAveraging, SpeedModel, make_protocol
from sim.helpers import simulation
from sim.test_topologies import AGGREGATE, LATENCY, MBIT, MEGABIT, ONE_LANE, STEP, run

REPO = Path(__file__).resolve().parents[2]
WORKERS, CHECK_EVERY, CALIBRATION = 4, 2, 6


class Recorded(DynamicAveraging):
    """Every worker's model as it enters the protocol after each step and as it leaves it, the bytes sent by then,
    and what a joiner starts from (its model, reference, step, and the coordinator's bytes once it is admitted)."""

    def setup(self, simulation):
        super().setup(simulation)
        self.before, self.after, self.bytes_before, self.joined = {}, {}, {}, {}

    def after_step(self, node, rank, step):
        replica = self.simulation.replicas[rank]
        self.before[step, rank] = replica.get()
        self.bytes_before[step, rank] = self.simulation.simulator.network.total_bytes
        yield from super().after_step(node, rank, step)
        self.after[step, rank] = replica.get()

    def join(self, node, rank):
        position = yield from super().join(node, rank)
        self.joined[rank] = {"model": self.simulation.replicas[rank].get(), "reference": self.references[rank].clone(),
                             "position": position,
                             "server_bytes": self.simulation.simulator.network.bytes_sent[self.simulation.server]}
        return position


def drifts(models, reference, size):
    """``||f_i - r||^2`` over the parameters (the first ``size`` entries), in float64, computed here."""
    return [float(((model[:size].double() - reference[:size].double()) ** 2).sum()) for model in models]


@pytest.mark.parametrize("topology", ["server", "strategy"])
def test_the_first_synchronisation_is_a_full_one_at_calibration_steps_with_delta_the_mean_drift(topology):
    """4 workers, checks every 2 steps, calibration at step 6, one lane per port. Nothing moves before step 6.

    Coordinator: every worker sends its model and its drift (m + 8 bytes, t = (m + 8) / rate each); the uploads
    queue at the coordinator's port (4 t + latency), one aggregation, then the mean and Delta go out one after the
    other: worker r has it 4 t + latency + aggregation + (r + 1) t + latency after step 6, the last 8 t + 2
    latencies + aggregation. Strategy: the check's 8-byte ring all-gather (3 (8 / rate + latency)), then the ring
    all-reduce of the models (2 * 3 (m / 4 / rate + latency)), for every worker alike."""
    protocol = Recorded(check_every=CHECK_EVERY, calibration_steps=CALIBRATION, sync_overhead=None, topology=topology)
    assert protocol.threshold is None and protocol.config()["divergence_threshold"] is None
    sim = simulation(protocol, workers=WORKERS, max_steps=CALIBRATION, network=ONE_LANE,
                     speed=SpeedModel(step_seconds=STEP, aggregate_seconds=AGGREGATE))
    initial = ModelVector(sim.model).get()
    result = sim.run()

    assert all(protocol.bytes_before[step, rank] == 0 for step in range(1, CALIBRATION) for rank in range(WORKERS))
    size = sim.replicas[0].vector.num_parameters
    entering = [protocol.before[CALIBRATION, rank] for rank in range(WORKERS)]
    delta = sum(drifts(entering, initial, size)) / WORKERS
    assert delta > 0 and protocol.threshold == pytest.approx(delta, rel=1e-12)
    assert protocol.metrics()["dynamic/divergence_threshold"] == protocol.threshold
    assert result.summary["protocol_metrics"]["dynamic/divergence_threshold"] == protocol.threshold
    assert protocol.counts == {"checks": 1, "violations": 0, "full_syncs": 1, "partial_syncs": 0}
    mean = weighted_average(entering)
    assert not torch.equal(entering[0], entering[1])
    for rank, replica in enumerate(sim.replicas):
        assert torch.equal(replica.get(), mean)
        assert torch.equal(protocol.references[rank], mean[:size])

    model_bytes = mean.nbytes
    rate = MBIT * MEGABIT
    waits = {wait["worker"]: wait["seconds"] for wait in result.waits}
    assert sorted(waits) == list(range(WORKERS)) and {wait["step"] for wait in result.waits} == {CALIBRATION}
    if topology == "server":
        message = model_bytes + 8
        assert sim.simulator.network.bytes_sent == [message] * WORKERS + [WORKERS * message]
        uploads = WORKERS * message / rate + LATENCY
        for rank in range(WORKERS):
            assert waits[rank] == pytest.approx(uploads + AGGREGATE + (rank + 1) * message / rate + LATENCY)
        calibration = uploads + AGGREGATE + WORKERS * message / rate + LATENCY
        assert torch.equal(protocol.reference, mean[:size])
        assert torch.equal(protocol.reference_model, mean)
    else:
        ring = 2 * (WORKERS - 1) * model_bytes // WORKERS
        assert sim.simulator.network.bytes_sent == [(WORKERS - 1) * 8 + ring] * WORKERS
        gather = (WORKERS - 1) * (8 / rate + LATENCY)
        all_reduce = 2 * (WORKERS - 1) * (model_bytes / WORKERS / rate + LATENCY)
        calibration = gather + all_reduce
        for rank in range(WORKERS):
            assert waits[rank] == pytest.approx(calibration)
    assert result.summary["virtual_seconds"] == pytest.approx(CALIBRATION * STEP + calibration, rel=1e-12)


def probed_sync_seconds(model_bytes):
    """The full synchronisation's time the strategy topology's probes give (ring all-reduces of 8 bytes and of an
    eighth of the model in whole float32 entries, ``2 (W - 1) (bytes / W / rate + latency)`` each;
    estimated_sync_seconds by hand)."""
    rate = MBIT * MEGABIT

    def ring(nbytes):
        return 2 * (WORKERS - 1) * (nbytes / WORKERS / rate + LATENCY)

    probe = model_bytes // 8 // 4 * 4
    parts = model_bytes / probe
    return parts * ring(probe) - (parts - 1) * ring(8)


def test_the_period_is_the_shortest_whose_probed_synchronisation_costs_at_most_sync_overhead_of_its_steps():
    """topology="strategy", timed in virtual seconds: 4 workers, checks every 2 steps, calibration_steps 6 (periods
    2, 4, 6), a step takes STEP. The probes' estimate of a full synchronisation is computed here from the network
    model, and sync_overhead set to it / (3 STEP): 4 steps qualify (sync <= 4/3 sync), 2 do not. Overheads that
    2 steps meet, and that no period meets, take 2 and 6."""
    model_bytes = ModelVector(simulation(Recorded(), workers=WORKERS, max_steps=1).model).get().nbytes
    sync = probed_sync_seconds(model_bytes)
    for overhead, period in ((sync / (3 * STEP), 4), (sync / STEP, 2), (sync / (7 * STEP), 6)):
        protocol = DynamicAveraging(check_every=CHECK_EVERY, calibration_steps=CALIBRATION, sync_overhead=overhead,
                                    topology="strategy")
        simulation(protocol, workers=WORKERS, max_steps=period, network=ONE_LANE,
                   speed=SpeedModel(step_seconds=STEP, aggregate_seconds=AGGREGATE)).run()
        assert protocol.calibration_period == period, (overhead, period)


@pytest.mark.parametrize("topology", ["server", "strategy"])
@pytest.mark.parametrize(("sync_overhead", "period"), [(1e12, CHECK_EVERY), (1e-12, CALIBRATION)])
def test_with_sync_overhead_delta_is_the_mean_drift_over_the_chosen_period(topology, sync_overhead, period):
    """An overhead every synchronisation meets takes check_every, one none meets calibration_steps; Delta is the
    workers' mean drift after that many steps (computed here from their models), and the first synchronisation
    comes there. Bytes of the longest period: the replayable calibration's plus the probes (8 bytes and an eighth
    of a synchronisation's bytes; a ring all-reduce moves 2 (W - 1) / W of them per worker, the coordinator sends
    each back) and, with the strategy's topology, the 24-byte all-gather of the times."""
    protocol = Recorded(check_every=CHECK_EVERY, calibration_steps=CALIBRATION, sync_overhead=sync_overhead,
                        topology=topology)
    sim = simulation(protocol, workers=WORKERS, max_steps=period, network=ONE_LANE,
                     speed=SpeedModel(step_seconds=STEP, aggregate_seconds=AGGREGATE))
    initial = ModelVector(sim.model).get()
    result = sim.run()
    size = sim.replicas[0].vector.num_parameters
    assert protocol.calibration_period == period
    assert result.summary["protocol_metrics"]["dynamic/calibration_period"] == period
    entering = [protocol.before[period, rank] for rank in range(WORKERS)]
    assert protocol.threshold == pytest.approx(sum(drifts(entering, initial, size)) / WORKERS, rel=1e-12)
    assert protocol.counts == {"checks": 1, "violations": 0, "full_syncs": 1, "partial_syncs": 0}
    model_bytes = initial.nbytes
    probe = model_bytes // 8 // 4 * 4  # whole float32 entries, as the strategy's probe tensor holds
    if topology == "server":
        report = model_bytes + 8
        sent = [8 + probe + report] * WORKERS + [WORKERS * (8 + probe + report)]
    else:  # two 8-byte all-reduces (the first lines the workers up), the probe, the all-gathers, the synchronisation
        all_reduces = 2 * (WORKERS - 1) * (2 * 8 + probe + model_bytes)
        sent = [all_reduces + WORKERS * (WORKERS - 1) * (24 + 8)]  # in total: the ring splits unevenly by a byte
    if period == CALIBRATION:
        totals = sim.simulator.network.bytes_sent if topology == "server" else [sum(sim.simulator.network.bytes_sent)]
        assert totals == sent


@pytest.mark.parametrize("topology", ["server", "strategy"])
def test_with_check_every_1_the_period_is_chosen_once_a_step_was_timed(topology):
    """check_every=1: a worker's clock starts after its step 1, itself a check. Chosen there, its step time was NaN
    and the longest period (4) was taken whatever sync_overhead; an overhead every synchronisation meets takes 1,
    chosen at step 2, whose check is the calibration check: Delta is the mean drift there, counted as the first check
    (the strategy's rule, tests/strategies/test_dynamic_calibration.py)."""
    protocol = Recorded(check_every=1, calibration_steps=4, sync_overhead=1e12, topology=topology)
    sim = simulation(protocol, workers=WORKERS, max_steps=3, network=ONE_LANE,
                     speed=SpeedModel(step_seconds=STEP, aggregate_seconds=AGGREGATE))
    initial = ModelVector(sim.model).get()
    sim.run()
    size = sim.replicas[0].vector.num_parameters
    assert protocol.calibration_period == 1
    entering = [protocol.before[2, rank] for rank in range(WORKERS)]
    assert protocol.threshold == pytest.approx(sum(drifts(entering, initial, size)) / WORKERS, rel=1e-12)
    assert all(torch.equal(protocol.after[2, rank], weighted_average(entering)) for rank in range(WORKERS))
    assert protocol.counts["checks"] == 2 and protocol.counts["full_syncs"] >= 1


class Placed(Recorded):
    """At step 8, the first check after the calibration, worker 0 is placed at a squared distance of 1.05 Delta from
    its reference and worker 1 at 0.95 Delta (along the all-ones direction); the others trained on as they were."""

    def after_step(self, node, rank, step):
        if step == CALIBRATION + CHECK_EVERY and rank in (0, 1):
            replica = self.simulation.replicas[rank]
            vector, size = replica.get(), replica.vector.num_parameters
            target = (1.05 if rank == 0 else 0.95) * self.threshold
            vector[:size] = self.references[rank] + (target / size) ** 0.5
            replica.set(vector)
        yield from super().after_step(node, rank, step)


@pytest.mark.parametrize("topology", ["server", "strategy"])
def test_the_checks_after_the_calibration_compare_with_the_measured_delta(topology):
    """Only worker 0 lies beyond Delta at step 8 (worker 1 at 0.95 Delta, the others' drifts computed here are
    below it): exactly one violation, so Delta, not another threshold within 5 %, decides."""
    protocol = Placed(check_every=CHECK_EVERY, calibration_steps=CALIBRATION, sync_overhead=None, topology=topology)
    sim, _ = run(protocol, WORKERS, CALIBRATION + CHECK_EVERY)
    size = sim.replicas[0].vector.num_parameters
    reference = weighted_average([protocol.before[CALIBRATION, rank] for rank in range(WORKERS)])
    step = CALIBRATION + CHECK_EVERY
    distances = drifts([protocol.before[step, rank] for rank in range(WORKERS)], reference, size)
    assert distances[0] == pytest.approx(1.05 * protocol.threshold, rel=1e-4)
    assert distances[1] == pytest.approx(0.95 * protocol.threshold, rel=1e-4)
    assert max(distances[2:]) < protocol.threshold
    assert protocol.counts["checks"] == 2 and protocol.counts["violations"] == 1
    assert protocol.counts["full_syncs"] + protocol.counts["partial_syncs"] == 2  # the calibration's, then one


@pytest.mark.parametrize("topology", ["server", "strategy"])
def test_a_set_threshold_checks_from_check_every_on_whatever_calibration_steps_is(topology):
    """An explicit Delta: checks from step 2 on, not from calibration_steps, every worker violating a tiny Delta at
    each, and the same run for any calibration_steps."""
    runs = []
    for calibration_steps in (CALIBRATION, 100):
        protocol = DynamicAveraging(divergence_threshold=1e-12, check_every=CHECK_EVERY,
                                    calibration_steps=calibration_steps, topology=topology)
        sim, result = run(protocol, WORKERS, CALIBRATION)
        assert protocol.counts["checks"] == 3 and protocol.counts["violations"] >= 3
        assert protocol.threshold == 1e-12 == protocol.metrics()["dynamic/divergence_threshold"]
        runs.append((protocol.counts, [replica.get() for replica in sim.replicas], sim.simulator.network.bytes_sent,
                     result.summary["virtual_seconds"]))
    (counts, models, sent, seconds), (other_counts, other_models, other_sent, other_seconds) = runs
    assert all(torch.equal(model, other) for model, other in zip(models, other_models))
    assert counts == other_counts and sent == other_sent and seconds == other_seconds


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"calibration_steps": 15}, r"calibration_steps must be a multiple of check_every=10 .*; got 15"),
        ({"check_every": 4, "calibration_steps": 6}, r"calibration_steps must be a multiple of check_every=4"),
        ({"calibration_steps": 0}, r"calibration_steps must be an integer >= 1"),
        ({"calibration_steps": 2.5}, r"calibration_steps must be an integer >= 1"),
        ({"divergence_threshold": 0.7, "calibration_steps": -10}, r"calibration_steps must be an integer >= 1"),
    ],
)
def test_bad_calibration_steps_is_refused_by_name(arguments, message):
    with pytest.raises(ValueError, match=message):
        DynamicAveraging(**arguments)
    with pytest.raises(ValueError, match=message):
        make_protocol("dynamic_avg", topology="strategy", **arguments)


def test_a_sim_config_with_divergence_threshold_null_measures_it(tmp_path):
    """``protocol: {name: dynamic_avg, divergence_threshold: null, calibration_steps: 4}`` in a YAML config."""
    config = yaml.safe_load((REPO / "configs/sim/dynamic_avg.yaml").read_text())
    config["protocol"] = {"name": "dynamic_avg", "divergence_threshold": None, "check_every": 2, "calibration_steps": 4}
    path = tmp_path / "measured.yaml"
    path.write_text(yaml.safe_dump(config))
    main(["simulate", "--config", str(path), "--workers", "3", "--max_steps", "6", "--eval_every", "3",
          "--model.init_args.hidden_size", "16", "--out", str(tmp_path / "run")])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["protocol"]["divergence_threshold"] is None and summary["protocol"]["calibration_steps"] == 4
    metrics = summary["protocol_metrics"]
    assert metrics["dynamic/divergence_threshold"] > 0
    assert metrics["dynamic/checks"] == 2 and metrics["dynamic/full_syncs"] >= 1


def test_the_calibration_waits_for_the_workers_present_and_a_later_joiner_starts_from_its_mean_with_delta():
    """Worker 2 leaves during its step 2 (0.015 s) and comes back at 0.07 s. Workers 0 and 1 report at step 4
    (0.04 s) and the coordinator does not wait for worker 2: Delta is the mean of their two drifts, and they finish
    at once. Worker 2 starts from the calibration's mean, as its reference, at its own step 1; the coordinator
    sent two calibration results and its admission, each a model and Delta."""
    protocol = Recorded(check_every=2, calibration_steps=4, sync_overhead=None)
    sim = simulation(protocol, workers=3, max_steps=4, churn=Churn(absences={2: [(0.015, 0.07)]}))
    initial = ModelVector(sim.model).get()
    result = sim.run()
    size = sim.replicas[0].vector.num_parameters
    entering = [protocol.before[4, rank] for rank in (0, 1)]
    assert protocol.threshold == pytest.approx(sum(drifts(entering, initial, size)) / 2, rel=1e-12)
    mean = weighted_average(entering)
    assert torch.equal(protocol.after[4, 0], mean) and torch.equal(protocol.after[4, 1], mean)
    calibrated = max(wait["start"] + wait["seconds"] for wait in result.waits if wait["worker"] in (0, 1))
    assert calibrated < 0.07
    joined = protocol.joined[2]
    assert torch.equal(joined["model"], mean) and torch.equal(joined["reference"], mean[:size])
    assert joined["position"] == 1
    assert joined["server_bytes"] == 3 * (mean.nbytes + 8)


def test_a_joiner_before_the_calibration_starts_from_the_initial_model_and_is_waited_for():
    """Worker 2 is away from the start and joins at 0.015 s, before any report: admitted at once (the model alone:
    Delta is not known yet) with the initial model, as its reference, at step 0. It reaches its step 4 after the
    others, which wait for its report: Delta is the mean of the three drifts, worker 2's from the initial model."""
    protocol = Recorded(check_every=2, calibration_steps=4, sync_overhead=None)
    sim = simulation(protocol, workers=3, max_steps=4, churn=Churn(absences={2: [(0.0, 0.015)]}))
    initial = ModelVector(sim.model).get()
    result = sim.run()
    size = sim.replicas[0].vector.num_parameters
    joined = protocol.joined[2]
    assert torch.equal(joined["model"], initial) and torch.equal(joined["reference"], initial[:size])
    assert joined["position"] == 0 and joined["server_bytes"] == initial.nbytes
    entering = [protocol.before[4, rank] for rank in range(3)]
    assert protocol.threshold == pytest.approx(sum(drifts(entering, initial, size)) / 3, rel=1e-12)
    mean = weighted_average(entering)
    assert all(torch.equal(replica.get(), mean) for replica in sim.replicas)
    waits = {wait["worker"]: wait for wait in result.waits if wait["step"] == 4}
    assert all(waits[rank]["start"] + waits[rank]["seconds"] > waits[2]["start"] for rank in (0, 1))
    assert protocol.counts == {"checks": 1, "violations": 0, "full_syncs": 1, "partial_syncs": 0}


def test_a_worker_whose_report_was_lost_reports_again_after_its_last_step():
    """Worker 1 reports at its last step (4, at 0.04 s) and leaves while the report is on the wire (0.0402 s);
    it comes back at 0.05 s, before worker 0 (3 times slower) reports: admitted at once with the initial model, it
    has no step left, so it reports after its last step (a drift of 0) and the calibration waits for it. Delta is
    the mean of worker 0's drift and 0, and both end on the mean of worker 0's model and the initial one."""
    protocol = Recorded(check_every=2, calibration_steps=4, sync_overhead=None)
    sim = simulation(protocol, workers=2, max_steps=4, churn=Churn(absences={1: [(0.0402, 0.05)]}),
                     speed=SpeedModel(step_seconds=0.01, aggregate_seconds=0.001, slowdown={0: 3.0}))
    initial = ModelVector(sim.model).get()
    sim.run()
    size = sim.replicas[0].vector.num_parameters
    assert protocol.joined[1]["position"] == 4 and torch.equal(protocol.joined[1]["model"], initial)
    worker0 = protocol.before[4, 0]
    assert protocol.threshold == pytest.approx(drifts([worker0], initial, size)[0] / 2, rel=1e-12)
    mean = weighted_average([worker0, initial])
    assert all(torch.equal(replica.get(), mean) for replica in sim.replicas)
    assert protocol.counts["full_syncs"] == 1
