"""Paper 002, section 4.2 in algorithms/segmented_gossip: re-requesting a segment, and eq. (3) over the segments as
they were pulled (fewer or other providers, a joiner without a local model)."""

import pytest
import torch

from lightning_dist.algorithms.segmented_gossip import (
    aggregate,
    aggregate_pulled,
    requested_providers,
    segment_bounds,
    substitute_provider,
)

SIZES = torch.tensor([10.0, 30.0, 20.0, 40.0])


def models():
    return torch.arange(4 * 5, dtype=torch.float32).reshape(4, 5) ** 1.5  # unequal rows


def test_aggregate_pulled_is_eq3_over_each_segments_own_providers():
    w = models()
    bounds = segment_bounds(5, 2)  # [0, 3) and [3, 5)
    pulled = [{1: w[1, 0:3], 3: w[3, 0:3]}, {2: w[2, 3:5]}]  # segment 1 from one provider only
    result = aggregate_pulled(w[0], pulled, bounds, SIZES, rank=0)
    first = (10 * w[0, 0:3] + 30 * w[1, 0:3] + 40 * w[3, 0:3]) / 80
    second = (10 * w[0, 3:5] + 20 * w[2, 3:5]) / 30
    assert torch.allclose(result, torch.cat([first, second]), rtol=0, atol=1e-5)


def test_a_joiner_aggregates_without_its_local_model_and_keeps_a_segment_nobody_provided():
    w = models()
    bounds = segment_bounds(5, 2)
    pulled = [{1: w[1, 0:3], 2: w[2, 0:3]}, {}]
    result = aggregate_pulled(w[0], pulled, bounds, SIZES, rank=0, include_local=False)
    assert torch.allclose(result[0:3], (30 * w[1, 0:3] + 20 * w[2, 0:3]) / 50, rtol=0, atol=1e-5)
    assert torch.equal(result[3:5], w[0, 3:5])


def test_aggregate_is_aggregate_pulled_of_its_mixed_models_bit_for_bit():
    w = models()
    bounds = segment_bounds(5, 2)
    providers = torch.tensor([[1, 3], [2, 1]])
    mixed = torch.stack([torch.cat([w[1, 0:3], w[2, 3:5]]), torch.cat([w[3, 0:3], w[1, 3:5]])])
    pulled = [{1: w[1, 0:3], 3: w[3, 0:3]}, {2: w[2, 3:5], 1: w[1, 3:5]}]
    assert torch.equal(aggregate(w[0], mixed, providers, bounds, SIZES, 0),
                       aggregate_pulled(w[0], pulled, bounds, SIZES, 0))
    with pytest.raises(ValueError, match="lists rank 0 as its own provider"):
        aggregate_pulled(w[0], [{0: w[0, 0:3]}, {}], bounds, SIZES, 0)


def test_a_substitute_is_online_new_for_the_segment_and_among_the_least_loaded():
    generator = torch.Generator().manual_seed(0)
    picks = {substitute_provider(0, excluded={1}, load={2: 2, 3: 1, 4: 1}, offline={5}, world_size=6,
                                 generator=generator) for _ in range(50)}
    assert picks == {3, 4}  # not itself, not the segment's provider 1, not offline 5, not the busier 2
    assert substitute_provider(0, excluded={1, 2}, load={}, offline={3}, world_size=4, generator=generator) is None


def test_requested_providers_replace_only_the_peers_marked_offline():
    plan_row = torch.tensor([[1, 2], [3, 1]])
    generator = torch.Generator().manual_seed(0)
    chosen = requested_providers(plan_row, rank=0, offline={1}, world_size=5, generator=generator)
    assert chosen[0][0] == 2 and chosen[1][0] == 3
    assert all(len(set(segment)) == 2 and 1 not in segment and 0 not in segment for segment in chosen)
    # Segment 0 keeps 2, segment 1 keeps 3: the substitutes spread over the least loaded (4 once, then 3 or 2 ...).
    assert 4 in chosen[0] + chosen[1]
    assert requested_providers(plan_row, 0, offline={1, 2, 3, 4}, world_size=5, generator=generator) == [[], []]
