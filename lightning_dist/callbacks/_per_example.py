"""Per-example gradients of a LightningModule's loss with ``torch.func`` (vmap over grad).

Under DDP ``p.grad`` after backward is already the all-reduced batch mean, so per-example local
gradients cannot come from it: they are recomputed here from the batch, at the module's current
weights, as ``vmap(grad(loss of one example))``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_flatten, tree_map

PerExampleLoss = Callable[[nn.Module, Any], Tensor]


class _LossModule(nn.Module):
    """``forward(batch) = loss_fn(module, batch)``, so that ``functional_call`` can swap the module's parameters
    while running arbitrary user code (a method such as ``per_example_loss``, not only ``forward``)."""

    def __init__(self, module: nn.Module, loss_fn: PerExampleLoss) -> None:
        super().__init__()
        self.module = module
        self.loss_fn = loss_fn

    def forward(self, batch: Any) -> Tensor:
        return self.loss_fn(self.module, batch)


class PerExampleGradients:
    """``batch -> (batch_size, d)``: each example's gradient of ``loss_fn``, flattened over the trainable parameters.

    ``loss_fn(module, batch)`` returns the per-example losses of ``batch``, shape ``(batch_size,)``;
    it is called with batches of one example. The batch must be a tensor or a nested
    tuple/list/dict of tensors whose first dimension is the batch size. Randomness (dropout)
    differs between examples; modules whose output depends on the whole batch (BatchNorm in
    training mode) have no per-example gradient and must be evaluated in eval mode by ``loss_fn``.
    """

    def __init__(self, module: nn.Module, loss_fn: PerExampleLoss) -> None:
        self._wrapper = _LossModule(module, loss_fn)
        self._trainable = [name for name, p in self._wrapper.named_parameters() if p.requires_grad]
        if not self._trainable:
            raise ValueError("the module has no trainable parameters: there are no gradients to balance")
        self.num_parameters = sum(p.numel() for p in module.parameters() if p.requires_grad)

        def loss_of_one(trainable: dict[str, Tensor], fixed: dict[str, Tensor], example: Any) -> Tensor:
            batch_of_one = tree_map(lambda t: t.unsqueeze(0), example)
            loss = functional_call(self._wrapper, {**fixed, **trainable}, (batch_of_one,))
            if loss.numel() != 1:
                raise ValueError(
                    f"the per-example loss must return one loss per example, shape (batch_size,); for a batch of one "
                    f"it returned shape {tuple(loss.shape)}"
                )
            return loss.sum()

        self._per_example = vmap(grad(loss_of_one), in_dims=(None, None, 0), randomness="different")

    @property
    def device(self) -> torch.device:
        """Where the module's parameters, and so the gradients, are."""
        return next(self._wrapper.parameters()).device

    def __call__(self, batch: Any) -> Tensor:
        leaves, _ = tree_flatten(batch)
        if not leaves or not all(isinstance(leaf, Tensor) for leaf in leaves):
            raise ValueError(
                "per-example gradients need a batch made of tensors (a tensor, or tuples/lists/dicts of them); got "
                f"leaves of types {sorted({type(leaf).__name__ for leaf in leaves})}"
            )
        sizes = {leaf.shape[0] if leaf.dim() else None for leaf in leaves}
        if len(sizes) != 1 or None in sizes:
            raise ValueError(f"every tensor of the batch needs the same first (batch) dimension; got sizes {sizes}")
        named = dict(self._wrapper.named_parameters())
        trainable = {name: named[name].detach() for name in self._trainable}
        fixed = {name: p.detach() for name, p in named.items() if name not in trainable}
        fixed.update({name: b for name, b in self._wrapper.named_buffers()})
        with torch.no_grad():  # torch.func.grad ignores it; it keeps the outer autograd from recording anything
            grads = self._per_example(trainable, fixed, batch)
        size = sizes.pop()
        return torch.cat([grads[name].reshape(size, -1) for name in self._trainable], dim=1)
