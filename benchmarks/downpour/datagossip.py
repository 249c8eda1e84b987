"""DataGossip on skewed and balanced partitions, with DownpourSGD as the base (paper 000's study).

Every run is one ``torchrun`` launch of ``_downpour_worker.py``: asynchronous DownpourSGD on
``--ranks`` CPU processes (Gloo), scikit-learn digits, the MLP of the examples, plain SGD. Rank 0
copies the server's global model every 0.25 s; the copies are evaluated on the validation split
after fit, which gives accuracy against wall-clock time. DataGossip runs fully asynchronously, as
in the paper (``wait_for_exchange=False``).

Runs, each repeated for every seed in ``--seeds`` (paper 000: 3 repetitions, mean and std):

- skewed (``class_sorted``: the training set sorted by label and cut into equal contiguous
  shards, paper 000's skew): the baseline (no DataGossip); DataGossip with active_bias at f = 4
  (the paper's default) and f = 1 (its advice for known skew); random, hem and spl at f = 1;
- balanced (``iid``): the baseline and DataGossip with active_bias at f = 4.

Reported, per configuration, mean and std over seeds of:

- ``acc_at_baseline_end``: the accuracy of the server's model at the time the same seed's
  baseline run finished, paper 000's comparison; and the gain over the baseline's final
  accuracy in points. The global model of asynchronous Downpour on skewed data swings by tens
  of points from one snapshot to the next (each push moves it towards one rank's classes), so
  "the accuracy at time t" is the mean over the snapshots of the last ``WINDOW_S`` seconds up to
  t, for the baseline's final accuracy as well;
- ``final_acc`` (the same window at the run's end) and ``fit_s``;
- ``local_time_overhead``: each rank's training time (until its last batch ended) minus the time
  it spent in foreign batches, averaged over ranks, over the baseline's, minus 1: the callback's
  cost (bookkeeping per step, selection and encoding per epoch, the background exchange) without
  the batches it inserts (a batch's time runs from the end of the batch before to its own end,
  so fetching it, Lightning's loop and all hooks count); ``local_step_overhead``, the same for the
  median local batch; and ``hook_share``: the seconds spent inside DataGossip's training hooks
  over the rank's local training time (mean over ranks), the callback's cost measured directly
  rather than as a difference of two noisy run times. ``on_train_end`` is left out of it and
  reported as ``end_wait_s``: there the ranks agree on their exchange count, which mostly means
  waiting for the slowest rank to finish training, as the strategy's own end does.

The overhead is measured in its own runs (``overhead``: 2 ranks, iid, baseline and active_bias
at f = 4 and f = 1): with 8 processes on 2 cores, time slicing between processes swamps the
callback's cost, and a rank's step time depends on what the others happen to do.

Usage::

    python -m benchmarks.downpour.datagossip                 # 8 ranks, 3 seeds, about 20 minutes on 2 cores
    python -m benchmarks.downpour.datagossip --sections overhead   # rerun one section; the others stay in the JSON
    python -m benchmarks.downpour.datagossip --replot              # recompute the summary and plot from the JSON
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.common.launch import launch
from benchmarks.common.paths import RESULTS
from benchmarks.common.report import pyplot, save_figure, write_json

WORKER = Path(__file__).with_name("worker.py")
TASK = {
    "model": {"hidden_size": 64, "learning_rate": 0.03, "momentum": 0.0},
    "strategy": {"push_every": 5, "synchronous": False, "staleness_aware": False},  # paper 000: updates in full
    "snapshot_every_s": 0.25,
}
BATCH_SIZE = 16
WINDOW_S = 1.0
RECORDS_PER_EXCHANGE = 5
OVERHEAD_RANKS = 2
CONFIGS: dict[str, list[tuple[str, dict[str, Any] | None]]] = {
    "class_sorted": [
        ("baseline", None),
        ("active_bias_f4", {"selector": "active_bias", "weave_every": 4}),
        ("active_bias_f1", {"selector": "active_bias", "weave_every": 1}),
        ("random_f1", {"selector": "random", "weave_every": 1}),
        ("hem_f1", {"selector": "hem", "weave_every": 1}),
        ("spl_f1", {"selector": "spl", "weave_every": 1}),
    ],
    "iid": [
        ("baseline", None),
        ("active_bias_f4", {"selector": "active_bias", "weave_every": 4}),
    ],
    "overhead": [
        ("baseline", None),
        ("active_bias_f4", {"selector": "active_bias", "weave_every": 4}),
        ("active_bias_f1", {"selector": "active_bias", "weave_every": 1}),
    ],
}
PARTITION = {"class_sorted": "class_sorted", "iid": "iid", "overhead": "iid"}


def accuracy_at(curve: list[dict[str, Any]], seconds: float, window: float = WINDOW_S) -> float:
    """Mean accuracy of the snapshots taken in ``(seconds - window, seconds]`` (the last one before, if none)."""
    inside = [point["val_acc"] for point in curve if seconds - window < point["seconds"] <= seconds]
    if inside:
        return statistics.fmean(inside)
    before = [point for point in curve if point["seconds"] <= seconds]
    return (before[-1] if before else curve[0])["val_acc"]


def median_local_step(result: dict[str, Any]) -> float:
    durations = [d for rank in result["batch_durations"] for d in rank["local"]]
    return statistics.median(durations)


def local_training_time(result: dict[str, Any]) -> float:
    """Per rank: seconds until its last batch ended, minus its foreign batches; mean over ranks."""
    times = [ends[-1] - sum(rank["foreign"]) for ends, rank in zip(result["step_times"], result["batch_durations"])]
    return statistics.fmean(times)


def hook_share(result: dict[str, Any]) -> float:
    """Seconds in DataGossip's training hooks but ``on_train_end`` over local training time; mean over ranks.

    NaN for results recorded before the worker timed each hook separately.
    """
    if any(not isinstance(rank["hook_s"], dict) for rank in result["batch_durations"]):
        return math.nan
    shares = [sum(seconds for hook, seconds in rank["hook_s"].items() if hook != "on_train_end")
              / (ends[-1] - sum(rank["foreign"]))
              for ends, rank in zip(result["step_times"], result["batch_durations"])]
    return statistics.fmean(shares)


def end_wait(result: dict[str, Any]) -> float:
    """Seconds in DataGossip's ``on_train_end``, the most any rank spent there (NaN for older results)."""
    if any(not isinstance(rank["hook_s"], dict) for rank in result["batch_durations"]):
        return math.nan
    return max(rank["hook_s"].get("on_train_end", 0.0) for rank in result["batch_durations"])


def mean_std(values: list[float]) -> dict[str, float]:
    if any(math.isnan(value) for value in values):
        return {"mean": math.nan, "std": math.nan, "values": values}
    return {"mean": statistics.fmean(values), "std": statistics.pstdev(values) if len(values) > 1 else 0.0,
            "values": values}


def summarize(runs: dict[str, dict[str, dict[int, dict[str, Any]]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for partition, configs in runs.items():
        baselines = configs["baseline"]
        rows = {}
        for name, by_seed in configs.items():
            seeds = sorted(by_seed)
            at_end = [accuracy_at(by_seed[s]["curve"], baselines[s]["fit_s"]) for s in seeds]
            final = [accuracy_at(by_seed[s]["curve"], by_seed[s]["fit_s"]) for s in seeds]
            gain = [100 * (a - accuracy_at(baselines[s]["curve"], baselines[s]["fit_s"])) for a, s in zip(at_end, seeds)]
            step_overhead = [median_local_step(by_seed[s]) / median_local_step(baselines[s]) - 1 for s in seeds]
            time_overhead = [local_training_time(by_seed[s]) / local_training_time(baselines[s]) - 1 for s in seeds]
            foreign = [sum(len(rank["foreign"]) for rank in by_seed[s]["batch_durations"]) for s in seeds]
            gossip_bytes = [sum((rank["gossip"] or {}).get("gossip/bytes_sent", 0.0)
                                for rank in by_seed[s]["batch_durations"]) for s in seeds]
            rows[name] = {
                "gossip": by_seed[seeds[0]]["gossip"],
                "acc_at_baseline_end": mean_std(at_end),
                "gain_points_at_baseline_end": mean_std(gain),
                "final_acc": mean_std(final),
                "fit_s": mean_std([by_seed[s]["fit_s"] for s in seeds]),
                "local_time_overhead": mean_std(time_overhead),
                "local_step_overhead": mean_std(step_overhead),
                "hook_share": mean_std([hook_share(by_seed[s]) for s in seeds]),
                "end_wait_s": mean_std([end_wait(by_seed[s]) for s in seeds]),
                "foreign_batches": mean_std([float(f) for f in foreign]),
                "gossip_bytes": mean_std(gossip_bytes),
                "protocol_bytes": mean_std([float(by_seed[s]["protocol_bytes"]) for s in seeds]),
            }
        summary[partition] = rows
    return summary


def plot(runs: dict[str, dict[str, dict[int, dict[str, Any]]]], path: Path, ranks: dict[str, int]) -> None:
    plt = pyplot()
    import numpy as np

    fig, axes = plt.subplots(1, len(runs), figsize=(7 * len(runs), 4.8), squeeze=False)
    for ax, (partition, configs) in zip(axes[0], runs.items()):
        for name, by_seed in configs.items():
            end = min(result["fit_s"] for result in by_seed.values())
            grid = np.linspace(0, end, 60)
            curves = np.array([[accuracy_at(result["curve"], t) for t in grid] for result in by_seed.values()])
            mean, std = curves.mean(axis=0), curves.std(axis=0)
            style = {"color": "black", "linewidth": 2.2} if name == "baseline" else {}
            line = ax.plot(grid, mean, label=name, **style)[0]
            ax.fill_between(grid, mean - std, mean + std, alpha=0.15, color=line.get_color())
        baseline_end = np.mean([result["fit_s"] for result in configs["baseline"].values()])
        ax.axvline(baseline_end, color="black", linestyle=":", linewidth=1)
        ax.set_title(f"{partition}: DownpourSGD, {ranks[partition]} ranks, mean ± std over seeds")
        ax.set_xlabel("wall-clock seconds since fit started")
        ax.set_ylabel(f"server model's val. accuracy (mean of last {WINDOW_S:g} s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path, dpi=130)


def show(summary: dict[str, dict[str, dict[str, Any]]], ranks: dict[str, int]) -> None:
    """Print the summary, one line per configuration of each section."""
    for partition, rows in summary.items():
        print(f"\n{partition} ({ranks[partition]} ranks): name, acc at baseline end (mean ± std), gain points, "
              "final acc, fit s, local time overhead, local step overhead, hook share, end wait s")
        for name, row in rows.items():
            print(f"  {name:16s} {row['acc_at_baseline_end']['mean']:.4f} ± {row['acc_at_baseline_end']['std']:.4f}  "
                  f"{row['gain_points_at_baseline_end']['mean']:+6.2f}  {row['final_acc']['mean']:.4f}  "
                  f"{row['fit_s']['mean']:6.1f}  {100 * row['local_time_overhead']['mean']:+5.1f}%  "
                  f"{100 * row['local_step_overhead']['mean']:+5.1f}%  {100 * row['hook_share']['mean']:4.1f}%  "
                  f"{row['end_wait_s']['mean']:4.2f}")


def replot(out: Path) -> None:
    """Redraw the figure and reprint the table from ``datagossip.json`` alone (the curves and the summary), for a
    checkout without ``runs/datagossip_full.json``."""
    report = json.loads((out / "datagossip.json").read_text())
    plot(report["runs"], out / "datagossip.png", report["setting"]["ranks"])
    show(report["summary"], report["setting"]["ranks"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sections", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--replot", action="store_true", help="recompute summary and plot from the JSON")
    args = parser.parse_args(argv)
    path = args.out / "runs" / "datagossip_full.json"  # every batch's timing: megabytes, kept out of git
    if args.replot and not path.exists():
        replot(args.out)
        return 0
    # Earlier results of the sections not rerun are kept (JSON turns the seed keys into strings).
    previous = json.loads(path.read_text()) if path.exists() else {"setting": {"ranks": {}}, "runs": {}}
    runs: dict[str, dict[str, dict[Any, dict[str, Any]]]] = previous["runs"]
    ranks: dict[str, int] = previous["setting"]["ranks"]
    for section in [] if args.replot else args.sections:
        ranks[section] = OVERHEAD_RANKS if section == "overhead" else args.ranks
        runs[section] = {}
        for seed in args.seeds:
            for name, gossip in CONFIGS[section]:
                data = {"batch_size": BATCH_SIZE, "partition": PARTITION[section], "val_fraction": 0.3}
                spec = {**TASK, "name": f"datagossip_{section}_{name}_s{seed}", "epochs": args.epochs,
                        "seed": seed, "data": data}
                if gossip is not None:
                    spec["gossip"] = {**gossip, "records_per_exchange": RECORDS_PER_EXCHANGE, "wait_for_exchange": False}
                print(f"{spec['name']} ...", end=" ", flush=True)
                result = launch(spec, ranks[section], args.out / "runs", timeout=args.timeout, worker=WORKER)
                runs[section].setdefault(name, {})[str(seed)] = result
                print(f"fit {result['fit_s']:.1f} s, final acc {result['final_val_acc']:.4f}", flush=True)
    summary = summarize(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    setting = {"ranks": ranks, "epochs": args.epochs, "seeds": args.seeds, "batch_size": BATCH_SIZE,
               "records_per_exchange": RECORDS_PER_EXCHANGE, "window_s": WINDOW_S, **TASK}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"setting": setting, "summary": summary, "runs": runs}))
    curves = {section: {name: {seed: {key: result[key] for key in ("fit_s", "final_val_acc", "curve")}
                               for seed, result in by_seed.items()} for name, by_seed in configs.items()}
              for section, configs in runs.items()}
    write_json(args.out / "datagossip.json", {"setting": setting, "summary": summary, "runs": curves})
    plot(runs, args.out / "datagossip.png", ranks)
    show(summary, ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
