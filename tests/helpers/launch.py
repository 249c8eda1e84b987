"""Run a worker script on N real processes, as torchrun runs them (Gloo on CPU), and collect per-rank results."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.process import kill_tree
from helpers.forked import ForkedJob

WORKERS = Path(__file__).resolve().parent.parent / "workers"
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop(agent: subprocess.Popen) -> None:
    """Kill a torchrun agent that is still running and its workers (torchrun starts them in sessions of their own,
    so killing the agent alone leaves them training). A finished agent is left alone: its pid may be another's."""
    if agent.poll() is None:
        kill_tree(agent.pid)
        agent.wait()


def worker_env(**extra: str) -> dict[str, str]:
    """The environment a worker runs in: this one, the repository importable, one thread per rank."""
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def write_spec(spec: dict[str, Any], out_dir: Path) -> Path:
    """``spec`` (with ``out``) as ``out_dir/spec.json``, the worker's one argument."""
    out_dir.mkdir(parents=True, exist_ok=True)
    spec_path = out_dir / "spec.json"
    spec_path.write_text(json.dumps({**spec, "out": str(out_dir)}))
    return spec_path


def wait_jobs(jobs: Sequence[ForkedJob], timeout: float) -> list[int]:
    """Every job's exit code; all of them killed if one runs past ``timeout`` seconds or the wait is interrupted."""
    deadline = time.monotonic() + timeout
    try:
        return [job.wait(max(0.0, deadline - time.monotonic())) for job in jobs]
    finally:
        for job in jobs:
            job.kill()


def run_ranks(
    nprocs: int, worker: str, spec: dict[str, Any], out_dir: Path, timeout: float = 240, check: bool = True,
    torchrun_args: Sequence[str] = (),
) -> subprocess.CompletedProcess:
    """Run ``tests/workers/<worker>.py spec.json`` on ``nprocs`` local ranks of one job (:class:`ForkedJob`;
    under torchrun itself with ``torchrun_args``, for what only its agent does). The ranks' output is the result's
    ``stderr``."""
    spec_path = write_spec(spec, out_dir)
    if torchrun_args:
        return run_torchrun(nprocs, spec_path, worker, timeout, check, torchrun_args)
    log = out_dir / f"{worker}_ranks.log"
    log.write_text("")
    job = ForkedJob(WORKERS / f"{worker}.py", [str(spec_path)], worker_env(), out_dir, log, nprocs)
    try:
        code = wait_jobs([job], timeout)[0]
    except TimeoutError as error:
        raise AssertionError(f"{error}\n--- ranks' output\n{log.read_text()[-8000:]}") from None
    result = subprocess.CompletedProcess([worker, str(spec_path)], code, "", log.read_text())
    if check and code != 0:
        raise AssertionError(f"the ranks of {worker} exited {code}\n--- ranks' output\n{result.stderr[-8000:]}")
    return result


def run_torchrun(nprocs: int, spec_path: Path, worker: str, timeout: float, check: bool,
                 torchrun_args: Sequence[str]) -> subprocess.CompletedProcess:
    """:func:`run_ranks` under torchrun's agent."""
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nprocs}", "--nnodes=1",
        "--master_addr=127.0.0.1", f"--master_port={free_port()}", *torchrun_args,
        str(WORKERS / f"{worker}.py"), str(spec_path),
    ]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=worker_env(),
                          cwd=spec_path.parent) as agent:
        try:
            stdout, stderr = agent.communicate(timeout=timeout)
        finally:  # a timeout or an interrupt: the workers too (subprocess.run would kill the agent alone)
            stop(agent)
    result = subprocess.CompletedProcess(command, agent.returncode, stdout, stderr)
    if check and result.returncode != 0:
        raise AssertionError(f"torchrun exited {result.returncode}\n--- stdout\n{result.stdout[-6000:]}\n--- stderr\n{result.stderr[-8000:]}")
    return result


def run_nodes(
    nodes: int, ranks_per_node: int, worker: str, spec: dict[str, Any], out_dir: Path, timeout: float = 240,
    check: bool = True,
) -> None:
    """Run ``nodes`` jobs on this host as if on ``nodes`` machines (torchrun's ``--nnodes``, ``--node-rank``, one
    static rendezvous), each with ``ranks_per_node`` ranks of ``tests/workers/<worker>.py spec.json``; ``check``:
    raise if a job failed."""
    spec_path = write_spec(spec, out_dir)
    logs = [out_dir / f"{worker}_node{node}.log" for node in range(nodes)]
    jobs: list[ForkedJob] = []
    for node, log in enumerate(logs):
        log.write_text("")
        port = jobs[0].master_port if jobs else None
        jobs.append(ForkedJob(WORKERS / f"{worker}.py", [str(spec_path)], worker_env(), out_dir, log, ranks_per_node,
                              nodes=nodes, node_rank=node, master_port=port))
    try:
        codes = wait_jobs(jobs, timeout)
    except TimeoutError as error:
        raise AssertionError(f"{error}\n" + "\n".join(f"--- node {node}\n{log.read_text()[-6000:]}"
                                                       for node, log in enumerate(logs))) from None
    failed = [(node, code) for node, code in enumerate(codes) if code != 0]
    if check and failed:
        raise AssertionError(f"nodes exited {failed}\n" + "\n".join(f"--- node {node}\n{log.read_text()[-6000:]}"
                                                                     for node, log in enumerate(logs)))


def load_results(out_dir: Path, nprocs: int) -> list[dict[str, Any]]:
    return [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(nprocs)]


def run_case_ranks(nprocs: int, worker: str, cases: dict[str, dict[str, Any]], out_dir: Path) -> dict[str, list[Any]]:
    """One launch of a hand-set-case worker (tests/helpers/cases.py) for every case: ``{name: [rank 0's result, ...]}``."""
    run_ranks(nprocs, worker, {"cases": list(cases.values())}, out_dir)
    per_rank = load_results(out_dir, nprocs)
    return {name: [per_rank[rank][index] for rank in range(nprocs)] for index, name in enumerate(cases)}


LIGHTHOUSE_FLAGS = {"min_replicas": 1, "join_timeout_ms": 30000, "heartbeat_timeout_ms": 1000}
FT_SECRET = "the test run's secret, 16+ bytes"
"""Every replica group's ``LIGHTNING_DIST_FT_SECRET`` in :func:`run_replica_groups`."""


def run_replica_groups(
    groups: int, ranks_per_group: int, spec: dict[str, Any], out_dir: Path,
    restart_group: int | Sequence[int] | None = None, timeout: float = 300, network: Any = None,
    duplicate_group: int | None = None, join_timeout_ms: int | None = None,
) -> dict[int, int]:
    """``tests/workers/fault_tolerant.py``: ``groups`` torchrun jobs of ``ranks_per_group`` ranks each, one replica
    group each, joined by a torchft Lighthouse in this process (heartbeats time out after 1 s, so a dead group
    leaves the next quorum quickly; ``join_timeout_ms``: the Lighthouse's, 30 s by default), every job with the
    run's secret (:data:`FT_SECRET`). With ``restart_group`` (one or several), each such group's job is started
    again (``restart``) as soon as it exits; with ``duplicate_group``, a second job of that group starts beside the
    first (``copy``: no barrier, nothing injected). With ``network`` (a ``benchmarks.common.netns.Network`` of
    ``groups`` nodes), group ``g``'s job runs on node ``g`` (its own host: ``MASTER_ADDR`` 127.0.0.1 names only
    itself) and the Lighthouse, the ``torchft_lighthouse`` binary, on node 0. Returns each job's exit code by
    group (the restarted or copied ones' under ``groups``, ``groups + 1``, ... in order)."""
    from torchft.coordination import LighthouseServer

    from lightning_dist.comm.peer_state import SECRET_ENV

    restarted = ([] if restart_group is None else [restart_group] if isinstance(restart_group, int)
                 else list(restart_group))
    flags = {**LIGHTHOUSE_FLAGS, **({} if join_timeout_ms is None else {"join_timeout_ms": join_timeout_ms})}
    lighthouse_port = free_port()
    if network is None:
        lighthouse = LighthouseServer(bind="[::]:0", **flags)
        address, stop_lighthouse = lighthouse.address(), lighthouse.shutdown
    else:
        flags = [f"--{name}={value}" for name, value in flags.items()]
        binary = Path(sys.executable).with_name("torchft_lighthouse")
        process = network.run(0, [str(binary), f"--bind=[::]:{lighthouse_port}", *flags], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
        address, stop_lighthouse = f"http://{network.address(0)}:{lighthouse_port}", process.kill
    out_dir.mkdir(parents=True, exist_ok=True)
    spec_path = out_dir / "spec.json"
    spec_path.write_text(json.dumps({**spec, "groups": groups, "lighthouse": address, "out": str(out_dir),
                                     "restarted": restarted + ([] if duplicate_group is None else [duplicate_group])}))
    env = worker_env(**{SECRET_ENV: FT_SECRET})

    def launch(group: int, *extra: str) -> ForkedJob | subprocess.Popen:
        log = out_dir / f"group{group}{''.join(extra)}.log"
        log.write_text("")
        script, argv = WORKERS / "fault_tolerant.py", [str(spec_path), str(group), *extra]
        if network is None:
            return ForkedJob(script, argv, env, out_dir, log, ranks_per_group)
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks_per_group}",
                   "--nnodes=1", "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script), *argv]
        return network.run(group, command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=out_dir)

    jobs = {group: launch(group) for group in range(groups)}
    if duplicate_group is not None:
        jobs[groups] = launch(duplicate_group, "copy")
    try:
        for index, group in enumerate(restarted):
            jobs[group].wait(timeout=timeout)
            jobs[groups + index] = launch(group, "restart")
        return {group: job.wait(timeout=timeout) for group, job in jobs.items()}
    finally:
        for job in jobs.values():
            job.kill() if isinstance(job, ForkedJob) else stop(job)
        stop_lighthouse()
