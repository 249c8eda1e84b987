"""Main job: how much sooner does a language model reach its loss on a slow network with dynamic averaging than with DDP?

    python examples/lm_demo.py [--workers 4] [--mbit 20] [--out demo_out]

The simulator (``lightning_dist.sim``) trains the package's transformer language model
(``TransformerLM``, 1.3M parameters, on the Python standard library's source, contiguous shards per
worker, AdamW) on ``--workers`` virtual workers twice: with DDP (a gradient all-reduce every step)
and with dynamic averaging as ``strategy="dynamic_avg"`` gives it to a user (paper 004: models are
averaged only when one drifts more than ``Delta`` from the last average; ``Delta`` measured in the run,
the workers' mean drift over the shortest period, at most 100 steps, whose synchronization costs at most a
quarter of its computing: 100 steps at 20 Mbit/s). Training is real; time is virtual. It is the
headline cell of the measured language-model benchmark, replayed by the simulator: the model, data,
DDP, target loss, compute time per step and network come from ``benchmarks/results/lm_network.json``
(4 real ranks on a capped network), and ``benchmarks/language_model/simulated.py`` runs it (its ``simulate``), so what is
printed here is what that script predicts and docs/results/language-model-simulated.md sets against the measurement. Each method
trains until its averaged model's validation loss reaches the target; the script prints the virtual
seconds and steps to it, the bytes sent and the speed-up, and writes a plot of loss against virtual time.

Every run of the command on one machine prints the same figures (the wall seconds aside), given the same torch
and corpus (the running Python's standard library): the simulation draws from seeded generators and takes no
wall-clock time, trains with 1 thread, and pins torch's CPU kernels
(:func:`lightning_dist.sim.numerics.pin_cpu_kernels`). Another CPU model can still print other figures: an Intel
Xeon with the same pinned kernels did (issue 42), and training amplifies any last-bit difference into other
synchronizations and another step at which the target is crossed. The script prints what the figures depend on,
each method's loss at the evaluation before the one that reached the target (how close that crossing was), and
how far the figures moved over last-bit variants of the kernels and threads and on that Xeon
(``benchmarks/results/demo_replay.json``, made by ``python -m benchmarks.simulator.demo_replay``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from lightning_dist.data import StdlibTextDataModule
from lightning_dist.sim.numerics import pin_cpu_kernels

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script: the benchmarks importable
from benchmarks.language_model.simulated import measured_ceiling_mbit, measured_step_s, simulate  # noqa: E402

MEASURED = REPO / "benchmarks" / "results" / "lm_network.json"
REPLAYS = REPO / "benchmarks" / "results" / "demo_replay.json"  # benchmarks/simulator/demo_replay.py's spread
# What a user gets from strategy="dynamic_avg": no threshold, no calibration run (the simulator measures it as the
# strategy does).
DYNAMIC_DEFAULTS = {"name": "dynamic_default", "kind": "dynamic",
                    "label": "dynamic averaging, its defaults",
                    "strategy": {"class": "DynamicAveragingStrategy", "kwargs": {}}}


def plot(results: list[dict[str, Any]], labels: dict[str, str], target: float, args: argparse.Namespace,
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(7, 4.5))
    for result in results:
        axis.plot([row["time"] for row in result["rows"]], [row["val_loss"] for row in result["rows"]],
                  marker=".", label=labels[result["name"]])
    axis.axhline(target, color="black", linestyle=":", linewidth=1, label=f"target {target:.3f}")
    axis.set_xlabel(f"virtual seconds ({args.workers} workers, {args.mbit:g} Mbit/s per node)")
    axis.set_ylabel("validation loss (nats/char)")
    axis.set_title("TransformerLM on the Python stdlib: DDP vs dynamic averaging (simulated)", fontsize=10)
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def before(result: dict[str, Any]) -> str:
    """The loss at the evaluation before the one that reached the target: how near the crossing was."""
    earlier = [row for row in result["rows"] if row["mean_steps"] < result["steps_to_target"]]
    return f"at step {earlier[-1]['mean_steps']:.0f}: {earlier[-1]['val_loss']:.3f}"


def replay(numerics: dict[str, Any], corpus: dict[str, Any], measured: dict[str, Any]) -> str:
    """What the figures depend on besides the code: another run prints them again where all of it is the same."""
    threads = numerics["threads"]
    kernels = (f"ATen {numerics['aten_cpu_capability']} / MKL {numerics['mkl_cbwr'] or 'auto'} / "
               f"oneDNN {numerics['onednn_max_cpu_isa'] or 'auto'}")
    measured_texts = {launch["corpus"]["sha256"] for launch in measured["launches"] if "corpus" in launch}
    text = "the measured run's" if corpus["sha256"] in measured_texts else "not the measured run's"
    return (f"same figures on every run of one CPU model with torch {numerics['torch']} on {numerics['machine']}, "
            f"{threads} thread{'s' if threads != 1 else ''}, kernels {kernels}, corpus Python "
            f"{corpus['python_version']}'s stdlib (sha256 {corpus['sha256'][:12]}, {text})")


def elsewhere(path: Path = REPLAYS) -> str | None:
    """Which figures another CPU can print otherwise, and how far: their spread in ``path`` (None without it)."""
    if not path.exists():
        return None
    record = json.loads(path.read_text())

    def span(figure: str, form: str) -> str:
        low, high = (format(record["spread"][figure][end], form) for end in ("min", "max"))
        return low if low == high else f"{low}-{high}"

    return (f"another CPU can print other figures (last bits differ and training amplifies them): Delta "
            f"{span('delta', '.4g')}, {span('dynamic_steps', '.0f')} steps and {span('dynamic_virtual_s', '.1f')} "
            f"virtual s to the target, {span('speedup', '.1f')}x, DDP's final loss {span('ddp_final_loss', '.3f')} "
            f"(this demo and {len(record['variants']) - 1} last-bit variants of it on an {record['cpu']}, and an Intel "
            f"Xeon's run, issue 42: {path.relative_to(REPO) if path.is_relative_to(REPO) else path})")


def workload(workers: int) -> dict[str, Any]:
    """The measured run's model, data, target, step time and ceiling, and the two methods the demo trains."""
    measured = json.loads(MEASURED.read_text())
    config = measured["config"]
    return {"measured": measured, "config": config, "target": measured["summary"]["target_val_loss"],
            "methods": [next(method for method in config["methods"] if method["name"] == "ddp"), DYNAMIC_DEFAULTS],
            "step_s": measured_step_s(measured), "ceiling_mbit": measured_ceiling_mbit(measured), "workers": workers}


def run(work: dict[str, Any], method: dict[str, Any], mbit: float, max_steps: int, threads: int = 1) -> dict[str, Any]:
    """One method's simulated run (``simulate`` of the measured benchmark), with ``threads`` intra-op threads."""
    return simulate(work["config"], method, work["workers"], mbit, work["ceiling_mbit"], work["step_s"], None,
                    max_steps, work["target"], threads=threads)


def timed_run(work: dict[str, Any], method: dict[str, Any], mbit: float,
              max_steps: int) -> tuple[dict[str, Any], float]:
    """:func:`run` in a process of its own, and the wall seconds it took."""
    started = time.perf_counter()
    return run(work, method, mbit, max_steps), time.perf_counter() - started


def method_line(method: dict[str, Any], result: dict[str, Any], wall_s: float) -> str:
    """The demo's line for one method: steps and virtual seconds to the target, final loss, bytes."""
    reached = result["time_to_target_s"] is not None
    at = (f"reached it after {result['steps_to_target']:.0f} steps, {result['time_to_target_s']:.1f} virtual s "
          f"({before(result)})"
          if reached else f"did not reach it in {result['steps']:.0f} steps ({result['virtual_s']:.1f} virtual s)")
    threshold = result["protocol_metrics"].get("dynamic/divergence_threshold")
    period = result["protocol_metrics"].get("dynamic/calibration_period")
    label = method["label"] + (f" (Delta {threshold:.4g}, its drift in {period} steps)" if threshold else "")
    return (f"  {label:<40} {at}; final loss {result['final_val_loss']:.3f}, "
            f"{result['protocol_bytes'] / 1e6:.1f} MB sent ({wall_s:.0f} s wall)")


def speedup_line(ddp: dict[str, Any], dynamic: dict[str, Any]) -> str | None:
    """How much sooner dynamic averaging reaches the target, and with how many fewer bytes (None: one did not)."""
    if not (ddp["time_to_target_s"] and dynamic["time_to_target_s"]):
        return None
    return (f"dynamic averaging reaches the target {ddp['time_to_target_s'] / dynamic['time_to_target_s']:.1f}x "
            f"sooner than DDP, having sent {ddp['bytes_to_target'] / max(dynamic['bytes_to_target'], 1):.0f}x "
            f"fewer bytes by then")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--mbit", type=float, default=20.0, help="cap per node, Mbit/s (each way)")
    parser.add_argument("--max-steps", type=int, default=400, help="steps per worker at most")
    parser.add_argument("--out", type=Path, default=Path("demo_out"))
    args = parser.parse_args()
    if args.workers < 2:
        parser.error(f"--workers must be at least 2; got {args.workers}")
    if not args.mbit > 0:
        parser.error(f"--mbit must be > 0; got {args.mbit}")
    pin_cpu_kernels()
    work = workload(args.workers)
    config, target, methods, measured = work["config"], work["target"], work["methods"], work["measured"]
    print(f"TransformerLM ({config['model']['n_layer']} layers x {config['model']['n_embd']}), {args.workers} "
          f"simulated workers, {args.mbit:g} Mbit/s per node, {work['step_s']:.3f} s of compute per step; target "
          f"validation loss {target:.3f} nats/char ({measured['summary']['target_rule']})", flush=True)
    # The two methods in two processes at once (each trains with 1 thread, in virtual time: the figures are those of
    # one process running both, the wall time about half).
    with ProcessPoolExecutor(len(methods), mp_context=multiprocessing.get_context("spawn")) as pool:
        runs = [pool.submit(timed_run, work, method, args.mbit, args.max_steps) for method in methods]
        results = []
        for method, future in zip(methods, runs):
            result, wall_s = future.result()
            results.append(result)
            print(method_line(method, result, wall_s), flush=True)
    ddp, dynamic = results
    speedup = speedup_line(ddp, dynamic)
    if speedup:
        print(speedup)
    print(replay(ddp["numerics"], StdlibTextDataModule(**config["data"]).corpus_info(), measured))
    variation = elsewhere()
    if variation:
        print(variation)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "lm_demo.png"
    plot(results, {method["name"]: method["label"] for method in methods}, target, args, path)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
