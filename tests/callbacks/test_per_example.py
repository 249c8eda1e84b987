"""Per-example gradients (torch.func) against a plain autograd loop."""

import pytest
import torch
from torch import nn

from lightning_dist.callbacks._per_example import PerExampleGradients
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
