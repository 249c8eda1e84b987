"""The language model's results tables, rendered from ``benchmarks/results/lm_network.json`` into the README and
``docs/results/language-model.md`` (:mod:`benchmarks.common.tables`): the README's headline rows, the page's table of
the methods against DDP at every bandwidth, and its streaming comparison's tables at 20, 5 and 1000 Mbit/s."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.common.tables import result
from benchmarks.language_model.network import fmt_s, summarize, table

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


DATES_KEPT_SINCE = "2026-12-08"
"""The day the benchmark's runs began to record their launch date."""


def launch_dates(report: dict[str, Any], name: str, mbit: float) -> set[str]:
    """The days the runs of method ``name`` at ``mbit`` were launched ("undated" before :data:`DATES_KEPT_SINCE`:
    launches merged over each other before then are told apart only in git history)."""
    return {run.get("date", "undated") for launch in report["launches"] if launch["node_mbit"] == mbit
            for run in launch.get("runs", []) if run["name"] == name}


def readme_table() -> str:
    """Seconds to the target at 20 Mbit/s seed by seed, their mean over the seeds that reached it, and the bytes on the
    wire by then, for :data:`README_METHODS`."""
    report = result("lm_network")
    rows = {row["name"]: row for row in report["summary"]["rows"] if row["node_mbit"] == README_MBIT}
    lines = ["| method | s to target, seeds 0 / 1 / 2 | mean (seeds reaching) | wire MB to target |",
             "|---|---|---|---|"]
    for name, label in README_METHODS.items():
        row = rows[name]
        each = " / ".join(fmt_s(value) for value in row["time_to_target_s_each"])
        reached = [value for value in row["time_to_target_s_each"] if value is not None]
        mean = (f"{statistics.fmean(reached):.1f} ({len(reached)} of {len(row['seeds'])})" if reached
                else f"never in {report['config']['budget_s']:g} s (final loss {row['final_val_loss']:.2f})")
        wire = "-" if row["wire_bytes_to_target"] is None else f"{row['wire_bytes_to_target'] / 1e6:.0f}"
        lines.append(f"| {label} | {each} | {mean} | {wire} |")
    dates = set().union(*(launch_dates(report, name, README_MBIT) for name in README_METHODS))
    days = sorted(dates - {"undated"}) + ([f"before {DATES_KEPT_SINCE}, when runs kept no date"]
                                         if "undated" in dates else [])
    lines.append("")
    lines.append(f"Target {report['summary']['target_val_loss']:.3f} nats/char ({report['summary']['target_rule']}); "
                 f"runs launched {' and '.join(days)}.")
    return "\n".join(lines)


NETWORK_METHODS = ("ddp", "periodic_h10", "periodic_h50", "fedavg", "dynamic_lo", "dynamic_hi", "segmented_gossip",
                   "downpour", "diloco", "dynamic_outer", "ddp_powersgd_r1", "ddp_powersgd_r4", "ddp_fp16",
                   "dynamic_default", "periodic_h50_int8", "dynamic_default_int8", "gossip_p20_r1", "gossip_p50_r1",
                   "gossip_p50_r2", "downpour_p50", "dynamic_overhead10")
"""The methods of the results page's first table, in its order (compressed DownpourSGD and the streaming comparison's
methods are in tables of their own)."""

STREAMING_METHODS = {
    20.0: ("ddp_powersgd_r4", "periodic_h50", "periodic_h50_int8", "diloco", "periodic_h50_stream",
           "periodic_h50_stream_int8", "periodic_h50_stream_a0", "periodic_h50_stream_a0_int8", "diloco_stream",
           "diloco_stream_int8", "torchft_diloco", "torchft_streaming_diloco"),
    5.0: ("ddp_powersgd_r4", "periodic_h50_int8", "periodic_h50_stream_a0_int8", "diloco_stream_int8",
          "torchft_diloco", "torchft_streaming_diloco"),
    1000.0: ("periodic_h50_int8", "periodic_h50_stream_a0", "periodic_h50_stream_a0_int8", "diloco", "diloco_stream",
             "torchft_diloco", "torchft_streaming_diloco"),
}
"""The streaming comparison's rows per bandwidth (Mbit/s), as its launches of 2026-11-27 ran them."""


def summary_rows(report: dict[str, Any], mbit: float, names: tuple[str, ...]) -> list[dict[str, Any]]:
    """The summary's rows of methods ``names`` at ``mbit``, in the order of ``names`` (those not run there left out)."""
    rows = {row["name"]: row for row in report["summary"]["rows"] if row["node_mbit"] == mbit}
    return [rows[name] for name in names if name in rows]


def network_table() -> str:
    """Every bandwidth's row of each method in :data:`NETWORK_METHODS`, in the benchmark's own table format."""
    report = result("lm_network")
    bandwidths = sorted({row["node_mbit"] for row in report["summary"]["rows"]}, reverse=True)
    return table({"rows": [row for mbit in bandwidths for row in summary_rows(report, mbit, NETWORK_METHODS)]})


def streaming_table(mbit: float) -> str:
    """The methods :data:`STREAMING_METHODS` names at ``mbit``, as :func:`rows_table` gives them."""
    return rows_table(summary_rows(result("lm_network"), mbit, STREAMING_METHODS[mbit]))


def rows_table(rows: list[dict[str, Any]]) -> str:
    """Seconds to the target seed by seed, their mean, wire MB by then, final loss, steps and s/step of summary
    ``rows``."""
    seeds = rows[0]["seeds"]
    label = f"seed {seeds[0]}" if len(seeds) == 1 else "seeds " + " / ".join(str(seed) for seed in seeds)
    lines = [f"| method | s to target, {label} | mean (seeds) | wire MB to target | final loss | steps | s/step |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        each = " / ".join(fmt_s(value) for value in row["time_to_target_s_each"])
        mean = f"{fmt_s(row['time_to_target_s'])} ({row['reached']}/{len(row['seeds'])})"
        wire = "-" if row["wire_bytes_to_target"] is None else f"{row['wire_bytes_to_target'] / 1e6:.0f}"
        lines.append(f"| {row['name']} | {each} | {mean} | {wire} | {row['final_val_loss']:.3f} | {row['steps']:.0f} "
                     f"| {row['step_s']:.3f} |")
    return "\n".join(lines)


def streaming_table_20() -> str:
    """The streaming comparison at 20 Mbit/s."""
    return streaming_table(20.0)


def streaming_table_5() -> str:
    """The streaming comparison at 5 Mbit/s."""
    return streaming_table(5.0)


def streaming_table_1000() -> str:
    """The streaming comparison at 1000 Mbit/s (the floor: the network out of the way)."""
    return streaming_table(1000.0)


ISSUE27_METHODS = {
    "ddp_powersgd_r4": "DDP + PowerSGD rank 4",
    "ddp_powersgd_r1": "DDP + PowerSGD rank 1",
    "ddp_fp16": "DDP + fp16 compression",
    "ddp": "DDP (plain, earlier launches)",
    "periodic_h50": "periodic averaging every 50",
    "periodic_h50_int8": "periodic every 50, **int8**",
    "dynamic_default": "dynamic averaging, defaults",
    "dynamic_default_int8": "dynamic averaging, defaults, **int8**",
    "gossip_p50_r1": "segmented gossip S=4 R=1 every 50",
    "gossip_p50_r2": "segmented gossip S=4 R=2 every 50",
    "gossip_p20_r1": "segmented gossip S=4 R=1 every 20",
    "segmented_gossip": "segmented gossip S=4 R=2 every 10 (earlier)",
    "downpour": "DownpourSGD, push every 5",
    "downpour_p50": "DownpourSGD, push every 50",
    "downpour_p50_int8": "DownpourSGD, push every 50, **int8**",
    "downpour_p20_int8": "DownpourSGD, push every 20, int8",
}
"""The issue-27 table's rows, in its order."""

ISSUE27_BOLD = ("periodic_h50_int8", "dynamic_default_int8")
"""Its rows in bold: the package's best methods there."""


def issue27_table() -> str:
    """Issue 27's launches at 20 Mbit/s (``lm_network_issue27.json``: rows later launches replaced in
    ``lm_network.json``): seconds to the target per seed (final losses where the budget ended first), the first
    launch's runs in brackets where a later launch replaced them, the mean over the seeds that reached it, wire MB by
    then, the mean final loss and steps; the package's best methods in bold."""
    archive = result("lm_network_issue27")
    lines = ["| method | s to target, seeds 0 / 1 / 2 | mean | wire MB to target | final loss (mean) | steps |",
             "|---|---|---|---|---|---|"]
    for name, label in ISSUE27_METHODS.items():
        runs, first = ([run for run in sorted(archive[key], key=lambda run: run["seed"]) if run["name"] == name]
                       for key in ("runs", "first_runs"))
        reached = [run["time_to_target_s"] for run in runs if run["time_to_target_s"] is not None]
        times = " / ".join(fmt_s(run["time_to_target_s"]) for run in runs)
        if name == "ddp":
            mean = f"{archive['ddp_projected_time_to_target_s']:.0f} projected"
        elif reached:
            mean = f"{statistics.fmean(reached):.1f}" + ("" if len(reached) == len(runs) else f" ({len(reached)} seeds)")
        else:
            mean = "-"
        wire = (" / ".join("-" if run["wire_bytes_to_target"] is None else f"{run['wire_bytes_to_target'] / 1e6:.0f}"
                           for run in runs) if reached else "-")
        if name in ISSUE27_BOLD:
            times, mean, wire = f"**{times}**", f"**{mean}**", f"**{wire}**"
        missed = [run["final_val_loss"] for run in runs if run["time_to_target_s"] is None]
        if missed:
            times += f" ({', '.join(f'{loss:.{3 if len(missed) == 1 else 2}f}' for loss in missed)})"
        if first:
            times += f" [first: {' / '.join(fmt_s(run['time_to_target_s']) for run in first)}]"
        loss, steps = (statistics.fmean(run[key] for run in runs) for key in ("final_val_loss", "steps"))
        lines.append(f"| {label} | {times} | {mean} | {wire} | {loss:.3f} | {steps:.0f} |")
    return "\n".join(lines)


SPARSE_METHODS = ("ddp_powersgd_r4", "periodic_h50", "periodic_h50_int8", "periodic_h50_sparse", "periodic_h10_sparse")
"""The sparse comparison's rows at 20 Mbit/s (``lm_sparse.json``: the first four in one launch per seed, the
last in a second)."""


def own_launch_table(name: str, methods: tuple[str, ...]) -> str:
    """Launches kept in their own ``<name>.json`` (no DDP run there: ``lm_network.json``'s target), the rows of
    ``methods`` as :func:`rows_table` gives them."""
    summary = summarize(result(name), result("lm_network")["summary"]["target_val_loss"])
    return rows_table([row for method in methods for row in summary["rows"] if row["name"] == method])


def sparse_table() -> str:
    """The sparse comparison at 20 Mbit/s (``lm_sparse.json``)."""
    return own_launch_table("lm_sparse", SPARSE_METHODS)


SWEEP_METHODS = ("periodic_h50_int8", "periodic_h10_sparse_d1_b2", "periodic_h10_sparse_d1_b4", "periodic_h10_sparse",
                 "periodic_h10_sparse_d2_b4", "periodic_h10_sparse_d5_b2", "periodic_h10_sparse_d5_b4")
"""The density x bits sweep's rows at 5 Mbit/s (``lm_sparse_sweep.json``: one launch per seed), int8 every 50 steps
first."""


def sweep_table() -> str:
    """The density x bits sweep at 5 Mbit/s (``lm_sparse_sweep.json``)."""
    return own_launch_table("lm_sparse_sweep", SWEEP_METHODS)
