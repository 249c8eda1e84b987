"""What a lost rank or node costs under torchrun --max-restarts (examples/elastic/kill_a_rank.py), several seeds.

    python -m benchmarks.elastic.restart            # 3 seeds x (rank, node) + their uninterrupted runs, ~5 min
    python -m benchmarks.elastic.restart --replot   # redraw from the JSON

For each seed, dynamic averaging (configs/dynamic_avg.yaml, MNIST-1D) trains MAX_STEPS optimizer
steps with a checkpoint every INTERVAL steps, four ways, all in this run:

* ``rank``: one torchrun agent of 2 processes; global rank 1 is SIGKILLed a fraction of a
  checkpoint interval after the first checkpoint (0.25, 0.5, 0.75 for seeds 0, 1, 2; the interval's
  length in seconds taken from the same seed's uninterrupted run), and torchrun restarts both;
* ``node``: two agents of 2 processes each; the second agent and its processes are SIGKILLed the
  same way, and the survivor restarts alone (4 ranks -> 2);
* ``none``, on 1 and on 2 agents: the uninterrupted runs the failures are held against.

Per failure it records the restart's parts, from the kill: torchrun noticing and starting new
processes (``restart_s``), and those processes starting Python, meeting at the rendezvous and
restoring ``last.ckpt`` (``resume_s``); the work lost (steps since the last checkpoint, from the
checkpoint's age at the kill over the seed's uninterrupted step time); the whole overhead (wall
time against the uninterrupted run of the same seed and shape); and the final model's accuracy
against the uninterrupted run's. Writes benchmarks/results/elastic_restart.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.paths import REPO, RESULTS
from benchmarks.common.report import pyplot, save_figure

SCRIPT = REPO / "examples" / "elastic" / "kill_a_rank.py"
PREFIX = "elastic_restart"
CONFIG = REPO / "configs" / "dynamic_avg.yaml"
MAX_STEPS = 2000
INTERVAL = 200  # every_n_train_steps
SEEDS = (0, 1, 2)
FRACTIONS = (0.25, 0.5, 0.75)  # of a checkpoint interval, after the first checkpoint, per seed
SCENARIOS = {"rank": 1, "node": 2}  # kill -> torchrun agents ("nodes") of 2 processes


def kill_a_rank(workdir: Path, kill: str, nodes: int, seed: int, kill_delay: float = 0.0) -> dict[str, Any]:
    record = workdir / "record.json"
    command = [sys.executable, str(SCRIPT), "--config", str(CONFIG), "--workdir", str(workdir), "--json", str(record),
               f"--kill={kill}", f"--nodes={nodes}", f"--seed={seed}", f"--max-steps={MAX_STEPS}",
               f"--every-n-train-steps={INTERVAL}", f"--kill-delay={kill_delay}", "--timeout=300"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=400)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {result.returncode}:\n{result.stderr[-4000:]}")
    return json.loads(record.read_text())


def step_seconds(uninterrupted: dict[str, Any]) -> float:
    """Seconds per step: the median over consecutive checkpoints (so the start-up before the first is left out)."""
    seen = sorted((int(step), at) for step, at in uninterrupted["checkpoints_seen_s"].items())
    gaps = [(b_at - a_at) / (b - a) for (a, a_at), (b, b_at) in zip(seen, seen[1:])]
    return statistics.median(gaps)


def failure_costs(failure: dict[str, Any], uninterrupted: dict[str, Any]) -> dict[str, float]:
    step_s = step_seconds(uninterrupted)
    return {
        "restart_s": failure["restarted_at_s"] - failure["killed_at_s"],
        "resume_s": failure["resumed_at_s"] - failure["killed_at_s"],
        "lost_steps": failure["checkpoint_age_at_kill_s"] / step_s,
        "lost_s": failure["checkpoint_age_at_kill_s"],
        "overhead_s": failure["wall_s"] - uninterrupted["wall_s"],
        "step_s": step_s,
        "val_acc_delta": failure["val_acc"] - uninterrupted["val_acc"],
    }


def table(runs: list[dict[str, Any]]) -> list[str]:
    lines = [f"{'kill':<5} {'seed':>4} {'world':>6} {'restart s':>9} {'resume s':>8} {'lost steps':>10} "
             f"{'lost s':>6} {'overhead s':>10} {'val_acc':>7} {'uninterrupted':>13}"]
    for run in runs:
        if run["kill"] == "none":
            continue
        cost = run["cost"]
        lines.append(f"{run['kill']:<5} {run['seed']:>4} {run['world_size_before']:>2} -> {run['world_size_after']}"
                     f" {cost['restart_s']:>9.2f} {cost['resume_s']:>8.2f} {cost['lost_steps']:>10.0f} "
                     f"{cost['lost_s']:>6.2f} {cost['overhead_s']:>10.2f} {run['val_acc']:>7.4f} "
                     f"{run['val_acc'] - cost['val_acc_delta']:>13.4f}")
    for kill in SCENARIOS:
        costs = [run["cost"] for run in runs if run["kill"] == kill]
        if costs:
            lines.append(f"{kill:<5} median: restart {statistics.median(c['restart_s'] for c in costs):.2f} s, resume "
                         f"{statistics.median(c['resume_s'] for c in costs):.2f} s, overhead "
                         f"{statistics.median(c['overhead_s'] for c in costs):.2f} s")
    return lines


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()

    failures = [run for run in runs if run["kill"] != "none"]
    labels = [f"{run['kill']} {run['world_size_before']}->{run['world_size_after']}\nseed {run['seed']}"
              for run in failures]
    figure, (costs, accuracy) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = range(len(failures))
    restart = [run["cost"]["restart_s"] for run in failures]
    start_up = [run["cost"]["resume_s"] - run["cost"]["restart_s"] for run in failures]
    lost = [run["cost"]["lost_s"] for run in failures]
    costs.bar(x, restart, label="torchrun notices, starts new processes")
    costs.bar(x, start_up, bottom=restart, label="processes start, meet, restore last.ckpt")
    costs.bar(x, lost, bottom=[a + b for a, b in zip(restart, start_up)], label="steps since the checkpoint, redone")
    costs.scatter(x, [run["cost"]["overhead_s"] for run in failures], color="black", zorder=3,
                  label="measured: wall time - uninterrupted")
    costs.set_xticks(list(x), labels, fontsize=8)
    costs.set_ylabel("seconds")
    costs.set_title(f"cost of a failure ({MAX_STEPS} steps, checkpoint every {INTERVAL})")
    tallest = max(a + b + c for a, b, c in zip(restart, start_up, lost))
    costs.set_ylim(top=1.5 * tallest)
    costs.axhline(0, color="grey", linewidth=0.5)
    costs.legend(fontsize=8, loc="upper center", ncol=2)
    width = 0.4
    accuracy.bar([i - width / 2 for i in x], [run["val_acc"] - run["cost"]["val_acc_delta"] for run in failures],
                 width, label="uninterrupted (same seed, same start)")
    accuracy.bar([i + width / 2 for i in x], [run["val_acc"] for run in failures], width, label="with the failure")
    accuracy.set_xticks(list(x), labels, fontsize=8)
    accuracy.set_ylabel("final val_acc")
    accuracy.set_ylim(0, 1)
    accuracy.legend(fontsize=8, loc="lower right")
    accuracy.set_title("final model")
    save_figure(figure, path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replot", action="store_true", help="redraw from the JSON; run nothing")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = args.out / f"{PREFIX}.json", args.out / f"{PREFIX}.png"
    if args.replot:
        runs = json.loads(json_path.read_text())["runs"]
        print("\n".join(table(runs)))
        plot(runs, png_path)
        return
    runs, start = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        for seed, fraction in zip(SEEDS, FRACTIONS):
            for kill, nodes in SCENARIOS.items():
                uninterrupted = kill_a_rank(Path(scratch) / f"none{nodes}-{seed}", "none", nodes, seed)
                delay = fraction * INTERVAL * step_seconds(uninterrupted)
                failure = kill_a_rank(Path(scratch) / f"{kill}-{seed}", kill, nodes, seed, delay)
                failure["cost"] = failure_costs(failure, uninterrupted)
                runs += [uninterrupted, failure]
                print(table([failure])[1], flush=True)
    lines = table(runs)
    print("\n".join(lines))
    config = {"config": str(CONFIG.relative_to(REPO)), "max_steps": MAX_STEPS, "every_n_train_steps": INTERVAL,
              "seeds": SEEDS, "kill_delay_fractions": FRACTIONS, "scenarios": SCENARIOS, "nproc_per_node": 2,
              "date": time.strftime("%Y-%m-%d"), "machine": platform.platform(), "python": sys.version.split()[0],
              "torch": torch.__version__, "wall_seconds": time.perf_counter() - start}
    json_path.write_text(json.dumps({"config": config, "table": lines, "runs": runs}, indent=1) + "\n")
    plot(runs, png_path)
    print(f"wrote {json_path} and {png_path} in {config['wall_seconds']:.0f} s")


if __name__ == "__main__":
    main()
