"""Data-parallel training as Lightning's DDP runs it (``Trainer(strategy="ddp")``): a gradient all-reduce every step.

What the real run does: ``DistributedDataParallel`` all-reduces the gradients during backward
(on CPU a Gloo ring all-reduce, :mod:`lightning_dist.sim.collectives`; on GPUs NCCL's ring or tree,
``Simulation(collectives="nccl")``, :mod:`lightning_dist.sim.nccl`), bucket by bucket (the
first bucket 1 MiB, the others up to 25 MiB), each as soon as its gradients are ready, so
communication overlaps the rest of backward. Every rank divides by the number of ranks and
applies the mean gradient with its own optimizer; the replicas stay identical.

Here every step each worker computes its gradient on its own batch (``execute``, the step's whole
modelled time: forward, backward and the optimizer's update), then all workers all-reduce it (one
all-reduce of the trainable parameters' gradients under the simulation's collective model, ``M`` bytes in
their dtype: ``2 (N - 1) / N * M`` bytes sent per worker), then each applies the mean with its own optimizer.
The all-reduce starts when the whole backward has ended: **no overlap**, an upper bound on DDP's
step time. How much DDP can hide: a bucket's all-reduce starts once all its gradients are ready,
so only the buckets completed before the backward's end overlap it. With the defaults (first
bucket 1 MiB, then up to 25 MiB) a model of a few MB has two buckets, and the second starts when
the backward ends: for the 1.29 M-parameter ``TransformerLM`` (5.2 MB of gradients) at most the
first 1 MiB, a fifth of the bytes, can overlap. The gradient moves as one all-reduce: DDP's
buckets add a collective's latencies (Gloo's ring: ``2 (N - 1)``) per extra bucket and move the same
bytes. The optimizer's update after the all-reduce is an ``execute`` of kind ``"update"``: inside a
modelled ``step_seconds``, its own time when measured.

The replicas being identical, the workers share one model and optimizer
(:class:`~lightning_dist.sim.replica.SharedReplica`: one copy in memory, not N; its first worker to apply a step's
mean takes the optimizer step), unless workers leave and join or epoch schedulers would step at different steps.

DDP also broadcasts rank 0's buffers before every forward (``broadcast_buffers``); a module with
floating-point buffers (BatchNorm) is refused rather than simulated without that broadcast.

Churn (:mod:`lightning_dist.sim.churn`), as torchft runs DDP over a changing group: every step's
all-reduce is among the workers present, its mean over their number. A step's members are fixed
when the first of them starts it; a worker that leaves is dropped from the steps not yet reduced
(a ring already running ends with its gradient in it). A joiner is admitted when the step in
progress starts its ring (its last member has joined) and takes part from the next step: the
lowest member of that step sends it the model once the step is applied (the replicas are
identical), and it goes on from that step. If that member leaves first, another present member
sends it; if no worker is left at all, the joiner starts from the model the last one left with,
at its step (as from a checkpoint), without a transfer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_dist.algorithms.arguments import check_count, check_steps
from lightning_dist.algorithms.averaging import accumulation_dtype
from lightning_dist.algorithms.gradient_compression import PowerSGD, fp16_mean
from lightning_dist.sim.engine import Message, Node
from lightning_dist.sim.protocols.base import Program, Protocol
from lightning_dist.sim.replica import NonFiniteModelError


class DataParallel(Protocol):
    """Every worker takes part in every step's gradient all-reduce.

    Args:
    hook: None (DDP's plain all-reduce), ``"fp16"`` or ``"powersgd"``: the DDP communication hook the
        benchmarks register (:mod:`lightning_dist.algorithms.gradient_compression` gives what every
        worker applies; the all-reduce carries the hook's bytes: half, or PowerSGD's factors, in the hook's three
        all-reduces one after the other: the uncompressed tensors, every ``P``, every ``Q``; the hook's own
        products are not timed).
    matrix_approximation_rank: PowerSGD's rank ``r``.
    start_powerSGD_iter: PowerSGD's plain all-reduces before compressing (>= 2 with error feedback, as the hook).
    """

    name = "ddp"
    identical_replicas = True
    arguments = ("hook", "matrix_approximation_rank", "start_powerSGD_iter")

    def __init__(self, hook: str | None = None, matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 2) -> None:
        if hook not in (None, "fp16", "powersgd"):
            raise ValueError(f"hook must be None, 'fp16' or 'powersgd'; got {hook!r}")
        self.hook = hook
        self.matrix_approximation_rank = check_steps("matrix_approximation_rank", matrix_approximation_rank,
                                                     "PowerSGD's rank")
        self.start_powerSGD_iter = check_count("start_powerSGD_iter", start_powerSGD_iter, 2,
                                               meaning=" (PowerSGD with error feedback compresses from the third step)")

    def setup(self, simulation) -> None:  # type: ignore[no-untyped-def]
        super().setup(simulation)
        vector = simulation.replicas[0].vector
        if vector.get().numel() != vector.num_parameters:
            raise ValueError(
                "the ddp protocol needs a module without floating-point buffers (e.g. BatchNorm's running "
                "statistics): DDP broadcasts rank 0's buffers before every forward, which it does not simulate"
            )
        self.members = simulation.present_workers()
        """The workers taking part in the steps not started yet."""
        self.step_members: dict[int, list[int]] = {}  # members of each step once its first member started it
        self.done = [0] * simulation.num_workers  # steps each worker has applied
        self.waiting: list[int] = []  # joiners not yet admitted
        self.owed: dict[int, tuple[int, list[int]]] = {}  # step -> (its sender, joiners it still owes the model)
        self.left_with: tuple[Tensor, int] = (simulation.replicas[0].get(), 0)  # the last worker's model and step
        self.powersgd: PowerSGD | None = None  # made from the first step's gradients (the trainable parameters)

    def train_step(self, node: Node, rank: int, batch: Any) -> Program:
        replica = self.simulation.replicas[rank]
        step = self.done[rank] + 1
        members = self.step_members.setdefault(step, list(self.members))
        loss = yield from node.execute(replica.compute_gradient, batch)
        started = node.now
        gradients = replica.gradients()
        *chained, last = self._phases(step, gradients)
        for phase, nbytes in enumerate(chained):  # PowerSGD's all-reduces before its last, one after the other
            yield from node.all_reduce(("gradient", step, phase), members, None, lambda _: None, nbytes=nbytes)
        mean = yield from node.all_reduce(("gradient", step), members, gradients,
                                          lambda grads: self._reduce(step, grads), nbytes=last)
        self.simulation.record_wait(rank, step, started)
        yield from node.execute(replica.apply_gradient, mean, kind="update")
        self.done[rank] = step
        self.step_members.pop(step - 1, None)
        owed = self.owed.get(step)
        if owed is not None and owed[0] in (rank, None):  # its sender, or the first to hold it if the sender left
            self.owed[step] = (rank, owed[1])
            self._send_state(rank, step)
        return loss

    def _phases(self, step: int, gradients: list[Tensor]) -> list[int]:
        """The bytes of the step's all-reduces, run one after the other: the gradients, in float16 with the fp16 hook;
        once PowerSGD compresses, its three (the uncompressed tensors, every ``P``, every ``Q``: each needs the one
        before, so their latencies add up)."""
        if self.hook == "powersgd" and self.powersgd is None:
            self.powersgd = PowerSGD([gradient.shape for gradient in gradients], self.simulation.num_workers,
                                     self.matrix_approximation_rank, self.start_powerSGD_iter)
        plain = sum(gradient.numel() * gradient.element_size() for gradient in gradients)
        if self.hook == "fp16":
            return [plain // 2]
        if self.powersgd is not None and step > self.start_powerSGD_iter:
            return self.powersgd.phase_nbytes()
        return [plain]

    def _reduce(self, step: int, gradients: list[list[Tensor]]) -> Tensor:
        """The all-reduce of ``step`` starts: its mean; the joiners waiting now take part from the next step."""
        if self.waiting:
            admitted, self.waiting = self.waiting, []
            self.members = sorted(self.members + admitted)
            self.owed[step] = (min(self.step_members[step]), admitted)
        mean = self._mean(gradients)  # also refuses a non-finite gradient by its worker
        if self.hook is None:
            return mean
        if self.powersgd is not None and len(gradients) != self.powersgd.workers:
            raise ValueError("the powersgd hook keeps one error per worker: it is not simulated with churn")
        assert self.hook == "fp16" or self.powersgd is not None
        parts = fp16_mean(gradients) if self.hook == "fp16" else self.powersgd.mean(gradients)
        return torch.cat([part.reshape(-1) for part in parts])

    def _send_state(self, sender: int, step: int) -> None:
        """``sender`` (a present worker holding the model after ``step``) sends it to the joiners owed it (each
        is struck off when it arrives, so a leaving sender's dropped transfers are sent again)."""
        replica = self.simulation.replicas[sender]
        for joiner in self.owed[step][1]:
            self.simulation.simulator.nodes[sender].send(joiner, (replica.get(), step), tag="state")

    def leave(self, rank: int) -> None:
        self.members = [member for member in self.members if member != rank]
        for members in self.step_members.values():
            if rank in members:
                members.remove(rank)
        if rank in self.waiting:
            self.waiting.remove(rank)
        for step, (sender, joiners) in list(self.owed.items()):
            if rank in joiners:
                joiners.remove(rank)
            if not joiners:
                del self.owed[step]
            elif sender == rank:  # another present worker holding the model after that step sends it
                ready = [member for member in self.members if member not in joiners and self.done[member] == step]
                self.owed[step] = (min(ready) if ready else None, joiners)
                if ready:
                    self._send_state(min(ready), step)
        if not self.members:  # the last worker left: joiners start from its model, as from a checkpoint
            replica = self.simulation.replicas[rank]
            self.left_with = (replica.get(), self.done[rank])
            self._admit_alone()

    def _admit_alone(self) -> None:
        """Admit the waiting joiners without a transfer, from the model the last worker left with."""
        admitted, self.waiting = self.waiting, []
        self.members = sorted(admitted)
        for joiner in admitted:
            node = self.simulation.simulator.nodes[joiner]
            node.deliver(Message(joiner, "state", self.left_with, 0, node.now))

    def join(self, node: Node, rank: int) -> Program:
        """Wait for admission at the next step's start; take the model after it and go on from that step."""
        self.waiting.append(rank)
        if not self.members:
            self._admit_alone()
        model, step = (yield node.recv(tag="state")).payload
        joiners = self.owed.get(step, (None, []))[1]
        if rank in joiners:
            joiners.remove(rank)
            if not joiners:
                del self.owed[step]
        self.simulation.replicas[rank].set(model)
        self.done[rank] = step
        return step

    def finish(self, node: Node, rank: int) -> Program:
        """A worker that took its last step takes part in no further step."""
        self.leave(rank)
        yield from ()

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
