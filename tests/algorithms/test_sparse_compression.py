"""SparseLoCo's compression (lightning_dist.algorithms.sparse_compression) in one process: a hand-computed exchange,
the wire format's sizes and choices as properties, error feedback from its definition, and refusals by name."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dist.algorithms.compression import compress_chunks, compressed_mean
from lightning_dist.algorithms.sparse_compression import SPARSE_BITS, SparseCodec, pack_bits, unpack_bits


def test_an_exchange_of_two_ranks_by_hand():
    """Chunks of 2, half of each sent, float32 values, beta 0.5. Rank 0 owns elements 0-1, rank 1 elements 2-3.
    Rank 0 sends -3 of its first chunk and 2 of its second; rank 1 sends 1 (of tied 1 and 1: the lower position) and
    -4. Each owner sums its chunk, halves it and sends that chunk's larger entry again."""
    codec = SparseCodec(density=0.5, bits=32, chunk=2, decay=0.5)
    deltas = [torch.tensor([1.0, -3.0, 2.0, 0.5]), torch.tensor([1.0, 1.0, 0.0, -4.0])]
    worker = [torch.zeros(4), torch.tensor([0.0, 0.0, 0.0, 2.0])]  # rank 1's residual decays to 1 before it adds
    owner = [torch.zeros(2), torch.zeros(2)]
    applied, worker, owner = compressed_mean(deltas, worker, owner, codec)
    # rank 1 accumulates [1, 1, 0, -3]: sends 1 (position 0 of its first chunk) and -3
    # owner 0: ([0, -3] + [1, 0]) / 2 = [0.5, -1.5] -> sends -1.5, keeps [0.5, 0]
    # owner 1: ([2, 0] + [0, -3]) / 2 = [1, -1.5] -> sends -1.5, keeps [1, 0]
    assert applied.tolist() == [0.0, -1.5, 0.0, -1.5]
    assert worker[0].tolist() == [1.0, 0.0, 0.0, 0.5] and worker[1].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert owner[0].tolist() == [0.5, 0.0] and owner[1].tolist() == [1.0, 0.0]
    assert codec.nbytes(2) == 1 + 4  # one position of 1 bit, one float32 value


def test_two_bit_levels_are_the_means_of_equal_count_runs():
    """Eight values kept in one chunk at 2 bits: four runs of two in sorted order, each decoded to its mean."""
    codec = SparseCodec(density=1.0, bits=2, chunk=8)
    vector = torch.tensor([8.0, -1.0, 3.0, 4.0, -2.0, 1.0, 7.0, 2.0])
    decoded = codec.decode(codec.encode(vector), 8)
    # sorted: -2 -1 | 1 2 | 3 4 | 7 8 -> levels -1.5, 1.5, 3.5, 7.5
    assert decoded.tolist() == [7.5, -1.5, 3.5, 3.5, -1.5, 1.5, 7.5, 1.5]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 16), st.lists(st.integers(0, 2**16 - 1), min_size=0, max_size=50))
def test_bits_pack_and_unpack(width, values):
    values = [value % 2**width for value in values]
    packed = pack_bits(torch.tensor(values, dtype=torch.int64), width)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(len(values) * width / 8)
    assert unpack_bits(packed, width, len(values)).tolist() == values


@st.composite
def codecs_and_vectors(draw):
    codec = SparseCodec(density=draw(st.floats(0.001, 1.0)), bits=draw(st.sampled_from(SPARSE_BITS)),
                        chunk=draw(st.integers(2, 300)))
    length = draw(st.integers(1, 1000))
    kind = draw(st.sampled_from(["normal", "ties", "zeros"]))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    if kind == "normal":
        vector = torch.randn(length, generator=generator)
    elif kind == "ties":  # few distinct magnitudes, both signs
        vector = torch.randint(-2, 3, (length,), generator=generator).to(torch.float32)
    else:
        vector = torch.zeros(length)
    return codec, vector


@settings(max_examples=200, deadline=None)
@given(codecs_and_vectors())
def test_each_chunk_sends_its_largest_entries_ties_to_the_lower_position(case):
    codec, vector = case
    encoded = codec.encode(vector)
    assert encoded.nbytes() == codec.nbytes(vector.numel())
    decoded = codec.decode(encoded, vector.numel())
    for start in range(0, vector.numel(), codec.chunk):
        piece = vector[start:start + codec.chunk]
        kept = codec.kept(piece.numel())
        assert kept == min(piece.numel(), math.ceil(codec.density * piece.numel())) >= 1
        # the kept positions: by magnitude, then by position (sorted by hand, not by torch.sort)
        expected = sorted(range(piece.numel()), key=lambda i: (-abs(piece[i].item()), i))[:kept]
        sent = decoded[start:start + codec.chunk]
        others = [i for i in range(piece.numel()) if i not in expected]
        assert all(sent[i] == 0 for i in others)
        chosen = piece[expected]
        if codec.bits == 32 or len(set(chosen.tolist())) <= 2 ** codec.bits:
            assert torch.equal(sent[expected], chosen)  # exact: values as they are, or few enough for the levels
        else:  # each level the mean of its run: the chunk's rounding sums to zero
            assert math.isclose(sent[expected].sum().item(), chosen.sum().item(), rel_tol=1e-5, abs_tol=1e-4)


@settings(max_examples=100, deadline=None)
@given(codecs_and_vectors(), st.sampled_from([1.0, 0.9, 0.5]), st.integers(1, 5))
def test_error_feedback_keeps_what_was_not_sent(case, decay, rounds):
    """Every round: what was sent plus the new residual is what was to be sent (the decayed old residual plus the
    delta); with decay 1, summed over the rounds, the sends and the last residual are the deltas' sum."""
    codec, vector = case
    codec = SparseCodec(codec.density, codec.bits, codec.chunk, decay)
    bounds = [(0, vector.numel())]
    residual, total_sent, total_delta = torch.zeros_like(vector), torch.zeros_like(vector), torch.zeros_like(vector)
    for step in range(rounds):
        delta = vector * (step + 1) - step
        (piece,), new_residual = compress_chunks(delta, residual, codec, bounds, decay=decay)
        sent = codec.decode(piece, vector.numel())
        assert torch.allclose(sent + new_residual, residual * decay + delta, atol=1e-5)
        residual, total_sent, total_delta = new_residual, total_sent + sent, total_delta + delta
    if decay == 1.0:
        assert torch.allclose(total_sent + residual, total_delta, atol=1e-4)


def test_density_one_and_float32_values_send_the_vector_as_it_is():
    vector = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    codec = SparseCodec(density=1.0, bits=32, chunk=256)
    owners = [torch.zeros(500), torch.zeros(500)]
    applied, worker, owner = compressed_mean([vector, -vector * 3], [torch.zeros(1000)] * 2, owners, codec)
    assert torch.equal(applied, (vector - vector * 3) / 2)
    assert all(residual.abs().sum() == 0 for residual in worker + owner)


def test_a_large_vector_at_two_percent_and_two_bits_is_a_hundredth_of_float32():
    codec = SparseCodec(density=0.02, bits=2)
    assert 4 * 1_300_000 / codec.nbytes(1_300_000) > 100


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"density": 0.0}, r"density must be a number in \(0, 1\]"),
    ({"density": 1.5}, r"density must be a number in \(0, 1\]"),
    ({"density": float("nan")}, r"density must be a number in \(0, 1\]"),
    ({"density": 0.1, "decay": 0.0}, r"decay must be a number in \(0, 1\]"),
    ({"density": 0.1, "bits": 5}, r"bits must be one of \(1, 2, 3, 4, 8, 32\)"),
    ({"density": 0.1, "bits": True}, "bits must be one of"),
    ({"density": 0.1, "chunk": 1}, r"chunk must be an integer in \[2, 65536\]"),
    ({"density": 0.1, "chunk": 70000}, r"chunk must be an integer in \[2, 65536\]"),
])
def test_bad_settings_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SparseCodec(**kwargs)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_and_empty_vectors_are_refused_by_name(bad):
    vector = torch.ones(10)
    vector[7] = bad
    with pytest.raises(ValueError, match=f"holds {bad} at element 7"):
        SparseCodec(density=0.5).encode(vector)
    with pytest.raises(ValueError, match="non-empty 1-D vector"):
        SparseCodec(density=0.5).encode(torch.zeros(0))
