"""DiLoCo's outer optimizer in the averaging strategies, on 3 Gloo processes (one launch, several fits).

Expected models are computed here from DiLoCo's Algorithm 1 (Douillard et al. 2023) and the replicas
each rank recorded: ``Delta_t = theta_{t-1} - mean_i theta_i``, Nesterov SGD
``b_t = mu b_{t-1} + Delta_t``, ``theta_t = theta_{t-1} - lr (Delta_t + mu b_t)``, lr 0.7, mu 0.9.
"""

import pytest
import torch

from helpers.launch import load_results, run_ranks

LR, MU = 0.7, 0.9
OUTER = {"class_path": "torch.optim.SGD", "init_args": {"lr": LR, "momentum": MU, "nesterov": True}}
PERIOD = 4
DILOCO = {"strategy": "periodic", "kwargs": {"period": PERIOD, "outer_optimizer": OUTER}, "trainer": {"max_epochs": 4}}
# digits, class-sorted over 3 ranks: 15 batches of 32 per epoch; epoch 2 ends at step 30, mid-round.
CASES = [
    {"name": "diloco", **DILOCO, "checkpoint_dir": "ckpt"},
    {"name": "resumed", **DILOCO, "resume": "ckpt/epoch=1-*.ckpt"},
    {"name": "resumed_without_outer", "strategy": "periodic", "kwargs": {"period": PERIOD},
     "trainer": {"max_epochs": 4}, "resume": "ckpt/epoch=1-*.ckpt"},
    # Delta 0.5 every 4 steps over 2 epochs: checks without violations, a partial sync and 2 full syncs.
    {"name": "dynamic", "strategy": "dynamic", "trainer": {"max_epochs": 2},
     "kwargs": {"divergence_threshold": 0.5, "check_every": 4, "outer_optimizer": OUTER}},
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("outer")
    run_ranks(3, "outer", {"cases": CASES}, out, timeout=300)
    return {case["name"]: load_results(out / case["name"], 3) for case in CASES}


def _ok(results):
    for result in results:
        assert result["error"] is None, result["error"]
    return results


def _nesterov(theta, buffer, mean):
    """One outer step of Algorithm 1 in float64; ``buffer`` is None before the first."""
    delta = theta - mean
    buffer = delta if buffer is None else MU * buffer + delta
    return theta - LR * (delta + MU * buffer), buffer


def test_every_round_ends_on_the_outer_step_of_the_gathered_replicas(runs):
    results = _ok(runs["diloco"])
    rounds = [list(ranks) for ranks in zip(*(result["records"] for result in results))]
    assert len(rounds) == 60 // PERIOD and results[0]["local_steps"] == 60
    theta, buffer = results[0]["start"].double(), None
    for records in rounds:
        mean = torch.stack([record["before"].double() for record in records]).mean(dim=0)
        theta, buffer = _nesterov(theta, buffer, mean)
        after = records[0]["after"]
        assert all(torch.equal(after, record["after"]) for record in records[1:])  # one model on every rank
        torch.testing.assert_close(after.double(), theta, rtol=0, atol=2e-5)
        assert (after.double() - mean).abs().max() > 1e-3  # not the plain average
        theta = after.double()  # next round starts from what the ranks hold
    # fit ends on a round boundary: the final model is the last outer step's result, on every rank
    assert all(torch.equal(result["vector"], rounds[-1][0]["after"]) for result in results)
    outer = results[0]["protocol"]["outer"]
    assert outer["steps"] == len(rounds) and torch.equal(outer["reference"], results[0]["vector"])
    torch.testing.assert_close(outer["optimizer"]["state"][0]["momentum_buffer"].double(), buffer, rtol=0, atol=2e-5)
    assert results[0]["metrics"]["outer/steps"] == len(rounds)


def test_resume_mid_round_ends_with_the_uninterrupted_model(runs):
    full, resumed = _ok(runs["diloco"]), _ok(runs["resumed"])
    assert resumed[0]["resumed_from"] % PERIOD != 0
    for a, b in zip(full, resumed):
        assert torch.equal(a["vector"], b["vector"])
        assert torch.equal(a["protocol"]["outer"]["reference"], b["protocol"]["outer"]["reference"])
        assert torch.equal(a["protocol"]["outer"]["optimizer"]["state"][0]["momentum_buffer"],
                           b["protocol"]["outer"]["optimizer"]["state"][0]["momentum_buffer"])
        assert a["metrics"] == b["metrics"]


def test_resuming_a_diloco_checkpoint_without_the_outer_optimizer_is_refused(runs):
    for result in runs["resumed_without_outer"]:
        assert result["error"] is not None and "ValueError" in result["error"]
        assert "with an outer_optimizer and is resumed without one" in result["error"]


def test_dynamic_averaging_takes_the_outer_step_from_the_reference_at_full_syncs_only(runs):
    """Full synchronization: Delta = r - mean of all replicas, theta = Nesterov step from r, which becomes r and
    every replica. Partial synchronization: its members get their plain mean, r stays."""
    results = _ok(runs["dynamic"])
    size = results[0]["num_parameters"]
    checks = [list(ranks) for ranks in zip(*(result["records"] for result in results))]
    kinds = [records[0]["kind"] for records in checks]
    assert kinds.count("full") >= 2 and kinds.count("partial") >= 1 and kinds.count("none") >= 1, kinds
    buffer = None
    for records in checks:
        reference = records[0]["reference"].double()
        assert all(torch.equal(records[0]["reference"], record["reference"]) for record in records[1:])
        kind = records[0]["kind"]
        if kind == "full":
            mean = torch.stack([record["before"].double() for record in records]).mean(dim=0)
            theta, buffer = _nesterov(reference, buffer, mean[:size])
            after = records[0]["after"]
            assert all(torch.equal(after, record["after"]) for record in records[1:])
            torch.testing.assert_close(after[:size].double(), theta, rtol=0, atol=2e-5)
            assert (after[:size].double() - mean[:size]).abs().max() > 1e-3  # not the plain average
            assert torch.equal(records[0]["reference_after"], after[:size])
            continue
        members = [record for record in records if not torch.equal(record["before"], record["after"])]
        assert (len(members) > 0) == (kind == "partial") and len(members) < len(records)
        if members:
            mean = torch.stack([record["before"].double() for record in members]).mean(dim=0)
            for record in members:
                torch.testing.assert_close(record["after"].double(), mean, rtol=0, atol=1e-6)
        assert torch.equal(records[0]["reference_after"], records[0]["reference"])
    outer = results[0]["protocol"]["outer"]
    assert outer["steps"] == kinds.count("full") == results[0]["metrics"]["dynamic/full_syncs"]
