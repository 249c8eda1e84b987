"""ModelVector: the flat view of a module's floating-point state that every protocol averages."""

import torch
from torch import nn

import pytest

from lightning_dist.model_vector import ModelVector, VectorRange


def _module(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2)).to(dtype)


def test_get_in_another_dtype_is_the_flat_state_cast():
    module = _module(torch.bfloat16)
    vector = ModelVector(module)
    flat = vector.get()
    assert vector.dtype == flat.dtype == torch.bfloat16
    wide = vector.get(dtype=torch.float32)
    assert wide.dtype == torch.float32 and torch.equal(wide, flat.float())
    # Parameters (8 + 2 + 2) then the float buffers (running mean and variance); num_batches_tracked is left out.
    assert flat.numel() == 3 * 2 + 2 + 2 + 2 + 2 + 2 and vector.num_parameters == 12


def test_parameter_views_follow_the_parameters_and_set_rounds_once():
    module = _module(torch.bfloat16)
    vector = ModelVector(module)
    reference = torch.arange(vector.num_parameters, dtype=torch.float32)
    views = vector.parameter_views(reference)
    assert [v.shape for v in views] == [p.shape for p in vector.parameters]
    assert torch.equal(torch.cat([v.reshape(-1) for v in views]), reference)
    assert views[0].data_ptr() == reference.data_ptr()  # views, not copies
    # A float32 vector is rounded into the bfloat16 tensors once.
    state = torch.linspace(-1, 1, vector.get().numel()) / 3
    vector.set(state)
    assert torch.equal(vector.get(), state.to(torch.bfloat16))


def test_a_vector_range_reads_the_models_entries_slice_by_slice_and_all_finite_sees_every_tensor():
    """A VectorRange over entries [3, 15) gives, for any slice, a new tensor equal to that slice of the flat vector;
    all_finite covers parameters and buffers without a copy."""
    vector = ModelVector(_module(torch.float32))
    flat = vector.get()
    part = VectorRange(vector, 3, 12)
    assert part.numel() == 12 and part.dtype == flat.dtype and part.device == flat.device
    for start, stop in ((0, 12), (2, 7), (11, 12), (5, 5), (4, 100)):
        piece = part[start:stop]
        assert torch.equal(piece, flat[3:15][start:stop])
        piece.fill_(7)  # a copy: the model is untouched
    assert torch.equal(vector.get(), flat)
    with pytest.raises(ValueError, match="contiguous slices"):
        part[0:12:2]
    with pytest.raises(ValueError, match="not within the model vector"):
        VectorRange(vector, 3, flat.numel())
    assert vector.all_finite()
    next(iter(vector.buffers)).fill_(float("nan"))
    assert not vector.all_finite()

