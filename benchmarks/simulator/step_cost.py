"""What a simulated step costs on this machine: wall seconds per step of all workers, and memory, by worker count.

The hybrid simulator computes every worker's gradients for real, so a simulated step of ``N`` workers
costs at least ``N`` real steps; everything else (the event engine, the network and collectives,
the protocol's averaging, evaluations) is the simulator's overhead. Two workloads:

- ``mlp``: ``MLPClassifier`` 64-64-64-10 on scikit-learn digits (batch 16), 16 and 64 workers, every
  protocol as the strategy runs it (``ddp``; ``periodic``, ``dynamic_avg``, ``segmented_gossip``
  and ``parameter_server`` with ``topology="strategy"``), no evaluation during the run, and once
  with ``evaluate_workers=True`` to show what evaluating every worker adds.
- ``lm``: the language-model benchmark's ``TransformerLM`` (4 layers, 160 wide, 64 bytes of
  context, 1.28 M parameters) on ``StdlibTextDataModule`` (batch 8), ``ddp`` and ``periodic``
  (period 50, all-reduce) at 16, 64 and 256 workers, a few steps, with the process's peak
  resident memory.

Each row: wall seconds per simulated step of all workers (the run's wall time less set-up and
evaluation, over its steps), the real compute inside it (``Node.execute``), the rest (overhead)
per step, and the peak RSS of the process so far (``ru_maxrss``: it only grows, so rows run in
increasing size). Modelled durations (``SpeedModel(step_seconds=0.05)``) and a 20 Mbit/s network.

Usage::

    python -m benchmarks.simulator.step_cost                 # both workloads (about 15 min on 2 cores)
    python -m benchmarks.simulator.step_cost --only mlp      # or lm
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lightning_dist.data import DigitsDataModule, StdlibTextDataModule
from lightning_dist.models import MLPClassifier, TransformerLM
from benchmarks.common.paths import RESULTS
from lightning_dist.sim import NetworkModel, Simulation, SpeedModel, make_protocol

NETWORK = NetworkModel(latency=0.0001, node_mbit=20)
SPEED = SpeedModel(step_seconds=0.05, aggregate_seconds=0.0)
MLP_PROTOCOLS = {
    "ddp": ("ddp", {}),
    "periodic": ("periodic", {"period": 10, "topology": "strategy"}),
    "dynamic_avg": ("dynamic_avg", {"divergence_threshold": 0.05, "check_every": 10, "topology": "strategy"}),
    "segmented_gossip": ("segmented_gossip", {"segments": 4, "replicas": 2, "period": 10, "topology": "strategy"}),
    "parameter_server": ("parameter_server", {"push_every": 10, "staleness_aware": False, "topology": "strategy"}),
}
LM_PROTOCOLS = {"ddp": ("ddp", {}), "periodic": ("periodic", {"period": 50, "topology": "strategy"})}


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB on Linux


def measure(model: Any, datamodule: Any, protocol: str, arguments: dict[str, Any], workers: int, steps: int,
            evaluate_workers: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    sim = Simulation(model, datamodule, make_protocol(protocol, **arguments), workers=workers, max_steps=steps,
                     network=NETWORK, speed=SPEED, eval_every=steps if evaluate_workers else 10**9,
                     evaluate_workers=evaluate_workers)
    result = sim.run()
    summary = result.summary
    loop = summary["wall_seconds"] - summary["setup_wall_seconds"] - summary["evaluation_wall_seconds"]
    return {
        "protocol": protocol, "workers": workers, "steps": steps, "evaluate_workers": evaluate_workers,
        "wall_s_per_step": loop / steps,
        "compute_s_per_step": summary["compute_wall_seconds"] / steps,
        "overhead_s_per_step": (loop - summary["compute_wall_seconds"]) / steps,
        "evaluation_wall_s": summary["evaluation_wall_seconds"], "evaluations": len(result.rows),
        "setup_wall_s": summary["setup_wall_seconds"],
        "virtual_s_per_step": summary["virtual_seconds"] / steps,
        "peak_rss_gb": peak_rss_gb(),
    }


def print_row(workload: str, row: dict[str, Any]) -> None:
    print(f"{workload:4} {row['protocol']:17} N={row['workers']:4} eval_workers={row['evaluate_workers']!s:5} "
          f"wall/step {row['wall_s_per_step']:7.3f} s  compute {row['compute_s_per_step']:7.3f} s  "
          f"overhead {row['overhead_s_per_step']:6.3f} s  eval {row['evaluation_wall_s']:6.2f} s "
          f"({row['evaluations']} rows)  peak RSS {row['peak_rss_gb']:5.2f} GB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=["mlp", "lm"])
    parser.add_argument("--lm-workers", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    if args.only in (None, "mlp"):
        for workers in (16, 64):
            for name, (protocol, arguments) in MLP_PROTOCOLS.items():
                model = MLPClassifier(num_features=64, hidden_size=64, learning_rate=0.1)
                row = measure(model, DigitsDataModule(batch_size=16), protocol, arguments, workers, 40, False)
                rows.append({"workload": "mlp", "model": "MLPClassifier 64-64-64-10", **row})
                print_row("mlp", row)
            model = MLPClassifier(num_features=64, hidden_size=64, learning_rate=0.1)
            row = measure(model, DigitsDataModule(batch_size=16), "periodic", MLP_PROTOCOLS["periodic"][1], workers,
                          40, True)
            rows.append({"workload": "mlp", "model": "MLPClassifier 64-64-64-10", **row})
            print_row("mlp", row)
    if args.only in (None, "lm"):
        for workers in args.lm_workers:
            for name, (protocol, arguments) in LM_PROTOCOLS.items():
                model = TransformerLM(block_size=64, n_layer=4, n_head=4, n_embd=160, learning_rate=2e-3)
                data = StdlibTextDataModule(block_size=64, batch_size=8, max_val_sequences=64)
                row = measure(model, data, protocol, arguments, workers, 3, False)
                rows.append({"workload": "lm", "model": "TransformerLM 4x160, 64 bytes",
                             "parameters": sum(p.numel() for p in model.parameters()), **row})
                print_row("lm", row)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("sim_scale.json" if args.only is None else f"sim_scale_{args.only}.json")
    path.write_text(json.dumps({
        "command": " ".join(["python", "benchmarks/simulator/step_cost.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d"), "python": platform.python_version(), "torch": torch.__version__,
        "cpus": len(__import__("os").sched_getaffinity(0)), "torch_threads": 1,
        "wall_seconds": time.perf_counter() - start, "rows": rows,
    }, indent=1))
    print(f"wrote {path} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
