"""Launch ``benchmarks/_worker.py`` on N local processes with torchrun (Gloo on CPU), one run per launch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
WORKER = BENCHMARKS / "_worker.py"


class RunFailed(RuntimeError):
    """A torchrun launch exited non-zero, timed out, or wrote no result."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(
    spec: dict[str, Any], ranks: int, work_dir: Path, timeout: float, worker: Path = WORKER
) -> dict[str, Any]:
    """Run one spec under torchrun with ``worker``; return its JSON result (with ``launch_s`` added).

    The spec goes to ``work_dir/<name>.spec.json``, the processes' output to ``<name>.log``.
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
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONWARNINGS": "ignore",
    }
    start = time.perf_counter()
    with log_path.open("w") as log:
        try:
            process = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise RunFailed(f"{name}: torchrun did not finish within {timeout:.0f} s; see {log_path}") from exc
    elapsed = time.perf_counter() - start
    if not result_path.exists():
        tail = "\n".join(log_path.read_text().splitlines()[-40:])
        raise RunFailed(f"{name}: torchrun exited {process.returncode}; last lines of {log_path}:\n{tail}")
    result = json.loads(result_path.read_text())
    result["launch_s"] = elapsed
    result["exit_code"] = process.returncode
    if process.returncode != 0:
        # Rank 0 writes the result after fit and the final counters; a failure after that is a
        # teardown problem, reported but not fatal to the measurement.
        print(f"\nwarning: {name}: torchrun exited {process.returncode} after writing its result; see {log_path}",
              file=sys.stderr)
    return result
