"""Worker for the DiLoCo outer-optimizer tests: several fits in one torchrun launch, records per rank.

Usage: torchrun --nproc_per_node=N outer.py spec.json (see tests/helpers/launch.py). Spec keys:
``cases``, run in order as separate ``Trainer.fit`` calls in the same processes, each
``{"name", "strategy": "periodic" | "dynamic", "kwargs", "trainer", "checkpoint_dir"?, "resume"?}``
(``resume``: a glob, relative to ``out``, naming the checkpoint to resume from, written by an earlier
case); ``out``. Each case writes ``<out>/<name>/rank<r>.pt``: its error, or the start vector, the final
vector, the protocol state and, at every step where the protocol may sync, this rank's vector before
and after it (and the reference model before, for dynamic averaging).
"""

import sys
from pathlib import Path
from typing import Any

import lightning as L

from lightning_dist import DynamicAveragingStrategy, PeriodicAveragingStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for helpers
from helpers.cases import fit_digits, run_fits  # noqa: E402


class RecordingPeriodic(PeriodicAveragingStrategy):
    """The strategy under test, recording this rank's vector around every averaging step."""

    records: list[dict[str, Any]]

    def after_local_step(self, step: int) -> None:
        if step % self.period:
            super().after_local_step(step)
            return
        before = self.model_vector.get()
        super().after_local_step(step)
        self.records.append({"step": step, "before": before, "after": self.model_vector.get()})


class RecordingDynamic(DynamicAveragingStrategy):
    """The strategy under test, recording this rank's vector and the reference around every check."""

    records: list[dict[str, Any]]

    def after_local_step(self, step: int) -> None:
        if step % self.check_every:
            super().after_local_step(step)
            return
        before, reference = self.model_vector.get(), self.reference.clone()
        full, partial = self._full_syncs, self._partial_syncs
        super().after_local_step(step)
        kind = "full" if self._full_syncs > full else "partial" if self._partial_syncs > partial else "none"
        self.records.append({"step": step, "before": before, "reference": reference, "kind": kind,
                             "after": self.model_vector.get(), "reference_after": self.reference.clone()})


def run_case(case: dict[str, Any], out: Path) -> dict[str, Any]:
    L.seed_everything(0, workers=True)
    strategy_class = {"periodic": RecordingPeriodic, "dynamic": RecordingDynamic}[case["strategy"]]
    strategy = strategy_class(**case["kwargs"])
    strategy.records = []
    ckpt_path = None
    if case.get("resume"):
        (ckpt_path,) = sorted(out.glob(case["resume"]))
    return fit_digits(strategy, case, out, ckpt_path)


if __name__ == "__main__":
    run_fits(run_case)
