"""Compressed full synchronizations with error feedback: what crosses the network is a quantized model delta.

A full synchronization of the averaging protocols replaces every replica ``f_i`` by the mean. All
replicas left the previous synchronization from the same model ``r`` (the common model), so the
mean is ``r + mean_i(f_i - r)`` and only the deltas ``f_i - r`` need to travel; they are small and
smooth where the weights are not, which is what makes them quantize well.

Codecs (:data:`CODECS`): ``"bf16"`` (2 bytes an element) and ``"int8"`` (1 byte an element plus one
float32 scale per block of :data:`INT8_BLOCK` elements: ``scale = max|x| / 127`` over the block,
``code = round(x / scale)``, symmetric, round half to even).

Error feedback (Seide et al. 2014's 1-bit SGD; Karimireddy et al. 2019, EF-SGD; Streaming DiLoCo,
Douillard et al. 2025): what a compression drops is kept as a residual and added to the next
delta, so nothing is lost, only delayed. Two compressions happen per synchronization, and both keep
a residual (as 1-bit Adam's worker and server sides do, Tang et al. 2021):

- every rank compresses ``v_i = (f_i - r) + e_i`` and keeps ``e_i <- v_i - D(Q(v_i))``;
- the mean is formed chunk by chunk, each chunk by the rank that owns it (the reduce-scatter of
  :mod:`lightning_dist.algorithms.subset_average`'s plan over all ranks), which compresses its chunk
  of the mean ``u_j = mean_i D(Q(v_i))[j] + s_j`` again for the all-gather and keeps
  ``s_j <- u_j - D(Q(u_j))``.

Every rank decodes the same all-gathered codes, so every replica ends with the same
``r' = r + D(Q(u))``: replicas agree bit for bit after a compressed synchronization. Summed over
synchronizations ``t`` (residuals start at 0), the applied updates telescope to the true ones:

``sum_t D(Q(u_t)) + mean_i e_i + s = sum_t mean_i (f_i,t - r_t)``

with the final residuals ``e_i``, ``s`` (:func:`compressed_mean` is that definition in one
process; the strategies run the same steps across ranks).

Only the parameters are compressed. A model vector
(:class:`~lightning_dist.model_vector.ModelVector`) holds the parameters, then the floating-point
buffers (BatchNorm's running mean and variance): those are statistics, not sums of steps, and must
stay valid values. An int8 block shares one scale, so a running variance of 1e-5 in a block with
deltas of 1e-2 decodes to a multiple of ``1e-2 / 127`` (below zero as easily as above: NaN
evaluation). The buffers are averaged exactly instead, in :func:`accumulation_dtype`
(:func:`compressed_model_mean`): a mean of valid statistics, few bytes. The common model's
parameters stay in the model's dtype too (float64 is not rounded to float32 at every
synchronization): the update is decoded in float32 and added in the accumulation dtype. Bytes per rank: the reduce-scatter and the
all-gather each send ``(m - 1) / m`` of the model in the codec's size, the pattern of a ring
all-reduce: a quarter of its float32 bytes with int8 (plus 4 bytes per 1024 elements), half with bf16.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Union

import torch
from torch import Tensor

from lightning_dist.algorithms.averaging import accumulation_dtype
from lightning_dist.algorithms.sparse_compression import SparseCodec, SparseEncoded
from lightning_dist.algorithms.subset_average import chunk_bounds

CODECS = ("bf16", "int8")
Codec = Union[str, SparseCodec]
"""A codec: one of :data:`CODECS`, or a :class:`~lightning_dist.algorithms.sparse_compression.SparseCodec`."""
INT8_BLOCK = 1024
"""Elements per int8 scale: 4 bytes of scale per 1024 one-byte codes (0.4% more bytes)."""
INT8_LEVELS = 127


class Encoded(NamedTuple):
    """A compressed vector: ``codes`` (int8 or bfloat16) and, for int8, one float32 ``scales`` entry per block."""

    codes: Tensor
    scales: Tensor


def num_blocks(num_elements: int) -> int:
    return -(-num_elements // INT8_BLOCK)


def encode(vector: Tensor, codec: Codec) -> Encoded | SparseEncoded:
    """``vector`` (any float dtype) compressed with ``codec``."""
    if isinstance(codec, SparseCodec):
        return codec.encode(vector)
    if codec == "bf16":
        return Encoded(vector.to(torch.bfloat16), vector.new_empty(0, dtype=torch.float32))
    values = vector.to(torch.float32)
    padded = values.new_empty(num_blocks(values.numel()) * INT8_BLOCK)  # a new tensor: the codes are formed in it
    padded[: values.numel()] = values
    padded[values.numel():] = 0
    blocks = padded.view(-1, INT8_BLOCK)
    # max |x| per block without a temporary |x| of the vector's size (abs_ turns a -0.0 of a zero block into 0.0)
    scales = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg()).abs_() / INT8_LEVELS
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = blocks.div_(safe[:, None]).round_().clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
    return Encoded(codes.view(-1)[: values.numel()], scales)


def decode(encoded: Encoded | SparseEncoded, codec: Codec, num_elements: int | None = None) -> Tensor:
    """The float32 values of the vector ``encoded`` stands for (its ``num_elements`` needed for a sparse codec: a
    sparse encoding's size does not tell it)."""
    if isinstance(codec, SparseCodec):
        assert num_elements is not None, "a sparse encoding decodes to a length its caller knows"
        return codec.decode(encoded, num_elements)
    if codec == "bf16":
        return encoded.codes.to(torch.float32)
    codes = encoded.codes
    padded = torch.nn.functional.pad(codes, (0, encoded.scales.numel() * INT8_BLOCK - codes.numel())).to(torch.float32)
    return padded.view(-1, INT8_BLOCK).mul_(encoded.scales[:, None]).view(-1)[: codes.numel()]


def empty_encoded(num_elements: int, codec: Codec, device: torch.device | None = None) -> Encoded | SparseEncoded:
    """Buffers to receive the encoding of a vector of ``num_elements`` into."""
    if isinstance(codec, SparseCodec):
        return codec.empty(num_elements, device)
    codes = torch.empty(num_elements, dtype=torch.int8 if codec == "int8" else torch.bfloat16, device=device)
    scales = torch.empty(num_blocks(num_elements) if codec == "int8" else 0, dtype=torch.float32, device=device)
    return Encoded(codes, scales)


def encoded_nbytes(num_elements: int, codec: Codec) -> int:
    """Bytes of :func:`encode`'s output for a vector of ``num_elements``."""
    if isinstance(codec, SparseCodec):
        return codec.nbytes(num_elements)
    if codec == "bf16":
        return 2 * num_elements
    return num_elements + 4 * num_blocks(num_elements)


def error_decay(codec: Codec) -> float:
    """What a rank's residual keeps of itself at each exchange (``e <- decay * e + delta``): a sparse codec's
    ``decay`` (SparseLoCo's ``beta``), else 1."""
    return codec.decay if isinstance(codec, SparseCodec) else 1.0


def encoded_chunks_nbytes(num_elements: int, ranks: int, codec: Codec) -> int:
    """The encoded bytes of a vector of ``num_elements`` cut into the ``ranks`` owners' chunks: the size a compressed
    synchronization reduces and gathers (a float32 one's is ``4 * num_elements``)."""
    bounds = chunk_bounds(num_elements, list(range(ranks))).values()
    return sum(encoded_nbytes(stop - start, codec) for start, stop in bounds)


def compressed_sync_nbytes(num_parameters: int, num_buffers: int, ranks: int, codec: Codec, dtype: torch.dtype) -> int:
    """The size a compressed full synchronization of ``ranks`` moves as a ring all-reduce would: the parameters'
    encoded chunks, and the buffers in :func:`accumulation_dtype` of the model's ``dtype`` (averaged exactly)."""
    element = torch.empty(0, dtype=accumulation_dtype(dtype)).element_size()
    return encoded_chunks_nbytes(num_parameters, ranks, codec) + element * num_buffers


def compress_chunks(
    update: Tensor, residual: Tensor, codec: Codec, bounds: Sequence[tuple[int, int]], overwrite: bool = False,
    decay: float = 1.0,
) -> tuple[list[Encoded | SparseEncoded], Tensor]:
    """``update + decay * residual`` compressed chunk by chunk (int8 blocks and sparse chunks start at each chunk),
    and the new residual.

    Chunks are compressed apart so that each owner's piece decodes on its own. The new residual is formed in
    ``update`` itself when ``overwrite`` (a float32 tensor of the caller's own, with no other use), else in a new
    tensor: no temporary of the vector's size either way (a bucket of a large model's synchronization).
    """
    value = (update.add_(residual, alpha=decay) if overwrite  # no temporary of the residual's size either
             else torch.add(update.to(torch.float32), residual, alpha=decay))
    pieces = [encode(value[start:stop], codec) for start, stop in bounds]
    for piece, (start, stop) in zip(pieces, bounds):
        value[start:stop].sub_(decode(piece, codec, stop - start))
    return pieces, value


def compressed_mean(
    deltas: Sequence[Tensor], worker_residuals: Sequence[Tensor], owner_residuals: Sequence[Tensor], codec: Codec,
    contributors: int | None = None,
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """One compressed synchronization of ``m`` ranks in one process: the executable definition.

    ``deltas[i] = f_i - r``; ``worker_residuals[i]`` is rank ``i``'s ``e_i`` (the whole vector),
    ``owner_residuals[j]`` rank ``j``'s ``s_j`` (its chunk of :func:`chunk_bounds` over ranks
    ``0..m-1``), all float32. Returns the applied update ``D(Q(u))`` (every replica's new model is
    ``r`` plus it) and the new residuals. ``u`` divides the chunks' sums by ``contributors`` (default ``m``): a
    rank whose delta and residual are zero (a replica group healed in this window, under ``fault_tolerance``)
    is then not counted. A rank's residual decays by :func:`error_decay` before its delta is added (a sparse
    codec's ``beta``); an owner's does not (it is what compressing the mean dropped).
    """
    ranks = list(range(len(deltas)))
    bounds = list(chunk_bounds(deltas[0].numel(), ranks).values())
    compressed, new_worker = [], []
    for delta, residual in zip(deltas, worker_residuals):
        pieces, residual = compress_chunks(delta, residual, codec, bounds, decay=error_decay(codec))
        compressed.append(pieces)
        new_worker.append(residual)
    applied, new_owner = [], []
    for owner, residual in zip(ranks, owner_residuals):
        length = bounds[owner][1] - bounds[owner][0]
        chunk_sum = sum(decode(pieces[owner], codec, length) for pieces in compressed)
        pieces, residual = compress_chunks(chunk_sum / (contributors or len(ranks)), residual, codec, [(0, length)])
        applied.append(decode(pieces[0], codec, length))
        new_owner.append(residual)
    return torch.cat(applied), new_worker, new_owner


def compressed_model_mean(
    models: Sequence[Tensor], common: Tensor, num_parameters: int, worker_residuals: Sequence[Tensor],
    owner_residuals: Sequence[Tensor], codec: Codec,
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """A compressed full synchronization of whole model vectors in one process: the new common model, the same on
    every rank, in the models' dtype.

    The first ``num_parameters`` elements are parameters: ``common`` plus :func:`compressed_mean` of the models'
    deltas from it (residuals as there, of the parameter part only), added in :func:`accumulation_dtype`. The rest
    are buffers: their exact mean (module docstring: a quantized running variance can decode below zero).
    """
    dtype = accumulation_dtype(common.dtype)
    anchor = common[:num_parameters].to(dtype)
    deltas = [(model[:num_parameters].to(dtype) - anchor).to(torch.float32) for model in models]
    applied, new_worker, new_owner = compressed_mean(deltas, worker_residuals, owner_residuals, codec)
    buffers = sum(model[num_parameters:].to(dtype) for model in models) / len(models)
    mean = torch.cat([anchor + applied.to(dtype), buffers])
    return mean.to(common.dtype), new_worker, new_owner
