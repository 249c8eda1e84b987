"""What the simulator's dynamic-averaging workers measure while ``Delta`` is still to be measured.

With ``divergence_threshold=None``, :class:`~lightning_dist.sim.protocols.dynamic.DynamicAveraging` measures
``Delta`` as :class:`~lightning_dist.strategies.DynamicAveragingStrategy` does, in virtual seconds where the
strategy uses wall seconds. Each worker notes the virtual time of its first step and, with ``sync_overhead``
set, its ``||f_i - r||^2`` at every check before ``calibration_steps`` (no message). Its calibration report is
its drift, and with ``sync_overhead`` set also those earlier drifts (first) and its mean step time (last), 8
bytes each on the wire. From every worker's report and the calibration synchronisation's time,
:meth:`Calibration.measure` computes ``Delta`` and the period whose drift it is
(:func:`~lightning_dist.algorithms.averaging.measured_threshold`; with ``sync_overhead=None``,
:func:`~lightning_dist.algorithms.averaging.calibrated_threshold` of the drifts after ``calibration_steps``).
A worker that joined during the calibration has no drift at the checks before it joined (NaN in its
report); ``Delta`` is the mean over the workers that do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from lightning_dist.algorithms.averaging import calibrated_threshold, measured_threshold


class Calibration:
    """Every worker's notes while ``Delta`` is to be measured (``check_every``, ``calibration_steps`` and
    ``sync_overhead`` as :class:`~lightning_dist.sim.protocols.dynamic.DynamicAveraging` takes them)."""

    def __init__(self, check_every: int, calibration_steps: int, sync_overhead: float | None, workers: int) -> None:
        self.check_every, self.calibration_steps, self.sync_overhead = check_every, calibration_steps, sync_overhead
        self.periods = list(range(check_every, calibration_steps + 1, check_every))
        self._drifts: list[dict[int, float]] = [{} for _ in range(workers)]  # step -> drift at each noted check
        self._clocks: list[tuple[int, float] | None] = [None] * workers  # (step, virtual time) of the first step

    @property
    def timed(self) -> bool:
        """Whether the period is chosen from the timings (``sync_overhead`` set)."""
        return self.sync_overhead is not None

    def note(self, rank: int, step: int, now: float, drift: Callable[[], float]) -> None:
        """After worker ``rank``'s ``step`` at virtual time ``now``: its first step's time, and its drift (computed
        only when noted) at a check before ``calibration_steps``."""
        if self._clocks[rank] is None:
            self._clocks[rank] = (step, now)
        if self.timed and step % self.check_every == 0 and step < self.calibration_steps:
            self._drifts[rank][step] = drift()

    def restart(self, rank: int) -> None:
        """Worker ``rank`` joined: its calibration starts from the model it joins with."""
        self._drifts[rank], self._clocks[rank] = {}, None

    def report(self, rank: int, step: int, now: float, drift: float) -> tuple[float, ...]:
        """What worker ``rank`` shares at its calibration check (``step``, at virtual time ``now``), ``drift`` its
        ``||f_i - r||^2`` there (the last period's column, whatever its step)."""
        if not self.timed:
            return (drift,)
        first_step, started = self._clocks[rank] or (step, math.nan)
        step_seconds = (now - started) / (step - first_step) if step > first_step else math.nan
        noted = self._drifts[rank]
        return (*(noted.get(check, math.nan) for check in self.periods[:-1]), drift, step_seconds)

    def measure(self, reports: Sequence[Sequence[float]], sync_seconds: Sequence[float]) -> tuple[float, int]:
        """``(Delta, period)`` from the workers' reports and how long the calibration's synchronisation took them."""
        if not self.timed:
            return calibrated_threshold([report[0] for report in reports], self.calibration_steps), self.calibration_steps
        return measured_threshold(
            [report[:-1] for report in reports], self.periods, [report[-1] for report in reports], sync_seconds,
            self.sync_overhead,
        )
