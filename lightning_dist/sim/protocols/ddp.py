"""Data-parallel training as Lightning's DDP runs it (``Trainer(strategy="ddp")``): a gradient all-reduce every step.

What the real run does: ``DistributedDataParallel`` all-reduces the gradients during backward
(on CPU a Gloo ring all-reduce, :mod:`lightning_dist.sim.collectives`), bucket by bucket (the
first bucket 1 MiB, the others up to 25 MiB), each as soon as its gradients are ready, so
communication overlaps the rest of backward. Every rank divides by the number of ranks and
applies the mean gradient with its own optimizer; the replicas stay identical.

Here every step each worker computes its gradient on its own batch (``execute``, the step's whole
modelled time: forward, backward and the optimizer's update), then all workers all-reduce it (one
ring all-reduce of the trainable parameters' gradients, ``M`` bytes in their dtype:
``2 (N - 1) / N * M`` bytes sent per worker), then each applies the mean with its own optimizer.
The all-reduce starts when the whole backward has ended: **no overlap**, an upper bound on DDP's
step time. How much DDP can hide: a bucket's all-reduce starts once all its gradients are ready,
so only the buckets completed before the backward's end overlap it. With the defaults (first
bucket 1 MiB, then up to 25 MiB) a model of a few MB has two buckets, and the second starts when
the backward ends: for the 1.29 M-parameter ``TransformerLM`` (5.2 MB of gradients) at most the
first 1 MiB, a fifth of the bytes, can overlap. The gradient moves as one all-reduce: DDP's
buckets add ``2 (N - 1)`` latencies per extra bucket and move the same bytes. The optimizer's
update after the all-reduce is an ``execute`` of kind ``"update"``: inside a modelled
``step_seconds``, its own time when measured.

DDP also broadcasts rank 0's buffers before every forward (``broadcast_buffers``); a module with
floating-point buffers (BatchNorm) is refused rather than simulated without that broadcast.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_dist.algorithms.averaging import accumulation_dtype
from lightning_dist.sim.engine import Node
from lightning_dist.sim.protocols.base import Program, Protocol
from lightning_dist.sim.replica import NonFiniteModelError


class DataParallel(Protocol):
    """No arguments: every worker takes part in every step's gradient all-reduce."""

    name = "ddp"

    def setup(self, simulation) -> None:  # type: ignore[no-untyped-def]
        super().setup(simulation)
        vector = simulation.replicas[0].vector
        if vector.get().numel() != vector.num_parameters:
            raise ValueError(
                "the ddp protocol needs a module without floating-point buffers (e.g. BatchNorm's running "
                "statistics): DDP broadcasts rank 0's buffers before every forward, which it does not simulate"
            )
        self.members = list(range(simulation.num_workers))

    def train_step(self, node: Node, rank: int, batch: Any) -> Program:
        replica = self.simulation.replicas[rank]
        loss = yield from node.execute(replica.compute_gradient, batch)
        started = node.now
        gradients = replica.gradients()
        mean = yield from node.all_reduce(("gradient", replica.steps), self.members, gradients, self._mean)
        self.simulation.record_wait(rank, replica.steps + 1, started)
        yield from node.execute(replica.apply_gradient, mean, kind="update")
        return loss

    @staticmethod
    def _mean(gradients: list[list[Tensor]]) -> Tensor:
        """What the all-reduce gives every worker: the sum of the workers' gradients (each a list of parameter
        gradients) over their number, as one flat vector, summed in at least float32 without a copy of each.
        """
        first = gradients[0]
        total = torch.zeros(sum(part.numel() for part in first), dtype=accumulation_dtype(first[0].dtype))
        chunks = total.split([part.numel() for part in first])
        for worker in gradients:
            for chunk, part in zip(chunks, worker):
                chunk.add_(part.reshape(-1))
        total /= len(gradients)
        if not bool(torch.isfinite(total).all()):  # a non-finite gradient makes the mean non-finite: find whose
            for rank, worker in enumerate(gradients):
                if not all(bool(torch.isfinite(part).all()) for part in worker):
                    raise NonFiniteModelError(f"worker {rank} has a non-finite gradient; refusing to all-reduce it")
            raise NonFiniteModelError("the mean of the workers' finite gradients overflowed")
        return total

    def after_step(self, node: Node, rank: int, step: int) -> Program:
        yield from ()
