"""The fault-tolerance benchmarks' tables, rendered from ``benchmarks/results/ft_failure.json`` and
``ft_goodput.json`` into ``benchmarks/fault_tolerance/README.md`` and ``docs/launching.md``
(:mod:`benchmarks.common.tables`)."""

from __future__ import annotations

from benchmarks.common.tables import result
from benchmarks.fault_tolerance import failure
from benchmarks.fault_tolerance.goodput import fmt

GOODPUT_WAYS = {"no_failure": "no failure (option on)",
                "ft_kills": "the option, a group killed every 60 s and restarted",
                "torchrun_restart": "torchrun restart from `last.ckpt` under the same kills"}


def goodput_table() -> str:
    """Per way: time to the target and goodput seed by seed, the kills that fell in each run and how long the killed
    group took to be back in the run."""
    report = result("ft_goodput")
    rows = report["summary"]["rows"]
    seeds = " / ".join(str(seed) for seed in rows["no_failure"]["seeds"])
    lines = [f"| way | s to target, seeds {seeds} (mean) | goodput (each) | kills (each) "
             "| kill to back in the run, s |", "|---|---|---|---|---|"]
    for way, label in GOODPUT_WAYS.items():
        row = rows[way]
        each = lambda key, spec=".1f": " / ".join(fmt(value, spec) for value in row[key])  # noqa: E731
        lines.append(f"| {label} | {each('time_to_target_s_each')} ({fmt(row['time_to_target_s'])}) | "
                     f"{fmt(row['goodput'], '.2f')} ({each('goodput_each', '.2f')}) | "
                     f"{' / '.join(map(str, row['kills_each']))} | {fmt(row['back_after_kill_s'])} |")
    targets = " / ".join(f"{target:.3f}" for target in report["summary"]["target_val_loss"])
    lines += ["", f"Targets (each seed's no-failure loss at {report['target_at']:.0%} of its time): {targets}; "
              f"{len(report['commands'])} commands, {report['wall_s'] / 60:.0f} min: "
              + "; ".join(f"`{command}`" for command in report["commands"]) + "."]
    return "\n".join(lines)


def failure_table() -> str:
    """The failure benchmark's table as ``--replot`` prints it: each way's time to the target, what the kill cost and
    the returning group's timeline."""
    text = failure.table(result("ft_failure")["summary"])
    return text.replace("\nrestarted, each seed", "\n\nrestarted, each seed")  # the note after it is no table row
