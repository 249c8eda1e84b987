"""Batched workers (``Simulation(batched_workers=k)``): the training steps in progress at one virtual instant computed
together, up to ``k`` replicas in one ``torch.func.vmap`` call, instead of one Python-level forward and backward per
worker.

A simulated run of hundreds of workers of a small model spends its time in Python: every worker's
``training_step`` and autograd's graph, one after another. With a modelled step duration
(:class:`~lightning_dist.sim.engine.SpeedModel`) the workers of a local-update protocol step nearly in lockstep
between their synchronizations, so their steps overlap in virtual time and can be computed as one:
``torch.func.functional_call`` runs the module's own ``training_step`` on one shell copy of the module, and
``vmap(grad_and_value(...))`` over the group's stacked parameters, buffers and batches gives every worker's loss
and gradient.

What stays per worker: its batches, its optimizer and schedulers (each replica applies its own gradient with its
own optimizer, so any optimizer and schedule work), its step count, and when the step becomes visible. Only a
worker's own program changes its model (the protocols set a replica between its steps, in its own
``after_step`` or ``join``), so a step's inputs are fixed from the start of its interval: a worker registers its
step then (:meth:`BatchedSteps.submit`), and when the first registered step ends, every step started by then is
computed, grouped by batch shapes and step index. Each worker applies its gradient when its own step ends
(:meth:`BatchedSteps.finish`, run by :meth:`~lightning_dist.sim.engine.Node.execute` at the end of the
interval), in the order the per-worker path runs the steps, so what anyone reads in between (an evaluation, a
peer) is what it would have read.

Equality: the group's matrix products are batched kernels that sum in another order than one model's, so losses
and gradients agree with the per-worker path to float32 rounding, not bit for bit; protocols whose decisions follow
the models (dynamic averaging's threshold) may then decide a check later or earlier, as on another CPU
(:mod:`lightning_dist.sim.numerics`). ``tests/sim/test_batched.py`` bounds the difference per protocol.

Refused by name, before the run or at the first group: a ``training_step`` that draws random numbers (dropout
with ``p > 0``: ``vmap`` cannot draw what the per-worker path draws), that changes a buffer in place (BatchNorm's
running statistics), or whose loss leaves a trainable parameter unreached (the per-worker path leaves its gradient
None, which optimizers skip; a batched gradient would be zeros); batches that are not tensors or tuples, lists
or dicts of them. Steps whose batches differ in shape (an epoch's last short batch) or step index form groups of
their own.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Optional

import lightning as L
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, vmap

from lightning_dist.sim.replica import NodeReplica, Replica


class _TrainingStep(nn.Module):
    """The module's ``training_step`` as a ``forward``, so ``functional_call`` runs it with other parameters."""

    def __init__(self, module: L.LightningModule) -> None:
        super().__init__()
        self.module = module
        self.module.log = lambda *args, **kwargs: None  # a logged tensor under vmap has no value to keep

    def forward(self, batch: Any, batch_idx: int) -> Tensor:
        output = self.module.training_step(batch, batch_idx)
        return output["loss"] if isinstance(output, dict) else output


def check_batchable(model: L.LightningModule) -> None:
    """Refuse, by name, a module whose running statistics batched workers could not keep (see the module docstring)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats:
            raise ValueError(
                f"batched_workers cannot keep the running statistics of {name or 'the model'} "
                f"({type(module).__name__}): vmap computes the group's steps on copies of its buffers; "
                "use batched_workers=None"
            )


def _stack(batches: Sequence[Any]) -> Any:
    """The batches of a group stacked leaf by leaf along a new first dimension."""
    first = batches[0]
    if isinstance(first, Tensor):
        return torch.stack(batches)
    if isinstance(first, Mapping):
        return {key: _stack([batch[key] for batch in batches]) for key in first}
    return type(first)(_stack(list(items)) for items in zip(*batches))


def _signature(batch: Any) -> Hashable:
    """What must be equal for two batches to be stacked: their structure and every tensor's shape and dtype."""
    if isinstance(batch, Tensor):
        return (tuple(batch.shape), batch.dtype)
    if isinstance(batch, Mapping):
        return ("dict", tuple((key, _signature(value)) for key, value in batch.items()))
    if isinstance(batch, (tuple, list)):
        return (type(batch).__name__, tuple(_signature(item) for item in batch))
    raise TypeError(
        f"batched_workers needs batches of tensors or tuples, lists or dicts of them; got a {type(batch).__name__}"
    )


class _Entry:
    """One worker's step from its start: its replica and batches, then its gradients and losses once computed."""

    def __init__(self, replica: Replica, batches: list[Any]) -> None:
        self.replica, self.batches = replica, batches
        self.result: Optional[tuple[list[Tensor], list[float]]] = None


class BatchedSteps:
    """The training steps of one simulation, each computed with every step started by the time the first of them
    ends, in groups of at most ``group_size`` replicas (see the module docstring).

    Args:
        template: the module every replica copies (a shell copy runs the group's ``training_step``).
        group_size: replicas per ``vmap`` call, ``>= 1``: memory grows with it (the group's parameters,
            gradients and activations), Python's share of the work shrinks with it.
    """

    def __init__(self, template: L.LightningModule, group_size: int) -> None:
        self.group_size = group_size
        shell = copy.deepcopy(template)
        shell.train()
        self._shell = _TrainingStep(shell)
        self._pending: list[_Entry] = []
        self._checked = False
        self.steps = 0
        """Steps computed so far."""
        self.calls = 0
        """``vmap`` calls that computed them: ``steps / calls`` replicas a call on average."""
        # The shell's names for what a replica's module holds, in the order _tensors lists them.
        parameters = list(shell.named_parameters())
        self._trainable_names = [f"module.{name}" for name, parameter in parameters if parameter.requires_grad]
        self._fixed_names = ([f"module.{name}" for name, parameter in parameters if not parameter.requires_grad]
                             + [f"module.{name}" for name, _ in shell.named_buffers()])
        self._replica_tensors: dict[int, tuple[list[Tensor], list[Tensor]]] = {}

    def _tensors(self, replica: Replica) -> tuple[list[Tensor], list[Tensor]]:
        """``replica``'s trainable parameters, and its frozen parameters and buffers, in the shell's names' order
        (listed once: walking a module's tree is the slow part of a small model's step)."""
        if id(replica) not in self._replica_tensors:
            parameters = list(replica.module.parameters())
            self._replica_tensors[id(replica)] = (
                [parameter for parameter in parameters if parameter.requires_grad],
                [parameter for parameter in parameters if not parameter.requires_grad] + list(replica.module.buffers()),
            )
        return self._replica_tensors[id(replica)]

    def submit(self, replica: Replica, batch: Any) -> _Entry:
        """Start ``replica``'s optimizer step on ``batch`` (a :class:`NodeReplica`'s: one batch per local rank)."""
        entry = _Entry(replica, batch if isinstance(replica, NodeReplica) else [batch])
        self._pending.append(entry)
        return entry

    def finish(self, entry: _Entry) -> float:
        """End ``entry``'s step at the end of its interval: computed now with every step started so far if it was
        not yet, its gradient applied by its replica's optimizer; returns its training loss."""
        if entry.result is None:
            self._compute()
        gradients, losses = entry.result
        entry.result = None
        entry.replica.apply_gradient(gradients)
        return sum(losses) / len(losses)

    def _compute(self) -> None:
        entries, self._pending = self._pending, []
        groups: dict[Hashable, list[_Entry]] = defaultdict(list)
        for entry in entries:
            groups[(entry.replica.steps, tuple(_signature(batch) for batch in entry.batches))].append(entry)
        for group in groups.values():
            for start in range(0, len(group), self.group_size):
                self._compute_group(group[start:start + self.group_size])

    def _compute_group(self, group: list[_Entry]) -> None:
        if not self._checked:
            _check_reached(group[0])
            self._checked = True
        trainable = _stacked(self._trainable_names, [self._tensors(entry.replica)[0] for entry in group])
        fixed = _stacked(self._fixed_names, [self._tensors(entry.replica)[1] for entry in group])
        batches = [_stack([entry.batches[index] for entry in group]) for index in range(len(group[0].batches))]
        shell, step_index, count = self._shell, group[0].replica.steps, len(group[0].batches)

        def loss(trainable: dict[str, Tensor], fixed: dict[str, Tensor], batches: list[Any]) -> tuple[Tensor, Tensor]:
            losses = [functional_call(shell, {**trainable, **fixed}, (batch, step_index)) for batch in batches]
            # A NodeReplica's rule: each local rank's loss divided by L, their gradients summed.
            total = sum(value / count for value in losses) if count > 1 else losses[0]
            return total, torch.stack(losses).detach()

        try:
            gradients, (_, losses) = vmap(grad_and_value(loss, has_aux=True), randomness="error")(
                trainable, fixed, batches
            )
        except RuntimeError as error:
            if "randomness" not in str(error):
                raise
            raise ValueError(
                "batched_workers needs a training_step without random operations (dropout with p > 0): vmap cannot "
                "draw the numbers each worker draws on its own; use batched_workers=None"
            ) from error
        changed = [name.removeprefix("module.") for name, tensor in fixed.items() if tensor._version]
        if changed:
            raise ValueError(
                f"batched_workers cannot keep what a training_step changes in place ({', '.join(changed)}): the "
                "group computes on copies; use batched_workers=None"
            )
        self.steps, self.calls = self.steps + len(group), self.calls + 1
        rows = zip(*(gradient.unbind() for gradient in gradients.values()))
        for entry, row, entry_losses in zip(group, rows, losses.tolist()):
            entry.result = list(row), entry_losses


def _stacked(names: list[str], rows: list[list[Tensor]]) -> dict[str, Tensor]:
    """The replicas' tensors (a row per replica, in ``names``' order) stacked along a new first dimension."""
    return {name: torch.stack([row[index].detach() for row in rows]) for index, name in enumerate(names)}


def _check_reached(entry: _Entry) -> None:
    """Refuse, by name, trainable parameters the loss does not reach: one per-worker backward of ``entry``'s batches
    (its gradients dropped; the replica's model is not changed)."""
    module = entry.replica.module
    module.zero_grad(set_to_none=True)
    for batch in entry.batches:
        entry.replica._loss(batch).backward()
    unreached = [name for name, parameter in module.named_parameters()
                 if parameter.requires_grad and parameter.grad is None]
    module.zero_grad(set_to_none=True)
    if unreached:
        raise ValueError(
            f"batched_workers needs every trainable parameter in the loss; not reached: {', '.join(unreached)} "
            "(the per-worker path skips them, a batched gradient would be zeros): freeze them or use "
            "batched_workers=None"
        )
