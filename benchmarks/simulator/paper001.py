"""Paper 001's experiments on the hybrid simulator (``lightning_dist.sim``): sync vs async parameter server.

Paper 001 (Section 4) runs DownpourSGD-style data parallelism on its simulator: a 1-worker
baseline; 2 and 4 workers, synchronous and asynchronous parameter server, at latencies 0, 1 ms,
10 ms and 100 ms; the asynchronous server with 8, 16, 32 and 64 workers at 1 ms; loss against
elapsed virtual time and against iterations. It concludes that 4 workers converge faster than 2,
that latencies up to 10 ms barely matter while 100 ms hurts (the synchronous mode more), that the
curves of 8-64 asynchronous workers coincide in iterations (after it changed its update rule: the
first rule stalled at 16 workers and exploded at 32 and 64), and that the simulator runs at least
64 workers. This script runs the same study with :class:`lightning_dist.sim.Simulation` and adds
a scale test with hundreds of virtual workers.

The task (``TASK``) is MNIST-1D (4000 samples, 3200 for training dealt iid over the workers, 800
for validation), ``MLPClassifier`` 40-64-64-10 (7,434 parameters, 29,736 B per message), plain SGD,
batch size 32 per worker, ``push_every=1`` (a gradient exchange after every step, as in the paper),
every worker ``STEPS`` (500) iterations. The network is a 1 Gbit/s cap per node and port, no
per-link cap (paper 001's serialized send and receive ports), so one model crosses in 0.24 ms
plus the latency.

Compute is modelled, so every run is deterministic: ``step_seconds`` and ``aggregate_seconds`` are
calibrated once, at the start, from a measured 1-worker Simulation on this machine (its mean
measured step and server update), rounded to 3 significant digits and recorded in the JSON; every
later run uses those fixed values (``--step-seconds``/``--aggregate-seconds`` reuse earlier ones).

Learning rates: the asynchronous server adds every pushed update, so ``n`` asynchronous workers
make ``n`` updates per iteration; a synchronous round applies the mean of the ``n`` updates (paper
001's SSGD, "the parameter server obtains the gradient average"), one step of ``n`` times the
batch. The 1/2/4-worker study uses ``learning_rate=0.1`` for every run, as the paper compares the
modes at one setting (4 x 0.1 is still stable on this task for the asynchronous sum, 1 worker at
0.4 trains too), so at equal iterations the synchronous runs take the baseline's step length and
the asynchronous ones ``n`` of them. For 8-64 asynchronous workers the rate is
``0.1 / workers`` (one iteration of all workers then moves the model as far as one baseline step;
this is the change of update rule the paper had to make), and the unscaled 0.1 is also run for
``UNSCALED_STEPS`` iterations to reproduce the paper's stall/explosion (its Fig. 14).

Reported per run: final and last-5-evaluation mean ``val_loss``, ``val_acc``, virtual seconds,
virtual time and iterations to ``val_loss <= TARGET_LOSS`` and to ``val_acc >= TARGET_ACC``
(first evaluation that reaches it, every ``EVAL_EVERY`` iterations); ratios sync/async at each
latency and 4/2 workers. The scale part runs 64-512 virtual workers for ``SCALE_STEPS`` steps
(asynchronous PS at ``0.1 / workers``, and periodic averaging with period 10) and reports the wall
seconds, the wall seconds of real compute inside ``execute`` (training steps and server updates),
of evaluation and of set-up, and the overhead ratio ``(wall - evaluation - set-up) / compute``.

Outputs (``--out``, default ``benchmarks/results``): ``sim_paper001.json`` (config with the
calibration, summary tables, every run's curve: virtual time, iterations, train_loss, val_loss,
val_acc) and ``sim_paper001.png``.

Usage::

    python -m benchmarks.simulator.paper001             # the full study and scale test, 2.5-4.5 min on 2 shared cores
    python -m benchmarks.simulator.paper001 --quick     # smoke run: few steps, fewer runs (about 1 min)
    python -m benchmarks.simulator.paper001 --replot    # recompute summaries, redraw the figure and tables from the JSON
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common.paths import RESULTS
from benchmarks.common.report import command_line, pyplot, save_figure
from benchmarks.simulator.paper001_summary import TARGET_ACC, TARGET_LOSS, formatted, summarize, tables

PREFIX = "sim_paper001"

TASK: dict[str, Any] = {
    "data": {"num_samples": 4000, "batch_size": 32, "partition": "iid", "val_fraction": 0.2, "seed": 0},
    "model": {"num_features": 40, "hidden_size": 64, "momentum": 0.0},
    "seed": 0,
}
BASE_LR = 0.1
STEPS = 500
LATENCIES = [0.0, 0.001, 0.01, 0.1]
STUDY_WORKERS = [2, 4]
ASYNC_WORKERS = [8, 16, 32, 64]
ASYNC_LATENCY = 0.001
UNSCALED_STEPS = 200
NODE_MBIT = 1000.0  # 1 Gbit/s per node (each of its send and receive ports), no per-link cap
EVAL_EVERY = 10
SCALE_WORKERS = [64, 128, 256, 512]
SCALE_STEPS = 20
SCALE_PERIOD = 10
CALIBRATION_STEPS = 400
ROW_KEYS = ("time", "steps", "mean_steps", "bytes", "train_loss", "val_loss", "val_acc")


# ---------------------------------------------------------------- running


# Paper 001's asynchronous parameter server: every update added in full (the strategy's default divides it by its
# staleness plus one).
PAPER_ASYNC = {"name": "parameter_server", "push_every": 1, "synchronous": False, "staleness_aware": False}

def _round(value: Any) -> Any:
    return float(f"{value:.6g}") if isinstance(value, float) and math.isfinite(value) else value


def simulate(name: str, part: str, protocol: dict[str, Any], workers: int, lr: float, steps: int,
             latency: float, speed: dict[str, float] | None, eval_every: int = EVAL_EVERY) -> dict[str, Any]:
    """One Simulation; returns its record (settings, summary numbers, the global curve)."""
    import torch

    from lightning_dist.data import MNIST1DDataModule
    from lightning_dist.models import MLPClassifier
    from lightning_dist.sim import (
        NetworkModel,
        NonFiniteModelError,
        ParameterServer,
        PeriodicAveraging,
        Simulation,
        SpeedModel,
    )

    torch.manual_seed(TASK["seed"])
    model = MLPClassifier(**TASK["model"], learning_rate=lr)
    datamodule = MNIST1DDataModule(**TASK["data"])
    kind = protocol["name"]
    arguments = {key: value for key, value in protocol.items() if key != "name"}
    proto = ParameterServer(**arguments) if kind == "parameter_server" else PeriodicAveraging(**arguments)
    simulation = Simulation(
        model, datamodule, proto, workers=workers, max_steps=steps,
        network=NetworkModel(latency=latency, node_mbit=NODE_MBIT),
        speed=SpeedModel(**speed) if speed else SpeedModel(),
        eval_every=eval_every, evaluate_workers=False, seed=TASK["seed"],
    )
    record: dict[str, Any] = {"name": name, "part": part, "protocol": protocol, "workers": workers,
                              "learning_rate": lr, "max_steps": steps, "latency": latency, "status": "ok"}
    started = time.perf_counter()
    try:
        result = simulation.run()
        summary = result.summary
        rows = result.rows
    except NonFiniteModelError as error:
        # Paper 001's gradient explosion: the protocol refuses a NaN/inf update; keep the curve so far.
        record.update(status="diverged", error=str(error))
        summary, rows = {}, simulation.result.rows
    record["wall_seconds_total"] = time.perf_counter() - started
    for key in ("virtual_seconds", "bytes", "messages", "wall_seconds", "compute_wall_seconds",
                "evaluation_wall_seconds", "setup_wall_seconds", "overhead_ratio", "mean_step_wall_seconds",
                "wait_seconds_per_worker", "model_bytes", "num_parameters", "steps"):
        if key in summary:
            record[key] = _round(summary[key]) if isinstance(summary[key], float) else summary[key]
    if summary:
        record["protocol_metrics"] = {key: _round(value) for key, value in summary["protocol_metrics"].items()}
        record["speed"] = summary["speed"]
    else:
        record["virtual_seconds"] = rows[-1]["time"] if rows else None
    record["rows"] = [{key: _round(row[key]) for key in ROW_KEYS if key in row} for row in rows]
    return record


def calibrate(steps: int, repeats: int = 3) -> dict[str, Any]:
    """Measured 1-worker Simulations (asynchronous PS, no latency): mean step and server-update wall time.

    Other processes share the CPU, so the run is repeated and the least disturbed one (the lowest
    mean step time) is taken.
    """
    protocol = PAPER_ASYNC
    simulate("warmup", "calibration", protocol, 1, BASE_LR, 50, 0.0, None, eval_every=1000)
    measured = []
    for _ in range(repeats):
        record = simulate("calibration", "calibration", protocol, 1, BASE_LR, steps, 0.0, None, eval_every=1000)
        step = record["mean_step_wall_seconds"]
        # compute_wall_seconds covers the worker's steps and the server's updates (one per step).
        measured.append((step, max(record["compute_wall_seconds"] - step * steps, 0.0) / steps))
    step, aggregate = min(measured)
    return {
        "method": f"measured Simulation: 1 worker, async PS push_every=1, {steps} steps, {repeats} repeats after a "
                  "50-step warm-up; the repeat with the lowest mean step time",
        "repeats": [{"step_seconds": a, "aggregate_seconds": b} for a, b in measured],
        "measured_step_seconds": step,
        "measured_aggregate_seconds": aggregate,
        "step_seconds": float(f"{step:.3g}"),
        "aggregate_seconds": float(f"{aggregate:.3g}"),
    }


def plan(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick
    return {
        "steps": 60 if quick else STEPS,
        "latencies": [0.0, 0.01] if quick else LATENCIES,
        "study_workers": STUDY_WORKERS,
        "async_workers": [8, 16] if quick else ASYNC_WORKERS,
        "unscaled_steps": 40 if quick else UNSCALED_STEPS,
        "scale_workers": [64, 256] if quick else SCALE_WORKERS,
        "scale_steps": 10 if quick else SCALE_STEPS,
        "calibration_steps": 100 if quick else CALIBRATION_STEPS,
    }


def study_specs(p: dict[str, Any]) -> list[dict[str, Any]]:
    specs = [{"name": "baseline_w1", "part": "study", "mode": "baseline", "workers": 1, "latency": 0.0,
              "lr": BASE_LR, "steps": p["steps"], "protocol": {"name": "parameter_server", "push_every": 1,
                                                                "synchronous": True}}]
    for workers in p["study_workers"]:
        for mode in ("sync", "async"):
            for latency in p["latencies"]:
                specs.append({"name": f"{mode}_w{workers}_lat{latency:g}", "part": "study", "mode": mode,
                              "workers": workers, "latency": latency, "lr": BASE_LR, "steps": p["steps"],
                              "protocol": {"name": "parameter_server", "push_every": 1,
                                           "synchronous": mode == "sync", "staleness_aware": False}})
    for scaled, steps in ((True, p["steps"]), (False, p["unscaled_steps"])):
        for workers in p["async_workers"]:
            specs.append({"name": f"async_w{workers}_lat{ASYNC_LATENCY:g}" + ("" if scaled else "_unscaled"),
                          "part": "async_scaled" if scaled else "async_unscaled", "mode": "async",
                          "workers": workers, "latency": ASYNC_LATENCY,
                          "lr": BASE_LR / workers if scaled else BASE_LR, "steps": steps,
                          "protocol": PAPER_ASYNC})
    return specs


def scale_specs(p: dict[str, Any]) -> list[dict[str, Any]]:
    specs = []
    for workers in p["scale_workers"]:
        specs.append({"name": f"scale_async_ps_w{workers}", "part": "scale", "mode": "async", "workers": workers,
                      "latency": ASYNC_LATENCY, "lr": BASE_LR / workers, "steps": p["scale_steps"],
                      "protocol": PAPER_ASYNC})
        specs.append({"name": f"scale_periodic_w{workers}", "part": "scale", "mode": "periodic", "workers": workers,
                      "latency": ASYNC_LATENCY, "lr": BASE_LR, "steps": p["scale_steps"],
                      "protocol": {"name": "periodic", "period": SCALE_PERIOD}})
    return specs


def run_specs(specs: list[dict[str, Any]], speed: dict[str, float]) -> list[dict[str, Any]]:
    records = []
    for spec in specs:
        record = simulate(spec["name"], spec["part"], spec["protocol"], spec["workers"], spec["lr"], spec["steps"],
                          spec["latency"], speed)
        record["mode"] = spec["mode"]
        records.append(record)
        final = record["rows"][-1] if record["rows"] else {}
        print(f"  {record['name']:<28} {record['status']:<8} lr {record['learning_rate']:.4g}  virtual "
              f"{formatted(record.get('virtual_seconds'), '.4g')} s  val_loss {final.get('val_loss', math.nan):.3f}  val_acc "
              f"{final.get('val_acc', math.nan):.3f}  wall {record['wall_seconds_total']:.1f} s", flush=True)
    return records


# ---------------------------------------------------------------- figure


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    runs = report["runs"]
    colors = {latency: f"C{index}" for index, latency in enumerate(LATENCIES)}
    baseline = next((r for r in runs if r["name"] == "baseline_w1"), None)
    fig, axes = plt.subplots(3, 4, figsize=(22, 14))

    def curve(axis, record, x: str, y: str = "val_loss", **style):
        rows = [row for row in record["rows"] if y in row and (x != "time" or row["time"] > 0)]
        axis.plot([row[x] for row in rows], [row[y] for row in rows], **style)

    for line, y in enumerate(("val_loss", "train_loss")):
        ylabel = "global model val_loss" if y == "val_loss" else "workers' mean train_loss (since last eval)"
        axes_x = (("time", "virtual time (s, log)"), ("mean_steps", "iterations per worker"))
        for column, (x, label) in enumerate(axes_x):
            for offset, workers in enumerate(STUDY_WORKERS):
                axis = axes[line, 2 * column + offset]
                for record in runs:
                    if record["part"] == "study" and record["workers"] == workers:
                        curve(axis, record, x, y, color=colors.get(record["latency"], "k"),
                              linestyle="-" if record["mode"] == "sync" else "--", linewidth=1.1,
                              label=f"{record['mode']} {1000 * record['latency']:g} ms")
                if baseline:
                    curve(axis, baseline, x, y, color="k", linestyle=":", linewidth=1.2, label="1 worker")
                axis.set(xlabel=label, ylabel=ylabel,
                         title=f"{workers} workers: sync (solid) vs async (dashed), {y}")
                if x == "time":
                    axis.set_xscale("log")
                axis.legend(fontsize=7, ncol=2)
    for column, (x, label) in enumerate((("time", "virtual time (s, log)"), ("mean_steps", "iterations per worker"))):
        axis = axes[2, column]
        for index, record in enumerate(r for r in runs if r["part"] == "async_scaled"):
            legend = f"{record['workers']} workers, lr {record['learning_rate']:.3g}"
            curve(axis, record, x, color=f"C{index}", label=legend)
        if baseline:
            curve(axis, baseline, x, color="k", linestyle=":", label="1 worker, lr 0.1")
        title = f"async, {1000 * ASYNC_LATENCY:g} ms, lr = 0.1 / workers"
        axis.set(xlabel=label, ylabel="global val_loss", title=title)
        if x == "time":
            axis.set_xscale("log")
        axis.legend(fontsize=7)
    axis = axes[2, 2]
    for index, record in enumerate(r for r in runs if r["part"] == "async_unscaled"):
        label = f"{record['workers']} workers" + (" (diverged)" if record["status"] == "diverged" else "")
        curve(axis, record, "mean_steps", color=f"C{index}", label=label)
    if baseline:
        curve(axis, baseline, "mean_steps", color="k", linestyle=":", label="1 worker")
    axis.set(xlabel="iterations per worker", ylabel="global val_loss (log)", yscale="log",
             title=f"async, {1000 * ASYNC_LATENCY:g} ms, unscaled lr 0.1 (paper's Fig. 14)")
    axis.legend(fontsize=7)
    axis = axes[2, 3]
    scale = report["summary"]["scale"]
    for index, mode in enumerate(sorted({r["mode"] for r in scale})):
        points = sorted((r for r in scale if r["mode"] == mode and r["overhead_ratio"] is not None),
                        key=lambda r: r["workers"])
        axis.plot([r["workers"] for r in points], [r["overhead_ratio"] for r in points], marker="o", color=f"C{index}",
                  label=f"{'async PS' if mode == 'async' else 'periodic avg'}: overhead ratio")
        for r in points:
            axis.annotate(f"{r['wall_seconds']:.0f} s", (r["workers"], r["overhead_ratio"]), fontsize=7,
                          textcoords="offset points", xytext=(3, 4))
    axis.set_xscale("log", base=2)
    axis.set(xlabel="virtual workers", ylabel="(wall - eval) / compute wall",
             title="scale: simulator overhead (labels: wall seconds)")
    axis.legend(fontsize=7)
    for axis in axes.flat:
        axis.grid(alpha=0.3)
    speed = report["config"].get("speed", {})
    fig.suptitle(f"Paper 001 on lightning_dist.sim: MNIST-1D MLP, PS push_every=1, {NODE_MBIT:g} Mbit/s per node, "
                 f"modelled step {speed.get('step_seconds')} s (calibrated), "
                 f"{report['config'].get('steps')} iterations")
    save_figure(fig, path, dpi=100)


# ---------------------------------------------------------------- main


def write(report: dict[str, Any], out: Path) -> None:
    report["summary"] = summarize(report)
    (out / f"{PREFIX}.json").write_text(json.dumps(report, indent=1) + "\n")


def replot(out: Path) -> int:
    path = out / f"{PREFIX}.json"
    if not path.exists():
        print(f"no {path}; run the benchmark first", file=sys.stderr)
        return 1
    report = json.loads(path.read_text())
    write(report, out)
    plot(report, out / f"{PREFIX}.png")
    print(tables(report["summary"], report["config"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help="output folder")
    parser.add_argument("--quick", action="store_true", help="smoke run: few steps, fewer runs")
    parser.add_argument("--replot", action="store_true",
                        help="recompute summaries and redraw from the JSON; run nothing")
    parser.add_argument("--step-seconds", type=float, default=None, help="modelled step time (skips the calibration)")
    parser.add_argument("--aggregate-seconds", type=float, default=None,
                        help="modelled server update time (with --step-seconds)")
    parser.add_argument("--no-scale", action="store_true", help="skip the scale part")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        return replot(args.out)

    import lightning
    import torch

    torch.set_num_threads(1)
    started = time.perf_counter()
    p = plan(args)
    command = command_line(argv)
    config: dict[str, Any] = {
        "command": command, "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
        "torch": torch.__version__, "lightning": lightning.__version__, "torch_threads": 1,
        "load_average_at_start": os.getloadavg(),
        "quick": args.quick, "task": TASK, "base_learning_rate": BASE_LR, "steps": p["steps"],
        "latencies": p["latencies"], "study_workers": p["study_workers"], "async_workers": p["async_workers"],
        "async_latency": ASYNC_LATENCY, "unscaled_steps": p["unscaled_steps"], "push_every": 1,
        "network": {"node_mbit": NODE_MBIT, "link_mbit": None}, "eval_every": EVAL_EVERY,
        "targets": {"val_loss": TARGET_LOSS, "val_acc": TARGET_ACC},
        "scale": {"workers": p["scale_workers"], "steps": p["scale_steps"], "periodic_period": SCALE_PERIOD,
                  "latency": ASYNC_LATENCY},
    }
    if args.step_seconds is not None:
        config["calibration"] = {"method": "given on the command line"}
        speed = {"step_seconds": args.step_seconds,
                 "aggregate_seconds": args.aggregate_seconds if args.aggregate_seconds is not None else 0.0}
    else:
        print(f"calibrating the modelled compute ({p['calibration_steps']} measured steps)", flush=True)
        calibration = calibrate(p["calibration_steps"])
        config["calibration"] = calibration
        speed = {"step_seconds": calibration["step_seconds"], "aggregate_seconds": calibration["aggregate_seconds"]}
        print(f"  measured step {calibration['measured_step_seconds'] * 1e3:.4f} ms, server update "
              f"{calibration['measured_aggregate_seconds'] * 1e6:.1f} us -> step_seconds {speed['step_seconds']}, "
              f"aggregate_seconds {speed['aggregate_seconds']}", flush=True)
    config["speed"] = speed
    report: dict[str, Any] = {"config": config, "runs": []}

    specs = study_specs(p)
    print(f"study: {len(specs)} runs, {p['steps']} iterations per worker", flush=True)
    t0 = time.perf_counter()
    report["runs"] += run_specs(specs, speed)
    config["study_wall_seconds"] = time.perf_counter() - t0
    # Modelled compute makes a run deterministic: repeat one and compare its curve bit for bit.
    check_spec = next(spec for spec in specs if spec["mode"] == "async" and spec["workers"] == 2)
    again = run_specs([check_spec], speed)[0]
    first = next(record for record in report["runs"] if record["name"] == check_spec["name"])
    config["determinism_check"] = {"run": check_spec["name"], "identical_curve": again["rows"] == first["rows"]}
    print(f"  determinism: {check_spec['name']} repeated, identical curve: {again['rows'] == first['rows']}")
    write(report, args.out)

    if not args.no_scale:
        specs = scale_specs(p)
        print(f"scale: {len(specs)} runs, {p['scale_steps']} steps per worker", flush=True)
        t0 = time.perf_counter()
        report["runs"] += run_specs(specs, speed)
        config["scale_wall_seconds"] = time.perf_counter() - t0
    config["wall_seconds"] = time.perf_counter() - started
    config["load_average_at_end"] = os.getloadavg()
    write(report, args.out)
    plot(report, args.out / f"{PREFIX}.png")
    print()
    print(tables(report["summary"], config))
    failed = [r["name"] for r in report["runs"] if r["status"] not in ("ok", "diverged")]
    print(f"\ntotal wall time {config['wall_seconds']:.0f} s; results in {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
