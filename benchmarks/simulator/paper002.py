"""Paper 002 (segmented gossip, "Combo") in the hybrid simulator, and the simulator against the real network.

Part 1, paper 002's scalability study (its section 5): FedAvg (all workers take part, an
aggregation server), plain gossip (``S = 1, R = 2``) and segmented gossip (``S = 10, R = 2``),
``tau = 40`` local steps between synchronisations, on 20, 30 and 40 workers behind 100 Mbit/s per
node and 10 Mbit/s per link; the score is the virtual time until the global model (for gossip the
mean of the workers' models weighted by their part sizes ``|D_j|``, paper 002's eq. 3; for FedAvg,
whose strategy averages plainly, the plain mean) first reaches a target accuracy. The paper
reports segmented gossip 2.25x (20 workers) to 3.01x (40 workers) faster than FedAvg. Paper 002
trains McMahan et al.'s CIFAR-10 CNN (about 10^6 parameters); here every worker trains an MLP
64-1024-1024-10 (1,126,410 parameters, 4.5 MB) on scikit-learn digits, so a model costs as
many bytes as the paper's. Compute is modelled (``SpeedModel``) from the step time of that model
measured on this machine before the runs (best of 10 block medians, recorded in the JSON; the
FedAvg server's mean of N models, and one worker's segment-wise aggregation for plain and
segmented gossip, likewise), so each run is deterministic given those numbers. A
run stops a few evaluations after its global model reached the highest target. A cheap probe
(``period = 1`` and one modelled step worth ``tau`` steps) also gives every protocol's time per
round under full-duplex and half-duplex links, which splits each speedup into
rounds-to-target and seconds-per-round.

Part 2, fidelity: ``benchmarks/segmented_gossip/run.py`` measured segmented gossip (R = 2,
S in {1, 2, 4, 5, 10}) among 11 processes in network namespaces behind htb caps of 20 Mbit/s per
node and 2 Mbit/s per link (payload share 1448/1514 of the cap), an MLP 64-512-512-10 (1.2 MB),
3 rounds, a barrier before each round, a round's time being from the barrier to the last rank's
end. The same setting runs here (11 workers, the same model, seed and therefore the same pull plans
(checked against the recorded plans), caps times the payload share, no latency, a barrier before
each round as in the real run) with full-duplex and with half-duplex links (Gloo moves a
pair's two directions one after the other). Compared per S: the round span (from
``result.waits``), each rank's time in each round (from the barrier to the arrival of its last
sent or received transfer, against the measured ``per_rank_s``), and bytes per round (the
strategy's ``protocol_bytes`` accounting: the segments plus a 1-byte finiteness flag per rank and
peer; the accuracy runs of the same JSON give it measured for 8 ranks, which the simulator also
runs).

Outputs (``--out``, default ``benchmarks/results``): ``sim_paper002.json`` (config with
calibration, every run's rows, the tables' numbers) and ``sim_paper002.png`` (accuracy vs virtual
time per worker count, time to target, the fidelity panels).

Usage::

    python -m benchmarks.simulator.paper002            # the full benchmark (about 10 min on 2 cores)
    python -m benchmarks.simulator.paper002 --quick    # smoke run: 6 and 8 workers, a small model (under a minute)
    python -m benchmarks.simulator.paper002 --replot   # redraw the figure and tables from the JSON; run nothing
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lightning_dist.algorithms.averaging import weighted_average
from lightning_dist.algorithms.segmented_gossip import aggregate, pull_plan, segment_bounds
from lightning_dist.data import DigitsDataModule
from lightning_dist.models import MLPClassifier
from lightning_dist.sim import NetworkModel, PeriodicAveraging, SegmentedGossip, Simulation, SpeedModel
from lightning_dist.sim.replica import Replica
from lightning_dist.sim.report import first_reaching

from benchmarks.common.paths import REPO, RESULTS
PREFIX = "sim_paper002"
REAL_JSON = RESULTS / "segmented_gossip.json"

# ---------------------------------------------------------------- part 1: paper 002's study
WORKERS = [20, 30, 40]
NODE_MBIT = 100.0  # paper 002: per worker
LINK_MBIT = 10.0  # paper 002: between two workers (the WAN bottleneck)
LATENCY = 0.001  # the paper gives none; 1 ms is nothing next to seconds of transfers
PERIOD = 40  # tau
SEGMENTS = 10
REPLICAS = 2
# digits (1257 training images split iid, 540 held out), batch 10, plain SGD at 0.1 as in
# benchmarks/segmented_gossip/run.py; hidden 1024 makes the model 4.5 MB, the size of paper 002's CNN.
HIDDEN = 1024
LEARNING_RATE = 0.1
BATCH_SIZE = 10
VAL_FRACTION = 0.3
SEED = 0
# The global model plateaus near 0.97 (20 workers) and 0.96 (40 workers). Paper 002 scores 80 %
# where its model converges near 82 %; 0.94 is as close to this plateau.
TARGETS = [0.92, 0.94, 0.95]
TARGET = 0.94
MAX_STEPS = 600  # a cap; a run stops EXTRA_EVALS evaluations after reaching max(TARGETS)
EXTRA_EVALS = 2
PAPER_SPEEDUP = {20: 2.25, 40: 3.01}  # paper 002, Fig. 3(b): segmented gossip over FedAvg, time to 80 %
PROBE_ROUNDS = 4

# ---------------------------------------------------------------- part 2: fidelity
FIDELITY_WORKERS = 11
FIDELITY_HIDDEN = 512
FIDELITY_ROUNDS = 3
FIDELITY_STEP_S = 0.001  # one modelled step before each round; the barrier removes it from the span
TOLERANCE = 0.20  # the issue: agreement within 20 %

PROTOCOLS = {
    "fedavg": "FedAvg (C=1, server)",
    "gossip": f"gossip S=1 R={REPLICAS}",
    "segmented": f"segmented gossip S={SEGMENTS} R={REPLICAS}",
}
COLORS = {"fedavg": "tab:green", "gossip": "tab:orange", "segmented": "tab:red"}


def make_protocol(name: str, period: int, segments: int = SEGMENTS) -> Any:
    if name == "fedavg":
        return PeriodicAveraging(period=period, client_fraction=1.0, seed=SEED)
    return SegmentedGossip(segments=1 if name == "gossip" else segments, replicas=REPLICAS, period=period, seed=SEED)


def datamodule() -> DigitsDataModule:
    return DigitsDataModule(batch_size=BATCH_SIZE, val_fraction=VAL_FRACTION, seed=SEED)


def model(hidden: int) -> MLPClassifier:
    torch.manual_seed(SEED)
    return MLPClassifier(num_features=64, num_classes=10, hidden_size=hidden, learning_rate=LEARNING_RATE)


# ---------------------------------------------------------------- calibration


def calibrate(hidden: int, workers: list[int], steps: int = 400, warmup: int = 30, blocks: int = 10) -> dict[str, Any]:
    """Measured wall time of one training step of a worker and of one FedAvg aggregation of ``n``
    models (best of 3) for each worker count.

    The step time is the smallest of the medians of ``blocks`` consecutive blocks of steps (timeit's
    best of several repeats): other processes share the 2 cores, and a block they slowed down
    says nothing about the model. The plain median and percentiles are recorded too.
    """
    data = datamodule()
    data.setup("fit")
    replica = Replica(model(hidden), data.train_loader(workers[0], 0))
    for _ in range(warmup):
        replica.step(replica.next_batch())
    times = []
    for _ in range(steps):
        batch = replica.next_batch()  # loading is not step compute, as in Simulation
        start = time.perf_counter()
        replica.step(batch)
        times.append(time.perf_counter() - start)
    size = steps // blocks
    block_medians = [statistics.median(times[i * size:(i + 1) * size]) for i in range(blocks)]
    times.sort()
    vector = replica.get()
    # One worker's segment-wise aggregation (eq. 3) for plain and segmented gossip: it does not depend
    # on the number of workers, only on S, R and the model.
    merge = {}
    for name, segments in (("gossip", 1), ("segmented", SEGMENTS)):
        bounds = segment_bounds(vector.numel(), segments)
        providers = pull_plan(workers[0], segments, REPLICAS, torch.Generator().manual_seed(SEED))[0]
        mixed, sizes = vector.repeat(REPLICAS, 1), torch.ones(workers[0], dtype=torch.float64)
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            aggregate(vector, mixed, providers, bounds, sizes, 0)
            samples.append(time.perf_counter() - start)
        merge[name] = min(samples)
    aggregate_s = {}
    for n in workers:
        models = [vector.clone() for _ in range(n)]
        samples = []
        for _ in range(3):
            start = time.perf_counter()
            weighted_average(models, [1.0] * n)
            samples.append(time.perf_counter() - start)
        aggregate_s[str(n)] = min(samples)
        del models
    return {"hidden": hidden, "num_parameters": vector.numel(), "model_bytes": vector.nbytes, "steps": steps,
            "step_s": min(block_medians), "block_medians_s": block_medians, "step_median_s": statistics.median(times),
            "step_p10_s": times[len(times) // 10],
            "step_p90_s": times[9 * len(times) // 10], "aggregate_s": aggregate_s,
            "merge_s": merge,
            "load_average": list(_load_average())}


def _load_average() -> tuple[float, ...]:
    try:
        with open("/proc/loadavg") as handle:
            return tuple(float(x) for x in handle.read().split()[:3])
    except OSError:
        return ()


# ---------------------------------------------------------------- part 1


def stop_after(target: float, extra: int) -> Any:
    """A ``stop_when`` that ends a run ``extra`` evaluations after the global model first reached ``target``."""

    def stop_when(rows: list[dict[str, float]]) -> bool:
        reached = [i for i, row in enumerate(rows) if row.get("val_acc", -1.0) >= target]
        return bool(reached) and len(rows) - 1 - reached[0] >= extra

    return stop_when


def aggregate_seconds(calibration: dict[str, Any], name: str, workers: int) -> float:
    """The modelled cost of the protocol's one kind of aggregation: the FedAvg server's mean of
    ``workers`` models, or one worker's segment-wise aggregation for (segmented) gossip."""
    return calibration["aggregate_s"][str(workers)] if name == "fedavg" else calibration["merge_s"][name]


def paper_run(workers: int, name: str, args: argparse.Namespace, calibration: dict[str, Any]) -> dict[str, Any]:
    speed = SpeedModel(step_seconds=calibration["step_s"],
                       aggregate_seconds=aggregate_seconds(calibration, name, workers))
    network = NetworkModel(latency=LATENCY, node_mbit=NODE_MBIT, link_mbit=LINK_MBIT)
    simulation = Simulation(model(args.hidden), datamodule(), make_protocol(name, PERIOD), workers=workers,
                            max_steps=args.max_steps, network=network, speed=speed, eval_every=PERIOD,
                            evaluate_workers=False, seed=SEED, stop_when=stop_after(max(args.targets), EXTRA_EVALS))
    result = simulation.run()
    rows = [{key: row[key] for key in ("time", "mean_steps", "bytes", "val_acc", "val_loss", "train_loss")
             if key in row} for row in result.rows]
    summary = result.summary
    return {"name": name, "label": PROTOCOLS[name], "workers": workers, "rows": rows,
            "model_bytes": summary["model_bytes"], "num_parameters": summary["num_parameters"],
            "protocol": summary["protocol"], "virtual_seconds": summary["virtual_seconds"],
            "bytes": summary["bytes"], "steps": summary["steps"], "wall_seconds": summary["wall_seconds"],
            "evaluation_wall_seconds": summary["evaluation_wall_seconds"],
            "mean_step_wall_seconds": summary["mean_step_wall_seconds"],
            "wait_seconds_per_worker": summary["wait_seconds_per_worker"]}


def probe_round_seconds(workers: int, name: str, hidden: int, step_s: float, aggregate_s: float,
                        half_duplex: bool) -> dict[str, float]:
    """Virtual seconds of the first round and of a steady round (mean of rounds 2..PROBE_ROUNDS).

    ``period = 1`` with one modelled step worth ``tau`` steps: the timing of a ``tau = 40`` round
    (it depends on bytes, plans and compute time, not on the models' values) for a few real steps.
    """
    network = NetworkModel(latency=LATENCY, node_mbit=NODE_MBIT, link_mbit=LINK_MBIT, half_duplex_links=half_duplex)
    protocol = make_protocol(name, 1)
    result = Simulation(model(hidden), datamodule(), protocol, workers=workers,
                        max_steps=PROBE_ROUNDS, network=network,
                        speed=SpeedModel(step_seconds=PERIOD * step_s, aggregate_seconds=aggregate_s),
                        eval_every=10**6, evaluate_workers=False, seed=SEED).run()
    ends = []
    for step in range(1, PROBE_ROUNDS + 1):
        waits = [w for w in result.waits if w["step"] == step]
        ends.append(max(w["start"] + w["seconds"] for w in waits))
    # The caps' bound on round 1 (full duplex, fluid sharing): compute, then the busiest node or link;
    # FedAvg: compute, every model into the server, the aggregation, the mean back out.
    model_bytes, node_rate = result.summary["model_bytes"], NODE_MBIT * 1e6 / 8
    if name == "fedavg":
        transfer_s = 2 * max(workers * model_bytes / node_rate, model_bytes / (LINK_MBIT * 1e6 / 8)) + aggregate_s
    else:
        stats = plan_stats(protocol.plan(1)[0], protocol.bounds, model_bytes // result.summary["num_parameters"])
        transfer_s = max(stats["busiest_node_bytes"] / node_rate, stats["busiest_link_bytes"] / (LINK_MBIT * 1e6 / 8))
        transfer_s += aggregate_s
    return {"first_round_s": ends[0], "steady_round_s": (ends[-1] - ends[0]) / (PROBE_ROUNDS - 1),
            "first_round_bound_s": PERIOD * step_s + transfer_s + LATENCY,
            "bytes_per_round": result.summary["bytes"] / PROBE_ROUNDS}


def summarize_paper(part: dict[str, Any]) -> dict[str, Any]:
    targets, target = part["targets"], part["target"]
    table = {}
    for workers, runs in part["runs"].items():
        entry: dict[str, Any] = {}
        for name, run in runs.items():
            rows = run["rows"]
            reach = {f"{t:g}": first_reaching(rows, "val_acc", t) for t in targets}
            hit = next((row for row in rows if row["val_acc"] >= target), None)
            times = [row["time"] for row in rows]
            entry[name] = {
                "seconds_to": reach,
                "rounds_to": {f"{t:g}": (None if (s := first_reaching(rows, "val_acc", t, axis="mean_steps")) is None
                                         else s / PERIOD) for t in targets},
                "mb_to_target": None if hit is None else hit["bytes"] / 1e6,
                # bytes posted between two evaluations (one round), median over the run
                "mb_per_round": statistics.median(b["bytes"] - a["bytes"] for a, b in itertools.pairwise(rows[1:])) / 1e6
                if len(rows) > 2 else None,
                "round_s": statistics.median(b - a for a, b in itertools.pairwise(times[1:])) if len(times) > 2 else None,
                "best_val_acc": max(row["val_acc"] for row in rows),
                "rounds_run": run["steps"] / int(workers) / PERIOD,
                "wall_seconds": run["wall_seconds"],
            }
        for first, second in (("segmented", "fedavg"), ("gossip", "fedavg"), ("segmented", "gossip")):
            speedups = {}
            for t in targets:
                fast = entry.get(first, {}).get("seconds_to", {}).get(f"{t:g}")
                slow = entry.get(second, {}).get("seconds_to", {}).get(f"{t:g}")
                speedups[f"{t:g}"] = slow / fast if fast and slow else None
            entry[f"speedup_{first}_over_{second}"] = speedups
        table[workers] = entry
    return table


def paper_table(report: dict[str, Any]) -> str:
    part = report["paper"]
    summary, target = part["summary"], part["target"]
    key = f"{target:g}"
    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [f"| workers | protocol | t->{key} (s) | rounds | s/round | MB to target | MB/round | best acc |",
             "|---|---|---|---|---|---|---|---|"]
    for workers, entry in summary.items():
        for name, label in PROTOCOLS.items():
            if name not in entry:
                continue
            row = entry[name]
            lines.append(f"| {workers} | {label} | {fmt(row['seconds_to'][key], '.1f')} | "
                         f"{fmt(row['rounds_to'][key], '.0f')} | {fmt(row['round_s'], '.2f')} | "
                         f"{fmt(row['mb_to_target'], '.0f')} | {fmt(row['mb_per_round'], '.1f')} | {row['best_val_acc']:.3f} |")
    lines.append("")
    lines.append("| workers | " + " | ".join(f"SG/FedAvg @{t:g}" for t in part["targets"]) + " | "
                 + " | ".join(f"gossip/FedAvg @{t:g}" for t in part["targets"]) + f" | SG/gossip @{key} | paper SG/FedAvg |")
    lines.append("|---" * (2 + 2 * len(part["targets"]) + 1) + "|")
    for workers, entry in summary.items():
        sg = entry.get("speedup_segmented_over_fedavg", {})
        go = entry.get("speedup_gossip_over_fedavg", {})
        sgg = entry.get("speedup_segmented_over_gossip", {}).get(key)
        paper = PAPER_SPEEDUP.get(int(workers))
        lines.append(f"| {workers} | " + " | ".join(fmt(sg.get(f"{t:g}"), ".2f") + "x" for t in part["targets"])
                     + " | " + " | ".join(fmt(go.get(f"{t:g}"), ".2f") + "x" for t in part["targets"])
                     + f" | {fmt(sgg, '.2f')}x | {fmt(paper, '.2f') + 'x' if paper else '2.25-3.01x (between)'} |")
    lines.append(f"t->A: virtual seconds until the global model (mean of the workers; |D_j|-weighted for gossip) first has val_acc >= A, "
                 f"evaluated every tau={PERIOD} steps just before each synchronisation; rounds = tau-periods of local "
                 "steps by then; s/round: median virtual seconds between evaluations; speedup X/Y = t_Y / t_X")
    return "\n".join(lines)


def probe_table(report: dict[str, Any]) -> str:
    probe = report["paper"].get("probe")
    if not probe:
        return ""
    lines = [("| workers | protocol | round s full duplex: first, steady | round s half duplex: first, steady | "
              "caps bound, round 1 (s) | first full / bound | MB/round |"), "|---|---|---|---|---|---|---|"]
    for workers, entry in probe.items():
        for name, modes in entry.items():
            full, half = modes["full"], modes["half"]
            lines.append(f"| {workers} | {PROTOCOLS[name]} | {full['first_round_s']:.2f}, {full['steady_round_s']:.2f} | "
                         f"{half['first_round_s']:.2f}, {half['steady_round_s']:.2f} | "
                         f"{full['first_round_bound_s']:.2f} | {full['first_round_s'] / full['first_round_bound_s']:.2f} | "
                         f"{full['bytes_per_round'] / 1e6:.1f} |")
    lines.append("round s: virtual seconds per round including tau steps of modelled compute; first: from the start "
                 "(every worker sends at once); steady: mean of rounds 2..4 (FedAvg's server receives the next round's "
                 "models while it still sends the mean); caps bound: tau steps + the busiest node's or link's bytes at "
                 "its cap (FedAvg: + N models in, the aggregation, N out), what fluid sharing of the caps would give")
    return "\n".join(lines)


def paper_part(args: argparse.Namespace, calibration: dict[str, Any]) -> dict[str, Any]:
    runs: dict[str, dict[str, Any]] = {}
    probe: dict[str, dict[str, Any]] = {}
    for workers in args.workers:
        runs[str(workers)] = {}
        probe[str(workers)] = {}
        for name, label in PROTOCOLS.items():
            print(f"part 1: {workers} workers, {label} ...", end=" ", flush=True)
            run = paper_run(workers, name, args, calibration)
            runs[str(workers)][name] = run
            reach = first_reaching(run["rows"], "val_acc", args.target)
            print(f"t->{args.target:g} = {'-' if reach is None else format(reach, '.1f')} s virtual, "
                  f"{run['virtual_seconds']:.1f} s virtual in all, {run['wall_seconds']:.0f} s wall", flush=True)
            probe[str(workers)][name] = {
                mode: probe_round_seconds(workers, name, args.hidden, calibration["step_s"],
                                          aggregate_seconds(calibration, name, workers), mode == "half")
                for mode in ("full", "half")}
    part = {"targets": args.targets, "target": args.target, "runs": runs, "probe": probe}
    part["summary"] = summarize_paper(part)
    return part


# ---------------------------------------------------------------- part 2: fidelity


class BarrierGossip(SegmentedGossip):
    """Segmented gossip with a barrier before every round, as ``benchmarks/segmented_gossip/worker.py`` times it
    (there, ``dist.barrier()`` and then the strategy's flag all-gather); records every transfer's arrival."""

    def setup(self, simulation: Simulation) -> None:  # type: ignore[override]
        super().setup(simulation)
        self._arrived: dict[int, int] = {}
        self._events: dict[int, Any] = {}
        self.release: dict[int, float] = {}
        self.transfers: list[dict[str, float]] = []
        self._network: Any = None

    def _record_transfers(self, node: Any) -> None:
        network = node.simulator.network
        if self._network is network:
            return
        self._network = network
        post, env = network.post, node.simulator.env

        def recorded_post(source: int, target: int, nbytes: int, deliver: Any) -> Any:
            round_index = len(self.release)
            event = post(source, target, nbytes, deliver)
            event.callbacks.append(lambda _event: self.transfers.append(
                {"round": round_index, "source": source, "target": target, "bytes": nbytes, "arrived": env.now}))
            return event

        network.post = recorded_post

    def after_step(self, node: Any, rank: int, step: int) -> Any:
        if step % self.period == 0:
            self._record_transfers(node)
            event = self._events.setdefault(step, node.simulator.env.event())
            self._arrived[step] = self._arrived.get(step, 0) + 1
            if self._arrived[step] == self.simulation.num_workers:
                self.release[step // self.period] = node.now
                event.succeed()
            yield event
        yield from super().after_step(node, rank, step)


def plan_stats(plan: torch.Tensor, bounds: list[tuple[int, int]], element_size: int) -> dict[str, int]:
    """The plan figures ``_gossip_worker.round_bound`` records, to check that the simulator draws the real plans."""
    from lightning_dist.algorithms.segmented_gossip import transfers

    link_bytes = {pair: sum((bounds[s][1] - bounds[s][0]) * element_size for s in segments)
                  for pair, segments in transfers(plan).items()}
    pair_bytes: dict[frozenset[int], int] = {}
    node_bytes: dict[tuple[str, int], int] = {}
    for (provider, puller), nbytes in link_bytes.items():
        pair_bytes[frozenset((provider, puller))] = pair_bytes.get(frozenset((provider, puller)), 0) + nbytes
        node_bytes[("out", provider)] = node_bytes.get(("out", provider), 0) + nbytes
        node_bytes[("in", puller)] = node_bytes.get(("in", puller), 0) + nbytes
    return {"links_used": len(link_bytes), "busiest_link_bytes": max(link_bytes.values()),
            "busiest_pair_bytes": max(pair_bytes.values()), "busiest_node_bytes": max(node_bytes.values()),
            "two_way_pairs": sum(1 for (i, j) in link_bytes if i < j and (j, i) in link_bytes)}


def fidelity_sim(workers: int, segments: int, rounds: int, share: float, node_mbit: float, link_mbit: float,
                 half_duplex: bool) -> dict[str, Any]:
    protocol = BarrierGossip(segments=segments, replicas=REPLICAS, period=1, seed=SEED)
    network = NetworkModel(latency=0.0, node_mbit=node_mbit * share, link_mbit=link_mbit * share,
                           half_duplex_links=half_duplex)
    result = Simulation(model(FIDELITY_HIDDEN), datamodule(), protocol, workers=workers, max_steps=rounds,
                        network=network, speed=SpeedModel(step_seconds=FIDELITY_STEP_S, aggregate_seconds=0.0),
                        eval_every=10**6, evaluate_workers=False, seed=SEED).run()
    spans, received, finished = [], [], []
    for step in range(1, rounds + 1):
        waits = [w for w in result.waits if w["step"] == step]
        release = max(w["start"] for w in waits)  # the barrier opens when the last worker arrives
        spans.append(max(w["start"] + w["seconds"] for w in waits) - release)
        # A worker's round ends (in the simulator's protocol) when its last pull has arrived ...
        ends = [release] * workers
        for wait in waits:
            ends[wait["worker"]] = wait["start"] + wait["seconds"]
        received.append([end - release for end in ends])
        # ... and all its transfers, sent ones too, have arrived a little later or at the same time.
        for transfer in protocol.transfers:
            if transfer["round"] == step:
                for rank in (transfer["source"], transfer["target"]):
                    ends[rank] = max(ends[rank], transfer["arrived"])
        finished.append([end - release for end in ends])
    element_size = result.summary["model_bytes"] // result.summary["num_parameters"]
    plans = [plan_stats(protocol.plan(r)[0], protocol.bounds, element_size) for r in range(1, rounds + 1)]
    return {"span_s": spans, "per_rank_received_s": received, "per_rank_finished_s": finished, "bytes_per_round": result.summary["bytes"] / rounds,
            "model_bytes": result.summary["model_bytes"], "plans": plans, "lanes": network.lanes}


def fidelity_part(args: argparse.Namespace) -> dict[str, Any]:
    real = json.loads(REAL_JSON.read_text())
    config = real["config"]
    share = config["payload_share"]
    node_mbit, link_mbit = config["node_mbit"], config["link_mbit"]
    out: dict[str, Any] = {"source": str(REAL_JSON.relative_to(REPO)), "node_mbit": node_mbit, "link_mbit": link_mbit,
                           "payload_share": share, "real_date": config.get("date"), "sync": [], "accuracy_bytes": []}
    for run in real["sync"]["runs"]:
        segments, world = run["segments"], run["world_size"]
        print(f"part 2: fidelity, {world} workers, S={segments} ...", flush=True)
        rounds = len(run["rounds"])
        sims = {mode: fidelity_sim(world, segments, rounds, share, node_mbit, link_mbit, mode == "half")
                for mode in ("full", "half")}
        measured_rank = [r["per_rank_s"] for r in run["rounds"]]
        plans_match = all(
            all(plan[key] == measured[key] for key in ("links_used", "busiest_link_bytes", "busiest_pair_bytes",
                                                       "busiest_node_bytes", "two_way_pairs"))
            for plan, measured in zip(sims["half"]["plans"], run["rounds"]))
        out["sync"].append({"segments": segments, "replicas": run["replicas"], "world_size": world,
                            "model_bytes": run["model_bytes"], "measured_span_s": [r["span_s"] for r in run["rounds"]],
                            "measured_per_rank_s": measured_rank, "plans_match": plans_match,
                            # the strategy's protocol_bytes per round: R models pulled per rank + a 1-byte flag per
                            # rank and peer (the all-gather), as the 8-rank accuracy runs measured it
                            "accounted_bytes_per_round": world * run["replicas"] * run["model_bytes"] + world * (world - 1),
                            "sim": sims})
    # Measured protocol bytes of the accuracy part (8 ranks, tau=40): per round, against the simulator.
    for run in real.get("accuracy", {}).get("runs", []):
        if run["kind"] not in ("gossip", "segmented") or not run.get("protocol_bytes"):
            continue
        segments = run["strategy"]["kwargs"]["segments"] if "strategy" in run else (1 if run["kind"] == "gossip" else 10)
        world, rounds = run["world_size"], run["syncs"]
        sim = fidelity_sim(world, segments, 1, share, node_mbit, link_mbit, True)
        out["accuracy_bytes"].append({"name": run["name"], "segments": segments, "world_size": world,
                                      "measured_bytes_per_round": run["protocol_bytes"] / rounds,
                                      "sim_bytes_per_round": sim["bytes_per_round"]})
    out["summary"] = summarize_fidelity(out)
    return out


def summarize_fidelity(part: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for entry in part["sync"]:
        measured = statistics.median(entry["measured_span_s"])
        row: dict[str, Any] = {"segments": entry["segments"], "measured_s": measured,
                               "measured_min_s": min(entry["measured_span_s"]),
                               "measured_max_s": max(entry["measured_span_s"]), "plans_match": entry["plans_match"],
                               "accounted_bytes_per_round": entry["accounted_bytes_per_round"]}
        for mode in ("full", "half"):
            sim = entry["sim"][mode]
            predicted = statistics.median(sim["span_s"])
            row[mode] = {"predicted_s": predicted, "predicted_over_measured": predicted / measured,
                         "within_tolerance": abs(predicted / measured - 1) <= TOLERANCE,
                         "bytes_per_round": sim["bytes_per_round"],
                         "bytes_over_accounted": sim["bytes_per_round"] / entry["accounted_bytes_per_round"]}
            for kind in ("received", "finished"):
                for order in ("by_rank", "sorted"):
                    errors = []
                    for sim_round, real_round in zip(sim[f"per_rank_{kind}_s"], entry["measured_per_rank_s"]):
                        pairs = (zip(sim_round, real_round) if order == "by_rank"
                                 else zip(sorted(sim_round), sorted(real_round)))
                        errors += [abs(p - m) / m for p, m in pairs]
                    row[mode][f"per_rank_{kind}_{order}"] = {
                        "median_error": statistics.median(errors), "max_error": max(errors),
                        "share_within_tolerance": sum(e <= TOLERANCE for e in errors) / len(errors)}
        rows.append(row)
    return rows


def fidelity_table(report: dict[str, Any]) -> str:
    part = report["fidelity"]
    lines = [("| S | measured s/round (min-max) | sim full duplex (sim/meas) | sim half duplex (sim/meas) | "
              "per rank, half, by rank: median err, share <=20% | per rank, half, sorted: median err, max err | "
              "per rank, full, by rank: median err | bytes/round sim (sim/accounted) | plans match |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for row in part["summary"]:
        full, half = row["full"], row["half"]
        by_rank, ranked = half["per_rank_received_by_rank"], half["per_rank_received_sorted"]
        lines.append(
            f"| {row['segments']} | {row['measured_s']:.2f} ({row['measured_min_s']:.2f}-{row['measured_max_s']:.2f}) | "
            f"{full['predicted_s']:.2f} ({full['predicted_over_measured']:.2f}) | "
            f"{half['predicted_s']:.2f} ({half['predicted_over_measured']:.2f}) | "
            f"{100 * by_rank['median_error']:.0f}%, {100 * by_rank['share_within_tolerance']:.0f}% | "
            f"{100 * ranked['median_error']:.0f}%, {100 * ranked['max_error']:.0f}% | "
            f"{100 * full['per_rank_received_by_rank']['median_error']:.0f}% | "
            f"{half['bytes_per_round']:,.0f} ({half['bytes_over_accounted']:.6f}) | {row['plans_match']} |")
    for entry in part["accuracy_bytes"]:
        lines.append(f"bytes per round, {entry['world_size']} ranks, {entry['name']} (S={entry['segments']}): measured "
                     f"{entry['measured_bytes_per_round']:,.0f}, simulator {entry['sim_bytes_per_round']:,.0f} "
                     f"({entry['sim_bytes_per_round'] / entry['measured_bytes_per_round']:.6f})")
    lines.append(f"{part['source']}: 11 ranks, caps {part['node_mbit']:g}/{part['link_mbit']:g} Mbit/s x payload share "
                 f"{part['payload_share']:.4f}; s/round: median over 3 rounds of the span from the barrier to the last "
                 "rank's end; per rank: |sim - measured| / measured of each rank's time in each round (sim: until its last pull "
                 "arrived; sorted: the k-th fastest against the k-th fastest)")
    return "\n".join(lines)


# ---------------------------------------------------------------- figure


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    paper, fidelity = report.get("paper"), report.get("fidelity")
    columns = max(3, len(paper["runs"]) if paper else 0)
    fig, axes = plt.subplots(2, columns, figsize=(5 * columns, 9.5), squeeze=False)
    for axis in axes.flat:
        axis.set_visible(False)
    if paper:
        target = paper["target"]
        for column, (workers, runs) in enumerate(paper["runs"].items()):
            axis = axes[0, column]
            axis.set_visible(True)
            for name, run in runs.items():
                rows = run["rows"]
                axis.plot([max(r["time"], 0.05) for r in rows], [r["val_acc"] for r in rows], marker=".",
                          color=COLORS[name], label=PROTOCOLS[name])
                hit = first_reaching(rows, "val_acc", target)
                if hit is not None:
                    axis.axvline(hit, color=COLORS[name], linestyle=":", linewidth=1)
            axis.axhline(target, color="black", linestyle=":", linewidth=1)
            axis.set_xscale("log")
            axis.set_ylim(min(0.8, target - 0.1), 0.99)
            axis.set(xlabel="virtual seconds (log)", ylabel="global model val_acc",
                     title=f"{workers} workers, {NODE_MBIT:g}/{LINK_MBIT:g} Mbit/s, tau={PERIOD}")
            axis.grid(alpha=0.3, which="both")
            axis.legend(fontsize=8, loc="lower right")
        axis = axes[1, 0]
        axis.set_visible(True)
        key = f"{target:g}"
        summary = paper["summary"]
        counts = list(summary)
        width = 0.27
        for offset, name in enumerate(PROTOCOLS):
            values = [summary[w].get(name, {}).get("seconds_to", {}).get(key) or math.nan for w in counts]
            bars = axis.bar([i + (offset - 1) * width for i in range(len(counts))], values, width, color=COLORS[name],
                            label=PROTOCOLS[name])
            if name == "segmented":
                for bar, w in zip(bars, counts):
                    speedup = summary[w]["speedup_segmented_over_fedavg"].get(key)
                    if speedup:
                        axis.annotate(f"{speedup:.1f}x vs FedAvg", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                      ha="center", va="bottom", fontsize=7)
        axis.set_yscale("log")
        axis.set_ylim(top=axis.get_ylim()[1] * 4)  # room for the legend above the bars
        axis.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        axis.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axis.set_xticks(range(len(counts)), [f"{w} workers" for w in counts])
        axis.set(ylabel=f"virtual seconds to val_acc {key} (log)",
                 title="time to target (paper: SG 2.25x-3.01x faster than FedAvg)")
        axis.grid(alpha=0.3, axis="y", which="both")
        axis.legend(fontsize=8, loc="upper left", ncol=2)
    if fidelity:
        rows = fidelity["summary"]
        s = [row["segments"] for row in rows]
        axis = axes[1, 1]
        axis.set_visible(True)
        axis.errorbar(s, [r["measured_s"] for r in rows],
                      yerr=[[r["measured_s"] - r["measured_min_s"] for r in rows],
                            [r["measured_max_s"] - r["measured_s"] for r in rows]],
                      marker="o", color="black", capsize=3, label="measured (netns + htb, Gloo)")
        axis.plot(s, [r["half"]["predicted_s"] for r in rows], marker="x", color="tab:purple",
                  label="simulator, half-duplex links")
        axis.plot(s, [r["full"]["predicted_s"] for r in rows], marker="+", color="tab:blue", linestyle="--",
                  label="simulator, full-duplex links")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log", base=2)
        axis.set_xticks(s, [str(x) for x in s])
        axis.set(xlabel="segments S", ylabel="seconds per round",
                 title=f"fidelity: 11 ranks, R={REPLICAS}, {fidelity['node_mbit']:g}/{fidelity['link_mbit']:g} Mbit/s")
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=8)
        axis = axes[1, 2]
        axis.set_visible(True)
        cmap = plt.get_cmap("viridis")
        top = 0.0
        for index, entry in enumerate(fidelity["sync"]):
            measured = [m for rnd in entry["measured_per_rank_s"] for m in rnd]
            predicted = [p for rnd in entry["sim"]["half"]["per_rank_received_s"] for p in rnd]
            top = max(top, *measured, *predicted)
            axis.scatter(measured, predicted, s=14, color=cmap(index / max(len(fidelity["sync"]) - 1, 1)),
                         label=f"S={entry['segments']}", alpha=0.8)
        axis.plot([0, top * 1.05], [0, top * 1.05], color="black", linewidth=1)
        axis.plot([0, top * 1.05], [0, top * 1.05 * (1 + TOLERANCE)], color="gray", linewidth=0.8, linestyle=":")
        axis.plot([0, top * 1.05], [0, top * 1.05 * (1 - TOLERANCE)], color="gray", linewidth=0.8, linestyle=":")
        axis.set(xlabel="measured seconds (each rank, each round)", ylabel="simulated seconds (half duplex, pulls done)",
                 title="fidelity per rank and round (dotted: +-20%)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- main


def print_report(report: dict[str, Any]) -> None:
    calibration = report.get("config", {}).get("calibration")
    if calibration:
        print(f"\ncalibration: MLP 64-{calibration['hidden']}-{calibration['hidden']}-10, "
              f"{calibration['num_parameters']:,} parameters ({calibration['model_bytes'] / 1e6:.2f} MB); step "
              f"{1e3 * calibration['step_s']:.2f} ms ({calibration['step_s_source']}; all steps: median "
              f"{1e3 * calibration['step_median_s']:.2f}, p10 {1e3 * calibration['step_p10_s']:.2f}, "
              f"p90 {1e3 * calibration['step_p90_s']:.2f}); FedAvg aggregation "
              + ", ".join(f"{n}: {1e3 * s:.0f} ms" for n, s in calibration["aggregate_s"].items())
              + "; a worker's gossip aggregation "
              + ", ".join(f"{n}: {1e3 * s:.1f} ms" for n, s in calibration.get("merge_s", {}).items()))
    if report.get("paper"):
        print("\nPart 1: paper 002's study, time to target in virtual seconds")
        print(paper_table(report))
        print("\nRound time probe")
        print(probe_table(report))
    if report.get("fidelity"):
        print("\nPart 2: simulator vs the real capped network (benchmarks/results/segmented_gossip.json)")
        print(fidelity_table(report))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 6 and 8 workers, hidden 128, few steps")
    parser.add_argument("--replot", action="store_true", help="redraw the figure and tables from the JSON; run nothing")
    parser.add_argument("--workers", type=int, nargs="+", default=None, help=f"worker counts (default {WORKERS})")
    parser.add_argument("--hidden", type=int, default=None, help=f"MLP hidden size of part 1 (default {HIDDEN})")
    parser.add_argument("--max-steps", type=int, default=None, help=f"cap on steps per worker (default {MAX_STEPS})")
    parser.add_argument("--targets", type=float, nargs="+", default=TARGETS)
    parser.add_argument("--target", type=float, default=TARGET, help="headline target accuracy")
    parser.add_argument("--step-seconds", type=float, default=None,
                        help="modelled step time instead of the calibrated one (the JSON records which)")
    parser.add_argument("--no-fidelity", action="store_true", help="skip part 2")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.workers = args.workers or ([6, 8] if args.quick else WORKERS)
    args.hidden = args.hidden or (128 if args.quick else HIDDEN)
    args.max_steps = args.max_steps or (240 if args.quick else MAX_STEPS)
    if args.quick and args.targets == TARGETS:
        args.targets, args.target = [0.85, 0.90], 0.90
    if args.target not in args.targets:
        args.targets = sorted({*args.targets, args.target})
    json_path, png_path = args.out / f"{PREFIX}.json", args.out / f"{PREFIX}.png"
    if args.replot:
        report = json.loads(json_path.read_text())
        if report.get("paper"):
            report["paper"]["summary"] = summarize_paper(report["paper"])
        if report.get("fidelity"):
            report["fidelity"]["summary"] = summarize_fidelity(report["fidelity"])
        json_path.write_text(json.dumps(report, indent=1) + "\n")
        plot(report, png_path)
        print_report(report)
        print(f"\nredrew {png_path} from {json_path}")
        return 0

    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    command = "python " + " ".join([str(Path(sys.argv[0]))] + (argv if argv is not None else sys.argv[1:]))
    import lightning
    import numpy
    import simpy

    print(f"calibrating the step time of MLP 64-{args.hidden}-{args.hidden}-10 ...", flush=True)
    calibration = calibrate(args.hidden, args.workers)
    calibration["measured_step_s"] = calibration["step_s"]
    if args.step_seconds is not None:
        calibration["step_s"] = args.step_seconds
    calibration["step_s_source"] = ("--step-seconds" if args.step_seconds is not None
                                    else "measured, best of 10 block medians")
    print(f"step {1e3 * calibration['step_s']:.2f} ms ({calibration['step_s_source']})", flush=True)
    report: dict[str, Any] = {"config": {
        "command": command, "quick": args.quick, "python": platform.python_version(), "torch": torch.__version__,
        "lightning": lightning.__version__, "simpy": simpy.__version__, "numpy": numpy.__version__,
        "machine": platform.machine(), "date": time.strftime("%Y-%m-%d"), "torch_threads": torch.get_num_threads(),
        "workers": args.workers, "node_mbit": NODE_MBIT, "link_mbit": LINK_MBIT, "latency": LATENCY,
        "period": PERIOD, "segments": SEGMENTS, "replicas": REPLICAS, "fedavg_client_fraction": 1.0,
        "data": {"name": "digits", "batch_size": BATCH_SIZE, "val_fraction": VAL_FRACTION, "partition": "iid"},
        "model": {"hidden_size": args.hidden, "learning_rate": LEARNING_RATE, "momentum": 0.0},
        "seed": SEED, "max_steps": args.max_steps, "extra_evals": EXTRA_EVALS, "targets": args.targets,
        "target": args.target, "paper_speedup": PAPER_SPEEDUP, "calibration": calibration}}
    report["paper"] = paper_part(args, calibration)
    if not args.no_fidelity:
        report["fidelity"] = fidelity_part(args)
    report["config"]["wall_s"] = time.perf_counter() - started
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, png_path)
    print_report(report)
    print(f"\ntotal wall time {report['config']['wall_s']:.0f} s; results in {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
