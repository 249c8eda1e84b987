"""What both sides of the validation run: one small LightningModule, its data, and the methods (a strategy for the real
fit, a protocol for the simulator), plus the pure arithmetic that turns step end times into seconds per synchronization.

The model is one ``rows x cols`` float32 matrix (no bias; PowerSGD compresses it) whose loss is ``s_r <W, D>``: ``D``
a fixed random matrix, ``s_r`` rank ``r``'s sign (its data: every batch of rank ``r`` holds ``s_r``). A step's
gradient is ``s_r D``, a few hundred thousand multiplications, so the capped network sets the pace, not the cores.
The signs make dynamic averaging's balancing sets what the study asks for: the ranks of the chosen set get +1 and -1
in turn (their drifts cancel, so the set's mean is the reference and the first balancing round closes it), every
other rank 0 (it never drifts, never violates). The simulator trains the same module on the same data, so its
workers violate exactly as the real ranks do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

ROWS, COLS = 16, 16384  # 262,144 float32 parameters, 1 MiB; PowerSGD rank 4 sends 257 KiB of it
LR = 0.1
DIRECTION_SCALE = 1e-3
SEED = 0


class Directions(L.LightningModule):
    """``loss = s * <W, D>``: rank ``r``'s batches carry its sign ``s``; the gradient is ``s D``."""

    def __init__(self, rows: int = ROWS, cols: int = COLS, lr: float = LR) -> None:
        super().__init__()
        self.lr = lr
        self.layer = torch.nn.Linear(cols, rows, bias=False)
        # A plain attribute, not a buffer: DDP would broadcast a buffer every step.
        self.direction = torch.randn(rows, cols, generator=torch.Generator().manual_seed(SEED + 1)) * DIRECTION_SCALE

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (sign,) = batch
        return sign.mean() * (self.layer.weight * self.direction).sum()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", (self.layer.weight * self.direction).sum())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class SignData(L.LightningDataModule):
    """Rank ``r`` of ``len(signs)`` trains on ``steps`` batches of one example, each its sign ``signs[r]``.

    ``train_loader(num_replicas, rank)`` is the simulator's per-rank loader; under Lightning (``use_distributed_sampler
    =False``) ``train_dataloader`` gives the trainer's rank the same one.
    """

    def __init__(self, signs: Sequence[float], steps: int) -> None:
        super().__init__()
        self.signs, self.steps = list(signs), steps

    def train_loader(self, num_replicas: int, rank: int) -> DataLoader:
        if num_replicas != len(self.signs):
            raise ValueError(f"{len(self.signs)} signs for {num_replicas} ranks")
        return DataLoader(TensorDataset(torch.full((self.steps,), float(self.signs[rank]))), batch_size=1)

    def train_dataloader(self) -> DataLoader:
        return self.train_loader(self.trainer.world_size, self.trainer.global_rank)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.zeros(1)), batch_size=1)


def balancing_set(size: int, ranks: int) -> list[int]:
    """The ranks of a balancing set of ``size``: spread over the namespaces (every other rank for half of them, two
    ranks on different namespaces for a pair, all of them for ``size == ranks``)."""
    if size == ranks:
        return list(range(ranks))
    if size == 2:
        return [1, ranks - 2]
    step = ranks // size
    return list(range(0, step * size, step))


def signs_for(members: Sequence[int], ranks: int) -> list[float]:
    """+1, -1, +1, ... over ``members`` in rank order (their drifts cancel pairwise), 0 for every other rank."""
    signs = [0.0] * ranks
    for index, member in enumerate(sorted(members)):
        signs[member] = 1.0 if index % 2 == 0 else -1.0
    return signs


def dynamic_cycle(size: int, ranks: int) -> int:
    """Checks in one cycle of the violation counter when ``size`` ranks violate at every check: ``v += size`` until
    ``v >= ranks`` forces a full synchronization (which resets it)."""
    return math.ceil(ranks / size)


def drift_threshold(check_every: int) -> float:
    """A divergence threshold a violator crosses in ``check_every`` steps (a quarter of its squared drift), far above
    what the mean of a balanced set keeps (rounding)."""
    drift = LR * check_every * DIRECTION_SCALE
    return 0.25 * drift * drift * ROWS * COLS


def methods(ranks: int, quick: bool = False) -> list[dict[str, Any]]:
    """Every method of the study for ``ranks`` ranks: its name, steps per synchronization ``every``, the
    synchronizations run ``syncs`` (the first ``warmup`` are left out of the time), the ranks' signs, and how to
    build it on each side (``strategy`` for the fit, ``protocol`` for the simulator)."""
    alternating = [1.0 if rank % 2 == 0 else -1.0 for rank in range(ranks)]
    syncs, warmup = (4, 1) if quick else (10, 2)
    runs: list[dict[str, Any]] = [
        {"name": "allreduce", "label": "DDP gradient all-reduce (ring)", "every": 1, "syncs": syncs, "warmup": warmup,
         "signs": alternating, "strategy": {"kind": "ddp"}, "protocol": {"name": "ddp"}},
        {"name": "powersgd", "label": "DDP + PowerSGD rank 4", "every": 1, "syncs": syncs + 2, "warmup": warmup + 2,
         "signs": alternating,
         "strategy": {"kind": "powersgd", "matrix_approximation_rank": 4, "start_powerSGD_iter": 2},
         "protocol": {"name": "ddp", "hook": "powersgd", "matrix_approximation_rank": 4, "start_powerSGD_iter": 2}},
        {"name": "periodic", "label": "periodic averaging, H = 4", "every": 4, "syncs": 3 if quick else 9, "warmup": 1,
         "signs": alternating, "strategy": {"kind": "PeriodicAveragingStrategy", "period": 4},
         "protocol": {"name": "periodic", "period": 4, "topology": "strategy"}},
    ]
    check_every = 4
    for role, size in (("pair", 2), ("half", ranks // 2), ("all", ranks)):
        cycle = dynamic_cycle(size, ranks)
        members = balancing_set(size, ranks)
        kwargs = {"divergence_threshold": drift_threshold(check_every), "check_every": check_every}
        runs.append({"name": f"dynamic_{role}", "label": f"dynamic averaging, |B| = {size}", "every": check_every,
                     "syncs": 1 + cycle * (1 if quick else math.ceil(8 / cycle)), "warmup": 1, "members": members,
                     "signs": signs_for(members, ranks),
                     "strategy": {"kind": "DynamicAveragingStrategy", **kwargs},
                     "protocol": {"name": "dynamic_avg", "topology": "strategy", **kwargs}})
    gossip = {"segments": 4, "replicas": 2, "period": 2, "seed": SEED}
    runs.append({"name": "gossip", "label": "segmented gossip, S = 4, R = 2", "every": 2, "syncs": 3 if quick else 9,
                 "warmup": 1, "signs": alternating, "strategy": {"kind": "SegmentedGossipStrategy", **gossip},
                 "protocol": {"name": "segmented_gossip", "topology": "strategy", **gossip}})
    downpour = {"push_every": 4, "synchronous": False}
    runs.append({"name": "downpour", "label": "DownpourSGD, asynchronous, push every 4", "every": 4,
                 "syncs": 3 if quick else 6, "warmup": 1, "signs": alternating,
                 "strategy": {"kind": "DownpourSGDStrategy", **downpour},
                 "protocol": {"name": "parameter_server", "topology": "strategy", **downpour}})
    return runs


def sync_times(step_ends: Sequence[Sequence[float]], every: int) -> list[float]:
    """When synchronization ``s = 1, 2, ...`` had ended on every rank: the latest rank's end of step ``s * every``
    (``step_ends[rank][i]`` is when rank ``rank`` ended step ``i + 1``; a step's end includes its synchronization)."""
    steps = min(len(ends) for ends in step_ends)
    return [max(ends[step - 1] for ends in step_ends) for step in range(every, steps + 1, every)]


def seconds_per_sync(times: Sequence[float], warmup: int) -> float:
    """Seconds per synchronization in the steady state: from the end of synchronization ``warmup`` to the end of the
    last, over the synchronizations between (``times[s - 1]`` is when synchronization ``s`` ended)."""
    if not 1 <= warmup < len(times):
        raise ValueError(f"need more than warmup={warmup} (>= 1) synchronizations; got {len(times)}")
    return (times[-1] - times[warmup - 1]) / (len(times) - warmup)


def local_step_seconds(step_ends: Sequence[Sequence[float]], every: int) -> float:
    """The median duration of a step without a synchronization (the compute the simulator is given): a step ``i`` is
    timed from the end of step ``i - 1``, for every ``i > 1`` that is not a synchronization's step nor the one after."""
    durations = sorted(ends[i] - ends[i - 1] for ends in step_ends for i in range(1, len(ends))
                       if (i + 1) % every and i % every)
    if not durations:
        raise ValueError(f"no step without a synchronization with every={every}")
    middle = len(durations) // 2
    return durations[middle] if len(durations) % 2 else (durations[middle - 1] + durations[middle]) / 2
