"""DiLoCo's outer step (Douillard et al. 2023, Algorithm 1) in one process, from the paper's equations.

Algorithm 1: ``Delta^(t) = theta^(t-1) - 1/k sum_i theta_i^(t)``, ``theta^(t) = OuterOpt(theta^(t-1), Delta^(t))``.
OuterOpt is SGD with Nesterov momentum (Sutskever et al. 2013, as torch.optim.SGD writes it):
``b_t = mu b_{t-1} + Delta_t`` (``b_1 = Delta_1``), ``theta_t = theta_{t-1} - lr (Delta_t + mu b_t)``.
"""

import functools

import pytest
import torch

from lightning_dist.algorithms.arguments import check_outer_optimizer
from lightning_dist.algorithms.averaging import weighted_average
from lightning_dist.algorithms.outer import OuterStep, diloco_outer_optimizer


def _mean(replicas):
    return sum(replicas) / len(replicas)


def test_two_rounds_of_algorithm_1_with_nesterov_momentum():
    lr, mu = 0.7, 0.9  # the paper's outer learning rate and Nesterov momentum
    theta0 = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
    outer = OuterStep(theta0, diloco_outer_optimizer)
    # Round 1: three unequal replicas after their inner steps.
    round1 = [theta0 + torch.tensor(d, dtype=torch.float64) for d in
              ([0.3, -0.1, 0.0, 0.2], [-0.6, 0.4, 0.1, 0.0], [0.9, 0.3, -0.4, 0.5])]
    delta1 = theta0 - _mean(round1)
    buffer1 = delta1
    theta1 = theta0 - lr * (delta1 + mu * buffer1)
    got1 = outer.step(_mean(round1))
    torch.testing.assert_close(got1, theta1, rtol=1e-12, atol=1e-12)
    # Round 2: replicas start from theta1; the momentum buffer carries round 1's outer gradient.
    round2 = [theta1 + torch.tensor(d, dtype=torch.float64) for d in
              ([0.2, 0.2, -0.1, 0.0], [-0.1, 0.5, 0.0, -0.3], [0.05, -0.2, 0.3, 0.1])]
    delta2 = theta1 - _mean(round2)
    buffer2 = mu * buffer1 + delta2
    theta2 = theta1 - lr * (delta2 + mu * buffer2)
    got2 = outer.step(_mean(round2))
    torch.testing.assert_close(got2, theta2, rtol=1e-12, atol=1e-12)
    # The buffer matters: a fresh optimizer (no memory of round 1) lands elsewhere.
    without_memory = theta1 - lr * (1 + mu) * delta2
    assert (got2 - without_memory).abs().max() > 0.1
    assert outer.steps == 2
    metrics = outer.metrics()
    assert metrics["outer/pseudo_gradient_norm"] == pytest.approx(float(delta2.norm()))
    assert metrics["outer/update_norm"] == pytest.approx(float((theta2 - theta1).norm()))


def test_sgd_with_unit_learning_rate_and_no_momentum_is_plain_averaging():
    """theta^(t) = theta^(t-1) - (theta^(t-1) - mean) = mean. Exactly on values whose arithmetic is exact
    (multiples of 1/64 in [-4, 4]); within one rounding of a - (a - b) on arbitrary float32 values."""
    plain = functools.partial(torch.optim.SGD, lr=1.0, momentum=0.0)
    generator = torch.Generator().manual_seed(0)
    start = torch.randint(-256, 256, (50,), generator=generator).float() / 64
    outer = OuterStep(start, plain)
    model = start
    for _ in range(3):
        replicas = [model + torch.randint(-32, 32, (50,), generator=generator).float() / 64 for _ in range(4)]
        average = weighted_average(replicas)
        model = outer.step(average)
        assert torch.equal(model, average)
    start = torch.randn(1000, generator=generator)
    outer = OuterStep(start, plain)
    model = start
    for _ in range(3):
        replicas = [model + 0.1 * torch.randn(1000, generator=generator) for _ in range(3)]
        average = weighted_average(replicas)
        model = outer.step(average)
        torch.testing.assert_close(model, average, rtol=0, atol=4 * torch.finfo(torch.float32).eps)


def test_bfloat16_model_keeps_a_float32_master_and_measures_delta_from_the_rounded_start():
    """bfloat16 resolution at 1.0 is 2^-7. Each round the replicas' average is one ulp above the model they
    started from; SGD with lr 1/4 moves the reference by a quarter ulp. A float32 master accumulates the quarters
    (1 + 2^-9, 1 + 2^-8, 1 + 3 * 2^-9, rounded to the model: 1, 1 (tie to even), 1 + 2^-7); a bfloat16
    reference would round each quarter away and never move."""
    ulp = 2.0**-7
    outer = OuterStep(torch.ones(2, dtype=torch.bfloat16), functools.partial(torch.optim.SGD, lr=0.25))
    assert outer.reference.dtype == torch.float32
    expected_masters = [1 + ulp / 4, 1 + ulp / 2, 1 + 3 * ulp / 4]
    expected_models = [1.0, 1.0, 1 + ulp]
    for master, model in zip(expected_masters, expected_models):
        start = outer.start
        assert start.dtype == torch.bfloat16
        average = start + ulp  # exact in bfloat16 around 1
        result = outer.step(average)
        assert result.dtype == torch.bfloat16
        assert torch.equal(outer.reference, torch.full((2,), master, dtype=torch.float32))
        assert torch.equal(result, torch.full((2,), model, dtype=torch.bfloat16))


def test_entries_past_the_reference_are_returned_as_averaged():
    """Floating-point buffers follow the parameters in a model vector; they get the plain average."""
    outer = OuterStep(torch.zeros(3), diloco_outer_optimizer)
    average = torch.tensor([1.0, 2.0, 3.0, 5.0, 7.0])
    result = outer.step(average)
    assert torch.equal(result[3:], average[3:])
    torch.testing.assert_close(result[:3], -0.7 * 1.9 * (torch.zeros(3) - average[:3]))


def test_state_round_trip_continues_bit_for_bit():
    generator = torch.Generator().manual_seed(1)
    start = torch.randn(20, generator=generator)
    averages = [start + torch.randn(20, generator=generator) for _ in range(4)]
    adam = functools.partial(torch.optim.Adam, lr=0.1, betas=(0.8, 0.9))
    original = OuterStep(start, adam)
    for average in averages[:2]:
        original.step(average)
    state = original.state_dict()
    saved_reference = state["reference"].clone()
    restored = OuterStep(torch.zeros(20), adam)
    restored.load_state_dict(state)
    for average in averages[2:]:
        assert torch.equal(original.step(average), restored.step(average))
    assert torch.equal(state["reference"], saved_reference)  # the saved state is a copy
    assert restored.steps == original.steps == 4
    assert restored.metrics() == original.metrics()
    with pytest.raises(ValueError, match="shape"):
        OuterStep(torch.zeros(5), adam).load_state_dict(state)


def test_outer_optimizer_argument_forms_and_refusals():
    spec = {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.7, "momentum": 0.9, "nesterov": True}}
    optimizer = check_outer_optimizer(spec)([torch.zeros(1)])
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.defaults["nesterov"] and optimizer.defaults["lr"] == 0.7
    assert check_outer_optimizer(None) is None
    assert check_outer_optimizer(diloco_outer_optimizer) is diloco_outer_optimizer
    assert check_outer_optimizer("lightning_dist.algorithms.outer.diloco_outer_optimizer") is diloco_outer_optimizer
    for bad, message in [
        ({"class_path": "torch.optim.NoSuchOptimizer"}, "cannot be imported"),
        ({"class_path": "torch.nn.Linear"}, "Optimizer subclass"),
        ({"class": "torch.optim.SGD"}, "class_path"),
        ({"class_path": "torch.optim.SGD", "init_args": {"params": [torch.zeros(1)]}}, "without params"),
        ("no_such_module.factory", "cannot be imported"),
        (0.7, "outer_optimizer must be"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_outer_optimizer(bad)
    with pytest.raises(ValueError, match="client_fraction=1"):
        check_outer_optimizer(diloco_outer_optimizer, client_fraction=0.5)
    with pytest.raises(ValueError, match="torch.optim.Optimizer"):
        OuterStep(torch.zeros(2), lambda params: list(params))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("factory", [diloco_outer_optimizer, functools.partial(torch.optim.Adam, lr=0.01)],
                         ids=["nesterov", "adam"])
def test_a_bucket_at_a_time_equals_the_whole_step_bit_for_bit(dtype, factory):
    """The outer step taken in buckets of 7 (step_range, in place, in the order a strategy averages them; a model
    of 40 parameters and 5 buffer entries, so the last bucket holds both) gives what the one-piece step gives, bit
    for bit, over three rounds: element-wise optimizers do not see the pieces. Norms agree to rounding."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(40, generator=generator).to(dtype)
    whole, bucketed = OuterStep(start, factory), OuterStep(start, factory, bucket=7)
    pieces_whole = OuterStep(start, factory, bucket=8)  # step() over pieces: 40 parameters, 5 whole buckets
    assert len(bucketed.pieces) == 6 and len(whole.pieces) == 1
    model = start
    for _ in range(3):
        mean = torch.cat([model + 0.1 * torch.randn(40, generator=generator).to(dtype),
                          torch.rand(5, generator=generator).to(dtype)])  # buffers pass through
        expected = whole.step(mean)
        result = mean.to(bucketed.reference.dtype, copy=True)
        for begin in range(0, 45, 7):
            bucketed.step_range(begin, result[begin:begin + 7])
        assert torch.equal(result.to(dtype), expected)
        assert torch.equal(pieces_whole.step(mean), expected)
        model = expected[:40]
    assert bucketed.steps == whole.steps == pieces_whole.steps == 3
    assert torch.equal(bucketed.reference, whole.reference)
    for key in ("outer/pseudo_gradient_norm", "outer/update_norm"):
        assert bucketed.metrics()[key] == pytest.approx(whole.metrics()[key], rel=1e-5)


def test_step_range_refuses_ranges_that_are_not_its_buckets():
    outer = OuterStep(torch.zeros(20), diloco_outer_optimizer, bucket=8)
    with pytest.raises(ValueError, match="whole buckets of 8 entries"):
        outer.step_range(4, torch.zeros(8))
    with pytest.raises(ValueError, match="whole buckets of 8 entries"):
        outer.step_range(0, torch.zeros(5))
    with pytest.raises(ValueError, match="whole buckets of 8 entries"):
        outer.step_range(0, torch.zeros(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="bucket must be a positive"):
        OuterStep(torch.zeros(20), diloco_outer_optimizer, bucket=0)
