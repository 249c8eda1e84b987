"""Workers that leave and join (issue 18), in the simulator: accuracy against virtual time under churn.

32 virtual workers train an MLP on scikit-learn digits under each protocol (DDP, periodic averaging,
dynamic averaging, segmented gossip, the asynchronous parameter server). 0, 10, 30 and 50 % of them
churn (``lightning_dist.sim.Churn``): a churning worker stays for an exponential time of mean
``1 / LEAVE_RATE`` virtual seconds, leaves (losing the step it was taking), stays away an
exponential time of mean ``MEAN_ABSENCE`` and rejoins by the protocol's own rule (the simulator's
docstrings). Every run has the same budget of virtual time; the score is the validation accuracy of
the model the run is scored by (the present workers' mean, the server's model), against virtual
time. Each setting runs with several seeds: the seed draws the model's initialization, who churns
and when. The 0 % runs are the same runs without churn (``Churn(fraction=0)`` takes the churn code
path: the same models as no schedule at all, tested; segmented gossip then sends its pull requests,
8 bytes a segment).

Compute is modelled (``STEP_SECONDS`` a step), so virtual times are deterministic; the network is
100 Mbit/s per node with 1 ms latency.

Outputs (``--out``, default ``benchmarks/results``): ``churn.json`` (config, every run's rows and
counters, the table) and ``churn.png`` (accuracy against virtual time per protocol, one line per
churn level, the seeds' mean with their range shaded).

Usage::

    python -m benchmarks.simulator.churn             # the study (about 15 min on 2 cores)
    python -m benchmarks.simulator.churn --quick     # smoke run: 8 workers, a short budget, one seed (under a minute)
    python -m benchmarks.simulator.churn --replot    # redraw the figure and table from the JSON; run nothing
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

import torch

from lightning_dist.data import DigitsDataModule
from lightning_dist.models import MLPClassifier
from lightning_dist.sim import (
    Churn,
    DataParallel,
    DynamicAveraging,
    NetworkModel,
    ParameterServer,
    PeriodicAveraging,
    SegmentedGossip,
    Simulation,
    SpeedModel,
)

from benchmarks.common.paths import RESULTS
from benchmarks.common.report import pyplot, save_figure

PREFIX = "churn"

WORKERS = 32
FRACTIONS = [0.0, 0.1, 0.3, 0.5]
SEEDS = [0, 1, 2]
LEAVE_RATE = 1.0  # leaves per virtual second present: a churning worker stays 1 s (100 steps) on average ...
MEAN_ABSENCE = 1.0  # ... and is away 1 s on average: present half of the time
BUDGET = 6.0  # virtual seconds per run
STEP_SECONDS = 0.01
AGGREGATE_SECONDS = 0.0005
NETWORK = {"latency": 0.001, "node_mbit": 100.0}
TASK = {
    # 1257 training images dealt out iid: 39 per worker; 540 held out.
    "data": {"batch_size": 10, "partition": "iid", "val_fraction": 0.3},
    "model": {"num_features": 64, "num_classes": 10, "hidden_size": 64, "learning_rate": 0.1},
}
PERIOD = 10  # local steps between rounds (periodic, gossip), checks (dynamic) and pushes (parameter server)
PROTOCOLS = {
    "ddp": ("DDP (all-reduce every step)", lambda: DataParallel()),
    "periodic": (f"periodic averaging b={PERIOD}", lambda: PeriodicAveraging(period=PERIOD)),
    "dynamic_avg": (f"dynamic averaging Delta=0.5 b={PERIOD}",
                    lambda: DynamicAveraging(divergence_threshold=0.5, check_every=PERIOD)),
    "segmented_gossip": (f"segmented gossip S=10 R=2 tau={PERIOD}",
                         lambda: SegmentedGossip(segments=10, replicas=2, period=PERIOD)),
    "parameter_server": (f"parameter server (async) push every {PERIOD}, lr 0.0005",
                         lambda: ParameterServer(push_every=PERIOD, staleness_aware=False)),
}
LEARNING_RATE = {"parameter_server": 0.0005}
"""Asynchronous Downpour adds every worker's update in full, 31 server versions stale on average with 32 workers:
without churn, at the task's 0.1 it stays at chance; at 0.002 and 0.001 it reaches 0.70 and 0.83 and then collapses
(to 0.3-0.4 within the 6 s); at 0.0005 it climbs steadily (0.66 at 6 s). Measured before the study, seed 0."""
EVAL_EVERY = {"ddp": 2}
"""Steps per worker between evaluations; DDP's 32-member ring makes its steps about 8x longer than the others'."""
EVALS = 40  # evaluations per run, about every BUDGET / EVALS virtual seconds without churn
LAST = 0.25  # the score: mean accuracy over the last quarter of the budget


def run_one(protocol: str, fraction: float, seed: int, workers: int, budget: float) -> dict[str, Any]:
    """One simulated run; returns its rows and counters."""
    torch.manual_seed(seed)
    learning_rate = LEARNING_RATE.get(protocol, TASK["model"]["learning_rate"])
    model = MLPClassifier(**{**TASK["model"], "learning_rate": learning_rate})
    data = DigitsDataModule(**TASK["data"], seed=0)
    churn = Churn(fraction=fraction, leave_rate=LEAVE_RATE, mean_absence=MEAN_ABSENCE, seed=seed)
    steps_budget = budget / STEP_SECONDS
    simulation = Simulation(
        model, data, PROTOCOLS[protocol][1](), workers=workers, max_steps=10 * int(steps_budget),
        network=NetworkModel(**NETWORK),
        speed=SpeedModel(step_seconds=STEP_SECONDS, aggregate_seconds=AGGREGATE_SECONDS), max_virtual_seconds=budget,
        eval_every=EVAL_EVERY.get(protocol, max(1, int(steps_budget / EVALS))), evaluate_workers=False, seed=seed,
        churn=churn,
    )
    start = time.perf_counter()
    result = simulation.run()
    wall = time.perf_counter() - start
    summary = result.summary
    absent = absent_seconds(result.churn, workers, budget)
    return {
        "protocol": protocol, "fraction": fraction, "seed": seed, "workers": workers,
        "churning": summary["churn"]["churning"], "leaves": summary["churn"]["leaves"],
        "joins": summary["churn"]["joins"],
        "present_share": 1 - absent / (workers * budget),
        "rows": [{key: row[key] for key in ("time", "steps", "bytes", "val_acc", "val_loss") if key in row}
                 for row in result.rows],
        "steps": summary["steps"], "bytes": summary["bytes"], "virtual_seconds": summary["virtual_seconds"],
        "protocol_metrics": summary["protocol_metrics"], "wall_seconds": wall,
    }


def absent_seconds(events: list[dict[str, Any]], workers: int, budget: float) -> float:
    """Worker-seconds away within the budget, from the leave and join events."""
    away, since = 0.0, {}
    for event in events:
        if event["event"] == "leave":
            since[event["worker"]] = event["time"]
        elif event["event"] == "join":
            away += event["time"] - since.pop(event["worker"])
    return away + sum(budget - time for time in since.values())


def on_grid(rows: list[dict[str, float]], grid: list[float]) -> list[float]:
    """Accuracy at each grid time: the last evaluation at or before it (the model a user would have then)."""
    values, index = [], 0
    for point in grid:
        while index + 1 < len(rows) and rows[index + 1]["time"] <= point + 1e-12:
            index += 1
        values.append(rows[index].get("val_acc", math.nan))
    return values


def score(run: dict[str, Any], budget: float) -> float:
    """Mean accuracy of the evaluations in the last ``LAST`` of the budget."""
    values = [row["val_acc"] for row in run["rows"] if row["time"] >= (1 - LAST) * budget and "val_acc" in row]
    return statistics.fmean(values) if values else math.nan


def first_time(run: dict[str, Any], target: float) -> float:
    return next((row["time"] for row in run["rows"] if row.get("val_acc", -1) >= target), math.nan)


def table(runs: list[dict[str, Any]], budget: float) -> list[dict[str, Any]]:
    """Per protocol and churn level: score, time to the no-churn runs' target, steps and bytes against no churn."""
    lines = []
    for protocol in PROTOCOLS:
        base = [run for run in runs if run["protocol"] == protocol and run["fraction"] == 0.0]
        if not base:
            continue
        target = 0.95 * statistics.fmean(score(run, budget) for run in base)
        base_steps = statistics.fmean(run["steps"] for run in base)
        base_bytes = statistics.fmean(run["bytes"] for run in base)
        for fraction in sorted({run["fraction"] for run in runs}):
            chosen = [run for run in runs if run["protocol"] == protocol and run["fraction"] == fraction]
            if not chosen:
                continue
            scores = [score(run, budget) for run in chosen]
            times = [first_time(run, target) for run in chosen]
            reached = [t for t in times if not math.isnan(t)]
            lines.append({
                "protocol": protocol, "fraction": fraction, "seeds": len(chosen),
                "score_mean": statistics.fmean(scores), "score_sd": statistics.pstdev(scores),
                "score_min": min(scores), "score_max": max(scores),
                "target": target, "time_to_target_mean": statistics.fmean(reached) if reached else math.nan,
                "reached": len(reached),
                "present_share": statistics.fmean(run["present_share"] for run in chosen),
                "leaves_mean": statistics.fmean(run["leaves"] for run in chosen),
                "steps_ratio": statistics.fmean(run["steps"] for run in chosen) / base_steps,
                "bytes_ratio": statistics.fmean(run["bytes"] for run in chosen) / base_bytes,
            })
    return lines


def print_table(lines: list[dict[str, Any]]) -> None:
    print(f"{'protocol':<18}{'churn':>6}{'present':>9}{'leaves':>8}{'acc, last 25%':>19}{'t to 95%':>16}"
          f"{'steps':>8}{'bytes':>8}")
    for line in lines:
        t = line["time_to_target_mean"]
        reached = f"{'-' if math.isnan(t) else f'{t:.2f} s'} ({line['reached']}/{line['seeds']})"
        print(f"{line['protocol']:<18}{line['fraction']:>6.0%}{line['present_share']:>9.1%}{line['leaves_mean']:>8.1f}"
              f"{line['score_mean']:>10.3f} +- {line['score_sd']:.3f}{reached:>16}"
              f"{line['steps_ratio']:>7.2f}x{line['bytes_ratio']:>7.2f}x")


def plot(runs: list[dict[str, Any]], budget: float, path: Path) -> None:
    plt = pyplot()

    grid = [budget * index / 200 for index in range(201)]
    fractions = sorted({run["fraction"] for run in runs})
    colors = {fraction: plt.cm.viridis(index / max(1, len(fractions) - 1)) for index, fraction in enumerate(fractions)}
    protocols = [protocol for protocol in PROTOCOLS if any(run["protocol"] == protocol for run in runs)]
    figure, axes = plt.subplots(1, len(protocols), figsize=(4.2 * len(protocols), 3.8), sharey=True, squeeze=False)
    for axis, protocol in zip(axes[0], protocols):
        for fraction in fractions:
            curves = [on_grid(run["rows"], grid) for run in runs
                      if run["protocol"] == protocol and run["fraction"] == fraction]
            if not curves:
                continue
            mean = [statistics.fmean(values) for values in zip(*curves)]
            axis.plot(grid, mean, color=colors[fraction], label=f"{fraction:.0%} churning")
            axis.fill_between(grid, [min(values) for values in zip(*curves)], [max(values) for values in zip(*curves)],
                              color=colors[fraction], alpha=0.15, linewidth=0)
        axis.set(title=PROTOCOLS[protocol][0], xlabel="virtual time (s)")
        axis.grid(alpha=0.3)
    axes[0, 0].set_ylabel("validation accuracy (global model)")
    axes[0, 0].legend(loc="lower right", fontsize=8)
    workers = runs[0]["workers"]
    figure.suptitle(f"{workers} workers, churning ones present {1 / (1 + LEAVE_RATE * MEAN_ABSENCE):.0%} of the time "
                    f"(mean stay {1 / LEAVE_RATE:g} s, absence {MEAN_ABSENCE:g} s); "
                    f"mean of {len({run['seed'] for run in runs})} seeds, range shaded")
    save_figure(figure, path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 workers, 1 virtual second, seed 0")
    parser.add_argument("--replot", action="store_true", help="redraw from the JSON; run nothing")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--protocols", nargs="*", default=list(PROTOCOLS), choices=list(PROTOCOLS))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = args.out / f"{PREFIX}.json", args.out / f"{PREFIX}.png"
    if args.replot:
        saved = json.loads(json_path.read_text())
        budget = saved["config"]["budget"]
        print_table(table(saved["runs"], budget))
        plot(saved["runs"], budget, png_path)
        return
    workers, budget, seeds = (8, 1.0, [0]) if args.quick else (WORKERS, BUDGET, SEEDS)
    runs, start = [], time.perf_counter()
    for protocol in args.protocols:
        for fraction in FRACTIONS:
            for seed in seeds:
                run = run_one(protocol, fraction, seed, workers, budget)
                runs.append(run)
                print(f"{protocol:<18} churn {fraction:>4.0%} seed {seed}: acc {score(run, budget):.3f}, "
                      f"{run['leaves']} leaves, {run['steps']} steps, {run['bytes'] / 1e6:.1f} MB, "
                      f"wall {run['wall_seconds']:.1f} s", flush=True)
    lines = table(runs, budget)
    print_table(lines)
    config = {
        "workers": workers, "fractions": FRACTIONS, "seeds": seeds, "leave_rate": LEAVE_RATE,
        "mean_absence": MEAN_ABSENCE, "budget": budget, "step_seconds": STEP_SECONDS,
        "aggregate_seconds": AGGREGATE_SECONDS, "network": NETWORK, "task": TASK, "period": PERIOD,
        "protocols": {name: label for name, (label, _) in PROTOCOLS.items()}, "learning_rate": LEARNING_RATE,
        "eval_every": EVAL_EVERY, "score": f"mean val_acc over the last "
        f"{LAST:.0%} of the budget", "quick": args.quick, "date": time.strftime("%Y-%m-%d"),
        "machine": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
        "wall_seconds": time.perf_counter() - start,
    }
    json_path.write_text(json.dumps({"config": config, "table": lines, "runs": runs}, indent=1) + "\n")
    plot(runs, budget, png_path)
    print(f"wrote {json_path} and {png_path} in {config['wall_seconds']:.0f} s")


if __name__ == "__main__":
    main()
