"""A module's floating-point state seen as one flat vector, the unit every protocol averages."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class ModelVector:
    """Flattens parameters, then floating-point buffers, of ``module`` into one vector.

    Averaging covers parameters and floating-point buffers (BatchNorm running statistics), so
    averaged replicas are identical, not just their weights. Divergence (``parameters_of``) covers
    parameters only, the model weights of paper 004. Integer buffers (BatchNorm's
    ``num_batches_tracked``) advance identically on every rank and are left alone.
    """

    def __init__(self, module: nn.Module) -> None:
        parameters = list(module.parameters())
        buffers = [buffer for buffer in module.buffers() if buffer.is_floating_point()]
        self._tensors = parameters + buffers
        self._sizes = [tensor.numel() for tensor in self._tensors]
        self.num_parameters = sum(parameter.numel() for parameter in parameters)

    def get(self) -> Tensor:
        """A new flat copy of the current state."""
        return torch.cat([tensor.detach().reshape(-1) for tensor in self._tensors])

    @torch.no_grad()
    def set(self, vector: Tensor) -> None:
        """Copy ``vector`` into the module's tensors in place (optimizers keep their references)."""
        for tensor, chunk in zip(self._tensors, vector.split(self._sizes)):
            tensor.copy_(chunk.view_as(tensor))

    def parameters_of(self, vector: Tensor) -> Tensor:
        """The parameter part of a vector produced by ``get``."""
        return vector[: self.num_parameters]
