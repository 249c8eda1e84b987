"""The count sketch that CD-GraB may balance on (paper 003, D.1.2), checked in one process: a seeded,
linear map with one +-1 per input coordinate that keeps inner products in expectation."""

import pytest
import torch

from lightning_dist.algorithms.projection import CountSketch


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_same_seed_same_map_other_seed_other_map():
    first, second, other = CountSketch(1000, 32, seed=7), CountSketch(1000, 32, seed=7), CountSketch(1000, 32, seed=8)
    assert torch.equal(first.buckets, second.buckets) and torch.equal(first.signs, second.signs)
    x = torch.randn(4, 1000, generator=gen())
    assert torch.equal(first(x), second(x))
    assert not torch.equal(first.buckets, other.buckets) and not torch.equal(first(x), other(x))
    # Buckets cover [0, k) and signs are +-1 (1000 draws: every bucket and both signs occur).
    assert first.buckets.min() == 0 and first.buckets.max() == 31 and first.buckets.unique().numel() == 32
    assert set(first.signs.tolist()) == {-1, 1}


def test_each_basis_vector_lands_in_one_bucket_with_a_sign():
    sketch = CountSketch(50, 8, seed=3)
    images = sketch(torch.eye(50, dtype=torch.float64))  # row i = P(e_i)
    assert images.shape == (50, 8)
    nonzero = images != 0
    assert (nonzero.sum(dim=1) == 1).all()
    assert set(images[nonzero].tolist()) == {-1.0, 1.0}
    for i in range(50):
        assert images[i, sketch.buckets[i]] == sketch.signs[i]


def test_projection_is_linear_and_works_on_batches():
    sketch = CountSketch(200, 16, seed=1)
    x, y = torch.randn(2, 200, generator=gen(1), dtype=torch.float64)
    a, b = 2.5, -0.75
    assert torch.allclose(sketch(a * x + b * y), a * sketch(x) + b * sketch(y), rtol=0, atol=1e-12)
    assert torch.equal(sketch(torch.zeros(200)), torch.zeros(16))
    batch = torch.randn(3, 5, 200, generator=gen(2))
    out = sketch(batch)
    assert out.shape == (3, 5, 16) and out.dtype == batch.dtype
    assert torch.allclose(out[2, 4], sketch(batch[2, 4]))
    # The sum of the coordinates in a bucket, with their signs, by hand for bucket 0.
    members = sketch.buckets == 0
    assert torch.allclose(sketch(x)[0], (x[members] * sketch.signs[members]).sum())


def test_inner_products_are_kept_in_expectation():
    """<Px, Py> = <x, y> + C with C = sum_{i<j} [h(i) = h(j)] s_i s_j (x_i y_j + x_j y_i); E[C] = 0 and,
    as the pair terms are uncorrelated, Var(C) = (1/k) sum_{i<j} (x_i y_j + x_j y_i)^2. Averaged over S
    seeds the error has standard deviation sqrt(Var / S); the test allows 5 of them (and the fixed seeds
    make it deterministic): about 3.5 here. A sketch without signs would be off by sum_{i<j} c_ij / k on
    average, -6.6 here."""
    d, k, seeds = 64, 8, 2000
    x, y = torch.randn(2, d, generator=gen(5), dtype=torch.float64)
    y = y + x  # correlated, so <x, y> is far from 0
    exact = float(x @ y)
    cross = torch.outer(x, y) + torch.outer(y, x)
    variance = float((cross.triu(diagonal=1) ** 2).sum()) / k
    estimates = torch.tensor([float(s(x) @ s(y)) for s in (CountSketch(d, k, seed=seed) for seed in range(seeds))])
    tolerance = 5 * (variance / seeds) ** 0.5
    assert abs(float(estimates.mean()) - exact) < tolerance, (float(estimates.mean()), exact, tolerance)
    assert tolerance < 0.1 * abs(exact)  # the check is tight enough to mean something
    # The spread matches the formula too (relative error of a sample variance over 2000 draws: a few percent).
    assert float(estimates.var()) == pytest.approx(variance, rel=0.25)
    # Squared norms in expectation as well.
    norms = torch.tensor([float(CountSketch(d, k, seed=seed)(x).square().sum()) for seed in range(500)])
    assert float(norms.mean()) == pytest.approx(float(x @ x), rel=0.1)


def test_bad_dimensions_and_shapes_are_rejected():
    for name, args in (
        ("input_dim", (0, 4)),
        ("input_dim", (True, 4)),
        ("input_dim", (3.0, 4)),
        ("output_dim", (4, 0)),
        ("output_dim", (4, -2)),
    ):
        with pytest.raises(ValueError, match=rf"{name} must be an integer >= 1"):
            CountSketch(*args)
    sketch = CountSketch(10, 4)
    with pytest.raises(ValueError, match=r"expected vectors of length 10; got shape \(2, 9\)"):
        sketch(torch.zeros(2, 9))
    with pytest.raises(ValueError, match=r"expected vectors of length 10; got shape \(10, 1\)"):
        sketch(torch.zeros(10, 1))


def _sequential_sketch(sketch: CountSketch, rows: torch.Tensor) -> torch.Tensor:
    """The definition, one coordinate at a time: bucket ``h(i)`` += ``sigma(i) x[i]`` in increasing ``i``, rounded
    to the vectors' dtype after every addition (what ``index_add_`` does on the host)."""
    out = rows.new_zeros(rows.shape[0], sketch.output_dim)
    for i in range(sketch.input_dim):
        bucket = int(sketch.buckets[i])
        out[:, bucket] = out[:, bucket] + rows[:, i] * int(sketch.signs[i])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_accelerator_path_adds_in_the_hosts_order_bit_for_bit(dtype):
    """Off the host the sketch reduces sorted buckets with segment_reduce (CUDA's index_add_ adds with atomics,
    in no fixed order). Run here on the host, that path must give exactly the host's sums, which are the
    sequential sums of the definition: values spanning nine orders of magnitude make any other order of
    addition round differently. k > d leaves empty buckets. (CD-GraB projects float32 or float64 gradients;
    in bfloat16 the host's index_add_ does not round after every addition.)"""
    generator = gen(11)
    for input_dim, output_dim in ((3000, 37), (20, 64)):
        sketch = CountSketch(input_dim, output_dim, seed=4)
        scale = torch.logspace(-4, 5, input_dim, dtype=torch.float64)
        rows = (torch.randn(5, input_dim, generator=generator, dtype=torch.float64) * scale).to(dtype)
        expected = _sequential_sketch(sketch, rows)
        host = sketch._project_on_host(rows)  # noqa: SLF001
        device = sketch._project_on_device(rows)  # noqa: SLF001
        assert host.dtype == device.dtype == dtype
        assert torch.equal(host, expected) and torch.equal(device, expected)
        # The order matters at this spread: a float64 sum rounded once differs from the float32 sequential one.
        if dtype == torch.float32 and input_dim > output_dim:
            assert not torch.equal(expected, _sequential_sketch(sketch, rows.double()).float())
        # Any leading shape, including a single vector (a one-dimensional reduction would take another path).
        batch = rows.reshape(5, 1, input_dim).expand(5, 2, input_dim)
        assert torch.equal(sketch._project_on_device(batch), expected.unsqueeze(1).expand(5, 2, output_dim))  # noqa: SLF001
        assert torch.equal(sketch._project_on_device(rows[3]), expected[3])  # noqa: SLF001
