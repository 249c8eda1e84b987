"""Dynamic-averaging checks across 4 and 8 real processes equal paper 004's operator in one process.

The cases of one world size share a launch (tests/workers/balance.py runs them one after another).
"""

import pytest
import torch

from helpers.launch import load_results, run_ranks
from lightning_dist.algorithms.averaging import balance_models, divergence, local_condition_holds, plan_balancing

DIM = 6
FLOAT = 4  # bytes per float32 element
E = [2.0, -1.0, 0.5, 1.5, -0.5, 1.0]  # ||E||^2 = 8.75


def _scaled(factor, vector=E):
    return [factor * value for value in vector]


# The simulator's test model (tests/sim/helpers.py: MLPClassifier 64-16-16-10) has this many parameters and no
# buffers; the cross-check case gives the strategy's workers models of that size, so the simulator can hold the same.
SIM_MODEL = 1482
CROSS_THRESHOLD = 0.5 * SIM_MODEL


def _cross_check_models():
    """8 models of SIM_MODEL entries: rank 1 far from r = 0 (a violator), the others near it; the violator's mean with
    2 added ranks lies within the threshold, a two-round partial synchronization of 3."""
    generator = torch.Generator().manual_seed(5)
    spread = [0.1, 1.0] + [0.1] * 6
    return [(torch.randn(SIM_MODEL, generator=generator) * factor).tolist() for factor in spread]


CASES = {
    4: {
        "quiet": {"spread": [0.1] * 4, "threshold": 10.0, "seed": 0},  # nobody violates: only distances move
        # one violator; 1 + 2 added >= 4 / 2 hedges to a full sync (the all-reduce)
        "hedged": {"spread": [3.0, 0.1, 0.1, 0.1], "threshold": 1.0, "seed": 1},
        "counter": {"spread": [3.0] * 4, "threshold": 1e-3, "seed": 2},  # everyone violates: the counter forces it
        # ranks 1 and 3 violate in opposite directions: their mean lies within Delta, a partial sync of 2
        "set_of_2": {"models": [_scaled(0.1), _scaled(1.0), _scaled(-0.2), _scaled(-0.9)], "threshold": 1.0, "seed": 0},
        # ranks 0, 1, 2 violate, their mean is near r: a partial sync of 3, rank 3 untouched
        "set_of_3": {"models": [_scaled(2.0), _scaled(-1.2), _scaled(-0.7), _scaled(0.2)], "threshold": 1.0, "seed": 0},
        # the same with AVERAGE_BUCKET = 2: the members' chunks of 2 entries go out in windows of 2 // 2 = 1 entry
        "set_of_3_windows": {"models": [_scaled(2.0), _scaled(-1.2), _scaled(-0.7), _scaled(0.2)], "threshold": 1.0,
                             "seed": 0, "bucket": 2},
        "bf16_all_reduce": {"spread": [3.0] * 4, "threshold": 1e-3, "seed": 3, "dim": 64, "dtype": "bfloat16"},
        "bf16_hedged": {"spread": [3.0, 0.1, 0.1, 0.1], "threshold": 1.0, "seed": 3, "dim": 64, "dtype": "bfloat16"},
        "bf16_set_of_2": {"models": [_scaled(0.1), _scaled(1.3), _scaled(-0.2), _scaled(-1.1)], "threshold": 1.0,
                          "seed": 0, "dtype": "bfloat16"},
    },
    # one violator of 8, balanced by 2 more: two rounds, the second adds two whole models to the first's sum
    8: {"two_rounds": {"spread": [0.1, 1.0] + [0.1] * 6, "threshold": 1.0, "seed": 1},
        "cross_check": {"models": _cross_check_models(), "threshold": CROSS_THRESHOLD, "seed": 1},
        # a set of 3 of 1482 entries gathered in windows of 100 // 2 = 50 entries
        "cross_check_windows": {"models": _cross_check_models(), "threshold": CROSS_THRESHOLD, "seed": 1,
                                "bucket": 100}},
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    results = {}
    for world_size, cases in CASES.items():
        out = tmp_path_factory.mktemp(f"balance{world_size}")
        specs = [{"dim": DIM, **case} for case in cases.values()]
        run_ranks(world_size, "balance", {"cases": specs}, out)
        per_rank = load_results(out, world_size)
        for index, name in enumerate(cases):
            results[name] = [per_rank[rank][index] for rank in range(world_size)]
    return results


def _expected(results, threshold, seed):
    models = results[0]["models"]
    reference = torch.zeros_like(models[0])
    violators = [i for i, f in enumerate(models) if not local_condition_holds(f, reference, threshold)]
    return violators, balance_models(models, reference, violators, threshold, 0, torch.Generator().manual_seed(seed))


def _decision_rounds(models, violators, threshold, seed):
    """Rounds whose set has more than one member: each costs one all-gather of 8-byte distances."""
    sets = []

    def within(balancing_set, newly_added):
        sets.append(balancing_set)
        mean = torch.stack([models[i].double() for i in balancing_set]).mean(0)
        return local_condition_holds(mean, torch.zeros_like(mean), threshold)

    plan_balancing(violators, len(models), 0, torch.Generator().manual_seed(seed), within)
    return sum(len(members) > 1 for members in sets)


def _all_cases():
    return [(name, world_size) for world_size, cases in CASES.items() for name in cases]


@pytest.mark.parametrize(("name", "world_size"), _all_cases())
def test_check_matches_one_process_definition(launched, name, world_size):
    case = CASES[world_size][name]
    results = launched[name]
    assert all(result["error"] is None for result in results)
    threshold, seed = case["threshold"], case["seed"]
    violators, (expected_models, expected_reference, balancing_set, expected_counter) = _expected(results, threshold, seed)
    models = results[0]["models"]
    for rank, result in enumerate(results):
        assert torch.allclose(result["vector"].double(), expected_models[rank].double(), atol=1e-6)
        assert torch.allclose(result["reference"].double(), expected_reference.double(), atol=1e-6)
        assert result["counter"] == expected_counter
    finals = [result["vector"].double() for result in results]
    # Definition 2 of paper 004: mean unchanged (up to the models' rounding), divergence bounded.
    tolerance = 1e-6 if models[0].dtype == torch.float32 else 2e-2
    assert torch.allclose(torch.stack(finals).mean(0), torch.stack([m.double() for m in models]).mean(0), atol=tolerance)
    assert divergence(finals) <= threshold + 1e-6
    if models[0].dtype == torch.bfloat16:
        # Summed in float32 and rounded once: members hold the exact mean rounded to bfloat16.
        exact = (sum(models[rank].double() for rank in balancing_set) / len(balancing_set)).to(torch.bfloat16)
        for rank in balancing_set:
            assert torch.equal(results[rank]["vector"], exact)
    untouched = [rank for rank in range(world_size) if rank not in balancing_set]
    for rank in untouched:
        assert torch.equal(results[rank]["vector"], models[rank])
    # Bytes: every rank all-gathers its 8-byte distance at the check and in every decision round.
    model_bytes = models[0].numel() * models[0].element_size()
    gathers = 1 + (_decision_rounds(models, violators, threshold, seed) if violators else 0)
    per_rank_flags = gathers * (world_size - 1) * 8
    sent = [result["stats"].protocol_bytes for result in results]
    if not violators:
        assert sent == [per_rank_flags] * world_size
        assert all(result["metrics"]["dynamic/partial_syncs"] + result["metrics"]["dynamic/full_syncs"] == 0
                   for result in results)
        return
    partial = len(balancing_set) < world_size
    assert results[0]["metrics"]["dynamic/partial_syncs"] == int(partial)
    assert results[0]["metrics"]["dynamic/full_syncs"] == int(not partial)
    if partial:
        # Each member sends its chunks of its model (reduce) and of the mean (gather): 2 (|B| - 1) / |B| models,
        # what a ring all-reduce among the members costs; no rank more. Non-members send only distances.
        share = 2 * (len(balancing_set) - 1) * model_bytes // len(balancing_set)
        for rank in range(world_size):
            assert sent[rank] == per_rank_flags + (share if rank in balancing_set else 0)
    else:
        # The all-reduce over all ranks (float32 sums: bfloat16 models travel at twice their size).
        reduced_bytes = models[0].numel() * 4
        assert sum(sent) == world_size * per_rank_flags + 2 * (world_size - 1) * reduced_bytes


def test_the_cases_cover_partial_sets_of_two_and_three_and_two_rounds(launched):
    sizes = {name: sum(result["metrics"]["dynamic/partial_syncs"] for result in launched[name][:1]) for name in launched}
    assert sizes["set_of_2"] == sizes["set_of_3"] == sizes["two_rounds"] == sizes["bf16_set_of_2"] == 1
    members = lambda name: [r for r, res in enumerate(launched[name]) if not torch.equal(res["vector"], res["models"][r])]
    assert members("set_of_2") == [1, 3] and members("set_of_3") == [0, 1, 2] and len(members("two_rounds")) == 3


def test_non_finite_rank_is_named_and_nothing_is_averaged(tmp_path):
    """A NaN in rank 2's weights, or only in rank 1's buffer, the running statistic the distance does not cover but
    balancing averages (there ranks 1 and 3 would form a set of 2, as in ``set_of_2``): every rank raises naming the
    rank, and no model moves."""
    cases = [{"threshold": 1e-3, "seed": 0, "dim": DIM, "spread": [1.0] * 4, "nan_rank": 2},
             {**CASES[4]["set_of_2"], "dim": DIM, "nan_buffer_rank": 1}]
    run_ranks(4, "balance", {"cases": cases}, tmp_path)
    for case, results in zip(cases, zip(*load_results(tmp_path, 4))):
        named = case.get("nan_rank", case.get("nan_buffer_rank"))
        for rank, result in enumerate(results):
            assert result["error"] is not None and f"rank(s) [{named}]" in result["error"], (case, rank, result["error"])
            if rank != named:
                assert torch.equal(result["vector"][:DIM], result["models"][rank]), (case, rank)


@pytest.mark.parametrize("name", ["set_of_3", "cross_check"])
def test_a_balancing_gathered_in_windows_is_the_same_model_and_bytes(launched, name):
    """A small AVERAGE_BUCKET (a large model's, scaled down) gathers the set's mean in windows of the members' chunks,
    reading each rank's pieces from its model rather than a copy of it: every rank ends with the same bits and sends
    the same bytes, in more messages."""
    whole, windows = launched[name], launched[f"{name}_windows"]
    for a, b in zip(whole, windows):
        assert a["error"] is None and b["error"] is None
        assert torch.equal(a["vector"], b["vector"])
        assert a["stats"].protocol_bytes == b["stats"].protocol_bytes
    assert sum(b["stats"].messages for b in windows) > sum(a["stats"].messages for a in whole)


def test_the_simulator_moves_what_the_strategy_moves_for_the_same_models(launched):
    """The cross-check case run by the simulator's dynamic averaging as the strategy runs it (topology="strategy"),
    its workers holding the strategy's 8 models at the check (the simulator's reference is its start model, so
    each worker holds start + model): the same violators, the same balancing set and synchronizations, the same
    averaged models, and every worker sends exactly the protocol bytes its rank counted."""
    from lightning_dist.sim import DynamicAveraging
    from sim.helpers import simulation

    results = launched["cross_check"]
    models = results[0]["models"]

    class HandSet(DynamicAveraging):
        def after_step(self, node, rank, step):
            replica = self.simulation.replicas[rank]
            assert replica.vector.num_parameters == SIM_MODEL == replica.get().numel()
            self.start = self.reference.clone()
            replica.set(self.start + models[rank])
            yield from super().after_step(node, rank, step)

    protocol = HandSet(divergence_threshold=CROSS_THRESHOLD, check_every=1, calibration_steps=1, seed=1,
                       topology="strategy")
    sim = simulation(protocol, workers=8, max_steps=1)
    sim.run()
    strategy_syncs = {key: results[0]["metrics"][f"dynamic/{key}"] for key in ("full_syncs", "partial_syncs")}
    assert strategy_syncs == {"full_syncs": 0, "partial_syncs": 1}
    assert {key: protocol.counts[key] for key in strategy_syncs} == strategy_syncs
    assert sim.simulator.network.bytes_sent == [result["stats"].protocol_bytes for result in results]
    for rank, result in enumerate(results):
        assert torch.allclose(sim.replicas[rank].get() - protocol.start, result["vector"], atol=1e-5)
