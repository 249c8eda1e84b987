"""Main job: how much sooner does a language model reach its loss on a slow network with dynamic averaging than with DDP?

    python examples/lm_demo.py [--workers 4] [--mbit 20] [--target 2.6] [--out demo_out]

The simulator (``lightning_dist.sim``) trains the package's transformer language model
(``TransformerLM``, 1.3M parameters, on the Python standard library's source, contiguous shards per
worker, AdamW) on ``--workers`` virtual workers twice: with DDP (a gradient all-reduce every step)
and with dynamic averaging (paper 004: models are averaged only when one drifts more than ``Delta``
from the last average). Training is real; time is virtual: each step takes the compute time this
machine measures for it, and every byte crosses a modelled network where each node sends and
receives at most ``--mbit`` Mbit/s. Each method trains until its averaged model's validation loss
reaches ``--target`` nats per character. The script prints, per method, the virtual seconds and
steps to the target, the bytes sent and the speed-up, and writes a plot of loss against virtual time.

The same comparison on a real capped network, with every method and bandwidth, is
``benchmarks/lm_network.py``; ``benchmarks/lm_sim.py`` checks the simulator's times against it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from lightning_dist.data import StdlibTextDataModule
from lightning_dist.models import TransformerLM
from lightning_dist.sim import NetworkModel, Simulation, SpeedModel
from lightning_dist.sim.protocols import make_protocol

# The benchmark's workload (benchmarks/lm_network.py TASK).
DATA = {"block_size": 64, "batch_size": 8, "partition": "contiguous", "max_val_sequences": 64}
MODEL = {"block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 160, "learning_rate": 2e-3, "warmup_steps": 20}
# benchmarks/results/lm_network_calibration.json: the median ||f_i - r||^2 after 100 local steps without averaging.
DELTA = 212.0
CHECK_EVERY = 10
METHODS = {
    "DDP": ("ddp", {}),
    f"dynamic averaging (Delta={DELTA:g})": ("dynamic_avg", {"divergence_threshold": DELTA, "check_every": CHECK_EVERY}),
}
PAYLOAD_SHARE = 1448 / 1514  # TCP payload per Ethernet frame


def run(name: str, protocol: str, arguments: dict, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    datamodule = StdlibTextDataModule(seed=0, **DATA)
    model = TransformerLM(**MODEL)

    def reached(rows: list[dict[str, float]]) -> bool:
        return rows[-1].get("val_loss", float("inf")) <= args.target

    simulation = Simulation(
        model, datamodule, make_protocol(protocol, **arguments), workers=args.workers, max_steps=args.max_steps,
        network=NetworkModel(latency=0.0002, node_mbit=args.mbit * PAYLOAD_SHARE), speed=SpeedModel(),
        eval_every=10, evaluate_workers=False, stop_when=reached, seed=0)
    started = time.perf_counter()
    result = simulation.run()
    final = result.rows[-1]
    hit = final["val_loss"] <= args.target
    print(f"  {name:<32} {'reached' if hit else 'did not reach'} {args.target:g} after {final['mean_steps']:.0f} steps, "
          f"{final['time']:.1f} virtual s, {final['bytes'] / 1e6:.1f} MB sent ({time.perf_counter() - started:.0f} s wall)",
          flush=True)
    return {"name": name, "rows": result.rows, "reached": hit, "seconds": final["time"], "steps": final["mean_steps"],
            "bytes": final["bytes"]}


def plot(results: list[dict], args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(7, 4.5))
    for result in results:
        axis.plot([row["time"] for row in result["rows"]], [row["val_loss"] for row in result["rows"]],
                  label=result["name"])
    axis.axhline(args.target, color="black", linestyle=":", linewidth=1, label=f"target {args.target:g}")
    axis.set_xscale("log")
    axis.set_xlabel(f"virtual seconds ({args.workers} workers, {args.mbit:g} Mbit/s per node)")
    axis.set_ylabel("validation loss (nats/char)")
    axis.set_title("TransformerLM on the Python stdlib: DDP vs dynamic averaging", fontsize=10)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--mbit", type=float, default=20.0, help="cap per node, Mbit/s (each way)")
    parser.add_argument("--target", type=float, default=2.6, help="validation loss to reach, nats per character")
    parser.add_argument("--max-steps", type=int, default=600, help="steps per worker at most")
    parser.add_argument("--out", type=Path, default=Path("demo_out"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"TransformerLM ({sum(p.numel() for p in TransformerLM(**MODEL).parameters()) / 1e6:.2f}M parameters), "
          f"{args.workers} simulated workers, {args.mbit:g} Mbit/s per node, target val loss {args.target:g} nats/char")
    results = [run(name, protocol, arguments, args) for name, (protocol, arguments) in METHODS.items()]
    ddp, dynamic = results
    if ddp["reached"] and dynamic["reached"]:
        print(f"dynamic averaging reaches the target {ddp['seconds'] / dynamic['seconds']:.1f}x sooner than DDP "
              f"and sends {ddp['bytes'] / max(dynamic['bytes'], 1):.0f}x fewer bytes")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "lm_demo.png"
    plot(results, args, path)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
