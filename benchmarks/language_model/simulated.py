"""The simulator's prediction of ``benchmarks/language_model/network.py``'s table, and its extension past this machine.

``lightning_dist.sim`` runs the same workload (the same ``TransformerLM``, ``StdlibTextDataModule``,
AdamW, seed 0) with the same methods on virtual workers, on a modelled network with the measured
run's caps: each node sends and receives at most ``node_mbit`` (times the TCP payload share of an
Ethernet frame, 1448 / 1514) with ``LATENCY_S`` per message, and never faster than this machine's
ceiling. Training is real; time is virtual. Two constants of the machine come from the measured run,
both at its highest bandwidth, neither from a time to target:

- a step takes ``step_s`` of virtual time, the median step of a local-update method (compute only:
  its steps without a synchronization);
- the ceiling is the node rate periodic averaging's synchronizations reached there (a ring
  all-reduce of the model, inverted through ``ring_all_reduce_seconds``). Four ranks on two cores
  move about 215 Mbit/s through the namespaces (2026-11-24 run), so a 1000 Mbit/s cap is not what
  binds; every smaller cap measured here is below the ceiling and unaffected by it.

Every protocol moves what its strategy moves (DDP and periodic averaging a ring all-reduce, FedAvg a reduce into the
participants' chunks and an all-gather of the mean, DownpourSGD pushes and pulls to a server on rank 0;
``lightning_dist.sim.collectives``, ``lightning_dist.sim.protocols.subset_average``).

Part 1, prediction: for every method and bandwidth of the measured JSON, the simulated seconds to
the measured target loss, the final loss after the same budget of (virtual) seconds and the steps
taken, next to the measured ones and their ratio (the goal: within 20%).

Part 2, extension: the same methods at 16, 64 and 256 workers (``--scale-workers``) on the headline
bandwidth, each worker with the same batch (weak scaling: the global batch grows with the workers),
until the target loss or ``--scale-max-steps`` steps per worker.

Outputs (``--out``, default ``benchmarks/results``): ``lm_sim.json`` and ``lm_sim.png`` (predicted
against measured seconds to target; time to target against workers).

The figures replay bit for bit on any x86-64 CPU with AVX2, given the same torch and corpus: by default the
simulations train with 1 thread and ``main`` pins torch's CPU kernels
(:func:`lightning_dist.sim.numerics.pin_cpu_kernels`). ``--threads`` and ``--native-kernels`` (the CPU's own
kernels) run about 3x faster, with figures that compare bit for bit only with runs of that kind; every run records
what it had (``numerics``).

Usage::

    python -m benchmarks.language_model.simulated                    # both parts (reads benchmarks/results/lm_network.json)
    python -m benchmarks.language_model.simulated --predict-only
    python -m benchmarks.language_model.simulated --scale-only --scale-workers 16 64
    python -m benchmarks.language_model.simulated --replot
    python -m benchmarks.language_model.simulated --merge-from /tmp/run/lm_sim.json   # add another run's cells
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_dist.algorithms.outer import diloco_outer_optimizer
from lightning_dist.data import StdlibTextDataModule
from lightning_dist.models import TransformerLM
from lightning_dist.sim import NetworkModel, Simulation, SpeedModel
from lightning_dist.sim.network_model import ring_all_reduce_seconds
from lightning_dist.sim.numerics import pin_cpu_kernels
from lightning_dist.sim.protocols import Protocol, make_protocol

from benchmarks.common.paths import REPO, RESULTS
from benchmarks.common.report import check_names, command_line, pyplot, save_figure, write_json
from benchmarks.language_model.retime import check_loss_tolerance, retimed_scale

PREFIX = "lm_sim"
PAYLOAD_SHARE = 1448 / 1514
LATENCY_S = 0.0002
SCALE_WORKERS = [16, 64, 256]
SCALE_METHODS = ["ddp", "periodic_h50", "dynamic_hi", "diloco"]
SCALE_MAX_STEPS = 150
EVALUATIONS = 16  # evaluations over a run's budget, as the measured run's parameter copies


def protocol_of(method: dict[str, Any]) -> Protocol:
    """The simulator's protocol for one of ``lm_network.methods``: the strategy's arguments, its communication."""
    if method["kind"] == "ddp":
        hook = dict(method.get("hook") or {})
        return make_protocol("ddp", **({"hook": hook.pop("name"), **hook} if hook else {}))
    if method["kind"] == "torchft":  # torchft's DiLoCo: the same algorithm (its fragments cut at tensor boundaries,
        # its Lighthouse's quorums and heartbeats not modelled) as the package's periodic averaging with these arguments
        torchft = method["torchft"]
        method = {**method, "strategy": {"class": "PeriodicAveragingStrategy", "kwargs": {
            "period": torchft["sync_every"], "fragments": torchft["fragments"],
            "fragment_sync_delay": torchft["fragment_sync_delay"],
            "fragment_update_alpha": torchft["fragment_update_alpha"]}}}
    kwargs = dict(method["strategy"]["kwargs"])
    kwargs.pop("hierarchy", None)  # the Simulation's, not the protocol's (hierarchy_of)
    kwargs.pop("state_device", None)  # where the strategy keeps its state: no effect on the simulated run
    cls = method["strategy"]["class"]
    if method.get("outer"):
        if method["outer"] != {"lr": 0.7, "momentum": 0.9, "nesterov": True}:
            raise ValueError(f"{method['name']}: only DiLoCo's outer optimizer is mapped; got {method['outer']}")
        kwargs["outer_optimizer"] = diloco_outer_optimizer
    if cls == "PeriodicAveragingStrategy":
        name = "fedavg" if kwargs.get("client_fraction", 1.0) < 1 else "periodic"
        return make_protocol(name, topology="strategy", **kwargs)
    if cls == "DynamicAveragingStrategy":
        return make_protocol("dynamic_avg", topology="strategy", **kwargs)
    if cls == "SegmentedGossipStrategy":
        return make_protocol("segmented_gossip", topology="strategy", **kwargs)
    if cls == "DownpourSGDStrategy":
        return make_protocol("parameter_server", topology="strategy", **kwargs)
    raise ValueError(f"{method['name']}: no simulator protocol for {cls}")


def hierarchy_of(method: dict[str, Any]) -> str | None:
    """The strategy's ``hierarchy`` (None for DDP and for every rank a learner)."""
    return method.get("strategy", {}).get("kwargs", {}).get("hierarchy") if method["kind"] != "ddp" else None


def node_rate_mbit(node_mbit: float, ceiling_mbit: float) -> float:
    """The payload rate of a node capped at ``node_mbit``: the cap's TCP payload share, at most the ceiling."""
    return min(node_mbit * PAYLOAD_SHARE, ceiling_mbit)


def simulate(config: dict[str, Any], method: dict[str, Any], workers: int, node_mbit: float, ceiling_mbit: float,
             step_s: float, max_virtual_s: float | None, max_steps: int, target: float | None,
             ranks_per_node: int = 1, intra_mbit: float | None = None, threads: int = 1,
             collectives: str = "gloo_ring", eval_every: int | None = None) -> dict[str, Any]:
    """One simulated run of ``workers`` ranks, ``ranks_per_node`` to a machine (machines joined at ``node_mbit``, a
    machine's ranks at ``intra_mbit``; ``lightning_dist.sim.machines``), its collectives timed by ``collectives``
    (``gloo_ring`` as the measured CPU runs, or ``nccl`` as a GPU cluster); stops at ``max_virtual_s``,
    ``max_steps`` or two evaluations after ``target``; evaluates every ``eval_every`` steps (default: ``EVALUATIONS``
    times over ``max_steps``)."""
    torch.manual_seed(0)
    datamodule = StdlibTextDataModule(seed=0, **config["data"])
    model = TransformerLM(**config["model"])

    def reached(rows: list[dict[str, float]]) -> bool:
        return target is not None and sum(row.get("val_loss", math.inf) <= target for row in rows) >= 2

    simulation = Simulation(
        model, datamodule, protocol_of(method), workers=workers, max_steps=max_steps,
        network=NetworkModel(latency=LATENCY_S, node_mbit=node_rate_mbit(node_mbit, ceiling_mbit),
                             half_duplex_links=True),
        speed=SpeedModel(step_seconds=step_s, aggregate_seconds=0.0), max_virtual_seconds=max_virtual_s,
        eval_every=eval_every or max(1, max_steps // EVALUATIONS), evaluate_workers=False, stop_when=reached, seed=0,
        ranks_per_node=ranks_per_node, hierarchy=hierarchy_of(method), threads=threads, collectives=collectives,
        intra_node=None if intra_mbit is None else NetworkModel(latency=LATENCY_S, node_mbit=intra_mbit,
                                                                half_duplex_links=True))
    started = time.perf_counter()
    result = simulation.run()
    # With machines of several ranks, the bytes that crossed between machines (the slow links).
    rows = [{"time": row["time"], "mean_steps": row["mean_steps"], "val_loss": row["val_loss"],
             "bytes": row.get("bytes_inter_node", row["bytes"])} for row in result.rows]
    hit = next((row for row in rows if target is not None and row["val_loss"] <= target), None)
    return {"name": method["name"], "workers": workers, "ranks_per_node": ranks_per_node, "intra_mbit": intra_mbit,
            "collectives": collectives,
            "bytes_by_level": result.summary["bytes_by_level"], "node_mbit": node_mbit,
            "rate_mbit": node_rate_mbit(node_mbit, ceiling_mbit), "step_s": step_s,
            "rows": rows, "time_to_target_s": hit["time"] if hit else None,
            "steps_to_target": hit["mean_steps"] if hit else None, "bytes_to_target": hit["bytes"] if hit else None,
            "final_val_loss": rows[-1]["val_loss"], "steps": rows[-1]["mean_steps"], "virtual_s": rows[-1]["time"],
            "protocol_bytes": result.summary["bytes"], "numerics": result.summary["numerics"],
            "protocol_metrics": result.summary["protocol_metrics"],
            "wall_s": time.perf_counter() - started}


def measured_step_s(measured: dict[str, Any]) -> float:
    """The median training step of the local-update runs at the highest bandwidth: compute, no synchronization."""
    runs = [run for launch in measured["launches"] if "runs" in launch for run in launch["runs"]]
    top = max(run["node_mbit"] for run in runs)
    durations = [d for run in runs if run["node_mbit"] == top and run["kind"] in ("periodic", "dynamic")
                 for rank in run["step_s_per_rank"] for d in rank[5:]]
    return statistics.median(durations)


def measured_run_step_s(measured: dict[str, Any], name: str, node_mbit: float) -> float:
    """The median training step of one method's runs at one bandwidth (every seed; each rank's first 5 steps left
    out): its own compute speed there, with whatever its exchanges in flight took from the CPU."""
    durations = [d for launch in measured["launches"] if launch["node_mbit"] == node_mbit
                 for run in launch.get("runs", []) if run["name"] == name
                 for rank in run["step_s_per_rank"] for d in rank[5:]]
    if not durations:
        raise ValueError(f"{name} has no measured run at {node_mbit:g} Mbit/s to take its step time from")
    return statistics.median(durations)


def measured_ceiling_mbit(measured: dict[str, Any]) -> float:
    """The node rate of periodic averaging's all-reduces at the highest bandwidth, Mbit/s of payload.

    The median synchronization there, set equal to ``ring_all_reduce_seconds`` of the model's bytes among
    the ranks, solved for the rate (the latency's share subtracted).
    """
    runs = [run for launch in measured["launches"] if "runs" in launch for run in launch["runs"]]
    top = max(run["node_mbit"] for run in runs)
    plain = [run for run in runs if run["node_mbit"] == top and run["kind"] == "periodic"
             and run["strategy"]["kwargs"].get("client_fraction", 1.0) == 1.0]
    if not plain:
        raise ValueError(f"no periodic averaging run at {top:g} Mbit/s in the measured JSON to take the ceiling from")
    round_s = statistics.median(d for run in plain for rank in run["round_s_per_rank"] for d in rank)
    ranks, nbytes = plain[0]["world_size"], plain[0]["model_bytes"]
    unit = NetworkModel(latency=LATENCY_S, node_mbit=1.0, half_duplex_links=True)
    latency_s = ring_all_reduce_seconds(NetworkModel(latency=LATENCY_S, half_duplex_links=True), ranks, nbytes)
    return (ring_all_reduce_seconds(unit, ranks, nbytes) - latency_s) / (round_s - latency_s)


def predict(args: argparse.Namespace, measured: dict[str, Any], step_s: float, ceiling_mbit: float,
            ranks_per_node: int = 1, intra_mbit: float | None = None) -> list[dict[str, Any]]:
    """Every measured cell (of ``args.methods``, if given) simulated on the measured ranks, ``ranks_per_node`` to
    a machine."""
    config, summary = measured["config"], measured["summary"]
    ranks = config.get("ranks") or config["nodes"] * config["ranks_per_node"]
    methods = {method["name"]: method for method in config["methods"]}
    budget, target = config["budget_s"], summary["target_val_loss"]
    cells = []
    for row in summary["rows"]:
        if args.methods and row["name"] not in args.methods:
            continue
        cell_step_s = measured_run_step_s(measured, row["name"], row["node_mbit"]) if args.own_step else step_s
        max_steps = math.ceil(budget / cell_step_s) + 1
        predicted = simulate(config, methods[row["name"]], ranks, row["node_mbit"], ceiling_mbit, cell_step_s,
                             budget, max_steps, None, ranks_per_node, intra_mbit, args.threads)
        hit = next((r for r in predicted["rows"] if r["val_loss"] <= target), None)
        predicted.update(time_to_target_s=hit["time"] if hit else None, steps_to_target=hit["mean_steps"] if hit else None,
                         bytes_to_target=hit["bytes"] if hit else None)
        cell = {"name": row["name"], "node_mbit": row["node_mbit"], "step": "own" if args.own_step else "machine",
                "predicted": predicted,
                "measured": {key: row[key] for key in ("time_to_target_s", "final_val_loss", "steps", "reached",
                                                       "protocol_bytes", "projected_time_to_target_s") if key in row}}
        if row.get("projected_time_to_target_s"):
            # DDP's measured projection: its steps to the target at the highest bandwidth times its step here.
            steps_to_target = row["projected_time_to_target_s"] / row["step_s"]
            predicted["projected_time_to_target_s"] = steps_to_target * predicted["virtual_s"] / predicted["steps"]
        cell["time_ratio"] = ratio(predicted["time_to_target_s"], row["time_to_target_s"])
        cell["projected_ratio"] = ratio(predicted.get("projected_time_to_target_s"), row.get("projected_time_to_target_s"))
        cell["steps_ratio"] = ratio(predicted["steps"], row["steps"])
        cell["loss_ratio"] = ratio(predicted["final_val_loss"], row["final_val_loss"])
        cells.append(cell)
        print(f"  {row['node_mbit']:>6g} Mbit/s {row['name']:<17} step {cell_step_s:.4f} s: "
              f"predicted {fmt(predicted['time_to_target_s'])} s to target, "
              f"{predicted['steps']:.0f} steps, loss {predicted['final_val_loss']:.3f}; measured "
              f"{fmt(row['time_to_target_s'])} s, {row['steps']:.0f} steps, loss {row['final_val_loss']:.3f} "
              f"({predicted['wall_s']:.0f} s)", flush=True)
    return cells


def scale(args: argparse.Namespace, measured: dict[str, Any], step_s: float, ceiling_mbit: float,
          ranks_per_node: int = 1, intra_mbit: float | None = None) -> list[dict[str, Any]]:
    """``args.scale_methods`` on each of ``args.scale_workers`` ranks, ``ranks_per_node`` to a machine."""
    config, target = measured["config"], measured["summary"]["target_val_loss"]
    methods = {method["name"]: method for method in config["methods"]}
    runs = []
    for workers in args.scale_workers:
        for name in args.scale_methods:
            run = simulate(config, methods[name], workers, args.scale_mbit, ceiling_mbit, step_s, None,
                           args.scale_max_steps, target, ranks_per_node, intra_mbit, args.threads, args.collectives)
            run.update(command=args.command, date=time.strftime("%Y-%m-%d"))
            runs.append(run)
            print(f"  {workers:>4} workers {name:<17} {fmt(run['time_to_target_s'])} s to target "
                  f"({fmt(run['steps_to_target'])} steps), loss {run['final_val_loss']:.3f} after {run['steps']:.0f} steps, "
                  f"{run['virtual_s']:.1f} virtual s ({run['wall_s']:.0f} s wall)", flush=True)
    return runs


def collectives_of(run: dict[str, Any]) -> str:
    """The collective model that timed a scale run (runs before ``--collectives`` existed: Gloo's ring)."""
    return run.get("collectives", "gloo_ring")


def merged_scale(kept: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Part 2's runs: ``kept`` but for the (method, workers, collective model) cells run again, which ``new``
    replaces; a cell under another collective model stays beside it."""
    def key(run: dict[str, Any]) -> tuple[str, int, str]:
        return run["name"], run["workers"], collectives_of(run)

    again = {key(run) for run in new}
    runs = [run for run in kept if key(run) not in again] + new
    return sorted(runs, key=lambda run: (run["workers"], collectives_of(run), run["name"]))


def merged_prediction(kept: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Part 1's cells: ``kept`` with the (method, bandwidth) cells predicted again replaced in place, the others
    of ``new`` after them (``--methods`` re-predicts some methods and keeps the rest)."""
    def key(cell: dict[str, Any]) -> tuple[str, float, str]:
        return cell["name"], cell["node_mbit"], cell.get("step", "machine")

    fresh = {key(cell): cell for cell in new}
    cells = [fresh.pop(key(cell), cell) for cell in kept]
    return cells + list(fresh.values())


def ratio(predicted: float | None, measured: float | None) -> float | None:
    return predicted / measured if predicted and measured else None


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def prediction_table(cells: list[dict[str, Any]]) -> str:
    lines = ["| Mbit/s | method | step s | s to target: measured | predicted | ratio | DDP projected: measured "
             "| predicted | ratio | final loss: measured | predicted | steps: measured | predicted |", "|" + "---|" * 13]
    for cell in cells:
        m, p = cell["measured"], cell["predicted"]
        step = f"{p['step_s']:.3f}" + (" (own)" if cell.get("step") == "own" else "")
        lines.append(f"| {cell['node_mbit']:g} | {cell['name']} | {step} | {fmt(m['time_to_target_s'])} "
                     f"| {fmt(p['time_to_target_s'])} "
                     f"| {fmt(cell['time_ratio'], 2)} | {fmt(m.get('projected_time_to_target_s'))} "
                     f"| {fmt(p.get('projected_time_to_target_s'))} | {fmt(cell.get('projected_ratio'), 2)} "
                     f"| {m['final_val_loss']:.3f} | {p['final_val_loss']:.3f} | {m['steps']:.0f} | {p['steps']:.0f} |")
    lines.append("\n" + agreement(cells))
    return "\n".join(lines)


def agreement(cells: list[dict[str, Any]]) -> str:
    """How many compared times lie within 20% of the measurement, and the cells where only one side reached the
    target; the cells run on their own measured step (``--own-step``) counted apart."""
    parts = {kind: [cell for cell in cells if cell.get("step", "machine") == kind] for kind in ("machine", "own")}
    return " ".join(f"{kind.capitalize()} step: {counted(part)}" if all(parts.values()) else counted(part)
                    for kind, part in parts.items() if part)


def counted(cells: list[dict[str, Any]]) -> str:
    """:func:`agreement`'s sentence for one kind of cells."""
    times = [c["time_ratio"] for c in cells if c["time_ratio"] is not None]
    projected = [c["projected_ratio"] for c in cells if c.get("projected_ratio") is not None]
    one_sided = [f"{c['name']} at {c['node_mbit']:g}" for c in cells
                 if (c["measured"]["time_to_target_s"] is None) != (c["predicted"]["time_to_target_s"] is None)]
    return (f"{sum(abs(r - 1) <= 0.2 for r in times)} of {len(times)} cells where both reached the target are within "
            f"20% in time to target; DDP's projections {sum(abs(r - 1) <= 0.2 for r in projected)} of {len(projected)}. "
            f"Reached on one side only: {', '.join(one_sided) or 'none'}.")


def scale_table(runs: list[dict[str, Any]], mbit: float) -> str:
    lines = [f"| workers | method | s to target at {mbit:g} Mbit/s | steps to target | MB sent to target | final loss "
             "| steps run | run on |", "|" + "---|" * 8]
    for run in runs:
        megabytes = None if run["bytes_to_target"] is None else run["bytes_to_target"] / 1e6
        lines.append(f"| {run['workers']} | {run['name']} | {fmt(run['time_to_target_s'])} | {fmt(run['steps_to_target'], 0)} "
                     f"| {fmt(megabytes, 0)} | {run['final_val_loss']:.3f} | {run['steps']:.0f} | {run['date']} |")
    return "\n".join(lines)


def compared_times(cell: dict[str, Any]) -> tuple[float, float, bool] | None:
    """(measured, predicted, projected) seconds to target of a cell: both reached, else DDP's projections."""
    measured, predicted = cell["measured"], cell["predicted"]
    if cell["time_ratio"] is not None:
        return measured["time_to_target_s"], predicted["time_to_target_s"], False
    if cell.get("projected_ratio") is not None:
        return measured["projected_time_to_target_s"], predicted["projected_time_to_target_s"], True
    return None


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    fig, (left, right, far_right) = plt.subplots(1, 3, figsize=(19, 5))
    cells = [(cell, times) for cell in report.get("prediction", []) if (times := compared_times(cell))]
    bandwidths = sorted({cell["node_mbit"] for cell, _ in cells}, reverse=True)
    colors = dict(zip(bandwidths, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for cell, (measured, predicted, projected) in cells:
        color, own = colors[cell["node_mbit"]], cell.get("step") == "own"
        left.scatter(measured, predicted, marker="s" if projected else "^" if own else "o",
                     facecolors="none" if projected else color, edgecolors=color, label=f"{cell['node_mbit']:g} Mbit/s")
        left.annotate(cell["name"] + (" (proj)" if projected else " (own step)" if own else ""), (measured, predicted),
                      fontsize=6)
    if cells:
        values = [value for _, times in cells for value in times[:2]]
        low, high = min(values) * 0.8, max(values) * 1.25
        left.plot([low, high], [low, high], color="black", linewidth=1)
        left.fill_between([low, high], [low * 0.8, high * 0.8], [low * 1.2, high * 1.2], color="grey", alpha=0.2)
        left.set_xscale("log")
        left.set_yscale("log")
    handles, labels = left.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    left.legend(unique.values(), unique.keys(), fontsize=8)
    left.set_xlabel("measured seconds to target")
    left.set_ylabel("simulated seconds to target")
    left.set_title("prediction vs measurement, 4 ranks\n(band: within 20%; squares: DDP projected; triangles: the "
                   "run's own step)", fontsize=9)
    left.grid(True, which="both", alpha=0.3)
    runs = report.get("scale", [])
    mbit = report["config"].get("scale_mbit")
    four = {cell["name"]: times[1] for cell, times in cells if cell["node_mbit"] == mbit and cell.get("step") != "own"}
    for name in dict.fromkeys(run["name"] for run in runs):
        points = [(run["workers"], run["time_to_target_s"]) for run in runs if run["name"] == name and run["time_to_target_s"]]
        if name in four:
            points.insert(0, (report["prediction"][0]["predicted"]["workers"], four[name]))
        if points:
            right.plot(*zip(*sorted(points)), marker="o", label=name)
        sent = [(run["workers"], run["bytes_to_target"] / 1e9) for run in runs
                if run["name"] == name and run["bytes_to_target"] is not None]
        if sent:
            far_right.plot(*zip(*sorted(sent)), marker="o", label=name)
    for axis in (right, far_right):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("workers")
        axis.grid(True, which="both", alpha=0.3)
        if runs:
            axis.legend(fontsize=8)
    right.set_ylabel("simulated seconds to target")
    right.set_title(f"extension at {mbit or 0:g} Mbit/s per node (weak scaling; 4 workers: part 1)", fontsize=10)
    far_right.set_ylabel("GB sent by all workers until the target")
    far_right.set_title("bytes to target (weak scaling)", fontsize=10)
    save_figure(fig, path, dpi=120)


def run_parts(args: argparse.Namespace, measured: dict[str, Any], report: dict[str, Any], step_s: float,
              ceiling_mbit: float, intra_mbit: float | None = None, measured_ranks_per_node: int = 1,
              scale_ranks_per_node: int = 1) -> None:
    """Part 1 (but with ``--scale-only``, on the measured machines) and part 2 (but with ``--predict-only``, on
    machines of ``scale_ranks_per_node``) into ``report``: re-predicted cells (``--methods``) and scale runs
    replace theirs, the others are kept."""
    if not args.scale_only:
        print("part 1: prediction of the measured table")
        predicted = predict(args, measured, step_s, ceiling_mbit, measured_ranks_per_node, intra_mbit)
        report["prediction"] = merged_prediction(report.get("prediction", []), predicted) if args.methods else predicted
    if not args.predict_only:
        print(f"part 2: {args.scale_workers} ranks ({scale_ranks_per_node} a machine) at {args.scale_mbit:g} Mbit/s"
              + (f", re-timed from {args.retime}" if args.retime else ""))
        if args.retime:
            recorded = json.loads(args.retime.read_text()).get("scale", [])
            new = retimed_scale(args, measured["config"], recorded, simulate)
        else:
            new = scale(args, measured, step_s, ceiling_mbit, scale_ranks_per_node, intra_mbit)
        report["scale"] = merged_scale(report.get("scale", []), new)


def show(report: dict[str, Any], out: Path, prefix: str, scale_table: Callable[[list[dict[str, Any]], float], str],
         plot: Callable[[dict[str, Any], Path], None]) -> None:
    """Print the report's tables and draw ``<out>/<prefix>.png``."""
    if report.get("prediction"):
        print(prediction_table(report["prediction"]))
    if report.get("scale"):
        print(scale_table(report["scale"], report["config"]["scale_mbit"]))
    plot(report, out / f"{prefix}.png")
    print(f"wrote {out / f'{prefix}.json'} and {out / f'{prefix}.png'}")


def parts_parser(description: str, measured: str, scale_methods: list[str]) -> argparse.ArgumentParser:
    """The arguments of a prediction-and-extension driver (this one, ``hierarchy_simulated``): the measured JSON
    (``results/<measured>.json``), which part to run, part 1's methods and part 2's, its step cap, numerics and
    ``--out``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--measured", type=Path, default=RESULTS / f"{measured}.json")
    parser.add_argument("--predict-only", action="store_true")
    parser.add_argument("--scale-only", action="store_true")
    parser.add_argument("--replot", action="store_true")
    parser.add_argument("--merge-from", type=Path, nargs="+", default=None,
                        help="other runs' JSONs of this driver whose cells replace theirs in --out's, then redraw")
    parser.add_argument("--methods", nargs="+", default=None,
                        help="methods of part 1, whose cells replace theirs in the JSON (default: every measured one, anew)")
    parser.add_argument("--scale-methods", nargs="+", default=scale_methods)
    parser.add_argument("--scale-max-steps", type=int, default=SCALE_MAX_STEPS)
    parser.add_argument("--collectives", choices=["gloo_ring", "nccl"], default="gloo_ring",
                        help="part 2's collective model: Gloo's ring, as the measured CPU runs (part 1 always), or "
                             "NCCL's ring or tree, as a GPU cluster runs DDP (lightning_dist.sim.nccl)")
    parser.add_argument("--retime", type=Path, default=None,
                        help="part 2's lock-step methods (DDP, its hooks) re-timed under --collectives from this JSON's "
                             "recorded runs: their first evaluation interval re-run and checked, not the whole run "
                             "(retime.py)")
    parser.add_argument("--retime-loss-tolerance", type=float, default=0.0,
                        help="--retime of a run recorded under other numerics (another CPU's kernels): the relative "
                             "difference of the checked losses accepted (default 0: bit for bit, the same numerics)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch's intra-op threads while simulating (the figures' last bits depend on it)")
    parser.add_argument("--native-kernels", action="store_true",
                        help="run the CPU's own float32 kernels instead of pin_cpu_kernels()'s: about twice as fast, "
                             "figures comparable only with runs on this kind of CPU (each run records its numerics)")
    parser.add_argument("--own-step", action="store_true",
                        help="part 1: each cell's step time is its own measured runs' median step at that bandwidth, "
                             "not the one machine constant (the network and overlap model, apart from the day's "
                             "compute speed); its cells are kept beside the others")
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser


def check_method_names(args: argparse.Namespace, measured: dict[str, Any]) -> None:
    """Refuse ``--methods`` / ``--scale-methods`` names that the measured JSON does not define."""
    known = [method["name"] for method in measured["config"]["methods"]]
    check_names("--methods", args.methods or [], known, str(args.measured))
    check_names("--scale-methods", args.scale_methods, known, str(args.measured))


def check_retime_arguments(args: argparse.Namespace) -> None:
    """Refuse a ``--retime-loss-tolerance`` out of [0, 1) or without ``--retime``, before anything runs."""
    try:
        check_loss_tolerance(args.retime_loss_tolerance)
    except ValueError as error:
        raise SystemExit(f"--retime-loss-tolerance: {error}") from None
    if args.retime_loss_tolerance and not args.retime:
        raise SystemExit("--retime-loss-tolerance applies to --retime only")


def drive(args: argparse.Namespace, argv: list[str] | None, prefix: str,
          constants: Callable[[dict[str, Any]], dict[str, Any]], scale_ranks_per_node: int,
          scale_table: Callable[[list[dict[str, Any]], float], str],
          plot: Callable[[dict[str, Any], Path], None], scale_only_methods: tuple[dict[str, Any], ...] = ()) -> int:
    """A prediction-and-extension driver's run into ``<out>/<prefix>.json`` and its plot.

    ``--replot`` redraws the JSON; ``--merge-from`` adds other runs' JSONs of this driver (each with its own ``--out``,
    say one per session) to it and redraws. Otherwise the parts run: ``constants(measured)`` gives the machine's
    constants taken from the measured JSON (``step_s``, ``ceiling_mbit``, ``scale_mbit``, optionally
    ``intra_mbit``), recorded in the config with what every run records. Part 1 runs on the measured machines (the
    measured config's ``ranks_per_node``, else 1), part 2 on machines of ``scale_ranks_per_node``. A part run alone
    keeps the other part of the JSON already there. ``scale_only_methods`` join the measured JSON's methods for
    part 2: methods the measured study did not run (its part 1 has no cell of theirs).
    """
    json_path = args.out / f"{prefix}.json"
    if args.replot or args.merge_from:
        report = json.loads(json_path.read_text())
        for path in args.merge_from or []:
            other = json.loads(path.read_text())
            if other.get("scale"):
                report["scale"] = merged_scale(report.get("scale", []), other["scale"])
            if other.get("prediction"):
                report["prediction"] = merged_prediction(report.get("prediction", []), other["prediction"])
    else:
        check_retime_arguments(args)
        if not args.native_kernels:
            pin_cpu_kernels()
        measured = json.loads(args.measured.read_text())
        measured["config"]["methods"] += scale_only_methods
        check_method_names(args, measured)
        config = constants(measured)
        args.scale_mbit = config["scale_mbit"]
        target = measured["summary"]["target_val_loss"]
        args.command = command_line(argv)
        report = json.loads(json_path.read_text()) if json_path.exists() and (args.predict_only or args.scale_only) else {}
        report["config"] = {"measured": str(args.measured.relative_to(REPO) if args.measured.is_relative_to(REPO)
                                            else args.measured),
                            **config, "latency_s": LATENCY_S, "payload_share": PAYLOAD_SHARE, "target_val_loss": target,
                            "scale_max_steps": args.scale_max_steps, "python": platform.python_version(),
                            "scale_only_methods": list(scale_only_methods),
                            "command": args.command, "date": time.strftime("%Y-%m-%d")}
        print(", ".join(f"{key} {value:g}" for key, value in config.items()) + f" (measured); target loss {target:.3f}")
        run_parts(args, measured, report, config["step_s"], config["ceiling_mbit"], config.get("intra_mbit"),
                  measured["config"].get("ranks_per_node", 1), scale_ranks_per_node)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(json_path, report)
    show(report, args.out, prefix, scale_table, plot)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = parts_parser(__doc__.split("\n\n")[0], "lm_network", SCALE_METHODS)
    parser.add_argument("--scale-workers", type=int, nargs="+", default=SCALE_WORKERS)
    parser.add_argument("--scale-mbit", type=float, default=None, help="bandwidth of part 2 (default: the headline)")
    args = parser.parse_args(argv)

    def constants(measured: dict[str, Any]) -> dict[str, Any]:
        return {"step_s": measured_step_s(measured), "ceiling_mbit": measured_ceiling_mbit(measured),
                "scale_mbit": args.scale_mbit or measured["config"]["headline_mbit"]}

    return drive(args, argv, PREFIX, constants, 1, scale_table, plot)


if __name__ == "__main__":
    sys.exit(main())
