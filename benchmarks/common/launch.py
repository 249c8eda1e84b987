"""Launch benchmark workers under torchrun (Gloo on CPU): N local processes, or one node per namespace of a ``netns.Network``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common.paths import REPO
from benchmarks.common.process import kill_tree


class RunFailed(RuntimeError):
    """A torchrun launch exited non-zero, timed out, or wrote no result."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env() -> dict[str, str]:
    """The environment of a launched worker: the repository importable (``benchmarks.*``, ``lightning_dist``), one
    thread per rank, unbuffered output, no warnings in the logs."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"}


def launch(
    spec: dict[str, Any], ranks: int, work_dir: Path, timeout: float, worker: Path, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run one spec under torchrun with ``worker``; return its JSON result (with ``launch_s`` and ``exit_code``).

    The spec goes to ``work_dir/<name>.spec.json``, the processes' output to ``<name>.log``; ``env`` is added to
    :func:`worker_env`. torchrun and its workers are killed whole on a timeout (:func:`~benchmarks.common.process.kill_tree`).
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    name = spec["name"]
    result_path = work_dir / f"{name}.result.json"
    result_path.unlink(missing_ok=True)
    spec_path = work_dir / f"{name}.spec.json"
    spec_path.write_text(json.dumps({**spec, "out": str(result_path)}, indent=1))
    log_path = work_dir / f"{name}.log"
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--nnodes=1",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(worker), str(spec_path),
    ]
    start = time.perf_counter()
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**worker_env(), **(env or {})},
                                   cwd=REPO, start_new_session=True)
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_tree(process.pid)  # torchrun and its workers (each in a session of its own)
            process.wait()
            code = None
    elapsed = time.perf_counter() - start
    if not result_path.exists():
        tail = "\n".join(log_path.read_text().splitlines()[-40:])
        reason = f"did not finish within {timeout:.0f} s" if code is None else f"torchrun exited {code}"
        raise RunFailed(f"{name}: {reason}; last lines of {log_path}:\n{tail}")
    result = json.loads(result_path.read_text())
    result["launch_s"] = elapsed
    result["exit_code"] = code
    if code != 0:
        # Rank 0 writes the result after fit and the final counters; a failure after that is a
        # teardown problem, reported but not fatal to the measurement.
        print(f"\nwarning: {name}: torchrun exited {code} after writing its result; see {log_path}", file=sys.stderr)
    return result


def launch_on_network(network: Any, spec: dict[str, Any], work_dir: Path, timeout: float, port: int,
                      worker: Path, ranks_per_node: int = 1) -> dict[str, Any]:
    """Run ``spec`` with ``worker``, one torchrun of ``ranks_per_node`` ranks per node of a ``netns.Network`` (the ranks
    of a node share its namespace: they talk inside it uncapped); return rank 0's JSON (plus ``launch_s``).

    The spec gets ``out`` (the result file) and ``work_dir``; each node's output goes to ``<name>.node<i>.log``.
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    name = spec["name"]
    result_path = work_dir / f"{name}.result.json"
    result_path.unlink(missing_ok=True)
    spec_path = work_dir / f"{name}.spec.json"
    spec_path.write_text(json.dumps({**spec, "out": str(result_path), "work_dir": str(work_dir)}, indent=1))
    env = worker_env()
    logs = [work_dir / f"{name}.node{node}.log" for node in range(network.nodes)]
    processes = []
    start = time.perf_counter()
    for node, log in enumerate(logs):
        with log.open("w") as handle:
            argv = network.torchrun_argv(node, [str(worker), str(spec_path)], master_port=port,
                                         nproc_per_node=ranks_per_node)
            processes.append(network.run(node, argv, env=env, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO))
    deadline = start + timeout
    codes: list[int | None] = []
    for process in processes:
        try:
            codes.append(process.wait(max(deadline - time.perf_counter(), 0.1)))
        except subprocess.TimeoutExpired:
            codes.append(None)
    if None in codes:
        for process in processes:
            if process.poll() is None:
                kill_tree(process.pid)  # torchrun and its workers (each in a session of its own)
                process.wait()
    elapsed = time.perf_counter() - start
    if None in codes or not result_path.exists():
        tails = "\n".join(f"--- node {node} (exit {code}), {log}:\n" + "\n".join(log.read_text().splitlines()[-25:])
                          for node, (code, log) in enumerate(zip(codes, logs)))
        reason = f"did not finish within {timeout:.0f} s" if None in codes else "wrote no result"
        raise RunFailed(f"{name}: {reason}\n{tails}")
    if any(codes):
        print(f"\nwarning: {name}: exit codes {codes} after writing its result; see {work_dir}", file=sys.stderr)
    result = json.loads(result_path.read_text())
    result["launch_s"] = elapsed
    return result
