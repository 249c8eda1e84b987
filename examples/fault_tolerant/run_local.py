"""Replica groups on one machine, joined by a torchft Lighthouse; kill one, and start it again if you like.

    python examples/fault_tolerant/run_local.py --workdir /tmp/ft
    python examples/fault_tolerant/run_local.py --workdir /tmp/ft --kill-group 2 --kill-after 15 --restart
    python examples/fault_tolerant/run_local.py --workdir /tmp/ft --kill-group 2 --kill-after 5 --restart \
        -- --trainer.max_steps=20000        # long enough that the restarted group rejoins the others

What a user runs by hand, in one script: the Lighthouse (``torchft_lighthouse``, installed with torchft), then one
torchrun job per replica group (``--groups``, each ``--nproc-per-node`` ranks), each with its own
``--master-port``, ``REPLICA_GROUP_ID``, ``TORCHFT_LIGHTHOUSE`` and the run's ``LIGHTNING_DIST_FT_SECRET``
(``--secret``, a new one by default), running ``lightning-dist fit --config CONFIG``
(``examples/fault_tolerant/diloco.yaml`` by default: DiLoCo on MNIST-1D with ``fault_tolerance`` set). With
``--kill-group G`` the job of group G is SIGKILLed with its processes ``--kill-after`` seconds after every group has
logged its first window; with ``--restart`` it is started again at once and rejoins with the others' live state.

Prints, and writes to ``--json``, each job's exit code and, from the logs, every group's quorums, its windows
(committed or discarded) and the times in seconds from the start at which each happened.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # benchmarks.common.process
from benchmarks.common.process import kill_tree  # noqa: E402  (torchrun's workers live in sessions of their own)
from lightning_dist.comm.peer_state import SECRET_ENV  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parent / "diloco.yaml"
QUORUM = re.compile(r"lightning_dist: quorum (\S+): (\d+) replica group\(s\), (\d+) contributing")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"the Lighthouse did not listen on port {port} within {timeout} s")


def lighthouse(port: int, log: Path) -> subprocess.Popen:
    """torchft's Lighthouse: a quorum needs 1 group; a group whose heartbeat stops for 2 s is left out."""
    binary = Path(sys.executable).parent / "torchft_lighthouse"
    return subprocess.Popen([str(binary), "--bind", f"[::]:{port}", "--min_replicas", "1",
                             "--join_timeout_ms", "10000", "--heartbeat_timeout_ms", "2000"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)


def group_job(group: int, args: argparse.Namespace, lighthouse_port: int, tag: str) -> subprocess.Popen:
    """One replica group: its own torchrun job (its own store), in its own process group (killed together)."""
    workdir = Path(args.workdir)
    env = {**os.environ, "REPLICA_GROUP_ID": str(group), "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{lighthouse_port}",
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", SECRET_ENV: args.secret}
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc_per_node}", "--nnodes=1",
               "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "lightning_dist.cli", "fit",
               "--config", str(args.config), f"--trainer.default_root_dir={workdir / f'group{group}'}",
               "--trainer.enable_progress_bar=false", *args.overrides]
    log = (workdir / f"group{group}{tag}.log").open("w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)


def windows_in(log: Path) -> list[dict[str, Any]]:
    """The quorums a group's log reports (``lightning_dist: quorum ...``), in order."""
    return [{"quorum": quorum, "groups": int(groups), "contributing": int(contributing)}
            for quorum, groups, contributing in QUORUM.findall(log.read_text(errors="replace"))]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--nproc-per-node", type=int, default=1)
    parser.add_argument("--kill-group", type=int, default=None)
    parser.add_argument("--kill-after", type=float, default=10.0,
                        help="seconds after every group's first window")
    parser.add_argument("--restart", action="store_true")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", default=None)
    parser.add_argument("--secret", default=os.environ.get(SECRET_ENV) or secrets.token_hex(16),
                        help=f"the run's shared secret (default: {SECRET_ENV}, else a new one for this run)")
    parser.add_argument("overrides", nargs="*",
                        help="after --: lightning-dist fit arguments for every job, e.g. -- --trainer.max_steps=20000")
    args = parser.parse_args(argv)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    port = free_port()
    house = lighthouse(port, workdir / "lighthouse.log")
    events: list[tuple[float, str]] = []
    try:
        wait_for(port, 30)
        jobs = {group: group_job(group, args, port, "") for group in range(args.groups)}
        restarted = None
        if args.kill_group is not None:
            logs = [workdir / f"group{group}.log" for group in range(args.groups)]
            while not all(log.exists() and windows_in(log) for log in logs):
                if time.monotonic() - began > args.timeout:
                    raise TimeoutError("the groups did not all end a first window")
                time.sleep(0.1)
            events.append((time.monotonic() - began, "every group ended its first window"))
            time.sleep(args.kill_after)
            kill_tree(jobs[args.kill_group].pid)
            events.append((time.monotonic() - began, f"group {args.kill_group} SIGKILLed"))
            jobs[args.kill_group].wait()
            if args.restart:
                restarted = group_job(args.kill_group, args, port, "_restart")
                events.append((time.monotonic() - began, f"group {args.kill_group} started again"))
        codes = {str(group): job.wait(timeout=args.timeout) for group, job in jobs.items()}
        if restarted is not None:
            codes[f"{args.kill_group}_restart"] = restarted.wait(timeout=args.timeout)
        events.append((time.monotonic() - began, "every job exited"))
    finally:
        house.kill()
    record = {"exit_codes": codes, "events": events,
              "quorums": {log.stem: windows_in(log) for log in sorted(workdir.glob("group*.log"))}}
    print(json.dumps(record, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main()
