"""Worker of ``benchmarks/segmented_gossip/run.py``: Lightning fits under torchrun, one node per network namespace.

Usage (normally through ``benchmarks/segmented_gossip/run.py``, which starts one torchrun per node of a
``benchmarks/common/netns.py`` network)::

    torchrun --nnodes=N --nproc_per_node=1 --node_rank=i ... benchmarks/segmented_gossip/worker.py spec.json

One launch runs the fits listed in ``spec["runs"]`` one after the other in the same processes (the
8 to 11 Python processes of a launch take most of a minute to start on 2 cores), reseeding before
each, so every fit starts from the same weights and data order. Common keys: ``data``
(DigitsDataModule arguments), ``model`` (MLPClassifier arguments), ``seed``, ``caps``
(``{"node_mbit", "link_mbit"}``, used only for the expected times), ``work_dir`` and ``out`` (the
JSON file rank 0 writes). ``mode`` is one of:

``"sync"`` (part 1, synchronisation time): each run is ``{"name", "segments", "replicas", "rounds"}``;
a ``SegmentedGossipStrategy`` with period 1 trains ``rounds`` steps, so every step ends with a
round. Before each round all ranks meet at a barrier (so a round's time is its transfers, not
waiting for a rank that is still computing); each rank times ``gossip_round`` from the barrier's
end to its own end. Rank 0 also previews the round's pull plan (``strategy.next_plan()``) and turns it
into the time the caps allow (``round_bound``).

``"accuracy"`` (part 2, time to accuracy): each run is ``{"name", "kind", "strategy", "budget_s",
"snapshot_every"}`` with ``kind`` ``"ddp"`` (Lightning's DDP: gradient all-reduce every step) or
a lightning_dist class name with its kwargs. Training stops at the first snapshot step after
``budget_s`` seconds of training (rank 0 decides, a broadcast makes every rank stop at the same
step). Every ``snapshot_every`` optimizer steps each rank copies its parameters and the time;
no validation runs during fit (for the local-update strategies it averages the replicas, an
all-reduce over the capped network that would cost as much as a round). After fit the copies
go to files in ``work_dir`` (same machine, no network) and rank 0 evaluates the mean of all
ranks' copies at each snapshot step on the validation split: the model a validation at that
step would evaluate (every rank reads the same number of examples, so the dataset-size weighted
mean is the plain mean). A snapshot's time is the latest rank's time at that step, measured from
the earliest rank's start of training. The local-update strategies' ``after_local_step`` is
timed on every rank at round steps (no barrier: waiting for slower ranks counts).

The strategies' end-of-fit average (an all-reduce of the whole model over the capped network)
runs after the last timed step and snapshot, so it is in no measured time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from benchmarks.common.report import write_json
import lightning_dist
from lightning_dist.algorithms.segmented_gossip import transfers
from lightning_dist.data.datamodules import DigitsDataModule
from lightning_dist.models import MLPClassifier

# TCP payload per Ethernet frame (1448 of 1514 bytes): the rate a cap of X Mbit/s gives to data.
PAYLOAD_SHARE = 1448 / 1514


def payload_bytes_per_s(mbit: float | None) -> float:
    return float("inf") if mbit is None else mbit * 1e6 / 8 * PAYLOAD_SHARE


def round_bound(plan: torch.Tensor, bounds: list[tuple[int, int]], element_size: int,
                node_mbit: float | None, link_mbit: float | None) -> dict[str, float]:
    """Shortest time the caps allow for one round of ``plan``: the busiest link and the busiest node.

    A link ``i -> j`` moves the segments ``j`` pulls from ``i`` at ``min(link, node)``; a node sends and
    receives at most ``node`` in total. The round takes at least the larger of the two bounds
    (``bound_s``). ``pair_bound_s`` is the busiest pair of ranks when a pair's two directions move
    one after the other, which is what Gloo does here: ``batch_isend_irecv`` of 1.2 MB each way
    between two ranks took 10.0 s under a 2 Mbit/s link cap, twice the one-way time, while plain
    TCP both ways over one connection took 5.1-6.7 s. ``gloo_bound_s`` is the larger of that and
    the node bound.
    """
    segment_bytes = [(stop - start) * element_size for start, stop in bounds]
    link_bytes = {pair: sum(segment_bytes[s] for s in segments) for pair, segments in transfers(plan).items()}
    world = plan.shape[0]
    egress, ingress = [0] * world, [0] * world
    for (provider, puller), nbytes in link_bytes.items():
        egress[provider] += nbytes
        ingress[puller] += nbytes
    link_rate = payload_bytes_per_s(min(x for x in (link_mbit, node_mbit, float("inf")) if x is not None))
    node_rate = payload_bytes_per_s(node_mbit)
    pair_bytes: dict[frozenset[int], int] = {}
    for pair, nbytes in link_bytes.items():
        pair_bytes[frozenset(pair)] = pair_bytes.get(frozenset(pair), 0) + nbytes
    busiest_link = max(link_bytes.values())
    busiest_pair = max(pair_bytes.values())
    busiest_node = max(max(egress), max(ingress))
    link_s, pair_s, node_s = busiest_link / link_rate, busiest_pair / link_rate, busiest_node / node_rate
    return {"link_bound_s": link_s, "node_bound_s": node_s, "bound_s": max(link_s, node_s),
            "pair_bound_s": pair_s, "gloo_bound_s": max(pair_s, node_s),
            "busiest_link_bytes": busiest_link, "busiest_pair_bytes": busiest_pair, "busiest_node_bytes": busiest_node,
            "links_used": len(link_bytes),
            "two_way_pairs": sum(1 for (i, j) in link_bytes if i < j and (j, i) in link_bytes)}


def gossip_bound(strategy: lightning_dist.SegmentedGossipStrategy, caps: dict[str, Any]) -> dict[str, float]:
    """The bound of the round the strategy is about to run (its plan drawn from a copy of its generator)."""
    element_size = strategy.model_vector.get().element_size()
    return round_bound(strategy.next_plan(), strategy.segment_bounds, element_size, caps.get("node_mbit"), caps.get("link_mbit"))


def trainer_kwargs(strategy: Any, callbacks: list[Callback], **extra: Any) -> dict[str, Any]:
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    return dict(accelerator="cpu", devices=local, num_nodes=int(os.environ["WORLD_SIZE"]) // local,
                strategy=strategy, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
                enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                deterministic=True, callbacks=callbacks, **extra)


def build(spec: dict[str, Any]) -> tuple[DigitsDataModule, MLPClassifier]:
    seed = int(spec["seed"])
    L.seed_everything(seed, workers=True, verbose=False)
    datamodule = DigitsDataModule(seed=seed, **spec["data"])
    model = MLPClassifier(num_features=datamodule.num_features, num_classes=datamodule.num_classes, **spec["model"])
    return datamodule, model


# ------------------------------------------------------------------ part 1: synchronisation time


def sync_run(spec: dict[str, Any], run: dict[str, Any]) -> dict[str, Any] | None:
    datamodule, model = build(spec)
    strategy = lightning_dist.SegmentedGossipStrategy(segments=run["segments"], replicas=run["replicas"], period=1,
                                                      seed=int(spec["seed"]))
    spans: list[tuple[float, float]] = []
    bounds: list[dict[str, float]] = []
    original = strategy.gossip_round

    def timed_round() -> None:
        if dist.get_rank() == 0:
            bounds.append(gossip_bound(strategy, spec["caps"]))
        dist.barrier()
        start = time.monotonic()
        original()
        spans.append((start, time.monotonic()))

    strategy.gossip_round = timed_round  # after_local_step looks the method up on the instance
    trainer = L.Trainer(**trainer_kwargs(strategy, [], max_steps=int(run["rounds"])))
    trainer.fit(model, datamodule=datamodule)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, spans)
    if dist.get_rank() != 0:
        return None
    rounds = []
    for index, bound in enumerate(bounds):
        starts = [rank_spans[index][0] for rank_spans in gathered]
        ends = [rank_spans[index][1] for rank_spans in gathered]
        rounds.append({"span_s": max(ends) - min(starts),
                       "per_rank_s": [end - start for start, end in zip(starts, ends)], **bound})
    return {"name": run["name"], "segments": run["segments"], "replicas": run["replicas"],
            "world_size": dist.get_world_size(), "num_parameters": strategy.model_vector.num_parameters,
            "model_bytes": strategy.model_vector.get().nbytes, "rounds": rounds,
            "protocol_metrics": strategy.protocol_metrics()}


# ------------------------------------------------------------------ part 2: time to accuracy


class Snapshots(Callback):
    """Every ``every`` optimizer steps: copy the parameters and the time; stop after ``budget_s`` (rank 0 decides)."""

    def __init__(self, every: int, budget_s: float) -> None:
        self.every, self.budget_s = every, budget_s
        self.start = 0.0
        self.steps: list[int] = []
        self.times: list[float] = []
        self.vectors: list[torch.Tensor] = []
        self.step_ends: list[float] = []

    def _take(self, pl_module: L.LightningModule, step: int) -> None:
        self.steps.append(step)
        self.times.append(time.monotonic())
        self.vectors.append(parameters_to_vector(pl_module.parameters()).detach().clone())

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = time.monotonic()
        self._take(pl_module, 0)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.step_ends.append(time.monotonic())
        step = trainer.global_step
        if step % self.every:
            return
        self._take(pl_module, step)
        stop = trainer.strategy.broadcast(time.monotonic() - self.start >= self.budget_s, src=0)
        if stop:
            trainer.should_stop = True


def time_protocol(strategy: lightning_dist.LocalUpdateStrategy, period: int, caps: dict[str, Any]
                  ) -> tuple[list[tuple[int, float]], list[dict[str, float]]]:
    """Time ``after_local_step`` at round steps (``step % period == 0``); for gossip also record the round's bound."""
    durations: list[tuple[int, float]] = []
    bounds: list[dict[str, float]] = []
    original = strategy.after_local_step

    def timed(step: int) -> None:
        if step % period:
            original(step)
            return
        if isinstance(strategy, lightning_dist.SegmentedGossipStrategy) and dist.get_rank() == 0:
            bounds.append(gossip_bound(strategy, caps))
        start = time.monotonic()
        original(step)
        durations.append((step, time.monotonic() - start))

    strategy.after_local_step = timed
    return durations, bounds


def per_rank_step_s(gathered: list[dict[str, Any]]) -> list[list[float]]:
    """Every rank's training-step durations, from its ``start`` and its ``step_ends``."""
    durations = []
    for part in gathered:
        ends = [part["start"]] + part["step_ends"]
        durations.append([b - a for a, b in zip(ends[:-1], ends[1:])])
    return durations


def comm_result(strategy: Any, stats: Any) -> dict[str, Any]:
    """The strategy's summed counters for a run's result (nothing for Lightning's DDP, which has none)."""
    if stats is None:
        return {}
    return dict(protocol_bytes=stats.protocol_bytes, bytes_sent=stats.bytes_sent,
                bytes_by_purpose=dict(stats.bytes_by_purpose), bytes_by_level=dict(stats.bytes_by_level),
                syncs=stats.syncs,
                protocol_metrics=strategy.protocol_metrics())


def accuracy_run(spec: dict[str, Any], run: dict[str, Any]) -> dict[str, Any] | None:
    datamodule, model = build(spec)
    seed = int(spec["seed"])
    durations: list[tuple[int, float]] = []
    bounds: list[dict[str, float]] = []
    if run["kind"] == "ddp":
        strategy: Any = "ddp"
    else:
        strategy = getattr(lightning_dist, run["strategy"]["class"])(seed=seed, **run["strategy"]["kwargs"])
        durations, bounds = time_protocol(strategy, run["strategy"]["kwargs"]["period"], spec["caps"])
    snapshots = Snapshots(int(run["snapshot_every"]), float(run["budget_s"]))
    trainer = L.Trainer(**trainer_kwargs(strategy, [snapshots], max_epochs=int(run.get("max_epochs", 10_000))))
    trainer.fit(model, datamodule=datamodule)
    fit_end = time.monotonic()
    strategy = trainer.strategy
    stats = strategy.refresh_comm_stats() if isinstance(strategy, lightning_dist.LocalUpdateStrategy) else None

    rank, world = dist.get_rank(), dist.get_world_size()
    work_dir = Path(spec["work_dir"])
    snapshot_file = work_dir / f"{run['name']}.rank{rank}.snapshots.pt"
    torch.save(torch.stack(snapshots.vectors), snapshot_file)
    snapshots.vectors.clear()
    local = {"start": snapshots.start, "fit_end": fit_end, "steps": snapshots.steps, "times": snapshots.times,
             "step_ends": snapshots.step_ends, "rounds": durations}
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, local)  # also a barrier: every rank's file is written
    if rank != 0:
        return None
    start = min(part["start"] for part in gathered)
    steps = gathered[0]["steps"]
    if any(part["steps"] != steps for part in gathered):
        raise RuntimeError(f"{run['name']}: ranks took snapshots at different steps")
    total = None
    for other in range(world):
        path = work_dir / f"{run['name']}.rank{other}.snapshots.pt"
        vectors = torch.load(path)
        total = vectors if total is None else total + vectors
        path.unlink()
    mean = total / world
    features, labels = datamodule.val_set.features, datamodule.val_set.labels
    curve = []
    with torch.no_grad():
        for index, step in enumerate(steps):
            vector_to_parameters(mean[index], model.parameters())
            accuracy = float((model(features).argmax(dim=1) == labels).float().mean())
            seconds = max(part["times"][index] for part in gathered) - start
            curve.append({"step": step, "seconds": seconds, "val_acc": accuracy})
    step_durations = per_rank_step_s(gathered)
    round_s = [[duration for _, duration in part["rounds"]] for part in gathered]
    result = {
        "name": run["name"], "kind": run["kind"], "strategy": run.get("strategy"), "world_size": world,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "model_bytes": mean[0].nbytes, "budget_s": run["budget_s"], "snapshot_every": run["snapshot_every"],
        "steps": trainer.global_step, "epochs": trainer.current_epoch,
        "fit_s": max(part["fit_end"] for part in gathered) - start,
        "mean_step_s": sum(map(sum, step_durations)) / max(sum(map(len, step_durations)), 1),
        "round_s_per_rank": round_s, "round_steps": [step for step, _ in gathered[0]["rounds"]],
        "round_bounds": bounds, "curve": curve,
        "final_val_acc": curve[-1]["val_acc"],
    }
    result.update(comm_result(strategy, stats))
    return result


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    run_one = {"sync": sync_run, "accuracy": accuracy_run}[spec["mode"]]
    results = []
    for run in spec["runs"]:
        started = time.monotonic()
        result = run_one(spec, run)
        if result is not None:
            result["launch_part_s"] = time.monotonic() - started
            results.append(result)
            print(f"[{spec['mode']}] {run['name']} done in {result['launch_part_s']:.1f} s", flush=True)
    if dist.get_rank() == 0:
        write_json(Path(spec["out"]), {"runs": results})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
