"""Process groups that lightning_dist creates, and their orderly destruction.

A Gloo process group still alive when the interpreter finalizes can abort the process at exit
("terminate called without an active exception", pytorch/pytorch#190489): its worker threads
outlive the interpreter. Lightning does not destroy the default group after ``fit``, and the
strategies and callbacks here add groups of their own, so every group is created through
:func:`new_group`, which makes sure all groups are destroyed while the interpreter is still
alive. Nothing can use a process group once the interpreter is exiting, so this never takes
a group away from code that still needs it.
"""

from __future__ import annotations

import atexit
import os
import warnings
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout
from torch.distributed.distributed_c10d import _world

_destroy_registered = False


def new_group(backend: str | None = None, timeout: timedelta | None = None) -> dist.ProcessGroup:
    """``dist.new_group()`` over every rank (a collective), destroyed at exit at the latest.

    ``timeout`` bounds every operation on the group. torch does not take it from the default
    group: None means the backend's default (30 min for Gloo, 10 min for NCCL), so callers pass
    the strategy's (:func:`strategy_timeout`).
    """
    global _destroy_registered
    if not _destroy_registered:
        atexit.register(_destroy_all_groups)
        _destroy_registered = True
    return dist.new_group(backend=backend, timeout=timeout)


def destroy_group(group: dist.ProcessGroup | None) -> None:
    """Destroy ``group`` if it still exists (not a collective).

    Destroying the default group destroys every other group too, so a group may be gone
    already; that is not an error.
    """
    if group is not None and dist.is_initialized() and group in _world.pg_map:
        dist.destroy_process_group(group)


def _destroy_all_groups() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def check_timeout(timeout: timedelta | None) -> timedelta | None:
    """``timeout`` if it is None or a positive ``timedelta``; a ValueError naming the parameter otherwise."""
    if timeout is not None and (not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0):
        raise ValueError(f"timeout must be None or a positive datetime.timedelta; got {timeout!r}")
    return timeout


def strategy_timeout(strategy: object) -> timedelta | None:
    """The ``timeout`` a Lightning strategy was built with (its collectives' bound), None if it has none.

    Lightning's DDP-family strategies keep it as ``_timeout`` and pass it to
    ``init_process_group``; the groups this package adds use the same bound, so a rank that
    stops answering fails the others within the user's timeout, not torch's default.
    """
    return getattr(strategy, "_timeout", None)


def restart_scoped_store(timeout: timedelta | None) -> dist.Store | None:
    """Under torchrun, a view of its agent's key-value store private to this restart round.

    torchrun's elastic agent hosts one store for the whole job, and ``init_process_group``'s
    ``env://`` rendezvous writes each rank's address under the same keys in every round. After
    a restart (``--max-restarts``), a rank that comes up before its peers reads the address a dead
    process published in the previous round and gives up ("Gloo connectFullMesh failed ...
    Connection refused"; seen here with torch 2.13 on one of two ranks that started 3 s apart).
    Prefixing the keys with ``TORCHELASTIC_RESTART_COUNT`` makes every round start from empty
    keys. ``None`` outside torchrun, or when torchrun's agent does not host the store.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    warn_if_restart_counts_diverge()
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout if timeout is not None else default_pg_timeout)
    return dist.PrefixStore(f"lightning_dist/restart{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


def warn_if_restart_counts_diverge() -> None:
    """Warn where :func:`restart_scoped_store`'s prefix cannot keep rounds apart: several torchrun agents that may
    restart, sharing their rendezvous store with the workers (torch's default under c10d).

    Each agent counts its own restarts: after one node's process fails, its agent's count goes up, while the agents
    restarted with it for the membership change keep theirs, so the ranks of one round use different prefixes and
    some read the previous round's addresses (pytorch/pytorch#135712; seen here as "Gloo connectFullMesh failed ...
    Connection refused" and then a hang, 4 agents in network namespaces, torch 2.13). With
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in torchrun's environment every round gets a fresh store."""
    agents = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if agents > 1 and restarts > 0:
        warnings.warn(
            f"torchrun runs {agents} agents with --max-restarts={restarts} and shares its rendezvous store with the "
            "workers: after one node's process fails, the agents' restart counts differ and the restarted round can "
            "fail to connect or hang (pytorch/pytorch#135712). Start torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment.", stacklevel=2)
