"""A real, slow network on one machine: every node in its own Linux network namespace.

Distributed runs on one machine normally talk over loopback, which moves gigabytes per second, so
algorithms that save bandwidth (paper 002's segmented gossip assumes 100 Mbit/s per node and
10 Mbit/s per link) show no gain in wall-clock time. ``Network`` builds, for ``nodes`` nodes::

    ld-<pid>-0 .. ld-<pid>-<N-1>    one namespace per node, interface eth0 = 10.77.0.<i+1>/24
         |  veth pair  (eth0 in the node <-> n<i> in the hub)
    ld-<pid>-hub                    bridge br0 joining n0 .. n<N-1>: the switch

and shapes it with ``tc`` (htb; ``netem`` is not needed, there is no delay emulation):

- ``node_mbit``: a node sends at most this much in total (htb class 1:1 on its eth0) and receives
  at most this much in total (htb on its switch port n<i>, whose egress is the node's ingress).
- ``link_mbit``: each ordered pair of nodes: traffic from node i to node j (a u32 filter on j's
  address) goes through its own htb class, at most ``link_mbit``, under the node's class 1:1, so
  one link alone gets ``min(link, node)`` and many links together share ``node``.

The host's network namespace is left alone; only named namespaces are created and deleted.
Run a node's processes inside its namespace with ``Network.run`` (``ip netns exec``); for
torchrun, ``Network.torchrun_argv`` gives the command of node ``i`` of an N-node job.

Needs root (CAP_NET_ADMIN) and iproute2's ``ip`` and ``tc``. Scripts call ``require_network()``
first: without them it prints why and exits with ``SKIP_EXIT_CODE`` (77) instead of a traceback.

Also a command-line tool: ``python -m benchmarks.common.netns cleanup`` deletes the namespaces of
networks whose process died (every ``Network`` does this too when it starts); the roles
``_receive`` and ``_send`` are the two ends of ``measure_tcp``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

PREFIX = "ld"
IFNAME = "eth0"
SUBNET = "10.77.0"
MAX_NODES = 254
SKIP_EXIT_CODE = 77
REQUIREMENTS = "root (CAP_NET_ADMIN), iproute2's `ip` and `tc`, and kernel support for veth, bridge and htb"
# Gloo and TensorPipe bind to the address of the interface these name; it is eth0 in every namespace.
SOCKET_ENV = {"GLOO_SOCKET_IFNAME": IFNAME, "TP_SOCKET_IFNAME": IFNAME}
# TCP hands veth "super-packets" of up to 64 KB (GSO) and htb shapes each as one, so rates move in
# 64 KB steps (0.5 Mbit: 5% of a 1 s transfer at 10 Mbit/s) and flows sharing a cap split it
# unevenly (measured: 12.1 and 9.6 Mbit/s into a 20 Mbit/s node; 9.6 and 9.7 with this limit).
# GSO packets of about one frame make htb shape frames.
GSO_MAX_BYTES = 1514
# htb's default quantum (rate in bytes/s over 10) is out of its range at most rates here and tc
# warns; one full-size frame per round shares a parent fairly.
QUANTUM = 1514
# Classids of the link classes: 1:<LINK_CLASS_BASE + peer> in hex, clear of the node class 1:1.
LINK_CLASS_BASE = 0x10
STOP_GRACE_S = 5.0

_NAMESPACE = re.compile(rf"^{PREFIX}-(\d+)-(?:hub|\d+)$")
# Pids with an open Network. Namespaces are named by pid, so a process has one network at a time.
_OPEN_PIDS: set[int] = set()
_HERE = Path(__file__).resolve()


class NetnsError(RuntimeError):
    """A command that builds, shapes or removes the network failed (the message holds its stderr)."""


def _run(argv: Sequence[str], stdin: str | None = None) -> str:
    """Run ``argv``; return its stdout, or raise ``NetnsError`` with the command and its stderr."""
    try:
        return subprocess.run(argv, input=stdin, capture_output=True, text=True, check=True).stdout
    except FileNotFoundError:
        raise NetnsError(f"`{argv[0]}` is not installed; a network of namespaces needs {REQUIREMENTS}") from None
    except subprocess.CalledProcessError as exc:
        commands = f"\ncommands:\n{stdin}" if stdin else ""
        raise NetnsError(f"`{' '.join(argv)}` exited {exc.returncode}: {exc.stderr.strip()}{commands}") from None


def _batch(tool: str, namespace: str, commands: Sequence[str]) -> None:
    """Run ``ip`` or ``tc`` commands (without the tool's name) inside ``namespace``, in one process."""
    if commands:
        _run([tool, "-n", namespace, "-batch", "-"], stdin="\n".join(commands) + "\n")


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale(pid: int) -> bool:
    """Whether the namespaces of ``pid`` belong to no open network (a dead process, or an earlier one
    with this process's pid)."""
    if pid == os.getpid():
        return pid not in _OPEN_PIDS
    return not _process_alive(pid)


def remove_stale_namespaces() -> list[str]:
    """Delete the ``ld-<pid>-*`` namespaces of networks that are no longer open; return their names.

    A network whose process was killed with SIGKILL cannot clean up after itself; its namespaces
    would hold the names (and addresses) of the next run with the same pid.
    """
    stale = [name for name in list_namespaces() if (match := _NAMESPACE.match(name)) and _stale(int(match[1]))]
    for name in stale:
        _run(["ip", "netns", "delete", name])
    return stale


def _bits(mbit: float) -> str:
    return f"{round(mbit * 1e6)}bit"


def _htb_class(device: str, parent: str, classid: str, rate_mbit: float, ceil_mbit: float) -> str:
    return (f"class add dev {device} parent {parent} classid {classid} htb "
            f"rate {_bits(rate_mbit)} ceil {_bits(ceil_mbit)} quantum {QUANTUM}")


def _delete_root(device: str, installed: bool) -> list[str]:
    """The tc command that removes ``device``'s shaping (qdisc, classes, filters), if it has any."""
    return [f"qdisc del dev {device} root"] if installed else []


def _check_cap(name: str, mbit: float | None) -> None:
    if mbit is not None and not mbit > 0:
        raise ValueError(f"{name} must be a positive number of Mbit/s or None (no cap), got {mbit!r}")


def _raise_system_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


class Network:
    """``nodes`` network namespaces joined by a bridge, with per-node and per-link bandwidth caps.

    Use it as a context manager: entering builds the network (after removing stale ones),
    leaving stops the processes started with ``run`` and deletes every namespace, also on an
    exception, Ctrl-C or SIGTERM (turned into ``SystemExit`` while the network exists, when
    entered from the main thread). Caps are in Mbit/s (10^6 bit/s of Ethernet frames; TCP payload
    is 1448 of each 1514 bytes, 95.6%); ``None`` means no cap.
    """

    def __init__(self, nodes: int, node_mbit: float | None = None, link_mbit: float | None = None) -> None:
        if not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"nodes must be between 1 and {MAX_NODES}, got {nodes}")
        _check_cap("node_mbit", node_mbit)
        _check_cap("link_mbit", link_mbit)
        self.nodes = nodes
        self.node_mbit = node_mbit
        self.link_mbit = link_mbit
        tag = f"{PREFIX}-{os.getpid()}"
        self.hub = f"{tag}-hub"
        self.namespaces = [f"{tag}-{node}" for node in range(nodes)]
        self._processes: list[subprocess.Popen] = []
        self._installed: tuple[float | None, float | None] = (None, None)  # caps now in the kernel
        self._previous_sigterm: Any = None

    def address(self, node: int) -> str:
        """IPv4 address of ``node`` (on its eth0)."""
        return f"{SUBNET}.{node + 1}"

    def __enter__(self) -> Network:
        if os.getpid() in _OPEN_PIDS:
            raise NetnsError(f"this process already has an open Network; its namespaces are named {PREFIX}-<pid>-*")
        remove_stale_namespaces()
        _OPEN_PIDS.add(os.getpid())
        self._catch_sigterm()
        try:
            self._build()
            self.set_caps(self.node_mbit, self.link_mbit)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def _catch_sigterm(self) -> None:
        """Make SIGTERM unwind the stack (so ``close`` runs) instead of killing the process outright."""
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, _raise_system_exit)

    def _build(self) -> None:
        for name in [self.hub, *self.namespaces]:
            _run(["ip", "netns", "add", name])
        # addrgenmode none: no IPv6 link-local addresses, so IPv4 is the only address on eth0.
        hub = ["link add br0 type bridge", "link set br0 addrgenmode none", "link set br0 up"]
        for node, namespace in enumerate(self.namespaces):
            port = f"n{node}"
            hub += [f"link add {port} type veth peer name {IFNAME} netns {namespace}",
                    f"link set {port} addrgenmode none", f"link set {port} master br0", f"link set {port} up"]
        _batch("ip", self.hub, hub)
        for node, namespace in enumerate(self.namespaces):
            _batch("ip", namespace, [f"link set {IFNAME} addrgenmode none",
                                     f"link set {IFNAME} gso_max_size {GSO_MAX_BYTES}",
                                     f"addr add {self.address(node)}/24 dev {IFNAME}",
                                     f"link set {IFNAME} up", "link set lo up"])

    def set_caps(self, node_mbit: float | None, link_mbit: float | None) -> None:
        """Replace the bandwidth caps (Mbit/s, ``None`` = no cap) on a running network."""
        _check_cap("node_mbit", node_mbit)
        _check_cap("link_mbit", link_mbit)
        installed_node, installed_link = self._installed
        egress_installed = installed_node is not None or installed_link is not None
        for node, namespace in enumerate(self.namespaces):
            _batch("tc", namespace, _delete_root(IFNAME, egress_installed)
                   + self._egress_commands(node, node_mbit, link_mbit))
            _batch("tc", self.hub, _delete_root(f"n{node}", installed_node is not None)
                   + self._ingress_commands(node, node_mbit))
        self.node_mbit, self.link_mbit = self._installed = node_mbit, link_mbit

    def _egress_commands(self, node: int, node_mbit: float | None, link_mbit: float | None) -> list[str]:
        """tc commands for what ``node`` sends: the node class 1:1 and one class per peer.

        htb lets a class that is within its own ``rate`` send without asking its parent, so the
        link classes' rates must add up to at most the node's rate: each link is guaranteed
        ``min(link, node / peers)`` and may borrow up to ``min(link, node)`` from the node class.
        Unclassified packets (ARP) bypass the shaping (``default 0``).
        """
        if node_mbit is None and link_mbit is None:
            return []
        commands = [f"qdisc add dev {IFNAME} root handle 1: htb default 0"]
        parent = "1:"
        if node_mbit is not None:
            commands.append(_htb_class(IFNAME, "1:", "1:1", node_mbit, node_mbit))
            parent = "1:1"
        if link_mbit is None:  # every IP packet goes through the node class
            return commands + [f"filter add dev {IFNAME} parent 1: protocol ip prio 1 u32 "
                               f"match ip dst 0.0.0.0/0 flowid 1:1"]
        peers = [peer for peer in range(self.nodes) if peer != node]
        for peer in peers:
            classid = f"1:{LINK_CLASS_BASE + peer:x}"
            guaranteed, ceil = link_mbit, link_mbit
            if node_mbit is not None:
                guaranteed, ceil = min(link_mbit, node_mbit / len(peers)), min(link_mbit, node_mbit)
            commands += [_htb_class(IFNAME, parent, classid, guaranteed, ceil),
                         f"filter add dev {IFNAME} parent 1: protocol ip prio 1 u32 "
                         f"match ip dst {self.address(peer)}/32 flowid {classid}"]
        return commands

    def _ingress_commands(self, node: int, node_mbit: float | None) -> list[str]:
        """tc commands for what ``node`` receives: its switch port's egress, one class of ``node_mbit``."""
        if node_mbit is None:
            return []
        port = f"n{node}"
        return [f"qdisc add dev {port} root handle 1: htb default 1",
                _htb_class(port, "1:", "1:1", node_mbit, node_mbit)]

    def run(self, node: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
            **popen_kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``node``'s namespace (``ip netns exec``); return its ``Popen``.

        The environment is ``env`` (default: this process's) plus ``SOCKET_ENV``. The process
        gets its own process group, which ``close`` terminates if it still runs.
        """
        environment = {**(os.environ if env is None else env), **SOCKET_ENV}
        process = subprocess.Popen(["ip", "netns", "exec", self.namespaces[node], *argv], env=environment,
                                   start_new_session=True, **popen_kwargs)
        self._processes.append(process)
        return process

    def torchrun_argv(self, node: int, script_argv: Sequence[str], master_port: int,
                      nproc_per_node: int = 1) -> list[str]:
        """The torchrun command of node ``node`` of a job spanning every node; node 0 hosts the store."""
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.nodes}",
                f"--nproc_per_node={nproc_per_node}", f"--node_rank={node}",
                f"--master_addr={self.address(0)}", f"--master_port={master_port}",
                f"--local_addr={self.address(node)}", *script_argv]

    def close(self) -> None:
        """Stop the processes started with ``run``, delete the namespaces, restore SIGTERM handling."""
        try:
            self._stop_processes()
            ours = {self.hub, *self.namespaces}
            failures = []
            for name in [n for n in list_namespaces() if n in ours]:
                try:
                    _run(["ip", "netns", "delete", name])
                except NetnsError as exc:
                    failures.append(str(exc))
            if failures:
                raise NetnsError("could not delete every namespace:\n" + "\n".join(failures))
        finally:
            _OPEN_PIDS.discard(os.getpid())
            if self._previous_sigterm is not None:
                signal.signal(signal.SIGTERM, self._previous_sigterm)
                self._previous_sigterm = None

    def _stop_processes(self) -> None:
        running = [process for process in self._processes if process.poll() is None]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for process in running:
                try:
                    os.killpg(process.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + STOP_GRACE_S
            for process in running:
                try:
                    process.wait(max(deadline - time.monotonic(), 0.01))
                except subprocess.TimeoutExpired:
                    pass
            running = [process for process in running if process.poll() is None]
        self._processes.clear()


def unavailable_reason() -> str | None:
    """Why a ``Network`` cannot be built here, or ``None`` when it can (a 2-node network is tried)."""
    if os.geteuid() != 0:
        return "this process is not root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(f'`{tool}`' for tool in missing)} not installed (package iproute2)"
    try:
        with Network(nodes=2, node_mbit=1, link_mbit=1):
            pass
    except NetnsError as exc:
        return str(exc)
    return None


def require_network(script: str) -> None:
    """Exit with ``SKIP_EXIT_CODE`` and a message saying what is missing, unless a network can be built."""
    reason = unavailable_reason()
    if reason is not None:
        print(f"{script}: skipped: a network of namespaces needs {REQUIREMENTS}; here {reason}.", file=sys.stderr)
        sys.exit(SKIP_EXIT_CODE)


@dataclass(frozen=True)
class Flow:
    """One TCP transfer as its receiver saw it: ``bytes`` arrived between ``first`` and ``last``.

    ``first`` and ``last`` are ``time.monotonic()`` readings (one clock for every process on the
    machine); ``bytes`` leaves out the first read, which arrived before ``first`` was taken.
    """

    src: int
    dst: int
    bytes: int
    first: float
    last: float

    @property
    def mbit_s(self) -> float:
        return self.bytes * 8 / (self.last - self.first) / 1e6


def aggregate_mbit_s(flows: Sequence[Flow]) -> float:
    """Bytes of all flows over the span from the first flow's start to the last flow's end."""
    return sum(flow.bytes for flow in flows) * 8 / (max(f.last for f in flows) - min(f.first for f in flows)) / 1e6


def _expect_line(process: subprocess.Popen, expected: str, role: str) -> None:
    line = process.stdout.readline().strip()
    if line != expected:
        rest, _ = process.communicate()
        raise NetnsError(f"{role} printed {line!r} instead of {expected!r}; exit {process.returncode}; {rest}")


def measure_tcp(network: Network, pairs: Sequence[tuple[int, int]], nbytes: int, timeout: float = 120,
                first_port: int = 5201) -> list[Flow]:
    """Send ``nbytes`` over TCP for each ``(src, dst)`` pair, all at once; return what each receiver saw.

    Every sender connects first and waits; then all get the go together, so the flows overlap
    from the first byte.
    """
    role = [sys.executable, str(_HERE)]
    receivers = [network.run(dst, [*role, "_receive", str(first_port + k)], stdout=subprocess.PIPE, text=True)
                 for k, (_, dst) in enumerate(pairs)]
    for receiver in receivers:
        _expect_line(receiver, "ready", "receiver")
    senders = [network.run(src, [*role, "_send", network.address(dst), str(first_port + k), str(nbytes)],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for k, (src, dst) in enumerate(pairs)]
    for sender in senders:
        _expect_line(sender, "connected", "sender")
    for sender in senders:
        sender.stdin.write("go\n")
        sender.stdin.flush()
    flows = []
    for (src, dst), sender, receiver in zip(pairs, senders, receivers):
        _, errors = sender.communicate(timeout=timeout)
        if sender.returncode != 0:
            raise NetnsError(f"sender {src}->{dst} exited {sender.returncode}: {errors}")
        seen = json.loads(receiver.communicate(timeout=timeout)[0])
        flows.append(Flow(src=src, dst=dst, **seen))
    return flows


def _receive(port: int) -> None:
    """Accept one connection on ``port``, read it to the end, print bytes and times as JSON."""
    buffer = bytearray(1 << 16)
    total, first, last = 0, 0.0, 0.0
    with socket.create_server(("0.0.0.0", port)) as server:
        print("ready", flush=True)
        connection, _ = server.accept()
        with connection:
            count = connection.recv_into(buffer)
            first = last = time.monotonic()
            while count := connection.recv_into(buffer):
                last = time.monotonic()
                total += count
    print(json.dumps({"bytes": total, "first": first, "last": last}), flush=True)


def _send(host: str, port: int, nbytes: int) -> None:
    """Connect to ``host:port``, wait for a line on stdin, send ``nbytes`` zero bytes, close."""
    chunk = memoryview(bytes(1 << 16))
    with socket.create_connection((host, port), timeout=30) as connection:
        print("connected", flush=True)
        sys.stdin.readline()
        while nbytes > 0:
            connection.sendall(chunk[:min(nbytes, len(chunk))])
            nbytes -= len(chunk)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("cleanup", help="delete the ld-<pid>-* namespaces of processes that are gone")
    receive = commands.add_parser("_receive", help="internal: receiving end of measure_tcp")
    receive.add_argument("port", type=int)
    send = commands.add_parser("_send", help="internal: sending end of measure_tcp")
    send.add_argument("host")
    send.add_argument("port", type=int)
    send.add_argument("nbytes", type=int)
    args = parser.parse_args(argv)
    if args.command == "cleanup":
        print("\n".join(f"deleted {name}" for name in remove_stale_namespaces()) or "nothing stale")
    elif args.command == "_receive":
        _receive(args.port)
    else:
        _send(args.host, args.port, args.nbytes)


if __name__ == "__main__":
    main()
