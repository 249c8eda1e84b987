"""Dynamic averaging's timed calibration (``divergence_threshold=None``, ``sync_overhead`` a number) in one process.

The probe's size and the choice of the period decide at which steps every rank meets in collectives, so every rank
must reach them from the same inputs. The strategy runs here on stand-in communicators whose collectives return
preset values (the times every rank would have gathered), which shows what each rank would decide.
"""

import math

import torch
from torch import nn

from lightning_dist.model_vector import ModelVector
from lightning_dist.strategies._hierarchy import NodeHierarchy
from lightning_dist.strategies.dynamic import DynamicAveragingStrategy


class Collectives:
    """A communicator of ``world_size`` ranks as rank ``rank`` sees it: an all-reduce returns the tensor as it is (the
    sizes reduced are kept), an all-gather every rank's row as ``gathered`` makes it from this rank's."""

    def __init__(self, rank, world_size, gathered=None):
        self.rank, self.world_size = rank, world_size
        self.gathered = gathered
        self.reduced = []

    def all_reduce_sum_(self, tensor, purpose):
        self.reduced.append(tensor.numel())
        return tensor

    def all_gather(self, tensor, purpose):
        return torch.tensor([self.gathered(tensor.tolist())] * self.world_size, dtype=tensor.dtype)


class Flat(nn.Module):
    def __init__(self, numel):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(numel))


def strategy_on(numel, gathered, local_rank=0, ranks_per_node=1, nodes=2, **kwargs):
    """A strategy set up as rank ``local_rank`` of a node of ``ranks_per_node`` (``hierarchy="node"`` when more than
    one) among ``nodes``, with a model of ``numel`` float32 parameters."""
    hierarchy = "node" if ranks_per_node > 1 else None
    strategy = DynamicAveragingStrategy(hierarchy=hierarchy, **kwargs)
    strategy.parallel_devices = [torch.device("cpu")]
    strategy._vector = ModelVector(Flat(numel))
    strategy._comm = Collectives(local_rank, nodes * ranks_per_node, gathered)
    if hierarchy is not None:
        strategy._hierarchy = NodeHierarchy(None, Collectives(local_rank, ranks_per_node), Collectives(0, nodes))
    return strategy


def test_every_local_rank_probes_the_same_bytes_and_chooses_the_same_period_under_a_hierarchy():
    """1,000,003 float32 parameters on nodes of 4 ranks: local ranks 0-2 carry 250,001 entries, rank 3 250,000.
    Every rank gathered the same times (8 bytes in 0 s, the probe in 1 s, 1 s a step), so a full synchronization is
    ``parts`` seconds, and an overhead of 8.00001 / 10 lets 10 steps pay for one of 8 probes but not of 8.000032.
    Sized from its own chunk, rank 3 took 10 and the others 20, and rank 3 would wait at step 10 for collectives the
    others start at step 20; sized from the largest chunk, every rank probes 31,250 entries and takes 20."""
    overhead = 8.00001 / 10

    def times(local):
        return [0.0, 1.0, 1.0]

    probes, parts, periods = [], [], []
    for local_rank in range(4):
        strategy = strategy_on(1_000_003, times, local_rank, ranks_per_node=4, check_every=10, sync_overhead=overhead)
        strategy._probes = strategy._probe()
        strategy._clock = (1, 0.0)
        probes.append(strategy.learners.reduced[-1])
        parts.append(strategy._probe_parts)
        periods.append(strategy._choose_period(10))
    assert probes == [31_250] * 4
    assert len(set(parts)) == 1 and parts[0] == 250_001 * 4 / (31_250 * 4)
    assert periods == [20] * 4


def calibrating(check_every, calibration_steps, sync_overhead):
    """A flat strategy of 2 ranks whose calibration check is recorded, not run: every rank gathered probes of 1 ms
    and 2 ms and this rank's step time (NaN: no step timed)."""
    strategy = strategy_on(1000, lambda local: [0.001, 0.002, local[2]], check_every=check_every,
                           calibration_steps=calibration_steps, sync_overhead=sync_overhead)
    strategy._gather_distances = lambda: [1.0, 2.0]
    strategy.synchronized_at = []
    strategy._full_sync = lambda: strategy.synchronized_at.append(strategy.trained)
    return strategy


def run_steps(strategy, steps):
    for step in steps:
        strategy.trained = step
        strategy._calibrate(step)
        if strategy.threshold is not None:
            return


def test_with_check_every_1_the_period_is_chosen_once_a_step_was_timed():
    """check_every=1: the clock starts at step 1, which is also a check. Chosen there, the step time was NaN and the
    longest period (5) was taken whatever ``sync_overhead``; an overhead every synchronization meets takes 1 once
    step 2 has been timed, and Delta is the drift at step 2."""
    strategy = calibrating(check_every=1, calibration_steps=5, sync_overhead=1e12)
    run_steps(strategy, range(1, 7))
    assert strategy._calibration_period == 1
    assert strategy.synchronized_at == [2] and strategy.threshold == 1.5


def test_a_run_resumed_at_a_check_chooses_at_the_next_check():
    """A run resumed with no period chosen whose first step (20) is a check: its clock starts there, so the period
    is chosen at step 30, from one check's steps; chosen at step 20 it was the longest (40) whatever the overhead.
    The decision depends on the steps alone, the same on every rank."""
    strategy = calibrating(check_every=10, calibration_steps=40, sync_overhead=1e12)
    run_steps(strategy, range(20, 60))
    assert strategy._calibration_period == 10
    assert strategy.synchronized_at == [30]
    assert math.isfinite(strategy.threshold)
