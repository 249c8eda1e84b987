"""Worker for the streaming-synchronization tests: several fits in one torchrun launch, records per rank.

Usage: torchrun --nproc_per_node=N streaming.py spec.json (see tests/helpers/launch.py). Spec keys: ``cases``,
run in order as separate ``Trainer.fit`` calls in the same processes, each ``{"name", "kwargs", "trainer",
"outer"?, "engine"?, "checkpoint_dir"?, "save_after_fit"?, "resume"?, "memory"?, "bucket"?}`` (``kwargs`` of
``PeriodicAveragingStrategy``; ``outer``: DiLoCo's Nesterov SGD, lr 0.7, momentum 0.9; ``save_after_fit``: the file
name, under ``out``, of a checkpoint written after ``fit``; ``resume``: a glob, relative to ``out``'s parent, of a
checkpoint an earlier case or launch wrote; ``memory``: record the allocator's peak of bytes allocated by the
protocol after every step; ``bucket``: ``AVERAGE_BUCKET`` for the case (averaging's and DiLoCo's outer step's));
``out``. Each case writes ``<out>/<name>/rank<r>.pt``: its error, or the start vector, this rank's vector before and
after the protocol at every step (and its peak), the final vector, the protocol state and the counters.
"""

import functools
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

import lightning_dist.algorithms.averaging as averaging
from lightning_dist import PeriodicAveragingStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for helpers
from helpers.cases import fit_digits, run_fits  # noqa: E402


def allocated_peak(kineto_results: Any) -> int:
    """The most bytes the allocator held at once for allocations made in a profiled window, from the profiler's
    memory events (each allocation's and each free's size, in time order)."""
    events = sorted((event.start_ns(), event.nbytes()) for event in kineto_results.events() if event.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


class RecordingPeriodic(PeriodicAveragingStrategy):
    """The strategy under test, recording this rank's vector around the protocol after every optimizer step."""

    records: list[dict[str, Any]]
    measure_memory = False

    def after_local_step(self, step: int) -> None:
        before = self.model_vector.get()
        peak = None
        if self.measure_memory:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
                super().after_local_step(step)
            peak = allocated_peak(prof.profiler.kineto_results)
        else:
            super().after_local_step(step)
        self.records.append({"step": step, "before": before, "after": self.model_vector.get(), "peak_bytes": peak})


DEFAULT_BUCKET = averaging.AVERAGE_BUCKET


def run_case(case: dict[str, Any], out: Path) -> dict[str, Any]:
    L.seed_everything(0, workers=True)
    kwargs = dict(case["kwargs"])
    if case.get("outer"):
        kwargs["outer_optimizer"] = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
    strategy = RecordingPeriodic(**kwargs)
    if case.get("engine"):  # the fragment engine for a plan that does not need it, to compare it with the blocking path
        strategy.streams = True
    strategy.records = []
    strategy.measure_memory = bool(case.get("memory"))
    averaging.AVERAGE_BUCKET = case.get("bucket", DEFAULT_BUCKET)
    ckpt_path = None
    if case.get("resume"):
        (ckpt_path,) = sorted(out.parent.glob(case["resume"]))
    return fit_digits(strategy, case, out, ckpt_path)


if __name__ == "__main__":
    run_fits(run_case)
