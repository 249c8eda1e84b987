"""``start_at_batch``: a train loader's next iteration from a given batch, its sampler's epoch kept (one process)."""

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler

from lightning_dist.data.resume import start_at_batch


def batches(loader):
    return [batch.tolist() for batch in loader]


def test_the_next_iteration_starts_at_the_batch_and_later_ones_are_whole():
    data = torch.arange(20)
    loader = DataLoader(data, batch_size=3, sampler=DistributedSampler(data, num_replicas=2, rank=1, seed=7))
    loader.sampler.set_epoch(4)
    epoch = batches(loader)
    assert start_at_batch(loader, 2)
    assert len(loader) == len(epoch)  # Lightning counts the skipped batches as done
    assert batches(loader) == epoch[2:]  # this epoch's order (set_epoch on the loader's own sampler), from batch 2
    assert batches(loader) == epoch  # then whole
    loader.sampler.set_epoch(5)
    assert start_at_batch(loader, 1) and batches(loader)[0] != epoch[1]  # another epoch, another order


def test_a_loader_that_batches_otherwise_is_left_alone():
    data = torch.arange(10)

    class Pairs(BatchSampler):
        pass

    custom = DataLoader(data, batch_sampler=Pairs(SequentialSampler(data), 2, False))
    assert not start_at_batch(custom, 1) and batches(custom)[0] == [0, 1]
    assert start_at_batch(DataLoader(data, batch_size=5), 0)
