"""The language model's results tables, rendered from ``benchmarks/results/lm_network.json`` into the README and
``docs/results`` (:mod:`benchmarks.common.tables`)."""

from __future__ import annotations

import json
import statistics
from typing import Any

from benchmarks.common.paths import RESULTS

README_MBIT = 20.0
README_METHODS = {
    "ddp": "DDP",
    "ddp_powersgd_r4": "DDP + PowerSGD rank 4 (the strongest DDP variant here)",
    "torchft_diloco": "torchft's DiLoCo, every 50 steps",
    "periodic_h50": "periodic averaging every 50 steps",
    "dynamic_default": "dynamic averaging, `strategy=\"dynamic_avg\"`",
    "periodic_h50_int8": "periodic every 50, `compression=\"int8\"`",
    "dynamic_default_int8": "dynamic averaging, `compression=\"int8\"`",
    "periodic_h50_stream_a0_int8": "streaming periodic every 50, 5 fragments, int8",
}
"""The README's rows: the baselines a Lightning user would pick, then the package's headline methods."""


def network_report() -> dict[str, Any]:
    return json.loads((RESULTS / "lm_network.json").read_text())


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def launch_dates(report: dict[str, Any], name: str, mbit: float) -> set[str]:
    """The days the runs of method ``name`` at ``mbit`` were launched ("undated" for runs from before the dates were
    recorded)."""
    return {run.get("date", "undated") for launch in report["launches"] if launch["node_mbit"] == mbit
            for run in launch.get("runs", []) if run["name"] == name}


def readme_table() -> str:
    """Seconds to the target at 20 Mbit/s seed by seed, their mean over the seeds that reached it, and the bytes on the
    wire by then, for :data:`README_METHODS`."""
    report = network_report()
    rows = {row["name"]: row for row in report["summary"]["rows"] if row["node_mbit"] == README_MBIT}
    lines = ["| method | s to target, seeds 0 / 1 / 2 | mean (seeds reaching) | wire MB to target |",
             "|---|---|---|---|"]
    for name, label in README_METHODS.items():
        row = rows[name]
        each = " / ".join(seconds(value) for value in row["time_to_target_s_each"])
        reached = [value for value in row["time_to_target_s_each"] if value is not None]
        mean = (f"{statistics.fmean(reached):.1f} ({len(reached)} of {len(row['seeds'])})" if reached
                else f"never in {report['config']['budget_s']:g} s (final loss {row['final_val_loss']:.2f})")
        wire = "-" if row["wire_bytes_to_target"] is None else f"{row['wire_bytes_to_target'] / 1e6:.0f}"
        lines.append(f"| {label} | {each} | {mean} | {wire} |")
    dates = sorted(set().union(*(launch_dates(report, name, README_MBIT) for name in README_METHODS)))
    lines.append("")
    lines.append(f"Target {report['summary']['target_val_loss']:.3f} nats/char ({report['summary']['target_rule']}); "
                 f"runs launched: {', '.join(dates)}.")
    return "\n".join(lines)
