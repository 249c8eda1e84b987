"""Benchmark of paper 002's claims for segmented gossip, on a real capped network (``benchmarks/common/netns.py``).

Every rank runs in its own network namespace behind an htb-capped veth port (one torchrun per
node, Gloo over the namespaces' eth0), so every byte of the protocols crosses a slow network.
Paper 002 simulates 100 Mbit/s per node and 10 Mbit/s per link; this machine runs the same
ratio scaled by 1/5 (20 and 2 Mbit/s; ``--node-mbit``, ``--link-mbit``), which keeps the
kernel's shaping work small next to the training on 2 cores.

Part 1, synchronisation time per round against the number of segments ``S`` (replicas ``R = 2``),
on ``--sync-ranks`` (11) ranks: each rank pulls ``S * R`` segments; with 11 ranks they come from
``min(S R, 10)`` different peers, each over its own 2 Mbit/s link, and 10 links are exactly the
20 Mbit/s node cap. So the caps predict ``M / (S * link)`` for ``S <= 5`` (doubling ``S`` halves the
time) and the node cap ``R M / node`` from ``S = 5`` on, the crossover of paper 002's Fig. 4(b).
Rank 0 computes each round's bound from its actual pull plan (busiest link, busiest node), and a
second bound for Gloo, which moves the two directions of a pair of ranks one after the other
(measured: 1.2 MB each way between two ranks takes twice the one-way time; two plain TCP
streams on one connection do not), so a pair that exchanges segments both ways takes the sum.

Part 2, time to a target accuracy of the averaged model, on ``--ranks`` (8) ranks, all with the
same task, seed and wall-clock budget: Lightning's DDP (gradient all-reduce every step),
periodic averaging (all-reduce every ``tau`` steps), FedAvg (``C = 0.5``, a star through the
lowest participant every ``tau`` steps), plain gossip (``S = 1, R = 2``) and segmented gossip
(``S = 10, R = 2``), ``tau = 40`` (paper 002's). The worker copies every rank's parameters every
few steps and evaluates the mean after fit, so evaluation costs no network time.

Outputs (``--out``, default ``benchmarks/results``): ``segmented_gossip.json`` (config, summaries,
every run's rounds and accuracy curve), ``segmented_gossip.png`` (sync time vs S; accuracy vs
wall-clock time), and ``runs/segmented_gossip_*`` (specs, per-node logs, raw results).

Usage::

    python -m benchmarks.segmented_gossip.run                  # both parts, about 13.5 min on 2 cores
    python -m benchmarks.segmented_gossip.run --quick          # smoke run (5 and 4 ranks, short budget), about 3.5 min
    python -m benchmarks.segmented_gossip.run --sync-only      # part 1 only (about 3.5 min)
    python -m benchmarks.segmented_gossip.run --accuracy-only  # part 2 only (about 10 min)
    python -m benchmarks.segmented_gossip.run --replot         # redraw the figure and tables from the JSON

Exits 77 with a message where network namespaces cannot be built (not root, no ``ip``/``tc``).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import netns
from benchmarks.common.launch import RunFailed, launch_on_network
from benchmarks.common.paths import RESULTS
from benchmarks.common.report import chosen, command_line, pyplot, save_figure, write_json

WORKER = Path(__file__).with_name("worker.py")
PREFIX = "segmented_gossip"
# Paper 002: 100 Mbit/s per node, 10 per link. Scaled by 1/5, same ratio.
NODE_MBIT = 20.0
LINK_MBIT = 2.0
# The task of every run: scikit-learn digits (1257 training images split iid over the ranks, 540
# held out), an MLP 64-512-512-10 (301,066 parameters, 1.2 MB: a round of plain gossip moves one
# model per link, 5 s at 2 Mbit/s, while 40 local steps take about a second), plain SGD.
TASK: dict[str, Any] = {
    "data": {"batch_size": 10, "partition": "iid", "val_fraction": 0.3},
    "model": {"hidden_size": 512, "learning_rate": 0.1, "momentum": 0.0},
    "seed": 0,
}
SYNC_RANKS = 11
SEGMENTS = [1, 2, 4, 5, 10]
REPLICAS = 2
SYNC_ROUNDS = 3
RANKS = 8
PERIOD = 40  # tau, paper 002's synchronisation interval
BUDGET_S = 90.0
SNAPSHOT_EVERY = 8  # steps between parameter copies of the local-update runs (DDP: every step)
TARGETS = [0.90, 0.93, 0.95]
TARGET = 0.95  # the headline target: near convergence (final accuracy about 0.967), as paper 002's 80% is near its 82%
PAPER_SPEEDUP = 2.0  # paper 002: segmented gossip reaches the target at least ~2x faster than FedAvg
FEDAVG_FRACTION = 0.5
MASTER_PORT = 29610


def methods(args: argparse.Namespace) -> list[dict[str, Any]]:
    gossip = lambda segments: {"class": "SegmentedGossipStrategy",  # noqa: E731
                               "kwargs": {"segments": segments, "replicas": args.replicas, "period": args.period}}
    runs = [
        {"name": "ddp", "kind": "ddp", "label": "DDP (gradient all-reduce every step)", "snapshot_every": 1},
        {"name": "periodic", "kind": "periodic", "label": f"periodic averaging (all-reduce every {args.period})",
         "strategy": {"class": "PeriodicAveragingStrategy", "kwargs": {"period": args.period}}},
        {"name": "fedavg", "kind": "fedavg", "label": f"FedAvg C={FEDAVG_FRACTION:g} (star every {args.period})",
         "strategy": {"class": "PeriodicAveragingStrategy",
                      "kwargs": {"period": args.period, "client_fraction": FEDAVG_FRACTION}}},
        {"name": "gossip", "kind": "gossip", "label": f"gossip S=1 R={args.replicas}", "strategy": gossip(1)},
        {"name": "segmented", "kind": "segmented",
         "label": f"segmented gossip S={args.gossip_segments} R={args.replicas}",
         "strategy": gossip(args.gossip_segments)},
    ]
    for run in runs:
        run.setdefault("snapshot_every", SNAPSHOT_EVERY)
        run["budget_s"] = args.budget
    return chosen(runs, args.methods)


# ---------------------------------------------------------------- launching on the network


# ---------------------------------------------------------------- part 1: sync time vs segments


def sync_part(args: argparse.Namespace) -> dict[str, Any]:
    runs = [{"name": f"S{segments}", "segments": segments, "replicas": args.replicas, "rounds": args.sync_rounds}
            for segments in args.segments]
    spec = {"name": f"{PREFIX}_sync", "mode": "sync", **task(args), "caps": caps(args), "runs": runs}
    print(f"part 1: sync time per round, {args.sync_ranks} ranks (one namespace each), caps {caps_text(args)}, "
          f"R={args.replicas}, S in {args.segments}, {args.sync_rounds} rounds each ...", flush=True)
    with netns.Network(nodes=args.sync_ranks, node_mbit=args.node_mbit, link_mbit=args.link_mbit) as network:
        raw = launch_on_network(network, spec, args.out / "runs", timeout=args.timeout, port=MASTER_PORT, worker=WORKER)
    print(f"part 1 done in {raw['launch_s']:.0f} s", flush=True)
    return {"launch_s": raw["launch_s"], "ranks": args.sync_ranks, "summary": summarize_sync(raw["runs"]),
            "runs": raw["runs"]}


def summarize_sync(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    base = None
    for run in runs:
        spans = [r["span_s"] for r in run["rounds"]]
        median = lambda key: statistics.median(r[key] for r in run["rounds"])  # noqa: E731
        row = {"segments": run["segments"], "replicas": run["replicas"], "world_size": run["world_size"],
               "model_bytes": run["model_bytes"], "links_used_per_round": median("links_used"),
               "two_way_pairs_per_round": median("two_way_pairs"),
               "link_bound_s": median("link_bound_s"), "node_bound_s": median("node_bound_s"),
               "expected_s": median("bound_s"), "gloo_expected_s": median("gloo_bound_s"),
               "measured_s": statistics.median(spans),
               "measured_min_s": min(spans), "measured_max_s": max(spans), "rounds": len(spans)}
        row["measured_over_expected"] = row["measured_s"] / row["expected_s"]
        row["measured_over_gloo_expected"] = row["measured_s"] / row["gloo_expected_s"]
        if base is None and run["segments"] == 1:
            base = row
        rows.append(row)
    for row in rows:
        if base is not None:
            row["speedup_vs_s1"] = base["measured_s"] / row["measured_s"]
            row["expected_speedup_vs_s1"] = base["expected_s"] / row["expected_s"]
    return rows


def sync_table(part: dict[str, Any]) -> str:
    header = (f"{'S':>3} {'R':>2} {'links':>5} {'2-way':>5} {'per-link':>9} {'per-node':>9} {'expected':>9} "
              f"{'Gloo pair':>10} {'measured':>9} {'(min-max)':>13} {'meas/exp':>9} {'meas/Gloo':>10} "
              f"{'speedup vs S=1':>15} {'(expected)':>10}")
    lines = [header, "-" * len(header)]
    for row in part["summary"]:
        lines.append(
            f"{row['segments']:>3} {row['replicas']:>2} {row['links_used_per_round']:>5.0f} "
            f"{row['two_way_pairs_per_round']:>5.0f} {row['link_bound_s']:>8.2f}s {row['node_bound_s']:>8.2f}s "
            f"{row['expected_s']:>8.2f}s {row['gloo_expected_s']:>9.2f}s {row['measured_s']:>8.2f}s "
            f"{row['measured_min_s']:>6.2f}-{row['measured_max_s']:<5.2f}s {row['measured_over_expected']:>9.2f} "
            f"{row['measured_over_gloo_expected']:>10.2f} {row.get('speedup_vs_s1', math.nan):>14.2f}x "
            f"{row.get('expected_speedup_vs_s1', math.nan):>9.2f}x")
    first = part["summary"][0]
    lines.append(f"{part['ranks']} ranks, model {first['model_bytes'] / 1e6:.3f} MB. links: (provider, puller) pairs "
                 "used in a round; 2-way: pairs of ranks with segments going both ways; per-link / per-node: busiest "
                 "link / node at the capped rates; expected = the larger; Gloo pair: busiest pair of ranks with its "
                 "two "
                 "directions one after the other (Gloo), or the node bound if larger; measured: median over rounds, "
                 "from the barrier before a round to the last rank's end")
    return "\n".join(lines)


# ---------------------------------------------------------------- part 2: time to accuracy


def accuracy_part(args: argparse.Namespace) -> dict[str, Any]:
    runs = methods(args)
    spec = {"name": f"{PREFIX}_accuracy", "mode": "accuracy", **task(args), "caps": caps(args), "runs": runs}
    print(f"part 2: time to accuracy, {args.ranks} ranks, caps {caps_text(args)}, tau={args.period}, "
          f"{args.budget:g} s of training per method: {', '.join(r['name'] for r in runs)} ...", flush=True)
    timeout = len(runs) * (args.budget + 150) + 180
    with netns.Network(nodes=args.ranks, node_mbit=args.node_mbit, link_mbit=args.link_mbit) as network:
        raw = launch_on_network(network, spec, args.out / "runs", timeout=timeout, port=MASTER_PORT + 1, worker=WORKER)
    print(f"part 2 done in {raw['launch_s']:.0f} s", flush=True)
    labels = {run["name"]: run["label"] for run in runs}
    for run in raw["runs"]:
        run["label"] = labels[run["name"]]
    return {"launch_s": raw["launch_s"], "ranks": args.ranks,
            "summary": summarize_accuracy(raw["runs"], config(args)), "runs": raw["runs"]}


def first_reach(curve: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    return next((point for point in curve if point["val_acc"] >= target), None)


def expected_round_s(run: dict[str, Any], config: dict[str, Any], key: str = "bound_s") -> float | None:
    """Shortest time the caps allow for one synchronisation (DDP: one step's gradient all-reduce).

    Rings and stars move data one way between any two ranks, so Gloo's pair serialization does not
    apply to them; for gossip ``key="gloo_bound_s"`` gives the bound with it.
    """
    link = netns_payload(min(config["link_mbit"], config["node_mbit"]))
    node = netns_payload(config["node_mbit"])
    size, world = run["model_bytes"], run["world_size"]
    if run["kind"] in ("ddp", "periodic"):  # Gloo's ring all-reduce: 2 (m-1)/m of the model to one neighbour
        return 2 * (world - 1) / world * size / link
    if run["kind"] == "fedavg":  # star: k-1 models into the coordinator, then the mean back out
        members = max(round(config["fedavg_client_fraction"] * world), 1)
        return 2 * max(size / link, (members - 1) * size / node)
    bounds = [bound[key] for bound in run["round_bounds"]]
    return statistics.median(bounds) if bounds else None


def netns_payload(mbit: float) -> float:
    return mbit * 1e6 / 8 * 1448 / 1514


def summarize_accuracy(runs: list[dict[str, Any]], config: dict[str, Any]) -> dict[str, Any]:
    targets, target = config["targets"], config["target"]
    rows = {}
    for run in runs:
        # A round lasts until its slowest rank is done (the others meet it at the next collective).
        rounds = [max(per_rank) for per_rank in zip(*run["round_s_per_rank"])]
        reach = {f"{t:g}": first_reach(run["curve"], t) for t in targets}
        row = {
            "label": run["label"], "steps": run["steps"], "fit_s": run["fit_s"],
            "syncs": run["steps"] if run["kind"] == "ddp" else len(run["round_steps"]),
            "mean_step_s": run["mean_step_s"],
            "mean_round_s": (statistics.mean(rounds) if rounds
                             else run["mean_step_s"] if run["kind"] == "ddp" else None),
            "expected_round_s": expected_round_s(run, config),
            "gloo_expected_round_s": expected_round_s(run, config, "gloo_bound_s"),
            "final_val_acc": run["final_val_acc"], "best_val_acc": max(p["val_acc"] for p in run["curve"]),
            "seconds_to": {t: (p["seconds"] if p else None) for t, p in reach.items()},
            "steps_to": {t: (p["step"] if p else None) for t, p in reach.items()},
            "protocol_bytes": run.get("protocol_bytes"),
        }
        if run["kind"] != "ddp":
            row["compute_step_s"] = (run["fit_s"] - sum(rounds)) / max(run["steps"], 1)
        rows[run["name"]] = row
    ratios: dict[str, dict[str, float | None]] = {}
    if "segmented" in rows:
        for name, row in rows.items():
            ratios[name] = {}
            for t in row["seconds_to"]:
                mine, theirs = row["seconds_to"][t], rows["segmented"]["seconds_to"][t]
                ratios[name][t] = mine / theirs if mine and theirs else None
    headline = ratios.get("fedavg", {}).get(f"{target:g}")
    return {
        "targets": targets, "target": target, "rows": rows,
        "time_ratio_vs_segmented": ratios,
        "ratio_definition": "seconds to the target of the method / seconds to the target of segmented gossip "
                            "(>1: segmented gossip is faster; None: one of them did not reach it within the budget)",
        "fedavg_over_segmented": headline,
        "paper_claim": f"segmented gossip reaches the target at least {PAPER_SPEEDUP:g}x faster than FedAvg",
        "paper_claim_met": None if headline is None else headline >= PAPER_SPEEDUP,
    }


def accuracy_table(part: dict[str, Any]) -> str:
    summary = part["summary"]
    targets = list(next(iter(summary["rows"].values()))["seconds_to"])
    header = (f"{'method':<38} {'steps':>6} {'syncs':>5} {'sync s':>7} {'expected':>8} {'Gloo pair':>9} {'step s':>7} "
              f"{'final':>6} {'best':>6} " + " ".join(f"{'t->' + t:>8}" for t in targets)
              + f" {'x vs seg @' + format(summary['target'], 'g'):>13}")
    lines = [header, "-" * len(header)]
    ratios = summary["time_ratio_vs_segmented"]
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for name, row in summary["rows"].items():
        reach = " ".join(f"{(fmt(row['seconds_to'][t], '.1f') + ('s' if row['seconds_to'][t] else '')):>8}"
                         for t in targets)
        ratio = ratios.get(name, {}).get(f"{summary['target']:g}")
        lines.append(
            f"{row['label']:<38} {row['steps']:>6} {row['syncs']:>5} {fmt(row['mean_round_s'], '.2f'):>7} "
            f"{fmt(row['expected_round_s'], '.2f'):>8} {fmt(row['gloo_expected_round_s'], '.2f'):>9} "
            f"{fmt(row.get('compute_step_s', row['mean_step_s']), '.3f'):>7} "
            f"{row['final_val_acc']:>6.3f} {row['best_val_acc']:>6.3f} {reach} "
            f"{fmt(ratio, '.2f') + ('x' if ratio else ''):>13}")
    lines.append("sync s = mean over rounds of the slowest rank's time in the round (DDP: mean step); "
                 "expected: the caps' bound "
                 "(median over rounds); Gloo pair: the same with each pair's two directions one after the other; "
                 "step s = local compute per "
                 "step (DDP: whole step); t->A = wall-clock seconds of training until the averaged model first "
                 "reaches accuracy A ('-' = not within the budget); x vs seg = t->target / segmented gossip's")
    headline = summary["fedavg_over_segmented"]
    lines.append(f"FedAvg / segmented gossip time to {summary['target']:g}: "
                 + ("not measurable (a run did not reach the target)" if headline is None else f"{headline:.2f}x")
                 + f"; paper 002 claims >= {PAPER_SPEEDUP:g}x: "
                 + {None: "undecided", True: "met", False: "NOT met"}[summary["paper_claim_met"]])
    return "\n".join(lines)


# ---------------------------------------------------------------- figure


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    import matplotlib.ticker

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    sync = report.get("sync")
    if sync:
        rows = sync["summary"]
        s = [row["segments"] for row in rows]
        measured = [row["measured_s"] for row in rows]
        errors = [[m - row["measured_min_s"] for m, row in zip(measured, rows)],
                  [row["measured_max_s"] - m for m, row in zip(measured, rows)]]
        left.errorbar(s, measured, yerr=errors, marker="o", color="tab:red", capsize=3,
                      label="measured (median, min-max)")
        left.plot(s, [row["expected_s"] for row in rows], color="black", marker="x",
                  label="expected: max of both bounds")
        left.plot(s, [row["gloo_expected_s"] for row in rows], color="tab:purple", marker="+", linestyle=":",
                  label="expected with Gloo's one-way-at-a-time pairs")
        left.plot(s, [row["link_bound_s"] for row in rows], color="tab:blue", linestyle="--", label="per-link bound")
        left.plot(s, [row["node_bound_s"] for row in rows], color="tab:green", linestyle="--", label="per-node bound")
        left.set_xscale("log", base=2)
        left.set_yscale("log", base=2)
        left.set_xticks(s, [str(x) for x in s])
        left.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        left.set_xlabel("segments S")
        left.set_ylabel("seconds per round")
        config = report["config"]
        left.set_title(f"sync time per round, {sync['ranks']} ranks, R={rows[0]['replicas']}, "
                       f"{config['node_mbit']:g}/{config['link_mbit']:g} Mbit/s node/link", fontsize=10)
        left.grid(True, which="both", alpha=0.3)
        left.legend(fontsize=8)
    accuracy = report.get("accuracy")
    if accuracy:
        colors = {"ddp": "tab:gray", "periodic": "tab:blue", "fedavg": "tab:green", "gossip": "tab:orange",
                  "segmented": "tab:red"}
        target = accuracy["summary"]["target"]
        for run in accuracy["runs"]:
            xs = [p["seconds"] for p in run["curve"]]
            ys = [p["val_acc"] for p in run["curve"]]
            right.plot(xs, ys, color=colors.get(run["name"]), linewidth=1.3,
                       label=f"{run['label']}: {run['steps']} steps, final {run['final_val_acc']:.3f}")
            hit = first_reach(run["curve"], target)
            if hit:
                right.plot(hit["seconds"], hit["val_acc"], marker="o", color=colors.get(run["name"]),
                           markeredgecolor="black")
        right.axhline(target, color="black", linestyle=":", linewidth=1)
        right.set_ylim(0.3, 1.0)
        right.set_xlabel("wall-clock seconds of training")
        right.set_ylabel("validation accuracy of the averaged model")
        right.set_title(f"digits, {accuracy['ranks']} ranks, tau={report['config']['period']}: "
                        f"accuracy vs time (dot: first >= {target:g})", fontsize=10)
        right.grid(True, alpha=0.3)
        right.legend(fontsize=8, loc="center right")
    save_figure(fig, path, dpi=130)


# ---------------------------------------------------------------- main


def task(args: argparse.Namespace) -> dict[str, Any]:
    return {"data": dict(TASK["data"]),
            "model": {**TASK["model"], "hidden_size": args.hidden, "learning_rate": args.lr}, "seed": TASK["seed"]}


def config(args: argparse.Namespace) -> dict[str, Any]:
    """The settings the summaries are computed from (stored in the JSON, so ``--replot`` recomputes them)."""
    return {**task(args), "node_mbit": args.node_mbit, "link_mbit": args.link_mbit, "payload_share": 1448 / 1514,
            "replicas": args.replicas, "period": args.period, "fedavg_client_fraction": FEDAVG_FRACTION,
            "budget_s": args.budget, "targets": args.targets, "target": args.target}


def caps(args: argparse.Namespace) -> dict[str, float]:
    return {"node_mbit": args.node_mbit, "link_mbit": args.link_mbit}


def caps_text(args: argparse.Namespace) -> str:
    return f"{args.node_mbit:g} Mbit/s per node, {args.link_mbit:g} per link"


def print_report(report: dict[str, Any]) -> None:
    if report.get("sync"):
        print("\nPart 1: synchronisation time per round vs segments")
        print(sync_table(report["sync"]))
    if report.get("accuracy"):
        print("\nPart 2: time to accuracy")
        print(accuracy_table(report["accuracy"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 5 ranks for part 1 (S = 1, 2, 4), "
                        "4 for part 2, 15 s per method, a smaller model")
    parser.add_argument("--sync-only", action="store_true", help="part 1 only (keeps part 2 of an existing JSON)")
    parser.add_argument("--accuracy-only", action="store_true", help="part 2 only (keeps part 1 of an existing JSON)")
    parser.add_argument("--replot", action="store_true", help="redraw the figure and tables from the JSON; run nothing")
    parser.add_argument("--node-mbit", type=float, default=NODE_MBIT)
    parser.add_argument("--link-mbit", type=float, default=LINK_MBIT)
    parser.add_argument("--sync-ranks", type=int, default=None, help=f"ranks of part 1 (default {SYNC_RANKS})")
    parser.add_argument("--segments", type=int, nargs="+", default=None,
                        help=f"S values of part 1 (default {SEGMENTS})")
    parser.add_argument("--sync-rounds", type=int, default=None, help=f"rounds per S (default {SYNC_ROUNDS})")
    parser.add_argument("--replicas", type=int, default=REPLICAS, help=f"R of every gossip run (default {REPLICAS})")
    parser.add_argument("--ranks", type=int, default=None, help=f"ranks of part 2 (default {RANKS})")
    parser.add_argument("--methods", nargs="+", default=None, help="method names (default: all)")
    parser.add_argument("--gossip-segments", type=int, default=10, help="S of the segmented gossip run of part 2")
    parser.add_argument("--period", type=int, default=PERIOD, help="tau of the averaging and gossip runs")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds of training per method (default {BUDGET_S:g})")
    parser.add_argument("--hidden", type=int, default=None,
                        help=f"MLP hidden size (default {TASK['model']['hidden_size']})")
    parser.add_argument("--lr", type=float, default=TASK["model"]["learning_rate"])
    parser.add_argument("--targets", type=float, nargs="+", default=TARGETS)
    parser.add_argument("--target", type=float, default=TARGET, help="headline target accuracy")
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed for part 1's launch")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    quick = args.quick
    args.sync_ranks = args.sync_ranks or (5 if quick else SYNC_RANKS)
    args.segments = args.segments or ([1, 2, 4] if quick else SEGMENTS)
    args.sync_rounds = args.sync_rounds or (2 if quick else SYNC_ROUNDS)
    args.ranks = args.ranks or (4 if quick else RANKS)
    args.budget = args.budget or (15.0 if quick else BUDGET_S)
    args.hidden = args.hidden or (256 if quick else TASK["model"]["hidden_size"])
    if args.target not in args.targets:
        args.targets = sorted({*args.targets, args.target})
    methods(args)  # refuses a --methods name it does not define, before any launch
    json_path, png_path = args.out / f"{PREFIX}.json", args.out / f"{PREFIX}.png"
    if args.replot:
        report = json.loads(json_path.read_text())
        if report.get("sync") and "runs" in report["sync"]:
            report["sync"]["summary"] = summarize_sync(report["sync"]["runs"])
        if report.get("accuracy") and "runs" in report["accuracy"]:
            report["accuracy"]["summary"] = summarize_accuracy(report["accuracy"]["runs"], report["config"])
        write_json(json_path, report)
        plot(report, png_path)
        print_report(report)
        return 0

    netns.require_network("benchmarks.segmented_gossip.run")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    command = command_line(argv)
    report: dict[str, Any] = {}
    if (args.sync_only or args.accuracy_only) and json_path.exists():
        report = json.loads(json_path.read_text())  # keep the other part
    import lightning
    import torch

    report["config"] = {**config(args),
                        "quick": quick, "command": command, "python": platform.python_version(),
                        "torch": torch.__version__, "lightning": lightning.__version__,
                        "date": time.strftime("%Y-%m-%d")}
    failed = False
    for part, enabled, run_part in (("sync", not args.accuracy_only, sync_part),
                                    ("accuracy", not args.sync_only, accuracy_part)):
        if not enabled:
            continue
        try:
            report[part] = run_part(args)
        except RunFailed as exc:
            print(f"FAILED: {exc}", file=sys.stderr)
            report[part] = {"error": str(exc)}
            failed = True
    report["config"]["wall_s"] = time.perf_counter() - started
    write_json(json_path, report)
    ok = {key: value for key, value in report.items() if not (isinstance(value, dict) and "error" in value)}
    plot(ok, png_path)
    print_report(ok)
    print(f"\ntotal wall time {report['config']['wall_s']:.0f} s; results in {json_path} and {png_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
