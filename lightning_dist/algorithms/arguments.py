"""Checks of the protocols' parameters, shared by the strategies and the simulator's protocols.

Each raises a ValueError that names the parameter, its meaning and the allowed range, so a bad
value fails the same way whether it reaches a Trainer or a simulation.
"""

from __future__ import annotations

import math


def check_steps(name: str, value: object, meaning: str) -> int:
    """An integer ``>= 1`` (a count of optimizer steps, segments, replicas, ...)."""
    # bool is an int subclass; True as a count is a bug, not a request for one.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 ({meaning}); got {value!r}")
    return value


def check_divergence_threshold(value: object) -> float:
    """Paper 004's ``Delta``: a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"divergence_threshold must be a finite number > 0 (squared L2 distance); got {value!r}")
    return float(value)


def check_client_fraction(value: object) -> float:
    """FedAvg's ``C``: a number in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and 0 < value <= 1):
        raise ValueError(f"client_fraction must lie in (0, 1]; got {value!r}")
    return float(value)


def check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False; got {value!r}")
    return value
