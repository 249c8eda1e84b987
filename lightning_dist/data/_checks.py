"""Argument checks shared by the data modules, so every bad value gets the same kind of message."""

from __future__ import annotations

import math
from typing import Optional, TypeVar

import numpy as np

T = TypeVar("T")


def check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    """Return ``value`` as an int, or raise ValueError naming ``name`` and the allowed range."""
    # bool is an int subclass; True as a count is a bug, not a request for one.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer; got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        upper = "" if maximum is None else f" and <= {maximum}"
        raise ValueError(f"{name} must be >= {minimum}{upper}; got {value}")
    return int(value)


def check_positive_float(name: str, value: object) -> float:
    """Return ``value`` as a float, or raise ValueError unless it is a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a finite number > 0; got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0; got {value}")
    return float(value)


def require_setup(owner: object, dataset: Optional[T]) -> T:
    """``dataset``, or the error a datamodule raises when a loader is asked for before ``setup``."""
    if dataset is None:
        raise RuntimeError(f"{type(owner).__name__}.setup() must run before its dataloaders are requested")
    return dataset

