"""Worker: one dynamic-averaging check across real processes on hand-set models.

Each rank sets its replica to a seeded random vector, then the strategy runs one check
(local conditions, balancing, averaging) exactly as after an optimizer step in training.
Rank results go to rank{r}.pt for comparison with the one-process definition.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lightning_dist.comm import Communicator
from lightning_dist.model_vector import ModelVector
from lightning_dist.strategies import DynamicAveragingStrategy


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    strategy = DynamicAveragingStrategy(
        divergence_threshold=spec["threshold"], check_every=1, seed=spec["seed"]
    )
    dtype = getattr(torch, spec.get("dtype", "float32"))
    module = nn.Linear(spec["dim"], 1, bias=False).to(dtype)
    strategy._comm = Communicator(dist.new_group(backend="gloo"))
    strategy._vector = ModelVector(module)
    strategy.parallel_devices = [torch.device("cpu")]
    strategy._reference = torch.zeros(spec["dim"], dtype=dtype)
    strategy._violation_counter = spec.get("violation_counter", 0)
    generator = torch.Generator().manual_seed(spec["seed"])
    models = [(torch.randn(spec["dim"], generator=generator) * spec["spread"][i]).to(dtype) for i in range(world_size)]
    strategy.model_vector.set(models[rank])
    error = None
    try:
        if spec.get("nan_rank") == rank:
            strategy.model_vector.set(torch.full((spec["dim"],), float("nan")))
        strategy.after_local_step(1)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    torch.save(
        {
            "error": error,
            "models": models,
            "vector": strategy.model_vector.get(),
            "reference": strategy._reference,
            "counter": strategy._violation_counter,
            "stats": strategy.comm.stats,
            "metrics": strategy.protocol_metrics(),
        },
        Path(spec["out"]) / f"rank{rank}.pt",
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
