"""Benchmark of paper 003's claim: CD-GraB's coordinated example orders train faster than random reshuffling.

Three example orders on the same distributed training (Lightning ``strategy="ddp"``, Gloo on CPU,
``--ranks`` processes, the same seed, learning rate, per-rank batch size, partition and
initialization), each run as ``torchrun`` launches of ``worker.py``:

- ``drr``: D-RR, each rank reshuffles its fixed shard every epoch (``CDGraBSampler(order="random")``,
  no callback), the paper's baseline;
- ``cdgrab``: CD-GraB (``CDGraB()`` + ``CDGraBSampler(order="balanced")``): per-example gradient
  differences all-gathered every step, one shared running sum;
- ``idgrab``: ID-GraB (``CDGraB(mode="independent")``): every rank balances its own differences.

Two tasks, as paper 003's appendix D.1 (SGD with momentum 0.9, learning rate tuned for D-RR
first and then used for all methods):

- ``logreg``: binary logistic regression on a synthetic tabular task shaped like the paper's HMDA
  mortgage data (18 standardized features, ``make_classification`` with 5 % label noise, 10,000
  rows, 80/20 split); 19 parameters;
- ``mlp``: the examples' MLP (40-64-64-10, 7,434 parameters) on MNIST-1D (8,000 samples, 80/20).

Sections (``--sections``):

- ``sweep``: D-RR alone, seed 0, over a learning-rate grid per task, as many epochs as
  ``compare``; picks the rate with the lowest full-train loss (mean of the last 3 epochs).
  ``compare`` uses that rate (or ``--lr``; without a sweep result, the rate in ``TASKS``).
- ``compare``: the three methods x ``--seeds``; one launch per (task, method), the seeds run one
  after the other inside it, so the launch's peak RSS is the method's.
- ``overhead``: the same three methods on 2 ranks (one process per core), few epochs, seed 0: the
  per-step cost of the callback without 4 processes time-slicing 2 cores.

Recorded per epoch (see ``worker.py``): full-train loss/accuracy (rank 0, whole training
split, after the epoch, outside the epoch clock), test loss/accuracy, epoch training time, the
callback's seconds (split into per-example gradients, all-gather, balancing) and bytes.

Outputs (``--out``, default ``benchmarks/results``): ``cdgrab.json``, ``cdgrab.png`` and
``runs/cdgrab_*`` (each launch's spec, log and raw result).

Usage::

    python -m benchmarks.cdgrab.run                       # sweep + compare + overhead (about 22 min on 2 cores)
    python -m benchmarks.cdgrab.run --sections compare    # rerun one section; the others stay in the JSON
    python -m benchmarks.cdgrab.run --quick               # smoke run (one launch, 2 epochs; writes under runs/quick)
    python -m benchmarks.cdgrab.run --replot              # recompute summary, tables and figure from the JSON
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.cdgrab.summary import (
    LABELS, METHODS, TASKS, report_text, summarize_compare, summarize_overhead, summarize_sweep, sweep_table,
)
from benchmarks.common.launch import RunFailed, launch
from benchmarks.common.paths import RESULTS
from benchmarks.common.report import command_line, pyplot, save_figure, write_json

WORKER = Path(__file__).with_name("worker.py")
COLORS = {"drr": "tab:blue", "cdgrab": "tab:red", "idgrab": "tab:green"}

QUICK_DATA = {"logreg": {"seed": 0, "n_samples": 2000}, "mlp": {"seed": 0, "num_samples": 2000}}
OVERHEAD_RANKS = 2
OVERHEAD_EPOCHS = 6


def run_spec(
    task: str, method: str, seed: int, learning_rate: float, epochs: int, data: dict[str, Any]
) -> dict[str, Any]:
    config = TASKS[task]
    spec = {
        "name": f"{task}_{method}_s{seed}_lr{learning_rate:g}",
        "task": task, "method": method, "seed": seed, "epochs": epochs, "learning_rate": learning_rate,
        "momentum": config["momentum"], "batch_size": config["batch_size"], "data": data,
    }
    if "hidden_size" in config:
        spec["hidden_size"] = config["hidden_size"]
    return spec


def run_launch(name: str, runs: list[dict[str, Any]], ranks: int, args: argparse.Namespace) -> dict[str, Any]:
    """One torchrun launch running ``runs`` one after the other; returns its result (or ``{"error": ...}``)."""
    print(f"  {name}: {len(runs)} fit(s) on {ranks} ranks ...", end=" ", flush=True)
    try:
        result = launch({"name": f"cdgrab_{name}", "runs": runs}, ranks, args.out / "runs", timeout=args.timeout,
                        worker=WORKER)
    except RunFailed as exc:
        print("FAILED")
        print(exc, file=sys.stderr)
        return {"name": name, "error": str(exc), "runs": []}
    fits = ", ".join(f"{r['name']} {r['fit_s']:.0f} s" for r in result["runs"])
    print(f"{result['launch_s']:.0f} s ({fits})", flush=True)
    for index, run in enumerate(result["runs"]):  # each fit carries its launch's memory
        run["launch"] = {"name": name, "index": index, "memory": result["memory"], "launch_s": result["launch_s"]}
    return result


# ---------------------------------------------------------------- plot


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    summary = report.get("summary", {})
    tasks = list(summary)
    if not tasks:
        return
    fig, axes = plt.subplots(len(tasks), 3, figsize=(15, 4.2 * len(tasks)), squeeze=False)
    for row, task in zip(axes, tasks):
        s = summary[task]
        offset = s.get("optimum", {}).get("train_loss")  # logreg: plot the excess over the minimum, log scale
        lows, highs = [], []
        for method in METHODS:
            if method not in s["methods"]:
                continue
            curve = s["methods"][method]["curve"]  # from the initial model (epoch -1: 0 epochs, 0 s)
            epochs = [p["epoch"] + 1 for p in curve]  # epochs completed
            seconds = [p["train_s"]["mean"] for p in curve]
            panels = ((row[0], epochs, "train_loss"), (row[1], seconds, "train_loss"), (row[2], epochs, "test_acc"))
            for ax, xs, key in panels:
                shift = offset if (offset is not None and key == "train_loss") else 0.0
                mean = [p[key]["mean"] - shift for p in curve]
                std = [p[key]["std"] for p in curve]
                ax.plot(xs, mean, color=COLORS[method], marker=".", label=LABELS[method])
                ax.fill_between(xs, [a - b for a, b in zip(mean, std)], [a + b for a, b in zip(mean, std)],
                                color=COLORS[method], alpha=0.2)
            tail = [p["train_loss"]["mean"] for p in curve if p["epoch"] >= 1] or [curve[-1]["train_loss"]["mean"]]
            lows.append(min(tail))
            highs.append(max(tail))
        for ax in row[:2]:
            if offset is not None:
                ax.set_yscale("log")
                ax.set_ylabel(f"full-train loss - minimum ({offset:.5f})")
            else:
                pad = 0.1 * (max(highs) - min(lows) or 1e-3)
                ax.set_ylim(min(lows) - pad, max(highs) + pad)  # epoch 1 on; the first epoch's drop flattens the rest
                ax.set_ylabel("full-train loss")
        row[0].set_xlabel("epochs completed")
        row[1].set_xlabel("training seconds (mean over seeds; evaluation excluded)")
        row[2].set_xlabel("epochs completed")
        row[2].set_ylabel("test accuracy")
        seeds = len(s["methods"]["drr"]["seeds"])
        row[0].set_title(f"{task}: {s['title']}\n{s['world_size']} ranks, lr {s['learning_rate']:g}, "
                         f"mean ± std over {seeds} seeds", fontsize=9)
        for ax in row:
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    save_figure(fig, path, dpi=120)


# ---------------------------------------------------------------- main


def logreg_optimum(data: dict[str, Any]) -> dict[str, float]:
    """The minimum of the logistic-regression full-train loss (scikit-learn, no regularization), for excess losses."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import log_loss

    from benchmarks.cdgrab.worker import load_arrays

    x, y, x_test, y_test = load_arrays("logreg", data)
    model = LogisticRegression(C=math.inf, max_iter=10000, tol=1e-10).fit(x, y)
    return {"train_loss": float(log_loss(y, model.predict_proba(x))), "train_acc": float(model.score(x, y)),
            "test_loss": float(log_loss(y_test, model.predict_proba(x_test))),
            "test_acc": float(model.score(x_test, y_test))}


def finish(report: dict[str, Any], out: Path, json_name: str, png_name: str) -> None:
    runs = [r for launch_result in report.get("compare", {}).get("launches", []) for r in launch_result["runs"]]
    report["summary"] = summarize_compare(runs) if runs else {}
    if "logreg" in report["summary"]:
        data = next(r["data"] for r in runs if r["task"] == "logreg")
        reference = report.setdefault("reference", {})
        if reference.get("logreg_data") != data:
            reference.update(logreg_data=data, logreg_optimum=logreg_optimum(data))
        report["summary"]["logreg"]["optimum"] = reference["logreg_optimum"]
    sweep_runs = [r for launch_result in report.get("sweep", {}).get("launches", []) for r in launch_result["runs"]]
    report["sweep_summary"] = summarize_sweep(sweep_runs) if sweep_runs else {}
    overhead_runs = [r for launch_result in report.get("overhead", {}).get("launches", [])
                     for r in launch_result["runs"]]
    report["overhead_summary"] = summarize_overhead(overhead_runs) if overhead_runs else {}
    write_json(out / json_name, report)
    plot(report, out / png_name)
    print()
    print(report_text(report))


def merge_section(previous: dict[str, Any] | None, launches: list[dict[str, Any]], wall_s: float,
                  command: str) -> dict[str, Any]:
    """The section's new launches, plus earlier launches of other names (tasks not rerun) from the JSON."""
    names = {launch_result["name"] for launch_result in launches}
    kept = [old for old in (previous or {}).get("launches", []) if old["name"] not in names]
    history = (previous or {}).get("history", [])
    if previous and "wall_s" in previous:
        history = history + [{"command": previous.get("command"), "wall_s": previous["wall_s"]}]
    return {"launches": kept + launches, "wall_s": wall_s, "command": command, "history": history}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4, help="processes per run (default 4)")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=None, help="epochs of every comparison run (default per task)")
    parser.add_argument("--sweep-epochs", type=int, default=None,
                        help="epochs of the sweep runs (default: the comparison's, per task)")
    parser.add_argument("--lr", nargs="+", default=[], metavar="TASK=LR",
                        help="learning rate per task for compare, overriding the sweep (e.g. mlp=0.03)")
    parser.add_argument("--sections", nargs="+", default=["sweep", "compare", "overhead"],
                        choices=["sweep", "compare", "overhead"])
    parser.add_argument("--out", type=Path, default=None, help="output folder (default benchmarks/results)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: both tasks, small data, 2 epochs, seed 0, one launch; writes under runs/quick")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds allowed per launch")
    parser.add_argument("--replot", action="store_true", help="recompute summary, tables and figure from the JSON")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = RESULTS / ("runs/quick" if args.quick else "")
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "cdgrab.json"
    if args.replot:
        finish(json.loads(json_path.read_text()), args.out, "cdgrab.json", "cdgrab.png")
        return 0

    started = time.perf_counter()
    command = command_line(argv)
    environment: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine()}
    try:
        import lightning
        import torch

        environment.update(torch=torch.__version__, lightning=lightning.__version__)
    except ImportError:
        pass
    report: dict[str, Any] = {}
    if json_path.exists() and not args.quick:
        report = json.loads(json_path.read_text())  # sections not rerun keep their results
    failed = False

    if args.quick:
        runs = [run_spec(task, method, 0, TASKS[task]["learning_rate"], args.epochs or 2, QUICK_DATA[task])
                for task in args.tasks for method in METHODS]
        print(f"quick: {len(runs)} fits in one launch, {args.ranks} ranks")
        result = run_launch("quick", runs, args.ranks, args)
        report = {"config": {"quick": True, "ranks": args.ranks, "command": command, **environment},
                  "compare": {"launches": [result]}}
        failed = "error" in result
        finish(report, args.out, "cdgrab.json", "cdgrab.png")
        print(f"\ntotal wall time {time.perf_counter() - started:.0f} s; results in {args.out}")
        return 1 if failed else 0

    overrides = {key: float(value) for key, value in (item.split("=", 1) for item in args.lr)}
    if "sweep" in args.sections:
        print(f"sweep: D-RR, seed 0, {args.ranks} ranks")
        t0 = time.perf_counter()
        launches = []
        for task in args.tasks:
            epochs = args.sweep_epochs or args.epochs or TASKS[task]["epochs"]
            runs = [run_spec(task, "drr", 0, lr, epochs, TASKS[task]["data"]) for lr in TASKS[task]["grid"]]
            launches.append(run_launch(f"sweep_{task}", runs, args.ranks, args))
        failed |= any("error" in r for r in launches)
        report["sweep"] = merge_section(report.get("sweep"), launches, time.perf_counter() - t0, command)
        report["sweep_summary"] = summarize_sweep([r for result in report["sweep"]["launches"] for r in result["runs"]])
        print(sweep_table(report["sweep_summary"]))
    selected = {task: s["selected"] for task, s in report.get("sweep_summary", {}).items() if s.get("selected")}
    rates = {task: overrides.get(task, selected.get(task, TASKS[task]["learning_rate"])) for task in TASKS}

    if "compare" in args.sections:
        print(f"compare: {METHODS} x seeds {args.seeds}, {args.ranks} ranks, learning rates {rates}")
        t0 = time.perf_counter()
        launches = []
        for task in args.tasks:
            epochs = args.epochs or TASKS[task]["epochs"]
            for method in METHODS:
                runs = [run_spec(task, method, seed, rates[task], epochs, TASKS[task]["data"]) for seed in args.seeds]
                launches.append(run_launch(f"{task}_{method}", runs, args.ranks, args))
        failed |= any("error" in r for r in launches)
        report["compare"] = merge_section(report.get("compare"), launches, time.perf_counter() - t0, command)
        report["compare"]["learning_rates"] = {**report["compare"].get("learning_rates", {}),
                                               **{task: rates[task] for task in args.tasks}}

    if "overhead" in args.sections:
        print(f"overhead: {METHODS} on {OVERHEAD_RANKS} ranks, {OVERHEAD_EPOCHS} epochs, seed 0")
        t0 = time.perf_counter()
        launches = []
        for task in args.tasks:
            runs = [run_spec(task, method, 0, rates[task], OVERHEAD_EPOCHS, TASKS[task]["data"]) for method in METHODS]
            launches.append(run_launch(f"overhead_{task}", runs, OVERHEAD_RANKS, args))
        failed |= any("error" in r for r in launches)
        report["overhead"] = merge_section(report.get("overhead"), launches, time.perf_counter() - t0, command)

    previous_tasks = report.get("config", {}).get("tasks", {})
    report["config"] = {**report.get("config", {}), "ranks": args.ranks,
                        "tasks": {**previous_tasks, **{t: TASKS[t] for t in args.tasks}},
                        "methods": METHODS, "seeds": args.seeds, "last_command": command, **environment,
                        "last_wall_s": time.perf_counter() - started}
    finish(report, args.out, "cdgrab.json", "cdgrab.png")
    print(f"\ntotal wall time {time.perf_counter() - started:.0f} s; results in {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
