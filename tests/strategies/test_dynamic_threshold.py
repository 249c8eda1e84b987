"""Dynamic averaging's measured threshold (``divergence_threshold=None``) in 2-process fits.

One launch trains the same MLP in two systems of units (every parameter stored 10 times larger, learning rate 100
times larger: the same trajectory, squared distances 100 times larger) and at two learning rates, with the measured
threshold and with an absolute one; a second launch resumes the measured run from a checkpoint. These runs measure
``Delta`` after ``calibration_steps`` (``sync_overhead=None``), which replays exactly. The timed choice of the period
(``sync_overhead`` a number: probes of the network) is tested at the two ends, where the timings cannot change the
outcome: an overhead no synchronization can meet takes ``calibration_steps``, one every synchronization meets takes
``check_every``.
"""

import pytest
import torch

from helpers.launch import load_results, run_ranks

CALIBRATION = {"check_every": 5, "calibration_steps": 20, "sync_overhead": None}
TIMED = {"check_every": 5, "calibration_steps": 20}
NO_SYNC_IS_THAT_CHEAP, EVERY_SYNC_IS_THAT_CHEAP = 1e-12, 1e12
UNITS = 10.0
EPOCHS = 10  # 23 steps per epoch on 2 ranks
LEARNING_RATES = (0.05, 0.2)
# Between the thresholds measured at the two learning rates (about 0.016 and 0.29; the test checks it lies between).
ABSOLUTE_BETWEEN = 0.07


def _run(name, strategy_kwargs, units=1.0, learning_rate=0.1, **spec):
    model = {"learning_rate": learning_rate * units**2}
    return {"name": name, "units": units, "model": model,
            "strategy": {"class": "DynamicAveragingStrategy", "kwargs": strategy_kwargs}, **spec}


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    root = tmp_path_factory.mktemp("threshold")
    checkpoints = root / "checkpoints"
    runs = [
        _run("measured", CALIBRATION, checkpoint_dir=str(checkpoints)),
        _run("measured_units", CALIBRATION, units=UNITS),
        _run("absolute", {**CALIBRATION, "divergence_threshold": 0.7}),
        _run("absolute_units", {**CALIBRATION, "divergence_threshold": 0.7}, units=UNITS),
        *(_run(f"measured_lr{lr}", CALIBRATION, learning_rate=lr) for lr in LEARNING_RATES),
        *(_run(f"absolute_lr{lr}", {**CALIBRATION, "divergence_threshold": ABSOLUTE_BETWEEN}, learning_rate=lr)
          for lr in LEARNING_RATES),
        _run("timed_dear", {**TIMED, "sync_overhead": NO_SYNC_IS_THAT_CHEAP}),
        _run("timed_cheap", {**TIMED, "sync_overhead": EVERY_SYNC_IS_THAT_CHEAP}),
        _run("measured_at_check_every", {**CALIBRATION, "calibration_steps": TIMED["check_every"]}),
        # The period (30) chosen at step 5, before the first epoch's checkpoint (23 steps), must survive it.
        _run("timed_across_checkpoint", {**TIMED, "calibration_steps": 30, "sync_overhead": NO_SYNC_IS_THAT_CHEAP},
             checkpoint_dir=str(root / "timed_checkpoints")),
        _run("measured_at_30", {**CALIBRATION, "calibration_steps": 30}),
    ]
    run_ranks(2, "fit", {"trainer": {"max_epochs": EPOCHS}, "runs": runs}, root / "full", timeout=480)
    results = {run["name"]: load_results(root / "full" / run["name"], 2) for run in runs}
    checkpoint = next(checkpoints.glob("epoch=1-*.ckpt"))
    timed_checkpoint = next((root / "timed_checkpoints").glob("epoch=0-*.ckpt"))
    resume = [
        _run("resumed", CALIBRATION, ckpt_path=str(checkpoint)),
        _run("timed_resumed", {**TIMED, "calibration_steps": 30, "sync_overhead": NO_SYNC_IS_THAT_CHEAP},
             ckpt_path=str(timed_checkpoint)),
    ]
    run_ranks(2, "fit", {"trainer": {"max_epochs": EPOCHS}, "runs": resume}, root / "resumed", timeout=480)
    results.update({run["name"]: load_results(root / "resumed" / run["name"], 2) for run in resume})
    for name, ranks in results.items():
        for result in ranks:
            assert result["error"] is None, (name, result["error"])
    return results, torch.load(checkpoint, weights_only=False)


def _syncs(result):
    return result["metrics"]["dynamic/full_syncs"] + result["metrics"]["dynamic/partial_syncs"]


def test_the_measured_threshold_gives_the_same_schedule_in_any_units(fits):
    """Measured: the threshold scales with the units (by UNITS**2) and the synchronizations are the same. Absolute:
    the same 0.7 is a different threshold in each system, and the schedules differ several-fold."""
    results, _ = fits
    measured, scaled = results["measured"][0], results["measured_units"][0]
    threshold = measured["metrics"]["dynamic/divergence_threshold"]
    assert scaled["metrics"]["dynamic/divergence_threshold"] == pytest.approx(UNITS**2 * threshold, rel=1e-3)
    assert measured["metrics"]["dynamic/full_syncs"] >= 3  # the calibration's and later ones
    assert _syncs(scaled) == _syncs(measured)
    assert scaled["metrics"]["dynamic/violations"] == measured["metrics"]["dynamic/violations"]
    absolute, absolute_scaled = _syncs(results["absolute"][0]), _syncs(results["absolute_units"][0])
    assert absolute_scaled >= 3 * absolute, (absolute, absolute_scaled)
    # The same training: the validation accuracy of the two measured runs agrees.
    assert scaled["callback_metrics"]["val_acc"] == pytest.approx(measured["callback_metrics"]["val_acc"], abs=0.02)


def test_the_measured_threshold_keeps_the_schedule_at_another_learning_rate(fits):
    """A learning rate 4 times larger moves the replicas apart about 16 times as far in the calibration window: the
    measured Delta follows it and the numbers of synchronizations stay within 1.5x of each other (20 and 16 when
    written), where one absolute Delta between the two measured ones synchronizes the faster run several times as
    often."""
    results, _ = fits
    low, high = (results[f"measured_lr{lr}"][0]["metrics"] for lr in LEARNING_RATES)
    low_threshold, high_threshold = low["dynamic/divergence_threshold"], high["dynamic/divergence_threshold"]
    assert high_threshold >= 8 * low_threshold, (low_threshold, high_threshold)
    assert low_threshold < ABSOLUTE_BETWEEN < high_threshold
    measured = sorted((_syncs(results[f"measured_lr{lr}"][0]) for lr in LEARNING_RATES))
    assert measured[0] >= 3 and measured[1] <= 1.5 * measured[0], measured
    absolute_low, absolute_high = (_syncs(results[f"absolute_lr{lr}"][0]) for lr in LEARNING_RATES)
    assert absolute_high >= 3 * max(absolute_low, 1), (absolute_low, absolute_high)


def test_the_first_synchronization_comes_at_the_calibration_check(fits):
    """Before calibration_steps the replicas train alone (the checks are skipped); at the calibration check every
    rank measures, the mean becomes Delta, and a full synchronization follows: checks counted from there."""
    results, _ = fits
    metrics = results["measured"][0]["metrics"]
    steps = results["measured"][0]["local_steps"]
    check_every, calibration = CALIBRATION["check_every"], CALIBRATION["calibration_steps"]
    assert metrics["dynamic/checks"] == (steps - calibration) // check_every + 1
    assert results["measured"][0]["protocol"]["divergence_threshold"] == metrics["dynamic/divergence_threshold"]


def test_a_resumed_run_keeps_the_measured_threshold_and_ends_where_the_uninterrupted_run_ends(fits):
    results, checkpoint = fits
    saved = checkpoint["lightning_dist"]["protocol"]["divergence_threshold"]
    assert saved == results["measured"][0]["metrics"]["dynamic/divergence_threshold"]
    for resumed, uninterrupted in zip(results["resumed"], results["measured"]):
        assert resumed["protocol"]["divergence_threshold"] == saved
        assert torch.equal(resumed["vector"], uninterrupted["vector"])
        assert resumed["metrics"] == uninterrupted["metrics"]


def test_after_fit_the_reference_is_the_final_average_and_the_counter_is_zero(fits):
    """The average every replica holds at the end of fit is a full synchronization in all but name (paper 004's
    reference is the last synchronization's model)."""
    results, _ = fits
    for result in results["measured"]:
        parameters = result["vector"][: result["protocol"]["reference"].numel()]
        assert torch.equal(result["protocol"]["reference"], parameters)
        assert result["protocol"]["violation_counter"] == 0


def test_a_synchronization_dearer_than_any_period_allows_takes_the_drift_after_calibration_steps(fits):
    """The timed rule with an overhead no synchronization meets: the longest period, the same Delta as the replayable
    rule (the same training up to the calibration), and the period logged."""
    results, _ = fits
    dear, replayed = results["timed_dear"][0]["metrics"], results["measured"][0]["metrics"]
    assert dear["dynamic/calibration_period"] == TIMED["calibration_steps"]
    assert replayed["dynamic/calibration_period"] == CALIBRATION["calibration_steps"]
    assert dear["dynamic/divergence_threshold"] == replayed["dynamic/divergence_threshold"]
    # The same schedule; the timed calibration sends more only in its probes and the all-gather of the times: with
    # 2 ranks an all-reduce records its tensor's bytes per rank (two of 8 bytes, one of an eighth of the float32
    # model), an all-gather the 24 bytes sent to the other rank (the simulator's byte model,
    # tests/sim/test_dynamic_threshold.py).
    assert _syncs(results["timed_dear"][0]) == _syncs(results["measured"][0])
    for timed, replayable in zip(results["timed_dear"], results["measured"]):
        probe = timed["vector"].numel() // 8 * 4
        assert timed["local_comm"].protocol_bytes - replayable["local_comm"].protocol_bytes == 2 * 8 + probe + 24


def test_a_synchronization_cheaper_than_any_period_takes_the_drift_after_check_every(fits):
    """The timed rule with an overhead every synchronization meets: the shortest period, whose drift (the replicas'
    mean after check_every steps, exactly what calibration_steps=check_every measures) is smaller than the drift after
    calibration_steps, so the replicas synchronize more often."""
    results, _ = fits
    cheap = results["timed_cheap"][0]["metrics"]
    at_check_every = results["measured_at_check_every"][0]["metrics"]
    assert cheap["dynamic/calibration_period"] == TIMED["check_every"]
    assert cheap["dynamic/divergence_threshold"] == at_check_every["dynamic/divergence_threshold"]
    measured = results["measured"][0]["metrics"]
    assert cheap["dynamic/divergence_threshold"] < measured["dynamic/divergence_threshold"] / 2
    assert _syncs(results["timed_cheap"][0]) > _syncs(results["measured"][0])


def test_a_period_chosen_before_a_checkpoint_is_kept_after_the_resume(fits):
    """The period (30, the longest) is chosen at step 5; checkpointed at step 23, the resumed run does not probe
    again: it measures Delta after 30 steps as the uninterrupted run did (= the replayable rule's), sent the same
    bytes and ends where that run ends."""
    results, _ = fits
    uninterrupted, resumed = results["timed_across_checkpoint"], results["timed_resumed"]
    assert uninterrupted[0]["metrics"]["dynamic/calibration_period"] == 30
    assert (resumed[0]["metrics"]["dynamic/divergence_threshold"]
            == uninterrupted[0]["metrics"]["dynamic/divergence_threshold"]
            == results["measured_at_30"][0]["metrics"]["dynamic/divergence_threshold"])
    for after_resume, straight in zip(resumed, uninterrupted):
        assert torch.equal(after_resume["vector"], straight["vector"])
        assert after_resume["metrics"] == straight["metrics"]
        assert after_resume["local_comm"].protocol_bytes == straight["local_comm"].protocol_bytes
