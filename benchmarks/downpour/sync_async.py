"""Synchronous vs asynchronous DownpourSGD with one straggler (paper 001's sync/async comparison).

Same task, seed and ranks for both runs: scikit-learn digits, iid partitions, the MLP of the
examples, plain SGD with learning rate 0.03 in both modes. The asynchronous server adds every
update in full; a synchronous round applies the mean of the ranks' updates (paper 001's SSGD), so
it moves the model about as far as one rank's update, from ``ranks`` times the examples. Rank
``ranks - 1`` sleeps ``--slow-seconds`` before every batch. Each run
records every rank's step times and, on rank 0, copies of the server's global model taken every
0.5 s (evaluated on the validation split after fit), so accuracy is plotted against wall time.

Reported ratios (async / sync): time the fast ranks need for their steps, time until the global
model first reaches ``--target-acc``, whole fit time, final accuracy.

Usage::

    python -m benchmarks.downpour.sync_async            # 4 ranks, about 40 s
    python -m benchmarks.downpour.sync_async --ranks 8 --slow-seconds 0.05
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.common.launch import launch
from benchmarks.common.paths import RESULTS
from benchmarks.common.report import pyplot, save_figure, write_json

WORKER = Path(__file__).with_name("worker.py")
TASK = {
    "data": {"batch_size": 10, "partition": "iid", "val_fraction": 0.3},
    "model": {"hidden_size": 64, "learning_rate": 0.03, "momentum": 0.0},
    "seed": 0,
    "snapshot_every_s": 0.5,
}


def first_time_at(curve: list[dict[str, Any]], target: float) -> float | None:
    return next((point["seconds"] for point in curve if point["val_acc"] >= target), None)


def summarize(results: dict[str, dict[str, Any]], target: float) -> dict[str, Any]:
    rows = {}
    for mode, result in results.items():
        slow_rank = result["slow"]["rank"]
        fast = [times[-1] for rank, times in enumerate(result["step_times"]) if rank != slow_rank]
        rows[mode] = {
            "fit_s": result["fit_s"],
            "fast_ranks_last_step_s": max(fast),
            "slow_rank_last_step_s": result["step_times"][slow_rank][-1],
            "seconds_to_target_acc": first_time_at(result["curve"], target),
            "final_val_acc": result["final_val_acc"],
            "staleness_mean": result["server"].get("downpour/staleness_mean"),
            "staleness_max": result["server"].get("downpour/staleness_max"),
            "protocol_bytes": result["protocol_bytes"],
        }
    ratio = lambda key: (rows["async"][key] / rows["sync"][key]  # noqa: E731
                         if rows["async"][key] and rows["sync"][key] else None)
    return {
        "target_acc": target,
        "runs": rows,
        "async_over_sync": {key: ratio(key) for key in ("fast_ranks_last_step_s", "seconds_to_target_acc", "fit_s")},
        "final_acc_diff_points": 100 * (rows["async"]["final_val_acc"] - rows["sync"]["final_val_acc"]),
    }


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for mode, color in (("sync", "tab:blue"), ("async", "tab:red")):
        curve = results[mode]["curve"]
        ax.plot([p["seconds"] for p in curve], [p["val_acc"] for p in curve], color=color, marker=".", label=mode)
    slow = results["async"]["slow"]
    ax.set_title(f"DownpourSGD, {results['async']['world_size']} ranks, rank {slow['rank']} sleeps "
                 f"{slow['seconds']} s per step")
    ax.set_xlabel("wall-clock seconds since fit started")
    ax.set_ylabel("validation accuracy of the server's model")
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path, dpi=130)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--push-every", type=int, default=5)
    parser.add_argument("--slow-seconds", type=float, default=0.05)
    parser.add_argument("--target-acc", type=float, default=0.6)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    results = {}
    for mode in ("sync", "async"):
        spec = {**TASK, "name": f"downpour_{mode}", "epochs": args.epochs,
                "strategy": {"push_every": args.push_every, "synchronous": mode == "sync",
                             "staleness_aware": False},  # paper 001: asynchronous updates in full
                "slow": {"rank": args.ranks - 1, "seconds": args.slow_seconds}}
        print(f"{mode} ...", end=" ", flush=True)
        results[mode] = launch(spec, args.ranks, args.out / "runs", timeout=args.timeout, worker=WORKER)
        print(f"fit {results[mode]['fit_s']:.1f} s, final acc {results[mode]['final_val_acc']:.4f}", flush=True)
    summary = summarize(results, args.target_acc)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "downpour_sync_async.json", {"summary": summary, "runs": results})
    plot(results, args.out / "downpour_sync_async.png")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
