"""How far a resumed run's validation accuracy may lie from uninterrupted runs' and still count as noise."""

from __future__ import annotations

import math
from collections.abc import Sequence


def noise_band(uninterrupted: Sequence[float], examples: int) -> tuple[float, float]:
    """The uninterrupted runs' accuracies widened on both sides by their spread, or by two standard errors of an
    accuracy measured on ``examples`` validation examples where that is wider: the spread of two runs alone can
    be a few examples' worth."""
    mean = sum(uninterrupted) / len(uninterrupted)
    noise = max(max(uninterrupted) - min(uninterrupted), 2 * math.sqrt(mean * (1 - mean) / examples))
    return min(uninterrupted) - noise, max(uninterrupted) + noise
