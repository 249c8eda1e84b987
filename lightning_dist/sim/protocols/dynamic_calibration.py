"""How the simulator's dynamic-averaging workers choose the period whose drift becomes ``Delta``.

With ``divergence_threshold=None`` and ``sync_overhead`` set,
:class:`~lightning_dist.sim.protocols.dynamic.DynamicAveraging` chooses the period as
:class:`~lightning_dist.strategies.DynamicAveragingStrategy` does, in virtual seconds where the strategy uses
wall seconds. After its first step a worker times two probes, of 8 bytes and of
:func:`~lightning_dist.algorithms.averaging.sync_probe_bytes` of a full synchronisation's bytes, each the way that topology synchronises: ``topology="strategy"``, ring
all-reduces among all workers (after an untimed 8-byte one that lines them up); with the coordinator, the
probe goes to the coordinator and comes back (a synchronisation's upload and download). At its first check it
takes :func:`~lightning_dist.algorithms.averaging.probed_period` of the probe times and its mean step time
since probing. ``topology="strategy"``: every worker first all-gathers its three times (24 bytes), so all take
the same period, as the strategy's ranks do. With the coordinator each worker takes its own (they report at
their own calibration checks, and the coordinator waits for every report anyway); ``calibration_period`` is the
longest taken. With ``sync_overhead=None`` the period is ``calibration_steps``, with no probe.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from typing import Any

import simpy

from lightning_dist.algorithms.averaging import calibration_periods, probed_period, sync_probe_bytes
from lightning_dist.sim.engine import Node

PROBE = "probe"  # worker -> coordinator -> worker: a probe, sent back as it came
_FLOAT_BYTES = 8


class Calibration:
    """Every worker's probe times, clock and period while ``Delta`` is to be measured (``check_every``,
    ``calibration_steps`` and ``sync_overhead`` as :class:`~lightning_dist.sim.protocols.dynamic.DynamicAveraging`
    takes them; ``model_bytes``: a full synchronisation's bytes)."""

    def __init__(
        self, check_every: int, calibration_steps: int, sync_overhead: float | None, workers: int, model_bytes: int
    ) -> None:
        self.check_every, self.calibration_steps, self.sync_overhead = check_every, calibration_steps, sync_overhead
        self.probe_bytes = sync_probe_bytes(model_bytes)
        self.parts = model_bytes / self.probe_bytes
        self.periods = calibration_periods(check_every, calibration_steps)
        untimed = calibration_steps if sync_overhead is None else None
        self._periods: list[int | None] = [untimed] * workers
        self._probes = [(math.nan, math.nan)] * workers
        self._clocks: list[tuple[int, float] | None] = [None] * workers  # (step, virtual time) after probing

    @property
    def period(self) -> int | None:
        """The period Delta is the drift of: the longest any worker took (None until one has)."""
        taken = [period for period in self._periods if period is not None]
        return max(taken) if taken else None

    def restart(self, rank: int) -> None:
        """Worker ``rank`` joined without ``Delta``: it probes and chooses again."""
        self._periods[rank] = self.calibration_steps if self.sync_overhead is None else None
        self._clocks[rank] = None

    def trains_alone(self, rank: int, step: int) -> bool:
        """Whether worker ``rank`` at ``step`` is before its calibration check (or has no period yet)."""
        period = self._periods[rank]
        return period is None or step < period

    def step(self, node: Node, rank: int, step: int, workers: list[int], server: int | None) -> Generator[Any, Any, None]:
        """After worker ``rank``'s ``step``: probe after its first one, choose the period at its first check.
        ``server``: the coordinator's node, or None for ``topology="strategy"`` (``workers``: all workers)."""
        if self._clocks[rank] is None:
            if self._periods[rank] is None:
                self._probes[rank] = yield from self._probe(node, workers, server)
            self._clocks[rank] = (step, node.now)
        if step % self.check_every or self._periods[rank] is not None:
            return
        first_step, started = self._clocks[rank]
        step_seconds = (node.now - started) / (step - first_step) if step > first_step else math.nan
        rows = [(*self._probes[rank], step_seconds)]
        if server is None:
            rows = yield from node.all_gather(("calibration", step), workers, rows[0], nbytes=3 * _FLOAT_BYTES)
        latency, probe, steps = ([row[column] for row in rows] for column in range(3))
        assert self.sync_overhead is not None
        self._periods[rank] = probed_period(self.periods, steps, latency, probe, self.sync_overhead, self.parts)

    def _probe(self, node: Node, workers: list[int], server: int | None) -> Generator[Any, Any, tuple[float, float]]:
        times = []
        if server is None:
            yield from node.all_reduce(("probe", 0), workers, 0.0, sum, nbytes=_FLOAT_BYTES)
        for index, nbytes in enumerate((_FLOAT_BYTES, self.probe_bytes), start=1):
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
