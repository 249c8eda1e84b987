"""The simulator's prediction of ``benchmarks/language_model/hierarchy.py``'s table (2 nodes x 2 ranks), and its extension to
32 x 8 and 128 x 8 ranks (issue 28).

``lightning_dist.sim`` with machines (:mod:`lightning_dist.sim.machines`): ``ranks_per_node`` ranks to a machine,
each machine one interface to the others (the namespace's capped link), its ranks joined by a link of their own.
Flat methods run every rank as a learner, the ranks of a machine sharing its interface; ``_node`` methods one
learner per machine (DDP inside it: the mean of its ranks' gradients, their all-reduce over the intra link every
step, an all-gather of what arrives). The methods, protocols and task are ``simulated``'s (``simulated.simulate``).

Three constants of this machine come from the measured JSON, none from a time to target:

- ``step_s``: the median training step of the flat local-update runs at the lowest measured bandwidth (the
  3-seed one; compute only: their steps without a synchronization, as ``lm_sim.measured_step_s``);
- ``intra_mbit``: the node runs' median step exceeds it by DDP's gradient all-reduce inside a node; that
  difference set equal to ``ring_all_reduce_seconds`` of the gradients among a node's ranks (half-duplex pairs,
  as Gloo) and solved for the rate;
- the interface's rate: the cap's TCP payload share, at most ``lm_network.json``'s ceiling (``lm_sim.node_rate_mbit``).

Part 1, prediction: every measured method at its bandwidth on 2 x 2, next to the measurement (the goal: within
20%). Part 2, extension: ``--scale-methods`` on ``--scale-nodes`` machines of ``--scale-ranks-per-node`` ranks,
the same constants (this machine's compute and intra link, replicated; 20 Mbit/s between machines), each rank
with the same batch (weak scaling), until the target loss or ``--scale-max-steps`` steps.

Usage::

    python -m benchmarks.language_model.hierarchy_simulated                         # both parts (reads results/lm_hierarchy.json)
    python -m benchmarks.language_model.hierarchy_simulated --predict-only
    python -m benchmarks.language_model.hierarchy_simulated --scale-only --scale-nodes 32 --scale-methods ddp dynamic_default_node
    python -m benchmarks.language_model.hierarchy_simulated --replot
    python -m benchmarks.language_model.hierarchy_simulated --merge-from /tmp/exp/s128/lm_hierarchy_sim.json   # add a run's cells
    python -m benchmarks.language_model.hierarchy_simulated --scale-only --scale-nodes 128 --scale-methods ddp \
        --collectives nccl --native-kernels --threads 2 --retime benchmarks/results/lm_hierarchy_sim.json --out DIR

Part 2's collectives are Gloo's ring (``--collectives gloo_ring``, the default: the measured CPU runs) or NCCL's
ring or tree (``nccl``, ``lightning_dist.sim.nccl``: what a GPU cluster's DDP runs); a run under one sits beside
the same cell under the other. ``--retime JSON`` moves DDP's runs (and its hooks') in that JSON to
``--collectives`` instead of re-running them (``retime.py``: their first evaluation interval re-run and checked;
``--retime-loss-tolerance`` for a run recorded on another CPU).

Writes ``lm_hierarchy_sim.json`` and ``lm_hierarchy_sim.png`` (``--out``, default ``benchmarks/results``); scale
runs of a method and size already in the JSON are replaced, the others kept.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.common.paths import RESULTS
from benchmarks.common.report import pyplot, save_figure
from benchmarks.language_model import network as lm_network
from benchmarks.language_model import simulated as lm_sim
from benchmarks.language_model.simulated import LATENCY_S, fmt
from lightning_dist.sim import NetworkModel
from lightning_dist.sim.network_model import ring_all_reduce_seconds

PREFIX = "lm_hierarchy_sim"
SCALE_NODES = [32, 128]
SCALE_RANKS_PER_NODE = 8
SCALE_METHODS = ["ddp", "ddp_powersgd_r4", "periodic_h50_node", "dynamic_default_node"]
SCALE_ONLY_METHODS = ({"name": "ddp_fp16", "kind": "ddp", "label": "DDP + fp16 gradient compression (its comm hook)",
                       "hook": {"name": "fp16"}},)
"""Baselines of part 2 that the measured 2 x 2 study did not run (``lm_network.json`` measures ``ddp_fp16``)."""


def calibration_mbit(measured: dict[str, Any]) -> float:
    """The bandwidth the constants are taken at: the lowest measured (the 3-seed one)."""
    return min(measured["config"]["bandwidths"])


def median_step_s(measured: dict[str, Any], hierarchical: bool) -> float:
    """The median training step (after the first five) of the local-update runs at ``calibration_mbit``, with or
    without a hierarchy."""
    durations = [duration for run in lm_network.all_runs(measured)
                 if run["kind"] in ("periodic", "dynamic") and run["name"].endswith("_node") == hierarchical
                 and run["node_mbit"] == calibration_mbit(measured)
                 for rank in run["step_s_per_rank"] for duration in rank[5:]]
    return statistics.median(durations)


def intra_node_mbit(measured: dict[str, Any], step_s: float) -> float:
    """The intra-node rate that makes DDP's gradient all-reduce inside a node take what the node runs' steps add."""
    config = measured["config"]
    run = next(run for run in lm_network.all_runs(measured) if run["name"].endswith("_node"))
    ranks, nbytes = config["ranks_per_node"], run["model_bytes"]  # the LM has no buffers: gradients = model
    extra = median_step_s(measured, hierarchical=True) - step_s
    latency_s = ring_all_reduce_seconds(NetworkModel(latency=LATENCY_S, half_duplex_links=True), ranks, nbytes)
    unit = ring_all_reduce_seconds(NetworkModel(latency=LATENCY_S, node_mbit=1.0, half_duplex_links=True), ranks, nbytes)
    if extra <= latency_s:
        raise ValueError(f"the node runs' steps ({extra:.4f} s longer) leave no time for the gradient all-reduce")
    return (unit - latency_s) / (extra - latency_s)


def kernels(numerics: dict[str, Any]) -> str:
    """Which float32 kernels a run had (``pinned``: :func:`~lightning_dist.sim.numerics.pin_cpu_kernels`; ``native``:
    the CPU's own, ``--native-kernels``) and its threads: runs compare bit for bit only within one kind."""
    return f"{'pinned' if numerics.get('mkl_cbwr') else 'native'}, {numerics['threads']}"


def collectives_label(run: dict[str, Any]) -> str:
    """How a scale run's collectives were timed: Gloo's ring or NCCL's model, and whether it was re-timed
    (``retime.py``) from a run under the other."""
    label = "NCCL" if lm_sim.collectives_of(run) == "nccl" else "Gloo ring"
    return f"{label}, re-timed" if run.get("retimed") else label


def scale_table(runs: list[dict[str, Any]], mbit: float) -> str:
    """Time to target against DDP's (and the strongest DDP variant's) at each size, under the same collective model."""
    lines = [f"| nodes x ranks | collectives | method | s to target at {mbit:g} Mbit/s | vs DDP "
             "| vs best DDP variant run at that size | steps to target | inter-node MB to target | final loss "
             "| steps run | kernels, threads |", "|" + "---|" * 11]
    for run in runs:
        same = [other for other in runs if other["workers"] == run["workers"] and other["name"].startswith("ddp")
                and lm_sim.collectives_of(other) == lm_sim.collectives_of(run)]
        ddp = next((other["time_to_target_s"] for other in same if other["name"] == "ddp"), None)
        best = min((other["time_to_target_s"] for other in same if other["time_to_target_s"]), default=None)
        megabytes = None if run["bytes_to_target"] is None else run["bytes_to_target"] / 1e6
        lines.append(
            f"| {run['workers'] // run['ranks_per_node']} x {run['ranks_per_node']} | {collectives_label(run)} "
            f"| {run['name']} | {fmt(run['time_to_target_s'])} | {fmt(lm_sim.ratio(ddp, run['time_to_target_s']), 1)} "
            f"| {fmt(lm_sim.ratio(best, run['time_to_target_s']), 2)} | {fmt(run['steps_to_target'], 0)} "
            f"| {fmt(megabytes, 0)} | {run['final_val_loss']:.3f} | {run['steps']:.0f} | {kernels(run['numerics'])} |")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5))
    cells = [cell for cell in report.get("prediction", []) if cell["time_ratio"] is not None]
    for cell in cells:
        measured, predicted = cell["measured"]["time_to_target_s"], cell["predicted"]["time_to_target_s"]
        left.scatter(measured, predicted, color="tab:green" if cell["name"].endswith("_node") else "tab:blue")
        left.annotate(cell["name"], (measured, predicted), fontsize=7)
    if cells:
        values = [value for cell in cells for value in (cell["measured"]["time_to_target_s"],
                                                         cell["predicted"]["time_to_target_s"])]
        low, high = min(values) * 0.8, max(values) * 1.25
        left.plot([low, high], [low, high], color="black", linewidth=1)
        left.fill_between([low, high], [low * 0.8, high * 0.8], [low * 1.2, high * 1.2], color="grey", alpha=0.2)
    left.set_xlabel("measured seconds to target")
    left.set_ylabel("simulated seconds to target")
    left.set_title("2 nodes x 2 ranks (green: one learner per node; band: within 20%)", fontsize=10)
    left.grid(True, alpha=0.3)
    runs = report.get("scale", [])
    colors = {name: f"C{index % 10}" for index, name in enumerate(dict.fromkeys(run["name"] for run in runs))}
    for name, collectives in dict.fromkeys((run["name"], lm_sim.collectives_of(run)) for run in runs):
        points = sorted((run["workers"], run["time_to_target_s"]) for run in runs
                        if (run["name"], lm_sim.collectives_of(run)) == (name, collectives) and run["time_to_target_s"])
        if points:
            flat = not (name.endswith("_node") or name.startswith("ddp"))  # every rank a learner: dashed
            nccl = collectives == "nccl"  # NCCL's model: filled markers; Gloo's ring: open, faint
            right.plot(*zip(*points), marker="o", linestyle="--" if flat else "-", alpha=1.0 if nccl else 0.45,
                       color=colors[name],
                       markerfacecolor=None if nccl else "none", label=f"{name} ({'NCCL' if nccl else 'Gloo ring'})")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("ranks (GPUs), 8 to a node")
    right.set_ylabel("simulated seconds to target")
    right.set_title(f"extension at {report['config'].get('scale_mbit', 0):g} Mbit/s between nodes (dashed: every "
                    "rank a learner; faint: Gloo's ring)", fontsize=10)
    right.grid(True, which="both", alpha=0.3)
    if runs:
        right.legend(fontsize=8)
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = lm_sim.parts_parser(__doc__.split("\n\n")[0], "lm_hierarchy", SCALE_METHODS)
    parser.add_argument("--scale-nodes", type=int, nargs="+", default=SCALE_NODES)
    parser.add_argument("--scale-ranks-per-node", type=int, default=SCALE_RANKS_PER_NODE)
    args = parser.parse_args(argv)
    args.scale_workers = [nodes * args.scale_ranks_per_node for nodes in args.scale_nodes]

    def constants(measured: dict[str, Any]) -> dict[str, Any]:
        network = json.loads((RESULTS / f"{lm_network.PREFIX}.json").read_text())
        step_s = median_step_s(measured, hierarchical=False)
        return {"step_s": step_s, "intra_mbit": intra_node_mbit(measured, step_s),
                "ceiling_mbit": lm_sim.measured_ceiling_mbit(network), "scale_mbit": calibration_mbit(measured)}

    return lm_sim.drive(args, argv, PREFIX, constants, args.scale_ranks_per_node, scale_table, plot,
                        SCALE_ONLY_METHODS)

if __name__ == "__main__":
    sys.exit(main())
