"""Streaming synchronization across ranks: :mod:`lightning_dist.algorithms.streaming`'s plan over communicators.

Every ``H / P`` steps one fragment of the model (``[start, stop)`` of the model vector) is synchronized. After
step ``t - tau`` each rank copies its fragment (one fragment of extra memory: the model is never flattened,
:meth:`~lightning_dist.model_vector.ModelVector.get_range`) and the mean of the copies starts on a process
group of its own, in a thread, while training goes on; after step ``t`` the training thread waits for it (by
then, on a fast enough link, it is done), steps the fragment's outer optimizer (DiLoCo) and mixes the result
into the replica with ``alpha``. With ``tau = 0`` the exchange runs in the training thread on the strategy's
own groups, the blocking synchronization, fragment by fragment.

Why a thread and a second group: the exchange is several collectives (a finiteness check, an all-reduce or
compressed transfers, under a hierarchy a gather inside the node), and Lightning and the strategy issue their
own collectives meanwhile (validation's consensus, counters); a group of its own keeps the two sequences from
pairing with each other's, and a thread lets the collectives wait for each other without holding up training.
On CUDA the thread issues its work on a stream of its own (as torchft's DiLoCo does), so the training stream
never waits on it. Bytes counted by the thread's communicators are folded into the strategy's counters by the
training thread when it collects the exchange.

State: per fragment, DiLoCo's :class:`~lightning_dist.algorithms.outer.OuterStep` (the fragment's reference and
the optimizer's state, on ``state_device``: ``"cpu"`` keeps them in host memory, as torchft keeps its backup)
and the compressed exchange's state (a
:class:`~lightning_dist.strategies._fragment_exchange.FragmentExchange`'s :class:`CompressedAverage`: its common model is the fragment's last
synchronized model, and the error-feedback residuals; on ``state_device`` too, brought to the model's device for
the fragment's exchange); one exchange in flight at a time.

A ``fit`` that ends between an exchange's start and its merge merges it then (:meth:`StreamingSync.merge_early`)
rather than lose it, and records which fragment's exchange, started after which step: a run resumed from a checkpoint
written after that ``fit`` passes the plan's merge step of that exchange without merging again (the early merge was
the merge: one outer step, one synchronization counted) and goes on with the plan's schedule.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_dist.algorithms.averaging import all_finite
from lightning_dist.algorithms.outer import OuterOptimizerFactory, OuterStep
from lightning_dist.algorithms.streaming import StreamingPlan, merge
from lightning_dist.model_vector import ModelVector
from lightning_dist.strategies._fragment_exchange import FragmentExchange, Lanes, exchanges


class _InFlight:
    """One fragment's exchange: started after ``started_at``, its mean (the same on every rank) once collected."""

    def __init__(self, fragment: int, started_at: int) -> None:
        self.fragment = fragment
        self.started_at = started_at
        self.mean: Tensor | None = None
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None


class StreamingSync:
    """One rank's side of streaming synchronization (see the module docstring).

    Args:
        plan: fragments, delay, alpha.
        vector: the model's vector view (read and written a fragment at a time).
        foreground: the strategy's communicators (exchanges with ``tau = 0``, in the training thread).
        background: communicators of this object's own, for exchanges in flight while training goes on
            (None when ``tau = 0``).
        codec: the ``compression`` codec or None.
        outer_optimizer: DiLoCo's outer optimizer factory or None (plain averaging).
        state_device: where the outer steps' and the compressed exchanges' state lives between a fragment's
            exchanges (None: the model's device).
        raise_for_ranks: the strategy's error for non-finite replicas (names the ranks and the step their copies
            were taken after).
    """

    def __init__(self, plan: StreamingPlan, vector: ModelVector, foreground: Lanes, background: Lanes | None,
                 codec: str | None, outer_optimizer: OuterOptimizerFactory | None, state_device: torch.device | None,
                 raise_for_ranks: Callable[[list[int], int], None]) -> None:
        self.plan = plan
        self.vector = vector
        self.foreground = foreground
        self.background = background
        self.codec = codec
        self.raise_for_ranks = raise_for_ranks
        self.bounds = plan.fragment_bounds(vector.numel)
        self.device = vector.parameters[0].device
        self.state_device = state_device or self.device
        self.fragments = exchanges(self.bounds, vector.num_parameters, foreground.hierarchy, codec, self.device,
                                   self.state_device)
        self.outer = [self._outer_step(outer_optimizer, fragment) for fragment in self.fragments]
        if codec is not None:  # each fragment's compressed deltas are taken from the model every replica starts with
            for fragment in self.fragments:
                fragment.hold(vector.get_range(fragment.start, fragment.stop))
        self.in_flight: _InFlight | None = None
        self.merged_early: tuple[int, int] | None = None
        """The exchange merged at the end of ``fit`` before its merge step, ``(fragment, step it started after)``,
        until the plan reaches that step."""
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" and background is not None else None

    def _outer_step(self, factory: OuterOptimizerFactory | None, fragment: FragmentExchange) -> OuterStep | None:
        if factory is None or fragment.num_parameters == 0:
            return None
        start = fragment.start
        return OuterStep(self.vector.get_range(start, start + fragment.num_parameters).to(self.state_device), factory)

    # ------------------------------------------------------------ the schedule

    def after_step(self, step: int) -> bool:
        """Start and merge what the plan says after optimizer ``step``; True when a fragment was merged (False at
        the merge step of an exchange :meth:`merge_early` merged: it is not merged, stepped or counted twice)."""
        started = self.plan.started_after(step)
        if started is not None:
            self.start(started, step)
        merged = self.plan.merged_after(step)
        if merged is None:
            return False
        if self.in_flight is None and self.merged_early == (merged, step - self.plan.delay):
            self.merged_early = None
            return False
        if self.in_flight is None or self.in_flight.fragment != merged:
            flying = "nothing" if self.in_flight is None else self.in_flight.fragment
            early = "" if self.merged_early is None else (
                f" (fragment {self.merged_early[0]}'s exchange, started after step {self.merged_early[1]}, was merged "
                "when fit ended)")
            raise RuntimeError(f"streaming synchronization: fragment {merged} is due to merge after step {step}, but "
                               f"{flying} is in flight{early}")
        self.merge_in_flight()
        return True

    def start(self, fragment: int, step: int) -> None:
        """Copy this rank's fragment and start its exchange (in the background when ``tau > 0``)."""
        if self.in_flight is not None:
            raise RuntimeError(f"streaming synchronization: fragment {self.in_flight.fragment}'s exchange is still in "
                               f"flight when fragment {fragment}'s starts")
        start, stop = self.bounds[fragment]
        snapshot = self.vector.get_range(start, stop)
        job = self.in_flight = _InFlight(fragment, step)
        if self.background is None:
            job.mean = self.exchange(fragment, step, snapshot, self.foreground)
            return
        lanes = self.background
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

        def run() -> None:
            try:
                if self.stream is None:
                    job.mean = self.exchange(fragment, step, snapshot, lanes)
                else:
                    with torch.cuda.stream(self.stream):
                        job.mean = self.exchange(fragment, step, snapshot, lanes)
                    self.stream.synchronize()
            except BaseException as error:  # re-raised in the training thread when it collects the exchange
                job.error = error

        # A daemon: a thread blocked in a collective of a failed job must not keep the process alive at exit.
        job.thread = threading.Thread(target=run, name=f"lightning_dist-streaming-fragment-{fragment}", daemon=True)
        job.thread.start()

    def collect(self) -> _InFlight | None:
        """Wait for the exchange in flight (if any) to finish; its counters folded in; raises what it raised."""
        job = self.in_flight
        if job is None:
            return None
        if job.thread is not None:
            job.thread.join()
            job.thread = None
            assert self.background is not None
            self.foreground.world.stats.absorb(self.background.world.stats)
        if job.error is not None:
            self.in_flight = None
            raise job.error
        return job

    def merge_in_flight(self) -> None:
        """Algorithm 1's merge of the exchange in flight: outer step (DiLoCo), then the mix into the replica."""
        job = self.collect()
        assert job is not None and job.mean is not None
        fragment, mean = job.fragment, job.mean
        self.in_flight = None
        outer = self.outer[fragment]
        synchronized = mean if outer is None else outer.step(mean.to(self.state_device)).to(self.device)
        start, stop = self.bounds[fragment]
        alpha = self.plan.alpha
        self.vector.set_range(start, synchronized if alpha == 0 else merge(self.vector.get_range(start, stop),
                                                                             synchronized, alpha))
        self.fragments[fragment].hold(synchronized)  # compression's next deltas of this fragment are taken from it

    def merge_early(self) -> bool:
        """``fit`` ends before the exchange in flight (if any) is due: merge it now rather than lose it, and record
        it (:attr:`merged_early`) so that a run resumed after this one passes its merge step; True when a fragment
        was merged."""
        job = self.in_flight
        if job is None:
            return False
        self.merge_in_flight()
        self.merged_early = (job.fragment, job.started_at)
        return True

    # ------------------------------------------------------------ one exchange

    def exchange(self, fragment: int, step: int, snapshot: Tensor, lanes: Lanes) -> Tensor:
        """The mean of every learner's ``snapshot`` of ``fragment``, the same on every rank (all collectives on
        ``lanes``); refuses non-finite replicas by rank before anything is averaged."""
        flag = torch.tensor([all_finite(snapshot)], dtype=torch.uint8, device=snapshot.device)
        flags = lanes.world.all_gather(flag, "protocol").view(-1).tolist()
        # The step the copies were taken after: training has moved on by the time a background exchange checks them.
        self.raise_for_ranks([rank for rank, finite in enumerate(flags) if not finite], step)
        return self.fragments[fragment].mean(lanes, snapshot, "protocol")  # ``snapshot`` is this exchange's own copy

    def metrics(self) -> dict[str, float]:
        """DiLoCo's counters over the fragments: outer steps taken, and the norms of each fragment's last step
        combined as one model's (empty for plain averaging)."""
        steps = [outer for outer in self.outer if outer is not None]
        if not steps:
            return {}
        return {
            "outer/steps": float(sum(outer.steps for outer in steps)),
            "outer/pseudo_gradient_norm": float(sum(float(outer.pseudo_gradient_norm) ** 2 for outer in steps) ** 0.5),
            "outer/update_norm": float(sum(float(outer.update_norm) ** 2 for outer in steps) ** 0.5),
        }

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Shared state (the same on every rank): the plan, each fragment's outer state, the exchange in flight
        with its mean (collected first: call :meth:`collect` on every rank before a checkpoint), the exchange
        merged early (:attr:`merged_early`)."""
        job, early = self.in_flight, self.merged_early
        return {
            "plan": {"period": self.plan.period, "fragments": self.plan.fragments, "delay": self.plan.delay,
                     "alpha": self.plan.alpha},
            "outer": [None if outer is None else outer.state_dict() for outer in self.outer],
            "in_flight": None if job is None else {"fragment": job.fragment, "started_at": job.started_at,
                                                   "mean": job.mean.detach().cpu()},
            "merged_early": None if early is None else {"fragment": early[0], "started_at": early[1]},
        }

    def load_state_dict(self, state: Mapping[str, Any], strategy: str) -> None:
        saved = dict(state["plan"])
        now = {"period": self.plan.period, "fragments": self.plan.fragments, "delay": self.plan.delay,
               "alpha": self.plan.alpha}
        if saved != now:
            raise ValueError(f"the checkpoint was written by {strategy} with streaming {saved} and is resumed with "
                             f"{now}; resume with the period, fragments, fragment_sync_delay and fragment_update_alpha "
                             "that wrote it")
        for outer, outer_state in zip(self.outer, state["outer"]):
            if (outer is None) != (outer_state is None):
                raise ValueError(f"the checkpoint was written by {strategy} with the outer_optimizer set differently; "
                                 "resume with the outer_optimizer setting that wrote it")
            if outer is not None:
                outer.load_state_dict(outer_state)
        job = state["in_flight"]
        self.in_flight = None
        if job is not None:
            self.in_flight = _InFlight(job["fragment"], job["started_at"])
            self.in_flight.mean = job["mean"].to(self.device)
        early = state.get("merged_early")  # absent from checkpoints written before it was recorded: none
        self.merged_early = None if early is None else (early["fragment"], early["started_at"])

    def worker_state_dict(self) -> dict[str, Any]:
        """This rank's compressed exchanges' state, fragment by fragment (empty without compression)."""
        if self.codec is None:
            return {}
        return {"compressed": [fragment.state_dict() for fragment in self.fragments]}

    def load_worker_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`worker_state_dict`; an empty state (another layout) restarts every fragment's compressed
        exchange from the fragment the replica now holds (the checkpoint's consensus), residuals at zero."""
        if self.codec is None:
            return
        saved = state.get("compressed")
        for index, fragment in enumerate(self.fragments):
            if saved is not None:
                fragment.load_state_dict(saved[index])
            else:
                fragment.restart(self.vector.get_range(fragment.start, fragment.stop))

    def close(self) -> None:
        if self.background is not None:
            self.background.close()
