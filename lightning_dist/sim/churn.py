"""Workers that leave and join during a simulated run (issue 18; paper 002, section 4.2).

A :class:`Churn` says when each worker is away. It is either explicit, absences in virtual
seconds per worker::

    Churn(absences={3: [(2.0, 5.0)], 7: [(0.0, 4.0)], 9: [(1.5, None)]})
    # worker 3 leaves at 2 s and rejoins at 5 s; worker 7 is away from the start and joins at 4 s;
    # worker 9 leaves at 1.5 s for good

or random with a rate, seeded::

    Churn(fraction=0.3, leave_rate=0.05, mean_absence=10.0, seed=1)
    # round(0.3 * workers) workers, drawn with the seed, churn: each, while present, leaves after an
    # exponential time of mean 1 / leave_rate = 20 s, stays away an exponential time of mean 10 s and
    # rejoins; the others never leave

What leaving and joining mean (the same for every protocol, enforced by
:class:`~lightning_dist.sim.simulation.Simulation`): at its leave time a worker stops computing and
sending. The step it was taking is lost (so churn needs a modelled ``SpeedModel.step_seconds``: a
measured step has already run when its interval starts), its transfers not yet sent are
cancelled and one on the wire stops (:meth:`~lightning_dist.sim.network.Network.drop`), messages
that reach it while it is away are lost, and it leaves the collectives not yet started. A worker
that has taken its last step stays (it no longer churns), so its model stays in the average.
At its join time the protocol brings it back (:meth:`~lightning_dist.sim.protocols.Protocol.join`:
which model it starts from and at which step) and it trains on with a fresh optimizer state (the
state it left with belongs to a model it no longer holds) and its own part of the data.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from lightning_dist.algorithms.arguments import check_count, check_number

Absence = tuple[float, Optional[float]]
"""``(leave, join)`` in virtual seconds; ``join`` None: the worker does not come back."""


@dataclass(frozen=True)
class Churn:
    """When workers leave and join; explicit ``absences`` or random (``fraction``, ``leave_rate``, ``mean_absence``).

    Args:
        absences: ``{worker: [(leave, join), ...]}``, virtual seconds, in time order, not overlapping:
            ``0 <= leave < join``, each leave after the previous join; ``join`` None (last only) for
            a worker that does not come back; ``leave = 0`` for a worker away from the start.
        fraction: share of the workers that churn, in [0, 1]; ``round(fraction * workers)`` of them,
            drawn with ``seed``. Exclusive with ``absences``.
        leave_rate: leaves per virtual second of presence of a churning worker, > 0 (exponential
            times between). Needed with ``fraction``.
        mean_absence: mean virtual seconds a churning worker stays away (exponential), > 0; None: it
            never comes back.
        seed: seeds who churns and when (each worker its own generator, so adding workers keeps the
            others' times).
    """

    absences: Optional[Mapping[int, Sequence[Sequence[Optional[float]]]]] = None
    fraction: Optional[float] = None
    leave_rate: Optional[float] = None
    mean_absence: Optional[float] = None
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.absences is None) == (self.fraction is None):
            raise ValueError(
                "churn needs either absences ({worker: [(leave, join), ...]}) or fraction with leave_rate "
                f"(random churn), not both or neither; got absences={self.absences!r}, fraction={self.fraction!r}"
            )
        object.__setattr__(self, "seed", check_count("churn.seed", self.seed, 0))
        if self.absences is not None:
            if self.leave_rate is not None or self.mean_absence is not None:
                raise ValueError("churn.leave_rate and churn.mean_absence belong to random churn (fraction); "
                                 "explicit absences take neither")
            object.__setattr__(self, "absences", self._checked_absences(self.absences))
            return
        fraction = self.fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
            raise ValueError(f"churn.fraction must lie in [0, 1] (share of the workers that churn); got {fraction!r}")
        object.__setattr__(self, "fraction", float(fraction))
        if self.leave_rate is None:
            raise ValueError("churn.leave_rate must be given with churn.fraction: a finite number > 0 "
                             "(leaves per virtual second of presence)")
        object.__setattr__(self, "leave_rate", check_number("churn.leave_rate", self.leave_rate, 0, strict=True))
        if self.mean_absence is not None:
            mean_absence = check_number("churn.mean_absence", self.mean_absence, 0, strict=True)
            object.__setattr__(self, "mean_absence", mean_absence)

    @staticmethod
    def _checked_absences(absences: object) -> dict[int, list[Absence]]:
        if not isinstance(absences, Mapping):
            raise ValueError(f"churn.absences must map a worker to a list of (leave, join) pairs; got {absences!r}")
        checked: dict[int, list[Absence]] = {}
        for worker, pairs in absences.items():
            if isinstance(worker, bool) or not isinstance(worker, int) or worker < 0:
                raise ValueError(f"churn.absences keys must be worker indices, integers >= 0; got {worker!r}")
            name = f"churn.absences[{worker}]"
            if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Sequence):
                raise ValueError(f"{name} must be a list of (leave, join) pairs; got {pairs!r}")
            previous = 0.0
            checked[worker] = []
            for index, pair in enumerate(pairs):
                item = f"{name}[{index}]"
                if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
                    raise ValueError(f"{item} must be a (leave, join) pair of virtual seconds; got {pair!r}")
                if checked[worker] and checked[worker][-1][1] is None:
                    raise ValueError(f"{name}: only the last absence may have join None (never back); got {pairs!r}")
                leave = check_number(f"{item} leave", pair[0], previous, strict=index > 0)
                join = None if pair[1] is None else check_number(f"{item} join", pair[1], leave, strict=True)
                checked[worker].append((leave, join))
                previous = leave if join is None else join
        return checked

    def check(self, num_workers: int) -> None:
        """Raise a ValueError naming the worker when ``absences`` names one outside ``[0, num_workers - 1]``."""
        for worker in self.absences or {}:
            if worker >= num_workers:
                raise ValueError(
                    f"churn.absences names worker {worker}; workers are in [0, {num_workers - 1}]"
                )

    def churning(self, num_workers: int) -> list[int]:
        """The workers that churn, ascending."""
        if self.absences is not None:
            return sorted(worker for worker, pairs in self.absences.items() if pairs)
        count = round(self.fraction * num_workers)
        return sorted(np.random.default_rng(self.seed).permutation(num_workers)[:count].tolist())

    def absent_at_start(self, num_workers: int) -> list[int]:
        """Workers away at virtual time 0 (they join later), ascending."""
        return [worker for worker in self.churning(num_workers) if next(self.intervals(worker, num_workers))[0] == 0]

    def intervals(self, worker: int, num_workers: int) -> Iterator[Absence]:
        """Worker ``worker``'s absences in time order; endless for a random churner that always comes back."""
        if self.absences is not None:
            yield from self.absences.get(worker, [])
            return
        if worker not in self.churning(num_workers):
            return
        generator = np.random.default_rng([self.seed, 1, worker])
        now = 0.0
        while True:
            leave = now + generator.exponential(1 / self.leave_rate)
            if self.mean_absence is None:
                yield leave, None
                return
            now = leave + generator.exponential(self.mean_absence)
            yield leave, now

    def config(self) -> dict[str, Any]:
        """The schedule as written in a config."""
        if self.absences is not None:
            return {"absences": {worker: [list(pair) for pair in pairs] for worker, pairs in self.absences.items()},
                    "seed": self.seed}
        return {"fraction": self.fraction, "leave_rate": self.leave_rate, "mean_absence": self.mean_absence,
                "seed": self.seed}
