"""The outer step of DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of
Language Models", Algorithm 1), applied to an averaged model.

Plain torch on flat model vectors: no Lightning, no process groups. The periodic and dynamic
averaging strategies and the simulator's protocols call :class:`OuterStep` where they would
otherwise hand every replica the plain average.

Algorithm 1 of the paper, for ``k`` replicas that all started outer round ``t`` from
``theta^(t-1)`` and took ``H`` inner steps each (lines 9, 11 and 12)::

    delta_i^(t) = theta^(t-1) - theta_i^(t)                 (outer gradient of replica i)
    Delta^(t)   = 1/k sum_i delta_i^(t) = theta^(t-1) - mean_i theta_i^(t)
    theta^(t)   = OuterOpt(theta^(t-1), Delta^(t))

and every replica starts round ``t + 1`` from ``theta^(t)`` (line 3). The paper's OuterOpt is SGD
with Nesterov momentum 0.9 and learning rate 0.7 (:func:`diloco_outer_optimizer`). As in torchft's
``DiLoCo`` (``torchft/local_sgd.py``), OuterOpt is a real ``torch.optim`` optimizer: the reference
``theta^(t-1)`` is its parameter, ``Delta^(t)`` is set as that parameter's ``.grad`` and
``optimizer.step()`` produces ``theta^(t)``; so any optimizer can be chosen. ``SGD(lr=1)`` without
momentum gives ``theta^(t) = mean_i theta_i^(t)``: plain model averaging.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_dist.algorithms.averaging import AVERAGE_BUCKET, accumulation_dtype, all_finite

OuterOptimizerFactory = Callable[[Iterable[Tensor]], Optimizer]
"""Builds the outer optimizer over the given tensors, like ``lightning.pytorch.cli.OptimizerCallable``
(``functools.partial(torch.optim.SGD, lr=0.7)``, or ``{class_path: torch.optim.SGD, init_args: ...}``
in a LightningCLI YAML)."""


def diloco_outer_optimizer(params: Iterable[Tensor]) -> Optimizer:
    """DiLoCo's outer optimizer: SGD with learning rate 0.7 and Nesterov momentum 0.9.

    The setting Douillard et al. (2023) use throughout and found best in their ablation of outer
    optimizers, with AdamW as the inner optimizer and ``H = 500`` inner steps.
    """
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


class OuterStep:
    """The reference model ``theta^(t-1)`` of DiLoCo and the outer optimizer that moves it.

    ``start`` is the model every replica starts from; :meth:`step` takes the average of the
    replicas at the end of a round and returns the model they all continue from.

    Precision: the reference is kept in :func:`~lightning_dist.algorithms.averaging.accumulation_dtype`
    (a float32 master for bfloat16/float16 models), so outer updates smaller than the model dtype's
    resolution accumulate instead of being rounded away; what the replicas receive is the reference
    rounded to the model's dtype (:attr:`start`). The outer gradient is measured from that rounded
    model, the one the replicas really started from: ``Delta = start - average``. Measured from the
    float32 master, it would also hold the rounding ``master - start`` as if the replicas had moved
    by it, and the outer step would pull the master onto the low-precision grid every round. For
    float32 and float64 models ``start`` is the reference itself.

    Buffers: the reference covers the first ``start.numel()`` entries of the vectors given to
    :meth:`step` (the model's parameters, which :class:`~lightning_dist.model_vector.ModelVector`
    puts first); later entries (floating-point buffers such as BatchNorm running statistics) are
    returned as averaged. They are statistics, not trained by gradients, and momentum would push a
    running variance past its average, below zero.

    The optimizer sees the reference as consecutive flat pieces of ``bucket`` entries (one group; one piece
    for a model under ``bucket``), so that a strategy can take the outer step a bucket at a time
    (:meth:`step_range`) with no model-sized temporary. Element-wise optimizers (SGD, Nesterov, Adam) behave
    as on the model's tensors, bit for bit whatever the pieces; one that uses per-tensor norms (LARS, LAMB)
    would take each piece as one tensor.

    Args:
        start: the common start model (parameters only), in the model's dtype.
        optimizer: ``OuterOpt``, built once over the reference's pieces.
        bucket: entries per piece (default :data:`~lightning_dist.algorithms.averaging.AVERAGE_BUCKET`).
    """

    def __init__(self, start: Tensor, optimizer: OuterOptimizerFactory, bucket: int = AVERAGE_BUCKET) -> None:
        if start.dim() != 1 or not start.is_floating_point():
            raise ValueError(
                f"start must be a flat floating-point model vector; got {start.dtype} of shape {tuple(start.shape)}"
            )
        self.dtype = start.dtype
        if bucket < 1:
            raise ValueError(f"bucket must be a positive number of entries; got {bucket}")
        self.reference = start.detach().to(accumulation_dtype(start.dtype), copy=True)
        self.bucket = bucket
        self.pieces = list(self.reference.split(bucket))  # views: stepping one moves the reference
        self.optimizer = optimizer(self.pieces)
        if not isinstance(self.optimizer, Optimizer):
            raise ValueError(
                "outer_optimizer must build a torch.optim.Optimizer from the reference tensor; "
                f"got {type(self.optimizer).__name__}"
            )
        self.steps = 0
        self.pseudo_gradient_norm = torch.zeros((), dtype=self.reference.dtype, device=self.reference.device)
        self.update_norm = torch.zeros_like(self.pseudo_gradient_norm)
        self._squares = torch.zeros(2, dtype=self.reference.dtype, device=self.reference.device)

    @property
    def start(self) -> Tensor:
        """``theta^(t-1)`` in the model's dtype: what every replica holds at the start of a round (a copy)."""
        return self.reference.to(self.dtype, copy=True)

    @torch.no_grad()
    def step(self, average: Tensor) -> Tensor:
        """One outer step (Algorithm 1, lines 11-12) from the replicas' ``average``; returns ``theta^(t)``.

        ``average`` is the mean of the replicas, at least as long as the reference (entries past it
        pass through, see the class docstring). The result has ``average``'s length and the model's
        dtype; every replica continues from it.
        """
        size = self.reference.numel()
        if average.dim() != 1 or average.numel() < size:
            raise ValueError(
                f"average must be a flat model vector of at least {size} entries (the reference's); "
                f"got shape {tuple(average.shape)}"
            )
        result = average.to(self.reference.dtype, copy=True)
        for start in range(0, max(size, 1), self.bucket):
            self.step_range(start, result[start:start + self.bucket] if start + self.bucket < size else result[start:])
        return result.to(self.dtype)

    @torch.no_grad()
    def step_range(self, start: int, mean: Tensor) -> Tensor:
        """The outer step of the model vector's entries ``[start, start + len(mean))``, in place in ``mean``.

        ``mean`` holds the replicas' mean there, in the reference's dtype (rounded to the model's dtype first, as
        the replicas would hold it); it is overwritten with ``theta^(t)`` there (entries past the reference pass
        through), which the caller writes back to the model. One outer step is the ranges ``[0, b)``, ``[b, 2b)``,
        ... of ``b = bucket`` entries in order, the last reaching the end of the vector: a strategy averages and
        steps one bucket at a time, and the temporaries are a bucket's.
        """
        size, stop = self.reference.numel(), start + mean.numel()
        if mean.dim() != 1 or mean.dtype != self.reference.dtype or start % self.bucket or (
                stop < size and mean.numel() != self.bucket):
            raise ValueError(
                f"step_range takes whole buckets of {self.bucket} entries from a multiple of it, in "
                f"{self.reference.dtype} (the last bucket reaching past the reference); got {mean.dtype} entries "
                f"[{start}, {stop})"
            )
        if start == 0:
            self._squares.zero_()
        if self.dtype != mean.dtype:  # the mean the replicas would hold: rounded to the model's dtype
            mean.copy_(mean.to(self.dtype))
        if start < size:
            piece, part = self.pieces[start // self.bucket], mean[:min(stop, size) - start]
            begin = piece.to(self.dtype, copy=True).to(piece.dtype)  # theta^(t-1) as the replicas hold it
            pseudo_gradient = part.neg_().add_(begin)  # start - mean (a - b is a + (-b), bit for bit)
            self._squares[0] += torch.linalg.vector_norm(pseudo_gradient).square()
            piece.grad = pseudo_gradient
            self.optimizer.step()  # moves this piece only: the others have no gradient
            piece.grad = None
            if not all_finite(piece):
                raise FloatingPointError(
                    "the outer optimizer's step made the reference model non-finite (the replicas' average was "
                    "finite): lower outer_optimizer's learning rate"
                )
            part.copy_(piece.to(self.dtype))
            self._squares[1] += torch.linalg.vector_norm(begin.sub_(part)).square()
        if start < size <= stop or start == size == 0:  # the range holding the last parameter ends the step
            self.steps += 1
            self.pseudo_gradient_norm, self.update_norm = self._squares.sqrt().unbind()
        return mean

    def metrics(self, prefix: str = "outer") -> dict[str, float]:
        """Outer steps taken and the norms of the last one: ``||Delta||`` and how far it moved the model."""
        return {
            f"{prefix}/steps": float(self.steps),
            f"{prefix}/pseudo_gradient_norm": float(self.pseudo_gradient_norm),
            f"{prefix}/update_norm": float(self.update_norm),
        }

    def state_dict(self) -> dict[str, Any]:
        """Reference, optimizer state and counters, on the host (copies: later steps do not change them)."""

        def to_host(value: Any) -> Any:
            if isinstance(value, Tensor):
                return value.detach().to("cpu", copy=True)
            if isinstance(value, Mapping):
                return {key: to_host(item) for key, item in value.items()}
            if isinstance(value, list):
                return [to_host(item) for item in value]
            return value

        return {
            "reference": to_host(self.reference),
            "optimizer": to_host(self.optimizer.state_dict()),
            "steps": self.steps,
            "pseudo_gradient_norm": to_host(self.pseudo_gradient_norm),
            "update_norm": to_host(self.update_norm),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s result; tensors move to the reference's device."""
        reference = state["reference"]
        if reference.shape != self.reference.shape or reference.dtype != self.reference.dtype:
            raise ValueError(
                f"the outer step's saved reference is {reference.dtype} of shape {tuple(reference.shape)}; this "
                f"model's is {self.reference.dtype} of shape {tuple(self.reference.shape)}"
            )
        self.reference.copy_(reference)
        # Optimizer.load_state_dict moves the state to the parameter's device and dtype.
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
        self.pseudo_gradient_norm = state["pseudo_gradient_norm"].to(self.reference.device)
        self.update_norm = state["update_norm"].to(self.reference.device)
