"""The learners' exchange across replica groups that come and go: torchft's quorum behind a counted all-reduce.

Under ``fault_tolerance`` (:mod:`lightning_dist.strategies._fault_tolerance`) every replica group (a node, or a
single rank) is its own torchrun job, and the protocol runs between groups over torchft's ``Manager``
(torchft 0.2.0, ``torchft.manager``): at the end of every synchronization window the healthy groups form a quorum
through torchft's Lighthouse, local rank ``j`` of every group all-reduces its chunk of the model over torchft's
reconfigurable Gloo group (torchft's ``group_rank`` is the local rank, as this package's slice groups), and
``should_commit`` says whether the window's exchange completed everywhere in the group. A group that dies inside
a window drops out of the next quorum (its heartbeat stops); one that dies inside the exchange makes it fail, and
every group that saw the failure discards the window. A group that is behind (new, restarted, or one whose last
commit failed) receives the small part of an up-to-date peer's state inside the quorum (torchft's checkpoint
transport) and the rest from the same peer outside the window, nothing read from disk.

:class:`QuorumCommunicator` is what the averaging code sees as the learners' communicator (``rank``, ``world_size``,
``level``, ``all_reduce_sum_``, ``exchange``, ``stats``), with the quorum's calls beside it. Its ``rank`` and
``world_size`` are torchft's participating rank and count; ``contributors``
(:meth:`QuorumCommunicator.count_contributors`) is how many of them the window's mean is of: a group that was healed in
this quorum or the one before takes part in the exchange with a zero contribution (its window trained from a model the
others have left) and is not counted in the mean.

torchft's ``Manager.allreduce`` does not raise: after a failure it logs, marks the step errored and turns the
rest of the window's all-reduces into no-ops whose tensors hold garbage. :meth:`QuorumCommunicator.exchange` (the
point-to-point transfers of compressed synchronizations, on torchft's group as its quantized all-reduce runs its
all-to-all) follows the same rule. The averaging code therefore writes its results where a rollback can undo
them, and :meth:`QuorumCommunicator.commit` decides.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

from lightning_dist.comm.communicator import HOST, receive_buffer, to_wire
from lightning_dist.comm.stats import CommStats

log = logging.getLogger(__name__)


def lighthouse_endpoint(url: str, source: str) -> tuple[str, int]:
    """The Lighthouse's ``(host, port)`` from ``http://host:port`` (an IPv6 host in brackets), or a ValueError
    naming ``source`` (where the address came from) and what is wrong: torchft's client takes nothing else."""
    expected = "http://host:port (an IPv6 host in brackets: http://[::1]:29510)"
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as error:
        raise ValueError(f"{source} must be {expected}; got {url!r} ({error})") from None
    if parts.scheme != "http" or not parts.hostname or port is None:
        raise ValueError(f"{source} must be {expected} with its port; got {url!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"{source} must be {expected}, nothing after the port; got {url!r}")
    return parts.hostname, port


def resolve(host: str, port: int, what: str) -> list[tuple[Any, ...]]:
    """``socket.getaddrinfo`` for a TCP connection to ``host:port``, or a ValueError naming ``what`` and why."""
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise ValueError(f"cannot resolve {what} ({host}:{port}): {error.strerror}") from None


def reaching_address(url: str) -> str:
    """This host's address on the route to ``url``'s host (``http://host:port``, IPv4 or IPv6): where the other
    groups reach it (``socket.gethostname()``, torchft's default, can name a host only this machine resolves)."""
    host, port = lighthouse_endpoint(url, "the Lighthouse's address")
    family, _, _, _, address = resolve(host, port, f"the Lighthouse's host {host!r}")[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)  # UDP: nothing is sent
        return probe.getsockname()[0]


def wait_for_lighthouse(url: str, timeout: timedelta) -> None:
    """Return once the Lighthouse at ``url`` accepts a TCP connection; a ConnectionError naming it after
    ``timeout`` (a job started just before its Lighthouse waits for it; one whose Lighthouse is not there fails
    here, before training, instead of inside torchft's first quorum)."""
    host, port = lighthouse_endpoint(url, "the Lighthouse's address")
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(5.0, timeout.total_seconds())):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise ConnectionError(
                    f"fault_tolerance: no torchft Lighthouse answers at {url} after {timeout.total_seconds():g} s "
                    f"({error}); start it first (torchft_lighthouse --min_replicas 1 ...) or fix "
                    f"TorchFT(lighthouse=...) / TORCHFT_LIGHTHOUSE") from None
        time.sleep(0.2)


def run_replica_prefix(run_tag: int) -> str:
    """What every torchft replica id of a run's groups starts with (a group's is this and its number; torchft adds
    ``:`` and a UUID per process)."""
    return f"lightning_dist_{run_tag:010x}_"


ENDED = "ended_at_step_"
"""After :func:`run_replica_prefix`, the mark a run's groups leave at the Lighthouse when their ``fit`` ends."""

HEARTBEAT = re.compile(r'<li class="heartbeat\s*(old)?\s*">\s*([^:\s<]+)(?::\S*)?: seen')
"""One heartbeat on torchft 0.2.0's Lighthouse status page: ``old`` once past the Lighthouse's heartbeat timeout."""


def mark_ended(url: str, run_tag: int, step: int, timeout: timedelta) -> None:
    """Leave at the Lighthouse at ``url`` the mark that run ``run_tag`` ended at optimizer step ``step``: a heartbeat
    under a replica id no group has (the Lighthouse keeps every id it has heard, fresh or old)."""
    from torchft.coordination import LighthouseClient

    LighthouseClient(url, connect_timeout=timeout).heartbeat(f"{run_replica_prefix(run_tag)}{ENDED}{step}")


@dataclass(frozen=True)
class RunAtLighthouse:
    """What the Lighthouse's status page says of one run: the step its groups said it ended at (None: no mark), and
    the groups of it that heartbeat now."""

    ended_at_step: int | None
    live_groups: frozenset[int]


def run_at_lighthouse(url: str, run_tag: int, timeout_s: float) -> RunAtLighthouse | None:
    """Read run ``run_tag``'s marks and live groups from the status page of the Lighthouse at ``url`` (torchft
    0.2.0's: it has no other way to list heartbeats); None if the page cannot be read."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/status", timeout=timeout_s) as response:
            page = response.read().decode("utf-8", "replace")
    except OSError as error:
        log.warning("lightning_dist: cannot read the Lighthouse's status at %s/status: %s", url, error)
        return None
    prefix = run_replica_prefix(run_tag)
    ended, live = None, set()
    for old, replica in HEARTBEAT.findall(page):
        if not replica.startswith(prefix):
            continue
        name = replica[len(prefix):]
        if name.startswith(ENDED) and name[len(ENDED):].isdigit():
            ended = max(ended or 0, int(name[len(ENDED):]))
        elif name.isdigit() and not old:
            live.add(int(name))
    return RunAtLighthouse(ended, frozenset(live))


def check_bind_address(address: str) -> str:
    """``address`` if it is an IP address of this host (a server can bind to it), else a ValueError naming
    ``bind_address``."""
    try:
        ipaddress.ip_address(address)
    except ValueError:
        raise ValueError(f"bind_address must be an IP address of this host (e.g. 10.0.0.5 or fd00::5); "
                         f"got {address!r}") from None
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError as error:
            raise ValueError(f"bind_address {address!r} is not an address of this host: {error.strerror}") from None
    return address


@dataclass(frozen=True)
class Membership:
    """One window's quorum as this group saw it: torchft's quorum id, the groups in it, how many contribute."""

    quorum_id: int
    groups: int
    contributors: int


class QuorumCommunicator:
    """The learners' communicator over torchft's ``Manager`` for one rank of a replica group (see the module).

    Args:
        make_manager: makes the rank's torchft ``Manager`` (:func:`torchft_manager`) given ``on_receive``, called
            as torchft starts to fetch a peer's state for this rank (``use_async_quorum=False``: a healed group's
            state is applied before the window's all-reduces, by the state-dict functions registered on it).
        counted_by: the strategy's communicator, whose counters these bytes go into (level ``inter_node``).
        timeout: named in failures.
        group: this rank's replica group, of ``groups``.
        run_tag: this run's tag, an integer below ``2**40`` the same in every group of the run and unlikely in
            another (from the run's secret): groups of two runs that share a Lighthouse meet in one quorum, and
            the tag tells them apart.
    """

    level = "inter_node"

    def __init__(self, make_manager: Callable[..., Any], counted_by: Any, timeout: timedelta, group: int,
                 groups: int, run_tag: int) -> None:
        self.manager = make_manager(on_receive=self.receiving)
        self._counted_by = counted_by
        self.timeout = timeout
        self.group, self.groups = group, groups
        self.run_tag = run_tag
        self.rank = 0
        self.world_size = 1
        self.contributors = 0
        self.contributing: dict[int, int] = {}  # group -> its rank here, for the groups that contribute
        self.voted = False
        self.membership: Membership | None = None
        self.healed = False
        self.behind = False
        self.on_membership: Callable[[Membership | None, Membership], None] | None = None

    @property
    def stats(self) -> CommStats:
        return self._counted_by.stats

    @property
    def transport(self) -> Any:
        """This rank's :class:`~lightning_dist.comm.peer_state.AuthenticatedStateTransport` (its torchft Manager's
        checkpoint transport): where it publishes its committed state and fetches a peer's."""
        return self.manager._checkpoint_transport

    def begin_window(self) -> None:
        """Form this window's quorum (blocking; torchft heals this group here if it is behind)."""
        self.healed = self.behind = False
        self.manager.start_quorum()

    def receiving(self) -> None:
        """Mark this window's quorum as one that heals this rank (``behind``), whether or not the state then
        arrives: torchft calls it from its quorum thread before the transfer, which :meth:`begin_window` waits
        for. A transfer that fails leaves ``healed`` false and torchft's step where it was."""
        self.behind = True

    def fall_behind(self) -> None:
        """Have the next quorum heal this group again (torchft heals a group whose step is below the quorum's): a
        join whose window was discarded left this group at the others' step if its state arrived (a window old by
        then), at its own if not."""
        self.manager.load_state_dict({"step": 0, "batches_committed": self.manager.batches_committed()})

    def committed_before(self) -> bool:
        """Whether a window of this run has been committed: torchft's step, the same on every group of the quorum
        once it has formed (a group that is behind was healed to it)."""
        return self.manager.current_step() > 0

    def count_contributors(self, contributes: bool, device: torch.device, vote: bool = False) -> int:
        """How many groups contribute to this window; sets ``rank``, ``world_size``, ``contributors``,
        ``contributing`` and ``voted``. One all-reduce of which groups are present, for those that contribute their
        rank here, and how many contributing groups ``vote`` (``voted``: whether any did; this group's own vote if the
        all-reduce failed). A decision that steers the exchange is taken from ``voted``: a group that was healed in
        this quorum cannot know which window the others are ending.

        A group contributes unless it was healed in this quorum or the last. 0 when the exchange failed (nothing to
        average) or when a group is in the quorum twice: two processes run as one replica group (typically a worker left
        training after its torchrun agent was killed: torchrun starts workers in sessions of their own, so killing the
        agent's process group spares them), and both copies' data would weigh twice in the mean. Each copy then raises,
        naming its group; the other groups discard the window and go on without it.

        The same all-reduce checks two things every group must hold first, and raises naming them: that torchft's
        all-reduce sums (the groups' presence flags add up to the quorum's size), and that every group in the
        quorum is of this run (the run tags add up to the quorum's size times this run's).
        """
        self.rank = self.manager.participating_rank() or 0
        participants = self.manager.num_participants()
        self.world_size = max(participants, 1)
        groups = self.groups
        flags = torch.zeros(2 * groups + 2, dtype=torch.float64, device=device)
        flags[self.group] = 1.0
        flags[groups + self.group] = self.rank + 1.0 if contributes else 0.0
        flags[2 * groups] = float(contributes and vote)
        flags[2 * groups + 1] = float(self.run_tag)
        total = self.all_reduce_sum_(flags, "protocol")
        failed = self.manager.errored() is not None
        if not failed:
            self._check_quorum(float(total[:groups].sum()), float(total[2 * groups + 1]), participants)
        self.voted = vote if failed else float(total[2 * groups]) > 0.5
        twice = [] if failed else [group for group in range(groups) if float(total[group]) > 1.5]
        if self.group in twice:
            raise RuntimeError(
                f"replica group {self.group} joined this quorum {int(round(float(total[self.group])))} times: two "
                f"processes run as replica group {self.group} (a worker whose torchrun agent was killed may still be "
                f"training). Stop every copy of group {self.group} and start it once.")
        ranks = {group: int(round(float(total[groups + group]))) - 1 for group in range(groups)}
        self.contributing = {} if failed or twice else {group: rank for group, rank in ranks.items() if rank >= 0}
        contributors = self.contributors = len(self.contributing)
        membership = Membership(self.manager._quorum_id, self.manager.num_participants(), contributors)
        if self.on_membership is not None and membership != self.membership:
            self.on_membership(self.membership, membership)
        self.membership = membership
        return contributors

    def _check_quorum(self, present: float, tags: float, participants: int) -> None:
        """Raise unless the quorum's ``participants`` groups summed their presence flags to ``present ==
        participants`` and their run tags to ``tags == participants * run_tag`` (exact: integers below 2**53)."""
        if round(present) != participants:
            raise RuntimeError(
                f"torchft's all-reduce of {participants} replica groups' presence flags gave {present:g}, not their "
                f"sum: this torchft release does not sum (fault_tolerance is built on torchft 0.2.0)")
        if tags != participants * float(self.run_tag):
            raise RuntimeError(
                f"replica group {self.group} met replica groups of another run in its quorum ({participants} groups, "
                f"not all with this run's secret): two runs share one Lighthouse. Give each run its own Lighthouse, "
                f"or the same LIGHTNING_DIST_FT_SECRET to every group of one run")

    def all_reduce_sum_(self, tensor: Tensor, purpose: str) -> Tensor:
        """Sum ``tensor`` over the quorum's groups in place (garbage if the exchange failed: see :meth:`commit`).

        Counted as a ring's share over the quorum's groups, as :meth:`Communicator.record_all_reduce`.
        """
        self.manager.allreduce(tensor, reduce_op=torch.distributed.ReduceOp.SUM).wait()
        groups = max(self.manager.num_participants(), 1)
        total = 2 * (groups - 1) * tensor.numel() * tensor.element_size()
        rank = self.manager.participating_rank() or 0
        share = total // groups + (total % groups if rank == 0 else 0)
        self.stats.record(purpose, share, 2 * (groups - 1), self.level)
        return tensor

    def exchange(self, sends: Sequence[tuple[Tensor, int]], receives: Sequence[tuple[Tensor, int]],
                 purpose: str) -> None:
        """One batch of point-to-point transfers between the quorum's participating ranks (as
        :meth:`Communicator.exchange <lightning_dist.comm.Communicator.exchange>`: between one pair, receives in the
        order of the matching sends), over torchft's group. Staged through the host (torchft's Gloo group);
        counted at the sender. After a failure, here or earlier in the window, a no-op: the receive buffers then
        hold garbage (see :meth:`commit`)."""
        if self.failed():
            return
        group = self.manager._pg  # torchft's reconfigurable group of this quorum (its Manager's own collectives' too)
        tags: dict[tuple[str, int], int] = {}

        def tag(direction: str, peer: int) -> int:  # the k-th message either way between a pair
            tags[direction, peer] = tags.get((direction, peer), -1) + 1
            return tags[direction, peer]

        staged = [(buffer, receive_buffer(buffer, HOST)) for buffer, _ in receives]
        try:
            works = [group.recv([wire], source, tag("in", source)) for (_, wire), (_, source) in zip(staged, receives)]
            works += [group.send([to_wire(tensor, HOST)], destination, tag("out", destination))
                      for tensor, destination in sends]
            for work in works:
                work.wait()
        except Exception as error:  # a member lost inside the exchange: the window fails, as torchft's allreduce
            log.warning("lightning_dist: exchange between replica groups failed: %s", error)
            self.manager.report_error(error)
            return
        for buffer, wire in staged:
            if wire is not buffer:
                buffer.copy_(wire)
        self.stats.record(purpose, sum(tensor.numel() * tensor.element_size() for tensor, _ in sends), len(sends),
                          self.level)

    def failed(self) -> bool:
        """Whether this window's exchange failed on this rank so far (its results are garbage)."""
        return self.manager.errored() is not None

    def commit(self) -> bool:
        """torchft's ``should_commit``: whether every rank of this group completed the window's exchange with
        enough groups (``min_replicas``); the same answer on every rank of the group."""
        return bool(self.manager.should_commit())

    def close(self) -> None:
        """Stop this rank's Manager (and, on the group's rank 0, its server)."""
        self.manager.shutdown(wait=False)


def torchft_manager(*, group_rank: int, group_world_size: int, replica_id: str, lighthouse: str,
                    min_replicas: int, timeout: timedelta, quorum_timeout: timedelta,
                    state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None],
                    on_receive: Callable[[], None], secret: bytes, bind_address: str | None) -> Any:
    """A torchft ``Manager`` for this rank of its replica group: torchft's reconfigurable Gloo group between
    groups, its servers and the group's own store (torchrun's, at ``MASTER_PORT``) advertised at this host's
    address on the route to the Lighthouse, synchronous quorums, and ``state_dict``/``load_state_dict`` as what a
    behind group receives (``on_receive`` called as its transfer starts), sent over
    :class:`~lightning_dist.comm.peer_state.AuthenticatedStateTransport` with the run's ``secret``, served at
    ``bind_address`` (None: the address on the route to the Lighthouse) and nowhere else.

    No ``init_sync``: torchft would then heal every group but one at step 0, and it picks the source per local rank
    (local rank ``j`` from the ``j``-th group), so a group's ranks would start from different groups' models. The
    first window averages the groups' start models instead (equal when every group seeds its model alike)."""
    # torchft is an optional extra (``lightning-dist[torchft]``): imported only when the option is used.
    from torchft import Manager, ProcessGroupGloo

    from lightning_dist.comm.peer_state import AuthenticatedStateTransport

    host = reaching_address(lighthouse)
    return Manager(
        pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict, state_dict=state_dict,
        min_replica_size=min_replicas, use_async_quorum=False, timeout=timeout, quorum_timeout=quorum_timeout,
        connect_timeout=timeout, rank=group_rank, world_size=group_world_size,
        # The quorum hands the first group's store address to every group, which meets there to build torchft's
        # Gloo group: a one-node job's MASTER_ADDR (127.0.0.1) would send each host to itself. The store listens on
        # every interface, so this host's reachable address names it for the group's own ranks as well.
        store_addr=host, store_port=int(os.environ["MASTER_PORT"]),
        lighthouse_addr=lighthouse, replica_id=replica_id, hostname=host, init_sync=False,
        checkpoint_transport=AuthenticatedStateTransport(bind_address or host, secret, timeout, on_receive),
    )
