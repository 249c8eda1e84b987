"""A module's floating-point state seen as one flat vector, the unit every protocol averages."""

from __future__ import annotations

from functools import reduce

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
        self.numel = sum(self._sizes)
        """The length of :meth:`get`'s vector."""
        self.parameters: list[Tensor] = parameters
        self.buffers: list[Tensor] = buffers
        self.num_parameters = sum(parameter.numel() for parameter in parameters)
        self.dtype: torch.dtype = reduce(torch.promote_types, (tensor.dtype for tensor in self._tensors))
        """The dtype of :meth:`get`'s vector (the module's, promoted as ``torch.cat`` would)."""

    def get(self, dtype: torch.dtype | None = None) -> Tensor:
        """A new flat copy of the current state, in ``dtype`` when given (cast piece by piece, no full-size temporary)."""
        if dtype is None:
            return torch.cat([tensor.detach().reshape(-1) for tensor in self._tensors])
        vector = torch.empty(self.numel, dtype=dtype, device=self._tensors[0].device)
        for tensor, chunk in zip(self._tensors, vector.split(self._sizes)):
            chunk.copy_(tensor.detach().reshape(-1))
        return vector

    @torch.no_grad()
    def set(self, vector: Tensor) -> None:
        """Copy ``vector`` into the module's tensors in place (optimizers keep their references)."""
        for tensor, chunk in zip(self._tensors, vector.split(self._sizes)):
            tensor.copy_(chunk.view_as(tensor))

    def parameters_of(self, vector: Tensor) -> Tensor:
        """The parameter part of a vector produced by ``get``."""
        return vector[: self.num_parameters]

    def parameter_views(self, vector: Tensor) -> list[Tensor]:
        """Views of a parameter vector (``parameters_of``'s result, or a reference model) shaped like :attr:`parameters`."""
        sizes = self._sizes[: len(self.parameters)]
        return [chunk.view_as(parameter) for chunk, parameter in zip(vector[: self.num_parameters].split(sizes), self.parameters)]
