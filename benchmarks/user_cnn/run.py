"""Every strategy on a model that is not the package's: validation accuracy after 3 epochs, over several launches.

The model is the test suite's stand-in for a user's module (``tests/helpers/user_models.py``: a CNN
on the 8x8 digits with BatchNorm, Dropout, Adam and a StepLR), trained by the suite's fit worker
(``tests/workers/fit.py``) on 4 CPU processes without a network cap: this answers "does the strategy
train my model as well as the others", not "how fast". Every launch runs every method once, in turn.
The averaging strategies are deterministic (the same accuracy every launch); asynchronous DownpourSGD
is not (which rank pushes when depends on the machine), hence ``--launches``.

Reported per method: validation accuracy of each launch, their mean and range, and protocol MB.

Usage::

    python -m benchmarks.user_cnn.run                      # 4 launches, about 2 min
    python -m benchmarks.user_cnn.run --launches 2 --methods downpour downpour_int8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common.paths import REPO, RESULTS
from benchmarks.common.report import pyplot, save_figure, write_json

sys.path.insert(0, str(REPO / "tests"))  # the suite's launcher and its stand-in for a user's module
from helpers.launch import load_results, run_ranks  # noqa: E402

RANKS, EPOCHS = 4, 3


def strategy(cls: str, **kwargs: Any) -> dict[str, Any]:
    return {"class": cls, "kwargs": kwargs}


METHODS = {
    "periodic": strategy("PeriodicAveragingStrategy"),
    "periodic_int8": strategy("PeriodicAveragingStrategy", compression="int8"),
    "dynamic": strategy("DynamicAveragingStrategy"),
    "dynamic_int8": strategy("DynamicAveragingStrategy", compression="int8"),
    "downpour_sync": strategy("DownpourSGDStrategy", synchronous=True),
    "downpour": strategy("DownpourSGDStrategy"),
    "downpour_int8": strategy("DownpourSGDStrategy", compression="int8"),
    "downpour_full_updates": strategy("DownpourSGDStrategy", staleness_aware=False),
}


def launch(methods: list[str], out: Path) -> dict[str, dict[str, float]]:
    runs = [{"name": name, "user_model": True, "strategy": METHODS[name]} for name in methods]
    run_ranks(RANKS, "fit", {"trainer": {"max_epochs": EPOCHS}, "runs": runs}, out, timeout=1800)
    rows = {}
    for name in methods:
        rank0 = load_results(out / name, RANKS)[0]
        if rank0["error"] is not None:
            raise RuntimeError(f"{name}: {rank0['error']}")
        rows[name] = {"val_acc": rank0["callback_metrics"]["val_acc"], "protocol_mb": rank0["comm"].protocol_bytes / 1e6}
    return rows


def summarize(launches: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, Any]]:
    summary = {}
    for name in launches[0]:
        accuracies = [rows[name]["val_acc"] for rows in launches]
        summary[name] = {"val_acc": accuracies, "mean": statistics.fmean(accuracies), "min": min(accuracies),
                         "max": max(accuracies), "protocol_mb": launches[0][name]["protocol_mb"]}
    return summary


def table(summary: dict[str, dict[str, Any]]) -> str:
    lines = ["| method | val_acc per launch | mean | range | protocol MB |", "|---|---|---|---|---|"]
    for name, row in summary.items():
        per_launch = " / ".join(f"{value:.3f}" for value in row["val_acc"])
        lines.append(f"| {name} | {per_launch} | {row['mean']:.3f} | {row['max'] - row['min']:.3f} "
                     f"| {row['protocol_mb']:.3f} |")
    return "\n".join(lines)


def plot(summary: dict[str, dict[str, Any]], path: Path) -> None:
    plt = pyplot()

    names = list(summary)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for index, name in enumerate(names):
        accuracies = summary[name]["val_acc"]
        ax.scatter([index] * len(accuracies), accuracies, color="C0", alpha=0.6)
        ax.hlines(summary[name]["mean"], index - 0.3, index + 0.3, color="C1")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylabel(f"validation accuracy after {EPOCHS} epochs")
    ax.set_title(f"user CNN (BatchNorm, Dropout, Adam, StepLR), {RANKS} ranks: each launch (dots), mean (line)")
    save_figure(fig, path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=4)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.launches < 1:
        parser.error(f"--launches must be >= 1; got {args.launches}")
    start = time.perf_counter()
    launches = []
    with tempfile.TemporaryDirectory() as scratch:
        for index in range(args.launches):
            launches.append(launch(args.methods, Path(scratch) / f"launch{index}"))
            print(f"launch {index + 1}/{args.launches} done at {time.perf_counter() - start:.0f} s", flush=True)
    summary = summarize(launches)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"ranks": RANKS, "epochs": EPOCHS, "methods": {name: METHODS[name] for name in args.methods},
              "launches": launches, "summary": summary, "wall_s": time.perf_counter() - start,
              "date": time.strftime("%Y-%m-%d")}
    write_json(args.out / "user_cnn.json", report)
    plot(summary, args.out / "user_cnn.png")
    print(table(summary))
    print(f"wrote {args.out / 'user_cnn.json'} and user_cnn.png in {report['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
