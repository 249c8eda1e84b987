"""DownpourSGD's server rule in one process, against hand-computed cases."""

import pytest
import torch

from lightning_dist.algorithms.parameter_server import (
    GlobalModel,
    NonFiniteUpdateError,
    accumulated_update,
    check_finite,
)


def test_accumulated_update_of_plain_sgd_is_minus_lr_times_summed_gradients():
    pulled = torch.tensor([1.0, 2.0])
    gradients = [torch.tensor([0.5, -1.0]), torch.tensor([0.25, 0.0])]
    local = pulled.clone()
    for gradient in gradients:
        local -= 0.1 * gradient
    assert torch.allclose(accumulated_update(local, pulled), -0.1 * (gradients[0] + gradients[1]))


def test_pushes_add_up_and_count_staleness():
    server = GlobalModel(torch.zeros(2))
    first = server.push(torch.tensor([1.0, 0.0]), pulled_version=0)
    second = server.push(torch.tensor([0.0, 2.0]), pulled_version=0)  # pulled before the first landed
    third = server.push(torch.tensor([1.0, 1.0]), pulled_version=2)
    assert torch.equal(server.vector, torch.tensor([2.0, 3.0]))
    assert [first.staleness, second.staleness, third.staleness] == [0, 1, 0]
    assert [first.version, second.version, third.version] == [1, 2, 3]
    assert server.metrics()["downpour/staleness_mean"] == pytest.approx(1 / 3)
    assert server.metrics()["downpour/staleness_max"] == 1


def test_max_staleness_drops_only_updates_beyond_the_bound():
    server = GlobalModel(torch.zeros(1), max_staleness=1)
    server.push(torch.ones(1), 0)
    server.push(torch.ones(1), 0)  # staleness 1: allowed
    dropped = server.push(torch.full((1,), 100.0), 0)  # staleness 2: dropped
    assert not dropped.accepted and dropped.staleness == 2 and dropped.version == 2
    assert torch.equal(server.vector, torch.tensor([2.0]))
    assert (server.accepted, server.rejected) == (2, 1)
    assert not server.too_stale(1) and server.too_stale(0)


def test_round_is_applied_in_the_given_order():
    server = GlobalModel(torch.zeros(1))
    outcomes = server.push_round([(torch.tensor([1.0]), 0), (torch.tensor([2.0]), 0)])
    assert [o.staleness for o in outcomes] == [0, 1] and server.version == 2
    assert torch.equal(server.vector, torch.tensor([3.0]))


def test_state_dict_round_trip_and_shape_check():
    server = GlobalModel(torch.zeros(3), max_staleness=4)
    server.push(torch.ones(3), 0)
    restored = GlobalModel(torch.zeros(3), max_staleness=4)
    restored.load_state_dict(server.state_dict())
    assert torch.equal(restored.vector, server.vector) and restored.version == 1 and restored.accepted == 1
    with pytest.raises(ValueError, match="shape"):
        GlobalModel(torch.zeros(2)).load_state_dict(server.state_dict())


def test_bad_input_and_non_finite_updates():
    with pytest.raises(ValueError, match="max_staleness must be None or an integer >= 0"):
        GlobalModel(torch.zeros(1), max_staleness=-1)
    with pytest.raises(ValueError, match="pulled_version must be in"):
        GlobalModel(torch.zeros(1)).push(torch.zeros(1), pulled_version=3)
    with pytest.raises(NonFiniteUpdateError, match="rank 4 pushed a non-finite update"):
        check_finite(torch.tensor([0.0, float("nan")]), rank=4)
    check_finite(torch.zeros(2), rank=0)
