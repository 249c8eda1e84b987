"""Paper 002's setting in the simulator, shared by both parts of the study: the workers, network, task and targets,
the three protocols, and the calibration of this machine's step and aggregation times."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from lightning_dist.algorithms.averaging import weighted_average
from lightning_dist.algorithms.segmented_gossip import aggregate, pull_plan, segment_bounds
from lightning_dist.data import DigitsDataModule
from lightning_dist.models import MLPClassifier
from lightning_dist.sim import PeriodicAveraging, SegmentedGossip, Simulation
from lightning_dist.sim.replica import Replica

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


PROTOCOLS = {
    "fedavg": "FedAvg (C=1, server)",
    "gossip": f"gossip S=1 R={REPLICAS}",
    "segmented": f"segmented gossip S={SEGMENTS} R={REPLICAS}",
}

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
