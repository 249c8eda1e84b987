"""Hypothesis property tests of the subset average's pure pieces (lightning_dist.algorithms.subset_average): chunk
bounds and the averaging of growing sets, over random sizes, dtypes, rank counts and set sequences."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dist.algorithms.subset_average import average_subset, chunk_bounds


@settings(max_examples=300, deadline=None)
@given(num_elements=st.integers(0, 10_000), owners=st.lists(st.integers(0, 1000), min_size=1, max_size=64, unique=True))
def test_property_chunk_bounds_tile_the_vector_in_owner_order_and_differ_by_at_most_one(num_elements, owners):
    """Contiguous, in the owners' order, covering ``range(num_elements)`` exactly, sizes within one of each other and
    the larger ones first: so every rank that computes them from the same numbers gets the same chunks."""
    bounds = chunk_bounds(num_elements, owners)
    assert list(bounds) == owners
    spans = [bounds[owner] for owner in owners]
    assert spans[0][0] == 0 and spans[-1][1] == num_elements
    assert all(stop == next_start for (_, stop), (next_start, _) in zip(spans, spans[1:]))
    sizes = [stop - start for start, stop in spans]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert chunk_bounds(num_elements, owners) == bounds  # a pure function of its inputs


@st.composite
def balancings(draw):
    """A world of ranks, a growing sequence of balancing sets in it (each contains the previous one), a model size
    and a dtype."""
    world = draw(st.integers(2, 24))
    order = draw(st.permutations(list(range(world))))
    sizes = draw(st.lists(st.integers(1, world), min_size=1, max_size=4).map(sorted))
    rounds = [list(order[:size]) for size in sizes]  # prefixes: each set contains the previous one
    return world, rounds, draw(st.integers(1, 3000)), draw(st.sampled_from([torch.float32, torch.float64,
                                                                              torch.bfloat16]))


@settings(max_examples=60, deadline=None)
@given(case=balancings(), seed=st.integers(0, 2**31 - 1))
def test_property_a_balancing_ends_at_the_last_sets_mean_and_leaves_the_global_mean_unchanged(case, seed):
    """Whatever the sets and sizes: the plan's result is the last set's mean (summed in the accumulation dtype,
    rounded once), each round's distance is that round's mean's, and replacing the members' models by the result
    leaves the mean of all ranks' models where it was (paper 004's balancing preserves the global mean)."""
    world, rounds, numel, dtype = case
    generator = torch.Generator().manual_seed(seed)
    models = {rank: torch.randn(numel, generator=generator).to(dtype) for rank in range(world)}
    reference = torch.randn(numel, generator=generator).to(dtype)
    accumulate = torch.promote_types(dtype, torch.float32)
    mean, distances = average_subset({rank: models[rank] for rank in rounds[-1]}, rounds, reference)
    exact = sum(models[rank].to(accumulate) for rank in rounds[-1]) / len(rounds[-1])
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert mean.dtype == dtype and torch.allclose(mean.to(accumulate), exact, rtol=0, atol=tolerance)
    assert len(distances) == len(rounds)
    for members, distance in zip(rounds, distances):
        round_mean = (sum(models[rank].to(accumulate) for rank in members) / len(members)).to(dtype)
        expected = float(((round_mean.double() - reference.double()) ** 2).sum())
        assert abs(distance - expected) <= 1e-6 * max(1.0, expected) + (1e-2 * expected if dtype == torch.bfloat16
                                                                         else 0)
    after = {rank: (mean.double() if rank in rounds[-1] else models[rank].double()) for rank in range(world)}
    if dtype != torch.bfloat16:  # a bf16 mean is rounded once to bf16: the global mean moves by that rounding only
        assert torch.allclose(sum(after.values()) / world, sum(m.double() for m in models.values()) / world,
                              rtol=0, atol=1e-5)
