"""Datamodules: shapes and dtypes, partitioned train loader, offline cached MNIST-1D, label permutation."""

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_dist.data import datamodules
from lightning_dist.data.datamodules import DigitsDataModule, MNIST1DDataModule
from lightning_dist.data.sampler import PartitionSampler


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    """Keep generated MNIST-1D files out of the real ~/.cache and start each test cold."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    datamodules._mnist1d_arrays.cache_clear()
    yield tmp_path / "lightning_dist"
    datamodules._mnist1d_arrays.cache_clear()


@pytest.fixture(scope="module")
def digits():
    datamodule = DigitsDataModule(batch_size=16, seed=0)
    datamodule.setup("fit")
    return datamodule


def all_labels(loader) -> torch.Tensor:
    return torch.cat([y for _, y in loader])


def test_sizes_are_known_before_setup():
    assert (DigitsDataModule().num_features, DigitsDataModule().num_classes) == (64, 10)
    assert (MNIST1DDataModule().num_features, MNIST1DDataModule().num_classes) == (40, 10)


def test_digits_splits_shapes_and_dtypes(digits):
    assert len(digits.train_set) + len(digits.val_set) == 1797
    assert len(digits.val_set) == pytest.approx(0.2 * 1797, abs=1)
    x, y = next(iter(digits.train_dataloader()))
    assert x.shape == (16, 64) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert 0.0 <= digits.train_set.features.min() and digits.train_set.features.max() <= 1.0
    # stratified: every class's share of the validation split matches its share of the training split
    train_share = np.bincount(digits.train_set.labels.numpy()) / len(digits.train_set)
    val_share = np.bincount(digits.val_set.labels.numpy()) / len(digits.val_set)
    assert np.abs(train_share - val_share).max() < 0.01


def test_train_loader_uses_the_trainers_rank(digits):
    loader = digits.train_dataloader()
    assert isinstance(loader.sampler, PartitionSampler)
    assert (loader.sampler.num_replicas, loader.sampler.rank) == (1, 0)
    # A strategy without distributed_sampler_kwargs (Lightning's single-device ones): the Trainer's world and rank.
    digits.trainer = SimpleNamespace(world_size=4, global_rank=2, strategy=SimpleNamespace())
    try:
        sampler = digits.train_dataloader().sampler
    finally:
        digits.trainer = None
    assert (sampler.num_replicas, sampler.rank, len(sampler)) == (4, 2, len(digits.train_set) // 4)


def test_train_loader_takes_the_strategys_shard(digits):
    """Where the strategy shards otherwise (fault_tolerance: group 1 of 3, one rank each, in a job of one rank), the
    loader reads the strategy's shard, as Lightning's own distributed sampler would."""
    strategy = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 3, "rank": 1})
    digits.trainer = SimpleNamespace(world_size=1, global_rank=0, strategy=strategy)
    try:
        sampler = digits.train_dataloader().sampler
    finally:
        digits.trainer = None
    assert (sampler.num_replicas, sampler.rank) == (3, 1)


def test_reshuffled_split_deals_out_a_new_disjoint_split_every_epoch():
    datamodule = DigitsDataModule(batch_size=16, partition="reshuffled", seed=0)
    datamodule.setup("fit")
    world_size = 4
    per_epoch = []
    for epoch in range(2):
        parts = []
        for rank in range(world_size):
            datamodule.trainer = SimpleNamespace(world_size=world_size, global_rank=rank, strategy=SimpleNamespace())
            loader = datamodule.train_dataloader()
            loader.sampler.set_epoch(epoch)
            parts.append(set(loader.sampler))
        per_epoch.append(parts)
    datamodule.trainer = None
    for parts in per_epoch:
        # equal sizes (every rank takes the same number of steps), disjoint, nearly the whole set
        assert {len(part) for part in parts} == {len(datamodule.train_set) // world_size}
        assert len(set().union(*parts)) == sum(len(part) for part in parts)
    # a rank's examples change from one epoch to the next: no rank is stuck with a fixed part
    for rank in range(world_size):
        assert per_epoch[0][rank] != per_epoch[1][rank]


def test_eval_loaders_are_sequential_and_complete(digits):
    assert torch.equal(all_labels(digits.val_dataloader()), digits.val_set.labels)
    assert torch.equal(all_labels(digits.test_dataloader()), digits.val_set.labels)


def test_label_permutation_reaches_existing_loaders():
    datamodule = DigitsDataModule(batch_size=64)
    datamodule.setup()
    train_loader, val_loader = datamodule.train_dataloader(), datamodule.val_dataloader()
    plain_val = all_labels(val_loader)
    perm = [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]
    datamodule.set_label_permutation(perm)
    assert torch.equal(all_labels(val_loader), torch.tensor(perm)[plain_val])
    order = list(train_loader.sampler)
    assert torch.equal(all_labels(train_loader), torch.tensor(perm)[datamodule.train_set.labels[order]])
    datamodule.set_label_permutation(None)
    assert torch.equal(all_labels(val_loader), plain_val)


def test_label_permutation_set_before_setup_applies_after():
    datamodule = DigitsDataModule()
    datamodule.set_label_permutation([1, 0, 2, 3, 4, 5, 6, 7, 8, 9])
    datamodule.setup()
    label = datamodule.val_set.labels[0].item()
    assert datamodule.val_set[0][1].item() == {0: 1, 1: 0}.get(label, label)


def test_mnist1d_is_generated_offline_and_cached(isolated_cache):
    python_state, numpy_state = random.getstate(), np.random.get_state()
    datamodule = MNIST1DDataModule(num_samples=200, batch_size=8, seed=3)
    datamodule.prepare_data()
    datamodule.setup("fit")
    # generation reseeds the global generators internally; the caller's streams must be untouched
    assert random.getstate() == python_state
    assert np.array_equal(np.random.get_state()[1], numpy_state[1])
    assert (len(datamodule.train_set), len(datamodule.val_set)) == (160, 40)
    x, y = next(iter(datamodule.train_dataloader()))
    assert x.shape == (8, 40) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert set(datamodule.train_set.labels.tolist()) == set(range(10))
    assert len(list(isolated_cache.glob("mnist1d-*.npz"))) == 1

    datamodules._mnist1d_arrays.cache_clear()
    from_disk = MNIST1DDataModule(num_samples=200, seed=3)
    from_disk.setup()
    assert torch.equal(from_disk.train_set.features, datamodule.train_set.features)
    other_seed = MNIST1DDataModule(num_samples=200, seed=4)
    other_seed.setup()
    assert not torch.equal(other_seed.train_set.features, datamodule.train_set.features)


def test_dataloaders_need_setup():
    with pytest.raises(RuntimeError, match="setup"):
        DigitsDataModule().train_dataloader()


@pytest.mark.parametrize(
    "make, parameter",
    [
        (lambda: DigitsDataModule(batch_size=0), "batch_size"),
        (lambda: DigitsDataModule(val_fraction=0.0), "val_fraction"),
        (lambda: DigitsDataModule(val_fraction=1.0), "val_fraction"),
        (lambda: DigitsDataModule(partition="shards"), "partition"),
        (lambda: DigitsDataModule(dirichlet_alpha=0.0), "dirichlet_alpha"),
        (lambda: DigitsDataModule(seed=-1), "seed"),
        (lambda: MNIST1DDataModule(num_samples=5), "num_samples"),
        (lambda: MNIST1DDataModule(num_samples=10, val_fraction=0.95), "num_samples"),
        (lambda: DigitsDataModule().set_label_permutation([0, 1, 2]), "perm"),
        (lambda: DigitsDataModule().set_label_permutation([0] * 10), "perm"),
    ],
)
def test_bad_arguments_name_the_parameter(make, parameter):
    with pytest.raises(ValueError, match=parameter):
        make()
