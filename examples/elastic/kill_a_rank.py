"""Kill a rank (or a whole node) in the middle of an elastic run and watch torchrun bring it back.

    python examples/elastic/kill_a_rank.py --config configs/dynamic_avg.yaml --workdir /tmp/elastic
    python examples/elastic/kill_a_rank.py --workdir /tmp/elastic --nodes 2 --kill node

Starts ``--nodes`` torchrun agents on this machine (each a "node" of ``--nproc-per-node``
processes, one c10d rendezvous, ``--nnodes=1:NODES --max-restarts=1``) running
``lightning_dist.cli fit`` with the strategy's config plus ``examples/elastic/checkpointing.yaml``
(a checkpoint every 20 steps, or ``--every-n-train-steps``; ``ckpt_path: last``). ``--kill-delay``
seconds after the first checkpoint is on disk it SIGKILLs global rank 1 (``--kill rank``) or the
last agent with all its processes (``--kill node``), then waits for the run to finish. torchrun's
agent sees the dead process, stops the others and starts the group again; every process resumes
from ``last.ckpt``, at a smaller world size when a node left. ``--kill none`` is the
uninterrupted run to compare with.

Prints and writes (``--json``) what happened, in seconds from the start: when each checkpoint
appeared, when the kill came and how old the checkpoint it left was (the work lost), when the
restarted processes appeared and when Lightning had restored the checkpoint; the world size before
and after, the final ``global_step`` and the final model's validation accuracy (the checkpoint
holds the replicas' average), so that a failure's cost can be read off against the uninterrupted run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

REPO = Path(__file__).resolve().parents[2]
CHECKPOINTING = Path(__file__).resolve().parent / "checkpointing.yaml"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# The other agents: torchrun imported first, then started the moment the first agent's rendezvous store listens.
# Started only then from scratch, an agent's own start-up (Python and torch, 2-4 s here) could come after the
# first agent's last call (2 s): the first agent would start alone and torchrun would have to grow the group, a
# second round that timed out waiting for its MASTER_ADDR in torch 2.13.
JOIN_WHEN_LISTENING = """
import socket, sys, time
import torch.distributed.run as torchrun
host, port = sys.argv[1].rsplit(":", 1)
while True:
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
        break
    except OSError:
        time.sleep(0.02)
sys.argv = ["torchrun", *sys.argv[2:]]
torchrun.main()
"""


def wait_for_listener(endpoint: str, agent: subprocess.Popen, timeout: float) -> None:
    host, port = endpoint.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and agent.poll() is None:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"torchrun's rendezvous store at {endpoint} did not come up")


def workers(run_id: str) -> list[dict[str, Any]]:
    """The training processes of this run, read from /proc: pid, parent pid, global rank, restart round, world size."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            raw = (proc / "environ").read_bytes()
        except OSError:
            continue
        env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
        if env.get("TORCHELASTIC_RUN_ID") == run_id and "RANK" in env and "LOCAL_RANK" in env:
            try:  # /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces, so split after ")"
                parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            found.append({"pid": int(proc.name), "ppid": parent, "rank": int(env["RANK"]),
                          "restart": int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
                          "world_size": int(env["WORLD_SIZE"])})
    return found


def checkpoint_steps(directory: Path) -> list[int]:
    """The steps of the step checkpoints on disk (ModelCheckpoint adds ``-v1`` to a name written twice)."""
    return sorted(int(re.search(r"step=(\d+)", path.stem)[1]) for path in directory.glob("epoch=*-step=*.ckpt"))


def resumable_checkpoint(directory: Path) -> tuple[int, float]:
    """The step and write time (wall clock) of last.ckpt, which a restart resumes from (ModelCheckpoint replaces it
    atomically, so it is always whole)."""
    path = directory / "last.ckpt"
    while True:
        written = path.stat().st_mtime
        step = torch.load(path, map_location="cpu", weights_only=False, mmap=True)["global_step"]
        if path.stat().st_mtime == written:
            return step, written


def validation_accuracy(checkpoint: Path, config: Path) -> float:
    """The checkpointed model's accuracy on the config's validation set, in this process."""
    from lightning_dist.cli import DistCLI

    cli = DistCLI(subclass_mode_model=True, subclass_mode_data=True, run=False, save_config_callback=None,
                  args=["--config", str(config), "--trainer.logger=false", "--trainer.devices=1",
                        "--trainer.strategy=auto", "--trainer.enable_progress_bar=false"])
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)
    cli.model.load_state_dict(state["state_dict"])
    (metrics,) = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    return float(metrics["val_acc"])


class Watch:
    """Polls a run every 50 ms from its start, noting when each step checkpoint first appears."""

    def __init__(self, workdir: Path, agents: list[subprocess.Popen], timeout: float) -> None:
        self.directory, self.agents, self.timeout = workdir / "checkpoints", agents, timeout
        self.start = time.monotonic()
        self.checkpoints_seen: dict[int, float] = {}  # step -> seconds from the start

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def poll(self) -> None:
        for step in checkpoint_steps(self.directory):
            self.checkpoints_seen.setdefault(step, self.elapsed())

    def sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.poll()
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def until(self, done: Callable[[], bool], what: str) -> None:
        """Waits for ``done``; fails if every agent ended first or ``timeout`` passed."""
        while True:
            self.poll()
            # Whether the agents had all ended is read before ``done``, so that ``done`` has its last look after
            # they ended: read after it, an agent ending in between failed a run whose ``done`` had just come true.
            ended = all(agent.poll() is not None for agent in self.agents)
            if done():
                break
            if ended:
                codes = [agent.returncode for agent in self.agents]
                raise RuntimeError(f"the run ended before its {what} (agents exited {codes}); "
                                   f"see {self.directory.parent}/agent*.log")
            if self.elapsed() > self.timeout:
                raise TimeoutError(f"no {what} within {self.timeout} s; see {self.directory.parent}/agent*.log")
            time.sleep(0.05)


def resumed(workdir: Path) -> bool:
    """Whether Lightning has reported restoring last.ckpt in any agent's log (only a restarted round does)."""
    return any("Restored all states from the checkpoint" in log.read_text(errors="replace")
               for log in workdir.glob("agent*.log"))


def checkpointing(workdir: Path, every_n_train_steps: int | None) -> Path:
    """examples/elastic/checkpointing.yaml, or a copy in ``workdir`` that checkpoints every ``every_n_train_steps``."""
    if every_n_train_steps is None:
        return CHECKPOINTING
    settings = yaml.safe_load(CHECKPOINTING.read_text())
    (callback,) = settings["trainer"]["callbacks"]
    callback["init_args"]["every_n_train_steps"] = every_n_train_steps
    path = workdir / "checkpointing.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


def run(config: Path, workdir: Path, nodes: int, nproc_per_node: int, max_steps: int, kill: str,
        timeout: float, seed: int | None = None, kill_delay: float = 0.0,
        every_n_train_steps: int | None = None) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    checkpoint_config = checkpointing(workdir, every_n_train_steps)
    run_id = f"kill-a-rank-{os.getpid()}-{time.time_ns()}"
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes=1:{nodes}",
               f"--nproc_per_node={nproc_per_node}", "--max-restarts=1", "--rdzv-backend=c10d",
               f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
               # a node that left is noticed within ~3 s, and a shrunken group starts 2 s after the
               # survivors meet (defaults: 5 s keep-alives, 30 s last call).
               "--rdzv-conf=last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3",
               "-m", "lightning_dist.cli", "fit", "--config", str(config),
               "--config", str(checkpoint_config),
               f"--trainer.max_steps={max_steps}", "--trainer.max_epochs=-1", "--trainer.enable_progress_bar=false",
               f"--trainer.default_root_dir={workdir}"] + ([] if seed is None else [f"--seed_everything={seed}"])
    record: dict[str, Any] = {"config": str(config), "nodes": nodes, "nproc_per_node": nproc_per_node,
                              "max_steps": max_steps, "kill": kill, "seed": seed, "kill_delay_s": kill_delay,
                              "every_n_train_steps": yaml.safe_load(checkpoint_config.read_text())["trainer"][
                                  "callbacks"][0]["init_args"]["every_n_train_steps"]}
    agents: list[subprocess.Popen] = []
    watch = Watch(workdir, agents, timeout)
    for node in range(nodes):
        log = open(workdir / f"agent{node}.log", "w")
        # The first agent hosts the rendezvous store (the node killed is another one); the others join it.
        argv = command if node == 0 else [sys.executable, "-c", JOIN_WHEN_LISTENING, endpoint, *command[3:]]
        agents.append(subprocess.Popen(argv, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True))
    wait_for_listener(endpoint, agents[0], timeout)
    try:
        first_round: list[dict[str, Any]] = []

        def started() -> bool:
            first_round[:] = [w for w in workers(run_id) if w["restart"] == 0]
            return bool(first_round) and len(first_round) == first_round[0]["world_size"]

        watch.until(started, "training process")
        record["world_size_before"] = first_round[0]["world_size"]
        if kill != "none":
            watch.until((workdir / "checkpoints" / "last.ckpt").exists, "first checkpoint")
            watch.sleep(kill_delay)
            record["killed_at_s"] = watch.elapsed()
            step, written = resumable_checkpoint(workdir / "checkpoints")
            record["resumable_step_at_kill"] = step
            # the work lost: what the ranks did after this checkpoint, redone from it after the restart
            record["checkpoint_age_at_kill_s"] = time.time() - written
            if kill == "rank":
                (victim,) = [w for w in first_round if w["rank"] == 1]
                os.kill(victim["pid"], signal.SIGKILL)
            else:  # the last agent and its training processes (torchrun starts them in sessions of their own)
                node_pids = [agents[-1].pid] + [w["pid"] for w in first_round if w["ppid"] == agents[-1].pid]
                for pid in node_pids:
                    os.kill(pid, signal.SIGKILL)
                agents.pop().wait()
            restarted: list[dict[str, Any]] = []

            def restarted_round() -> bool:
                restarted[:] = [w for w in workers(run_id) if w["restart"] >= 1]
                return bool(restarted)

            watch.until(restarted_round, "restart")
            record["restarted_at_s"] = watch.elapsed()
            record["world_size_after"] = restarted[0]["world_size"]
            watch.until(lambda: resumed(workdir), "resume from last.ckpt")
            record["resumed_at_s"] = watch.elapsed()
        watch.until(lambda: all(agent.poll() is not None for agent in agents), "end")
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
    record["wall_s"] = watch.elapsed()
    record["returncodes"] = [agent.returncode for agent in agents]
    record["checkpoints_seen_s"] = watch.checkpoints_seen
    final = workdir / "checkpoints" / "last.ckpt"
    record["global_step"] = torch.load(final, map_location="cpu", weights_only=False)["global_step"]
    record["val_acc"] = validation_accuracy(final, config)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "dynamic_avg.yaml")
    parser.add_argument("--workdir", type=Path, required=True, help="checkpoints/ and the agents' logs go here")
    parser.add_argument("--nodes", type=int, default=1, help="torchrun agents on this machine (default 1)")
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--kill", choices=("rank", "node", "none"), default="rank")
    parser.add_argument("--seed", type=int, help="seed_everything (default: the config's)")
    parser.add_argument("--kill-delay", type=float, default=0.0, help="seconds after the first checkpoint")
    parser.add_argument("--every-n-train-steps", type=int,
                        help="checkpoint interval (default: checkpointing.yaml's 20)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", type=Path, help="write the record here")
    args = parser.parse_args()
    if args.kill == "node" and args.nodes < 2:
        parser.error("--kill node needs --nodes >= 2 (one node must survive)")
    record = run(args.config, args.workdir, args.nodes, args.nproc_per_node, args.max_steps, args.kill, args.timeout,
                 args.seed, args.kill_delay, args.every_n_train_steps)
    print(json.dumps(record, indent=2))
    if args.json:
        args.json.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
