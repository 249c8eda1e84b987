"""Worker: dynamic-averaging checks across real processes on hand-set models, several cases in one launch.

For each case every rank sets its replica to a seeded random vector (or the case's explicit models),
then a fresh strategy runs one check (local conditions, balancing, averaging) exactly as after an
optimizer step in training (``bucket``: the ``AVERAGE_BUCKET`` it runs with, which sets the windows a balancing's
mean is gathered in). Each rank writes its results, one entry per case, to rank{r}.pt for comparison with the
one-process definition.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lightning_dist.algorithms import averaging
from lightning_dist.comm import Communicator
from lightning_dist.model_vector import ModelVector
from lightning_dist.strategies import DynamicAveragingStrategy


def models_of(case: dict, world_size: int, dtype: torch.dtype) -> list[torch.Tensor]:
    if "models" in case:
        return [torch.tensor(model, dtype=torch.float32).to(dtype) for model in case["models"]]
    generator = torch.Generator().manual_seed(case["seed"])
    return [(torch.randn(case["dim"], generator=generator) * case["spread"][i]).to(dtype) for i in range(world_size)]


DEFAULT_BUCKET = averaging.AVERAGE_BUCKET


def run_case(case: dict, group: dist.ProcessGroup, rank: int, world_size: int) -> dict:
    averaging.AVERAGE_BUCKET = case.get("bucket", DEFAULT_BUCKET)
    strategy = DynamicAveragingStrategy(divergence_threshold=case["threshold"], check_every=1, seed=case["seed"])
    dtype = getattr(torch, case.get("dtype", "float32"))
    models = models_of(case, world_size, dtype)
    dim = models[0].numel()
    module = nn.Linear(dim, 1, bias=False).to(dtype)
    if "nan_buffer_rank" in case:  # a running statistic after the weights, as BatchNorm's
        module.register_buffer("running_mean", torch.zeros(1, dtype=dtype))
    strategy._comm = Communicator(group)
    strategy._vector = ModelVector(module)
    strategy.parallel_devices = [torch.device("cpu")]
    strategy._reference = torch.zeros(dim, dtype=dtype)
    strategy._violation_counter = case.get("violation_counter", 0)
    buffers = torch.zeros(sum(buffer.numel() for buffer in strategy.model_vector.buffers), dtype=dtype)
    strategy.model_vector.set(torch.cat([models[rank], buffers]))
    error = None
    try:
        if case.get("nan_rank") == rank:
            strategy.model_vector.set(torch.full((dim,), float("nan")))
        if case.get("nan_buffer_rank") == rank:
            strategy.model_vector.set(torch.cat([models[rank], torch.full_like(buffers, float("nan"))]))
        strategy.after_local_step(1)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {
        "error": error,
        "models": models,
        "vector": strategy.model_vector.get(),
        "reference": strategy._reference,
        "counter": strategy._violation_counter,
        "stats": strategy.comm.stats,
        "metrics": strategy.protocol_metrics(),
    }


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(backend="gloo")
    results = [run_case(case, group, rank, world_size) for case in spec["cases"]]
    torch.save(results, Path(spec["out"]) / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
