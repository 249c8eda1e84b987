"""A simulated run as a whole: determinism, its records, and refusal of bad input."""

import math

import pytest

from lightning_dist.sim import NetworkModel, ParameterServer, PeriodicAveraging, SegmentedGossip, SpeedModel, make_protocol
from sim.helpers import simulation


def test_same_seed_and_speed_model_give_the_same_run():
    def run():
        network = NetworkModel(latency=0.002, node_mbit=50, link_mbit=10)
        return simulation(ParameterServer(push_every=2), workers=4, max_steps=12, network=network, eval_every=4).run()

    first, second = run(), run()
    assert first.rows == second.rows
    assert first.waits == second.waits
    assert first.worker_rows == second.worker_rows


def test_rows_record_time_steps_bytes_and_what_the_module_logs():
    result = simulation(SegmentedGossip(segments=2, replicas=1, period=5), workers=3, max_steps=10,
                        eval_every=5).run()
    rows = result.rows
    # Evaluated at the start, each time the workers took 5 more steps on average, and after the last round.
    assert [row["mean_steps"] for row in rows] == [0, 5, 10, 10]
    assert rows[-1]["time"] > rows[-2]["time"]
    assert rows[0]["time"] == 0 and rows[0]["bytes"] == 0
    assert all(later["time"] >= earlier["time"] for earlier, later in zip(rows, rows[1:]))
    assert rows[-1]["bytes"] == result.summary["bytes"] > 0
    assert 0 <= rows[-1]["val_acc"] <= 1 and math.isfinite(rows[-1]["val_loss"])
    assert rows[-1]["val_loss"] < rows[0]["val_loss"]
    workers = {row["worker"] for row in result.worker_rows}
    assert workers == {0, 1, 2}
    assert all("val_acc" in row for row in result.worker_rows)
    summary = result.summary
    assert summary["steps"] == 30 and summary["workers"] == 3
    assert summary["compute_wall_seconds"] > 0 and summary["overhead_ratio"] > 0


@pytest.mark.parametrize("step_seconds", [0.01, None], ids=["modelled", "measured"])
def test_an_evaluation_does_not_see_a_step_that_ends_after_it(step_seconds):
    """Worker 1's steps take 1000 times longer: when worker 0's second step ends (the first evaluation after
    the start), worker 1's first step is still running, so neither its row nor the global model shows it."""
    speed = SpeedModel(step_seconds=step_seconds, aggregate_seconds=0.0, slowdown={1: 1000.0})
    sim = simulation(PeriodicAveraging(period=100), workers=2, max_steps=3, speed=speed, eval_every=1)
    result = sim.run()
    first = result.rows[1]
    assert first["steps"] == 2 and 0 < first["time"] < result.summary["virtual_seconds"] / 100
    rows = {(row["time"], row["worker"]): row for row in result.worker_rows}
    assert rows[first["time"], 0]["steps"] == 2 and rows[first["time"], 1]["steps"] == 0
    assert rows[first["time"], 1]["val_loss"] == rows[0.0, 1]["val_loss"]
    assert rows[first["time"], 0]["val_loss"] != rows[0.0, 0]["val_loss"]


def test_max_virtual_seconds_stops_the_run_early():
    result = simulation(PeriodicAveraging(period=5), workers=2, max_steps=100, max_virtual_seconds=0.105).run()
    assert result.summary["virtual_seconds"] == pytest.approx(0.105)
    assert result.summary["steps"] < 200


@pytest.mark.parametrize(
    ("arguments", "name"),
    [({"workers": 0}, "workers"), ({"max_steps": 0}, "max_steps"), ({"eval_every": 0}, "eval_every"),
     ({"max_virtual_seconds": -1.0}, "max_virtual_seconds")],
)
def test_bad_run_parameters_are_refused_by_name(arguments, name):
    settings = {"workers": 2, "max_steps": 4, **arguments}
    with pytest.raises(ValueError, match=name):
        simulation(PeriodicAveraging(), **settings)


def test_unknown_protocol_and_bad_protocol_arguments_are_refused():
    with pytest.raises(ValueError, match="protocol must be one of"):
        make_protocol("allreduce_everything")
    with pytest.raises(ValueError, match="push_every"):
        make_protocol("parameter_server", push_every=0)
    with pytest.raises(ValueError, match="client_fraction"):
        make_protocol("fedavg", client_fraction=1.5)
    with pytest.raises(ValueError, match="divergence_threshold"):
        make_protocol("dynamic_avg", divergence_threshold=0)
    with pytest.raises(ValueError, match="segments"):
        make_protocol("segmented_gossip", segments=0)


def test_first_reaching_finds_the_first_row_at_the_target():
    from lightning_dist.sim.report import first_reaching

    rows = [{"time": 0.0, "val_acc": 0.1, "val_loss": 2.0}, {"time": 1.0, "val_acc": 0.6, "val_loss": 1.2},
            {"time": 2.0, "val_acc": 0.8, "val_loss": 0.9}]
    assert first_reaching(rows, "val_acc", 0.6) == 1.0
    assert first_reaching(rows, "val_acc", 0.9) is None
    assert first_reaching(rows, "val_loss", 1.0, lower_is_better=True) == 2.0


def test_stop_when_ends_the_run_at_the_evaluation_that_asks_for_it():
    result = simulation(PeriodicAveraging(period=5), workers=2, max_steps=100, eval_every=5,
                        stop_when=lambda rows: rows[-1]["mean_steps"] >= 20).run()
    assert 20 <= result.summary["steps"] / 2 < 25
    assert result.rows[-1]["mean_steps"] < 25
