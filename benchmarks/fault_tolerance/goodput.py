"""Goodput under repeated failures (issue 59): the language model on 4 groups over 20 Mbit/s, a random group killed
every minute of the run and restarted at once, with ``fault_tolerance=TorchFT(...)`` and with today's torchrun
restart from ``last.ckpt``, against the same run without a failure.

    python -m benchmarks.fault_tolerance.goodput              # 3 seeds x 3 ways, about 55 min on 2 cores
    python -m benchmarks.fault_tolerance.goodput --smoke      # the machinery only: 1 seed, 150 steps, about 4 min
    python -m benchmarks.fault_tolerance.goodput --replot     # the table and figure from the JSON
    python -m benchmarks.fault_tolerance.goodput --seeds 1 --add   # one more seed into the JSON

The setting is ``failure.py``'s (its launches, its worker ``failure_worker.py``, its scoring): every group one rank in
its own network namespace capped at 20 Mbit/s, the LM benchmark's task and target loss, DiLoCo every 50 steps with
the outer Nesterov step, here ``MAX_STEPS`` steps (about 2.6 min of training without a failure on this machine).
Three ways per seed, each a fresh launch:

- ``no_failure``: ``fault_tolerance=TorchFT(num_replica_groups=4)``, one torchrun job per group, a Lighthouse;
- ``ft_kills``: the same, and kill ``i`` at ``(i + 1) * KILL_EVERY_S`` seconds from the training origin (the first
  group's start of training) SIGKILLs a group drawn by ``random.Random(seed)``; the group's own torchrun starts it
  again at once and it joins the live run, healed from a peer;
- ``torchrun_restart``: one torchrun job over the 4 namespaces without the option, a checkpoint at every window
  (``ModelCheckpoint(every_n_train_steps=50, save_last=True)``), the same kills; torchrun restarts every process and
  Lightning resumes from ``last.ckpt``.

A kill comes at its group's first step end at or after its time, so one that falls while its group is restarting, or
writing a checkpoint, comes when the group trains again; kills of a group that pile up while it is down are served by
one death. A launch still running ``timeout_s`` after its start is stopped (under a kill a minute, torchrun's restarts
and checkpoints may leave it short of ``MAX_STEPS``: the run has no end then), and a group still running ``STRAGGLER_S``
after another group's job ended is stopped (a group restarted too late to be healed by a live peer waits for its quorum
timeout). The target is the loss the seed's run without a failure reaches at ``TARGET_AT`` of its training time (the LM
benchmark's target, 2.681, falls before the first kill here). Reported per way and seed: the time to the target
(goodput: the time without a failure over it), goodput in steps (the model's steps per second at its last copy over the
run's without a failure: it counts the work a restart keeps, also in a run cut before its end), the final loss, the
run's end, and every kill that happened: when, which group, the step it died at, and when and at which step its group
was back. Writes ``benchmarks/results/ft_goodput.{json,png}`` (``ft_goodput_smoke`` with ``--smoke``). Exits 77 where
network namespaces cannot be built.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks.common import netns
from benchmarks.common.paths import RESULTS
from benchmarks.common.report import command_line, one_figure, publish, replot, save_figure
from benchmarks.fault_tolerance.failure import (
    CHECKPOINT_EVERY, GROUPS, LIGHTHOUSE_FLAGS, common_spec, events, loss_panels, read_journals, run_groups,
    score, training_origin,
)
from benchmarks.language_model.network import DILOCO_PERIOD, HEADLINE_MBIT

PREFIX = "ft_goodput"
SEEDS = (0, 1, 2)
WAYS = ("no_failure", "ft_kills", "torchrun_restart")
SNAPSHOT_EVERY_S = 3.0  # coarser than failure.py's 2 s: runs of up to 15 min, 5.2 MB a copy
STRAGGLER_S = 30.0


class Setting(NamedTuple):
    max_steps: int
    kill_every_s: float
    timeout_s: float  # a launch's wall-clock cap from its start (the start-up takes about 15 s here)


# 12.8 s per 50 steps with the window (0.26 s a step; 4 groups on 2 cores, measured 2026-12-07): 2.6 min of
# training without a failure, two or three kills. failure.py's run of 2026-11-28 took 18 s per 50 steps: 3.6 min.
MAX_STEPS = 600
KILL_EVERY_S = 60.0
TARGET_AT = 0.8
FULL = Setting(max_steps=MAX_STEPS, kill_every_s=KILL_EVERY_S, timeout_s=600.0)
SMOKE = Setting(max_steps=150, kill_every_s=20.0, timeout_s=100.0)


def draw_kills(seed: int, setting: Setting) -> list[dict[str, Any]]:
    """The seed's kills, the same for every way: kill ``i`` at ``(i + 1) * kill_every_s`` s from the training origin,
    of a group drawn at random, as many as a launch's cap can hold."""
    rng = random.Random(seed)
    count = int(setting.timeout_s // setting.kill_every_s)
    return [{"group": rng.randrange(GROUPS), "after": (i + 1) * setting.kill_every_s} for i in range(count)]


def launch_way(network: netns.Network, way: str, seed: int, setting: Setting, work: Path) -> dict[str, Any]:
    """One launch of ``way``: its processes until they exit or are stopped, then every process's journal."""
    name = f"{way}{seed}"
    kills = draw_kills(seed, setting) if way != "no_failure" else []
    spec = {**common_spec(network, name, seed, work), "max_steps": setting.max_steps,
            "snapshot_every_s": SNAPSHOT_EVERY_S, "kills": kills, "tolerant": way != "torchrun_restart"}
    # Every agent may restart its workers once per kill: enough whichever groups the kills fall on.
    codes = run_groups(network, spec, len(kills), work, setting.timeout_s, STRAGGLER_S)
    failed = [group for group, code in enumerate(codes) if code not in (0, None)]
    if failed:
        raise RuntimeError(f"{name}: groups {failed} exited {[codes[g] for g in failed]}; see {work}/{name}.*.log")
    return {"way": way, "seed": seed, "kills": kills, "epoch": spec["epoch"], "exit_codes": codes,
            "journals": read_journals(work, name)}


def kill_records(launch: dict[str, Any]) -> list[dict[str, Any]]:
    """Every kill that happened, in time order: when (from the origin; and when it was due), the group, the step it
    died at, and when its group's next process was back in the run and at which step (the live run's or the
    checkpoint's): its start of training, or its end where it was healed at the run's last window."""
    records = []
    for tag, journal in launch["journals"].items():
        group, incarnation = (int(part) for part in tag.split("."))
        again = launch["journals"].get(f"{group}.{incarnation + 1}", [])
        back = (events(again, "train_start") + events(again, "end"))[:1]
        for kill in events(journal, "kill"):
            records.append({"seconds": kill["time"] - launch["origin"], "group": group, "step": kill["step"],
                            "due_s": min(launch["kills"][index]["after"] for index in kill["kills"]),
                            "back_at_step": back[0]["step"] if back else None,
                            "back_after_kill_s": back[0]["time"] - kill["time"] if back else None})
    return sorted(records, key=lambda record: record["seconds"])


def summarize_launch(launch: dict[str, Any], target: float) -> dict[str, Any]:
    curve = launch["curve"]
    ends = [event["time"] for journal in launch["journals"].values() for event in events(journal, "end")]
    return {"way": launch["way"], "seed": launch["seed"], "target_val_loss": target,
            "time_to_target_s": next((point["seconds"] for point in curve if point["val_loss"] <= target), None),
            "final_val_loss": curve[-1]["val_loss"], "final_s": curve[-1]["seconds"],
            "final_step": max(curve[-1]["steps"]),
            "end_s": max(ends) - launch["origin"] if ends else None,
            "stopped_groups": [group for group, code in enumerate(launch["exit_codes"]) if code is None],
            "kills": kill_records(launch)}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def mean(values: list[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.fmean(present) if present else None


def step_rate(run: dict[str, Any]) -> float | None:
    """Steps of the run's model per second at its last copy: what it kept of its work (a restart from a checkpoint
    goes back), also where the run was cut before its end."""
    return run["final_step"] / run["final_s"] if run.get("final_s") else None


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """Per way, each seed and the mean: time to the target and goodput (the seed's time without a failure over it),
    goodput in steps (its steps per second over the seed's without a failure), the final loss, the end, the kills."""
    runs = {(launch["way"], launch["seed"]): launch["summary"] for launch in report["launches"]}
    seeds = sorted({seed for _, seed in runs})
    rows = {}
    for way in (way for way in WAYS if any((way, seed) in runs for seed in seeds)):
        each = [runs[way, seed] for seed in seeds if (way, seed) in runs]
        base = [runs.get(("no_failure", run["seed"]), {}) for run in each]
        kills = [kill for run in each for kill in run["kills"]]
        rows[way] = {"seeds": [run["seed"] for run in each],
                     "time_to_target_s_each": [run["time_to_target_s"] for run in each],
                     "goodput_each": [ratio(b.get("time_to_target_s"), run["time_to_target_s"])
                                      for b, run in zip(base, each)],
                     "step_goodput_each": [ratio(step_rate(run), step_rate(b)) for b, run in zip(base, each)],
                     "final_val_loss_each": [run["final_val_loss"] for run in each],
                     "final_step_each": [run["final_step"] for run in each],
                     "end_s_each": [run["end_s"] for run in each],
                     "kills_each": [len(run["kills"]) for run in each],
                     "back_after_kill_s": mean([kill["back_after_kill_s"] for kill in kills])}
        for key in ("time_to_target_s", "goodput", "step_goodput", "final_val_loss", "end_s"):
            rows[way][key] = mean(rows[way][f"{key}_each"])
    targets = {run["seed"]: run["target_val_loss"] for run in runs.values()}
    return {"target_val_loss": [targets[seed] for seed in seeds], "rows": rows,
            "kills": {f"{launch['way']}{launch['seed']}": launch["summary"]["kills"] for launch in report["launches"]
                      if launch["summary"]["kills"]}}


def fmt(value: float | None, spec: str = ".1f", missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def table(summary: dict[str, Any]) -> str:
    targets = " / ".join(f"{target:.3f}" for target in summary["target_val_loss"])
    lines = [f"target loss (each seed) {targets}; '-': target not reached, or the run cut before its end",
             "| way | s to target (mean; each) | goodput (mean; each) | goodput in steps (mean; each) "
             "| final loss at step (each) | end, s (each) | kills (each) | kill to back in the run, s |",
             "|---" * 8 + "|"]
    for way, row in summary["rows"].items():
        each = lambda key, spec=".1f": " / ".join(fmt(value, spec) for value in row[key])  # noqa: E731
        lines.append(
            f"| {way} | {fmt(row['time_to_target_s'])} ({each('time_to_target_s_each')}) | "
            f"{fmt(row['goodput'], '.2f')} ({each('goodput_each', '.2f')}) | "
            f"{fmt(row['step_goodput'], '.2f')} ({each('step_goodput_each', '.2f')}) | " + " / ".join(
                f"{loss:.3f} at {step}" for loss, step in zip(row["final_val_loss_each"], row["final_step_each"]))
            + f" | {fmt(row['end_s'])} ({each('end_s_each')}) | {' / '.join(map(str, row['kills_each']))} | "
            f"{fmt(row['back_after_kill_s'])} |")
    for name, kills in summary["kills"].items():
        lines.append(f"{name} kills (s from the origin, due; group; step -> step back in the run): " + ", ".join(
            f"{kill['seconds']:.1f} ({kill['due_s']:g}); g{kill['group']}; {kill['step']} -> "
            f"{fmt(kill['back_at_step'], 'd', 'never')}" for kill in kills))
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    figure, panels = loss_panels(report, 6)
    for axis, seed, launches in panels:
        last = max(launch["curve"][-1]["seconds"] for launch in launches)
        for kill in report["schedules"][str(seed)]:
            if kill["after"] <= last:
                axis.axvline(kill["after"], color="grey", linestyle=":", linewidth=0.8)
        axis.axhline(launches[0]["summary"]["target_val_loss"], color="black", linewidth=0.8, linestyle="--")
        axis.set_title(f"seed {seed}: kills of groups " + ", ".join(
            str(kill["group"]) for kill in report["schedules"][str(seed)] if kill["after"] <= last), fontsize=10)
    figure.suptitle(f"DiLoCo on the LM, {GROUPS} groups at {HEADLINE_MBIT:g} Mbit/s:\n"
                    f"a random group killed every {report['setting']['kill_every_s']:g} s (dotted)")
    save_figure(figure, path)


def target_of(curve: list[dict[str, Any]]) -> float:
    """The loss a run without a failure reaches at ``TARGET_AT`` of its training time: a target deep enough that
    the kills fall before it."""
    return next(point["val_loss"] for point in curve if point["seconds"] >= TARGET_AT * curve[-1]["seconds"])


def run_seed(network: netns.Network, seed: int, setting: Setting, work: Path, keep: bool,
             ways: tuple[str, ...] = WAYS, target: float | None = None) -> list[dict[str, Any]]:
    """Launch ``ways`` for ``seed``, no_failure first: its curve sets the seed's target (else ``target``, the
    no_failure launch's of an earlier run)."""
    launches = []
    for way in ways:
        launch = launch_way(network, way, seed, setting, work)
        launch["origin"] = training_origin(launch)
        launch["curve"] = score(launch, work)
        target = target_of(launch["curve"]) if way == "no_failure" else target
        assert target is not None, "a seed's target comes from its no_failure launch"
        launch["summary"] = summarize_launch(launch, target)
        print(f"[goodput] seed {seed} {way}: {json.dumps(launch['summary'])}", flush=True)
        launch["journals"] = {tag: [event for event in journal if event["event"] != "step"]
                              for tag, journal in launch["journals"].items()}  # the JSON's size
        if not keep:  # up to 6 GB of copies a launch
            for copy in (work / "snapshots").glob(f"{way}{seed}.*.pt"):
                copy.unlink()
        launches.append(launch)
    return launches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replot", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="1 seed, 150 steps, a kill every 20 s: the machinery")
    parser.add_argument("--seeds", type=int, nargs="+")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--keep", type=Path, help="keep the launches' logs, journals and copies in this directory")
    parser.add_argument("--add", action="store_true",
                        help="add these seeds to the JSON's (same setting; a seed's launches of these ways replaced)")
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS),
                        help="launch only these ways (with --add: the others stay; the target is the JSON's)")
    args = parser.parse_args(argv)
    ways = tuple(way for way in WAYS if way in args.ways)
    if ways != WAYS and not args.add:
        parser.error("--ways needs --add: the ways not launched, and the seed's target, come from the JSON")
    setting = SMOKE if args.smoke else FULL
    seeds = args.seeds or ([SEEDS[0]] if args.smoke else list(SEEDS))
    prefix = f"{PREFIX}_smoke" if args.smoke else PREFIX
    json_path = args.out / f"{prefix}.json"
    draw = one_figure(plot, args.out, prefix)
    if args.replot:
        return replot(json_path, summarize, table, draw)
    netns.require_network("benchmarks.fault_tolerance.goodput")
    began = time.perf_counter()
    launches = []
    earlier = json.loads(json_path.read_text()) if args.add else None
    targets = {} if earlier is None else {launch["seed"]: launch["summary"]["target_val_loss"]
                                          for launch in earlier["launches"] if launch["way"] == "no_failure"}
    if "no_failure" not in ways and not set(seeds) <= set(targets):
        parser.error(f"--ways without no_failure: {json_path} has no no_failure launch for seeds "
                     f"{sorted(set(seeds) - set(targets))}")
    work = args.keep or Path(tempfile.mkdtemp(prefix="ft_goodput_"))
    (work / "snapshots").mkdir(parents=True, exist_ok=True)
    try:
        with netns.Network(GROUPS, node_mbit=HEADLINE_MBIT) as network:
            for seed in seeds:
                launches += run_seed(network, seed, setting, work, args.keep is not None, ways, targets.get(seed))
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    commands, wall_s = [command_line(argv)], time.perf_counter() - began
    if earlier is not None:  # a long study measured seed by seed: the JSON keeps every command that made it
        if earlier["setting"] != setting._asdict():
            raise ValueError(f"--add: {json_path} was measured with {earlier['setting']}, not {setting._asdict()}")
        launches = [launch for launch in earlier["launches"]
                    if not (launch["seed"] in seeds and launch["way"] in ways)] + launches
        seeds = sorted({launch["seed"] for launch in launches})
        commands = [*(earlier["commands"] if "commands" in earlier else [earlier["command"]]), *commands]
        wall_s += earlier["wall_s"]
    report = {"commands": commands, "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "groups": GROUPS, "node_mbit": HEADLINE_MBIT, "period": DILOCO_PERIOD,
              "setting": setting._asdict(), "smoke": args.smoke, "checkpoint_every": CHECKPOINT_EVERY,
              "snapshot_every_s": SNAPSHOT_EVERY_S, "straggler_s": STRAGGLER_S, "lighthouse_flags": LIGHTHOUSE_FLAGS,
              "target_at": TARGET_AT, "schedules": {str(seed): draw_kills(seed, setting) for seed in seeds},
              "launches": launches, "wall_s": wall_s}
    return publish(json_path, report, summarize, table, draw)


if __name__ == "__main__":
    sys.exit(main())
