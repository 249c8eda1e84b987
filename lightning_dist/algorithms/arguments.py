"""Checks of the protocols' parameters, shared by the strategies and the simulator's protocols.

Each raises a ValueError that names the parameter, its meaning and the allowed range, so a bad
value fails the same way whether it reaches a Trainer or a simulation.
"""

from __future__ import annotations

import math


def check_count(name: str, value: object, minimum: int, maximum: int | None = None, meaning: str = "") -> int:
    """An integer in ``[minimum, maximum]`` (no upper bound when ``maximum`` is None).

    ``meaning`` is appended to the message as given, e.g. ``" (gossip needs a peer)"``.
    """
    # bool is an int subclass; True as a count is a bug, not a request for one.
    out_of_range = isinstance(value, int) and (value < minimum or (maximum is not None and value > maximum))
    if isinstance(value, bool) or not isinstance(value, int) or out_of_range:
        allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an integer {allowed}{meaning}; got {value!r}")
    return value


def check_steps(name: str, value: object, meaning: str) -> int:
    """An integer ``>= 1`` (a count of optimizer steps, segments, replicas, ...)."""
    return check_count(name, value, 1, meaning=f" ({meaning})")


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
