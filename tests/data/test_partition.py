"""Partitions cover every example once, have the promised shape, are seeded, and reject bad input."""

import numpy as np
import pytest

from lightning_dist.data.partition import (
    PARTITIONS,
    class_sorted_partition,
    contiguous_partition,
    dirichlet_partition,
    iid_partition,
    make_partition,
)

LABELS = np.repeat(np.arange(10), 100)[np.random.default_rng(0).permutation(1000)]


def mean_label_entropy(parts: list[np.ndarray]) -> float:
    """Mean over parts of the entropy (nats) of the part's label distribution; log(10) is uniform."""
    entropies = []
    for part in parts:
        freqs = np.bincount(LABELS[part], minlength=10) / len(part)
        freqs = freqs[freqs > 0]
        entropies.append(-(freqs * np.log(freqs)).sum())
    return float(np.mean(entropies))


@pytest.mark.parametrize("name", PARTITIONS)
@pytest.mark.parametrize("num_parts", [1, 3, 8, 100])
def test_every_index_in_exactly_one_part(name, num_parts):
    parts = make_partition(name, LABELS, num_parts, seed=1, alpha=0.5)
    assert len(parts) == num_parts
    assert all(part.dtype == np.int64 and len(part) > 0 for part in parts)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(LABELS)))


@pytest.mark.parametrize("name", ["iid", "class_sorted"])
def test_one_example_per_part_is_allowed(name):
    assert sorted(p.item() for p in make_partition(name, LABELS, len(LABELS))) == list(range(len(LABELS)))


def test_iid_sizes_balanced_and_seeded():
    parts = iid_partition(1003, 4, seed=3)
    assert sorted(len(p) for p in parts) == [250, 251, 251, 251]
    assert all(np.array_equal(a, b) for a, b in zip(parts, iid_partition(1003, 4, seed=3)))
    assert not np.array_equal(parts[0], iid_partition(1003, 4, seed=4)[0])
    assert mean_label_entropy(iid_partition(1000, 4, seed=3)) > 0.98 * np.log(10)


def test_class_sorted_shards_are_contiguous_and_equal():
    parts = class_sorted_partition(LABELS, 5)
    assert [len(p) for p in parts] == [200] * 5
    assert np.array_equal(np.concatenate(parts), np.argsort(LABELS, kind="stable"))
    assert [sorted(set(LABELS[p])) for p in parts] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert max(len(p) for p in class_sorted_partition(LABELS[:999], 4)) - 249 <= 1


def test_contiguous_shards_are_ranges_in_order_and_ignore_label_values():
    parts = contiguous_partition(1003, 4)
    assert [len(p) for p in parts] == [251, 251, 251, 250]
    assert np.array_equal(np.concatenate(parts), np.arange(1003))
    assert all(p.dtype == np.int64 for p in parts)
    # make_partition reads only how many labels there are, so any integer labels give the same shards.
    for labels in (LABELS, np.zeros(1000, dtype=np.int64), np.arange(1000)):
        assert all(np.array_equal(a, b) for a, b in zip(make_partition("contiguous", labels, 3, seed=5),
                                                       contiguous_partition(1000, 3)))


def test_dirichlet_skew_follows_alpha():
    skewed = np.mean([mean_label_entropy(dirichlet_partition(LABELS, 8, 0.05, s)) for s in range(3)])
    balanced = np.mean([mean_label_entropy(dirichlet_partition(LABELS, 8, 1000.0, s)) for s in range(3)])
    assert skewed < 1.2 < 2.25 < balanced
    sizes = [len(p) for p in dirichlet_partition(LABELS, 8, 1000.0, 0)]
    assert max(sizes) - min(sizes) < 20


def test_dirichlet_is_deterministic_per_seed():
    first, again, other = (dirichlet_partition(LABELS, 6, 0.3, s) for s in (7, 7, 8))
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


def test_dirichlet_redraws_instead_of_leaving_a_part_empty():
    # With alpha=0.05 single draws often give some part nothing; the result must still cover all parts.
    for seed in range(20):
        assert all(len(p) > 0 for p in dirichlet_partition(LABELS[:60], 12, 0.05, seed))


def test_dirichlet_gives_up_with_a_clear_error():
    with pytest.raises(ValueError, match="alpha"):
        dirichlet_partition([0, 0], 2, 1e-4, seed=0)


@pytest.mark.parametrize(
    "call, parameter",
    [
        (lambda: iid_partition(10, 0, 0), "num_parts"),
        (lambda: iid_partition(10, 11, 0), "num_parts"),
        (lambda: iid_partition(10, 2.0, 0), "num_parts"),
        (lambda: iid_partition(0, 1, 0), "num_examples"),
        (lambda: iid_partition(10, 2, -1), "seed"),
        (lambda: class_sorted_partition(LABELS, 1001), "num_parts"),
        (lambda: class_sorted_partition(LABELS.reshape(10, 100), 2), "labels"),
        (lambda: class_sorted_partition(LABELS.astype(float), 2), "labels"),
        (lambda: class_sorted_partition([], 1), "labels"),
        (lambda: dirichlet_partition(LABELS, 2, 0.0, 0), "alpha"),
        (lambda: dirichlet_partition(LABELS, 2, -1.0, 0), "alpha"),
        (lambda: dirichlet_partition(LABELS, 2, float("nan"), 0), "alpha"),
        (lambda: dirichlet_partition(LABELS, 2, float("inf"), 0), "alpha"),
        (lambda: dirichlet_partition(LABELS, True, 1.0, 0), "num_parts"),
        (lambda: contiguous_partition(10, 11), "num_parts"),
        (lambda: contiguous_partition(0, 1), "num_examples"),
        (lambda: make_partition("shards", LABELS, 2), "iid"),
    ],
)
def test_bad_arguments_name_the_parameter(call, parameter):
    with pytest.raises(ValueError, match=parameter):
        call()
