"""A full synchronization that sends quantized model deltas with error feedback, over a :class:`Communicator`.

Runs :mod:`lightning_dist.algorithms.compression`'s synchronization across ranks: every rank
compresses its delta from the common model chunk by chunk and sends chunk ``j`` to rank ``j``
(one batch of point-to-point transfers); each rank sums its chunk in float32 (its own piece
included, in rank order, as :func:`~lightning_dist.algorithms.compression.compressed_mean`),
compresses its chunk of the mean and sends it to every other rank (a second batch); every rank
decodes the same codes, so the replicas agree bit for bit. A compressed vector cannot be summed
inside an all-reduce (int8 overflows and every rank's scales differ), hence the reduce-scatter and
all-gather as two batches of pieces, the pattern of :mod:`lightning_dist.strategies._subset_average`
and the bytes of a ring all-reduce in the codec's size.

Only the parameters are compressed; the buffers (BatchNorm's running statistics) are averaged exactly by an
all-reduce, so a running variance never decodes below zero. State per rank (in its checkpoint part): the common
model (in the model's dtype: float64 is not rounded to float32), the rank's residual ``e_i`` (float32, the
parameters: memory of one float32 copy of them) and the residual ``s_j`` of the chunk it owns.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_dist.algorithms.averaging import accumulation_dtype
from lightning_dist.algorithms.compression import (
    Codec,
    compress_chunks,
    decode,
    empty_encoded,
    encode,
    error_decay,
)
from lightning_dist.algorithms.subset_average import chunk_bounds
from lightning_dist.comm import Communicator


class CompressedAverage:
    """This rank's side of compressed full synchronizations (``codec``: ``"bf16"``, ``"int8"`` or a
    :class:`~lightning_dist.algorithms.sparse_compression.SparseCodec`)."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.common: Tensor | None = None  # the model every replica held after the last full synchronization
        self.residual: Tensor | None = None  # e_i: what this rank's compressions dropped, still to be sent
        self.owner_residual: Tensor | None = None  # s_j: what compressing this rank's chunk of the mean dropped

    def hold(self, common: Tensor, copy: bool = True) -> None:
        """Every replica now holds ``common``: the next deltas are taken from it (the residuals are kept).
        ``copy=False`` keeps ``common`` itself (a tensor nothing else changes), saving one copy of it."""
        self.common = common.detach().clone() if copy else common.detach()

    def to(self, device: torch.device) -> None:
        """Move the state (common model and residuals) to ``device``: streaming with ``state_device="cpu"`` keeps it
        in host memory between a fragment's exchanges and brings it to the model's device for one."""
        self.common, self.residual, self.owner_residual = (
            None if value is None else value.to(device) for value in (self.common, self.residual, self.owner_residual))

    def restart(self, common: Tensor) -> None:
        """A fresh start from ``common`` (a resume at another world size): residuals at zero, chunks re-cut."""
        self.hold(common)
        self.residual = self.owner_residual = None

    def recut(self) -> None:
        """The learners' chunks are cut anew (under ``fault_tolerance``, a replica group lost or joined): the owner
        residual, owed to the chunk this rank owned, is dropped (a quantization error's worth); ``e_i`` is kept."""
        self.owner_residual = None

    def average(self, comm: Communicator, local: Tensor, num_parameters: int, purpose: str,
                contributors: int | None = None, contributes: bool = True) -> Tensor:
        """The common model plus the compressed mean of the contributing ranks' deltas, the same on every rank.

        ``local``'s first ``num_parameters`` elements are parameters, compressed; the rest are buffers (BatchNorm's
        statistics), averaged exactly by an all-reduce in the accumulation dtype: a quantized running variance can
        decode below zero (:func:`~lightning_dist.algorithms.compression.compressed_model_mean`, this exchange's
        definition). The caller has checked that every rank's ``local`` is finite (a non-finite delta would turn a
        block's scale, and with it the mean, non-finite).

        ``contributors`` (default: every rank) is how many ranks the mean is of; a rank that does not
        ``contribute`` (under ``fault_tolerance``, a replica group healed in this window) sends a zero delta and
        zero buffers, its residual untouched, and still owns its chunk of the mean.
        """
        assert self.common is not None, "hold() the common model before the first synchronization"
        dtype = accumulation_dtype(local.dtype)
        rank, ranks = comm.rank, list(range(comm.world_size))
        bounds = chunk_bounds(num_parameters, ranks)
        start, stop = bounds[rank]
        if self.residual is None:
            self.residual = torch.zeros(num_parameters, dtype=torch.float32, device=local.device)
        if self.owner_residual is None:
            self.owner_residual = torch.zeros(stop - start, dtype=torch.float32, device=local.device)
        anchor = self.common[:num_parameters].to(dtype)
        if contributes:
            delta = (local[:num_parameters].to(dtype) - anchor).to(torch.float32)  # a new tensor: the residual's
            pieces, self.residual = compress_chunks(delta, self.residual, self.codec, list(bounds.values()),
                                                    overwrite=True, decay=error_decay(self.codec))
        else:
            pieces = [encode(torch.zeros(end - begin, dtype=torch.float32, device=local.device), self.codec)
                      for begin, end in bounds.values()]
        received = self._exchange(comm, {owner: pieces[owner] for owner in ranks if owner != rank},
                                  {source: bounds[rank] for source in ranks if source != rank}, purpose)
        received[rank] = pieces[rank]
        chunk_sum = sum(decode(received[source], self.codec, stop - start)  # a new tensor: the residual's
                        for source in ranks)
        (mean_piece,), self.owner_residual = compress_chunks(
            chunk_sum.div_(contributors or len(ranks)), self.owner_residual, self.codec, [(0, stop - start)],
            overwrite=True)
        gathered = self._exchange(comm, {member: mean_piece for member in ranks if member != rank},
                                  {owner: bounds[owner] for owner in ranks if owner != rank}, purpose)
        gathered[rank] = mean_piece
        # anchor + D(Q(u)), then the buffers' mean, written into one new vector (no temporaries of its size)
        mean = torch.empty(local.numel(), dtype=dtype, device=local.device)
        for owner in ranks:
            begin, end = bounds[owner]
            torch.add(anchor[begin:end], decode(gathered[owner], self.codec, end - begin).to(dtype),
                      out=mean[begin:end])
        buffers = mean[num_parameters:]
        if buffers.numel():
            if contributes:
                buffers.copy_(local[num_parameters:])
            else:
                buffers.zero_()
            comm.all_reduce_sum_(buffers, purpose).div_(contributors or comm.world_size)
        return mean.to(local.dtype)

    def _exchange(self, comm: Communicator, outgoing: dict[int, tuple[Tensor, ...]],
                  incoming: dict[int, tuple[int, int]], purpose: str) -> dict[int, tuple[Tensor, ...]]:
        """Send ``outgoing[rank]`` to each rank and receive an encoded piece of ``incoming[source]``'s bounds from each
        (every non-empty tensor of a piece, in its order)."""
        device = self.common.device if self.common is not None else None
        sends, receives, buffers = [], [], {}
        for destination, piece in outgoing.items():
            sends += [(part, destination) for part in piece if part.numel()]
        for source, (start, stop) in incoming.items():
            buffers[source] = empty_encoded(stop - start, self.codec, device)
            receives += [(part, source) for part in buffers[source] if part.numel()]
        comm.exchange(sends, receives, purpose)
        return buffers

    def state_dict(self) -> dict[str, Any]:
        return {"common": self.common, "residual": self.residual, "owner_residual": self.owner_residual}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        moved = {key: None if value is None else value.to(device) for key, value in state.items()}
        self.common, self.residual, self.owner_residual = moved["common"], moved["residual"], moved["owner_residual"]
