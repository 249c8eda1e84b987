"""The strategies' compressed full synchronization in the simulator (``compression="bf16"`` or ``"int8"``).

The math is :func:`lightning_dist.algorithms.compression.compressed_model_mean`, run once per
synchronization over every worker's model (parameters compressed as deltas from the common model,
buffers averaged exactly), with the workers' and the
chunk owners' residuals kept here (the strategy keeps them on each rank). The messages are the
strategy's: every worker all-gathers a 1-byte finiteness flag, then the compressed pieces of the
reduce-scatter and the all-gather of the compressed mean. They are timed as one ring all-reduce
(:mod:`lightning_dist.sim.collectives`) of the encoded chunks' total size, which moves the same
bytes in all (the strategy's two batches of direct pieces pay one latency each, the ring
``2 (m - 1)``; at the latencies modelled here that is microseconds).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import Tensor

from lightning_dist.algorithms.arguments import check_compression
from lightning_dist.algorithms.compression import Codec, compressed_model_mean, compressed_sync_nbytes
from lightning_dist.algorithms.outer import OuterStep
from lightning_dist.algorithms.subset_average import chunk_bounds
from lightning_dist.sim.engine import Node
from lightning_dist.sim.protocols.base import Program, all_finite


def check_simulated_compression(compression: object, topology: str, client_fraction: float = 1.0,
                                sparse_unsupported: str | None = None) -> Codec | None:
    """``compression`` as the strategies take it (``sparse_unsupported``: what refuses a sparse codec, as
    :func:`~lightning_dist.algorithms.arguments.check_compression`); simulated with ``topology="strategy"`` and every
    worker taking part."""
    compression = check_compression(compression, sparse_unsupported)
    if compression is not None and (topology != "strategy" or client_fraction < 1):
        raise ValueError(
            f"compression needs topology='strategy' and client_fraction=1 (the strategies' full synchronization); "
            f"got topology={topology!r}, client_fraction={client_fraction}"
        )
    return compression


class CompressedSync:
    """Compressed full synchronizations of ``workers`` workers that start from ``common``."""

    def __init__(self, codec: Codec, common: Tensor, num_parameters: int, workers: int) -> None:
        self.codec = codec
        self.common = common.clone()
        self.num_parameters = num_parameters
        bounds = chunk_bounds(num_parameters, list(range(workers))).values()
        self.worker_residuals = [torch.zeros(num_parameters) for _ in range(workers)]
        self.owner_residuals = [torch.zeros(stop - start) for start, stop in bounds]
        self.nbytes = compressed_sync_nbytes(num_parameters, common.numel() - num_parameters, workers, codec,
                                             common.dtype)

    def synchronize(self, node: Node, key: Hashable, workers: list[int], local: Tensor,
                    outer: OuterStep | None) -> Program:
        """Join the synchronization ``key``; returns the model every worker continues from (the same on all)."""
        yield from all_finite(node, key, workers, local, "to average them")
        return (yield from node.all_reduce(key, workers, local, lambda models: self._combine(models, outer),
                                           nbytes=self.nbytes))

    def _combine(self, models: list[Tensor], outer: OuterStep | None) -> Tensor:
        mean, self.worker_residuals, self.owner_residuals = compressed_model_mean(
            models, self.common, self.num_parameters, self.worker_residuals, self.owner_residuals, self.codec)
        if outer is not None:
            mean = outer.step(mean)
        self.common = mean.clone()
        return mean
