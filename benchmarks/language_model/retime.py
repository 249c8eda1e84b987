"""A lock-step baseline's scale run under another collective model, re-timed from its recorded run.

DDP's ranks, with or without a comm hook, step in lock-step and nothing they compute reads the clock: the losses
and bytes after each step are the same whichever model times the all-reduces (``lightning_dist.sim.nccl`` or Gloo's
ring); only the time axis moves. Re-running 1024 simulated ranks to the target to move it costs 62-81 minutes of
2 cores. :func:`retimed` re-runs only the recorded run's first evaluation interval under the new model, with an
evaluation after every step, so that the simulator itself times those steps, and refuses unless

- its bytes at the recorded evaluations it reaches are the recorded ones exactly, and its losses there the recorded
  ones bit for bit with the recorded run's numerics (threads, kernels), or, given ``loss_tolerance`` (a recorded run
  from another CPU's kernels, which differ in the last bits and then drift), within that relative tolerance;
- its last two steps took the same virtual time (past any warm-up: PowerSGD's first plain all-reduces), and the
  recorded run's evaluations from the end of that interval on are evenly spaced in time (a constant step).

Each recorded evaluation then takes the new model's time: the short run's own within the interval, and past it
the short run's last step time per step. ``tests/benchmarks/test_language_model_retime.py`` checks a re-timed run
against a full run under the new model.

Why a run from another CPU can be re-timed: its trajectory depends on its CPU's kernels and not on the collective
model, and a step's virtual time on the collective model and the bytes and not on the CPU (the compute is the
modelled step). The recorded trajectory on the new time axis is then what a full run under the new model would
give on the recording CPU; the short run here checks the same workload and code (bytes exact, losses within the
stated tolerance, the largest difference recorded) and supplies the step time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

LOCK_STEP_KINDS = ("ddp",)
"""The methods whose steps no clock steers (DDP and its comm hooks); every other method is re-run, not re-timed."""

RELATIVE_TOLERANCE = 1e-9
"""How closely two step times must agree to count as one constant step (sums of floats, not measurements)."""


def check_lock_step(method: dict[str, Any]) -> None:
    """Refuse, by name, a method whose run cannot be re-timed: one whose synchronizations follow its state."""
    if method["kind"] not in LOCK_STEP_KINDS:
        raise ValueError(
            f"{method['name']} ({method['kind']}) cannot be re-timed: only lock-step DDP runs (kind "
            f"{', '.join(LOCK_STEP_KINDS)}) have a trajectory independent of the collectives' times; re-run it")


def check_loss_tolerance(loss_tolerance: float) -> None:
    """Refuse a loss tolerance out of [0, 1) by name (a relative difference of losses)."""
    if not 0.0 <= loss_tolerance < 1.0:
        raise ValueError(f"loss_tolerance must be in [0, 1) (a relative difference of losses); got {loss_tolerance}")


def _same_step(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=RELATIVE_TOLERANCE, abs_tol=0.0)


def retimed(recorded: dict[str, Any], method: dict[str, Any], collectives: str,
            rerun: Callable[[int, str], dict[str, Any]], loss_tolerance: float = 0.0) -> dict[str, Any]:
    """``recorded`` (a scale run of ``simulated.simulate``) with its rows' times under ``collectives``.

    ``rerun(steps, collectives)`` is the recorded run's simulation stopped after ``steps`` steps, evaluated after
    every step. ``loss_tolerance``: 0 (the re-run's numerics and losses the recorded ones, bit for bit) or the
    relative difference of losses accepted from a re-run under other numerics (another CPU's kernels, threads).
    The result keeps the recorded losses, steps and bytes, records the check in ``retimed``, and its ``wall_s`` is
    the short run's.
    """
    check_lock_step(method)
    check_loss_tolerance(loss_tolerance)
    rows = recorded["rows"]
    if len(rows) < 3:
        raise ValueError(f"{recorded['name']} at {recorded['workers']} ranks has {len(rows)} evaluations; re-timing "
                         "needs the first interval and two more to check the recorded step")
    interval = round(rows[1]["mean_steps"])
    if interval < 3:
        raise ValueError(f"{recorded['name']}: its first evaluation is after {interval} steps; re-timing needs 3 to "
                         "check a constant step past the warm-up")
    started = time.perf_counter()
    short = rerun(interval, collectives)
    wall_s = time.perf_counter() - started
    label = f"{recorded['name']} at {recorded['workers']} ranks"
    if short["numerics"] != recorded["numerics"] and loss_tolerance == 0.0:
        raise ValueError(f"{label}: the re-run's numerics {short['numerics']} are not the recorded run's "
                         f"{recorded['numerics']}; give --threads and --native-kernels as the recorded run had them, "
                         "or a loss tolerance (--retime-loss-tolerance) for a run recorded on another CPU")
    at_step = {round(row["mean_steps"]): row for row in short["rows"]}
    if sorted(at_step) != list(range(interval + 1)):
        raise ValueError(f"{label}: the re-run evaluated at steps {sorted(at_step)}, not after each of 0..{interval}")
    largest = 0.0
    for row in rows[:2]:
        again = at_step[round(row["mean_steps"])]
        difference = abs(again["val_loss"] - row["val_loss"]) / abs(row["val_loss"])
        if again["bytes"] != row["bytes"] or difference > loss_tolerance:
            raise ValueError(f"{label}: after {row['mean_steps']:g} steps the re-run's loss and bytes "
                             f"({again['val_loss']!r}, {again['bytes']}) are not the recorded "
                             f"({row['val_loss']!r}, {row['bytes']})"
                             + (f" within a relative {loss_tolerance:g}" if loss_tolerance else "")
                             + ": not the same trajectory (a run with --native-kernels replays only on the CPU "
                             "model it ran on, and a change to the code can move last bits); re-run it")
        largest = max(largest, difference)
    step_s = at_step[interval]["time"] - at_step[interval - 1]["time"]
    if not _same_step(step_s, at_step[interval - 1]["time"] - at_step[interval - 2]["time"]):
        raise ValueError(f"{label}: the re-run's last two steps took {at_step[interval - 2]['time']:.6f} -> "
                         f"{at_step[interval - 1]['time']:.6f} -> {at_step[interval]['time']:.6f} s: not a constant step")
    recorded_step_s = (rows[-1]["time"] - rows[1]["time"]) / (rows[-1]["mean_steps"] - rows[1]["mean_steps"])
    for row in rows[2:]:
        expected = rows[1]["time"] + (row["mean_steps"] - interval) * recorded_step_s
        if not _same_step(row["time"], expected):
            raise ValueError(f"{label}: its recorded evaluation after {row['mean_steps']:g} steps is at "
                             f"{row['time']:.6f} s, not {expected:.6f} s of a constant step: not lock-step")
    start = at_step[interval]["time"]
    new_rows = [{**row, "time": at_step[round(row["mean_steps"])]["time"] if row["mean_steps"] <= interval
                 else start + (row["mean_steps"] - interval) * step_s} for row in rows]
    hit = next((row for row in new_rows if row["mean_steps"] == recorded["steps_to_target"]), None)
    return {**recorded, "collectives": collectives, "rows": new_rows,
            "time_to_target_s": hit["time"] if hit else None, "virtual_s": new_rows[-1]["time"], "wall_s": wall_s,
            "retimed": {"from_collectives": recorded.get("collectives", "gloo_ring"), "checked_steps": interval,
                        "numerics": short["numerics"], "loss_tolerance": loss_tolerance,
                        "largest_loss_difference": largest,
                        "step_virtual_s": step_s, "recorded_step_virtual_s": recorded_step_s,
                        "recorded_wall_s": recorded["wall_s"], "recorded_command": recorded.get("command")}}


def retimed_scale(args: Any, config: dict[str, Any], recorded_runs: list[dict[str, Any]],
                  simulate: Callable[..., dict[str, Any]]) -> list[dict[str, Any]]:
    """``args.scale_methods`` at each of ``args.scale_workers`` ranks, re-timed under ``args.collectives`` from
    ``recorded_runs`` (``args.retime``'s scale runs): each re-run on the recorded run's own network, step time and
    machines by ``simulate`` (``simulated.simulate``) with ``args.threads``."""
    methods = {method["name"]: method for method in config["methods"]}
    for name in args.scale_methods:
        check_lock_step(methods[name])
    chosen = []
    for workers in args.scale_workers:
        for name in args.scale_methods:
            recorded = next((run for run in recorded_runs if (run["name"], run["workers"]) == (name, workers)), None)
            if recorded is None:
                raise SystemExit(f"--retime: {args.retime} has no run of {name} at {workers} ranks to re-time")
            chosen.append(recorded)
    runs = []
    for recorded in chosen:
        def rerun(steps: int, collectives: str, recorded: dict[str, Any] = recorded) -> dict[str, Any]:
            # The recorded run's payload rate is its ceiling, so the re-run's network is the recorded one.
            return simulate(config, methods[recorded["name"]], recorded["workers"], recorded["node_mbit"],
                            recorded["rate_mbit"], recorded["step_s"], None, steps, None, recorded["ranks_per_node"],
                            recorded["intra_mbit"], args.threads, collectives, eval_every=1)

        run = retimed(recorded, methods[recorded["name"]], args.collectives, rerun, args.retime_loss_tolerance)
        run.update(command=args.command, date=time.strftime("%Y-%m-%d"))
        runs.append(run)
        print(f"  {run['workers']:>4} workers {run['name']:<17} re-timed under {args.collectives}: "
              f"{run['retimed']['step_virtual_s']:.4f} s a step (was {run['retimed']['recorded_step_virtual_s']:.4f}), "
              f"{run['time_to_target_s']} s to target ({run['steps_to_target']} steps; {run['wall_s']:.0f} s wall; "
              f"largest relative loss difference {run['retimed']['largest_loss_difference']:.2g})",
              flush=True)
    return runs
