"""Per-example gradients: torch.func against a plain autograd loop, and the linear-layer path against torch.func."""

import warnings

import pytest
import torch
from torch import nn

from lightning_dist.callbacks._per_example import (
    LinearPerExampleGradients,
    PerExampleGradients,
    make_per_example_gradients,
)
from lightning_dist.models import MLPClassifier


def _loss(module, batch):
    return module.per_example_loss(batch)


def test_matches_one_backward_per_example_and_skips_frozen_parameters():
    torch.manual_seed(0)
    model = MLPClassifier(num_features=8, num_classes=3, hidden_size=5)
    model.net[0].bias.requires_grad_(False)
    x, y = torch.randn(6, 8), torch.randint(3, (6,))
    gradients = PerExampleGradients(model, _loss)((x, y))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert gradients.shape == (6, sum(p.numel() for p in trainable))
    for i in range(6):
        expected = torch.autograd.grad(model.per_example_loss((x[i : i + 1], y[i : i + 1])).sum(), trainable)
        assert torch.allclose(gradients[i], torch.cat([g.reshape(-1) for g in expected]), atol=1e-6)
    assert all(p.grad is None for p in model.parameters())  # nothing accumulated into .grad


def test_dict_batches_work():
    model = nn.Linear(3, 1)
    gradients = PerExampleGradients(model, lambda m, b: ((m(b["x"]) - b["y"]) ** 2).view(-1))
    batch = {"x": torch.ones(4, 3), "y": torch.arange(4.0).view(4, 1)}
    out = gradients(batch)
    # d/dw (w.x + b - y)^2 = 2 (w.x + b - y) x
    residual = (model(batch["x"]) - batch["y"]).detach()
    assert torch.allclose(out[:, :3], 2 * residual * batch["x"]) and torch.allclose(out[:, 3:], 2 * residual)


def test_bad_batches_and_losses_are_explained():
    gradients = PerExampleGradients(nn.Linear(3, 1), lambda m, b: m(b[0]).view(-1))
    with pytest.raises(ValueError, match="batch made of tensors"):
        gradients((torch.ones(2, 3), "label"))
    with pytest.raises(ValueError, match="same first"):
        gradients((torch.ones(2, 3), torch.ones(3)))
    scalar_loss = PerExampleGradients(nn.Linear(3, 2), lambda m, b: m(b[0]))  # 2 outputs per example
    with pytest.raises(ValueError, match=r"one loss per example, shape \(batch_size,\)"):
        scalar_loss((torch.ones(2, 3),))
    with pytest.raises(ValueError, match="no trainable parameters"):
        PerExampleGradients(nn.Linear(3, 1).requires_grad_(False), lambda m, b: m(b[0]).view(-1))


class _TwiceApplied(nn.Module):
    """One linear layer applied at two sequence positions' features and again to its own output: calls add up."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1, bias=False)

    def forward(self, x):  # x: (batch, positions, 4)
        return self.head(self.layer(torch.tanh(self.layer(x)))).sum(dim=(1, 2))


class _TiedWeights(nn.Module):
    """The head reuses the first layer's weight outside that layer's forward: the layer hooks cannot see it."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 3)

    def forward(self, x):
        return nn.functional.linear(torch.tanh(self.layer(x)), self.layer.weight).sum(dim=1)


def test_linear_layers_give_torch_funcs_gradients_without_touching_grad():
    torch.manual_seed(0)
    model = MLPClassifier(num_features=8, num_classes=3, hidden_size=5)
    model.net[0].bias.requires_grad_(False)
    batch = (torch.randn(6, 8), torch.randint(3, (6,)))
    expected = PerExampleGradients(model, _loss)(batch)
    fast = LinearPerExampleGradients(model, _loss)
    assert fast.num_parameters == expected.shape[1]
    assert torch.allclose(fast(batch), expected, atol=1e-6)
    assert all(p.grad is None for p in model.parameters())


def test_linear_layers_called_several_times_and_on_sequences_add_up():
    torch.manual_seed(0)
    model = _TwiceApplied()
    x = torch.randn(5, 7, 4)
    loss = lambda m, b: m(b)  # noqa: E731
    assert torch.allclose(LinearPerExampleGradients(model, loss)(x), PerExampleGradients(model, loss)(x), atol=1e-5)


def test_only_models_of_linear_layers_are_supported():
    assert LinearPerExampleGradients.supports(MLPClassifier(num_features=4, num_classes=2, hidden_size=3))
    assert not LinearPerExampleGradients.supports(nn.Sequential(nn.Conv1d(1, 2, 3), nn.Flatten(), nn.Linear(4, 1)))
    # a frozen non-linear layer does not matter: it has no gradient to compute
    assert LinearPerExampleGradients.supports(nn.Sequential(nn.LayerNorm(3).requires_grad_(False), nn.Linear(3, 1)))
    assert not LinearPerExampleGradients.supports(nn.Linear(3, 1).requires_grad_(False))
    with pytest.raises(ValueError, match="nn.Linear"):
        LinearPerExampleGradients(nn.Conv1d(1, 1, 2), lambda m, b: m(b).sum(dim=(1, 2)))


def test_auto_uses_the_linear_path_only_after_it_matched_torch_func():
    torch.manual_seed(0)
    model = MLPClassifier(num_features=8, num_classes=3, hidden_size=5)
    batch = (torch.randn(4, 8), torch.randint(3, (4,)))
    gradients = make_per_example_gradients(model, _loss)
    first = gradients(batch)
    assert isinstance(gradients.method, LinearPerExampleGradients)
    assert torch.allclose(gradients(batch), first, atol=1e-6)
    assert isinstance(make_per_example_gradients(model, _loss, "vmap"), PerExampleGradients)
    assert isinstance(make_per_example_gradients(nn.Conv1d(1, 1, 2), lambda m, b: m(b).sum(dim=(1, 2))), PerExampleGradients)


def test_auto_falls_back_to_torch_func_when_the_layers_miss_a_use_of_a_weight():
    torch.manual_seed(0)
    model = _TiedWeights()
    loss = lambda m, b: m(b)  # noqa: E731
    x = torch.randn(4, 3)
    expected = PerExampleGradients(model, loss)(x)
    assert not torch.allclose(LinearPerExampleGradients(model, loss)(x), expected, atol=1e-4)
    gradients = make_per_example_gradients(model, loss)
    with pytest.warns(UserWarning, match="differ from torch.func"):
        first = gradients(x)
    assert isinstance(gradients.method, PerExampleGradients)
    assert torch.allclose(first, expected) and torch.allclose(gradients(x), expected)


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="method must be one of"):
        make_per_example_gradients(nn.Linear(2, 1), lambda m, b: m(b).view(-1), "hooks")


def test_in_bfloat16_auto_keeps_the_linear_path_and_still_catches_a_missed_weight():
    """bf16-true models: the two methods round their different sums differently (about 10 eps here), which must
    not pass for a wrong gradient; a weight the layers miss still differs by far more."""
    torch.manual_seed(0)
    model = MLPClassifier(num_features=40, num_classes=10, hidden_size=64).to(torch.bfloat16)
    batch = (torch.randn(16, 40).to(torch.bfloat16), torch.randint(10, (16,)))
    gradients = make_per_example_gradients(model, _loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gradients(batch).dtype == torch.bfloat16
    assert isinstance(gradients.method, LinearPerExampleGradients) and gradients.dtype == torch.bfloat16
    tied = _TiedWeights().to(torch.bfloat16)
    gradients = make_per_example_gradients(tied, lambda m, b: m(b))
    with pytest.warns(UserWarning, match="differ from torch.func"):
        gradients(torch.randn(4, 3).to(torch.bfloat16))
    assert isinstance(gradients.method, PerExampleGradients)
