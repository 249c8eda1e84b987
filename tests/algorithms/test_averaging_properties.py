"""Properties of dynamic averaging's decisions (paper 004, Algorithm 1, and our calibration), on random inputs.

Every rank computes these decisions itself from the same inputs, and they decide when ranks meet in collectives: they
must be pure functions of those inputs, and keep the rules the docstrings state for any sizes and seeds.
"""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dist.algorithms.averaging import (
    accumulated_nbytes,
    calibration_periods,
    estimated_sync_seconds,
    plan_balancing,
    probed_period,
    sync_probe,
)
from lightning_dist.algorithms.subset_average import chunk_bounds

SECONDS = st.floats(min_value=1e-6, max_value=100.0, allow_nan=False)
TIMES = st.one_of(SECONDS, st.just(math.nan), st.just(math.inf))
OVERHEAD = st.floats(min_value=1e-6, max_value=1e3, allow_nan=False)


@st.composite
def calibrations(draw):
    """``(periods, step times, latencies, probe times, parts)`` as every rank gathers them (some not finite)."""
    check_every = draw(st.integers(1, 20))
    periods = calibration_periods(check_every, check_every * draw(st.integers(1, 12)))
    ranks = draw(st.integers(1, 8))
    rows = [[draw(TIMES) for _ in range(ranks)] for _ in range(3)]
    parts = draw(st.floats(min_value=1.0, max_value=64.0))
    return (check_every, periods, *rows, parts)


@settings(max_examples=150, deadline=None)
@given(calibrations(), OVERHEAD, OVERHEAD, st.randoms(use_true_random=False))
def test_probed_period_is_a_pure_monotone_choice_among_the_periods(calibration, overhead, other, shuffler):
    """The period is one of the checks up to calibration_steps, the same for the same times in any rank order (every
    rank gathers them in rank order, but nothing may depend on it), the same when computed again, no longer for a
    larger overhead, and, unless the longest, the shortest whose estimated synchronization fits the overhead."""
    check_every, periods, steps, latencies, probes, parts = calibration
    period = probed_period(periods, steps, latencies, probes, overhead, parts)
    assert period in periods and period % check_every == 0 and check_every <= period <= periods[-1]
    assert probed_period(periods, list(steps), list(latencies), list(probes), overhead, parts) == period
    order = list(range(len(steps)))
    shuffler.shuffle(order)
    shuffled = [[row[index] for index in order] for row in (steps, latencies, probes)]
    assert probed_period(periods, *shuffled, overhead, parts) == period
    low, high = sorted((overhead, other))
    assert (probed_period(periods, steps, latencies, probes, low, parts)
            >= probed_period(periods, steps, latencies, probes, high, parts))
    finite = [[value for value in row if math.isfinite(value)] for row in (steps, latencies, probes)]
    if period != periods[-1]:
        step = math.fsum(finite[0]) / len(finite[0])
        sync = estimated_sync_seconds(min(finite[1]), min(finite[2]), parts)
        assert sync <= overhead * period * step
        assert all(sync > overhead * shorter * step for shorter in periods if shorter < period)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10**9), st.integers(1, 16), st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_the_probe_is_sized_from_the_largest_chunk_whatever_the_rank(numel, ranks_per_learner, dtype):
    """sync_probe sees only the largest of the chunks the ranks of a learner carry (so no rank's own chunk can change
    it), probes at least one whole entry and at most an eighth of that chunk's synchronization (or 64 MiB), and
    ``parts`` is the synchronization's bytes over the probe's."""
    element = accumulated_nbytes(1, dtype)
    asked = []

    def sync_bytes(entries):
        asked.append(entries)
        return accumulated_nbytes(entries, dtype)

    elements, parts = sync_probe(numel, ranks_per_learner, element, sync_bytes)
    largest = max(stop - start for start, stop in chunk_bounds(numel, list(range(ranks_per_learner))).values())
    assert asked == [largest]
    chunk = accumulated_nbytes(largest, dtype)
    assert elements >= 1 and (elements == 1 or elements * element <= min(chunk // 8, 64 << 20))
    assert parts == chunk / (elements * element)


@st.composite
def balancings(draw):
    """``(ranks, violators, violation counter, seed, answers)``: the callback's answers, in order, while asked."""
    ranks = draw(st.integers(2, 200))
    violators = draw(st.lists(st.integers(0, ranks - 1), min_size=1, max_size=ranks, unique=True))
    counter = draw(st.integers(0, ranks - 1))
    return ranks, violators, counter, draw(st.integers(0, 2**31)), draw(st.lists(st.booleans(), max_size=8))


def _plan(ranks, violators, counter, seed, answers):
    """plan_balancing with the callback answering ``answers`` in turn (False once they run out); its calls."""
    calls = []

    def mean_within_threshold(balancing_set, newly_added):
        calls.append((list(balancing_set), list(newly_added)))
        return answers[len(calls) - 1] if len(calls) <= len(answers) else False

    result = plan_balancing(violators, ranks, counter, torch.Generator().manual_seed(seed), mean_within_threshold)
    return result, calls


@settings(max_examples=150, deadline=None)
@given(balancings())
def test_plan_balancing_keeps_algorithm_1s_rules(balancing):
    """The violation counter: ``v + |B_0| >= m`` synchronizes all at once (counter 0, nothing asked), else the counter
    is ``v + |B_0|``. The set starts as the violators and each round adds ``2 |B|`` ranks not yet in it, asked about
    unless it would reach half of the ranks, where everyone synchronizes; the set ends where the callback answers
    True. The same seed plans the same balancing."""
    ranks, violators, counter, seed, answers = balancing
    (final, new_counter), calls = _plan(*balancing)
    assert _plan(*balancing) == ((final, new_counter), calls)
    assert set(violators) <= set(final) and final == sorted(final)
    if counter + len(violators) >= ranks:
        assert final == list(range(ranks)) and new_counter == 0 and calls == []
        return
    assert new_counter == counter + len(violators)  # below m: not every rank violates
    assert calls[0] == (sorted(violators), sorted(violators))
    for (previous, _), (members, added) in zip(calls, calls[1:]):
        assert not set(added) & set(previous) and len(added) == 2 * len(previous)
        assert members == sorted(previous + added) and len(members) < ranks / 2
    asked = len(calls)
    if asked <= len(answers) and answers[asked - 1]:
        assert final == calls[-1][0]
    else:
        assert final == list(range(ranks))
        last = calls[-1][0]
        assert len(last) + min(2 * len(last), ranks - len(last)) >= ranks / 2
