"""DownpourSGD's server rule in one process, against hand-computed cases and paper 001's definitions."""

import pytest
import torch

from lightning_dist.algorithms.parameter_server import (
    GlobalModel,
    NonFiniteUpdateError,
    check_finite,
    push_message,
)


def test_push_message_is_the_accumulated_update_then_the_absolute_buffers():
    pulled = torch.tensor([1.0, 2.0, 0.9, 1.1])  # two parameters, then two buffers
    gradients = [torch.tensor([0.5, -1.0]), torch.tensor([0.25, 0.0])]
    local = pulled.clone()
    for gradient in gradients:
        local[:2] -= 0.1 * gradient
    local[2:] = torch.tensor([0.7, 1.6])  # the worker's own running statistics
    message = push_message(local, pulled, num_parameters=2)
    assert torch.allclose(message[:2], -0.1 * (gradients[0] + gradients[1]))
    assert torch.equal(message[2:], torch.tensor([0.7, 1.6]))


def test_asynchronous_pushes_add_up_and_count_staleness():
    server = GlobalModel(torch.zeros(2), num_parameters=2, workers=2)
    first = server.push(torch.tensor([1.0, 0.0]), pulled_version=0, rank=0)
    second = server.push(torch.tensor([0.0, 2.0]), pulled_version=0, rank=1)  # pulled before the first landed
    third = server.push(torch.tensor([1.0, 1.0]), pulled_version=2, rank=0)
    assert torch.equal(server.vector, torch.tensor([2.0, 3.0]))
    assert [first.staleness, second.staleness, third.staleness] == [0, 1, 0]
    assert [first.version, second.version, third.version] == [1, 2, 3]
    assert server.metrics()["downpour/staleness_mean"] == pytest.approx(1 / 3)
    assert server.metrics()["downpour/staleness_max"] == 1


def test_staleness_aware_updates_are_divided_by_their_staleness_plus_one():
    """Zhang et al. (IJCAI 2016): lr / tau with tau counted from 1, i.e. u / (staleness + 1). Three workers push
    in turn from version 0: staleness 0, 1, 2; then rank 0 pushes from version 1 (staleness 2)."""
    server = GlobalModel(torch.zeros(2), num_parameters=2, workers=3, staleness_aware=True)
    outcomes = [server.push(torch.tensor([6.0, 0.0]), 0, rank=0), server.push(torch.tensor([6.0, 6.0]), 0, rank=1),
                server.push(torch.tensor([0.0, 6.0]), 0, rank=2), server.push(torch.tensor([3.0, 3.0]), 1, rank=0)]
    assert [outcome.staleness for outcome in outcomes] == [0, 1, 2, 2]
    assert torch.equal(server.vector, torch.tensor([6.0 + 3.0 + 0.0 + 1.0, 0.0 + 3.0 + 2.0 + 1.0]))
    assert server.version == 4
    # A synchronous round (staleness 0 for all) is the plain mean with or without the option.
    aware, plain = (GlobalModel(torch.zeros(1), 1, 2, staleness_aware=flag) for flag in (True, False))
    for model in (aware, plain):
        model.push_round([(torch.tensor([2.0]), 0, 0), (torch.tensor([4.0]), 0, 1)])
    assert torch.equal(aware.vector, plain.vector) and torch.equal(aware.vector, torch.tensor([3.0]))


def test_the_strategy_scales_by_staleness_by_default_and_names_the_flag():
    from lightning_dist import DownpourSGDStrategy

    assert DownpourSGDStrategy().staleness_aware is True
    with pytest.raises(ValueError, match="staleness_aware must be True or False; got 1"):
        DownpourSGDStrategy(staleness_aware=1)


def test_max_staleness_drops_only_updates_beyond_the_bound():
    server = GlobalModel(torch.zeros(1), num_parameters=1, workers=3, max_staleness=1)
    server.push(torch.ones(1), 0, rank=0)
    server.push(torch.ones(1), 0, rank=1)  # staleness 1: allowed
    dropped = server.push(torch.full((1,), 100.0), 0, rank=2)  # staleness 2: dropped
    assert not dropped.accepted and dropped.staleness == 2 and dropped.version == 2
    assert torch.equal(server.vector, torch.tensor([2.0]))
    assert (server.accepted, server.rejected) == (2, 1)
    assert not server.too_stale(1) and server.too_stale(0)


@pytest.mark.parametrize("max_staleness", [None, 0])
def test_synchronous_round_applies_the_gradient_average_of_paper_001(max_staleness):
    """Paper 001, SSGD: every worker computes a gradient from the same parameters, "the parameter server
    obtains the gradient average and updates the parameters": w <- w - lr * (1/m) sum_i g_i. All updates of
    the round start from the same version (staleness 0), so a bound of 0 drops none; the round is one version."""
    w = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    gradients = [torch.tensor([1.0, 0.0, -2.0]), torch.tensor([3.0, 1.0, 0.5]), torch.tensor([-0.5, 4.0, 1.0])]
    lr = 0.1
    server = GlobalModel(w, num_parameters=3, workers=3, max_staleness=max_staleness)
    server.push(push_message(w - lr * gradients[0].double(), w, 3), 0, rank=0)  # round 1: a lone update, version 1
    start = server.vector.clone()
    messages = [(push_message(start - lr * g.double(), start, 3), 1, rank) for rank, g in enumerate(gradients)]
    outcomes = server.push_round(messages)
    expected = start - lr * (gradients[0] + gradients[1] + gradients[2]).double() / 3
    assert torch.allclose(server.vector, expected, rtol=0, atol=1e-12)
    assert [(o.accepted, o.staleness, o.version) for o in outcomes] == [(True, 0, 2)] * 3
    assert server.version == 2 and server.rejected == 0
    assert server.metrics()["downpour/staleness_max"] == 0


def test_buffers_are_the_mean_of_each_workers_latest_not_a_sum_of_deltas():
    """A running variance of 1.0 that three workers each lowered (0.2, 0.3, 0.5): summing their deltas
    gives 1 + (-0.8 - 0.7 - 0.5) = -1.0; the rule keeps the mean of their latest values, 1/3."""
    initial = torch.tensor([0.0, 0.0, 1.0])  # two parameters, one running variance
    server = GlobalModel(initial, num_parameters=2, workers=3)
    reported = {0: 0.2, 1: 0.3, 2: 0.5}
    updates = {0: [1.0, 0.0], 1: [0.0, 2.0], 2: [4.0, 4.0]}
    for rank in (0, 1):
        server.push(torch.tensor(updates[rank] + [reported[rank]]), server.version, rank)
        # Before worker 2's first push its entry is the initial model's buffers.
    assert server.vector[2].item() == pytest.approx((0.2 + 0.3 + 1.0) / 3)
    server.push(torch.tensor(updates[2] + [reported[2]]), 0, rank=2)
    assert server.vector[2].item() == pytest.approx((0.2 + 0.3 + 0.5) / 3)
    assert torch.equal(server.vector[:2], torch.tensor([5.0, 6.0]))  # parameters: every update in full
    # A worker's new report replaces its old one.
    server.push(torch.tensor([0.0, 0.0, 0.9]), server.version, rank=0)
    assert server.vector[2].item() == pytest.approx((0.9 + 0.3 + 0.5) / 3)
    assert torch.allclose(server.worker_buffers[:, 0], torch.tensor([0.9, 0.3, 0.5]))


def test_synchronous_round_buffers_are_the_mean_of_the_rounds_buffers():
    server = GlobalModel(torch.tensor([1.0, 1.0]), num_parameters=1, workers=2)
    server.push_round([(torch.tensor([2.0, 0.25]), 0, 0), (torch.tensor([4.0, 0.75]), 0, 1)])
    assert torch.equal(server.vector, torch.tensor([1.0 + 3.0, 0.5]))


def test_bf16_updates_accumulate_in_a_float32_master():
    """100 updates of bf16(1e-3) onto 1.0: float32 reaches about 1.1; a bf16 sum never leaves 1.0
    (bf16's step at 1.0 is 2^-7, and 1 + 1e-3 rounds back to 1)."""
    update = torch.full((4,), 1e-3, dtype=torch.bfloat16)
    server = GlobalModel(torch.ones(4, dtype=torch.bfloat16), num_parameters=4, workers=1)
    in_bf16 = torch.ones(4, dtype=torch.bfloat16)
    for _ in range(100):
        server.push(update, server.version, rank=0)
        in_bf16 += update
    expected = 1.0 + 100 * update[0].double().item()
    assert server.vector.dtype == torch.float32
    assert server.vector.double().sub(expected).abs().max().item() < 1e-5
    assert in_bf16[0].item() == 1.0 and expected - 1.0 > 0.09


def test_a_bf16_worker_pushes_its_own_change_exactly_and_never_the_masters_rounding():
    master = torch.tensor([1.0 + 2**-10, 3.0 - 2**-12, 1.0 + 2**-7])  # the first two are not bf16 values
    server = GlobalModel(master, num_parameters=3, workers=1)
    replica = server.vector.to(torch.bfloat16)  # what the worker holds after converting the reply
    server.push(push_message(replica, replica, 3), server.version, rank=0)  # the worker did not move
    assert torch.equal(server.vector, master)
    # 5 - (1 + 2^-7) = 3.9921875 needs 9 significant bits: a bf16 subtraction would round it.
    local = torch.tensor([1.0 + 2**-6, 3.0 - 2**-5, 5.0], dtype=torch.bfloat16)
    message = push_message(local, replica, 3)
    assert message.dtype == torch.float32
    server.push(message, server.version, rank=0)
    assert torch.equal(server.vector, master + (local.double() - replica.double()).float())


def test_state_dict_round_trip_and_shape_check():
    server = GlobalModel(torch.zeros(3), num_parameters=2, workers=2, max_staleness=4)
    server.push(torch.tensor([1.0, 1.0, 0.5]), 0, rank=1)
    restored = GlobalModel(torch.zeros(3), num_parameters=2, workers=2, max_staleness=4)
    restored.load_state_dict(server.state_dict())
    assert torch.equal(restored.vector, server.vector) and restored.version == 1 and restored.accepted == 1
    assert torch.equal(restored.worker_buffers, torch.tensor([[0.0], [0.5]]))
    with pytest.raises(ValueError, match="global model in the checkpoint has shape"):
        GlobalModel(torch.zeros(2), num_parameters=1, workers=2).load_state_dict(server.state_dict())
    with pytest.raises(ValueError, match="worker buffers in the checkpoint has shape"):
        GlobalModel(torch.zeros(3), num_parameters=2, workers=3).load_state_dict(server.state_dict())


def test_bad_input_and_non_finite_updates():
    with pytest.raises(ValueError, match="max_staleness must be None or an integer >= 0"):
        GlobalModel(torch.zeros(1), 1, 1, max_staleness=-1)
    with pytest.raises(ValueError, match=r"num_parameters must be in \[0, 1\]"):
        GlobalModel(torch.zeros(1), 2, 1)
    with pytest.raises(ValueError, match="workers must be an integer >= 1"):
        GlobalModel(torch.zeros(1), 1, 0)
    with pytest.raises(ValueError, match="pulled_version must be in"):
        GlobalModel(torch.zeros(1), 1, 1).push(torch.zeros(1), pulled_version=3, rank=0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 1\]"):
        GlobalModel(torch.zeros(1), 1, 2).push(torch.zeros(1), pulled_version=0, rank=2)
    with pytest.raises(NonFiniteUpdateError, match="rank 4 pushed a non-finite update"):
        check_finite(torch.tensor([0.0, float("nan")]), rank=4)
    check_finite(torch.zeros(2), rank=0)
