"""The language model on two "nodes" of two ranks: one learner per node (``hierarchy="node"``) against every rank a
learner, and DDP over all four ranks (issue 28).

``benchmarks/language_model/network.py``'s task, worker, budget and target loss, on a different network: ``--nodes`` network
namespaces (``benchmarks/common/netns.py``), each running ``--ranks-per-node`` ranks of one torchrun agent. The ranks of a
node talk inside their namespace, uncapped (the fast link inside a machine); everything between nodes crosses the
node's interface, capped at ``node_mbit`` each way (the slow link between machines). Wire bytes are each namespace's
interface counters, read by the node's local rank 0 only, so they count what crossed between nodes.

Methods (``METHODS``): ``ddp`` (Lightning's DDP over all ranks), ``ddp_powersgd_r4``; ``periodic_h50``,
``dynamic_default``, ``diloco`` flat (every rank a learner: a node's ranks drift apart and average across the slow
link too, today's behaviour) and the same with ``hierarchy="node"`` (suffix ``_node``: DDP inside each node, the
protocol between nodes, each rank carrying half of every exchange). The target loss is ``lm_network.json``'s (DDP's
final loss at 1000 Mbit/s), so times compare with that table's.

Usage::

    python -m benchmarks.language_model.hierarchy                       # 20 Mbit/s, seeds 0 1 2 (about 20 min)
    python -m benchmarks.language_model.hierarchy --quick               # smoke: 2 methods, 1 seed, 15 s each
    python -m benchmarks.language_model.hierarchy --replot

Writes ``benchmarks/results/lm_hierarchy.json`` and ``lm_hierarchy.png``. Exits 77 where network namespaces cannot
be built (not root, no ``ip``/``tc``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.language_model import network as lm_network
from benchmarks.common import netns
from benchmarks.common.paths import RESULTS
from benchmarks.common.report import chosen, pyplot, save_figure, write_json

PREFIX = "lm_hierarchy"
NODES, RANKS_PER_NODE = 2, 2
BANDWIDTHS = [20.0]
MASTER_PORT = 29790
MEASURED = RESULTS  # lm_network's calibration and target, whatever --out is
FLAT = ["ddp", "ddp_powersgd_r4", "periodic_h50", "dynamic_default", "diloco"]
HIERARCHICAL = ["periodic_h50", "dynamic_default", "diloco"]


def methods(thresholds: dict[str, float]) -> list[dict[str, Any]]:
    """``lm_network``'s methods of ``FLAT``, then those of ``HIERARCHICAL`` again with ``hierarchy="node"``."""
    known = {run["name"]: run for run in lm_network.methods(thresholds)}
    runs = [known[name] for name in FLAT]
    for name in HIERARCHICAL:
        run = known[name]
        strategy = {**run["strategy"], "kwargs": {**run["strategy"]["kwargs"], "hierarchy": "node"}}
        runs.append({**run, "name": f"{name}_node", "label": f"{run['label']}, one learner per node",
                     "strategy": strategy})
    return runs


def sweep(args: argparse.Namespace, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    launches = []
    with netns.Network(nodes=args.nodes, node_mbit=args.bandwidths[0]) as network:
        for mbit in args.bandwidths:
            network.set_caps(mbit, None)
            for seed in args.seeds:
                launches.append(lm_network.run_launch(args, network, f"{PREFIX}_{mbit:g}mbit_seed{seed}", mbit, seed,
                                                      runs, MASTER_PORT + len(launches) % 50, args.ranks_per_node))
    return launches


def level_table(report: dict[str, Any]) -> str:
    """The strategy's counted MB by level per method under a hierarchy (mean over seeds; every purpose: set-up,
    protocol, final): what crossed between nodes and what stayed inside. Flat runs count no levels (their bytes
    between nodes are the summary's wire MB)."""
    lines = ["| Mbit/s | method | inter-node MB | intra-node MB (all-gathers and DDP's gradients) |", "|---|---|---|---|"]
    runs = lm_network.all_runs(report)
    for name, mbit in dict.fromkeys((run["name"], run["node_mbit"]) for run in runs):
        group = [run for run in runs if (run["name"], run["node_mbit"]) == (name, mbit)
                 and any(run.get("bytes_by_level", {}).values())]
        if group:
            inter = sum(run["bytes_by_level"]["inter_node"] for run in group) / len(group) / 1e6
            intra = sum(run["bytes_by_level"]["intra_node"] for run in group) / len(group) / 1e6
            lines.append(f"| {mbit:g} | {name} | {inter:.1f} | {intra:.1f} |")
    return "\n".join(lines)


def plot(report: dict[str, Any], out: Path) -> Path:
    plt = pyplot()

    summary, runs = report["summary"], lm_network.all_runs(report)
    target = summary["target_val_loss"]
    names = list(dict.fromkeys(run["name"] for run in runs))
    colors = {name: plt.get_cmap("tab10")(index % 10) for index, name in enumerate(names)}
    fig, (curves, bars) = plt.subplots(1, 2, figsize=(14, 4.8))
    seed, mbit = min(run["seed"] for run in runs), min(run["node_mbit"] for run in runs)
    for run in runs:
        if (run["seed"], run["node_mbit"]) == (seed, mbit):
            curve = run["curve"]
            curves.plot([p["seconds"] for p in curve], [p["val_loss"] for p in curve], color=colors[run["name"]],
                        label=run["name"], linestyle="-" if run["name"].endswith("_node") else "--")
    curves.axhline(target, color="black", linestyle=":", linewidth=1)
    curves.set_xlabel("wall-clock seconds of training")
    curves.set_ylabel("validation loss (nats/char)")
    curves.set_title(f"seed {seed}, {mbit:g} Mbit/s: solid one learner per node, dashed every rank a learner",
                     fontsize=10)
    curves.grid(True, alpha=0.3)
    curves.legend(fontsize=7, ncol=2)
    rows = summary["rows"]
    bars.bar(range(len(rows)), [row["time_to_target_s"] or 0 for row in rows],
             color=[colors[row["name"]] for row in rows])
    bars.set_xticks(range(len(rows)), [f"{row['name']} {row['node_mbit']:g}\n{row['reached']}/{len(row['seeds'])}"
                                       for row in rows],
                    rotation=30, ha="right", fontsize=7)
    bars.set_ylabel(f"seconds to val loss {target:.3f} (mean of seeds that reached it)")
    bars.set_title("time to target (0: not reached in the budget)", fontsize=10)
    bars.grid(True, axis="y", alpha=0.3)
    config = report["config"]
    fig.suptitle(f"TransformerLM, {config['nodes']} nodes x {config['ranks_per_node']} ranks, "
                 f"{'/'.join(f'{b:g}' for b in config['bandwidths'])} Mbit/s between nodes", fontsize=11)
    path = out / f"{PREFIX}.png"
    save_figure(fig, path, dpi=120)
    return path


def report_summary(report: dict[str, Any], out: Path) -> None:
    flat = json.loads((MEASURED / f"{lm_network.PREFIX}.json").read_text())["summary"]["target_val_loss"]
    report["summary"] = lm_network.summarize(report, target=flat)
    print(lm_network.table(report["summary"]))
    print(level_table(report))
    print("wrote", plot(report, out))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: ddp and periodic_h50_node, 1 seed, 15 s")
    parser.add_argument("--replot", action="store_true", help="summaries, figure and tables from the JSON")
    parser.add_argument("--nodes", type=int, default=NODES)
    parser.add_argument("--ranks-per-node", type=int, default=RANKS_PER_NODE)
    parser.add_argument("--bandwidths", type=float, nargs="+", default=BANDWIDTHS, help="Mbit/s between nodes")
    parser.add_argument("--seeds", type=int, nargs="+", default=lm_network.SEEDS)
    parser.add_argument("--methods", nargs="+", default=None, help="method names (default: all)")
    parser.add_argument("--budget", type=float, default=None, help=f"seconds of training per method ({lm_network.BUDGET_S:g})")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.budget = args.budget or (15.0 if args.quick else lm_network.BUDGET_S)
    if args.quick:
        args.seeds, args.methods = args.seeds[:1], args.methods or ["ddp", "periodic_h50_node"]
    json_path = args.out / f"{PREFIX}.json"
    if args.replot:
        report = json.loads(json_path.read_text())
        report_summary(report, args.out)
        write_json(json_path, report)
        return 0
    netns.require_network("benchmarks.language_model.hierarchy")
    calibration = json.loads((MEASURED / f"{lm_network.PREFIX}_calibration.json").read_text())
    runs = chosen(methods(calibration["thresholds"]), args.methods)
    started = time.perf_counter()
    report: dict[str, Any] = {"config": {
        **lm_network.TASK, "nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "bandwidths": args.bandwidths,
        "seeds": args.seeds, "budget_s": args.budget, "methods": runs, "quick": args.quick,
        **lm_network.provenance(argv)}}
    report["launches"] = sweep(args, runs)
    report["config"]["wall_s"] = time.perf_counter() - started
    if lm_network.all_runs(report):
        report_summary(report, args.out)
    write_json(json_path, report)
    print(f"total wall time {report['config']['wall_s']:.0f} s; results in {json_path}")
    return 1 if any("error" in launch for launch in report["launches"]) else 0


if __name__ == "__main__":
    sys.exit(main())
