"""Streaming synchronization in the simulator: periodic averaging's and DiLoCo's model in fragments, each exchange
overlapping ``tau`` steps of compute (Streaming DiLoCo, Douillard et al. 2025; the plan and the merge rule are
:mod:`lightning_dist.algorithms.streaming`'s, the strategies run the same).

After optimizer step ``t - tau`` every worker takes a copy (snapshot) of fragment ``p`` (the ``[start, stop)`` of
:meth:`StreamingPlan.fragment_bounds <lightning_dist.algorithms.streaming.StreamingPlan.fragment_bounds>` over the
model vector) and starts its exchange in a background process of its node; the worker goes on training at once.
After step ``t`` it waits for that process (only for what is left of it) and merges the result into its fragment
with :func:`~lightning_dist.algorithms.streaming.merge`: ``alpha * local + (1 - alpha) * theta_p``. So a worker's
virtual time is its compute plus ``max(0, exchange - tau steps of compute)`` per exchange.

The exchange is what the strategy's (:mod:`lightning_dist.strategies._streaming`) moves: every worker all-gathers a
1-byte finiteness flag (:func:`~lightning_dist.sim.protocols.base.all_finite`; the blocking plain average has no
such check, its compressed one does), then, over the fragment:

- plain averaging: a ring all-reduce of the fragment summed in
  :func:`~lightning_dist.algorithms.averaging.accumulation_dtype`; ``theta_p`` is the mean of the snapshots
  (:func:`~lightning_dist.sim.protocols.base.checked_mean`);
- DiLoCo (``outer_optimizer``): the same all-reduce, then one :class:`~lightning_dist.algorithms.outer.OuterStep`
  per fragment with parameters, over them (its reference is ``theta_p``): ``theta_p <- OuterOpt(theta_p,
  theta_p - mean_p)``; a fragment's buffers (BatchNorm's statistics, at the end of the model vector) are averaged,
  not stepped;
- ``compression``: :class:`~lightning_dist.sim.protocols.compressed.CompressedSync` per fragment (the 1-byte
  finiteness all-gather, then the encoded chunks of the fragment's parameters and its buffers in the accumulation
  dtype timed as one ring all-reduce), with its own error feedback: deltas from the fragment's common model
  ``theta_p``, worker and chunk-owner residuals of the fragment's parameters.

The reduction and the outer step run when the last worker has joined the exchange (its start; the strategy steps
the outer optimizer at the merge, the same numbers since nothing else touches the fragment's state in between), so
what a worker merges is fixed by the snapshots, whenever the bytes arrive.

Timing, as for every collective of the simulator (:mod:`lightning_dist.sim.collectives`): the exchange takes its
ring's duration once every worker has joined and occupies no port, so it neither slows nor is slowed by other
traffic. There is none during it here: a fragment's exchange is the protocol's only traffic, at most one is in
flight, and evaluations (the strategy's consensus at validation) cost no virtual time and no bytes in the
simulator; under ``hierarchy="node"`` a learner's gradient all-reduce inside its machine is part of its step. What
the simulator does not model: the CPU a background exchange takes from the compute on the same cores.

An exchange still in flight after the last step (started less than ``tau`` steps before the end) is waited for and
merged at the end (:meth:`StreamingSync.finish`), as the strategy does in ``on_train_end``.
"""

from __future__ import annotations

import simpy
from torch import Tensor

from lightning_dist.algorithms.averaging import accumulated_nbytes
from lightning_dist.algorithms.outer import OuterOptimizerFactory, OuterStep
from lightning_dist.algorithms.streaming import StreamingPlan, merge
from lightning_dist.sim.engine import Node
from lightning_dist.sim.protocols.base import Program, all_finite, checked_mean
from lightning_dist.sim.protocols.compressed import CompressedSync
from lightning_dist.sim.replica import Replica


class StreamingSync:
    """The fragments' exchanges of ``workers`` workers that start from the model vector ``start``.

    Args:
        plan: the :class:`~lightning_dist.algorithms.streaming.StreamingPlan` (period, fragments, tau, alpha).
        start: the common start model vector (parameters, then buffers).
        num_parameters: how many of ``start``'s entries are parameters.
        workers: the workers, all of which take part in every exchange.
        outer_optimizer: DiLoCo's outer optimizer factory, or None (plain averaging).
        codec: None, ``"bf16"`` or ``"int8"``.
    """

    def __init__(self, plan: StreamingPlan, start: Tensor, num_parameters: int, workers: int,
                 outer_optimizer: OuterOptimizerFactory | None = None,
                 codec: str | None = None) -> None:
        self.plan = plan
        self.workers = list(range(workers))
        self.bounds = plan.fragment_bounds(start.numel())
        # The parameters of each fragment: [start, min(stop, num_parameters)), empty for one of buffers only.
        parameters = [max(0, min(stop, num_parameters) - begin) for begin, stop in self.bounds]
        self.outers = [None if outer_optimizer is None or count == 0 else
                       OuterStep(start[begin:begin + count], outer_optimizer)
                       for (begin, _), count in zip(self.bounds, parameters)]
        self.compressed = (None if codec is None else
                           [CompressedSync(codec, start[begin:stop], count, workers)
                            for (begin, stop), count in zip(self.bounds, parameters)])
        self.nbytes = [accumulated_nbytes(stop - begin, start.dtype) for begin, stop in self.bounds]
        if self.compressed is not None:
            self.nbytes = [compressed.nbytes for compressed in self.compressed]
        self._in_flight: dict[int, tuple[int, simpy.Process]] = {}
        """Each worker's exchange in flight: its fragment and the background process that returns ``theta_p``."""

    def after_step(self, node: Node, rank: int, step: int, replica: Replica) -> Program:
        """Worker ``rank`` after optimizer step ``step``: start the exchange due (in the background), then merge the
        one due, waiting for what is left of it."""
        started = self.plan.started_after(step)
        if started is not None:
            if rank in self._in_flight:
                raise RuntimeError(f"worker {rank}: fragment {self._in_flight[rank][0]}'s exchange is still in flight "
                                   f"when fragment {started}'s starts after step {step}")
            begin, stop = self.bounds[started]
            snapshot = replica.vector.get_range(begin, stop)
            process = node.simulator.spawn(
                rank, lambda exchanging: self._exchange(exchanging, started, step, snapshot))
            self._in_flight[rank] = (started, process)
        merged = self.plan.merged_after(step)
        if merged is not None:
            if self._in_flight.get(rank, (None,))[0] != merged:
                raise RuntimeError(f"worker {rank}: fragment {merged} is due to merge after step {step}, but "
                                   f"{self._in_flight.get(rank, ('nothing',))[0]} is in flight")
            yield from self._merge(rank, replica)

    def finish(self, node: Node, rank: int, replica: Replica) -> Program:
        """Worker ``rank`` after its last step: the exchange still in flight, if any, waited for and merged."""
        if rank in self._in_flight:
            yield from self._merge(rank, replica)

    def _merge(self, rank: int, replica: Replica) -> Program:
        """Algorithm 1's mix of worker ``rank``'s exchange in flight into its replica, once the exchange is done."""
        fragment, process = self._in_flight.pop(rank)
        synchronized = yield process
        begin, stop = self.bounds[fragment]
        alpha = self.plan.alpha
        vector = replica.vector
        vector.set_range(begin, synchronized if alpha == 0 else merge(vector.get_range(begin, stop), synchronized,
                                                                      alpha))

    def _exchange(self, node: Node, fragment: int, step: int, snapshot: Tensor) -> Program:
        """The background exchange of ``fragment`` started after ``step``: the finiteness flags, then the (compressed)
        mean and the outer step; returns ``theta_p`` (one tensor for all workers)."""
        key = ("fragment", fragment, step)
        outer = self.outers[fragment]
        if self.compressed is not None:  # its synchronization checks the flags first
            return (yield from self.compressed[fragment].synchronize(node, key, self.workers, snapshot, outer))
        yield from all_finite(node, key, self.workers, snapshot, "to average them")
        combine = checked_mean if outer is None else lambda fragments: outer.step(checked_mean(fragments))
        return (yield from node.all_reduce(key, self.workers, snapshot, combine, nbytes=self.nbytes[fragment]))

    def metrics(self) -> dict[str, float]:
        """DiLoCo's counters as the strategy reports them: the fragments' outer steps in all, and the norms of each
        fragment's last step combined as one model's (empty for plain averaging). With one fragment, blocking
        DiLoCo's."""
        outers = [outer for outer in self.outers if outer is not None]
        if not outers:
            return {}
        return {
            "outer/steps": float(sum(outer.steps for outer in outers)),
            "outer/pseudo_gradient_norm": float(sum(float(outer.pseudo_gradient_norm) ** 2 for outer in outers) ** 0.5),
            "outer/update_norm": float(sum(float(outer.update_norm) ** 2 for outer in outers) ** 0.5),
        }
