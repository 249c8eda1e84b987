"""Paper 002 (segmented gossip, "Combo") in the hybrid simulator, and the simulator against the real network.

Part 1, paper 002's scalability study (its section 5): FedAvg (all workers take part, an
aggregation server), plain gossip (``S = 1, R = 2``) and segmented gossip (``S = 10, R = 2``),
``tau = 40`` local steps between synchronisations, on 20, 30 and 40 workers behind 100 Mbit/s per
node and 10 Mbit/s per link; the score is the virtual time until the global model (for gossip the
mean of the workers' models weighted by their part sizes ``|D_j|``, paper 002's eq. 3; for FedAvg,
whose strategy averages plainly, the plain mean) first reaches a target accuracy. The paper
reports segmented gossip 2.25x (20 workers) to 3.01x (40 workers) faster than FedAvg. Paper 002
trains McMahan et al.'s CIFAR-10 CNN (about 10^6 parameters); here every worker trains an MLP
64-1024-1024-10 (1,126,410 parameters, 4.5 MB) on scikit-learn digits, so a model costs as
many bytes as the paper's. Compute is modelled (``SpeedModel``) from the step time of that model
measured on this machine before the runs (best of 10 block medians, recorded in the JSON; the
FedAvg server's mean of N models, and one worker's segment-wise aggregation for plain and
segmented gossip, likewise), so each run is deterministic given those numbers. A
run stops a few evaluations after its global model reached the highest target. A cheap probe
(``period = 1`` and one modelled step worth ``tau`` steps) also gives every protocol's time per
round under full-duplex and half-duplex links, which splits each speedup into
rounds-to-target and seconds-per-round.

Part 2, fidelity: ``benchmarks/segmented_gossip/run.py`` measured segmented gossip (R = 2,
S in {1, 2, 4, 5, 10}) among 11 processes in network namespaces behind htb caps of 20 Mbit/s per
node and 2 Mbit/s per link (payload share 1448/1514 of the cap), an MLP 64-512-512-10 (1.2 MB),
3 rounds, a barrier before each round, a round's time being from the barrier to the last rank's
end. The same setting runs here (11 workers, the same model, seed and therefore the same pull plans
(checked against the recorded plans), caps times the payload share, no latency, a barrier before
each round as in the real run) with full-duplex and with half-duplex links (Gloo moves a
pair's two directions one after the other). Compared per S: the round span (from
``result.waits``), each rank's time in each round (from the barrier to the arrival of its last
sent or received transfer, against the measured ``per_rank_s``), and bytes per round (the
strategy's ``protocol_bytes`` accounting: the segments plus a 1-byte finiteness flag per rank and
peer; the accuracy runs of the same JSON give it measured for 8 ranks, which the simulator also
runs).

Outputs (``--out``, default ``benchmarks/results``): ``sim_paper002.json`` (config with
calibration, every run's rows, the tables' numbers) and ``sim_paper002.png`` (accuracy vs virtual
time per worker count, time to target, the fidelity panels).

Usage::

    python -m benchmarks.simulator.paper002            # the full benchmark (about 10 min on 2 cores)
    python -m benchmarks.simulator.paper002 --quick    # smoke run: 6 and 8 workers, a small model (under a minute)
    python -m benchmarks.simulator.paper002 --replot   # redraw the figure and tables from the JSON; run nothing
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.paths import RESULTS
from benchmarks.common.report import command_line, pyplot, save_figure
from benchmarks.simulator.paper002_fidelity import (
    TOLERANCE, fidelity_part, fidelity_table, plan_stats, summarize_fidelity,
)
from benchmarks.simulator.paper002_setting import (
    BATCH_SIZE, EXTRA_EVALS, HIDDEN, LATENCY, LEARNING_RATE, LINK_MBIT, MAX_STEPS, NODE_MBIT, PAPER_SPEEDUP, PERIOD,
    PROBE_ROUNDS, PROTOCOLS, REPLICAS, SEED, SEGMENTS, TARGET, TARGETS, VAL_FRACTION, WORKERS, calibrate, datamodule,
    make_protocol, model,
)
from lightning_dist.sim import NetworkModel, Simulation, SpeedModel
from lightning_dist.sim.report import first_reaching

PREFIX = "sim_paper002"

COLORS = {"fedavg": "tab:green", "gossip": "tab:orange", "segmented": "tab:red"}

# ---------------------------------------------------------------- part 1


def stop_after(target: float, extra: int) -> Any:
    """A ``stop_when`` that ends a run ``extra`` evaluations after the global model first reached ``target``."""

    def stop_when(rows: list[dict[str, float]]) -> bool:
        reached = [i for i, row in enumerate(rows) if row.get("val_acc", -1.0) >= target]
        return bool(reached) and len(rows) - 1 - reached[0] >= extra

    return stop_when


def aggregate_seconds(calibration: dict[str, Any], name: str, workers: int) -> float:
    """The modelled cost of the protocol's one kind of aggregation: the FedAvg server's mean of
    ``workers`` models, or one worker's segment-wise aggregation for (segmented) gossip."""
    return calibration["aggregate_s"][str(workers)] if name == "fedavg" else calibration["merge_s"][name]


def paper_run(workers: int, name: str, args: argparse.Namespace, calibration: dict[str, Any]) -> dict[str, Any]:
    speed = SpeedModel(step_seconds=calibration["step_s"],
                       aggregate_seconds=aggregate_seconds(calibration, name, workers))
    network = NetworkModel(latency=LATENCY, node_mbit=NODE_MBIT, link_mbit=LINK_MBIT)
    simulation = Simulation(model(args.hidden), datamodule(), make_protocol(name, PERIOD), workers=workers,
                            max_steps=args.max_steps, network=network, speed=speed, eval_every=PERIOD,
                            evaluate_workers=False, seed=SEED, stop_when=stop_after(max(args.targets), EXTRA_EVALS))
    result = simulation.run()
    rows = [{key: row[key] for key in ("time", "mean_steps", "bytes", "val_acc", "val_loss", "train_loss")
             if key in row} for row in result.rows]
    summary = result.summary
    return {"name": name, "label": PROTOCOLS[name], "workers": workers, "rows": rows,
            "model_bytes": summary["model_bytes"], "num_parameters": summary["num_parameters"],
            "protocol": summary["protocol"], "virtual_seconds": summary["virtual_seconds"],
            "bytes": summary["bytes"], "steps": summary["steps"], "wall_seconds": summary["wall_seconds"],
            "evaluation_wall_seconds": summary["evaluation_wall_seconds"],
            "mean_step_wall_seconds": summary["mean_step_wall_seconds"],
            "wait_seconds_per_worker": summary["wait_seconds_per_worker"]}


def probe_round_seconds(workers: int, name: str, hidden: int, step_s: float, aggregate_s: float,
                        half_duplex: bool) -> dict[str, float]:
    """Virtual seconds of the first round and of a steady round (mean of rounds 2..PROBE_ROUNDS).

    ``period = 1`` with one modelled step worth ``tau`` steps: the timing of a ``tau = 40`` round
    (it depends on bytes, plans and compute time, not on the models' values) for a few real steps.
    """
    network = NetworkModel(latency=LATENCY, node_mbit=NODE_MBIT, link_mbit=LINK_MBIT, half_duplex_links=half_duplex)
    protocol = make_protocol(name, 1)
    result = Simulation(model(hidden), datamodule(), protocol, workers=workers,
                        max_steps=PROBE_ROUNDS, network=network,
                        speed=SpeedModel(step_seconds=PERIOD * step_s, aggregate_seconds=aggregate_s),
                        eval_every=10**6, evaluate_workers=False, seed=SEED).run()
    ends = []
    for step in range(1, PROBE_ROUNDS + 1):
        waits = [w for w in result.waits if w["step"] == step]
        ends.append(max(w["start"] + w["seconds"] for w in waits))
    # The caps' bound on round 1 (full duplex, fluid sharing): compute, then the busiest node or link;
    # FedAvg: compute, every model into the server, the aggregation, the mean back out.
    model_bytes, node_rate = result.summary["model_bytes"], NODE_MBIT * 1e6 / 8
    if name == "fedavg":
        transfer_s = 2 * max(workers * model_bytes / node_rate, model_bytes / (LINK_MBIT * 1e6 / 8)) + aggregate_s
    else:
        stats = plan_stats(protocol.plan(1)[0], protocol.bounds, model_bytes // result.summary["num_parameters"])
        transfer_s = max(stats["busiest_node_bytes"] / node_rate, stats["busiest_link_bytes"] / (LINK_MBIT * 1e6 / 8))
        transfer_s += aggregate_s
    return {"first_round_s": ends[0], "steady_round_s": (ends[-1] - ends[0]) / (PROBE_ROUNDS - 1),
            "first_round_bound_s": PERIOD * step_s + transfer_s + LATENCY,
            "bytes_per_round": result.summary["bytes"] / PROBE_ROUNDS}


def summarize_paper(part: dict[str, Any]) -> dict[str, Any]:
    targets, target = part["targets"], part["target"]
    table = {}
    for workers, runs in part["runs"].items():
        entry: dict[str, Any] = {}
        for name, run in runs.items():
            rows = run["rows"]
            reach = {f"{t:g}": first_reaching(rows, "val_acc", t) for t in targets}
            hit = next((row for row in rows if row["val_acc"] >= target), None)
            times = [row["time"] for row in rows]
            entry[name] = {
                "seconds_to": reach,
                "rounds_to": {f"{t:g}": (None if (s := first_reaching(rows, "val_acc", t, axis="mean_steps")) is None
                                         else s / PERIOD) for t in targets},
                "mb_to_target": None if hit is None else hit["bytes"] / 1e6,
                # bytes posted between two evaluations (one round), median over the run
                "mb_per_round": statistics.median(b["bytes"] - a["bytes"] for a, b in itertools.pairwise(rows[1:])) / 1e6
                if len(rows) > 2 else None,
                "round_s": statistics.median(b - a for a, b in itertools.pairwise(times[1:])) if len(times) > 2 else None,
                "best_val_acc": max(row["val_acc"] for row in rows),
                "rounds_run": run["steps"] / int(workers) / PERIOD,
                "wall_seconds": run["wall_seconds"],
            }
        for first, second in (("segmented", "fedavg"), ("gossip", "fedavg"), ("segmented", "gossip")):
            speedups = {}
            for t in targets:
                fast = entry.get(first, {}).get("seconds_to", {}).get(f"{t:g}")
                slow = entry.get(second, {}).get("seconds_to", {}).get(f"{t:g}")
                speedups[f"{t:g}"] = slow / fast if fast and slow else None
            entry[f"speedup_{first}_over_{second}"] = speedups
        table[workers] = entry
    return table


def paper_table(report: dict[str, Any]) -> str:
    part = report["paper"]
    summary, target = part["summary"], part["target"]
    key = f"{target:g}"
    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [f"| workers | protocol | t->{key} (s) | rounds | s/round | MB to target | MB/round | best acc |",
             "|---|---|---|---|---|---|---|---|"]
    for workers, entry in summary.items():
        for name, label in PROTOCOLS.items():
            if name not in entry:
                continue
            row = entry[name]
            lines.append(f"| {workers} | {label} | {fmt(row['seconds_to'][key], '.1f')} | "
                         f"{fmt(row['rounds_to'][key], '.0f')} | {fmt(row['round_s'], '.2f')} | "
                         f"{fmt(row['mb_to_target'], '.0f')} | {fmt(row['mb_per_round'], '.1f')} | {row['best_val_acc']:.3f} |")
    lines.append("")
    lines.append("| workers | " + " | ".join(f"SG/FedAvg @{t:g}" for t in part["targets"]) + " | "
                 + " | ".join(f"gossip/FedAvg @{t:g}" for t in part["targets"]) + f" | SG/gossip @{key} | paper SG/FedAvg |")
    lines.append("|---" * (2 + 2 * len(part["targets"]) + 1) + "|")
    for workers, entry in summary.items():
        sg = entry.get("speedup_segmented_over_fedavg", {})
        go = entry.get("speedup_gossip_over_fedavg", {})
        sgg = entry.get("speedup_segmented_over_gossip", {}).get(key)
        paper = PAPER_SPEEDUP.get(int(workers))
        lines.append(f"| {workers} | " + " | ".join(fmt(sg.get(f"{t:g}"), ".2f") + "x" for t in part["targets"])
                     + " | " + " | ".join(fmt(go.get(f"{t:g}"), ".2f") + "x" for t in part["targets"])
                     + f" | {fmt(sgg, '.2f')}x | {fmt(paper, '.2f') + 'x' if paper else '2.25-3.01x (between)'} |")
    lines.append(f"t->A: virtual seconds until the global model (mean of the workers; |D_j|-weighted for gossip) first has val_acc >= A, "
                 f"evaluated every tau={PERIOD} steps just before each synchronisation; rounds = tau-periods of local "
                 "steps by then; s/round: median virtual seconds between evaluations; speedup X/Y = t_Y / t_X")
    return "\n".join(lines)


def probe_table(report: dict[str, Any]) -> str:
    probe = report["paper"].get("probe")
    if not probe:
        return ""
    lines = [("| workers | protocol | round s full duplex: first, steady | round s half duplex: first, steady | "
              "caps bound, round 1 (s) | first full / bound | MB/round |"), "|---|---|---|---|---|---|---|"]
    for workers, entry in probe.items():
        for name, modes in entry.items():
            full, half = modes["full"], modes["half"]
            lines.append(f"| {workers} | {PROTOCOLS[name]} | {full['first_round_s']:.2f}, {full['steady_round_s']:.2f} | "
                         f"{half['first_round_s']:.2f}, {half['steady_round_s']:.2f} | "
                         f"{full['first_round_bound_s']:.2f} | {full['first_round_s'] / full['first_round_bound_s']:.2f} | "
                         f"{full['bytes_per_round'] / 1e6:.1f} |")
    lines.append("round s: virtual seconds per round including tau steps of modelled compute; first: from the start "
                 "(every worker sends at once); steady: mean of rounds 2..4 (FedAvg's server receives the next round's "
                 "models while it still sends the mean); caps bound: tau steps + the busiest node's or link's bytes at "
                 "its cap (FedAvg: + N models in, the aggregation, N out), what fluid sharing of the caps would give")
    return "\n".join(lines)


def paper_part(args: argparse.Namespace, calibration: dict[str, Any]) -> dict[str, Any]:
    runs: dict[str, dict[str, Any]] = {}
    probe: dict[str, dict[str, Any]] = {}
    for workers in args.workers:
        runs[str(workers)] = {}
        probe[str(workers)] = {}
        for name, label in PROTOCOLS.items():
            print(f"part 1: {workers} workers, {label} ...", end=" ", flush=True)
            run = paper_run(workers, name, args, calibration)
            runs[str(workers)][name] = run
            reach = first_reaching(run["rows"], "val_acc", args.target)
            print(f"t->{args.target:g} = {'-' if reach is None else format(reach, '.1f')} s virtual, "
                  f"{run['virtual_seconds']:.1f} s virtual in all, {run['wall_seconds']:.0f} s wall", flush=True)
            probe[str(workers)][name] = {
                mode: probe_round_seconds(workers, name, args.hidden, calibration["step_s"],
                                          aggregate_seconds(calibration, name, workers), mode == "half")
                for mode in ("full", "half")}
    part = {"targets": args.targets, "target": args.target, "runs": runs, "probe": probe}
    part["summary"] = summarize_paper(part)
    return part


# ---------------------------------------------------------------- figure


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    import matplotlib.ticker

    paper, fidelity = report.get("paper"), report.get("fidelity")
    columns = max(3, len(paper["runs"]) if paper else 0)
    fig, axes = plt.subplots(2, columns, figsize=(5 * columns, 9.5), squeeze=False)
    for axis in axes.flat:
        axis.set_visible(False)
    if paper:
        target = paper["target"]
        for column, (workers, runs) in enumerate(paper["runs"].items()):
            axis = axes[0, column]
            axis.set_visible(True)
            for name, run in runs.items():
                rows = run["rows"]
                axis.plot([max(r["time"], 0.05) for r in rows], [r["val_acc"] for r in rows], marker=".",
                          color=COLORS[name], label=PROTOCOLS[name])
                hit = first_reaching(rows, "val_acc", target)
                if hit is not None:
                    axis.axvline(hit, color=COLORS[name], linestyle=":", linewidth=1)
            axis.axhline(target, color="black", linestyle=":", linewidth=1)
            axis.set_xscale("log")
            axis.set_ylim(min(0.8, target - 0.1), 0.99)
            axis.set(xlabel="virtual seconds (log)", ylabel="global model val_acc",
                     title=f"{workers} workers, {NODE_MBIT:g}/{LINK_MBIT:g} Mbit/s, tau={PERIOD}")
            axis.grid(alpha=0.3, which="both")
            axis.legend(fontsize=8, loc="lower right")
        axis = axes[1, 0]
        axis.set_visible(True)
        key = f"{target:g}"
        summary = paper["summary"]
        counts = list(summary)
        width = 0.27
        for offset, name in enumerate(PROTOCOLS):
            values = [summary[w].get(name, {}).get("seconds_to", {}).get(key) or math.nan for w in counts]
            bars = axis.bar([i + (offset - 1) * width for i in range(len(counts))], values, width, color=COLORS[name],
                            label=PROTOCOLS[name])
            if name == "segmented":
                for bar, w in zip(bars, counts):
                    speedup = summary[w]["speedup_segmented_over_fedavg"].get(key)
                    if speedup:
                        axis.annotate(f"{speedup:.1f}x vs FedAvg", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                      ha="center", va="bottom", fontsize=7)
        axis.set_yscale("log")
        axis.set_ylim(top=axis.get_ylim()[1] * 4)  # room for the legend above the bars
        axis.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        axis.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axis.set_xticks(range(len(counts)), [f"{w} workers" for w in counts])
        axis.set(ylabel=f"virtual seconds to val_acc {key} (log)",
                 title="time to target (paper: SG 2.25x-3.01x faster than FedAvg)")
        axis.grid(alpha=0.3, axis="y", which="both")
        axis.legend(fontsize=8, loc="upper left", ncol=2)
    if fidelity:
        rows = fidelity["summary"]
        s = [row["segments"] for row in rows]
        axis = axes[1, 1]
        axis.set_visible(True)
        axis.errorbar(s, [r["measured_s"] for r in rows],
                      yerr=[[r["measured_s"] - r["measured_min_s"] for r in rows],
                            [r["measured_max_s"] - r["measured_s"] for r in rows]],
                      marker="o", color="black", capsize=3, label="measured (netns + htb, Gloo)")
        axis.plot(s, [r["half"]["predicted_s"] for r in rows], marker="x", color="tab:purple",
                  label="simulator, half-duplex links")
        axis.plot(s, [r["full"]["predicted_s"] for r in rows], marker="+", color="tab:blue", linestyle="--",
                  label="simulator, full-duplex links")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log", base=2)
        axis.set_xticks(s, [str(x) for x in s])
        axis.set(xlabel="segments S", ylabel="seconds per round",
                 title=f"fidelity: 11 ranks, R={REPLICAS}, {fidelity['node_mbit']:g}/{fidelity['link_mbit']:g} Mbit/s")
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=8)
        axis = axes[1, 2]
        axis.set_visible(True)
        cmap = plt.get_cmap("viridis")
        top = 0.0
        for index, entry in enumerate(fidelity["sync"]):
            measured = [m for rnd in entry["measured_per_rank_s"] for m in rnd]
            predicted = [p for rnd in entry["sim"]["half"]["per_rank_received_s"] for p in rnd]
            top = max(top, *measured, *predicted)
            axis.scatter(measured, predicted, s=14, color=cmap(index / max(len(fidelity["sync"]) - 1, 1)),
                         label=f"S={entry['segments']}", alpha=0.8)
        axis.plot([0, top * 1.05], [0, top * 1.05], color="black", linewidth=1)
        axis.plot([0, top * 1.05], [0, top * 1.05 * (1 + TOLERANCE)], color="gray", linewidth=0.8, linestyle=":")
        axis.plot([0, top * 1.05], [0, top * 1.05 * (1 - TOLERANCE)], color="gray", linewidth=0.8, linestyle=":")
        axis.set(xlabel="measured seconds (each rank, each round)", ylabel="simulated seconds (half duplex, pulls done)",
                 title="fidelity per rank and round (dotted: +-20%)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


# ---------------------------------------------------------------- main


def print_report(report: dict[str, Any]) -> None:
    calibration = report.get("config", {}).get("calibration")
    if calibration:
        print(f"\ncalibration: MLP 64-{calibration['hidden']}-{calibration['hidden']}-10, "
              f"{calibration['num_parameters']:,} parameters ({calibration['model_bytes'] / 1e6:.2f} MB); step "
              f"{1e3 * calibration['step_s']:.2f} ms ({calibration['step_s_source']}; all steps: median "
              f"{1e3 * calibration['step_median_s']:.2f}, p10 {1e3 * calibration['step_p10_s']:.2f}, "
              f"p90 {1e3 * calibration['step_p90_s']:.2f}); FedAvg aggregation "
              + ", ".join(f"{n}: {1e3 * s:.0f} ms" for n, s in calibration["aggregate_s"].items())
              + "; a worker's gossip aggregation "
              + ", ".join(f"{n}: {1e3 * s:.1f} ms" for n, s in calibration.get("merge_s", {}).items()))
    if report.get("paper"):
        print("\nPart 1: paper 002's study, time to target in virtual seconds")
        print(paper_table(report))
        print("\nRound time probe")
        print(probe_table(report))
    if report.get("fidelity"):
        print("\nPart 2: simulator vs the real capped network (benchmarks/results/segmented_gossip.json)")
        print(fidelity_table(report))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 6 and 8 workers, hidden 128, few steps")
    parser.add_argument("--replot", action="store_true", help="redraw the figure and tables from the JSON; run nothing")
    parser.add_argument("--workers", type=int, nargs="+", default=None, help=f"worker counts (default {WORKERS})")
    parser.add_argument("--hidden", type=int, default=None, help=f"MLP hidden size of part 1 (default {HIDDEN})")
    parser.add_argument("--max-steps", type=int, default=None, help=f"cap on steps per worker (default {MAX_STEPS})")
    parser.add_argument("--targets", type=float, nargs="+", default=TARGETS)
    parser.add_argument("--target", type=float, default=TARGET, help="headline target accuracy")
    parser.add_argument("--step-seconds", type=float, default=None,
                        help="modelled step time instead of the calibrated one (the JSON records which)")
    parser.add_argument("--no-fidelity", action="store_true", help="skip part 2")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.workers = args.workers or ([6, 8] if args.quick else WORKERS)
    args.hidden = args.hidden or (128 if args.quick else HIDDEN)
    args.max_steps = args.max_steps or (240 if args.quick else MAX_STEPS)
    if args.quick and args.targets == TARGETS:
        args.targets, args.target = [0.85, 0.90], 0.90
    if args.target not in args.targets:
        args.targets = sorted({*args.targets, args.target})
    json_path, png_path = args.out / f"{PREFIX}.json", args.out / f"{PREFIX}.png"
    if args.replot:
        report = json.loads(json_path.read_text())
        if report.get("paper"):
            report["paper"]["summary"] = summarize_paper(report["paper"])
        if report.get("fidelity"):
            report["fidelity"]["summary"] = summarize_fidelity(report["fidelity"])
        json_path.write_text(json.dumps(report, indent=1) + "\n")
        plot(report, png_path)
        print_report(report)
        print(f"\nredrew {png_path} from {json_path}")
        return 0

    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    command = command_line(argv)
    import lightning
    import numpy
    import simpy

    print(f"calibrating the step time of MLP 64-{args.hidden}-{args.hidden}-10 ...", flush=True)
    calibration = calibrate(args.hidden, args.workers)
    calibration["measured_step_s"] = calibration["step_s"]
    if args.step_seconds is not None:
        calibration["step_s"] = args.step_seconds
    calibration["step_s_source"] = ("--step-seconds" if args.step_seconds is not None
                                    else "measured, best of 10 block medians")
    print(f"step {1e3 * calibration['step_s']:.2f} ms ({calibration['step_s_source']})", flush=True)
    report: dict[str, Any] = {"config": {
        "command": command, "quick": args.quick, "python": platform.python_version(), "torch": torch.__version__,
        "lightning": lightning.__version__, "simpy": simpy.__version__, "numpy": numpy.__version__,
        "machine": platform.machine(), "date": time.strftime("%Y-%m-%d"), "torch_threads": torch.get_num_threads(),
        "workers": args.workers, "node_mbit": NODE_MBIT, "link_mbit": LINK_MBIT, "latency": LATENCY,
        "period": PERIOD, "segments": SEGMENTS, "replicas": REPLICAS, "fedavg_client_fraction": 1.0,
        "data": {"name": "digits", "batch_size": BATCH_SIZE, "val_fraction": VAL_FRACTION, "partition": "iid"},
        "model": {"hidden_size": args.hidden, "learning_rate": LEARNING_RATE, "momentum": 0.0},
        "seed": SEED, "max_steps": args.max_steps, "extra_evals": EXTRA_EVALS, "targets": args.targets,
        "target": args.target, "paper_speedup": PAPER_SPEEDUP, "calibration": calibration}}
    report["paper"] = paper_part(args, calibration)
    if not args.no_fidelity:
        report["fidelity"] = fidelity_part(args)
    report["config"]["wall_s"] = time.perf_counter() - started
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, png_path)
    print_report(report)
    print(f"\ntotal wall time {report['config']['wall_s']:.0f} s; results in {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
