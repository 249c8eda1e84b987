"""The arithmetic of ``benchmarks/sim_validation``: seconds per synchronization from step end times, the compute step
the simulator is given, and the balancing sets the ranks' signs make (the netns measurement itself is not run here)."""

import itertools
import math

import pytest
import torch

from benchmarks.sim_validation import workload


def test_sync_times_take_the_latest_rank_at_every_synchronization_step():
    ends = [[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [1.5, 2.5, 2.9, 4.5, 5.1, 6.2]]
    assert workload.sync_times(ends, 2) == [2.5, 4.5, 6.2]
    assert workload.sync_times(ends, 1) == [1.5, 2.5, 3.0, 4.5, 5.1, 6.2]
    # a rank with fewer recorded steps bounds the synchronizations counted
    assert workload.sync_times([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0]], 2) == [2.0]


def test_seconds_per_sync_leaves_out_the_warmup():
    times = [5.0, 6.0, 7.5, 9.0]  # the first synchronization includes start-up
    assert workload.seconds_per_sync(times, 1) == pytest.approx((9.0 - 5.0) / 3)
    assert workload.seconds_per_sync(times, 2) == pytest.approx((9.0 - 6.0) / 2)
    for warmup in (0, 4):
        with pytest.raises(ValueError, match="warmup"):
            workload.seconds_per_sync(times, warmup)


def test_local_steps_leave_out_synchronization_steps_and_the_steps_after_them():
    # every=4: steps 4 and 8 synchronize (1 s); steps 5 (after a sync) take 0.5; the others 0.01 or 0.03.
    durations = [0.01, 0.03, 0.01, 1.0, 0.5, 0.03, 0.01, 1.0]
    ends = [list(itertools.accumulate(durations))]
    assert workload.local_step_seconds(ends, 4) == pytest.approx(0.02)  # steps 2, 3, 6, 7
    with pytest.raises(ValueError, match="no step"):
        workload.local_step_seconds(ends, 1)


@pytest.mark.parametrize("ranks", [8, 16])
def test_balancing_sets_and_their_violation_cycles(ranks):
    pair, half, whole = (workload.balancing_set(size, ranks) for size in (2, ranks // 2, ranks))
    assert pair == [1, ranks - 2] and len({rank // 2 for rank in pair}) == 2  # two namespaces of 2 ranks
    assert half == list(range(0, ranks, 2)) and whole == list(range(ranks))
    assert [workload.dynamic_cycle(len(s), ranks) for s in (pair, half, whole)] == [ranks // 2, 2, 1]
    signs = workload.signs_for(half, ranks)
    assert sum(signs) == 0 and [rank for rank, sign in enumerate(signs) if sign] == half


def test_violators_cross_the_threshold_and_a_balanced_set_does_not():
    check_every = 4
    threshold = workload.drift_threshold(check_every)
    model = workload.Directions()
    start = model.layer.weight.detach().clone()
    drift = workload.LR * check_every * model.direction  # what check_every SGD steps with sign 1 move
    assert float(drift.square().sum()) > threshold
    balanced = ((start - drift) + (start + drift)) / 2
    assert float((balanced - start).square().sum()) < 1e-6 * threshold
    assert math.isclose(float(drift.square().sum()), 4 * threshold, rel_tol=0.05)


def test_a_rank_trains_on_its_sign():
    data = workload.SignData([1.0, -1.0, 0.0], steps=3)
    assert [float(x) for (x,) in data.train_loader(3, 1)] == [-1.0, -1.0, -1.0]
    model = workload.Directions()
    loss = model.training_step((torch.tensor([-1.0]),), 0)
    loss.backward()
    assert torch.equal(model.layer.weight.grad, -model.direction)
    with pytest.raises(ValueError):
        data.train_loader(4, 0)
