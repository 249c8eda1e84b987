"""The simulator-against-real-runs results table in ``docs/results/simulator-validation.md``, rendered from
``benchmarks/results/sim_validation.json`` (:mod:`benchmarks.common.tables`)."""

from __future__ import annotations


from benchmarks.common.tables import result
from benchmarks.sim_validation.run import table


def results_table() -> str:
    """Seconds per synchronization and protocol bytes, measured against simulated, per layout and method."""
    cells = result("sim_validation")["summary"]
    return table([{**cell, "label": cell["label"].replace("|", "\\|")} for cell in cells])
