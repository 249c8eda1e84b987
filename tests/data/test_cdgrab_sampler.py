"""CDGraBSampler in one process: partition, dropped remainder, per-epoch orders, resume."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dist.data import CDGraBSampler

DATASET = TensorDataset(torch.arange(103))


def _samplers(order="balanced", ranks=3, batch_size=4, seed=0):
    return [CDGraBSampler(DATASET, batch_size, ranks, rank, order=order, seed=seed) for rank in range(ranks)]


def test_a_fixed_random_partition_in_whole_global_batches():
    samplers = _samplers()
    # 103 examples, 3 ranks x batch 4 = 12 per step: 96 kept, 7 dropped, 32 per rank.
    assert [len(s) for s in samplers] == [32] * 3 and samplers[0].dropped == 7
    parts = [set(s.local_indices.tolist()) for s in samplers]
    assert len(set.union(*parts)) == 96
    assert sorted(parts[0]) != list(range(32))  # shuffled before splitting
    for sampler in samplers:
        first = list(sampler)
        assert sorted(first) == sorted(sampler.local_indices.tolist())
    assert _samplers(seed=0)[1].local_indices.tolist() == samplers[1].local_indices.tolist()
    assert _samplers(seed=1)[1].local_indices.tolist() != samplers[1].local_indices.tolist()


def test_random_order_is_distributed_random_reshuffling():
    sampler, again = _samplers("random")[0], _samplers("random")[0]
    orders = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        again.set_epoch(epoch)
        orders.append(list(sampler))
        assert orders[-1] == list(again)  # seeded
        assert sorted(orders[-1]) == sorted(sampler.local_indices.tolist())  # same subset every epoch
    assert orders[0] != orders[1] != orders[2]


def test_balanced_order_takes_the_installed_permutation_and_refuses_to_guess():
    sampler = _samplers()[0]
    with pytest.raises(RuntimeError, match="no order for epoch 1: add the CDGraB callback"):
        sampler.set_epoch(1)
    reversed_order = sampler.permutation.flip(0)
    sampler.install_next_order(1, reversed_order)
    assert list(sampler) == sampler.local_indices[sampler.permutation].tolist()  # still epoch 0 until set_epoch
    sampler.set_epoch(1)
    assert list(sampler) == sampler.local_indices[reversed_order].tolist()
    sampler.set_epoch(1)  # Lightning calls it again on restarts: no change
    assert torch.equal(sampler.permutation, reversed_order)


def test_install_refuses_what_is_not_a_permutation():
    sampler = _samplers()[0]
    with pytest.raises(ValueError, match=r"permutation must be a permutation of range\(32\)"):
        sampler.install_next_order(1, torch.zeros(32, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"range\(32\)"):
        sampler.install_next_order(1, torch.arange(31))


def test_resume_skips_the_examples_already_read_once():
    sampler = _samplers()[2]
    order = torch.randperm(32, generator=torch.Generator().manual_seed(5))
    sampler.resume_at(4, order, start=8)
    assert sampler.epoch == 4 and len(sampler) == 32
    assert list(sampler) == sampler.local_indices[order[8:]].tolist()
    assert list(sampler) == sampler.local_indices[order].tolist()  # the next pass is whole
    state = sampler.state_dict()
    other = _samplers()[2]
    other.load_state_dict(state)
    assert torch.equal(other.permutation, order) and other.epoch == 4


def test_a_data_loader_reads_whole_batches():
    sampler = _samplers(ranks=1)[0]
    batches = [b[0] for b in DataLoader(DATASET, batch_size=4, sampler=sampler)]
    assert len(batches) == 25 and all(len(b) == 4 for b in batches)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(batch_size=3), "batch_size must be even"),
        (dict(batch_size=1), "batch_size must be an integer >= 2"),
        (dict(batch_size=4, order="sorted"), "order must be one of"),
        (dict(batch_size=40), "fewer than one step of batch_size=40 on each of 3 ranks"),
        (dict(batch_size=4, seed=-1), "seed must be an integer >= 0"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CDGraBSampler(DATASET, num_replicas=3, rank=0, **kwargs)
