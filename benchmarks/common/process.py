"""Stopping a launched job whole: a torchrun agent and every worker under it.

torchrun starts each worker in a session of its own (``torch.distributed.elastic``'s subprocess handler passes
``start_new_session=True``), so SIGKILL to the agent's process group, or to the agent alone, leaves the workers
running: they train on, hold their ports and cores, and can join a restarted job as a second copy of their group.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process under it (children from ``/proc``), parents before their children."""
    tree = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children = task.read_text().split()
        except OSError:  # the task ended while we read
            continue
        for child in children:
            tree += process_tree(int(child))
    return tree


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process under it. The tree is read first and the parents are killed first, so an
    agent cannot start a worker again after its workers are gone."""
    for process in process_tree(pid):
        try:
            os.kill(process, signal.SIGKILL)
        except ProcessLookupError:
            pass
