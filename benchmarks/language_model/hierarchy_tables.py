"""The tables of ``docs/results/one-learner-per-node.md`` (issues 28 and 42), rendered from
``benchmarks/results/lm_hierarchy.json`` (the measured 2 nodes x 2 ranks, :mod:`benchmarks.language_model.hierarchy`)
and ``benchmarks/results/lm_hierarchy_sim.json`` (the simulator's prediction of it and its 32 x 8 and 128 x 8 runs,
:mod:`benchmarks.language_model.hierarchy_simulated`) by :mod:`benchmarks.common.tables`."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.common.tables import result
from benchmarks.language_model.hierarchy_simulated import kernels
from benchmarks.language_model.network import all_runs
from benchmarks.language_model.simulated import collectives_of, fmt, ratio

MEASURED_MBIT = 20.0
"""The bandwidth between nodes of the 3-seed measurement."""
FAST_MBIT = 100.0
"""The bandwidth of the one-seed measurement on a faster link."""
MEASURED_LABELS = {
    "ddp": "DDP", "ddp_powersgd_r4": "DDP + PowerSGD rank 4",
    "periodic_h50": "periodic every 50, flat", "periodic_h50_node": "periodic every 50, per node",
    "dynamic_default": "dynamic defaults, flat", "dynamic_default_node": "dynamic defaults, per node",
    "diloco": "DiLoCo every 50, flat", "diloco_node": "DiLoCo every 50, per node",
}
"""The measured methods in the page's order."""
FAST_PAIRS = {"periodic_h50": "periodic every 50", "dynamic_default": "dynamic defaults", "diloco": "DiLoCo every 50"}
"""The protocols whose flat and per-node runs share a row of the faster link's table."""
SCALE_LABELS = {
    "ddp": "DDP over all {ranks} ranks", "ddp_powersgd_r4": "DDP + PowerSGD rank 4",
    "dynamic_default_node": "dynamic averaging defaults, one learner per node",
    "dynamic_default": "dynamic averaging defaults, every rank a learner",
    "periodic_h50_node": "periodic averaging every 50, one learner per node",
    "periodic_h50": "periodic averaging every 50, every rank a learner",
    "diloco_node": "DiLoCo every 50, one learner per node", "diloco": "DiLoCo every 50, every rank a learner",
}
"""The 32 x 8 table's rows under Gloo's ring, in the page's order (``{ranks}``: the run's ranks)."""
LARGEST_ROWS = ((32, "dynamic_default_node"), (128, "ddp"), (128, "ddp_powersgd_r4"), (128, "dynamic_default_node"))
"""The 128 x 8 table's (nodes, method) cells under Gloo's ring."""
NCCL_LABELS = {
    "ddp": "DDP over all {ranks} ranks", "ddp_powersgd_r4": "DDP + PowerSGD rank 4",
    "ddp_fp16": "DDP with the fp16 compression hook",
    "periodic_h50": "periodic averaging every 50, flat ({ranks} learners)",
    "periodic_h50_node": "periodic averaging every 50, one learner per node",
    "diloco": "DiLoCo every 50, flat ({ranks} learners)", "diloco_node": "DiLoCo every 50, one learner per node",
    "dynamic_default": "dynamic averaging defaults, flat ({ranks} learners)",
    "dynamic_default_node": "dynamic averaging defaults, one learner per node",
}
"""The methods of the NCCL table, in the page's order at each size."""
MOVED = 0.1
"""A relative change of the time to target under NCCL's model that the NCCL table sets in bold."""


def bold(text: str, emphasised: bool) -> str:
    """``text`` in bold where ``emphasised``."""
    return f"**{text}**" if emphasised else text


def summary_rows(report: dict[str, Any], mbit: float) -> dict[str, dict[str, Any]]:
    """The summary's rows at ``mbit`` by method."""
    return {row["name"]: row for row in report["summary"]["rows"] if row["node_mbit"] == mbit}


def measured_table() -> str:
    """The 3-seed measurement at :data:`MEASURED_MBIT`: seeds reaching the target, mean (and each seed's) seconds to
    it, final loss, steps, s/step and wire MB between nodes; per-node times, the lowest loss and MB in bold."""
    report = result("lm_hierarchy")
    rows = summary_rows(report, MEASURED_MBIT)
    lowest_loss = min(rows[name]["final_val_loss"] for name in MEASURED_LABELS)
    fewest_bytes = min(rows[name]["wire_bytes"] for name in MEASURED_LABELS)
    lines = ["| method | seeds reaching | s to target (each seed) | final val loss | steps in "
             f"{report['config']['budget_s']:g} s | s/step | wire MB between nodes |", "|---|---|---|---|---|---|---|"]
    for name, label in MEASURED_LABELS.items():
        row, node = rows[name], name.endswith("_node")
        each = " / ".join(fmt(value) for value in row["time_to_target_s_each"])
        time = "-" if row["time_to_target_s"] is None else f"{bold(fmt(row['time_to_target_s']), node)} ({each})"
        loss = bold(f"{row['final_val_loss']:.3f}", row["final_val_loss"] == lowest_loss)
        wire = bold(f"{row['wire_bytes'] / 1e6:.1f}", row["wire_bytes"] == fewest_bytes)
        lines.append(f"| {bold(label, node)} | {row['reached']}/{len(row['seeds'])} | {time} | {loss} "
                     f"| {row['steps']:.0f} | {row['step_s']:.3f} | {wire} |")
    lines.append(f"\nFrom `lm_hierarchy.json`'s summary at {MEASURED_MBIT:g} Mbit/s (means over the seeds).")
    return "\n".join(lines)


def syncs(report: dict[str, Any], name: str, mbit: float) -> str:
    """The mean number of synchronizations of method ``name``'s runs at ``mbit`` ("-" for DDP's)."""
    counts = [run["syncs"] for run in all_runs(report) if run["name"] == name and run["node_mbit"] == mbit
              and "syncs" in run]
    return f"{statistics.fmean(counts):.3g}" if counts else "-"


def paired(pair: tuple[dict[str, Any], ...], key: str, spec: str, scale: float = 1.0) -> str:
    """``key`` of a flat and a per-node row, divided by ``scale`` and formatted with ``spec``, as "flat / node"."""
    return " / ".join(f"{row[key] / scale:{spec}}" for row in pair)


def fast_table() -> str:
    """The one-seed measurement at :data:`FAST_MBIT`, flat and per node side by side, the sooner time in bold."""
    report = result("lm_hierarchy")
    rows = summary_rows(report, FAST_MBIT)
    lines = [f"| method | s to target | final val loss | steps in {report['config']['budget_s']:g} s | s/step "
             "| wire MB between nodes | syncs |", "|---|---|---|---|---|---|---|"]
    for name in ("ddp", "ddp_powersgd_r4"):
        row = rows[name]
        lines.append(f"| {MEASURED_LABELS[name]} | {fmt(row['time_to_target_s'])} | {row['final_val_loss']:.3f} "
                     f"| {row['steps']:.0f} | {row['step_s']:.3f} | {row['wire_bytes'] / 1e6:.1f} "
                     f"| {syncs(report, name, FAST_MBIT)} |")
    for name, label in FAST_PAIRS.items():
        pair = (rows[name], rows[f"{name}_node"])
        soonest = min(row["time_to_target_s"] for row in pair if row["time_to_target_s"] is not None)
        times = " / ".join(bold(fmt(row["time_to_target_s"]), row["time_to_target_s"] == soonest) for row in pair)
        cells = [times, paired(pair, "final_val_loss", ".3f"), paired(pair, "steps", ".0f"),
                 paired(pair, "step_s", ".3f"), paired(pair, "wire_bytes", ".1f", 1e6),
                 " / ".join(syncs(report, row["name"], FAST_MBIT) for row in pair)]
        lines.append(f"| {label}, flat / per node | {' | '.join(cells)} |")
    lines.append(f"\nFrom `lm_hierarchy.json`'s summary and runs at {FAST_MBIT:g} Mbit/s.")
    return "\n".join(lines)


def prediction_table() -> str:
    """The simulator's 2 x 2 prediction (one seed) against the measured means at :data:`MEASURED_MBIT`; a time
    ratio outside 20% in bold."""
    seeds = {name: len(row["seeds"]) for name, row in summary_rows(result("lm_hierarchy"), MEASURED_MBIT).items()}
    lines = ["| method | s to target: measured | predicted | ratio | final loss: measured | predicted "
             "| steps: measured | predicted |", "|---|---|---|---|---|---|---|---|"]
    for cell in result("lm_hierarchy_sim")["prediction"]:
        if cell["node_mbit"] != MEASURED_MBIT:
            continue
        m, p = cell["measured"], cell["predicted"]
        measured = fmt(m["time_to_target_s"])
        if m["time_to_target_s"] is not None and m["reached"] < seeds[cell["name"]]:
            measured += f" ({m['reached']} of {seeds[cell['name']]} seeds)"
        time_ratio = bold(fmt(cell["time_ratio"], 2), cell["time_ratio"] is not None
                          and abs(cell["time_ratio"] - 1) > 0.2)
        lines.append(f"| {MEASURED_LABELS[cell['name']]} | {measured} | {fmt(p['time_to_target_s'])} | {time_ratio} "
                     f"| {m['final_val_loss']:.3f} | {p['final_val_loss']:.3f} | {m['steps']:.0f} "
                     f"| {p['steps']:.0f} |")
    lines.append("\nFrom `lm_hierarchy_sim.json`'s prediction cells.")
    return "\n".join(lines)


def scale_runs(collectives: str) -> dict[tuple[int, str], dict[str, Any]]:
    """The simulator's scale runs under ``collectives`` by (nodes, method)."""
    return {(run["workers"] // run["ranks_per_node"], run["name"]): run for run in result("lm_hierarchy_sim")["scale"]
            if collectives_of(run) == collectives}


def megabytes(run: dict[str, Any]) -> str:
    """A run's MB between machines to the target."""
    return fmt(None if run["bytes_to_target"] is None else run["bytes_to_target"] / 1e6, 0)


def scale_table() -> str:
    """The 32 x 8 runs under Gloo's ring against DDP and DDP + PowerSGD rank 4; one learner per node in bold."""
    runs = scale_runs("gloo_ring")
    ddp, powersgd = runs[32, "ddp"]["time_to_target_s"], runs[32, "ddp_powersgd_r4"]["time_to_target_s"]
    lines = ["| method | s to target | vs DDP | vs DDP + PowerSGD rank 4 | steps to target "
             "| MB between machines to target | final loss | kernels, threads |", "|---|---|---|---|---|---|---|---|"]
    for name, label in SCALE_LABELS.items():
        run, node = runs[32, name], name.endswith("_node")
        cells = (label.format(ranks=run["workers"]), fmt(run["time_to_target_s"]),
                 fmt(ratio(ddp, run["time_to_target_s"])), fmt(ratio(powersgd, run["time_to_target_s"]), 2))
        lines.append(f"| {' | '.join(bold(cell, node) for cell in cells)} | {fmt(run['steps_to_target'], 0)} "
                     f"| {bold(megabytes(run), node)} | {run['final_val_loss']:.3f} | {kernels(run['numerics'])} |")
    return "\n".join(lines)


def largest_table() -> str:
    """The 128 x 8 runs under Gloo's ring beside one learner per node at 32 x 8; the soonest at the largest size in
    bold."""
    runs = scale_runs("gloo_ring")
    largest = max(nodes for nodes, _ in LARGEST_ROWS)
    soonest = min(runs[nodes, name]["time_to_target_s"] for nodes, name in LARGEST_ROWS if nodes == largest)
    lines = ["| nodes x ranks | method | s to target | steps to target | MB between machines to target | final loss "
             "| kernels, threads |", "|---|---|---|---|---|---|---|"]
    for nodes, name in LARGEST_ROWS:
        run = runs[nodes, name]
        time = bold(fmt(run["time_to_target_s"]), nodes == largest and run["time_to_target_s"] == soonest)
        lines.append(f"| {nodes} x {run['ranks_per_node']} | {SCALE_LABELS[name].format(ranks=run['workers'])} "
                     f"| {time} | {fmt(run['steps_to_target'], 0)} | {megabytes(run)} "
                     f"| {run['final_val_loss']:.3f} | {kernels(run['numerics'])} |")
    return "\n".join(lines)


def kernel_kind(numerics: dict[str, Any]) -> str:
    """``pinned`` or ``native`` (:func:`~benchmarks.language_model.hierarchy_simulated.kernels` without threads)."""
    return kernels(numerics).split(",")[0]


def how(run: dict[str, Any], gloo: dict[str, Any] | None) -> str:
    """How a cell under NCCL's model came about: run, re-run beside a Gloo-ring cell, or re-timed from one (from
    another CPU's run where the re-timing's CPU differs), with its minutes and kernels."""
    retimed = run.get("retimed")
    if retimed:
        here = retimed.get("numerics", run["numerics"])["aten_cpu_capability"]
        kind = "re-timed" + (" from another CPU's run" if here != run["numerics"]["aten_cpu_capability"] else "")
    else:
        kind = "run" if gloo is None else "re-run"
    threads = run["numerics"]["threads"]
    return (f"{kind}, {run['wall_s'] / 60:.0f} min ({kernel_kind(run['numerics'])}, {threads} "
            f"thread{'s' if threads != 1 else ''})")


def nccl_table() -> str:
    """Every cell under NCCL's model beside the same cell under Gloo's ring; in bold the per-node times and those
    NCCL's model moves by more than :data:`MOVED`."""
    nccl, gloo = scale_runs("nccl"), scale_runs("gloo_ring")
    order = list(NCCL_LABELS)
    lines = ["| nodes x ranks | method | Gloo ring: s to target | NCCL: s to target | steps to target | how |",
             "|---|---|---|---|---|---|"]
    for nodes, name in sorted(nccl, key=lambda key: (key[0], order.index(key[1]))):
        run, before = nccl[nodes, name], gloo.get((nodes, name))
        time, earlier = run["time_to_target_s"], None if before is None else before["time_to_target_s"]
        moved = time is not None and earlier is not None and abs(time / earlier - 1) > MOVED
        steps = fmt(run["steps_to_target"], 0)
        if before is not None and before["steps_to_target"] != run["steps_to_target"]:
            steps += f" ({fmt(before['steps_to_target'], 0)} under Gloo's ring, {kernel_kind(before['numerics'])})"
        lines.append(f"| {nodes} x {run['ranks_per_node']} | {NCCL_LABELS[name].format(ranks=run['workers'])} "
                     f"| {fmt(earlier)} | {bold(fmt(time), name.endswith('_node') or moved)} | {steps} "
                     f"| {how(run, before)} |")
    return "\n".join(lines)
