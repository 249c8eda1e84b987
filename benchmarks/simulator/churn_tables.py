"""The churn study's results table, rendered from ``benchmarks/results/churn.json`` into ``docs/results/churn.md``
(:mod:`benchmarks.common.tables`)."""

from __future__ import annotations

from typing import Any

from benchmarks.common.tables import result

ROWS = {
    "periodic": "periodic averaging b=10",
    "dynamic_avg": "dynamic averaging Delta=0.5",
    "segmented_gossip": "segmented gossip S=10 R=2",
    "parameter_server": "parameter server, async, lr 0.0005",
    "ddp": "DDP",
}
"""The table's rows in order, with their labels."""
EVERY_TIME = {"segmented_gossip"}
"""Protocols whose times to target at the intermediate churn levels are shown too (the page discusses them)."""


def percent(fraction: float) -> str:
    """A churn level as the page writes it: ``10 %``."""
    return f"{100 * fraction:g} %"


def time_to_target(line: dict[str, Any], annotate: bool) -> str:
    """Mean seconds to the target over the seeds that reached it, with how many did when ``annotate``."""
    seconds = "-" if line["reached"] == 0 else f"{line['time_to_target_mean']:.2f}"
    return f"{seconds} ({line['reached']} of {line['seeds']})" if annotate else seconds


def churn_table() -> str:
    """Per protocol: accuracy at each churn level, time to target without churn and at the most churn, and worker-steps
    and bytes at the most churn against none."""
    report = result("churn")
    fractions = report["config"]["fractions"]
    most = fractions[-1]
    lines = {(line["protocol"], line["fraction"]): line for line in report["table"]}
    fewest_steps = min(lines[protocol, most]["steps_ratio"] for protocol in ROWS)
    levels = " / ".join(f"{100 * fraction:g}" for fraction in fractions[1:])
    rows = [f"| protocol | accuracy, no churn / {levels} % "
            f"| time to target (s), no churn / {percent(most)} | worker-steps at {percent(most)} |",
            "|---|---|---|---|"]
    for protocol, label in ROWS.items():
        mine = [lines[protocol, fraction] for fraction in fractions]
        scores = " / ".join(f"{line['score_mean']:.3f}" for line in mine)
        spread = f"sd {min(line['score_sd'] for line in mine):.3f}-{max(line['score_sd'] for line in mine):.3f}"
        annotate = any(line["reached"] < line["seeds"] for line in (mine[0], mine[-1]))
        times = f"{time_to_target(mine[0], annotate)} / {time_to_target(mine[-1], annotate)}"
        if protocol in EVERY_TIME:
            times += " (" + ", ".join(f"{percent(line['fraction'])}: {time_to_target(line, annotate)}"
                                      for line in mine[1:-1]) + ")"
        steps = f"{mine[-1]['steps_ratio']:.2f}x"
        if mine[-1]["steps_ratio"] == fewest_steps:
            steps = f"**{steps}**"
        rows.append(f"| {label} | {scores} ({spread}) | {times} | {steps} (bytes {mine[-1]['bytes_ratio']:.2f}x) |")
    rows.append("")
    rows.append(f"Times are means over the seeds that reached the target; rows from `benchmarks/results/churn.json` "
                f"({report['config']['date']}).")
    return "\n".join(rows)
