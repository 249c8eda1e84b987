"""What a lost replica group costs (issue 43): the language model on 4 groups over 20 Mbit/s, one group killed at a
random step, with ``fault_tolerance=TorchFT(...)`` and with today's torchrun restart, in the same run, several seeds.

    python -m benchmarks.fault_tolerance.failure              # 3 seeds x 4 ways, about 35 min on 2 cores
    python -m benchmarks.fault_tolerance.failure --replot     # the table and figure from the JSON

Every group is one rank in its own network namespace (``benchmarks/common/netns.py``), each namespace's interface
capped at 20 Mbit/s as in the LM benchmark (``benchmarks/language_model/network.py``: its task, its target loss,
DiLoCo every 50 steps with the outer Nesterov step). Four ways per seed, each a fresh launch:

- ``no_failure``: ``fault_tolerance=TorchFT(num_replica_groups=4)``, one torchrun job per group, a torchft
  Lighthouse (``torchft_lighthouse``, the launching page's flags) in namespace 0;
- ``killed``: the same, and group ``v`` SIGKILLs itself at the end of step ``s`` (``v`` and ``s`` drawn from the
  seed, ``s`` between windows); the other three train on;
- ``restarted``: the same kill, and the group's torchrun (``--max-restarts=1``) starts it again at once; it joins
  the others with the live state from a peer;
- ``torchrun_restart``: today's way, without the option: one torchrun job over the 4 namespaces (c10d rendezvous,
  ``--max-restarts=1``), a checkpoint every 50 steps (at the windows: at most one window is lost, as with the
  option), the same kill; torchrun restarts every process and Lightning resumes from ``last.ckpt``.

Scoring is the LM benchmark's: every group copies its replica at the first step end after every
``SNAPSHOT_EVERY_S`` seconds of one wall-clock grid; the mean of the copies taken at a grid point is scored on
the 64 fixed validation windows; a point's time is its latest copy's, from the first group's start of training.
Reported per way (each seed and the mean): time to the target, the final loss, the run's end, the group-steps
lost (the killed group's steps since the last window it committed, or every group's steps since the checkpoint),
and for a restart: from the kill to the process being up, to it training again, and the bytes its namespace
received in between. Writes ``benchmarks/results/ft_failure.{json,png}``. Exits 77 where network namespaces
cannot be built.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import netns
from benchmarks.common.launch import worker_env
from benchmarks.common.paths import BENCHMARKS, REPO, RESULTS
from benchmarks.common.process import kill_tree
from benchmarks.common.report import command_line, one_figure, publish, pyplot, replot, save_figure
from lightning_dist.comm.peer_state import SECRET_ENV
from benchmarks.language_model.network import DILOCO_OUTER, DILOCO_PERIOD, EVAL_SEQUENCES, HEADLINE_MBIT, TASK

PREFIX = "ft_failure"
WORKER = BENCHMARKS / "fault_tolerance" / "failure_worker.py"
GROUPS = 4
SEEDS = (0, 1, 2)
MAX_STEPS = 250
CHECKPOINT_EVERY = DILOCO_PERIOD
SNAPSHOT_EVERY_S = 2.0
KILL_STEPS = (DILOCO_PERIOD + 5, 3 * DILOCO_PERIOD - 5)  # a kill between windows, after the first one
LIGHTHOUSE_PORT = 29510
MASTER_PORT = 29400
LIGHTHOUSE_FLAGS = ["--min_replicas", "1", "--join_timeout_ms", "10000", "--heartbeat_timeout_ms", "2000"]
TIMEOUT_S = 600.0
WAYS = ("no_failure", "killed", "restarted", "torchrun_restart")


def draw_kill(seed: int) -> dict[str, int]:
    """The seed's victim and step (never a window's step: the kill falls between windows)."""
    rng = random.Random(seed)
    group = rng.randrange(GROUPS)
    step = rng.choice([s for s in range(*KILL_STEPS) if s % DILOCO_PERIOD])
    return {"group": group, "step": step}


def launch_way(network: netns.Network, way: str, seed: int, kill: dict[str, int] | None, work: Path) -> dict[str, Any]:
    """One launch of ``way``: its processes until they exit, then every process's journal."""
    name = f"{way}{seed}"
    spec = {**common_spec(network, name, seed, work), "max_steps": MAX_STEPS, "snapshot_every_s": SNAPSHOT_EVERY_S,
            "kill": kill, "tolerant": way != "torchrun_restart"}
    codes = run_groups(network, spec, int(way in ("restarted", "torchrun_restart")), work)
    expected_failures = {kill["group"]} if kill and way == "killed" else set()
    failed = [group for group, code in enumerate(codes) if code != 0 and group not in expected_failures]
    if failed:
        raise RuntimeError(f"{name}: groups {failed} exited {[codes[g] for g in failed]}; see {work}/{name}.*.log")
    return {"way": way, "seed": seed, "kill": kill, "epoch": spec["epoch"], "exit_codes": codes,
            "journals": read_journals(work, name)}


def common_spec(network: netns.Network, name: str, seed: int, work: Path) -> dict[str, Any]:
    """What every launch of the LM over the groups tells ``failure_worker.py``, but for its steps, kills, snapshot
    grid and way (``max_steps``, ``kill`` or ``kills``, ``snapshot_every_s``, ``tolerant``)."""
    return {"name": name, "seed": seed, "groups": GROUPS, "period": DILOCO_PERIOD, "outer": DILOCO_OUTER,
            "data": TASK["data"], "model": TASK["model"], "checkpoint_every": CHECKPOINT_EVERY, "epoch": time.time(),
            "work_dir": str(work), "lighthouse": f"http://{network.address(0)}:{LIGHTHOUSE_PORT}"}


def run_groups(network: netns.Network, spec: dict[str, Any], restarts: int, work: Path, timeout_s: float = TIMEOUT_S,
               straggler_s: float | None = None) -> list[int | None]:
    """Run ``spec``: with ``spec["tolerant"]``, a Lighthouse in namespace 0 and one torchrun job per group, else one
    torchrun job over the groups' namespaces; each agent restarts its workers up to ``restarts`` times. Returns the
    groups' exit codes (:func:`wait_groups`)."""
    name, tolerant = spec["name"], bool(spec["tolerant"])
    spec_path = work / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    env = {**worker_env(), SECRET_ENV: secrets.token_hex(16)}  # the launch's groups share one secret
    if not tolerant:
        # torchrun's agents share their rendezvous store with the workers by default, and a restart round then
        # mixes attempts (each agent counts its own restarts): workers read a previous round's addresses
        # (pytorch/pytorch#135712, seen here as Gloo's "connection refused" in the restarted round). Off, as advised.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--max-restarts={restarts}"]
    lighthouse = None
    if tolerant:
        binary = Path(sys.executable).with_name("torchft_lighthouse")
        lighthouse = network.run(0, [str(binary), "--bind", f"[::]:{LIGHTHOUSE_PORT}", *LIGHTHOUSE_FLAGS],
                                 env=env, stdout=(work / f"{name}.lighthouse.log").open("w"),
                                 stderr=subprocess.STDOUT)
    processes = []
    for group in range(GROUPS):
        if tolerant:
            argv = [*torchrun, "--nnodes=1", "--master_addr=127.0.0.1", f"--master_port={MASTER_PORT}",
                    str(WORKER), str(spec_path), str(group)]
        else:
            argv = [*torchrun, f"--nnodes={GROUPS}", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint={network.address(0)}:{MASTER_PORT}", f"--rdzv-id={name}",
                    f"--local_addr={network.address(group)}",
                    # torchrun tells the store's host by the machine's hostname, which names the host outside the
                    # namespaces: node 0 is told.
                    f"--rdzv-conf=is_host={str(group == 0).lower()}", str(WORKER), str(spec_path), str(group)]
        with (work / f"{name}.{group}.log").open("w") as log:
            processes.append(network.run(group, argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
    try:
        return wait_groups(processes, timeout_s, straggler_s)
    finally:
        if lighthouse is not None:
            lighthouse.terminate()
            lighthouse.wait()


def wait_groups(processes: list[subprocess.Popen], timeout_s: float, straggler_s: float | None) -> list[int | None]:
    """The groups' exit codes; None for a group stopped (with every process under its agent) because it still ran
    ``timeout_s`` after the start or ``straggler_s`` after a group's job ended cleanly. A group restarted too late to
    be healed by a live peer would wait for its quorum timeout (30 min)."""
    deadline = time.monotonic() + timeout_s
    while None in (codes := [process.poll() for process in processes]) and time.monotonic() < deadline:
        if straggler_s is not None and 0 in codes:  # every group polled: a clean end anywhere starts the clock
            deadline = min(deadline, time.monotonic() + straggler_s)
        time.sleep(0.5)
    stopped = [process.poll() is None for process in processes]
    for process, stop in zip(processes, stopped):
        if stop:
            kill_tree(process.pid)
            process.wait()
    return [None if stop else process.returncode for process, stop in zip(processes, stopped)]


def read_journals(work: Path, name: str) -> dict[str, list[dict[str, Any]]]:
    """Every process's journal of launch ``name``, by ``<group>.<incarnation>``."""
    return {path.name.removeprefix(f"{name}.").removesuffix(".jsonl"): read_journal(path)
            for path in sorted(work.glob(f"{name}.*.jsonl"))}


def read_journal(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def events(journal: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [event for event in journal if event["event"] == kind]


def training_origin(launch: dict[str, Any]) -> float:
    """The first group's start of training (first incarnations): time 0 of every curve."""
    return min(events(journal, "train_start")[0]["time"] for tag, journal in launch["journals"].items()
               if tag.endswith(".0") and events(journal, "train_start"))


def healed_after(journal: list[dict[str, Any]]) -> float:
    """When a group's replica holds the run's state: at once, but for a process that joined a run in progress under
    ``fault_tolerance`` (it journaled ``joined``, then started training past step 0). That one trains its first window
    from the model it started with and takes its peer's committed state at the window's end (its work is discarded),
    so its copies before that window's end are no replica of the run."""
    starts = events(journal, "train_start")
    if not events(journal, "joined") or not starts or starts[0]["step"] == 0:
        return 0.0
    ends = [window["time"] for window in events(journal, "window") if window["time"] > starts[0]["time"]]
    return ends[0] if ends else math.inf


def score(launch: dict[str, Any], work: Path) -> list[dict[str, Any]]:
    """The loss curve: at every grid point, the mean of the copies taken there by the groups whose replica holds the
    run's state (:func:`healed_after`), scored (the LM benchmark's rule)."""
    import torch
    from lightning_dist.data import StdlibTextDataModule
    from lightning_dist.models import TransformerLM
    from benchmarks.language_model.recording import eval_batches, evaluate

    name = f"{launch['way']}{launch['seed']}"
    copies: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    for tag, journal in launch["journals"].items():
        healed_at = healed_after(journal)
        for event in events(journal, "snapshot"):
            if event["time"] >= healed_at:
                copies.setdefault(event["index"], []).append((tag, event))
    first_full = max(min(event["index"] for event in events(journal, "snapshot"))
                     for tag, journal in launch["journals"].items() if tag.endswith(".0"))
    indices = sorted(index for index in copies if index >= first_full)
    datamodule = StdlibTextDataModule(seed=launch["seed"], **TASK["data"])
    datamodule.setup("fit")
    model = TransformerLM(**TASK["model"])
    batches = eval_batches(datamodule, EVAL_SEQUENCES)
    means = torch.stack([sum(torch.load(work / "snapshots" / f"{name}.{tag}.{index}.pt") for tag, _ in copies[index])
                         / len(copies[index]) for index in indices])
    losses = evaluate(model, means, batches)
    return [{"seconds": max(event["time"] for _, event in copies[index]) - launch["origin"],
             "groups": len(copies[index]), "steps": [event["step"] for _, event in copies[index]],
             "val_loss": loss} for index, loss in zip(indices, losses)]


def restart_record(launch: dict[str, Any]) -> dict[str, Any] | None:
    """For a killed group: the kill, its restart's timeline (up, training again) and the bytes it received."""
    kill = launch["kill"]
    if kill is None:
        return None
    victim = launch["journals"][f"{kill['group']}.0"]
    killed = events(victim, "kill")[0]
    commits = [event["step"] for event in events(victim, "window") if event["committed"] is not False]
    record: dict[str, Any] = {"kill_time": killed["time"], "kill_step": killed["step"]}
    again = launch["journals"].get(f"{kill['group']}.1")
    if launch["way"] == "torchrun_restart":
        resumed = [events(journal, "train_start")[0] for tag, journal in launch["journals"].items() if tag.endswith(".1")]
        record["resumed_step"] = resumed[0]["step"] if resumed else None
        record["steps_lost"] = GROUPS * (killed["step"] - record["resumed_step"]) if resumed else None
    else:
        last_commit = max((step for step in commits if step <= killed["step"]), default=0)
        record["steps_lost"] = killed["step"] - last_commit
        record["survivor_windows_discarded"] = sum(
            1 for tag, journal in launch["journals"].items() if not tag.startswith(f"{kill['group']}.")
            for event in events(journal, "window") if event["committed"] is False)
    if again:
        up, start = events(again, "up")[0], events(again, "train_start")[0]
        first_step = events(again, "step")[0]
        record.update({"up_after_kill_s": up["time"] - killed["time"],
                       "training_after_up_s": first_step["time"] - up["time"],
                       "training_after_kill_s": first_step["time"] - killed["time"],
                       "joined_at_step": start["step"], "recovery_received_bytes": start["rx"] - up["rx"]})
        joined = events(again, "joined")
        if joined:
            record["joined_after_up_s"] = joined[0]["time"] - up["time"]
            record.update(heal_windows(launch, again, killed, start["step"]))
    return record


def heal_windows(launch: dict[str, Any], again: list[dict[str, Any]], killed: dict[str, Any],
                 joined_step: int) -> dict[str, Any]:
    """How long the survivors' windows took where the returning group was healed (``joined_step``) and where it
    caught up (the next), against their other windows after the first (median); and from the kill to the end of
    its catch-up window, from where it contributes."""
    survivors = [journal for tag, journal in launch["journals"].items()
                 if not tag.startswith(f"{launch['kill']['group']}.")]

    def longest(step: int) -> float | None:
        spans = [event["time"] - event["began"] for journal in survivors for event in events(journal, "window")
                 if event["step"] == step]
        return max(spans) if spans else None

    others = [event["time"] - event["began"] for journal in survivors for event in events(journal, "window")
              if event["step"] not in (0, joined_step, joined_step + DILOCO_PERIOD)]
    catch_up = [event for event in events(again, "window") if event["step"] == joined_step + DILOCO_PERIOD]
    return {"heal_window_s": longest(joined_step), "catch_up_window_s": longest(joined_step + DILOCO_PERIOD),
            "other_windows_median_s": statistics.median(others) if others else None,
            "contributing_after_kill_s": catch_up[0]["time"] - killed["time"] if catch_up else None}


def summarize_launch(launch: dict[str, Any], curve: list[dict[str, Any]], target: float) -> dict[str, Any]:
    reached = next((point["seconds"] for point in curve if point["val_loss"] <= target), None)
    ends = [events(journal, "end")[0]["time"] for journal in launch["journals"].values() if events(journal, "end")]
    saves = [event["time"] - event["began"] for tag, journal in launch["journals"].items() if tag.startswith("0.")
             for event in events(journal, "checkpoint")]
    return {"way": launch["way"], "seed": launch["seed"], "time_to_target_s": reached,
            "checkpoints_s": sum(saves),
            "final_val_loss": curve[-1]["val_loss"], "end_s": max(ends) - launch["origin"],
            "restart": restart_record(launch)}


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    rows = {}
    for way in sorted({launch["way"] for launch in report["launches"]}, key=WAYS.index):
        runs = [launch["summary"] for launch in report["launches"] if launch["way"] == way]
        reached = [run["time_to_target_s"] for run in runs if run["time_to_target_s"] is not None]
        rows[way] = {"seeds": [run["seed"] for run in runs], "reached": len(reached),
                     "time_to_target_s": statistics.fmean(reached) if reached else None,
                     "time_to_target_s_each": [run["time_to_target_s"] for run in runs],
                     "final_val_loss": statistics.fmean(run["final_val_loss"] for run in runs) if runs else None,
                     "end_s": statistics.fmean(run["end_s"] for run in runs) if runs else None,
                     "checkpoints_s": statistics.fmean(run["checkpoints_s"] for run in runs) if runs else None,
                     "restarts": [run["restart"] for run in runs if run["restart"]]}
    base = rows.get("no_failure", {}).get("time_to_target_s")
    for row in rows.values():
        row["vs_no_failure"] = row["time_to_target_s"] / base if base and row["time_to_target_s"] else None
    return {"target_val_loss": report["target_val_loss"], "rows": rows}


def mean_of(restarts: list[dict[str, Any]], key: str) -> float | None:
    values = [record[key] for record in restarts if record.get(key) is not None]
    return statistics.fmean(values) if values else None


def megabytes(value: float | None) -> float | None:
    return None if value is None else value / 1e6


def table(summary: dict[str, Any]) -> str:
    fmt = lambda value, spec=".1f": "-" if value is None else format(value, spec)  # noqa: E731
    lines = ["| way | reached | s to target (mean; each) | vs no failure | final loss | end, s | checkpoints, s "
             "| group-steps lost | kill to training again, s | up to training, s | MB received to rejoin |",
             "|---" * 11 + "|"]
    for way, row in summary["rows"].items():
        restarts = row["restarts"]
        each = " / ".join(fmt(value) for value in row["time_to_target_s_each"])
        lines.append(
            f"| {way} | {row['reached']}/{len(row['seeds'])} | {fmt(row['time_to_target_s'])} ({each}) | "
            f"{fmt(row['vs_no_failure'], '.2f')} | {row['final_val_loss']:.3f} | {fmt(row['end_s'])} | "
            f"{fmt(row['checkpoints_s'])} | "
            f"{fmt(mean_of(restarts, 'steps_lost'), '.0f')} | {fmt(mean_of(restarts, 'training_after_kill_s'))} | "
            f"{fmt(mean_of(restarts, 'training_after_up_s'))} | "
            f"{fmt(megabytes(mean_of(restarts, 'recovery_received_bytes')))} |")
    for way, row in summary["rows"].items():
        healed = [restart for restart in row["restarts"] if restart and restart.get("heal_window_s") is not None]
        if healed:
            each = lambda key: " / ".join(fmt(restart[key]) for restart in healed)  # noqa: E731
            lines.append(f"{way}, each seed: the survivors' window that healed the returning group "
                         f"{each('heal_window_s')} s, the one it caught up in {each('catch_up_window_s')} s, their "
                         f"other windows' median {each('other_windows_median_s')} s; kill to contributing again "
                         f"{each('contributing_after_kill_s')} s")
    return "\n".join(lines)


def loss_panels(report: dict[str, Any], width: float) -> tuple[Any, list[tuple[Any, int, list[dict[str, Any]]]]]:
    """A figure of one panel per seed, every launch's loss against wall time drawn in it; returns the figure and each
    panel's (axis, seed, launches) for the caller's marks."""
    plt = pyplot()
    seeds = sorted({launch["seed"] for launch in report["launches"]})
    figure, axes = plt.subplots(1, len(seeds), figsize=(width * len(seeds), 4), sharey=True, squeeze=False)
    panels = []
    for axis, seed in zip(axes[0], seeds):
        launches = [launch for launch in report["launches"] if launch["seed"] == seed]
        for launch in launches:
            curve = launch["curve"]
            axis.plot([p["seconds"] for p in curve], [p["val_loss"] for p in curve], marker=".", markersize=3,
                      label=launch["way"])
        axis.set_xlabel("wall time (s)")
        panels.append((axis, seed, launches))
    axes[0][0].set_ylabel("validation loss (nats/char)")
    axes[0][0].legend()
    return figure, panels


def plot(report: dict[str, Any], path: Path) -> None:
    figure, panels = loss_panels(report, 5)
    for axis, seed, launches in panels:
        for launch in launches:
            restart = launch["summary"]["restart"]
            if restart and launch["way"] == "killed":
                axis.axvline(restart["kill_time"] - launch["origin"], color="grey", linestyle=":")
        axis.axhline(report["target_val_loss"], color="black", linewidth=0.8, linestyle="--")
        kill = report["kills"][str(seed)]
        axis.set_title(f"seed {seed}: group {kill['group']} killed at step {kill['step']}")
    figure.suptitle(f"DiLoCo on the LM, {GROUPS} groups at {HEADLINE_MBIT:g} Mbit/s: one group killed")
    save_figure(figure, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replot", action="store_true")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--keep", type=Path, help="keep the launches' logs, journals and copies in this directory")
    args = parser.parse_args(argv)
    json_path = args.out / f"{PREFIX}.json"
    draw = one_figure(plot, args.out, PREFIX)
    if args.replot:
        return replot(json_path, summarize, table, draw)
    netns.require_network("benchmarks.fault_tolerance.failure")
    target = json.loads((RESULTS / "lm_network.json").read_text())["summary"]["target_val_loss"]
    began = time.perf_counter()
    launches = []
    work = args.keep or Path(tempfile.mkdtemp(prefix="ft_failure_"))
    (work / "snapshots").mkdir(parents=True, exist_ok=True)
    try:
        with netns.Network(GROUPS, node_mbit=HEADLINE_MBIT) as network:
            for seed in args.seeds:
                for way in args.ways:
                    kill = draw_kill(seed) if way != "no_failure" else None
                    launch = launch_way(network, way, seed, kill, work)
                    launch["origin"] = training_origin(launch)
                    launch["curve"] = score(launch, work)
                    launch["summary"] = summarize_launch(launch, launch["curve"], target)
                    print(f"[ft] seed {seed} {way}: {json.dumps(launch['summary'])}", flush=True)
                    launch["journals"] = {tag: [event for event in journal if event["event"] != "step"]
                                          for tag, journal in launch["journals"].items()}  # the JSON's size
                    launches.append(launch)
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    report = {"command": command_line(argv), "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "groups": GROUPS, "node_mbit": HEADLINE_MBIT, "period": DILOCO_PERIOD,
              "max_steps": MAX_STEPS, "checkpoint_every": CHECKPOINT_EVERY, "lighthouse_flags": LIGHTHOUSE_FLAGS,
              "target_val_loss": target, "kills": {str(seed): draw_kill(seed) for seed in args.seeds},
              "launches": launches, "wall_s": time.perf_counter() - began}
    return publish(json_path, report, summarize, table, draw)


if __name__ == "__main__":
    sys.exit(main())
