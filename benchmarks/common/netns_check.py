"""Self-check of ``benchmarks/common/netns.py``: do the caps give the bandwidth they promise?

On a 3-node network it measures TCP throughput (plain sockets) for one link alone, one node
sending to two peers at once, and two nodes sending to one, first with a node cap above the
link cap (40 and 10 Mbit/s: the link caps bind) and then below it (20 and 50: the node cap
binds, on the sending side and on the receiving side). Then it runs a 3-node torchrun job, one
process per namespace, in which rank 0 sends a tensor with Gloo to rank 1, and then to ranks 1
and 2 at once, under the 40/10 caps.

Prints a JSON table of expected vs measured Mbit/s (aggregate over the flows of a case, TCP or
tensor payload; the caps count Ethernet frames, of which TCP payload is 95.6%). Exits 0 when
every case is within 15% of its expectation, 1 otherwise, and 77 (``netns.SKIP_EXIT_CODE``)
with a message when namespaces cannot be built here (not root, no ``ip``/``tc``)::

    python -m benchmarks.common.netns_check               # about 40 s
    python -m benchmarks.common.netns_check --seconds 1   # shorter transfers, coarser numbers

Under torchrun (started by this script) it is also the Gloo worker: ``--gloo-worker OUT NBYTES``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import netns
from benchmarks.common.launch import worker_env
from benchmarks.common.paths import REPO

NODES = 3
TOLERANCE = 0.15
MASTER_PORT = 29500
GLOO_CAPS = (40.0, 10.0)
# Gloo sends of the worker: (name, receiving ranks, expected aggregate Mbit/s under GLOO_CAPS).
GLOO_SENDS = (("gloo: rank 0 sends a tensor to rank 1", (1,), 10.0),
              ("gloo: rank 0 sends a tensor to ranks 1 and 2 at once", (1, 2), 20.0))
TORCHRUN_TIMEOUT_S = 300


@dataclass(frozen=True)
class Case:
    """TCP flows ``pairs`` (src, dst) sent at once under caps ``node_mbit``/``link_mbit``."""

    name: str
    node_mbit: float
    link_mbit: float
    pairs: tuple[tuple[int, int], ...]
    expected_mbit_s: float


CASES = (
    Case("one link alone", 40, 10, ((0, 1),), 10),
    Case("node 0 sends to two peers at once", 40, 10, ((0, 1), (0, 2)), 20),
    Case("two nodes send to node 0 at once", 40, 10, ((1, 0), (2, 0)), 20),
    Case("one link, node cap below link cap", 20, 50, ((0, 1),), 20),
    Case("node 0 sends to two peers, node cap binds", 20, 50, ((0, 1), (0, 2)), 20),
    Case("two nodes send to node 0, its ingress cap binds", 20, 50, ((1, 0), (2, 0)), 20),
)


def row(name: str, caps: tuple[float, float], flows: Sequence[str], expected: float, measured: float,
        per_flow: Sequence[float]) -> dict[str, Any]:
    """One line of the table; ``ok`` when ``measured`` is within ``TOLERANCE`` of ``expected``."""
    ratio = measured / expected
    return {"case": name, "node_mbit": caps[0], "link_mbit": caps[1], "flows": list(flows),
            "expected_mbit_s": expected, "measured_mbit_s": round(measured, 2),
            "per_flow_mbit_s": [round(rate, 2) for rate in per_flow], "ratio": round(ratio, 3),
            "ok": abs(ratio - 1) <= TOLERANCE}


def use_caps(network: netns.Network, node_mbit: float, link_mbit: float) -> None:
    if (network.node_mbit, network.link_mbit) != (node_mbit, link_mbit):
        network.set_caps(node_mbit, link_mbit)


def tcp_case(network: netns.Network, case: Case, seconds: float) -> dict[str, Any]:
    """Measure ``case`` with transfers sized to last about ``seconds`` at the expected rate."""
    use_caps(network, case.node_mbit, case.link_mbit)
    nbytes = round(case.expected_mbit_s / len(case.pairs) * 1e6 / 8 * seconds)
    flows = netns.measure_tcp(network, case.pairs, nbytes)
    return row(case.name, (case.node_mbit, case.link_mbit), [f"{s}->{d}" for s, d in case.pairs],
               case.expected_mbit_s, netns.aggregate_mbit_s(flows), [flow.mbit_s for flow in flows])


def gloo_cases(network: netns.Network, seconds: float) -> list[dict[str, Any]]:
    """Run the 3-node torchrun job (one node per namespace) and turn rank 0's report into rows."""
    use_caps(network, *GLOO_CAPS)
    nbytes = round(GLOO_CAPS[1] * 1e6 / 8 * seconds)
    with tempfile.TemporaryDirectory(prefix="netns_check_") as work:
        out = Path(work) / "gloo.json"
        logs = [Path(work) / f"node{node}.log" for node in range(network.nodes)]
        script = ["-m", "benchmarks.common.netns_check", "--gloo-worker", str(out), str(nbytes)]
        processes = []
        for node, log in enumerate(logs):
            with log.open("w") as handle:
                processes.append(network.run(node, network.torchrun_argv(node, script, MASTER_PORT),
                                             env=worker_env(), cwd=REPO, stdout=handle, stderr=handle))
        deadline = time.monotonic() + TORCHRUN_TIMEOUT_S
        codes = [process.wait(max(deadline - time.monotonic(), 1)) for process in processes]
        if any(codes) or not out.exists():
            tails = "\n".join(f"--- node {node} (exit {code}):\n" + "\n".join(log.read_text().splitlines()[-20:])
                              for node, (code, log) in enumerate(zip(codes, logs)))
            raise RuntimeError(f"the Gloo job failed:\n{tails}")
        report = json.loads(out.read_text())
    return [row(name, GLOO_CAPS, [f"0->{dst}" for dst in dsts], expected, report[name]["mbit_s"],
                report[name]["per_receiver_mbit_s"])
            for name, dsts, expected in GLOO_SENDS]


def gloo_worker(out: Path, nbytes: int) -> None:
    """One rank of the Gloo job: rank 0 sends ``nbytes`` to each receiver of each ``GLOO_SENDS``.

    Receivers time from the barrier before a send to the end of their ``recv``; the rate of a
    send is its bytes over the span from the earliest start to the latest end (one monotonic
    clock for the whole machine). Rank 0 writes the rates to ``out``.
    """
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tensor = torch.ones(nbytes // 4)
    report = {}
    for name, receivers, _ in GLOO_SENDS:
        dist.barrier()
        start = time.monotonic()
        if rank == 0:
            for work in [dist.isend(tensor, dst) for dst in receivers]:
                work.wait()
        elif rank in receivers:
            dist.recv(tensor, src=0)
        spans: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(spans, (start, time.monotonic()) if rank in receivers else None)
        timed = [span for span in spans if span is not None]
        elapsed = max(end for _, end in timed) - min(begin for begin, _ in timed)
        report[name] = {"mbit_s": tensor.nbytes * len(timed) * 8 / elapsed / 1e6,
                        "per_receiver_mbit_s": [tensor.nbytes * 8 / (end - begin) / 1e6 for begin, end in timed]}
    if rank == 0:
        out.write_text(json.dumps(report))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each transfer at the expected rate")
    parser.add_argument("--gloo-worker", nargs=2, metavar=("OUT", "NBYTES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.gloo_worker:
        gloo_worker(Path(args.gloo_worker[0]), int(args.gloo_worker[1]))
        return
    netns.require_network("benchmarks.common.netns_check")
    with netns.Network(nodes=NODES) as network:
        rows = [tcp_case(network, case, args.seconds) for case in CASES] + gloo_cases(network, args.seconds)
    print("[\n" + ",\n".join(json.dumps(r) for r in rows) + "\n]")  # one case per line
    failed = [r["case"] for r in rows if not r["ok"]]
    if failed:
        print(f"netns_check.py: {len(failed)} case(s) off by more than {TOLERANCE:.0%}: {failed}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
