"""Worker: compressed full synchronizations across real processes on hand-set models.

For each case of ``spec["cases"]`` (``codec``: a codec's name or a ``SparseCodec``'s arguments; ``dim``, ``syncs``,
optional ``dtype`` and ``nan_rank``) every rank
builds a ``PeriodicAveragingStrategy(compression=codec)`` on a module with ``dim`` weights and a 3-element float
buffer, holds the seeded common model, then ``syncs`` times sets its replica to the common model plus its seeded
delta (row ``rank`` of that synchronization's deltas, of very different sizes per rank) and synchronizes as the
protocol does (``synchronize_in_place``). Per-case results go to rank{r}.pt as a list, for
comparison with ``compressed_mean``. Usage: see tests/helpers/launch.py.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lightning_dist.algorithms.sparse_compression import SparseCodec
from lightning_dist.comm import Communicator
from lightning_dist.model_vector import ModelVector
from lightning_dist.strategies import PeriodicAveragingStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for helpers
from helpers.cases import run_cases  # noqa: E402


def deltas_of(case: dict, world_size: int, numel: int) -> torch.Tensor:
    """``[syncs, world_size, numel]``: rank r's delta at each synchronization, scaled by 10^(r - 1)."""
    generator = torch.Generator().manual_seed(case.get("seed", 0))
    scales = torch.tensor([10.0 ** (rank - 1) for rank in range(world_size)])
    return torch.randn(case["syncs"], world_size, numel, generator=generator) * scales[None, :, None]


def run_case(case: dict, rank: int, world_size: int) -> dict:
    codec = case["codec"]
    strategy = PeriodicAveragingStrategy(period=1, compression=SparseCodec(**codec) if isinstance(codec, dict) else codec)
    module = nn.Linear(case["dim"], 1, bias=False)
    module.register_buffer("statistic", torch.zeros(3))
    module.to(getattr(torch, case.get("dtype", "float32")))
    strategy._comm = Communicator(dist.new_group(backend="gloo"))
    strategy._vector = ModelVector(module)
    strategy.parallel_devices = [torch.device("cpu")]
    strategy._buckets = strategy.full_sync_buckets()
    numel = strategy.model_vector.get().numel()
    start = torch.randn(numel, generator=torch.Generator().manual_seed(99)).to(strategy.model_vector.get().dtype)
    strategy.set_common_model(start)
    deltas = deltas_of(case, world_size, numel)
    means, residuals, error = [], [], None
    try:
        for sync in range(case["syncs"]):
            local = start.float() + deltas[sync, rank] if sync == 0 else means[-1].float() + deltas[sync, rank]
            if case.get("nan_rank") == rank:
                local = torch.full_like(local, float("nan"))
            strategy.model_vector.set(local.to(start.dtype))
            strategy.synchronize_in_place("protocol")
            means.append(strategy.model_vector.get())
            (bucket,) = strategy.compression_state_dict()["buckets"]  # a model under one bucket
            residuals.append({key: value.clone() for key, value in bucket.items() if key != "common"})
    except Exception as exc:  # reported to the test, which asserts on it
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "start": start, "deltas": deltas, "means": means, "residuals": residuals,
            "stats": strategy.comm.stats, "vector": strategy.model_vector.get()}


if __name__ == "__main__":
    run_cases(run_case)
