"""Dynamic averaging's measured threshold (``divergence_threshold=None``) in 2-process fits.

One launch trains the same MLP in two systems of units (every parameter stored 10 times larger, learning rate 100
times larger: the same trajectory, squared distances 100 times larger) and at two learning rates, with the measured
threshold and with an absolute one; a second launch resumes the measured run from a checkpoint.
"""

import pytest
import torch

from helpers.launch import load_results, run_ranks

CALIBRATION = {"check_every": 5, "calibration_steps": 20}
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
    ]
    run_ranks(2, "fit", {"trainer": {"max_epochs": EPOCHS}, "runs": runs}, root / "full", timeout=480)
    results = {run["name"]: load_results(root / "full" / run["name"], 2) for run in runs}
    checkpoint = next(checkpoints.glob("epoch=1-*.ckpt"))
    resume = [_run("resumed", CALIBRATION, ckpt_path=str(checkpoint))]
    run_ranks(2, "fit", {"trainer": {"max_epochs": EPOCHS}, "runs": resume}, root / "resumed", timeout=480)
    results["resumed"] = load_results(root / "resumed" / "resumed", 2)
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
