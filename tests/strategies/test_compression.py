"""Compressed full synchronizations on real Gloo processes against the one-process definition, and in Lightning fits.

One 3-process launch runs hand-set synchronizations (int8 and bf16 codecs, a bfloat16 model, a non-finite rank);
3-process fits check a bit-exact resume (the residuals are in the checkpoint) and the refusals by name.
"""

import pytest
import torch

from helpers.launch import run_case_ranks
from lightning_dist.algorithms.compression import compressed_model_mean, encoded_nbytes
from lightning_dist.algorithms.sparse_compression import SparseCodec
from lightning_dist.strategies import DownpourSGDStrategy, DynamicAveragingStrategy, PeriodicAveragingStrategy
from lightning_dist.algorithms.subset_average import chunk_bounds

WORLD = 3
CASES = {
    "int8": {"codec": "int8", "dim": 3000, "syncs": 3},
    "bf16": {"codec": "bf16", "dim": 3000, "syncs": 3, "seed": 1},
    "int8_bf16_model": {"codec": "int8", "dim": 3000, "syncs": 2, "seed": 2, "dtype": "bfloat16"},
    "non_finite": {"codec": "int8", "dim": 50, "syncs": 1, "nan_rank": 1},
    # SparseLoCo's codec: 5% of each 256-element chunk at 2 bits, the accumulator decaying by 0.9
    "sparse": {"codec": {"density": 0.05, "bits": 2, "chunk": 256, "decay": 0.9}, "dim": 3000, "syncs": 3, "seed": 3},
    # every entry as float32: the plain mean (the residuals stay zero)
    "sparse_dense": {"codec": {"density": 1.0, "bits": 32, "chunk": 256}, "dim": 3000, "syncs": 2, "seed": 4},
}


def codec_of(case):
    codec = CASES[case]["codec"]
    return SparseCodec(**codec) if isinstance(codec, dict) else codec


@pytest.fixture(scope="module")
def synchronizations(tmp_path_factory):
    out = tmp_path_factory.mktemp("compressed")
    return run_case_ranks(WORLD, "compressed", CASES, out)


@pytest.mark.parametrize("case", ["int8", "bf16", "int8_bf16_model", "sparse", "sparse_dense"])
def test_ranks_agree_bit_for_bit_on_the_definitions_mean_with_exact_bytes(synchronizations, case):
    """Every synchronization: every rank holds the same model, bit for bit, compressed_model_mean's: the common model's
    parameters plus compressed_mean's applied update (the same residuals carried from one synchronization to the
    next), bit for bit, and the 3-element buffer's exact mean (to float32 rounding: Gloo sums in its own order); each rank sent the 1-byte finiteness flag to each other rank, its
    compressed pieces of the other chunks, its compressed chunk of the mean to each other rank, and its share of the
    buffers' float32 all-reduce."""
    results = synchronizations[case]
    for result in results:
        assert result["error"] is None, result["error"]
    codec, start = codec_of(case), results[0]["start"]
    numel, num_parameters = start.numel(), CASES[case]["dim"]
    bounds = chunk_bounds(num_parameters, list(range(WORLD)))
    worker = [torch.zeros(num_parameters) for _ in range(WORLD)]
    owner = [torch.zeros(stop - begin) for begin, stop in bounds.values()]
    common = start
    for sync in range(CASES[case]["syncs"]):
        locals_ = [(common.float() + result["deltas"][sync, rank]).to(start.dtype) for rank, result in enumerate(results)]
        expected, worker, owner = compressed_model_mean(locals_, common, num_parameters, worker, owner, codec)
        for rank, result in enumerate(results):
            mean = result["means"][sync]
            assert torch.equal(mean, results[0]["means"][sync]), (sync, rank)  # every rank the same bits
            assert torch.equal(mean[:num_parameters], expected[:num_parameters]), (sync, rank)
            # The buffers' sum runs in Gloo's order, the definition's left to right: equal up to float32 rounding.
            assert torch.allclose(mean[num_parameters:], expected[num_parameters:], rtol=1e-6, atol=0), (sync, rank)
            assert torch.equal(result["residuals"][sync]["residual"], worker[rank])
            assert torch.equal(result["residuals"][sync]["owner_residual"], owner[rank])
        common = results[0]["means"][sync]
    buffers_share = 2 * (WORLD - 1) * (numel - num_parameters) * 4 // WORLD  # the ring's bytes, split evenly here
    for rank, result in enumerate(results):
        chunk = lambda owner_rank: bounds[owner_rank][1] - bounds[owner_rank][0]  # noqa: E731
        reduce = sum(encoded_nbytes(chunk(other), codec) for other in range(WORLD) if other != rank)
        gather = (WORLD - 1) * encoded_nbytes(chunk(rank), codec)
        assert result["stats"].protocol_bytes == CASES[case]["syncs"] * ((WORLD - 1) + reduce + gather + buffers_share)
    float32_ring = 2 * (WORLD - 1) / WORLD * numel * 4
    ratio = results[0]["stats"].protocol_bytes / (CASES[case]["syncs"] * float32_ring)
    assert ratio < {"int8": 0.26, "bf16": 0.51, "sparse": 0.04, "sparse_dense": 1.51}[
        case.replace("_bf16_model", "")], ratio


def test_a_non_finite_rank_is_named_before_anything_is_sent(synchronizations):
    for rank, result in enumerate(synchronizations["non_finite"]):
        assert "NonFiniteModelError" in result["error"] and "rank(s) [1]" in result["error"]
        assert result["stats"].protocol_bytes == WORLD - 1  # the finiteness flag only


def test_a_sparse_codec_keeping_everything_as_float32_gives_the_plain_mean(synchronizations):
    """Density 1 at 32 bits: every rank's model after each synchronization is the mean of the ranks' models, as
    without compression (to float32 rounding: here the deltas are averaged and added to the common model)."""
    results = synchronizations["sparse_dense"]
    common = results[0]["start"]
    for sync in range(CASES["sparse_dense"]["syncs"]):
        locals_ = torch.stack([common.float() + result["deltas"][sync, rank] for rank, result in enumerate(results)])
        assert torch.allclose(results[0]["means"][sync], locals_.mean(dim=0), rtol=0, atol=1e-4), sync
        common = results[0]["means"][sync]


@pytest.mark.parametrize(("make", "match"), [
    (lambda codec: DynamicAveragingStrategy(compression=codec), "not built for dynamic averaging"),
    (lambda codec: DownpourSGDStrategy(compression=codec), "not built for DownpourSGDStrategy's pushes"),
    (lambda codec: PeriodicAveragingStrategy(period=8, fragments=2, compression=codec),
     "built for blocking synchronizations without fault_tolerance yet"),
    (lambda codec: PeriodicAveragingStrategy(period=4, client_fraction=0.5, compression=codec),
     "compression needs client_fraction=1"),
])
def test_a_sparse_codec_is_refused_by_name_where_it_is_not_built(make, match):
    with pytest.raises(ValueError, match=match):
        make(SparseCodec(density=0.02))
