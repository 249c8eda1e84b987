"""Paper 002's segmented gossip math, checked in one process against hand-computed cases."""

import math

import pytest
import torch

from lightning_dist.algorithms.segmented_gossip import (
    aggregate,
    gossip_round,
    mixed_from_pulls,
    mixed_models,
    pack_segments,
    pull_plan,
    segment_bounds,
    transfers,
)


def _plan(world_size, segments, replicas, seed=0):
    return pull_plan(world_size, segments, replicas, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("num_elements", "segments"), [(10, 3), (10, 10), (7, 1), (1000, 7), (5, 2)])
def test_bounds_are_contiguous_near_equal_and_cover_everything(num_elements, segments):
    bounds = segment_bounds(num_elements, segments)
    assert len(bounds) == segments and bounds[0][0] == 0 and bounds[-1][1] == num_elements
    assert all(stop == next_start for (_, stop), (next_start, _) in zip(bounds, bounds[1:]))
    sizes = [stop - start for start, stop in bounds]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert sizes == sorted(sizes, reverse=True)  # the larger segments come first


def test_bounds_by_hand_and_bad_segment_counts():
    assert segment_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(ValueError, match=r"segments must be an integer in \[1, 4\] \(segments of a model vector of 4"):
        segment_bounds(4, 5)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=r"segments must be an integer"):
            segment_bounds(4, bad)


@pytest.mark.parametrize(("world_size", "segments", "replicas"), [(4, 1, 2), (4, 3, 3), (8, 10, 2), (5, 3, 2), (31, 10, 2), (2, 4, 1)])
def test_plan_has_no_self_distinct_peers_per_segment_and_spreads_pulls(world_size, segments, replicas):
    plan = _plan(world_size, segments, replicas)
    assert plan.shape == (world_size, segments, replicas) and plan.dtype == torch.int64
    pulls = segments * replicas
    for rank in range(world_size):
        assert not (plan[rank] == rank).any()
        assert ((plan[rank] >= 0) & (plan[rank] < world_size)).all()
        for segment in range(segments):
            assert len(set(plan[rank, segment].tolist())) == replicas
        # Without replacement until every other rank was used, then refilled.
        sequence = plan[rank].reshape(-1).tolist()
        first = sequence[: world_size - 1]
        assert len(set(first)) == len(first)
        counts = [sequence.count(peer) for peer in range(world_size) if peer != rank]
        assert min(counts) == pulls // (world_size - 1) and max(counts) == math.ceil(pulls / (world_size - 1))
        if pulls <= world_size - 1:
            assert len(set(sequence)) == pulls  # paper 002: every segment replica from a different rank


@pytest.mark.parametrize(("world_size", "segments", "replicas"), [(4, 6, 2), (5, 3, 3)])
def test_plan_refill_inside_a_segment_skips_its_providers(world_size, segments, replicas):
    """R does not divide m - 1: refills happen inside segments; over 20 seeds the new queue often starts
    with a peer that already provides the segment, which must be skipped, not pulled twice."""
    for seed in range(20):
        plan = _plan(world_size, segments, replicas, seed=seed)
        for rank in range(world_size):
            assert all(len(set(providers)) == replicas for providers in plan[rank].tolist())
            sequence = plan[rank].reshape(-1).tolist()
            counts = [sequence.count(peer) for peer in range(world_size) if peer != rank]
            assert max(counts) - min(counts) <= 1


def test_plan_is_identical_for_the_same_seed_and_generator_state():
    assert torch.equal(_plan(8, 10, 2, seed=5), _plan(8, 10, 2, seed=5))
    assert not torch.equal(_plan(8, 10, 2, seed=5), _plan(8, 10, 2, seed=6))
    generator = torch.Generator().manual_seed(5)
    first = pull_plan(8, 10, 2, generator)
    state = generator.get_state()
    second = pull_plan(8, 10, 2, generator)
    assert not torch.equal(first, second)  # each round draws a new plan
    assert torch.equal(pull_plan(8, 10, 2, torch.Generator().set_state(state)), second)


@pytest.mark.parametrize(
    ("world_size", "segments", "replicas", "match"),
    [
        (1, 1, 1, r"world_size must be an integer >= 2"),
        (4, 0, 1, r"segments must be an integer >= 1"),
        (4, 2, 0, r"replicas must be an integer in \[1, 3\]"),
        (4, 2, 4, r"replicas must be an integer in \[1, 3\]"),
    ],
)
def test_plan_rejects_bad_sizes(world_size, segments, replicas, match):
    with pytest.raises(ValueError, match=match):
        _plan(world_size, segments, replicas)


def test_transfers_list_each_link_once_with_its_segments():
    plan = torch.tensor([
        [[1, 2], [1, 3]],  # rank 0: segment 0 from 1 and 2, segment 1 from 1 and 3
        [[0, 3], [2, 0]],
        [[3, 1], [0, 3]],
        [[2, 0], [1, 2]],
    ])
    links = transfers(plan)
    assert links[(1, 0)] == [0, 1] and links[(2, 0)] == [0] and links[(3, 0)] == [1]
    assert links[(0, 1)] == [0, 1] and links[(3, 2)] == [0, 1] and links[(2, 3)] == [0, 1]
    assert (0, 0) not in links
    assert sum(len(segments) for segments in links.values()) == 4 * 2 * 2


def test_weighted_aggregation_equals_hand_computation():
    # 4 ranks, N = 5, S = 2 -> segments [0, 3) and [3, 5); rank 0 pulls segment 0 from 1, 2 and segment 1 from 3, 1.
    models = torch.tensor([
        [0.0, 0.0, 0.0, 0.0, 0.0],
        [1.0, 2.0, 3.0, 4.0, 5.0],
        [10.0, 10.0, 10.0, 10.0, 10.0],
        [-4.0, -4.0, -4.0, 8.0, 8.0],
    ])
    sizes = torch.tensor([1, 2, 3, 4])
    bounds = segment_bounds(5, 2)
    providers = torch.tensor([[1, 2], [3, 1]])
    mixed = mixed_models(models, providers, bounds)
    assert torch.equal(mixed, torch.tensor([[1.0, 2.0, 3.0, 8.0, 8.0], [10.0, 10.0, 10.0, 4.0, 5.0]]))
    result = aggregate(models[0], mixed, providers, bounds, sizes, rank=0)
    # segment 0: (1*0 + 2*[1,2,3] + 3*10) / 6; segment 1: (1*0 + 4*8 + 2*[4,5]) / 7
    expected = torch.tensor([32 / 6, 34 / 6, 36 / 6, 40 / 7, 42 / 7])
    assert torch.allclose(result, expected)


def test_one_segment_is_plain_gossip_and_all_peers_is_the_weighted_all_reduce():
    generator = torch.Generator().manual_seed(0)
    models = torch.randn(5, 13, generator=generator)
    sizes = torch.tensor([3, 1, 4, 1, 5])
    gossip_plan = _plan(5, 1, 2, seed=1)
    after = gossip_round(models, gossip_plan, segment_bounds(13, 1), sizes)
    for rank in range(5):
        members = [rank] + gossip_plan[rank, 0].tolist()
        weights = sizes[members].float()
        expected = (models[members] * weights[:, None]).sum(0) / weights.sum()
        assert torch.allclose(after[rank], expected, atol=1e-6)
    full = gossip_round(models, _plan(5, 4, 4, seed=2), segment_bounds(13, 4), sizes)
    weighted_mean = (models * sizes.float()[:, None]).sum(0) / sizes.sum()
    assert torch.allclose(full[0], weighted_mean, atol=1e-6)
    assert all(torch.equal(full[0], full[rank]) for rank in range(1, 5))  # summed in rank order: bit-identical


def test_round_with_equal_sizes_keeps_models_finite_and_moves_them_together():
    models = torch.randn(8, 40, generator=torch.Generator().manual_seed(1))
    after = gossip_round(models, _plan(8, 10, 2), segment_bounds(40, 10), torch.ones(8, dtype=torch.int64))

    def spread(stacked):
        return float(((stacked - stacked.mean(0)) ** 2).sum())

    assert torch.isfinite(after).all() and spread(after) < spread(models)


def test_aggregate_rejects_self_or_repeated_providers_and_bad_shapes():
    models = torch.zeros(3, 4)
    bounds = segment_bounds(4, 2)
    sizes = torch.ones(3)
    with pytest.raises(ValueError, match=r"providers of segment 0 must be distinct ranks other than 0"):
        aggregate(models[0], torch.zeros(1, 4), torch.tensor([[0], [1]]), bounds, sizes, rank=0)
    with pytest.raises(ValueError, match=r"providers must be one row of pull_plan"):
        aggregate(models[0], torch.zeros(1, 4), torch.tensor([[1]]), bounds, sizes, rank=0)
    with pytest.raises(ValueError, match=r"mixed must hold one model of 4 elements per replica \(1\)"):
        aggregate(models[0], torch.zeros(2, 4), torch.tensor([[1], [2]]), bounds, sizes, rank=0)


def test_packed_link_messages_rebuild_the_mixed_models():
    # What a puller rebuilds from the messages its providers pack equals mixed_models on all models.
    models = torch.randn(6, 23, generator=torch.Generator().manual_seed(1))
    bounds = segment_bounds(23, 4)
    plan = _plan(6, 4, 2)
    links = transfers(plan)
    for puller in range(6):
        pulls = {
            provider: (segments, pack_segments(models[provider], bounds, segments))
            for (provider, target), segments in links.items()
            if target == puller
        }
        rebuilt = mixed_from_pulls(models[puller], plan[puller], bounds, pulls)
        assert torch.equal(rebuilt, mixed_models(models, plan[puller], bounds))
    assert pack_segments(torch.arange(10.0), segment_bounds(10, 3), [0, 2]).tolist() == [0, 1, 2, 3, 7, 8, 9]
