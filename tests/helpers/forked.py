"""Rank processes forked from a server that has imported torch and Lightning once, in the environment torchrun
gives its workers.

A fresh Python process spends about 4.5 s of CPU importing torch and Lightning (Lightning's import pulls in
torch._dynamo, torchmetrics, scipy.signal and matplotlib) before a test's worker does anything, and torchrun's agent
another 2 s; the suite launches hundreds of ranks on two cores. :class:`ForkedJob` starts a job's ranks instead
from a :mod:`multiprocessing` fork server that imported those libraries once: each rank is a new process, in a
session of its own, that gets torchrun's environment variables (``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``,
``WORLD_SIZE``, ``TORCHELASTIC_RUN_ID``, ...), the job's store hosted outside the ranks as torchrun's agent hosts
it (``TORCHELASTIC_USE_AGENT_STORE``), and runs the worker script as ``__main__``. As torchrun's agent with no
restarts, the job fails as soon as one rank fails and its other ranks are stopped.

What only torchrun does (restarts, elastic membership, its agent's own exit) is tested by launching torchrun
(:func:`helpers.launch.run_ranks` with ``torchrun_args``, the examples' tests).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path

import torch.distributed as dist

PRELOAD = ["torch", "torch.distributed", "lightning", "lightning.pytorch", "lightning_dist", "numpy"]
"""What the fork server imports once: what every worker imports first."""

STOP_GRACE_S = 5.0
"""How long the other ranks of a failed job get to exit after SIGTERM before SIGKILL (torchrun's agent waits)."""

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(PRELOAD)


def _rank_main(script: str, argv: Sequence[str], env: Mapping[str, str], cwd: str, log: str) -> None:
    """A rank's process: torchrun's environment, output to ``log``, then ``script`` as ``__main__``."""
    os.setsid()  # its own session, as torchrun starts workers: stopping the job stops what the rank started
    output = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(output)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    import numpy
    import torch
    from lightning.fabric.utilities.rank_zero import _get_rank
    from lightning_utilities.core.rank_zero import rank_zero_only

    numpy.random.seed()  # a fresh process draws numpy's global state from the OS; forked ones would share it
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))  # read by OpenMP when the server loaded it
    rank_zero_only.rank = _get_rank() or 0  # Lightning reads it from the environment at import
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # what a fresh interpreter runs at exit; multiprocessing's child skips it
        sys.stdout.flush()
        sys.stderr.flush()


class ForkedJob:
    """One torchrun job of ``nprocs`` ranks of ``script`` (node ``node_rank`` of ``nodes``, every node's ranks
    meeting at ``master_addr:master_port``), its ranks forked from the server; the output of every rank appended to
    ``log``. The first node's job hosts the store in this process (``master_port`` None: a free one); a later
    node's is given the first node's port.

    A thread watches the ranks as torchrun's agent does: once one fails, the others get SIGTERM and, after
    :data:`STOP_GRACE_S`, SIGKILL. ``poll``/``wait``/``returncode`` as :class:`subprocess.Popen`'s for the job: 0
    once every rank exited 0, torchrun's 1 once one failed."""

    def __init__(self, script: Path, argv: Sequence[str], env: Mapping[str, str], cwd: Path, log: Path,
                 nprocs: int, nodes: int = 1, node_rank: int = 0, master_addr: str = "127.0.0.1",
                 master_port: int | None = None) -> None:
        self.store = None
        if node_rank == 0:
            self.store = dist.TCPStore(master_addr, master_port or 0, is_master=True, wait_for_workers=False,
                                       timeout=timedelta(seconds=300))
            master_port = self.store.port
        assert master_port is not None, "a later node's job needs the first node's master_port"
        self.master_port = master_port
        self.returncode: int | None = None
        self._failed = False  # a rank failed, or the job was killed
        world = {"GROUP_RANK": str(node_rank), "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(nprocs),
                 "WORLD_SIZE": str(nodes * nprocs), "GROUP_WORLD_SIZE": str(nodes),
                 "ROLE_WORLD_SIZE": str(nodes * nprocs), "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
                 "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none",
                 "TORCHELASTIC_USE_AGENT_STORE": "True"}
        self.ranks = []
        for local_rank in range(nprocs):
            rank = str(node_rank * nprocs + local_rank)
            rank_env = {**env, **world, "RANK": rank, "ROLE_RANK": rank, "LOCAL_RANK": str(local_rank)}
            process = _context.Process(target=_rank_main, args=(str(script), list(argv), rank_env, str(cwd), str(log)),
                                       name=f"rank{rank}")
            process.start()
            self.ranks.append(process)
        self._watcher = threading.Thread(target=self._watch, name="forked-job", daemon=True)
        self._watcher.start()

    def poll(self) -> int | None:
        """The job's exit code once it ended, else None."""
        return None if self._watcher.is_alive() else self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The job's exit code once it ended; :class:`TimeoutError` after ``timeout`` seconds (the job runs on)."""
        self._watcher.join(timeout)
        if self._watcher.is_alive():
            raise TimeoutError(f"the job's ranks ran past {timeout} s")
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        """SIGKILL every rank still running and what it started (a job killed counts as failed); then wait until
        they are gone."""
        if self._watcher.is_alive():
            self._failed = True
            self._signal(signal.SIGKILL)
        self._watcher.join()

    def _watch(self) -> None:
        """The agent's loop, the only reader of the ranks' exit codes: wait for the ranks; when one fails, stop the
        others."""
        running = list(self.ranks)
        while running:
            wait([process.sentinel for process in running])
            running = [process for process in running if process.exitcode is None]
            if any(process.exitcode != 0 for process in self.ranks if process not in running):
                self._failed = True
                self._signal(signal.SIGTERM)
                deadline = time.monotonic() + STOP_GRACE_S
                for process in running:
                    process.join(max(0.0, deadline - time.monotonic()))
                self._signal(signal.SIGKILL)
                for process in running:
                    process.join()
                break
        self.returncode = 1 if self._failed else 0
        self.store = None  # the job's store closes with its last reference

    def _signal(self, sig: int) -> None:
        """``sig`` to the session of every rank (torchrun's workers each lead their own)."""
        for process in self.ranks:
            try:
                os.killpg(process.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
