"""PartitionSampler: equal counts on every rank, only own-part indices, seeded per (seed, epoch, rank);
part_size: the true part size |D_j| of a rank's loader."""

import numpy as np
import pytest
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from lightning_dist.data.partition import make_partition
from lightning_dist.data.sampler import PartitionSampler, part_size

LABELS = np.repeat(np.arange(10), 50)  # 500 examples, class-sorted on purpose
DATASET = range(len(LABELS))


def samplers(partition: str = "iid", num_replicas: int = 4, **kwargs) -> list[PartitionSampler]:
    return [PartitionSampler(DATASET, LABELS, num_replicas, rank, partition=partition, **kwargs)
            for rank in range(num_replicas)]


def test_is_a_distributed_sampler_so_lightning_keeps_it():
    assert isinstance(samplers()[0], DistributedSampler)


def test_equal_counts_on_all_ranks_even_for_unequal_parts():
    ranks = samplers("dirichlet", num_replicas=4, dirichlet_alpha=0.1, seed=2)
    part_sizes = [len(s.part) for s in ranks]
    assert len(set(part_sizes)) > 1 and min(part_sizes) < 125 < max(part_sizes)
    for epoch in range(3):
        for sampler in ranks:
            sampler.set_epoch(epoch)
            assert len(list(sampler)) == len(sampler) == 125


@pytest.mark.parametrize("shuffle", [True, False])
def test_yields_only_its_own_part(shuffle):
    parts = make_partition("dirichlet", LABELS, 4, seed=2, alpha=0.1)
    for rank, sampler in enumerate(samplers("dirichlet", dirichlet_alpha=0.1, seed=2, shuffle=shuffle)):
        assert np.array_equal(sampler.part, parts[rank])
        assert set(sampler) <= set(parts[rank].tolist())


@pytest.mark.parametrize("shuffle", [True, False])
def test_short_part_is_cycled_in_full(shuffle):
    ranks = samplers("dirichlet", dirichlet_alpha=0.1, seed=2, shuffle=shuffle)
    short = min(ranks, key=lambda s: len(s.part))
    counts = np.bincount(list(short), minlength=len(LABELS))[short.part]
    assert counts.min() >= len(short) // len(short.part)
    assert counts.max() - counts.min() <= 1


@pytest.mark.parametrize("shuffle", [True, False])
def test_long_part_uses_a_different_subset_each_epoch(shuffle):
    long = max(samplers("dirichlet", dirichlet_alpha=0.1, seed=2, shuffle=shuffle), key=lambda s: len(s.part))
    assert len(long.part) > len(long)
    seen = []
    for epoch in range(2):
        long.set_epoch(epoch)
        seen.append(set(long))
    assert seen[0] != seen[1]


def test_shuffle_is_seeded_by_seed_epoch_and_rank():
    first = samplers(seed=5)
    again = samplers(seed=5)
    epoch0 = [list(s) for s in first]
    assert epoch0 == [list(s) for s in again] == [list(s) for s in first]
    assert epoch0 != [list(s) for s in samplers(seed=6)]
    for s in first:
        s.set_epoch(1)
    epoch1 = [list(s) for s in first]
    assert all(a != b and sorted(a) == sorted(b) for a, b in zip(epoch0, epoch1))


def test_iid_ranks_together_cover_the_dataset_each_epoch():
    assert sorted(i for s in samplers(seed=1) for i in s) == list(DATASET)


def test_without_shuffle_reads_the_part_in_order():
    sampler = PartitionSampler(DATASET, LABELS, 4, 1, partition="class_sorted", shuffle=False)
    assert list(sampler) == list(range(125, 250))


def test_state_dict_restores_the_epoch():
    sampler = samplers(seed=3)[2]
    sampler.set_epoch(4)
    restored = samplers(seed=3)[2]
    restored.load_state_dict(sampler.state_dict())
    assert sampler.state_dict() == {"epoch": 4}
    assert list(restored) == list(sampler)


@pytest.mark.parametrize(
    "kwargs, parameter",
    [
        (dict(num_replicas=0, rank=0), "num_replicas"),
        (dict(num_replicas=501, rank=0), "num_replicas"),
        (dict(num_replicas=2, rank=2), "rank"),
        (dict(num_replicas=2, rank=-1), "rank"),
        (dict(num_replicas=2, rank=0, seed=-1), "seed"),
        (dict(num_replicas=2, rank=0, partition="shards"), "iid"),
        (dict(num_replicas=2, rank=0, partition="dirichlet", dirichlet_alpha=0.0), "alpha"),
        (dict(num_replicas=2, rank=0, labels=LABELS[:-1]), "labels"),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs, parameter):
    kwargs.setdefault("labels", LABELS)
    with pytest.raises(ValueError, match=parameter):
        PartitionSampler(DATASET, **kwargs)


def test_negative_epoch_is_rejected():
    with pytest.raises(ValueError, match="epoch"):
        samplers()[0].set_epoch(-1)


def test_part_size_is_the_true_part_not_the_equalised_count():
    ranks = samplers("dirichlet", num_replicas=4, dirichlet_alpha=0.1, seed=2)
    parts = make_partition("dirichlet", LABELS, 4, seed=2, alpha=0.1)
    assert [s.part_size for s in ranks] == [len(part) for part in parts]
    assert len({s.part_size for s in ranks}) > 1 and {len(s) for s in ranks} == {125}
    assert [part_size(DataLoader(DATASET, batch_size=8, sampler=s)) for s in ranks] == [len(part) for part in parts]


def test_part_size_of_other_loaders_is_what_they_yield_or_unknown():
    # torch's DistributedSampler: an equal share of a fresh split each epoch; a rank's own shard; no length: unknown.
    shares = [DistributedSampler(range(10), num_replicas=3, rank=rank, drop_last=True) for rank in range(3)]
    assert [part_size(DataLoader(range(10), sampler=s)) for s in shares] == [3, 3, 3]
    assert part_size(DataLoader(range(7), batch_size=2, shuffle=True)) == 7
    assert part_size(DataLoader(range(7), batch_size=None)) == 7

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(5))

    assert part_size(DataLoader(Stream(), batch_size=2)) is None
    assert part_size([1, 2, 3]) is None


def test_a_reused_partition_is_the_one_the_labels_and_arguments_give():
    """The last partition is reused across ranks (a simulation's thousands of ranks) only while the dataset, its
    labels and the arguments are the same: changed labels or another seed give their own partition."""
    dataset = list(range(60))
    labels = np.repeat(np.arange(6), 10)
    for partition, seed, current in (("class_sorted", 0, labels), ("dirichlet", 1, labels),
                                     ("dirichlet", 1, labels[::-1].copy()), ("dirichlet", 2, labels[::-1].copy())):
        expected = make_partition(partition, current, 4, seed=seed, alpha=0.5)
        for rank in range(4):
            sampler = PartitionSampler(dataset, current, 4, rank, partition=partition, seed=seed)
            assert np.array_equal(sampler.part, expected[rank])
