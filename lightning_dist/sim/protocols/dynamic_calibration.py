"""How the simulator's dynamic-averaging workers choose the period whose drift becomes ``Delta``.

With ``divergence_threshold=None`` and ``sync_overhead`` set,
:class:`~lightning_dist.sim.protocols.dynamic.DynamicAveraging` chooses the period as
:class:`~lightning_dist.strategies.DynamicAveragingStrategy` does, in virtual seconds where the strategy uses
wall seconds. After its first step a worker times two probes, of 8 bytes and of
:func:`~lightning_dist.algorithms.averaging.sync_probe`'s share of a full synchronisation, each the way that
topology synchronises: ``topology="strategy"``, ring all-reduces among all workers (after an untimed 8-byte one
that lines them up); with the coordinator, the probe goes to the coordinator and comes back (a synchronisation's
upload and download). Under a hierarchy (``ranks_per_learner = L > 1``, ``topology="strategy"``) each of a
learner's ``L`` ranks probes in its slice group as the strategy's do, all at once: the learner's probes carry ``L``
times a rank's (``8 L`` bytes, and ``L`` probes sized from the largest chunk, so ``parts`` is the strategy's). At
its first check after probing (one at which at least one step has been timed: with ``check_every=1`` the first
step is a check too) it takes :func:`~lightning_dist.algorithms.averaging.probed_period` of the probe times and
its mean step time since probing; its calibration check is the first check at or after both that period and the
check it chose at. ``topology="strategy"``: every worker first all-gathers its three times (24 bytes, ``24 L``
under a hierarchy: the rows of its ``L`` ranks), so all take the same period, as the strategy's ranks do. With
the coordinator each worker takes its own (they report at their own calibration checks, and the coordinator waits
for every report anyway); ``calibration_period`` is the longest taken. With ``sync_overhead=None`` the period is
``calibration_steps``, with no probe.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from typing import Any

import simpy

from lightning_dist.algorithms.averaging import calibration_periods, probed_period, sync_probe
from lightning_dist.sim.engine import Node

PROBE = "probe"  # worker -> coordinator -> worker: a probe, sent back as it came
_FLOAT_BYTES = 8


class Calibration:
    """Every worker's probe times, clock and period while ``Delta`` is to be measured (``check_every``,
    ``calibration_steps`` and ``sync_overhead`` as :class:`~lightning_dist.sim.protocols.dynamic.DynamicAveraging`
    takes them). The probe is :func:`~lightning_dist.algorithms.averaging.sync_probe` of the model's ``numel``
    entries of ``element_size`` bytes, ``sync_bytes`` and ``ranks_per_learner`` (module docstring)."""

    def __init__(
        self, check_every: int, calibration_steps: int, sync_overhead: float | None, workers: int, numel: int,
        element_size: int, sync_bytes: Callable[[int], int], ranks_per_learner: int = 1,
    ) -> None:
        self.check_every, self.calibration_steps, self.sync_overhead = check_every, calibration_steps, sync_overhead
        elements, self.parts = sync_probe(numel, ranks_per_learner, element_size, sync_bytes)
        self.probe_bytes = ranks_per_learner * elements * element_size
        self.small_bytes = ranks_per_learner * _FLOAT_BYTES
        self.times_bytes = ranks_per_learner * 3 * _FLOAT_BYTES
        self.periods = calibration_periods(check_every, calibration_steps)
        untimed = calibration_steps if sync_overhead is None else None
        self._periods: list[int | None] = [untimed] * workers
        self._checks: list[int | None] = [untimed] * workers  # the step of each worker's calibration check
        self._probes = [(math.nan, math.nan)] * workers
        self._clocks: list[tuple[int, float] | None] = [None] * workers  # (step, virtual time) after probing

    @property
    def period(self) -> int | None:
        """The period Delta is the drift of: the longest any worker took (None until one has)."""
        taken = [period for period in self._periods if period is not None]
        return max(taken) if taken else None

    @property
    def check_step(self) -> int | None:
        """The step of the calibration check, the first check counted: the latest any worker's (None until known)."""
        known = [check for check in self._checks if check is not None]
        return max(known) if known else None

    def restart(self, rank: int) -> None:
        """Worker ``rank`` joined without ``Delta``: it probes and chooses again."""
        self._periods[rank] = self._checks[rank] = self.calibration_steps if self.sync_overhead is None else None
        self._clocks[rank] = None

    def trains_alone(self, rank: int, step: int) -> bool:
        """Whether worker ``rank`` at ``step`` is before its calibration check (or has no period yet)."""
        check = self._checks[rank]
        return check is None or step < check

    def step(self, node: Node, rank: int, step: int, workers: list[int], server: int | None) -> Generator[Any, Any, None]:
        """After worker ``rank``'s ``step``: probe after its first one, choose the period at its first check after
        that. ``server``: the coordinator's node, or None for ``topology="strategy"`` (``workers``: all workers)."""
        clock = self._clocks[rank]
        if clock is None:
            if self._periods[rank] is None:
                self._probes[rank] = yield from self._probe(node, workers, server)
            clock = self._clocks[rank] = (step, node.now)
        if step % self.check_every or self._periods[rank] is not None or step == clock[0]:
            return
        first_step, started = clock
        rows = [(*self._probes[rank], (node.now - started) / (step - first_step))]
        if server is None:
            rows = yield from node.all_gather(("calibration", step), workers, rows[0], nbytes=self.times_bytes)
        latency, probe, steps = ([row[column] for row in rows] for column in range(3))
        assert self.sync_overhead is not None
        period = probed_period(self.periods, steps, latency, probe, self.sync_overhead, self.parts)
        self._periods[rank], self._checks[rank] = period, max(period, step)

    def _probe(self, node: Node, workers: list[int], server: int | None) -> Generator[Any, Any, tuple[float, float]]:
        times = []
        if server is None:
            yield from node.all_reduce(("probe", 0), workers, 0.0, sum, nbytes=self.small_bytes)
        for index, nbytes in enumerate((self.small_bytes, self.probe_bytes), start=1):
            started = node.now
            if server is None:
                yield from node.all_reduce(("probe", index), workers, 0.0, sum, nbytes=nbytes)
            else:
                node.send(server, nbytes, tag=PROBE, nbytes=nbytes)
                yield node.recv(source=server, tag=PROBE)
            times.append(node.now - started)
        return times[0], times[1]


def echo(node: Node, message: Any) -> simpy.Event:
    """The coordinator sends a worker's probe back as it came."""
    return node.send(message.source, message.payload, tag=PROBE, nbytes=message.payload)
