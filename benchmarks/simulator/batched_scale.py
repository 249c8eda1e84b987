"""What batched workers (``Simulation(batched_workers=k)``) save at scale, against the per-worker path, in one run.

Two workloads, each run both ways on the same seed (modelled compute, a 20 Mbit/s network, 1 thread):

- ``mlp``: ``MLPClassifier`` 64-64-64-10 with periodic averaging (period 10, as the strategy runs it) on a
  synthetic 10-class task (scikit-learn's ``make_classification``, 64 features, 8 batches of 16 per worker, so
  every worker has its own data however many there are), 20 steps, 64 to 10,000 workers. The per-worker path runs
  up to ``--per-worker-max`` workers (it is the slow one).
- ``lm``: the language-model benchmark's ``TransformerLM`` (4 layers, 160 wide, 64 bytes of context, batch 8) with
  one learner per machine of 8 ranks (``hierarchy="node"``), periodic averaging every 50, a few steps on a few
  machines: its wall seconds per learner step, and what that makes 128 machines x 150 steps.

Each row: the run's wall seconds (set-up, the loop, evaluations), the loop's seconds per worker step, the peak
resident memory of the process so far (``ru_maxrss``, it only grows: rows run in increasing size), the vmap calls
and replicas per call, and against the per-worker run of the same size: the speed-up and the largest difference
of the final consensus (bytes sent must be equal).

Usage::

    python -m benchmarks.simulator.batched_scale                       # both (about 15 min on 2 cores)
    python -m benchmarks.simulator.batched_scale --only mlp --workers 64 256
    python -m benchmarks.simulator.batched_scale --replot

Outputs (``--out``, default ``benchmarks/results``): ``sim_batched.json`` and ``sim_batched.png``.
"""

from __future__ import annotations

import argparse
import platform
import resource
import time
from pathlib import Path
from typing import Any

import torch

from lightning_dist.data.datamodules import Arrays, ArrayDataModule
from lightning_dist.data import StdlibTextDataModule
from lightning_dist.models import MLPClassifier, TransformerLM
from lightning_dist.sim import NetworkModel, PeriodicAveraging, Simulation, SpeedModel

from benchmarks.common.paths import RESULTS
from benchmarks.common.report import command_line, pyplot, save_figure, write_json

NETWORK = NetworkModel(latency=0.0001, node_mbit=20)
INTRA = NetworkModel(latency=1e-5, node_mbit=100_000)
SPEED = SpeedModel(step_seconds=0.05, aggregate_seconds=0.0)
MLP_STEPS, LM_STEPS, LM_RANKS = 20, 3, 8
GROUP = 256


class SyntheticClassification(ArrayDataModule):
    """scikit-learn's ``make_classification``: 64 features, 10 classes, ``examples`` of them (seeded)."""

    num_features = 64
    num_classes = 10

    def __init__(self, examples: int, batch_size: int = 16) -> None:
        super().__init__(batch_size=batch_size)
        self.examples = examples

    def _load_arrays(self) -> Arrays:
        from sklearn.datasets import make_classification
        from sklearn.model_selection import train_test_split

        features, labels = make_classification(n_samples=self.examples, n_features=64, n_informative=32,
                                               n_classes=10, random_state=self.seed)
        x_train, x_val, y_train, y_val = train_test_split(features, labels, test_size=self.val_fraction,
                                                          random_state=self.seed)
        return x_train, y_train, x_val[:2000], y_val[:2000]


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB on Linux


def measure(workload: str, workers: int, batched: int | None) -> tuple[dict[str, Any], torch.Tensor]:
    """One run; its row and its final consensus."""
    torch.manual_seed(0)
    if workload == "mlp":
        model = MLPClassifier(num_features=64, hidden_size=64, learning_rate=0.1)
        data = SyntheticClassification(examples=int(workers * 8 * 16 / 0.8) + 10)
        extra: dict[str, Any] = {"max_steps": MLP_STEPS}
        protocol = PeriodicAveraging(period=10, topology="strategy")
    else:
        model = TransformerLM(block_size=64, n_layer=4, n_head=4, n_embd=160, learning_rate=2e-3)
        data = StdlibTextDataModule(block_size=64, batch_size=8, max_val_sequences=64)
        extra = {"max_steps": LM_STEPS, "ranks_per_node": LM_RANKS, "hierarchy": "node", "intra_node": INTRA}
        protocol = PeriodicAveraging(period=50, topology="strategy")
    sim = Simulation(model, data, protocol, workers=workers, network=NETWORK, speed=SPEED, eval_every=10**9,
                     evaluate_workers=False, batched_workers=batched, **extra)
    summary = sim.run().summary
    loop = summary["wall_seconds"] - summary["setup_wall_seconds"] - summary["evaluation_wall_seconds"]
    learners = summary["num_learners"]
    counts = summary["batched"] or {}
    row = {
        "workload": workload, "workers": workers, "learners": learners, "steps": extra["max_steps"],
        "batched_workers": batched, "wall_s": summary["wall_seconds"], "setup_wall_s": summary["setup_wall_seconds"],
        "evaluation_wall_s": summary["evaluation_wall_seconds"],
        "loop_s_per_learner_step": loop / (learners * extra["max_steps"]),
        "vmap_calls": counts.get("calls"), "replicas_per_call": counts["steps"] / counts["calls"] if counts else None,
        "bytes": summary["bytes"], "final_val_loss": summary["final"]["val_loss"], "peak_rss_gb": peak_rss_gb(),
    }
    return row, sim.consensus()


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    sizes = {"mlp": args.workers, "lm": [machines * LM_RANKS for machines in args.lm_machines]}
    for workload in [args.only] if args.only else ["mlp", "lm"]:
        for workers in sizes[workload]:
            per_worker = None
            if workers <= args.per_worker_max:
                per_worker, consensus = measure(workload, workers, None)
                rows.append(per_worker)
                show(per_worker)
            batched, batched_consensus = measure(workload, workers, GROUP)
            if per_worker is not None:
                if batched["bytes"] != per_worker["bytes"]:
                    raise RuntimeError(f"{workload} at {workers} workers: batched sent {batched['bytes']} bytes, "
                                       f"the per-worker path {per_worker['bytes']}")
                batched["speedup"] = per_worker["loop_s_per_learner_step"] / batched["loop_s_per_learner_step"]
                batched["max_abs_difference"] = float((batched_consensus - consensus).abs().max())
            rows.append(batched)
            show(batched)
    lm = [row for row in rows if row["workload"] == "lm"]
    projection = {
        f"{'batched' if row['batched_workers'] else 'per_worker'}_128x8_150_steps_min":
            row["loop_s_per_learner_step"] * 128 * 150 / 60 for row in lm if row["learners"] == max(args.lm_machines)
    }
    return {"command": command_line(), "date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
            "torch": torch.__version__, "threads": 1, "group": GROUP, "rows": rows, "lm_projection": projection}


def show(row: dict[str, Any]) -> None:
    path = f"batched {row['batched_workers']}" if row["batched_workers"] else "per worker"
    extra = (f", {row['replicas_per_call']:.1f} replicas a call" if row["replicas_per_call"] else "") + (
        f", {row['speedup']:.2f}x, max |diff| {row['max_abs_difference']:.1e}" if "speedup" in row else "")
    print(f"{row['workload']} {row['workers']:6} workers {path:12} {row['wall_s']:7.1f} s wall "
          f"({row['setup_wall_s']:.1f} set-up), {row['loop_s_per_learner_step'] * 1e3:7.3f} ms a learner step, "
          f"peak RSS {row['peak_rss_gb']:.2f} GB{extra}", flush=True)


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for axis, workload, title in ((axes[0], "mlp", "MLP 64-64-64-10, periodic averaging"),
                                  (axes[1], "lm", "TransformerLM, one learner per 8 ranks")):
        for batched, label, marker in ((False, "per worker", "o"), (True, f"batched ({report['group']} a call)", "s")):
            rows = [row for row in report["rows"] if row["workload"] == workload and bool(row["batched_workers"]) == batched]
            axis.plot([row["workers"] for row in rows], [row["loop_s_per_learner_step"] * 1e3 for row in rows],
                      marker=marker, label=label)
        axis.set_xscale("log")
        axis.set_xlabel("simulated ranks")
        axis.set_ylabel("wall ms per learner step")
        axis.set_title(title, fontsize=10)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["mlp", "lm"])
    parser.add_argument("--workers", type=int, nargs="+", default=[64, 256, 1024, 10_000])
    parser.add_argument("--per-worker-max", type=int, default=1024, help="run the per-worker path up to this size")
    parser.add_argument("--lm-machines", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--replot", action="store_true")
    args = parser.parse_args()
    json_path, png_path = args.out / "sim_batched.json", args.out / "sim_batched.png"
    if args.replot:
        import json

        report = json.loads(json_path.read_text())
    else:
        started = time.perf_counter()
        report = run(args)
        report["wall_seconds"] = time.perf_counter() - started
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(json_path, report)
    plot(report, png_path)
    print(f"wrote {json_path} and {png_path}; LM at 128 x 8, 150 steps (minutes of loop): {report['lm_projection']}")


if __name__ == "__main__":
    main()
