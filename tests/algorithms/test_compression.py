"""Compressed synchronizations (lightning_dist.algorithms.compression) in one process: codecs by hand, error feedback
from its definition with unequal deltas."""

import pytest
import torch

from lightning_dist.algorithms.arguments import check_compression
from lightning_dist.algorithms.compression import (
    INT8_BLOCK,
    compress_chunks,
    compressed_mean,
    decode,
    encode,
    encoded_nbytes,
)
from lightning_dist.algorithms.subset_average import chunk_bounds


def test_int8_scales_each_block_by_its_largest_magnitude_and_rounds_half_to_even():
    first = torch.zeros(INT8_BLOCK)
    first[:4] = torch.tensor([-2.54, 1.27, 0.005, 0.015])  # scale 2.54 / 127 = 0.02: codes -127, 63.5 -> 64, 0.25, 0.75
    second = torch.zeros(3)  # a last, short block of zeros: scale 0, codes 0
    encoded = encode(torch.cat([first, second]), "int8")
    assert encoded.codes.dtype == torch.int8 and encoded.codes.numel() == INT8_BLOCK + 3
    assert torch.allclose(encoded.scales, torch.tensor([0.02, 0.0]))
    assert encoded.codes[:4].tolist() == [-127, 64, 0, 1]
    decoded = decode(encoded, "int8")
    assert torch.allclose(decoded[:4], torch.tensor([-2.54, 1.28, 0.0, 0.02]))
    assert torch.equal(decoded[INT8_BLOCK:], torch.zeros(3))
    assert encoded_nbytes(INT8_BLOCK + 3, "int8") == INT8_BLOCK + 3 + 2 * 4


def test_bf16_is_a_cast():
    vector = torch.tensor([1.0, 1.00390625, 3.0e-3])
    encoded = encode(vector, "bf16")
    assert encoded.codes.dtype == torch.bfloat16 and encoded.scales.numel() == 0
    assert torch.equal(decode(encoded, "bf16"), vector.to(torch.bfloat16).float())
    assert encoded_nbytes(3, "bf16") == 6


def test_a_compression_keeps_what_it_drops_as_the_residual():
    update, residual = torch.randn(3000), 0.01 * torch.randn(3000)
    bounds = list(chunk_bounds(3000, [0, 1, 2]).values())
    pieces, new_residual = compress_chunks(update, residual, "int8", bounds)
    decoded = torch.cat([decode(piece, "int8") for piece in pieces])
    assert torch.allclose(decoded + new_residual, update + residual, atol=1e-6)
    assert 0 < new_residual.abs().max() <= max(piece.scales.max() for piece in pieces) / 2 + 1e-7


@pytest.mark.parametrize("codec", ["int8", "bf16"])
def test_error_feedback_applies_every_update_up_to_the_final_residuals(codec):
    """Three ranks, deltas of very different sizes, six synchronizations: the applied updates plus the ranks' mean
    residual plus the owners' residuals equal the sum of the true means of the deltas (the telescoping sum of the
    module docstring); each synchronization is close to its true mean; without feedback the errors would add up."""
    generator = torch.Generator().manual_seed(0)
    numel, ranks = 5000, 3  # chunks of 1667/1667/1666: two int8 blocks each, the second short
    worker = [torch.zeros(numel) for _ in range(ranks)]
    owner = [torch.zeros(stop - start) for start, stop in chunk_bounds(numel, list(range(ranks))).values()]
    applied_total, true_total = torch.zeros(numel), torch.zeros(numel)
    for _ in range(6):
        deltas = [scale * torch.randn(numel, generator=generator) for scale in (1e-3, 1.0, 30.0)]
        true_mean = sum(deltas) / ranks
        applied, worker, owner = compressed_mean(deltas, worker, owner, codec)
        assert torch.linalg.vector_norm(applied - true_mean) <= 0.02 * torch.linalg.vector_norm(true_mean)
        applied_total += applied
        true_total += true_mean
    left = sum(worker) / ranks + torch.cat(owner)
    assert torch.allclose(applied_total + left, true_total, rtol=0, atol=2e-5)
    assert left.abs().max() > 0


def test_compression_argument_names_the_formats():
    assert check_compression(None) is None and check_compression("int8") == "int8"
    with pytest.raises(ValueError, match="compression must be None or one of 'bf16', 'int8' .*; got 'fp8'"):
        check_compression("fp8")
