"""How long a balancing set's synchronization takes on the capped network, against an all-reduce of the same ranks.

Issue 26's target: "A balancing set's synchronization takes no longer than an all-reduce of the
same model among the same ranks (within 10%), measured on the capped network." Dynamic averaging's
balancing set and FedAvg's participants average by ``SubsetAverage`` (strategies/_subset_average.py):
a reduce of per-member chunks and an all-gather of the mean's chunks, each one batch of
point-to-point transfers (``Communicator.exchange``, receives posted first since 77024e8). A member
moves ``2 (|B| - 1) / |B|`` of a model each way, as a bandwidth-optimal (ring) all-reduce among the
members does, so on a network where every node's bandwidth binds the two should take the same time.
This benchmark measures that.

Setting: 4 ranks, one per network namespace of ``benchmarks/common/netns.py`` (one torchrun per node, Gloo
over the namespaces' eth0), every node capped at ``--bandwidths`` (20 and 100 Mbit/s) on what it
sends and on what it receives. The model is a float32 vector of ``--elements`` (1,298,880: the
package's language model, ``configs/lm/*.yaml``), random, a different one per rank. For each
balancing set (``--sets``: {1, 3}, {0, 1, 2} and all four ranks) five designs average the members'
vectors:

- ``subset``: ``average_subset(comm, vector, members, ...)``, FedAvg's averaging;
- ``balancing``: one balancing round of dynamic averaging through ``SubsetAverage``: ``reduce``,
  ``squared_distance`` (an 8-byte all-gather over all ranks) and ``gather``;
- ``allreduce``: ``torch.distributed.all_reduce`` on a process group of exactly the members
  (created once before timing with ``dist.new_group(members)``), then the division: the baseline;
- ``star``: the previous design (replaced by ``SubsetAverage`` in commit 48c2467), written out here
  for reference: the members send their vectors to the lowest member, which sends the mean back.

``--repetitions`` (5) passes over every (set, design) cell, the cells interleaved within a pass so
that a slow spell of the machine hits every design alike, after one untimed pass with a small
vector. Every rank enters a barrier before each timed operation and times it from the barrier's
end to its own end; a cell's time is the slowest member's. Each rank also records the bytes its
``Communicator`` counted for the operation (``subset``, ``balancing`` and ``star``; the plain
all-reduce bypasses it, so the Communicator's convention for a ring, ``2 (m - 1) / m`` of the
tensor, is given instead) and the bytes its network interface sent and received (every byte on
the wire, TCP/IP headers and ACKs included), and checks its result against the exact mean.

The bound from the caps: each member sends and receives ``2 (m - 1) / m`` of the model at the
payload rate of the cap (TCP carries 1448 bytes in every 1514-byte frame) for every design but
the star, whose lowest member receives ``m - 1`` models, then sends ``m - 1``.

Usage::

    python -m benchmarks.balancing_sync.run                 # the measurement (about 10 min on 2 cores)
    python -m benchmarks.balancing_sync.run --quick --out /tmp/balancing   # smoke run: 65,536 elements, 2 passes
    python -m benchmarks.balancing_sync.run --replot        # summary, table and figure from the JSON

Outputs (``--out``, default ``benchmarks/results``): ``balancing_sync.json`` (settings, the command,
every timed operation of every rank, the summary) and ``balancing_sync.png``; each launch's spec,
per-node logs and raw result go to ``runs/balancing_sync_*``. Torchrun starts this same file on
every node (``launch_on_network``); it then runs as the worker. Exits 77 with a message where
network namespaces cannot be built (not root, no ``ip``/``tc``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dist.algorithms.averaging import accumulation_dtype
from lightning_dist.comm import Communicator
from lightning_dist.strategies._subset_average import SubsetAverage, average_subset

from benchmarks.common import netns
from benchmarks.common.launch import RunFailed, launch_on_network
from benchmarks.common.paths import RESULTS
from benchmarks.common.report import command_line, pyplot, replot, save_figure, write_json

PREFIX = "balancing_sync"
RANKS = 4
ELEMENTS = 1_298_880  # TransformerLM(n_layer=4, n_head=4, n_embd=160), configs/lm/*.yaml
QUICK_ELEMENTS = 65_536
WARMUP_ELEMENTS = 4_096
SETS = [[1, 3], [0, 1, 2], [0, 1, 2, 3]]
BANDWIDTHS = [20.0, 100.0]
REPETITIONS = 5
DESIGNS = ["subset", "balancing", "allreduce", "star"]
LABELS = {"subset": "average_subset (reduce + gather)", "balancing": "balancing round (+ distance)",
          "allreduce": "all-reduce on the members' group", "star": "star through the lowest (previous)"}
HEADERS = {"subset": "subset", "balancing": "balancing round", "allreduce": "all-reduce", "star": "star (previous)"}
COMPARED = ["subset", "balancing", "star"]  # each against the all-reduce
TARGET_RATIO = 1.10  # issue 26: within 10% of the members' all-reduce
PURPOSE = "protocol"
SEED = 0
PAYLOAD_SHARE = 1448 / 1514  # TCP payload per Ethernet frame
INTERFACE_STATS = Path("/sys/class/net/eth0/statistics")
MASTER_PORT = 29810


# ---------------------------------------------------------------- the worker (one process per namespace)


def rank_vector(rank: int, elements: int) -> Tensor:
    """Rank ``rank``'s model vector; any rank can rebuild any other's to check a mean."""
    return torch.randn(elements, generator=torch.Generator().manual_seed(SEED + 1 + rank))


def wire_bytes() -> tuple[int, int]:
    """Bytes this namespace's interface has sent and received so far."""
    return int((INTERFACE_STATS / "tx_bytes").read_text()), int((INTERFACE_STATS / "rx_bytes").read_text())


def star_average(comm: Communicator, local: Tensor, members: Sequence[int]) -> Tensor | None:
    """The previous design (``LocalUpdateStrategy.star_average`` before 48c2467), kept here only for reference.

    The other members send their vectors to the lowest member, which sums them in the accumulation
    dtype, divides once and sends the mean back: it receives and then sends ``m - 1`` models.
    """
    coordinator, others = members[0], list(members[1:])
    if comm.rank == coordinator:
        total = local.to(accumulation_dtype(local.dtype), copy=True)
        for vector in comm.receive(local, others):
            total += vector
        mean = (total / len(members)).to(local.dtype)
        comm.send(mean, others, PURPOSE)
        return mean
    if comm.rank in members:
        comm.send(local, [coordinator], PURPOSE)
        return comm.receive(local, [coordinator])[0]
    return None


def average(design: str, comms: dict[str, Communicator], group: Any, local: Tensor, reference: Tensor,
            members: Sequence[int]) -> Tensor | None:
    """The members' mean by ``design`` (None off the set); every rank calls it, members or not."""
    comm = comms[design]
    if design == "subset":
        return average_subset(comm, local, members, PURPOSE)
    if design == "balancing":
        # What dynamic averaging's _resolve does for a set found in one round: the distance decides
        # whether the set is done; its all-gather involves every rank.
        balancing = SubsetAverage(comm, local, PURPOSE)
        balancing.reduce(members, members)
        balancing.squared_distance(reference)
        return balancing.gather()
    if design == "allreduce":
        if comm.rank not in members:
            return None
        total = local.clone()
        dist.all_reduce(total, group=group)
        return total / len(members)
    return star_average(comm, local, members)


def one_pass(comms: dict[str, Communicator], groups: dict[tuple[int, ...], Any], sets: list[list[int]], elements: int,
             repetition: int) -> list[dict[str, Any]]:
    """Every (set, design) cell once with vectors of ``elements``; this rank's record of each."""
    rank = dist.get_rank()
    local, reference = rank_vector(rank, elements), rank_vector(-1, elements)
    records = []
    for members in sets:
        exact = torch.stack([rank_vector(member, elements).double() for member in members]).mean(0)
        for design in DESIGNS:
            counted = comms[design].stats.bytes_sent
            dist.barrier()
            tx, rx = wire_bytes()
            start = time.monotonic()
            mean = average(design, comms, groups[tuple(members)], local, reference, members)
            end = time.monotonic()
            # A send completes once its bytes are in the socket (Gloo sizes the send buffer to the
            # message), so the interface counters are read after every rank has received everything.
            dist.barrier()
            tx_end, rx_end = wire_bytes()
            records.append({
                "repetition": repetition, "members": members, "design": design, "start": start, "end": end,
                "counted_bytes": comms[design].stats.bytes_sent - counted, "wire_tx": tx_end - tx,
                "wire_rx": rx_end - rx,
                "max_error": None if mean is None else float((mean.double() - exact).abs().max()),
            })
    return records


def worker(spec_path: Path) -> int:
    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    # The strategies' own Communicator holds every rank on a group of its own; the members' groups
    # are made once, on every rank (new_group is collective), before anything is timed.
    comm = Communicator(dist.new_group())
    comms = {design: comm for design in DESIGNS}
    groups = {tuple(members): dist.new_group(members) for members in spec["sets"]}
    # An untimed pass: the first use of each group and pair, with a vector too small to matter.
    one_pass(comms, groups, spec["sets"], WARMUP_ELEMENTS, repetition=-1)
    records = [record for repetition in range(spec["repetitions"])
               for record in one_pass(comms, groups, spec["sets"], spec["elements"], repetition)]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    if dist.get_rank() == 0:
        Path(spec["out"]).write_text(json.dumps({"records_per_rank": gathered}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------- the driver


def payload_rate(mbit: float) -> float:
    """Bytes of TCP payload per second through a cap of ``mbit`` Mbit/s of frames."""
    return mbit * 1e6 / 8 * PAYLOAD_SHARE


def bound_s(design: str, members: int, model_bytes: int, mbit: float) -> float:
    """The shortest time the node caps allow (sending and receiving at once at the payload rate)."""
    if design == "star":
        return 2 * (members - 1) * model_bytes / payload_rate(mbit)
    return 2 * (members - 1) / members * model_bytes / payload_rate(mbit)


def ring_bytes(members: int, model_bytes: int) -> int:
    """What ``Communicator`` counts per rank for an all-reduce (the ring's share), had it carried it."""
    return 2 * (members - 1) * model_bytes // members


def summarize(report: dict[str, Any]) -> list[dict[str, Any]]:
    config = report["config"]
    model_bytes = config["elements"] * 4
    rows = []
    for launch in report["launches"]:
        per_rank = launch["records_per_rank"]
        for members in config["sets"]:
            row: dict[str, Any] = {"node_mbit": launch["node_mbit"], "members": members}
            for design in DESIGNS:
                # This cell's records on every rank, one per pass, in the order the passes ran.
                cells = [[record for record in records if record["members"] == members and record["design"] == design]
                         for records in per_rank]
                slowest = [max(cells[m][rep]["end"] - cells[m][rep]["start"] for m in members)
                           for rep in range(len(cells[0]))]
                spans = [max(cells[m][rep]["end"] for m in members) - min(cells[m][rep]["start"] for m in members)
                         for rep in range(len(cells[0]))]
                counted = {m: sorted({record["counted_bytes"] for record in cells[m]}) for m in range(len(cells))}
                row[design] = {
                    "median_s": statistics.median(slowest), "min_s": min(slowest), "max_s": max(slowest),
                    "each_s": slowest, "span_median_s": statistics.median(spans),
                    "bound_s": bound_s(design, len(members), model_bytes, launch["node_mbit"]),
                    "counted_bytes_per_rank": [values[0] if len(values) == 1 else values
                                               for values in counted.values()],
                    "wire_tx_bytes_per_rank": [statistics.median(r["wire_tx"] for r in cell) for cell in cells],
                    "wire_rx_bytes_per_rank": [statistics.median(r["wire_rx"] for r in cell) for cell in cells],
                    "max_error": max(r["max_error"] for m in members for r in cells[m]),
                }
            row["allreduce"]["ring_bytes_per_member"] = ring_bytes(len(members), model_bytes)
            for design in COMPARED:
                row[design]["over_allreduce"] = row[design]["median_s"] / row["allreduce"]["median_s"]
            row["target_met"] = all(row[design]["over_allreduce"] <= TARGET_RATIO for design in ("subset", "balancing"))
            rows.append(row)
    return rows


def set_name(members: Sequence[int]) -> str:
    return "{" + ", ".join(map(str, members)) + "}"


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: median seconds (min-max) per cell and ratios to the all-reduce; then bytes per member."""
    def seconds(entry: dict[str, Any]) -> str:
        return f"{entry['median_s']:.2f} ({entry['min_s']:.2f}-{entry['max_s']:.2f})"

    def megabytes(values: list[float]) -> str:  # one figure when every member has it
        return "/".join(dict.fromkeys(f"{value / 1e6:.3f}" for value in values))

    lines = ["| Mbit/s | set | " + " | ".join(f"{HEADERS[design]} s" for design in DESIGNS)
             + " | bound s (chunked / star) | " + " | ".join(f"{HEADERS[design]} / all-reduce" for design in COMPARED)
             + " |",
             "|" + "---|" * (3 + len(DESIGNS) + len(COMPARED))]
    for row in rows:
        lines.append(f"| {row['node_mbit']:g} | {set_name(row['members'])} | "
                     + " | ".join(seconds(row[design]) for design in DESIGNS)
                     + f" | {row['subset']['bound_s']:.2f} / {row['star']['bound_s']:.2f} | "
                     + " | ".join(f"{row[design]['over_allreduce']:.2f}" for design in COMPARED) + " |")
    lines += ["", "| Mbit/s | set | counted MB sent per member: subset | balancing | all-reduce (ring formula) | star "
              "| wire MB sent / received, busiest member: subset | all-reduce | star |", "|" + "---|" * 9]
    for row in rows:
        members = row["members"]
        counted = {design: [row[design]["counted_bytes_per_rank"][m] for m in members]
                   for design in ("subset", "balancing", "star")}
        wire = {design: " / ".join(f"{max(row[design][key][m] for m in members) / 1e6:.3f}"
                                   for key in ("wire_tx_bytes_per_rank", "wire_rx_bytes_per_rank"))
                for design in ("subset", "allreduce", "star")}
        lines.append(f"| {row['node_mbit']:g} | {set_name(members)} | {megabytes(counted['subset'])} | "
                     f"{megabytes(counted['balancing'])} | {row['allreduce']['ring_bytes_per_member'] / 1e6:.3f} | "
                     f"{megabytes(counted['star'])} | {wire['subset']} | {wire['allreduce']} | {wire['star']} |")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> Path:
    plt = pyplot()

    rows = report["summary"]
    bandwidths = list(dict.fromkeys(row["node_mbit"] for row in rows))
    fig, axes = plt.subplots(1, len(bandwidths), figsize=(6.5 * len(bandwidths), 4.6), squeeze=False)
    width = 0.8 / len(DESIGNS)
    colors = dict(zip(DESIGNS, ["tab:blue", "tab:cyan", "tab:gray", "tab:red"]))
    for axis, mbit in zip(axes.flat, bandwidths):
        group = [row for row in rows if row["node_mbit"] == mbit]
        for index, design in enumerate(DESIGNS):
            xs = [position + (index - (len(DESIGNS) - 1) / 2) * width for position in range(len(group))]
            medians = [row[design]["median_s"] for row in group]
            errors = [[row[design]["median_s"] - row[design]["min_s"] for row in group],
                      [row[design]["max_s"] - row[design]["median_s"] for row in group]]
            axis.bar(xs, medians, width, yerr=errors, capsize=2, color=colors[design], label=LABELS[design])
            axis.scatter(xs, [row[design]["bound_s"] for row in group], marker="_", s=120, color="black",
                         zorder=3, label="bound from the caps" if index == 0 else None)
        for position, row in enumerate(group):
            top = max(row[design]["max_s"] for design in DESIGNS)
            axis.annotate(f"subset / all-reduce {row['subset']['over_allreduce']:.2f}", (position, top),
                          textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
        axis.set_ylim(top=1.12 * max(row[design]["max_s"] for row in group for design in DESIGNS))
        axis.set_xticks(range(len(group)), [set_name(row["members"]) for row in group])
        axis.set_xlabel("balancing set")
        axis.set_ylabel("seconds, slowest member (median, min-max)")
        axis.set_title(f"{mbit:g} Mbit/s per node, {report['config']['elements']:,} float32", fontsize=10)
        axis.grid(True, axis="y", alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("Averaging a set of ranks on the capped network (4 ranks, one namespace each)", fontsize=11)
    save_figure(fig, path, dpi=120)
    return path


def launch_timeout(args: argparse.Namespace, mbit: float) -> float:
    """Twice the caps' bound of every timed operation (Gloo may move a pair's two directions in turn), plus start-up."""
    model_bytes = args.elements * 4
    one_pass_s = sum(bound_s(design, len(members), model_bytes, mbit) for members in args.sets for design in DESIGNS)
    return 2 * args.repetitions * one_pass_s + 240


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK_ELEMENTS:,} elements, 2 passes")
    parser.add_argument("--replot", action="store_true", help="summary, table and figure from the JSON; run nothing")
    parser.add_argument("--bandwidths", type=float, nargs="+", default=BANDWIDTHS, help="node caps, Mbit/s")
    parser.add_argument("--elements", type=int, default=None, help=f"model vector length ({ELEMENTS:,})")
    parser.add_argument("--repetitions", type=int, default=None, help=f"timed passes ({REPETITIONS})")
    parser.add_argument("--sets", type=lambda text: [int(rank) for rank in text.split(",")], nargs="+",
                        default=SETS, help="balancing sets as comma-separated ranks (default: 1,3 0,1,2 0,1,2,3)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.elements = args.elements or (QUICK_ELEMENTS if args.quick else ELEMENTS)
    args.repetitions = args.repetitions or (2 if args.quick else REPETITIONS)
    json_path = args.out / f"{PREFIX}.json"
    if args.replot:
        return replot(json_path, summarize, table, lambda report: [plot(report, args.out / f"{PREFIX}.png")])

    netns.require_network("benchmarks.balancing_sync.run")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    command = command_line(argv)
    report: dict[str, Any] = {"config": {
        "ranks": RANKS, "elements": args.elements, "model_bytes": args.elements * 4, "sets": args.sets,
        "bandwidths": args.bandwidths, "repetitions": args.repetitions, "designs": LABELS,
        "target_ratio": TARGET_RATIO, "command": command, "python": platform.python_version(),
        "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}, "launches": []}
    spec = {"sets": args.sets, "elements": args.elements, "repetitions": args.repetitions}
    with netns.Network(nodes=RANKS, node_mbit=args.bandwidths[0]) as network:
        for index, mbit in enumerate(args.bandwidths):
            network.set_caps(mbit, None)
            name = f"{PREFIX}_{mbit:g}mbit"
            print(f"{name}: {len(args.sets)} sets x {len(DESIGNS)} designs x {args.repetitions} passes ...", flush=True)
            try:
                raw = launch_on_network(network, {**spec, "name": name}, args.out / "runs",
                                        launch_timeout(args, mbit), MASTER_PORT + index, Path(__file__).resolve())
            except RunFailed as exc:
                print(f"FAILED: {exc}", file=sys.stderr)
                return 1
            print(f"  done in {raw['launch_s']:.0f} s", flush=True)
            report["launches"].append({"node_mbit": mbit, "launch_s": raw["launch_s"],
                                       "records_per_rank": raw["records_per_rank"]})
    report["config"]["wall_s"] = time.perf_counter() - started
    report["summary"] = summarize(report)
    write_json(json_path, report)
    print(table(report["summary"]))
    print("wrote", json_path, plot(report, args.out / f"{PREFIX}.png"))
    print(f"total wall time {report['config']['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    # torchrun runs this file on every node (launch_on_network) with the spec as its only argument.
    sys.exit(worker(Path(sys.argv[1])) if "TORCHELASTIC_RUN_ID" in os.environ else main())
