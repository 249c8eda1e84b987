"""Issue 42, part 2: the simulator against real runs past 4 ranks, method by method (seconds per synchronization within
15%, bytes exact).

Real side: 8 ranks (4 network namespaces x 2 ranks) and 16 ranks (8 x 2), every namespace capped at ``--mbit``
(20 Mbit/s) each way (``benchmarks/common/netns.py``), one torchrun per namespace; the ranks of a namespace talk over
its loopback, uncapped. ``worker.py`` fits ``workload.Directions`` (one 16 x 16384 float32 matrix, 1 MiB, a trivial
step) with each method's strategy, one fit after the other in the same processes: DDP's gradient all-reduce (Gloo's
ring), DDP + PowerSGD rank 4, periodic averaging, dynamic averaging with balancing sets of 2, N/2 and N ranks, segmented
gossip and asynchronous DownpourSGD. Time per synchronization: from the end of the ``warmup``-th synchronization to the
end of the last, when the latest rank had ended it, over the synchronizations between (``workload.seconds_per_sync``).
Bytes: the protocol bytes the package's ``Communicator`` counted over the whole fit, summed over ranks.

Simulated side: ``lightning_dist.sim.Simulation`` trains the same module on the same data with the method's protocol
(``topology="strategy"``: the strategy's own messages), ``workers=N``, ``ranks_per_node=2`` (a namespace is a machine
whose interface its ranks share; inside it uncapped), each machine capped at the TCP payload rate of the cap
(``--mbit`` x 1448 / 1514). Two constants of the machine are measured in the same launch, none from a
synchronization's time: a step costs the median local step of the layout's periodic-averaging fit (compute only), and
a message's latency is one hop of Gloo's ring with nothing to carry (``worker.ring_step_latency``: the median
all-reduce of one float over its ``2 (N - 1)`` hops). Links are full duplex (a pair of processes moves both directions
at once, as the smoke runs showed for dynamic averaging's pairs); the prediction with Gloo's half-duplex pairs
(``half_duplex_links=True``, the language-model studies' setting) is recorded beside it. The simulator's time per
synchronization is the same difference of two runs, one to the ``warmup``-th synchronization and one to the last (its
virtual time ends when the last worker has ended its last step); its bytes are the whole run's.

Usage::

    python -m benchmarks.sim_validation.run                  # both layouts, every method (about 7 min on 2 cores)
    python -m benchmarks.sim_validation.run --quick --out /tmp/sim_validation   # smoke run: 8 ranks, fewer syncs (2 min)
    python -m benchmarks.sim_validation.run --replot         # summary, table and figure from the JSON

Outputs (``--out``, default ``benchmarks/results``): ``sim_validation.json`` (settings, command, every step end of
every rank, the simulator's runs, the summary) and ``sim_validation.png``; each launch's spec, per-node logs and raw
result go to ``runs/sim_validation_*``. Exits 77 with a message where network namespaces cannot be built.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lightning_dist.sim import NetworkModel, Simulation, SpeedModel
from lightning_dist.sim.protocols import make_protocol

from benchmarks.common import netns
from benchmarks.common.launch import RunFailed, launch_on_network
from benchmarks.common.paths import RESULTS
from benchmarks.common.report import command_line, pyplot, replot, save_figure, write_json
from benchmarks.language_model.simulated import PAYLOAD_SHARE
from benchmarks.sim_validation import workload

PREFIX = "sim_validation"
LAYOUTS = [(4, 2), (8, 2)]  # (namespaces, ranks per namespace): 8 and 16 ranks
QUICK_LAYOUTS = [(4, 2)]
MBIT = 20.0
TOLERANCE = 0.15
MASTER_PORT = 29870
STEP_SOURCE = "periodic"  # the fit whose local steps give the simulator its step time
WORKER = Path(__file__).resolve().with_name("worker.py")


def simulate(run: dict[str, Any], layout: dict[str, Any], syncs: int, half_duplex: bool) -> dict[str, Any]:
    """The simulator's run of ``run`` on ``layout`` to the end of synchronization ``syncs``: virtual seconds, bytes."""
    torch.manual_seed(workload.SEED)  # the real fit's seed_everything: the same initial matrix
    steps = run["every"] * syncs
    options = dict(run["protocol"])
    protocol = make_protocol(options.pop("name"), **options)
    simulation = Simulation(
        workload.Directions(), workload.SignData(run["signs"], steps), protocol, workers=layout["ranks"],
        max_steps=steps, network=NetworkModel(latency=layout["latency_s"], node_mbit=layout["mbit"] * PAYLOAD_SHARE,
                                              half_duplex_links=half_duplex),
        speed=SpeedModel(step_seconds=layout["step_s"], aggregate_seconds=0.0), eval_every=10**6,
        evaluate_workers=False, ranks_per_node=layout["ranks_per_node"])
    summary = simulation.run().summary
    return {"syncs": syncs, "steps": steps, "virtual_s": summary["virtual_seconds"], "bytes": summary["bytes"],
            "bytes_by_level": summary["bytes_by_level"], "protocol_metrics": summary["protocol_metrics"]}


def cell(layout: dict[str, Any], run: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """One (layout, method) cell: the measured and simulated seconds per synchronization and bytes."""
    times = workload.sync_times(measured["step_ends"], run["every"])
    measured_s = workload.seconds_per_sync(times, run["warmup"])
    sims = {half: [simulate(run, layout, syncs, half) for syncs in (run["warmup"], run["syncs"])]
            for half in (False, True)}
    predicted = {half: (full["virtual_s"] - short["virtual_s"]) / (run["syncs"] - run["warmup"])
                 for half, (short, full) in sims.items()}
    predicted_s, (short, full) = predicted[False], sims[False]
    return {"layout": layout["name"], "ranks": layout["ranks"], "name": run["name"], "label": run["label"],
            "every": run["every"], "syncs": run["syncs"], "warmup": run["warmup"], "sync_end_s": times,
            "measured_s": measured_s, "predicted_s": predicted_s, "ratio": predicted_s / measured_s,
            "within": abs(predicted_s / measured_s - 1) <= TOLERANCE,
            "predicted_half_duplex_s": predicted[True], "ratio_half_duplex": predicted[True] / measured_s,
            "bytes_half_duplex": sims[True][1]["bytes"],
            "measured_bytes": measured["protocol_bytes"], "predicted_bytes": full["bytes"],
            "bytes_exact": measured["protocol_bytes"] == full["bytes"], "sim_short": short, "sim_full": full,
            "measured_syncs": measured.get("syncs"), "protocol_metrics": measured.get("protocol_metrics"),
            "tcp_retransmits": measured.get("tcp_retransmits")}


def summarize(report: dict[str, Any]) -> list[dict[str, Any]]:
    cells = []
    for launch in report["launches"]:
        runs = {run["name"]: run for run in launch["runs"]}
        source = next(run for run in launch["methods"] if run["name"] == STEP_SOURCE)
        launch["layout"]["step_s"] = workload.local_step_seconds(runs[STEP_SOURCE]["step_ends"], source["every"])
        for run in launch["methods"]:
            if run["name"] in runs:
                cells.append(cell(launch["layout"], run, runs[run["name"]]))
    return cells


def table(cells: list[dict[str, Any]]) -> str:
    lines = ["| ranks (namespaces x ranks) | method | measured s/sync | simulated s/sync | simulated / measured "
             "| half-duplex pairs: simulated / measured | protocol bytes measured | simulated | bytes equal "
             "| TCP segments retransmitted in the fit |", "|" + "---|" * 10]
    for entry in cells:
        mark = "" if entry["within"] else " **miss**"
        lines.append(f"| {entry['layout']} | {entry['label']} | {entry['measured_s']:.3f} | {entry['predicted_s']:.3f} "
                     f"| {entry['ratio']:.3f}{mark} | {entry['ratio_half_duplex']:.3f} "
                     f"| {entry['measured_bytes']:,} | {entry['predicted_bytes']:,} "
                     f"| {'yes' if entry['bytes_exact'] else 'no'} | {entry.get('tcp_retransmits', '-')} |")
    within = sum(entry["within"] for entry in cells)
    exact = sum(entry["bytes_exact"] for entry in cells)
    lines += ["", f"{within} of {len(cells)} cells within {TOLERANCE:.0%}; bytes equal in {exact} of {len(cells)}."]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> Path:
    plt = pyplot()
    cells = report["summary"]
    layouts = list(dict.fromkeys(entry["layout"] for entry in cells))
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    scatter, bars = axes
    markers = ["o", "s", "^", "D"]
    top = 1.15 * max(max(entry["measured_s"], entry["predicted_s"]) for entry in cells)
    low = 0.8 * min(min(entry["measured_s"], entry["predicted_s"]) for entry in cells)
    line = [low, top]
    scatter.plot(line, line, color="black", lw=1, label="simulated = measured")
    scatter.fill_between(line, [x * (1 - TOLERANCE) for x in line], [x * (1 + TOLERANCE) for x in line],
                         color="tab:green", alpha=0.15, label=f"within {TOLERANCE:.0%}")
    names = list(dict.fromkeys(entry["name"] for entry in cells))
    colors = dict(zip(names, plt.cm.tab10.colors))
    for index, layout in enumerate(layouts):
        for entry in (e for e in cells if e["layout"] == layout):
            scatter.scatter(entry["measured_s"], entry["predicted_s"], color=colors[entry["name"]],
                            marker=markers[index % len(markers)], s=45, edgecolor="black", lw=0.5,
                            label=f"{entry['name']}" if index == 0 else None)
        scatter.scatter([], [], marker=markers[index % len(markers)], color="white", edgecolor="black",
                        label=f"{layout} ranks")
    scatter.set_xscale("log")
    scatter.set_yscale("log")
    scatter.set_xlim(low, top)
    scatter.set_ylim(low, top)
    scatter.set_xlabel("measured seconds per synchronization")
    scatter.set_ylabel("simulated seconds per synchronization")
    scatter.legend(fontsize=7, loc="upper left")
    scatter.grid(True, which="both", alpha=0.3)
    width = 0.8 / len(layouts)
    for index, layout in enumerate(layouts):
        group = {e["name"]: e for e in cells if e["layout"] == layout}
        xs = [position + (index - (len(layouts) - 1) / 2) * width for position in range(len(names))]
        ratios = [group[name]["ratio"] if name in group else float("nan") for name in names]
        bars.bar(xs, ratios, width, label=f"{layout} ranks", color=["tab:blue", "tab:orange"][index % 2])
    bars.axhspan(1 - TOLERANCE, 1 + TOLERANCE, color="tab:green", alpha=0.15)
    bars.axhline(1.0, color="black", lw=1)
    bars.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    bars.set_ylabel("simulated / measured seconds per synchronization")
    bars.legend(fontsize=8)
    bars.grid(True, axis="y", alpha=0.3)
    config = report["config"]
    fig.suptitle(f"Simulator against real runs: {config['mbit']:g} Mbit/s per namespace, "
                 f"{config['parameters']:,} float32 parameters, {config['date']}", fontsize=11)
    save_figure(fig, path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 8 ranks only, fewer synchronizations")
    parser.add_argument("--replot", action="store_true", help="summary, table and figure from the JSON; run nothing")
    parser.add_argument("--mbit", type=float, default=MBIT, help="each namespace's cap, each way (Mbit/s)")
    parser.add_argument("--layouts", nargs="+", default=None, type=lambda text: tuple(map(int, text.split("x"))),
                        help="NAMESPACESxRANKS each (default 4x2 8x2; --quick: 4x2)")
    parser.add_argument("--methods", nargs="+", default=None, help="only these methods (default: all)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    json_path = args.out / f"{PREFIX}.json"
    if args.replot:
        return replot(json_path, summarize, table, lambda report: [plot(report, args.out / f"{PREFIX}.png")])
    netns.require_network("benchmarks.sim_validation.run")
    started = time.perf_counter()
    report: dict[str, Any] = {"config": {
        "mbit": args.mbit, "payload_share": PAYLOAD_SHARE, "tolerance": TOLERANCE,
        "parameters": workload.ROWS * workload.COLS, "command": command_line(argv), "quick": args.quick,
        "python": platform.python_version(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")},
        "launches": []}
    layouts = args.layouts or (QUICK_LAYOUTS if args.quick else LAYOUTS)
    for index, (nodes, per_node) in enumerate(layouts):
        ranks = nodes * per_node
        runs = [run for run in workload.methods(ranks, args.quick) if not args.methods or run["name"] in args.methods
                or run["name"] == STEP_SOURCE]
        name = f"{PREFIX}_{ranks}ranks"
        print(f"{name}: {nodes} namespaces x {per_node} ranks, {len(runs)} fits ...", flush=True)
        with netns.Network(nodes=nodes, node_mbit=args.mbit) as network:
            try:
                raw = launch_on_network(network, {"name": name, "seed": workload.SEED, "runs": runs},
                                        args.out / "runs", 1500, MASTER_PORT + index, WORKER, ranks_per_node=per_node)
            except RunFailed as exc:
                print(f"FAILED: {exc}", file=sys.stderr)
                return 1
        print(f"  done in {raw['launch_s']:.0f} s", flush=True)
        layout = {"name": f"{ranks} ({nodes} x {per_node})", "ranks": ranks, "nodes": nodes,
                  "ranks_per_node": per_node, "mbit": args.mbit, "launch_s": raw["launch_s"],
                  "latency_s": raw["ring_step_latency_s"]}
        report["launches"].append({"layout": layout, "methods": runs, "runs": raw["runs"]})
    report["config"]["measure_wall_s"] = time.perf_counter() - started
    report["summary"] = summarize(report)
    report["config"]["wall_s"] = time.perf_counter() - started
    write_json(json_path, report)
    print(table(report["summary"]))
    print("wrote", json_path, plot(report, args.out / f"{PREFIX}.png"))
    print(f"total wall time {report['config']['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
