"""Paper 004's averaging math, checked in one process against hand-computed cases."""

import math

import pytest
import torch

from lightning_dist.algorithms.averaging import (
    calibrated_threshold,
    calibration_period,
    estimated_sync_seconds,
    probed_period,
    sync_probe,
    sync_probe_bytes,
    augment_balancing_set,
    balance_models,
    count_violations,
    divergence,
    local_condition_holds,
    plan_balancing,
    sample_participants,
    squared_distance,
    squared_distance_sum,
    weighted_average,
)


def test_squared_distance_and_local_condition_by_hand():
    model, reference = torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0])
    assert squared_distance(model, reference) == 5.0
    assert local_condition_holds(model, reference, 5.0)
    assert not local_condition_holds(model, reference, 4.99)
    assert not local_condition_holds(torch.tensor([float("nan"), 0.0]), reference, 1e9)


def test_squared_distance_sum_is_the_float64_definition_by_hand_in_chunks():
    """Paper 004's ||f - r||^2 with every entry taken to float64 first, over tensors of other shapes and dtypes
    (a bfloat16 bias: 0.1 is 0.10009765625 there; 0.3 in float32 is 0.30000001192092896), in chunks of 3 entries
    so that chunk boundaries fall inside a tensor."""
    weight = torch.tensor([[1.5, -2.0], [0.25, 3.0]])
    bias = torch.tensor([0.1], dtype=torch.bfloat16)
    reference = torch.tensor([1.0, -1.0, 0.0, 2.5, 0.3])
    pairs = [(weight, reference[:4].view(2, 2)), (bias, reference[4:])]
    expected = 0.5**2 + 1.0**2 + 0.25**2 + 0.5**2 + (0.10009765625 - 0.30000001192092896) ** 2
    for chunk in (3, 1, 1 << 20):
        distance = squared_distance_sum(pairs, chunk_elements=chunk)
        assert distance.dtype == torch.float64 and distance.dim() == 0
        assert float(distance) == pytest.approx(expected, rel=1e-15, abs=0)
    # Against the whole-vector float64 formula on a large random case (summation order differs only).
    model = torch.randn(3_000_001, generator=torch.Generator().manual_seed(0))
    other = model + 1e-3 * torch.randn(3_000_001, generator=torch.Generator().manual_seed(1))
    whole = float(torch.sum((model.double() - other.double()) ** 2))
    assert float(squared_distance_sum([(model, other)])) == pytest.approx(whole, rel=1e-12)
    assert squared_distance(model, other) == pytest.approx(whole, rel=1e-12)
    with pytest.raises(ValueError, match="equal sizes"):
        squared_distance_sum([(weight, reference)])


def test_bfloat16_means_are_the_exact_mean_rounded_once():
    """A bfloat16 mean must be the exact (float64) weighted mean of the bfloat16 values, rounded to bfloat16 once:
    sums run in float32. Summing in bfloat16 rounds at every addition (and 343 is 344 in bfloat16), which the last
    assertions show gives other values here."""
    bf16 = torch.bfloat16
    models = [torch.tensor(values, dtype=bf16) for values in
              ([1.0, 3.0, -0.5, 100.0], [0.00390625, 0.0117, 0.3, 1.01], [0.00390625, 0.0117, 0.29, -99.0])]
    weights = [190.0, 343.0, 257.0]  # unequal part sizes, as Dirichlet parts have
    exact = sum(w * m.double() for w, m in zip(weights, models)) / sum(weights)
    exact_plain = sum(m.double() for m in models) / len(models)
    weighted, plain = weighted_average(models, weights), weighted_average(models)
    assert weighted.dtype == plain.dtype == bf16
    assert torch.equal(weighted, exact.to(bf16)) and torch.equal(plain, exact_plain.to(bf16))
    running = torch.zeros(4, dtype=bf16)
    for w, m in zip(weights, models):
        running = running + torch.tensor(w, dtype=bf16) * m
    assert not torch.equal(running / torch.tensor(weights, dtype=bf16).sum(), weighted)
    running = models[0] + models[1] + models[2]
    assert not torch.equal(running / 3, plain)


def test_calibration_period_is_the_shortest_whose_synchronization_costs_at_most_the_overhead():
    """sync <= overhead * period * step: with 0.5 s steps and a 3 s synchronization, 25 % allows 24 steps or more
    (the first multiple of 10: 30); 100 % allows 6 (10); 1 % would need 600 (none: the longest, 100)."""
    periods = list(range(10, 101, 10))
    assert calibration_period(periods, 0.5, 3.0, 0.25) == 30
    assert calibration_period(periods, 0.5, 3.0, 1.0) == 10
    assert calibration_period(periods, 0.5, 3.0, 0.01) == 100
    assert calibration_period(periods, 0.5, 3.0, 0.2) == 30  # exactly 0.2 * 30 * 0.5 = 3.0: allowed
    assert calibration_period(periods, 0.5, 3.0, None) == 100  # the replayable rule
    for step, sync in ((math.nan, 3.0), (0.5, math.inf), (0.0, 3.0), (0.5, -1.0)):
        assert calibration_period(periods, step, sync, 0.25) == 100


def test_estimated_sync_seconds_extends_the_line_through_the_two_probes():
    """t = a + c * bytes through (8 bytes: 0.01 s) and (an eighth: 0.06 s): 8 * 0.06 - 7 * 0.01 = 0.41 s for the
    whole model; a probe no slower than the 8 bytes (latency-bound, or noise) gives the probe's own time."""
    assert estimated_sync_seconds(0.01, 0.06) == pytest.approx(0.41)
    assert estimated_sync_seconds(0.01, 0.06, parts=4) == pytest.approx(0.21)
    assert estimated_sync_seconds(0.05, 0.04) == 0.04


def test_the_probe_is_an_eighth_of_a_synchronization_and_at_most_64_mib():
    assert sync_probe_bytes(800) == 100
    assert sync_probe_bytes(4 * 10**9) == 64 << 20  # a billion float32 parameters: 64 MiB, not 500 MB
    assert sync_probe_bytes(3) == 1


def test_the_probe_is_sized_from_the_largest_chunk_of_a_learner():
    """Under a hierarchy of L ranks per learner every rank probes from the largest chunk, ceil(numel / L) entries:
    1,000,003 float32 entries on 4 ranks are chunks of 250,001 (ranks 0-2) and 250,000 (rank 3), and every rank
    probes 31,250 entries, an eighth of 250,001 * 4 bytes rounded down to whole entries (parts 8.000032, where rank
    3's own chunk gave 8.0). A chunk smaller than 8 entries probes one entry; a billion entries cap at 64 MiB."""
    def float32(numel):
        return 4 * numel

    assert sync_probe(1_000_003, 4, 4, float32) == (31_250, 1_000_004 / 125_000)
    assert sync_probe(1_000_003, 1, 4, float32) == (125_000, 4_000_012 / 500_000)
    assert sync_probe(7, 4, 4, float32) == (1, 2.0) and sync_probe(1, 4, 4, float32) == (1, 1.0)
    assert sync_probe(10**9, 1, 4, float32) == ((64 << 20) // 4, 4 * 10**9 / (64 << 20))


def test_probed_period_takes_the_mean_step_and_the_fastest_probes():
    """Three ranks: mean step 0.2 s; fastest probes 0.01 s and 0.04 s (the others waited for the last to arrive)
    give 8 * 0.04 - 7 * 0.01 = 0.25 s; at 30 % 10 steps allow 0.6 s: period 10; at 5 %, 30 steps (0.3 s). Non-finite
    times are left out; none at all gives the longest period."""
    periods = [10, 20, 30, 40]
    steps, latencies, probes = [0.1, 0.2, 0.3], [0.02, 0.01, 0.5], [0.04, 0.09, 0.6]
    assert probed_period(periods, steps, latencies, probes, 0.3) == 10
    assert probed_period(periods, steps, latencies, probes, 0.05) == 30
    assert probed_period(periods, [0.2, math.nan, 0.2], latencies, [0.04, math.inf, 0.6], 0.05) == 30
    assert probed_period(periods, [math.nan], [0.01], [0.04], 0.3) == 40


def test_calibrated_threshold_is_the_mean_drift_and_refuses_replicas_that_did_not_move():
    assert calibrated_threshold([1.0, 2.0, 6.0], steps=100) == 3.0
    for drifts in ([0.0, 0.0], [1.0, float("nan")], []):
        with pytest.raises(ValueError, match="calibration_steps=100 .*set divergence_threshold"):
            calibrated_threshold(drifts, steps=100)


def test_divergence_is_mean_squared_distance_to_mean():
    models = [torch.tensor([0.0]), torch.tensor([2.0]), torch.tensor([4.0])]
    # mean 2; squared distances 4, 0, 4; divergence = 8 / 3 (eq. 2)
    assert divergence(models) == pytest.approx(8 / 3)


def test_weighted_average_by_hand_and_bad_weights():
    models = [torch.tensor([0.0, 0.0]), torch.tensor([3.0, 6.0])]
    assert torch.equal(weighted_average(models), torch.tensor([1.5, 3.0]))
    assert torch.allclose(weighted_average(models, [1.0, 2.0]), torch.tensor([2.0, 4.0]))
    with pytest.raises(ValueError, match="weights"):
        weighted_average(models, [1.0])
    with pytest.raises(ValueError, match="models"):
        weighted_average([])


def test_violation_counter_forces_full_sync_at_m():
    assert count_violations([1], 0, 4) == (False, 1)
    assert count_violations([1, 2], 1, 4) == (False, 3)
    assert count_violations([3], 3, 4) == (True, 0)
    assert count_violations([0, 1, 2], 2, 4) == (True, 0)  # jumps past m


def test_augmentation_adds_twice_the_set_and_hedges_to_full_sync():
    generator = torch.Generator().manual_seed(0)
    added, full = augment_balancing_set([5], 16, generator)
    assert len(added) == 2 and 5 not in added and not full
    added, full = augment_balancing_set([0, 1, 2], 16, generator)  # 3 + 6 >= 8 -> full sync
    assert full and sorted(added) == list(range(3, 16))
    added, full = augment_balancing_set([0], 2, generator)
    assert full and added == [1]


def test_plan_balancing_stops_when_mean_is_within_threshold():
    calls = []

    def within(balancing_set, newly_added):
        calls.append((list(balancing_set), list(newly_added)))
        return len(balancing_set) >= 3

    balancing_set, counter = plan_balancing([4], 20, 0, torch.Generator().manual_seed(1), within)
    assert len(balancing_set) == 3 and 4 in balancing_set
    assert counter == 1
    assert calls[0] == ([4], [4])
    assert sorted(calls[1][1] + [4]) == balancing_set


def test_plan_balancing_full_sync_skips_the_callback():
    def never(balancing_set, newly_added):  # pragma: no cover - must not run
        raise AssertionError("a forced full sync needs no balancing check")

    balancing_set, counter = plan_balancing([0, 1], 2, 0, torch.Generator(), never)
    assert balancing_set == [0, 1] and counter == 0
    assert plan_balancing([], 4, 2, torch.Generator(), never) == ([], 2)


def _random_models(m: int, dim: int, spread: float, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(dim, generator=generator, dtype=torch.float64) * spread for _ in range(m)]


@pytest.mark.parametrize("seed", range(20))
def test_balancing_preserves_mean_and_bounds_divergence(seed):
    """Definition 2 of paper 004: (i) mean unchanged, (ii) divergence <= Delta afterwards."""
    m, threshold = 12, 1.0
    reference = torch.zeros(5, dtype=torch.float64)
    models = _random_models(m, 5, spread=0.2 + 0.1 * seed, seed=seed)
    violators = [i for i, f in enumerate(models) if not local_condition_holds(f, reference, threshold)]
    new_models, new_reference, balancing_set, _ = balance_models(
        models, reference, violators, threshold, 0, torch.Generator().manual_seed(seed)
    )
    assert torch.allclose(torch.stack(new_models).mean(0), torch.stack(models).mean(0))
    for model in new_models:  # every local condition holds, w.r.t. the possibly new reference
        assert local_condition_holds(model, new_reference, threshold + 1e-9)
    assert divergence(new_models) <= threshold + 1e-9
    assert set(violators) <= set(balancing_set) or not violators


def test_huge_threshold_touches_nothing_and_tiny_threshold_averages_all():
    models = _random_models(6, 4, spread=1.0, seed=3)
    reference = torch.zeros(4, dtype=torch.float64)
    same, ref, balancing_set, _ = balance_models(models, reference, [], 1e9, 0, torch.Generator())
    assert balancing_set == [] and all(a is b for a, b in zip(same, models)) and ref is reference
    violators = list(range(6))
    averaged, ref, balancing_set, counter = balance_models(models, reference, violators, 1e-12, 0, torch.Generator())
    assert balancing_set == violators and counter == 0
    mean = torch.stack(models).mean(0)
    assert all(torch.allclose(model, mean) for model in averaged) and torch.allclose(ref, mean)


def test_balance_models_reports_each_round_of_model_fetches():
    # Rank 0 far off, the rest at the reference: B = {0}; its mean still violates, so B grows by
    # 2|B| = 2 random ranks (3 of 8 < half); still violating, the next growth would pass half of the
    # ranks, so it is a full sync without testing (or fetching for) that last augmentation.
    models = [torch.full((3,), 10.0, dtype=torch.float64)] + [torch.zeros(3, dtype=torch.float64)] * 7
    fetches = []
    _, _, balancing_set, _ = balance_models(
        models, torch.zeros(3, dtype=torch.float64), [0], 1.0, 0, torch.Generator().manual_seed(0), fetches.append
    )
    assert fetches[0] == [0]
    assert len(fetches[1]) == 2 and 0 not in fetches[1]
    assert balancing_set == list(range(8))
    assert len(fetches) == 2


def test_fedavg_participants():
    generator = torch.Generator().manual_seed(0)
    chosen = sample_participants(10, 0.3, generator)
    assert len(chosen) == 3 and chosen == sorted(set(chosen))
    assert sample_participants(10, 0.01, generator) != []  # max(C*m, 1)
    assert sample_participants(4, 1.0, generator) == [0, 1, 2, 3]


def test_fedavg_participants_among_the_present_follow_one_permutation():
    draws = {name: torch.Generator().manual_seed(3) for name in ("all", "every_one_present", "some_present")}
    for _ in range(20):
        everyone = sample_participants(6, 0.5, draws["all"])
        assert sample_participants(6, 0.5, draws["every_one_present"], range(6)) == everyone
        generator = draws["some_present"]
        order = torch.randperm(6, generator=torch.Generator().manual_seed(0).set_state(generator.get_state())).tolist()
        chosen = sample_participants(6, 0.5, generator, [0, 2, 3, 5])
        # The first 3 present ranks of the same permutation, and the generator where the others' is: the draws of
        # groups that disagree on who is present stay in step.
        assert chosen == sorted([rank for rank in order if rank in (0, 2, 3, 5)][:3])
        assert torch.equal(generator.get_state(), draws["all"].get_state())
    assert sample_participants(4, 1.0, torch.Generator(), [1, 3]) == [1, 3]
    assert sample_participants(4, 0.5, torch.Generator(), [2]) == [2]  # fewer present than the round's count
