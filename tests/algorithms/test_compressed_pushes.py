"""DownpourSGD's compressed pushes and replies in one process: wire format, bytes, error feedback both ways."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dist.algorithms.compressed_pushes import (
    CompressedPushes,
    CompressedReplies,
    push_nbytes,
    reply_nbytes,
)
from lightning_dist.algorithms.compression import decode, encode
from lightning_dist.algorithms.parameter_server import push_message

PARAMETERS, BUFFERS = 2500, 3  # two full int8 blocks and a partial one; an odd byte count before the buffers


def _vectors(count, seed=0):
    generator = torch.Generator().manual_seed(seed)
    # Unequal magnitudes: the third block's elements are 1000x the first's.
    scale = torch.cat([torch.full((1024,), 1e-3), torch.ones(1024), torch.full((PARAMETERS - 2048 + BUFFERS,), 1.0)])
    return [torch.randn(PARAMETERS + BUFFERS, generator=generator) * scale for _ in range(count)]


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_a_push_decodes_to_the_compressed_update_and_the_exact_buffers_in_its_bytes(codec):
    start, local = _vectors(2)
    worker = CompressedPushes(codec, start, PARAMETERS)
    server = CompressedReplies(codec, start, PARAMETERS, workers=2)
    message = push_message(local, start, PARAMETERS)
    wire = worker.encode_push(message)
    assert wire.dtype == torch.uint8 and wire.numel() == push_nbytes(PARAMETERS, BUFFERS, codec)
    assert wire.numel() == server.push_like().numel()
    decoded = server.decode_push(wire)
    assert torch.equal(decoded[:PARAMETERS], decode(encode(message[:PARAMETERS], codec), codec))
    assert torch.equal(decoded[PARAMETERS:], local[PARAMETERS:])  # buffers are absolute: sent as they are
    assert torch.equal(worker.residual, message[:PARAMETERS] - decoded[:PARAMETERS])
    assert worker.residual.abs().max() > 0


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_error_feedback_keeps_the_sum_of_applied_updates_equal_to_the_true_sum_up_to_the_residual(codec):
    """sum_t D(Q(u_t + e_t)) + e_T = sum_t u_t, with updates of very different sizes per push."""
    start, *updates = _vectors(6, seed=1)
    worker = CompressedPushes(codec, start, PARAMETERS)
    server = CompressedReplies(codec, start, PARAMETERS, workers=1)
    applied = torch.zeros(PARAMETERS)
    for index, update in enumerate(updates):
        message = torch.cat([update[:PARAMETERS] * 10.0 ** (index - 2), update[PARAMETERS:]])
        applied += server.decode_push(worker.encode_push(message))[:PARAMETERS]
    true = sum(update[:PARAMETERS] * 10.0 ** (index - 2) for index, update in enumerate(updates))
    tolerance = 1e-6 * float(true.abs().max())  # float32 sums of values up to a few hundred
    assert torch.allclose(applied + worker.residual, true, rtol=0, atol=tolerance)
    assert not torch.allclose(applied, true, rtol=0, atol=100 * tolerance)  # the residual is not nothing


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_replies_keep_the_worker_and_server_mirrors_equal_and_close_in_on_the_global_model(codec):
    """The worker continues from its mirror, the server's copy of it equals it bit for bit, and what one reply's
    compression dropped is sent with the next: against a fixed global model the gap shrinks reply after reply."""
    start, target = _vectors(2, seed=2)
    worker = CompressedPushes(codec, start, PARAMETERS)
    server = CompressedReplies(codec, start, PARAMETERS, workers=3)
    gaps = []
    for _ in range(3):
        wire = server.encode_reply(2, target)
        assert wire.numel() == reply_nbytes(PARAMETERS, BUFFERS, codec)
        model = worker.decode_reply(wire)
        assert torch.equal(model, server.mirrors[2]) and torch.equal(model, worker.mirror)
        gaps.append(float((target - model).abs().max()))
    assert gaps[0] > 0 and gaps[1] < gaps[0] / 50 and gaps[2] <= gaps[1]
    assert torch.equal(server.mirrors[0], start) and torch.equal(server.mirrors[1], start)  # other workers' mirrors


def test_a_non_finite_push_decodes_non_finite():
    """The server's finiteness check runs on the decoded push: a NaN or inf must survive the int8 codec."""
    start = torch.zeros(PARAMETERS + BUFFERS)
    for bad in (float("nan"), float("inf")):
        message = torch.ones(PARAMETERS + BUFFERS)
        message[1500] = bad
        decoded = CompressedReplies("int8", start, PARAMETERS, 1).decode_push(
            CompressedPushes("int8", start, PARAMETERS).encode_push(message))
        assert not bool(torch.isfinite(decoded).all()), bad


def test_state_dicts_restore_residual_and_mirrors():
    start, local, target = _vectors(3, seed=3)
    worker = CompressedPushes("int8", start, PARAMETERS)
    server = CompressedReplies("int8", start, PARAMETERS, workers=2)
    worker.encode_push(push_message(local, start, PARAMETERS))
    worker.decode_reply(server.encode_reply(1, target))
    worker_copy = CompressedPushes("int8", torch.zeros_like(start), PARAMETERS)
    worker_copy.load_state_dict(worker.state_dict())
    server_copy = CompressedReplies("int8", torch.zeros_like(start), PARAMETERS, workers=2)
    server_copy.load_state_dict(server.state_dict())
    assert torch.equal(worker_copy.residual, worker.residual) and torch.equal(worker_copy.mirror, worker.mirror)
    assert torch.equal(server_copy.mirrors, server.mirrors)
    with pytest.raises(ValueError, match="reply mirrors in the checkpoint have shape"):
        CompressedReplies("int8", start, PARAMETERS, workers=3).load_state_dict(server.state_dict())


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_a_reply_carries_the_buffers_exactly_beside_large_parameter_changes(codec):
    """Issue 40: a BatchNorm running variance, tiny and positive, shares an int8 block (one scale per 1024 elements)
    with parameter changes 10^5 times larger; quantized with them (bf16: rounded as a change from 1) it decoded below
    zero in the worker's mirror (-1.9e-4 in training, then NaN evaluations). A reply sends the buffers as float32
    absolute values, as a push does: both mirrors hold the server's buffers exactly, reply after reply, and a reply
    has a push's bytes."""
    parameters, buffers = 1000, 24  # one int8 block: the buffers share the parameters' scale
    generator = torch.Generator().manual_seed(4)
    start = torch.cat([torch.zeros(parameters), torch.ones(buffers)])  # running variances start at 1
    worker = CompressedPushes(codec, start, parameters)
    server = CompressedReplies(codec, start, parameters, workers=2)
    for _ in range(2):
        target = torch.cat([torch.randn(parameters, generator=generator) * 10,
                            torch.rand(buffers, generator=generator) * 1e-4 + 1e-6])
        model = worker.decode_reply(server.encode_reply(1, target))
        assert torch.equal(model[parameters:], target[parameters:]), model[parameters:]
        assert float(model[parameters:].min()) > 0
        assert torch.equal(model, server.mirrors[1])
        assert not torch.equal(model[:parameters], target[:parameters])  # the parameters' change is compressed
    assert server.encode_reply(1, target).numel() == reply_nbytes(parameters, buffers, codec)
    assert reply_nbytes(parameters, buffers, codec) == push_nbytes(parameters, buffers, codec)


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_a_refused_push_leaves_the_residual_owed_to_the_next_accepted_one(codec):
    """u1 accepted, u2 refused as too stale, u3 accepted (issue 40): the refused update is dropped, and what u1's
    compression owed travels with u3, so sum of the applied decoded updates + the final residual = u1 + u3."""
    start, *updates = _vectors(4, seed=5)
    worker = CompressedPushes(codec, start, PARAMETERS)
    server = CompressedReplies(codec, start, PARAMETERS, workers=1)
    applied = torch.zeros(PARAMETERS)
    for update, accepted in zip(updates, (True, False, True)):
        wire = worker.encode_push(update)
        if accepted:
            applied += server.decode_push(wire)[:PARAMETERS]
        else:
            worker.refused()
    true = updates[0][:PARAMETERS] + updates[2][:PARAMETERS]
    assert torch.allclose(applied + worker.residual, true, rtol=0, atol=1e-6 * float(true.abs().max()))
    assert worker.residual.abs().max() > 0


@settings(max_examples=60, deadline=None)
@given(num_parameters=st.integers(1, 3000), num_buffers=st.integers(0, 20), codec=st.sampled_from(["bf16", "int8"]),
       accepted=st.lists(st.booleans(), min_size=1, max_size=8), seed=st.integers(0, 2**31 - 1))
def test_property_error_feedback_survives_any_sequence_of_refusals(num_parameters, num_buffers, codec, accepted, seed):
    """Any sizes and any accept/refuse sequence: the server's decoded updates of the accepted pushes plus the worker's
    final residual equal the sum of the accepted pushes' true updates (a refused push drops its own update, never the
    residual owed from before), and every push carries the buffers exactly."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randn(num_parameters + num_buffers, generator=generator)
    worker = CompressedPushes(codec, start, num_parameters)
    server = CompressedReplies(codec, start, num_parameters, workers=1)
    applied, true = torch.zeros(num_parameters, dtype=torch.float64), torch.zeros(num_parameters, dtype=torch.float64)
    for index, taken in enumerate(accepted):
        message = torch.randn(num_parameters + num_buffers, generator=generator) * 10.0 ** (index % 3 - 1)
        decoded = server.decode_push(worker.encode_push(message))
        assert torch.equal(decoded[num_parameters:], message[num_parameters:])
        if taken:
            applied += decoded[:num_parameters].double()
            true += message[:num_parameters].double()
        else:
            worker.refused()
    assert torch.allclose(applied + worker.residual.double(), true, rtol=0, atol=1e-5 * max(1.0, float(true.abs().max())))
