"""Bad arguments fail at construction, naming the parameter and its range, before any process starts."""

import lightning as L
import pytest
from lightning.pytorch.strategies import StrategyRegistry

import lightning_dist
from lightning_dist import DynamicAveragingStrategy, PeriodicAveragingStrategy


@pytest.mark.parametrize("value", [0, 0.0, -1.0, float("nan"), float("inf"), "1", True])
def test_divergence_threshold(value):
    with pytest.raises(ValueError, match=r"divergence_threshold must be None \(measured in the run\) or a finite number > 0"):
        DynamicAveragingStrategy(divergence_threshold=value)


@pytest.mark.parametrize("value", [0, -0.5, float("nan"), float("inf"), "0.25", True])
def test_sync_overhead(value):
    with pytest.raises(ValueError, match=r"sync_overhead must be None .* or a finite number > 0 .*; got"):
        DynamicAveragingStrategy(sync_overhead=value)


@pytest.mark.parametrize(("value", "message"), [
    (0, r"calibration_steps must be an integer >= 1"),
    (True, r"calibration_steps must be an integer >= 1"),
    (15, r"calibration_steps must be a multiple of check_every=10 .*; got 15"),
])
def test_calibration_steps(value, message):
    with pytest.raises(ValueError, match=message):
        DynamicAveragingStrategy(calibration_steps=value)


def test_a_set_threshold_takes_any_check_interval_without_calibration_steps():
    """calibration_steps (default 100) only matters when Delta is measured: check_every=3 is fine with a set one."""
    assert DynamicAveragingStrategy(divergence_threshold=0.5, check_every=3).check_every == 3


def test_the_default_threshold_is_measured_and_an_explicit_one_is_used_as_given():
    assert DynamicAveragingStrategy().threshold is None
    assert DynamicAveragingStrategy(divergence_threshold=2).threshold == 2.0


@pytest.mark.parametrize("value", [0, -3, 1.5, True])
def test_check_every_and_period(value):
    with pytest.raises(ValueError, match=r"check_every must be an integer >= 1"):
        DynamicAveragingStrategy(check_every=value)
    with pytest.raises(ValueError, match=r"period must be an integer >= 1"):
        PeriodicAveragingStrategy(period=value)


@pytest.mark.parametrize("value", [0, -0.5, 1.0001, float("nan")])
def test_client_fraction(value):
    with pytest.raises(ValueError, match=r"client_fraction must lie in \(0, 1\]"):
        PeriodicAveragingStrategy(client_fraction=value)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: PeriodicAveragingStrategy(compression="fp8"), r"compression must be None or one of 'bf16', 'int8'"),
    (lambda: DynamicAveragingStrategy(compression=8), r"compression must be None or one of 'bf16', 'int8'"),
    (lambda: PeriodicAveragingStrategy(client_fraction=0.5, compression="int8"),
     r"compression needs client_fraction=1 \(got 0.5\): FedAvg's rounds average a subset"),
    (lambda: lightning_dist.SegmentedGossipStrategy(compression="bf16"),
     r"SegmentedGossipStrategy does not support compression"),
    (lambda: lightning_dist.DownpourSGDStrategy(compression="int4"), r"compression must be None or one of 'bf16', 'int8'"),
])
def test_compression(build, message):
    with pytest.raises(ValueError, match=message):
        build()
    assert PeriodicAveragingStrategy(compression="int8").compression == "int8"
    assert lightning_dist.DownpourSGDStrategy(compression="bf16").compression == "bf16"


@pytest.mark.parametrize("name", ["dynamic_avg", "periodic_avg", "fedavg"])
def test_one_process_is_refused_when_the_trainer_is_built(name):
    with pytest.raises(ValueError, match=r"needs at least 2 \(devices \* num_nodes >= 2\)"):
        L.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False)


def test_names_resolve_and_registration_is_idempotent():
    lightning_dist.register_strategies()  # a second import in a launched process must not fail
    trainer = L.Trainer(strategy="dynamic_avg", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, DynamicAveragingStrategy)
    fedavg = L.Trainer(strategy="fedavg", accelerator="cpu", devices=2, logger=False).strategy
    assert isinstance(fedavg, PeriodicAveragingStrategy) and fedavg.client_fraction == 0.5
    assert {"dynamic_avg", "periodic_avg", "fedavg"} <= set(StrategyRegistry.available_strategies())
