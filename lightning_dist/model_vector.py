"""A module's floating-point state seen as one flat vector, the unit every protocol averages."""

from __future__ import annotations

from functools import reduce

import torch
from torch import Tensor, nn

from lightning_dist.algorithms.averaging import all_finite


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

    def get_range(self, start: int, stop: int, dtype: torch.dtype | None = None, out: Tensor | None = None) -> Tensor:
        """A new copy of :meth:`get`'s ``[start, stop)`` without materializing the rest (a fragment or bucket of a
        large model: extra memory of ``stop - start`` elements), or that copy written into ``out`` (a flat tensor of
        ``stop - start`` elements, which is returned)."""
        self._check_range(start, stop)
        if out is not None and out.shape != (stop - start,):
            raise ValueError(f"out must be a flat tensor of {stop - start} elements; got shape {tuple(out.shape)}")
        vector = out if out is not None else torch.empty(stop - start, dtype=dtype or self.dtype,
                                                         device=self._tensors[0].device)
        for tensor, (lo, hi), (offset, _) in self._overlaps(start, stop):
            vector[lo - start:hi - start].copy_(tensor.detach().reshape(-1)[lo - offset:hi - offset])
        return vector

    @torch.no_grad()
    def set_range(self, start: int, values: Tensor) -> None:
        """Copy ``values`` into :meth:`get`'s ``[start, start + len(values))`` in place, the rest untouched."""
        stop = start + values.numel()
        self._check_range(start, stop)
        for tensor, (lo, hi), (offset, _) in self._overlaps(start, stop):
            piece = values[lo - start:hi - start]
            if tensor.is_contiguous():
                tensor.view(-1)[lo - offset:hi - offset].copy_(piece)
            else:  # a strided parameter has no flat view: write its flat copy back whole
                flat = tensor.reshape(-1).clone()
                flat[lo - offset:hi - offset] = piece
                tensor.copy_(flat.view_as(tensor))

    def all_finite(self) -> bool:
        """Whether every entry of :meth:`get`'s vector is finite, without a copy of it."""
        return all(all_finite(tensor.detach()) for tensor in self._tensors)

    def _check_range(self, start: int, stop: int) -> None:
        if not 0 <= start <= stop <= self.numel:
            raise ValueError(f"range [{start}, {stop}) is not within the model vector's {self.numel} elements")

    def _overlaps(self, start: int, stop: int):  # type: ignore[no-untyped-def]
        """``(tensor, (lo, hi), (offset, end))`` for each tensor whose span ``[offset, end)`` meets ``[start, stop)``."""
        offset = 0
        for tensor, size in zip(self._tensors, self._sizes):
            end = offset + size
            if end > start and offset < stop:
                yield tensor, (max(start, offset), min(stop, end)), (offset, end)
            offset = end

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


class VectorRange:
    """Entries ``[offset, offset + numel)`` of a :class:`ModelVector`'s vector, read by slicing: each slice is a copy
    of just those entries (:meth:`ModelVector.get_range`). Code that slices a model-sized vector (a balancing's
    pieces) reads the model through it without a copy of the model."""

    def __init__(self, vector: ModelVector, offset: int, numel: int) -> None:
        vector._check_range(offset, offset + numel)
        self.vector, self.offset, self._numel = vector, offset, numel
        self.dtype: torch.dtype = vector.dtype
        self.device: torch.device = vector.parameters[0].device

    def numel(self) -> int:
        return self._numel

    def __getitem__(self, index: slice) -> Tensor:
        start, stop, step = index.indices(self._numel)
        if step != 1:
            raise ValueError("a VectorRange is read in contiguous slices")
        return self.vector.get_range(self.offset + start, self.offset + max(start, stop))

