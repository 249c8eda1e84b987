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

Every run of the command prints the same figures (the wall seconds aside), on any x86-64 CPU with AVX2,
given the same torch and corpus (the running Python's standard library): the simulation draws from seeded
generators and takes no wall-clock time, trains with 1 thread, and pins torch's CPU kernels
(:func:`lightning_dist.sim.numerics.pin_cpu_kernels`). Their last bits would otherwise follow the CPU,
and dynamic averaging's steps to the target with them (150 or 175 on one machine); the script prints
what the figures depend on, and each method's loss at the evaluation before the one that reached the
target, to show how close that crossing was.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from lightning_dist.data import StdlibTextDataModule
from lightning_dist.sim.numerics import pin_cpu_kernels

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script: the benchmarks importable
from benchmarks.language_model.simulated import measured_ceiling_mbit, measured_step_s, simulate  # noqa: E402

MEASURED = REPO / "benchmarks" / "results" / "lm_network.json"
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
    return (f"same figures wherever these are: torch {numerics['torch']} on {numerics['machine']}, {threads} "
            f"thread{'s' if threads != 1 else ''}, kernels {kernels}, corpus Python {corpus['python_version']}'s "
            f"stdlib (sha256 {corpus['sha256'][:12]}, {text})")


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
    measured = json.loads(MEASURED.read_text())
    config, target = measured["config"], measured["summary"]["target_val_loss"]
    methods = [next(method for method in config["methods"] if method["name"] == "ddp"), DYNAMIC_DEFAULTS]
    step_s, ceiling_mbit = measured_step_s(measured), measured_ceiling_mbit(measured)
    print(f"TransformerLM ({config['model']['n_layer']} layers x {config['model']['n_embd']}), {args.workers} simulated "
          f"workers, {args.mbit:g} Mbit/s per node, {step_s:.3f} s of compute per step; target validation loss "
          f"{target:.3f} nats/char ({measured['summary']['target_rule']})", flush=True)
    results = []
    for method in methods:
        started = time.perf_counter()
        result = simulate(config, method, args.workers, args.mbit, ceiling_mbit, step_s, None, args.max_steps, target)
        results.append(result)
        reached = result["time_to_target_s"] is not None
        at = (f"reached it after {result['steps_to_target']:.0f} steps, {result['time_to_target_s']:.1f} virtual s "
              f"({before(result)})"
              if reached else f"did not reach it in {result['steps']:.0f} steps ({result['virtual_s']:.1f} virtual s)")
        threshold = result["protocol_metrics"].get("dynamic/divergence_threshold")
        period = result["protocol_metrics"].get("dynamic/calibration_period")
        label = method["label"] + (f" (Delta {threshold:.4g}, its drift in {period} steps)" if threshold else "")
        print(f"  {label:<40} {at}; final loss {result['final_val_loss']:.3f}, "
              f"{result['protocol_bytes'] / 1e6:.1f} MB sent ({time.perf_counter() - started:.0f} s wall)", flush=True)
    ddp, dynamic = results
    if ddp["time_to_target_s"] and dynamic["time_to_target_s"]:
        print(f"dynamic averaging reaches the target {ddp['time_to_target_s'] / dynamic['time_to_target_s']:.1f}x "
              f"sooner than DDP, having sent {ddp['bytes_to_target'] / max(dynamic['bytes_to_target'], 1):.0f}x "
              f"fewer bytes by then")
    print(replay(ddp["numerics"], StdlibTextDataModule(**config["data"]).corpus_info(), measured))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "lm_demo.png"
    plot(results, {method["name"]: method["label"] for method in methods}, target, args, path)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
