"""Worker: segmented gossip rounds across real processes on hand-set models.

For each case of ``spec["cases"]`` (keys ``segments``, ``replicas``, ``seed``, ``dim``, ``sizes``:
``|D_j|`` per rank, optional ``nan_rank``) every rank builds a fresh strategy on a module with
``dim`` weights and a 3-element float buffer, sets its replica to row ``rank`` of seeded random
models, shares its dataset size, previews the plan and runs one round exactly as after an optimizer step in
training. With ``consensus`` it takes the consensus (the weighted mean every rank evaluates and checkpoints)
instead of the round; ``dtype`` (default float32) is the module's, ``identical`` gives every rank row 0, ``bucket``
the entries of the ranges a round runs in (``AVERAGE_BUCKET``). Per-case results go to rank{r}.pt as a list, for comparison with the one-process
definition. Usage: see tests/helpers/launch.py.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lightning_dist.algorithms import averaging
from lightning_dist.comm import Communicator
from lightning_dist.model_vector import ModelVector
from lightning_dist.strategies import SegmentedGossipStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for helpers
from helpers.cases import run_cases  # noqa: E402

BUFFER_SIZE = 3
DEFAULT_BUCKET = averaging.AVERAGE_BUCKET


def run_case(case: dict, rank: int, world_size: int) -> dict:
    averaging.AVERAGE_BUCKET = case.get("bucket", DEFAULT_BUCKET)
    strategy = SegmentedGossipStrategy(segments=case["segments"], replicas=case["replicas"], period=1, seed=case["seed"])
    module = nn.Linear(case["dim"], 1, bias=False)
    module.register_buffer("statistic", torch.zeros(BUFFER_SIZE))
    dtype = getattr(torch, case.get("dtype", "float32"))
    module.to(dtype)
    strategy._comm = Communicator(dist.new_group(backend="gloo"))
    strategy._vector = ModelVector(module)
    strategy.parallel_devices = [torch.device("cpu")]
    models = torch.randn(world_size, case["dim"] + BUFFER_SIZE, generator=torch.Generator().manual_seed(100 + case["seed"]))
    models = (models[:1].expand_as(models) if case.get("identical") else models).to(dtype)
    consensus = None
    error = None
    next_plan = bounds = None
    try:
        strategy.on_replicas_initialized(strategy.model_vector.get())
        bounds = strategy.segment_bounds
        next_plan = strategy.next_plan()
        strategy.exchange_dataset_sizes(case["sizes"][rank])
        strategy.model_vector.set(models[rank])
        if case.get("nan_rank") == rank:
            strategy.model_vector.set(torch.full_like(models[rank], float("nan")))
        if case.get("consensus"):
            consensus = strategy.consensus("final")
        else:
            strategy.after_local_step(1)
    except Exception as exc:  # reported to the test, which asserts on it
        error = f"{type(exc).__name__}: {exc}"
    return {
        "error": error,
        "models": models,
        "vector": strategy.model_vector.get(),
        "stats": strategy.comm.stats,
        "metrics": strategy.protocol_metrics(),
        "in_sync": strategy._replicas_in_sync,
        "bounds": bounds,
        "next_plan": next_plan,
        "consensus": consensus,
    }


if __name__ == "__main__":
    run_cases(run_case)
