"""Time to a target validation loss of a transformer language model against DDP, over network bandwidth.

The workload is the package's own: ``TransformerLM`` (a GPT-style character-level decoder, about
1.3M parameters here) on ``StdlibTextDataModule`` (the Python standard library's source, contiguous
shards per rank), AdamW, the same seed and the same wall-clock budget for every method. Every rank
runs in its own network namespace behind an htb cap of ``node_mbit`` on what it sends and on what it
receives (``benchmarks/common/netns.py``; Gloo over TCP), so every byte crosses a slow network. Methods:

- ``ddp``: Lightning's DDP, a gradient all-reduce every step (the baseline);
- ``ddp_powersgd_r1``, ``ddp_powersgd_r4``, ``ddp_fp16``: DDP with the compression a DDP user turns on
  first: PowerSGD of rank 1 and 4 (error feedback, warm start, plain all-reduces for the first
  step only), fp16 gradients. Lightning would drop these hooks on the CPU without a word;
  ``benchmarks/language_model/ddp_hooks.py`` registers them, in one DDP bucket as PowerSGD on Gloo needs;
- ``periodic_h10``, ``periodic_h50``: periodic averaging (local SGD) every 10 and 50 steps;
- ``fedavg``: FedAvg, ``C = 0.5``, every 10 steps;
- ``dynamic_lo``, ``dynamic_hi``: dynamic averaging (paper 004), checks every 10 steps, two
  divergence thresholds calibrated on this workload (``--calibrate``: the median ``||f_i - r||^2``
  after 20 and after 100 local steps without averaging, so a threshold means "about as far as 20
  or 100 steps go");
- ``dynamic_default``: dynamic averaging as ``strategy="dynamic_avg"`` gives it: the threshold measured in
  the run (the replicas' mean ``||f_i - r||^2`` over the period its probes of the network choose), no
  calibration run; ``dynamic_overhead10`` the same with ``sync_overhead=0.1`` (a longer period where
  synchronizing is cheap: fewer bytes);
- ``periodic_h50_int8``, ``dynamic_default_int8``: the same with ``compression="int8"`` (full
  synchronizations send int8 deltas from the common model, with error feedback);
- ``segmented_gossip``: paper 002, ``S = 4``, ``R = 2``, every 10 steps; ``gossip_p20_r1``,
  ``gossip_p50_r1``, ``gossip_p50_r2``: the sweep at the slow link (``R`` peers, every 20 or 50 steps;
  a round costs a rank ``R`` models in and about as many out, where a ring all-reduce costs 1.5);
- ``downpour``, ``downpour_p50``: asynchronous DownpourSGD (updates divided by their staleness plus
  one, the default), a push every 5 and every 50 steps (rank 0's port carries every other rank's
  push and reply: 6 models a round with 4 ranks, about 13 s at 20 Mbit/s); ``downpour_p20_int8``,
  ``downpour_p50_int8``: pushes and replies in int8 with error feedback (a quarter of the bytes), a push
  every 20 and every 50 steps;
- ``diloco``: periodic averaging every 50 steps with DiLoCo's outer step (SGD, Nesterov momentum 0.9,
  lr 0.7) on the averaged pseudo-gradient;
- ``dynamic_outer``: ``dynamic_hi`` with the same outer step at its full synchronizations (at the
  headline bandwidth only: it answers whether the outer step helps dynamic averaging);
- ``periodic_h50_stream``, ``diloco_stream`` and their ``_int8``: streaming synchronization (Streaming DiLoCo,
  ``lightning_dist/algorithms/streaming.py``): ``periodic_h50`` and ``diloco`` with the model cut into
  ``STREAM_FRAGMENTS`` (5) fragments, one merged every 10 steps, its exchange started ``STREAM_DELAY`` (5) steps
  before, ``STREAM_ALPHA`` (0.5) of the replica's own fragment kept at a merge (kind ``streaming``);
- ``torchft_diloco``, ``torchft_streaming_diloco``: torchft's ``DiLoCo`` (torchft 0.2.0, the ``torchft`` extra) with
  the same inner and outer optimizers, every 50 steps, blocking and with the streaming rows' fragments, delay and
  alpha: a Lighthouse on rank 0's node, one replica group per rank, Gloo over the same capped links
  (``benchmarks/language_model/torchft_diloco.py``, kind ``torchft``).

The caps are swept over ``--bandwidths`` (1000, 100, 20, 5 Mbit/s): one launch per bandwidth and seed
runs every method in turn (``benchmarks/language_model/worker.py``), three seeds at ``--headline-mbit`` (20),
one elsewhere. The target loss is the loss DDP reaches in the budget at the highest bandwidth (seed
0). Reported per method and bandwidth: seconds to the target (mean over seeds, the runs that reached
it), the final validation loss, protocol bytes (the strategies' counters; DDP moves gradients outside
them) and wire bytes (every byte the ranks' interfaces sent during the budget). DDP's trajectory in steps does not
depend on the network, so where DDP does not reach the target within the budget its time is also
given as a projection: its steps to the target at the highest bandwidth times its mean step time at
this bandwidth (marked ``proj``).

Outputs (``--out``, default ``benchmarks/results``): ``lm_network.json`` (config, corpus, calibration,
summaries, every run's curve and timings), ``lm_network.png`` (validation loss against wall-clock
time, one panel per bandwidth), ``lm_network_bandwidth.png`` (time to target against bandwidth: DDP, DDP +
PowerSGD rank 4, torchft's two DiLoCos and the fastest method at the headline bandwidth of each family, periodic
averaging / DiLoCo, dynamic averaging, segmented gossip, DownpourSGD, streaming: ``plotted_methods``), and
``runs/lm_network_*`` (specs, per-node logs, raw results). A launch without DDP at its top bandwidth has no target:
its JSON keeps the runs, without summary or figures (``--merge`` it into one that has DDP). The simulator's
prediction of the same table is ``benchmarks/language_model/simulated.py``, which reads this JSON.

Usage::

    python -m benchmarks.language_model.network --calibrate     # the dynamic thresholds (about 2 min)
    python -m benchmarks.language_model.network                 # the sweep (about 60 min on 2 cores)
    python -m benchmarks.language_model.network --quick         # smoke run: 2 methods, 2 bandwidths, short budget
    python -m benchmarks.language_model.network --replot        # summaries, figures and tables from the JSON
    python -m benchmarks.language_model.network --merge --bandwidths 5 --seeds 0   # one launch, added to the JSON
    python -m benchmarks.language_model.network --merge --bandwidths 20 --methods dynamic_default   # re-run methods, keep the rest

Exits 77 with a message where network namespaces cannot be built (not root, no ``ip``/``tc``).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import netns
from benchmarks.common.launch import RunFailed, launch_on_network
from benchmarks.common.paths import RESULTS
from benchmarks.common.report import chosen, command_line, pyplot, replot, save_figure, write_json

WORKER = Path(__file__).with_name("worker.py")
PREFIX = "lm_network"
RANKS = 4
BANDWIDTHS = [1000.0, 100.0, 20.0, 5.0]
HEADLINE_MBIT = 20.0
SEEDS = [0, 1, 2]
BUDGET_S = 45.0
SNAPSHOTS = 16
EVAL_SEQUENCES = 64
TARGET_SPEEDUP = 3.0  # the target: dynamic averaging reaches DDP's target 3x sooner at 20 Mbit/s
# About 1.3M parameters: 4 pre-norm blocks of width 160, context 64 bytes; batch 8 per rank (a step takes about
# 0.15 s with 4 ranks on 2 cores; 16 x 128 took 0.47 s, too few steps in a budget this machine can afford).
TASK: dict[str, Any] = {
    "data": {"block_size": 64, "batch_size": 8, "partition": "contiguous", "max_val_sequences": EVAL_SEQUENCES},
    "model": {"block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 160, "learning_rate": 2e-3, "warmup_steps": 20},
}
DILOCO_OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
DILOCO_PERIOD = 50
# Streaming synchronization (Streaming DiLoCo; lightning_dist/algorithms/streaming.py): P fragments, one merged every
# period / P steps, its exchange started tau steps before, alpha of the replica's own fragment kept at a merge. The same
# for the package's streaming rows and torchft's.
STREAM_FRAGMENTS = 5
STREAM_DELAY = 5
STREAM_ALPHA = 0.5
CHECK_EVERY = 10
CALIBRATION_STEPS = (20, 100)  # local steps whose median drift sets dynamic_lo and dynamic_hi
MASTER_PORT = 29710


SPARSE = {"density": 0.02, "bits": 2}
"""The sparse methods' ``SparseCodec`` arguments (chunks of 4096, no decay): SparseLoCo's 1-3% at 2 bits."""

SPARSE_SWEEP = [(density, bits) for density in (0.01, 0.02, 0.05) for bits in (2, 4) if (density, bits) != (0.02, 2)]
"""The density x bits sweep of sparse averaging every 10 steps (2% at 2 bits is ``periodic_h10_sparse``)."""


def methods(thresholds: dict[str, float]) -> list[dict[str, Any]]:
    def strategy(cls: str, **kwargs: Any) -> dict[str, Any]:
        return {"class": cls, "kwargs": kwargs}

    dynamic = lambda delta: strategy("DynamicAveragingStrategy", divergence_threshold=delta,  # noqa: E731
                                     check_every=CHECK_EVERY)
    stream = {"fragments": STREAM_FRAGMENTS, "fragment_sync_delay": STREAM_DELAY, "fragment_update_alpha": STREAM_ALPHA}
    streaming = f"{STREAM_FRAGMENTS} fragments, tau={STREAM_DELAY}, alpha={STREAM_ALPHA:g}"
    stream_a0 = {**stream, "fragment_update_alpha": 0.0}
    streaming_a0 = f"{STREAM_FRAGMENTS} fragments, tau={STREAM_DELAY}, alpha=0"
    return [
        {"name": "ddp", "kind": "ddp", "label": "DDP (gradient all-reduce every step)"},
        {"name": "ddp_powersgd_r1", "kind": "ddp", "label": "DDP + PowerSGD rank 1 (error feedback, from step 2)",
         "hook": {"name": "powersgd", "matrix_approximation_rank": 1}},
        {"name": "ddp_powersgd_r4", "kind": "ddp", "label": "DDP + PowerSGD rank 4 (error feedback, from step 2)",
         "hook": {"name": "powersgd", "matrix_approximation_rank": 4}},
        {"name": "ddp_fp16", "kind": "ddp", "label": "DDP + fp16 gradient compression",
         "hook": {"name": "fp16"}},
        {"name": "periodic_h10", "kind": "periodic", "label": "periodic averaging, every 10 steps",
         "strategy": strategy("PeriodicAveragingStrategy", period=10)},
        {"name": "periodic_h50", "kind": "periodic", "label": "periodic averaging, every 50 steps",
         "strategy": strategy("PeriodicAveragingStrategy", period=50)},
        {"name": "fedavg", "kind": "fedavg", "label": "FedAvg C=0.5, every 10 steps",
         "strategy": strategy("PeriodicAveragingStrategy", period=10, client_fraction=0.5)},
        {"name": "dynamic_lo", "kind": "dynamic", "label": f"dynamic averaging, Delta={thresholds['lo']:.3g}",
         "strategy": dynamic(thresholds["lo"])},
        {"name": "dynamic_hi", "kind": "dynamic", "label": f"dynamic averaging, Delta={thresholds['hi']:.3g}",
         "strategy": dynamic(thresholds["hi"])},
        {"name": "dynamic_default", "kind": "dynamic",
         "label": "dynamic averaging, defaults (Delta measured in the run)",
         "strategy": strategy("DynamicAveragingStrategy", check_every=CHECK_EVERY)},
        {"name": "dynamic_overhead10", "kind": "dynamic",
         "label": "dynamic averaging, defaults but sync_overhead=0.1",
         "strategy": strategy("DynamicAveragingStrategy", check_every=CHECK_EVERY, sync_overhead=0.1)},
        {"name": "periodic_h50_int8", "kind": "periodic",
         "label": "periodic averaging, every 50 steps, int8 deltas with error feedback",
         "strategy": strategy("PeriodicAveragingStrategy", period=50, compression="int8")},
        {"name": "periodic_h50_sparse", "kind": "periodic",
         "label": f"periodic averaging, every 50 steps, sparse: {SPARSE['density']:.0%} of each chunk at "
                  f"{SPARSE['bits']} bits (SparseLoCo's codec)",
         "strategy": strategy("PeriodicAveragingStrategy", period=50, compression={"sparse": SPARSE})},
        {"name": "periodic_h10_sparse", "kind": "periodic",
         "label": f"periodic averaging, every 10 steps, sparse: {SPARSE['density']:.0%} of each chunk at "
                  f"{SPARSE['bits']} bits (SparseLoCo's codec)",
         "strategy": strategy("PeriodicAveragingStrategy", period=10, compression={"sparse": SPARSE})},
        *[{"name": f"periodic_h10_sparse_d{density * 100:g}_b{bits}", "kind": "periodic",
           "label": f"periodic averaging, every 10 steps, sparse: {density:.0%} of each chunk at {bits} bits",
           "strategy": strategy("PeriodicAveragingStrategy", period=10,
                                compression={"sparse": {"density": density, "bits": bits}})}
          for density, bits in SPARSE_SWEEP],
        {"name": "dynamic_default_int8", "kind": "dynamic",
         "label": "dynamic averaging, defaults, int8 deltas with error feedback",
         "strategy": strategy("DynamicAveragingStrategy", check_every=CHECK_EVERY, compression="int8")},
        {"name": "segmented_gossip", "kind": "gossip", "label": "segmented gossip S=4 R=2, every 10 steps",
         "strategy": strategy("SegmentedGossipStrategy", segments=4, replicas=2, period=10)},
        {"name": "gossip_p20_r1", "kind": "gossip", "label": "segmented gossip S=4 R=1, every 20 steps",
         "strategy": strategy("SegmentedGossipStrategy", segments=4, replicas=1, period=20)},
        {"name": "gossip_p50_r1", "kind": "gossip", "label": "segmented gossip S=4 R=1, every 50 steps",
         "strategy": strategy("SegmentedGossipStrategy", segments=4, replicas=1, period=50)},
        {"name": "gossip_p50_r2", "kind": "gossip", "label": "segmented gossip S=4 R=2, every 50 steps",
         "strategy": strategy("SegmentedGossipStrategy", segments=4, replicas=2, period=50)},
        {"name": "downpour", "kind": "downpour", "label": "DownpourSGD async, push every 5 steps",
         "strategy": strategy("DownpourSGDStrategy", push_every=5)},
        {"name": "downpour_p50", "kind": "downpour", "label": "DownpourSGD async, push every 50 steps",
         "strategy": strategy("DownpourSGDStrategy", push_every=50)},
        {"name": "downpour_p20_int8", "kind": "downpour", "label": "DownpourSGD async, push every 20 steps, int8",
         "strategy": strategy("DownpourSGDStrategy", push_every=20, compression="int8")},
        {"name": "downpour_p50_int8", "kind": "downpour", "label": "DownpourSGD async, push every 50 steps, int8",
         "strategy": strategy("DownpourSGDStrategy", push_every=50, compression="int8")},
        {"name": "diloco", "kind": "periodic", "label": "DiLoCo: every 50 steps, outer Nesterov SGD lr 0.7",
         "strategy": strategy("PeriodicAveragingStrategy", period=DILOCO_PERIOD), "outer": DILOCO_OUTER},
        {"name": "dynamic_outer", "kind": "dynamic",
         "label": f"dynamic averaging Delta={thresholds['hi']:.3g} + DiLoCo outer step",
         "strategy": dynamic(thresholds["hi"]), "outer": DILOCO_OUTER, "headline_only": True},
        {"name": "periodic_h50_stream", "kind": "streaming",
         "label": f"streaming periodic averaging, every {DILOCO_PERIOD} steps, {streaming}",
         "strategy": strategy("PeriodicAveragingStrategy", period=DILOCO_PERIOD, **stream)},
        {"name": "periodic_h50_stream_int8", "kind": "streaming",
         "label": f"streaming periodic averaging, every {DILOCO_PERIOD} steps, {streaming}, int8",
         "strategy": strategy("PeriodicAveragingStrategy", period=DILOCO_PERIOD, **stream, compression="int8")},
        # alpha = 0 (torchft's default): a merge takes the synchronized fragment whole, as blocking averaging does
        {"name": "periodic_h50_stream_a0", "kind": "streaming",
         "label": f"streaming periodic averaging, every {DILOCO_PERIOD} steps, {streaming_a0}",
         "strategy": strategy("PeriodicAveragingStrategy", period=DILOCO_PERIOD, **stream_a0)},
        {"name": "periodic_h50_stream_a0_int8", "kind": "streaming",
         "label": f"streaming periodic averaging, every {DILOCO_PERIOD} steps, {streaming_a0}, int8",
         "strategy": strategy("PeriodicAveragingStrategy", period=DILOCO_PERIOD, **stream_a0, compression="int8")},
        {"name": "diloco_stream", "kind": "streaming",
         "label": f"streaming DiLoCo, every {DILOCO_PERIOD} steps, {streaming}",
         "strategy": strategy("PeriodicAveragingStrategy", period=DILOCO_PERIOD, **stream), "outer": DILOCO_OUTER},
        {"name": "diloco_stream_int8", "kind": "streaming",
         "label": f"streaming DiLoCo, every {DILOCO_PERIOD} steps, {streaming}, int8",
         "strategy": strategy("PeriodicAveragingStrategy", period=DILOCO_PERIOD, **stream, compression="int8"),
         "outer": DILOCO_OUTER},
        {"name": "torchft_diloco", "kind": "torchft",
         "label": f"torchft DiLoCo, every {DILOCO_PERIOD} steps, outer Nesterov SGD lr 0.7",
         "torchft": {"sync_every": DILOCO_PERIOD, "fragments": 1, "fragment_sync_delay": 0,
                     "fragment_update_alpha": 0.0},
         "outer": DILOCO_OUTER},
        {"name": "torchft_streaming_diloco", "kind": "torchft",
         "label": f"torchft streaming DiLoCo, every {DILOCO_PERIOD} steps, {streaming}",
         "torchft": {"sync_every": DILOCO_PERIOD, **stream}, "outer": DILOCO_OUTER},
    ]


def provenance(argv: list[str] | None) -> dict[str, Any]:
    """What made a report: the command line, the versions and the date."""
    import lightning
    import torch

    command = command_line(argv)
    return {"command": command, "python": platform.python_version(), "torch": torch.__version__,
            "lightning": lightning.__version__, "date": time.strftime("%Y-%m-%d")}


def spec_of(args: argparse.Namespace, name: str, seed: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": name, **TASK, "seed": seed, "budget_s": args.budget, "snapshots": SNAPSHOTS,
            "eval_sequences": EVAL_SEQUENCES, "runs": runs}


def timeout_of(runs: list[dict[str, Any]], budget: float) -> float:
    return len(runs) * (budget + 90) + 180


# ---------------------------------------------------------------- calibration


def calibrate(args: argparse.Namespace) -> dict[str, Any]:
    """Drift without averaging: dynamic averaging with a threshold nothing reaches, at the top bandwidth."""
    run = {"name": "calibration", "kind": "dynamic",
           "strategy": {"class": "DynamicAveragingStrategy",
                        "kwargs": {"divergence_threshold": 1e30, "check_every": CHECK_EVERY}}}
    budget = args.budget
    spec = {**spec_of(args, f"{PREFIX}_calibration", 0, [run]), "budget_s": budget}
    with netns.Network(nodes=args.ranks, node_mbit=max(args.bandwidths)) as network:
        raw = launch_on_network(network, spec, args.out / "runs", timeout_of([run], budget), MASTER_PORT, WORKER)
    per_rank = raw["runs"][0]["distances_per_rank"]
    checks = {CHECK_EVERY * (index + 1): [rank[index] for rank in per_rank] for index in range(len(per_rank[0]))}
    picked = {}
    for key, steps in zip(("lo", "hi"), CALIBRATION_STEPS):
        if steps not in checks:
            raise RunFailed(f"calibration reached {max(checks)} steps, fewer than {steps}; raise --budget")
        picked[key] = statistics.median(checks[steps])
    print(f"calibration: median ||f_i - r||^2 after {CALIBRATION_STEPS} steps = {picked['lo']:.4g}, {picked['hi']:.4g}")
    return {"thresholds": picked, "check_every": CHECK_EVERY, "steps": list(CALIBRATION_STEPS),
            "median_by_step": {step: statistics.median(values) for step, values in checks.items()},
            "budget_s": budget}


# ---------------------------------------------------------------- the sweep


def seeds_at(args: argparse.Namespace, mbit: float) -> list[int]:
    """The seeds run at ``mbit``: every seed of ``--seeds`` where it was given, else all at the headline bandwidth and
    the first elsewhere (the default sweep)."""
    if args.seeds is not None:
        return args.seeds
    return SEEDS if mbit == args.headline_mbit else SEEDS[:1]


def run_launch(args: argparse.Namespace, network: Any, name: str, mbit: float, seed: int, runs: list[dict[str, Any]],
               port: int, ranks_per_node: int = 1) -> dict[str, Any]:
    """One launch of every method of ``runs`` on ``network`` (capped at ``mbit``): its runs, labelled, or its error."""
    print(f"{name}: {len(runs)} methods x {args.budget:g} s on {network.nodes} node(s) x {ranks_per_node} ...", flush=True)
    try:
        raw = launch_on_network(network, spec_of(args, name, seed, runs), args.out / "runs",
                                timeout_of(runs, args.budget), port, WORKER, ranks_per_node)
    except RunFailed as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return {"node_mbit": mbit, "seed": seed, "error": str(exc)}
    labels = {run["name"]: run["label"] for run in runs}
    for run in raw["runs"]:  # the day: a merged report's table says which launches its rows come from
        run.update(label=labels[run["name"]], node_mbit=mbit, seed=seed, date=time.strftime("%Y-%m-%d"))
    print(f"  done in {raw['launch_s']:.0f} s", flush=True)
    return {"node_mbit": mbit, "seed": seed, "launch_s": raw["launch_s"], "runs": raw["runs"], "corpus": raw["corpus"]}


def sweep(args: argparse.Namespace, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results = []
    with netns.Network(nodes=args.ranks, node_mbit=args.bandwidths[0]) as network:
        for mbit in args.bandwidths:
            network.set_caps(mbit, None)
            for seed in seeds_at(args, mbit):
                launch_runs = [run for run in runs if mbit == args.headline_mbit or not run.get("headline_only")]
                results.append(run_launch(args, network, f"{PREFIX}_{mbit:g}mbit_seed{seed}", mbit, seed, launch_runs,
                                          MASTER_PORT + len(results) % 50))
    return results


def merged(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``old`` launches with ``new`` ones merged in: a new launch's runs replace the runs of the same methods at its
    bandwidth and seed, and the old launch's other methods stay (e.g. DDP, which a re-run of some methods leaves
    alone); launches of other bandwidths and seeds are kept as they are."""
    previous = {(launch["node_mbit"], launch["seed"]): launch for launch in old}
    for launch in new:
        earlier = previous.pop((launch["node_mbit"], launch["seed"]), None)
        if earlier is not None and "runs" in earlier and "runs" in launch:
            names = {run["name"] for run in launch["runs"]}
            launch = {**launch, "runs": [run for run in earlier["runs"] if run["name"] not in names] + launch["runs"]}
        previous[launch["node_mbit"], launch["seed"]] = launch
    return list(previous.values())


# ---------------------------------------------------------------- summaries


def first_reach(curve: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    return next((point for point in curve if point["val_loss"] <= target), None)


def mean_step_s(run: dict[str, Any]) -> float:
    """Mean seconds per training step over all ranks, the first 5 steps (warm-up) left out."""
    durations = [d for rank in run["step_s_per_rank"] for d in rank[5:]] or [d for rank in run["step_s_per_rank"] for d in rank]
    return statistics.fmean(durations)


def all_runs(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [run for launch in report["launches"] if "runs" in launch for run in launch["runs"]]


def summarize(report: dict[str, Any], target: float | None = None) -> dict[str, Any]:
    """Rows per method and bandwidth; the target loss is DDP's final one at the top bandwidth unless given."""
    runs = all_runs(report)
    top = max(run["node_mbit"] for run in runs)
    ddp_top = {run["seed"]: run for run in runs if run["name"] == "ddp" and run["node_mbit"] == top}
    target_rule = f"DDP's final validation loss at {top:g} Mbit/s, seed {min(ddp_top)}" if target is None else "given"
    target = ddp_top[min(ddp_top)]["final_val_loss"] if target is None else target
    rows = []
    for mbit in sorted({run["node_mbit"] for run in runs}, reverse=True):
        for name in dict.fromkeys(run["name"] for run in runs):
            group = [run for run in runs if run["name"] == name and run["node_mbit"] == mbit]
            if not group:
                continue
            hits = [hit for run in group if (hit := first_reach(run["curve"], target))]
            reached = [hit["seconds"] for hit in hits]
            row = {"name": name, "label": group[0]["label"], "node_mbit": mbit, "seeds": [run["seed"] for run in group],
                   "reached": len(reached), "time_to_target_s": statistics.fmean(reached) if reached else None,
                   "time_to_target_s_each": [(hit or {}).get("seconds") for run in group
                                             for hit in [first_reach(run["curve"], target)]],
                   "final_val_loss": statistics.fmean(run["final_val_loss"] for run in group),
                   "final_val_loss_std": statistics.pstdev(run["final_val_loss"] for run in group),
                   "steps": statistics.fmean(run["steps"] for run in group),
                   "step_s": statistics.fmean(mean_step_s(run) for run in group),
                   "protocol_bytes": (statistics.fmean(run["protocol_bytes"] for run in group)
                                      if "protocol_bytes" in group[0] else None),
                   "wire_bytes": statistics.fmean(run["curve"][-1]["wire_bytes"] for run in group),
                   # Every byte on the wire (setup included) by the evaluation that first reached the target.
                   "wire_bytes_to_target": statistics.fmean(hit["wire_bytes"] for hit in hits) if hits else None}
            if name == "ddp":
                projections = []
                for run in group:
                    hit = first_reach(ddp_top.get(run["seed"], ddp_top[min(ddp_top)])["curve"], target)
                    if hit:
                        projections.append(hit["step"] * mean_step_s(run))
                row["projected_time_to_target_s"] = statistics.fmean(projections) if projections else None
            rows.append(row)
    for row in rows:
        ddp = next((r for r in rows if r["name"] == "ddp" and r["node_mbit"] == row["node_mbit"]), None)
        if ddp is None:  # a launch without DDP at this bandwidth (its target given): no ratio to DDP
            row.update(ddp_time_to_target_s=None, ddp_time_is_projected=False, speedup_vs_ddp=None)
            continue
        baseline = ddp["time_to_target_s"] if ddp["reached"] == len(ddp["seeds"]) else ddp["projected_time_to_target_s"]
        row["ddp_time_to_target_s"] = baseline
        row["ddp_time_is_projected"] = ddp["reached"] < len(ddp["seeds"])
        row["speedup_vs_ddp"] = (baseline / row["time_to_target_s"]
                                 if baseline and row["time_to_target_s"] and row["reached"] == len(row["seeds"]) else None)
    return {"target_val_loss": target, "target_rule": target_rule, "rows": rows}


def fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(summary: dict[str, Any]) -> str:
    header = ("| Mbit/s | method | seeds reaching | s to target | DDP s to target | speed-up vs DDP | final val loss "
              "| steps | s/step | protocol MB | wire MB | wire MB to target |")
    lines = [header, "|" + "---|" * 12]
    for row in summary["rows"]:
        ddp_s = fmt_s(row["ddp_time_to_target_s"]) + (" proj" if row["ddp_time_is_projected"] else "")
        speedup = "-" if row["speedup_vs_ddp"] is None else f"{row['speedup_vs_ddp']:.2f}x"
        protocol = "-" if row["protocol_bytes"] is None else f"{row['protocol_bytes'] / 1e6:.1f}"
        lines.append(
            f"| {row['node_mbit']:g} | {row['name']} | {row['reached']}/{len(row['seeds'])} | {fmt_s(row['time_to_target_s'])} "
            f"| {ddp_s} | {speedup} | {row['final_val_loss']:.3f} +- {row['final_val_loss_std']:.3f} | {row['steps']:.0f} "
            f"| {row['step_s']:.3f} | {protocol} | {row['wire_bytes'] / 1e6:.1f} "
            f"| {fmt_s(None if row['wire_bytes_to_target'] is None else row['wire_bytes_to_target'] / 1e6)} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- figures


# The bandwidth figure: the baselines by name, then the fastest method of each of the package's families (by kind).
PLOT_BASELINES = {"ddp": "DDP", "ddp_powersgd_r4": "DDP + PowerSGD rank 4", "torchft_diloco": "torchft DiLoCo",
                  "torchft_streaming_diloco": "torchft streaming DiLoCo"}
PLOT_FAMILIES = {"periodic averaging / DiLoCo": ("periodic", "fedavg"), "dynamic averaging": ("dynamic",),
                 "segmented gossip": ("gossip",), "DownpourSGD": ("downpour",), "streaming": ("streaming",)}
# Each line its own colour and marker; baselines dashed, the package's methods solid.
PLOT_STYLES = {
    "DDP": ("black", "s", "--"), "DDP + PowerSGD rank 4": ("#7f7f7f", "D", "--"),
    "torchft DiLoCo": ("#8c564b", "^", "--"), "torchft streaming DiLoCo": ("#e377c2", "v", "--"),
    "periodic averaging / DiLoCo": ("#1f77b4", "o", "-"), "dynamic averaging": ("#ff7f0e", "P", "-"),
    "segmented gossip": ("#2ca02c", "X", "-"), "DownpourSGD": ("#d62728", "*", "-"), "streaming": ("#9467bd", "h", "-"),
}


def plotted_methods(summary: dict[str, Any], kinds: dict[str, str], headline_mbit: float) -> list[tuple[str, str]]:
    """``(slot, method name)`` of the lines of the bandwidth figure: each baseline of ``PLOT_BASELINES`` that has rows,
    then, per family of ``PLOT_FAMILIES`` (methods by ``kinds``, name to kind), its fastest method at ``headline_mbit``
    (or, where the family has no row there, at the lowest bandwidth it has): the most seeds reaching the target, then
    the shortest mean time to it, then the lowest final loss."""
    rows = summary["rows"]
    names = set(row["name"] for row in rows)
    chosen = [(slot, name) for name, slot in PLOT_BASELINES.items() if name in names]
    for family, family_kinds in PLOT_FAMILIES.items():
        candidates = [row for row in rows if kinds.get(row["name"]) in family_kinds]
        if not candidates:
            continue
        bandwidths = {row["node_mbit"] for row in candidates}
        mbit = headline_mbit if headline_mbit in bandwidths else min(bandwidths)
        best = min((row for row in candidates if row["node_mbit"] == mbit),
                   key=lambda row: (-row["reached"] / len(row["seeds"]), row["time_to_target_s"] or math.inf,
                                    row["final_val_loss"]))
        chosen.append((family, best["name"]))
    return chosen


def plot(report: dict[str, Any], out: Path) -> list[Path]:
    plt = pyplot()

    summary, runs = report["summary"], all_runs(report)
    target = summary["target_val_loss"]
    names = list(dict.fromkeys(run["name"] for run in runs))
    colors = {name: plt.get_cmap("tab10")(index % 10) for index, name in enumerate(names)}
    bandwidths = sorted({run["node_mbit"] for run in runs}, reverse=True)
    columns = min(len(bandwidths), 2)
    rows_n = math.ceil(len(bandwidths) / columns)
    fig, axes = plt.subplots(rows_n, columns, figsize=(7 * columns, 4.6 * rows_n), squeeze=False)
    for axis, mbit in zip(axes.flat, bandwidths):
        for run in runs:
            if run["node_mbit"] == mbit and run["seed"] == min(r["seed"] for r in runs if r["node_mbit"] == mbit):
                curve = run["curve"]
                axis.plot([p["seconds"] for p in curve], [p["val_loss"] for p in curve], color=colors[run["name"]],
                          label=run["name"], linewidth=1.4, linestyle="--" if run["name"] == "ddp" else "-")
        axis.axhline(target, color="black", linestyle=":", linewidth=1)
        axis.set_title(f"{mbit:g} Mbit/s per node, {report['config']['ranks']} ranks", fontsize=10)
        axis.set_xlabel("wall-clock seconds of training")
        axis.set_ylabel("validation loss (nats/char)")
        axis.grid(True, alpha=0.3)
    axes.flat[0].legend(fontsize=7, ncol=2)
    for axis in list(axes.flat)[len(bandwidths):]:
        axis.set_visible(False)
    fig.suptitle(f"TransformerLM on the Python stdlib: validation loss vs time (dotted: target {target:.3f})", fontsize=11)
    curves = out / f"{PREFIX}.png"
    save_figure(fig, curves, dpi=120)

    fig, axis = plt.subplots(figsize=(11, 5.2))
    kinds = {run["name"]: run["kind"] for run in runs}
    for slot, name in plotted_methods(summary, kinds, report["config"].get("headline_mbit", HEADLINE_MBIT)):
        color, marker, linestyle = PLOT_STYLES[slot]
        label = slot if slot in PLOT_BASELINES.values() else f"{slot}, best: {name}"
        rows = [row for row in summary["rows"] if row["name"] == name]
        points = [(row["node_mbit"], row["time_to_target_s"]) for row in rows if row["time_to_target_s"]]
        if not points:  # run, never at the target: in the legend only, said so
            label += " (target not reached in the budget)"
        axis.plot(*(zip(*points) if points else ([], [])), marker=marker, markersize=7, linestyle=linestyle,
                  color=color, label=label)
        if name == "ddp":
            projected = [(row["node_mbit"], row["projected_time_to_target_s"]) for row in rows
                         if row["projected_time_to_target_s"]]
            if projected:
                axis.plot(*zip(*projected), marker="x", markersize=7, linestyle=":", color=color,
                          label="DDP, projected (steps at 1000 Mbit/s x its step here)")
    axis.axhline(report["config"]["budget_s"], color="grey", linestyle=":", linewidth=1, label="budget")
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xticks(bandwidths, [f"{mbit:g}" for mbit in bandwidths])
    axis.minorticks_off()
    axis.invert_xaxis()
    axis.set_xlabel("node cap (Mbit/s)")
    axis.set_ylabel(f"seconds to val loss {target:.3f}")
    fig.suptitle(f"Time to DDP's target loss against bandwidth (mean over the seeds that reached it):\nthe baselines "
                 f"and each family's fastest at {report['config'].get('headline_mbit', HEADLINE_MBIT):g} Mbit/s "
                 "(every method: lm_network.json and its table)", fontsize=10)
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    bandwidth = out / f"{PREFIX}_bandwidth.png"
    save_figure(fig, bandwidth, dpi=120)
    return [curves, bandwidth]


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibrate", action="store_true", help="measure the dynamic thresholds and stop")
    parser.add_argument("--quick", action="store_true", help="smoke run: ddp and dynamic_hi at 1000 and 20 Mbit/s, 15 s")
    parser.add_argument("--replot", action="store_true", help="summaries, figures and tables from the JSON; run nothing")
    parser.add_argument("--ranks", type=int, default=RANKS)
    parser.add_argument("--bandwidths", type=float, nargs="+", default=None)
    parser.add_argument("--headline-mbit", type=float, default=HEADLINE_MBIT)
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help=f"seeds at every bandwidth (default: {SEEDS} at the headline bandwidth, {SEEDS[0]} elsewhere)")
    parser.add_argument("--methods", nargs="+", default=None, help="method names (default: all)")
    parser.add_argument("--budget", type=float, default=None, help=f"seconds of training per method ({BUDGET_S:g})")
    parser.add_argument("--merge", action="store_true",
                        help="add these launches to the existing JSON (methods run again at a bandwidth and seed replace their runs)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.bandwidths = args.bandwidths or ([1000.0, 20.0] if args.quick else BANDWIDTHS)
    args.budget = args.budget or (15.0 if args.quick else BUDGET_S)
    if args.quick:
        args.seeds, args.methods = (args.seeds or SEEDS)[:1], args.methods or ["ddp", "dynamic_hi"]
    json_path = args.out / f"{PREFIX}.json"
    if args.replot:
        return replot(json_path, summarize, table, lambda report: plot(report, args.out))

    netns.require_network("benchmarks.language_model.network")
    args.out.mkdir(parents=True, exist_ok=True)
    calibration_path = args.out / f"{PREFIX}_calibration.json"
    if args.calibrate:
        calibration = calibrate(args)
        write_json(calibration_path, calibration)
        print(f"wrote {calibration_path}")
        return 0
    if not calibration_path.exists():
        print(f"no {calibration_path}: run `python -m benchmarks.language_model.network --calibrate` first", file=sys.stderr)
        return 2
    calibration = json.loads(calibration_path.read_text())
    runs = chosen(methods(calibration["thresholds"]), args.methods)
    started = time.perf_counter()
    report: dict[str, Any] = {"config": {
        **TASK, "ranks": args.ranks, "bandwidths": args.bandwidths, "headline_mbit": args.headline_mbit,
        "seeds": args.seeds or SEEDS, "budget_s": args.budget, "snapshots": SNAPSHOTS, "eval_sequences": EVAL_SEQUENCES,
        "methods": runs, "calibration": calibration, "quick": args.quick, **provenance(argv)}}
    launches = sweep(args, runs)
    if args.merge and json_path.exists():
        launches = merged(json.loads(json_path.read_text())["launches"], launches)
        names = {run["name"] for launch in launches for run in launch.get("runs", [])}
        report["config"].update(bandwidths=sorted({launch["node_mbit"] for launch in launches}, reverse=True),
                                seeds=sorted({launch["seed"] for launch in launches}),
                                methods=[run for run in methods(calibration["thresholds"]) if run["name"] in names])
    report["launches"] = launches
    report["config"]["wall_s"] = time.perf_counter() - started
    failed = any("error" in launch for launch in report["launches"])
    runs_done = all_runs(report)
    top = max((run["node_mbit"] for run in runs_done), default=None)
    if any(run["name"] == "ddp" and run["node_mbit"] == top for run in runs_done):
        report["summary"] = summarize(report)
        print(table(report["summary"]))
        print("wrote", *plot(report, args.out))
    elif runs_done:  # no target loss without DDP at the top bandwidth: the runs as they are, no summary or figures
        print(f"no DDP run at {top:g} Mbit/s, so no target loss: no summary or figures (add ddp, or --merge into a "
              "JSON that has it)")
        for run in runs_done:
            print(f"  {run['node_mbit']:g} Mbit/s seed {run['seed']} {run['name']}: {run['steps']} steps, "
                  f"{mean_step_s(run):.3f} s/step, final val loss {run['final_val_loss']:.3f}, "
                  f"wire {run['wire_sent_bytes'] / 1e6:.1f} MB")
    write_json(json_path, report)
    print(f"total wall time {report['config']['wall_s']:.0f} s; results in {json_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
