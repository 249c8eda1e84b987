"""``fault_tolerance=TorchFT(...)``: the option itself, its checks, and what every group of a run derives from its
secret (:mod:`lightning_dist.strategies._fault_tolerance` is what the strategies do with it)."""

from __future__ import annotations

import hashlib
import hmac
import importlib.metadata
import os
from dataclasses import dataclass, field
from datetime import timedelta

from lightning_dist.algorithms.arguments import check_count
from lightning_dist.comm.quorum import check_bind_address, lighthouse_endpoint, resolve

REPLICA_GROUP_ENV = "REPLICA_GROUP_ID"
"""The environment variable that names a job's replica group when ``TorchFT(replica_group=None)`` (torchft's)."""
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""The environment variable with the Lighthouse's address when ``TorchFT(lighthouse=None)`` (torchft's)."""
TORCHFT_VERSION = "0.2.0"
"""The torchft release the option is built on and tested with. It relies on what other releases change: its
``Manager``'s private ``_pg`` and ``_quorum_id``, a step set back to have a group healed, and ``allreduce(SUM)``
summing (some releases divide by the number of groups)."""


def check_torchft_version() -> None:
    """A ValueError unless torchft :data:`TORCHFT_VERSION` is installed, naming what is."""
    try:
        installed = importlib.metadata.version("torchft")
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"fault_tolerance needs torchft: pip install 'lightning-dist[torchft]' "
                         f"(torchft=={TORCHFT_VERSION})") from None
    if installed != TORCHFT_VERSION:
        raise ValueError(f"fault_tolerance is built on torchft {TORCHFT_VERSION} (its Manager's internals and "
                         f"all-reduce semantics differ between releases); installed: torchft {installed}. "
                         f"pip install torchft=={TORCHFT_VERSION}")


@dataclass(frozen=True)
class TorchFT:
    """The ``fault_tolerance`` option: synchronize replica groups through torchft (see the module docstring).

    Args:
        num_replica_groups: how many replica groups the run has (each its own torchrun job): the data is cut into
            this many shards, group ``g`` training on shard ``g`` whether or not the others are alive.
        min_replicas: the fewest groups a window may commit with (torchft's ``min_replica_size``), in
            ``[1, num_replica_groups]``. Default 1: the survivors go on whatever is lost.
        replica_group: this job's group, in ``[0, num_replica_groups)``; None (default): the ``REPLICA_GROUP_ID``
            environment variable (torchft's convention), read when the job sets the strategy up.
        lighthouse: the Lighthouse's address (``http://host:port``); None (default): ``TORCHFT_LIGHTHOUSE``.
        timeout: how long one exchange, commit or recovery may take before it counts as failed; also how long a
            group started again finds its run ended at the Lighthouse, with no other group alive, before it fails.
        quorum_timeout: how long a group waits for a quorum. A restarted group waits there for the others to end
            their window, so this must exceed a window's length. Default 30 minutes.
        max_retries: how many windows in a row a group may discard during training (each rolled back to the last
            committed model) before its job fails, naming the last window's reason; ``>= 0``, default 10. A join at
            set-up is retried until ``quorum_timeout`` instead (it waits for the others' window to end).
        bind_address: the address this group serves its state from, to a group that is behind (one of this host's
            addresses; the server listens there only). None (default): this host's address on the route to the
            Lighthouse.

    Every group of a run needs the same secret, in ``LIGHTNING_DIST_FT_SECRET`` or the file named by
    ``LIGHTNING_DIST_FT_SECRET_FILE`` (:mod:`lightning_dist.comm.peer_state`): a peer's state is sent only to a
    group that proves it holds it, and loaded only if it carries the sender's proof and holds nothing but tensors
    and plain values.
    """

    num_replica_groups: int
    min_replicas: int = 1
    replica_group: int | None = None
    lighthouse: str | None = None
    timeout: timedelta = field(default=timedelta(seconds=60))
    quorum_timeout: timedelta = field(default=timedelta(minutes=30))
    max_retries: int = 10
    bind_address: str | None = None

    def __post_init__(self) -> None:
        check_torchft_version()
        check_count("num_replica_groups", self.num_replica_groups, 1, meaning=" (torchrun jobs synchronized by torchft)")
        check_count("min_replicas", self.min_replicas, 1, self.num_replica_groups,
                    " (the fewest replica groups a window may commit with)")
        if self.replica_group is not None:
            check_count("replica_group", self.replica_group, 0, self.num_replica_groups - 1)
        for name in ("timeout", "quorum_timeout"):
            value = getattr(self, name)
            if not isinstance(value, timedelta) or value.total_seconds() <= 0:
                raise ValueError(f"{name} must be a positive datetime.timedelta; got {value!r}")
        check_count("max_retries", self.max_retries, 0,
                    meaning=" (windows in a row a group may discard before its job fails)")
        if self.lighthouse is not None:
            lighthouse_endpoint(self.lighthouse, "TorchFT(lighthouse=...)")
        if self.bind_address is not None:
            check_bind_address(self.bind_address)

    def group(self) -> int:
        """This job's replica group: ``replica_group``, else ``REPLICA_GROUP_ID``, checked against the range."""
        if self.replica_group is not None:
            return self.replica_group
        value = os.environ.get(REPLICA_GROUP_ENV)
        if value is None or not value.isdigit():
            raise ValueError(
                f"fault_tolerance needs this job's replica group: pass TorchFT(replica_group=...) or set "
                f"{REPLICA_GROUP_ENV} to an integer in [0, {self.num_replica_groups}); got {value!r}"
            )
        return check_count(REPLICA_GROUP_ENV, int(value), 0, self.num_replica_groups - 1)

    def lighthouse_address(self) -> str:
        """``lighthouse``, else ``TORCHFT_LIGHTHOUSE``, checked (:func:`lighthouse_endpoint`)."""
        source = "TorchFT(lighthouse=...)" if self.lighthouse else LIGHTHOUSE_ENV
        address = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not address:
            raise ValueError(f"fault_tolerance needs the Lighthouse's address: pass TorchFT(lighthouse=...) or set "
                             f"{LIGHTHOUSE_ENV} (http://host:port)")
        lighthouse_endpoint(address, source)
        return address

    def check_environment(self) -> None:
        """Before training, every setting a job reads from its environment: its group, the Lighthouse's address
        (resolved), the run's secret; each error names the setting."""
        from lightning_dist.comm.peer_state import run_secret  # torchft's transport: imported with the option only

        self.group()
        host, port = lighthouse_endpoint(self.lighthouse_address(), "the Lighthouse's address")
        resolve(host, port, f"the Lighthouse's host {host!r}")
        run_secret()


def run_tag(secret: bytes) -> int:
    """The run's tag (:class:`~lightning_dist.comm.quorum.QuorumCommunicator`'s ``run_tag``, and part of every
    group's torchft replica id): 40 bits of an HMAC of a fixed message under the run's secret, so every group of a
    run has it and another run's groups almost surely not, and it says nothing of the secret."""
    return int.from_bytes(hmac.new(secret, b"lightning_dist run tag", hashlib.sha256).digest()[:5], "big")
