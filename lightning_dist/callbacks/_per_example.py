"""Per-example gradients of a LightningModule's loss: ``torch.func`` (vmap over grad), and a faster path for linear layers.

Under DDP ``p.grad`` after backward is already the all-reduced batch mean, so per-example local
gradients cannot come from it: they are recomputed here from the batch, at the module's current
weights. :class:`PerExampleGradients` is the general method, ``vmap(grad(loss of one example))``.
:class:`LinearPerExampleGradients` gets the same numbers for models whose trainable parameters all
belong to ``nn.Linear`` layers from one batched forward and one backward to the layers' outputs,
which on small models costs a fraction of vmap's per-example passes. :func:`make_per_example_gradients`
picks between them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from functools import reduce
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_flatten, tree_map

PerExampleLoss = Callable[[nn.Module, Any], Tensor]
METHODS = ("auto", "vmap")


class GradientFunction(Protocol):
    """What the CDGraB callback needs: ``batch -> (batch_size, num_parameters)`` on ``device``."""

    num_parameters: int

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def __call__(self, batch: Any) -> Tensor: ...


def _batch_size(batch: Any) -> int:
    """The common first dimension of the batch's tensors; a ValueError if there is none."""
    leaves, _ = tree_flatten(batch)
    if not leaves or not all(isinstance(leaf, Tensor) for leaf in leaves):
        raise ValueError(
            "per-example gradients need a batch made of tensors (a tensor, or tuples/lists/dicts of them); got "
            f"leaves of types {sorted({type(leaf).__name__ for leaf in leaves})}"
        )
    sizes = {leaf.shape[0] if leaf.dim() else None for leaf in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"every tensor of the batch needs the same first (batch) dimension; got sizes {sizes}")
    return sizes.pop()


def _promoted(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The dtype ``torch.cat`` gives tensors of ``dtypes``."""
    return reduce(torch.promote_types, dtypes)


def _check_losses(losses: Tensor, batch_size: int) -> None:
    if losses.shape != (batch_size,):
        raise ValueError(
            f"the per-example loss must return one loss per example, shape (batch_size,) = ({batch_size},); it "
            f"returned shape {tuple(losses.shape)}"
        )


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
            _check_losses(loss, 1)
            return loss.sum()

        self._per_example = vmap(grad(loss_of_one), in_dims=(None, None, 0), randomness="different")

    @property
    def device(self) -> torch.device:
        """Where the module's parameters, and so the gradients, are."""
        return next(self._wrapper.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The gradients' dtype: the trainable parameters' (read when asked: precision plugins convert the module
        after callbacks are set up)."""
        named = dict(self._wrapper.named_parameters())
        return _promoted(named[name].dtype for name in self._trainable)

    def __call__(self, batch: Any) -> Tensor:
        size = _batch_size(batch)
        named = dict(self._wrapper.named_parameters())
        trainable = {name: named[name].detach() for name in self._trainable}
        fixed = {name: p.detach() for name, p in named.items() if name not in trainable}
        fixed.update({name: b for name, b in self._wrapper.named_buffers()})
        with torch.no_grad():  # torch.func.grad ignores it; it keeps the outer autograd from recording anything
            grads = self._per_example(trainable, fixed, batch)
        return torch.cat([grads[name].reshape(size, -1) for name in self._trainable], dim=1)


class LinearPerExampleGradients:
    """The same ``(batch_size, d)`` gradients as :class:`PerExampleGradients`, for models built of ``nn.Linear`` layers.

    For a linear layer ``y = x W^T + b`` the gradient of example ``i``'s loss ``L_i`` is
    ``dL_i/dW = sum_t g_it x_it^T`` and ``dL_i/db = sum_t g_it`` with ``g_i = dL_i/dy_i`` (``t``
    runs over any dimensions between batch and features, e.g. sequence positions; Goodfellow,
    "Efficient per-example gradient computations", 2015). When examples do not interact in the
    forward pass, the gradient of ``sum_i L_i`` with respect to a layer's output holds every
    ``g_i`` at once, so one batched forward (forward hooks keep each layer's inputs and outputs)
    and one ``autograd.grad`` to the outputs replace vmap's per-example passes. A layer called
    several times adds up its calls. Parameters' ``.grad`` are not touched.

    Only for modules where :meth:`supports` holds: every trainable parameter is the ``weight``
    or ``bias`` of an ``nn.Linear``. A parameter used outside its layer's forward (weight tying
    through ``F.linear``) or examples that interact (BatchNorm in training mode) make the result
    wrong without an error; :func:`make_per_example_gradients` therefore checks it against torch.func
    on the first batch.
    """

    def __init__(self, module: nn.Module, loss_fn: PerExampleLoss) -> None:
        if not self.supports(module):
            raise ValueError("every trainable parameter must belong to an nn.Linear layer for LinearPerExampleGradients")
        self._module = module
        self._loss_fn = loss_fn
        owners = {id(p): (layer, name) for layer in module.modules() if isinstance(layer, nn.Linear)
                  for name, p in layer.named_parameters(recurse=False)}
        # In named_parameters order, as PerExampleGradients flattens them.
        self._parameters = [(owners[id(p)], p) for p in module.parameters() if p.requires_grad]
        self._layers = list({id(layer): layer for (layer, _), _ in self._parameters}.values())
        self.num_parameters = sum(p.numel() for _, p in self._parameters)

    @staticmethod
    def supports(module: nn.Module) -> bool:
        """Whether every trainable parameter of ``module`` (at least one) belongs to an ``nn.Linear``."""
        trainable = [
            isinstance(layer, nn.Linear)
            for layer in module.modules()
            for p in layer.parameters(recurse=False)
            if p.requires_grad
        ]
        return bool(trainable) and all(trainable)

    @property
    def device(self) -> torch.device:
        return self._parameters[0][1].device

    @property
    def dtype(self) -> torch.dtype:
        return _promoted(parameter.dtype for _, parameter in self._parameters)

    def __call__(self, batch: Any) -> Tensor:
        size = _batch_size(batch)
        calls: dict[nn.Module, list[tuple[Tensor, Tensor]]] = {layer: [] for layer in self._layers}

        def record(layer: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
            calls[layer].append((inputs[0].detach(), output))

        handles = [layer.register_forward_hook(record) for layer in self._layers]
        try:
            with torch.enable_grad():
                losses = self._loss_fn(self._module, batch)
        finally:
            for handle in handles:
                handle.remove()
        _check_losses(losses, size)
        recorded = [(layer, inputs, output) for layer, layer_calls in calls.items() for inputs, output in layer_calls]
        output_grads = torch.autograd.grad(
            losses.sum(), [output for _, _, output in recorded], allow_unused=True, materialize_grads=True
        )
        weights: dict[nn.Module, Tensor] = {}
        biases: dict[nn.Module, Tensor] = {}
        for (layer, inputs, _), output_grad in zip(recorded, output_grads):
            inputs = inputs.reshape(size, -1, inputs.shape[-1])
            output_grad = output_grad.detach().reshape(size, -1, output_grad.shape[-1])
            weight = torch.bmm(output_grad.transpose(1, 2), inputs)
            bias = output_grad.sum(dim=1)
            weights[layer] = weights[layer] + weight if layer in weights else weight
            biases[layer] = biases[layer] + bias if layer in biases else bias
        columns = []
        for (layer, name), parameter in self._parameters:
            found = (weights if name == "weight" else biases).get(layer)
            columns.append(found.reshape(size, -1) if found is not None else parameter.new_zeros(size, parameter.numel()))
        return torch.cat(columns, dim=1)


def make_per_example_gradients(
    module: nn.Module, loss_fn: PerExampleLoss, method: str = "auto"
) -> GradientFunction:
    """The per-example gradient function for ``module``: torch.func, or linear layers' outer products where they agree.

    ``method="vmap"`` always uses :class:`PerExampleGradients`. ``"auto"`` uses
    :class:`LinearPerExampleGradients` when it :meth:`~LinearPerExampleGradients.supports` the
    module, after checking on the first batch that both give the same gradients (a warning and
    torch.func from then on if they do not, e.g. with dropout or tied weights).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}")
    reference = PerExampleGradients(module, loss_fn)
    if method == "vmap" or not LinearPerExampleGradients.supports(module):
        return reference
    return _CheckedOnFirstBatch(LinearPerExampleGradients(module, loss_fn), reference)


class _CheckedOnFirstBatch:
    """``fast`` once its first batch's gradients matched ``reference``'s; ``reference`` otherwise."""

    def __init__(self, fast: LinearPerExampleGradients, reference: PerExampleGradients) -> None:
        self._fast = fast
        self._reference = reference
        self.num_parameters = reference.num_parameters
        self.method: Callable[[Any], Tensor] | None = None

    @property
    def device(self) -> torch.device:
        return self._reference.device

    @property
    def dtype(self) -> torch.dtype:
        return self._reference.dtype

    def __call__(self, batch: Any) -> Tensor:
        if self.method is not None:
            return self.method(batch)
        expected = self._reference(batch)
        fast = self._fast(batch)
        # Relative to the largest gradient: 1e-4 in float32; in bfloat16/float16 the two methods round their
        # different sums differently (measured up to 10 eps on a 64-wide MLP in bfloat16), hence 16 eps. Dropout
        # or tied weights change gradients by their own size, far above either.
        relative = max(1e-4, 16 * torch.finfo(expected.dtype).eps)
        tolerance = relative * float(expected.abs().max()) + 1e-7
        if fast.shape == expected.shape and float((fast - expected).abs().max()) <= tolerance:
            self.method = self._fast
        else:
            warnings.warn(
                "per-example gradients from the linear layers' outputs differ from torch.func's on the first batch "
                "(dropout, tied weights, or examples that interact?); using torch.func",
                stacklevel=2,
            )
            self.method = self._reference
        return expected
