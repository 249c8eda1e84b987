"""One dynamic-averaging check across 4 real processes equals paper 004's operator in one process."""

import pytest
import torch

from helpers.launch import load_results, run_ranks
from lightning_dist.algorithms.averaging import balance_models, divergence, local_condition_holds, plan_balancing

DIM = 6
FLOAT = 4  # bytes per float32 element


def _expected(results, threshold, seed, counter=0):
    models = results[0]["models"]
    reference = torch.zeros(DIM)
    violators = [i for i, f in enumerate(models) if not local_condition_holds(f, reference, threshold)]
    return violators, balance_models(models, reference, violators, threshold, counter, torch.Generator().manual_seed(seed))


def _balancing_rounds(models, violators, threshold, seed):
    calls = []

    def within(balancing_set, newly_added):
        calls.append(balancing_set)
        mean = torch.stack([models[i] for i in balancing_set]).mean(0)
        return local_condition_holds(mean, torch.zeros(DIM), threshold)

    plan_balancing(violators, len(models), 0, torch.Generator().manual_seed(seed), within)
    return len(calls)


@pytest.mark.parametrize(
    ("spread", "threshold", "seed"),
    [
        ([0.1] * 4, 10.0, 0),  # nobody violates: only flags move
        ([3.0, 0.1, 0.1, 0.1], 1.0, 1),  # one violator; 1 + 2 added >= 4 / 2 hedges to a full sync
        ([0.1, 1.0] + [0.1] * 6, 1.0, 1),  # one violator of 8, balanced by 2 more: a partial sync
        ([3.0] * 4, 1e-3, 2),  # everyone violates: the counter forces a full sync (all-reduce)
    ],
)
def test_check_matches_one_process_definition(tmp_path, spread, threshold, seed):
    world_size = len(spread)
    run_ranks(world_size, "balance", {"threshold": threshold, "seed": seed, "dim": DIM, "spread": spread}, tmp_path)
    results = load_results(tmp_path, world_size)
    assert all(result["error"] is None for result in results)
    violators, (expected_models, expected_reference, balancing_set, expected_counter) = _expected(results, threshold, seed)
    for rank, result in enumerate(results):
        assert torch.allclose(result["vector"], expected_models[rank], atol=1e-6)
        assert torch.allclose(result["reference"], expected_reference, atol=1e-6)
        assert result["counter"] == expected_counter
    # Definition 2 of paper 004: mean unchanged, divergence bounded.
    finals = [result["vector"] for result in results]
    assert torch.allclose(torch.stack(finals).mean(0), torch.stack(results[0]["models"]).mean(0), atol=1e-6)
    assert divergence(finals) <= threshold + 1e-6
    # Bytes: one float64 flag per rank to every other rank, then models only for the balancing set.
    flag_bytes = world_size * (world_size - 1) * 8
    total = sum(result["stats"].protocol_bytes for result in results)
    if not violators:
        assert total == flag_bytes
        assert all(result["metrics"]["dynamic/partial_syncs"] + result["metrics"]["dynamic/full_syncs"] == 0 for result in results)
    else:
        # Models: the star through the coordinator moves |B| - 1 models in and the mean out to
        # |B| - 1 members, the same volume as a ring all-reduce over all ranks: 2 (|B| - 1) N.
        # Control: one uint8 decision to every other rank per balancing round.
        rounds = _balancing_rounds(results[0]["models"], violators, threshold, seed)
        decisions = rounds * (world_size - 1)
        assert total == flag_bytes + decisions + 2 * (len(balancing_set) - 1) * DIM * FLOAT
        partial = len(balancing_set) < world_size
        assert results[0]["metrics"]["dynamic/partial_syncs"] == int(partial)
        untouched = [rank for rank in range(world_size) if rank not in balancing_set]
        for rank in untouched:
            assert torch.equal(results[rank]["vector"], results[rank]["models"][rank])


def test_non_finite_rank_is_named_and_nothing_is_averaged(tmp_path):
    run_ranks(3, "balance", {"threshold": 1e-3, "seed": 0, "dim": DIM, "spread": [1.0] * 3, "nan_rank": 2}, tmp_path)
    results = load_results(tmp_path, 3)
    for rank, result in enumerate(results):
        assert result["error"] is not None and "rank(s) [2]" in result["error"]
        if rank != 2:
            assert torch.equal(result["vector"], result["models"][rank])


@pytest.mark.parametrize(
    ("spread", "threshold"),
    [
        ([3.0] * 4, 1e-3),  # the counter forces a full sync: average_all's all-reduce
        ([3.0, 0.1, 0.1, 0.1], 1.0),  # one violator, hedged to all ranks through the coordinator: star_average
    ],
    ids=["all_reduce", "coordinator"],
)
def test_bfloat16_replicas_get_the_exact_mean_rounded_once(tmp_path, spread, threshold):
    """bfloat16 models are summed in float32 and the mean is rounded to bfloat16 once: every rank ends with the
    one-process definition's mean (itself the float64 mean rounded once), not with a bfloat16 running sum's."""
    dim = 64
    run_ranks(4, "balance", {"threshold": threshold, "seed": 3, "dim": dim, "spread": spread, "dtype": "bfloat16"},
              tmp_path)
    results = load_results(tmp_path, 4)
    assert all(result["error"] is None for result in results)
    models = results[0]["models"]
    assert models[0].dtype == torch.bfloat16
    violators = [i for i, f in enumerate(models) if not local_condition_holds(f, torch.zeros(dim), threshold)]
    expected_models, _, balancing_set, _ = balance_models(
        models, torch.zeros(dim, dtype=torch.bfloat16), violators, threshold, 0, torch.Generator().manual_seed(3))
    assert balancing_set == [0, 1, 2, 3]
    exact = (sum(m.double() for m in models) / 4).to(torch.bfloat16)
    for rank, result in enumerate(results):
        assert result["vector"].dtype == torch.bfloat16
        assert torch.equal(result["vector"], expected_models[rank]) and torch.equal(result["vector"], exact)
        assert torch.equal(result["reference"], exact)
    running = models[0]
    for model in models[1:]:
        running = running + model
    assert not torch.equal(running / 4, exact)  # what summing in bfloat16 gives
