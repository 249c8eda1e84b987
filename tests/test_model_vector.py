"""ModelVector: the flat view of a module's floating-point state that every protocol averages."""

import torch
from torch import nn

from lightning_dist.model_vector import ModelVector


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
