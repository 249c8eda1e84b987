"""What the large-model study measures memory with: the process's peak resident set, and the tensors a strategy keeps.

**Peak memory: the kernel's high-water mark of the resident set.** Linux keeps ``VmHWM`` in
``/proc/self/status``, the largest resident set the process has had, updated on every page fault that grows it: a
peak however short is never missed (no sampling thread). Writing ``5`` to ``/proc/self/clear_refs`` resets it to the
current resident set, so :class:`PeakRSS` measures the peak of a window: the steps that include a synchronization.
What makes the resident set follow the tensors: the CPU tensor allocator gets its memory from glibc's ``malloc``,
which returns large blocks to the kernel only when they were mapped for themselves. Its threshold for that adapts
at run time (a freed block may stay in the heap and be reused, invisibly), unless it is fixed: with
``MALLOC_MMAP_THRESHOLD_=131072`` in the environment (:data:`MALLOC_ENV`) every block of 128 KiB or more is mapped
when allocated and unmapped when freed. The measure then counts everything the process holds at its peak, the
tensors and Gloo's buffers and Python's objects alike: what an out-of-memory failure would count.

What it does not count: pages never written (``torch.empty`` untouched), which hold no memory. What it counts that
is no tensor: the interpreter, torch's and Lightning's code and data (about the same in every row, so it drops out
of a difference between two rows). ``tests/benchmarks/test_large_model.py`` checks it on known allocations: a
64 MiB tensor written and freed raises the peak by 64 MiB and leaves the resident set where it was, and a reset
forgets a larger earlier peak.

**The strategy's own tensors** (:func:`state_nbytes`): every tensor reachable from a strategy's attributes through
this package's objects, containers and optimizers, each storage counted once, by device, leaving out the model's
parameters and gradients and the training optimizer's state. It shows what a strategy holds between steps (its
reference model, anchor, outer momentum, residuals, mirrors), not its transient copies during a synchronization
(the peak shows those), and nothing held in C++ (DDP's gradient buckets).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

MMAP_THRESHOLD = 131072
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
"""The environment a measured process starts with: glibc maps (and unmaps on free) every block of 128 KiB or more."""

STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def status_bytes(field: str, status: str | None = None) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``), in bytes; ``status`` the file's text if given."""
    text = STATUS.read_text() if status is None else status
    for line in text.splitlines():
        if line.startswith(field + ":"):
            value, unit = line.split()[1:3]
            if unit != "kB":
                raise RuntimeError(f"{field} is in {unit!r}, not kB")
            return int(value) * 1024
    raise RuntimeError(f"{field} is not in /proc/self/status (not Linux?)")


class PeakRSS:
    """The peak resident set of this process over a window: :meth:`reset` opens it, :meth:`peak` reads it.

    Refuses to measure unless glibc's mmap threshold is fixed (:data:`MALLOC_ENV` in the environment at start-up;
    the variable is read once, when the process starts), because a freed block kept in the heap would let a later
    allocation reuse it without raising the resident set.
    """

    def __init__(self, require_fixed_threshold: bool = True) -> None:
        if require_fixed_threshold and os.environ.get("MALLOC_MMAP_THRESHOLD_") != str(MMAP_THRESHOLD):
            raise RuntimeError(
                f"start the process with MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD} in its environment: otherwise freed "
                "tensor memory can stay in glibc's heap and the resident set does not follow the tensors"
            )
        self.start: int | None = None

    def reset(self) -> int:
        """Reset the high-water mark to the current resident set; return that (bytes)."""
        CLEAR_REFS.write_text("5")
        self.start = status_bytes("VmRSS")
        return self.start

    def peak(self) -> int:
        """The largest resident set since :meth:`reset` (bytes)."""
        if self.start is None:
            raise RuntimeError("reset() opens the window before peak() can read it")
        return status_bytes("VmHWM")

    @staticmethod
    def current() -> int:
        """The resident set now (bytes)."""
        return status_bytes("VmRSS")


def storage_key(tensor: Tensor) -> tuple[str, int] | None:
    """The identity of ``tensor``'s storage (device, address), or None for a tensor with no memory (meta, empty)."""
    if tensor.device.type == "meta":
        return None
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return None
    return (str(tensor.device), storage.data_ptr())


def _walked_type(value: Any) -> bool:
    """Whether :func:`tensor_storages` looks inside ``value``'s attributes: this package's objects (and the study's),
    torch optimizers; not modules (the model), Lightning's objects, threads, process groups."""
    if isinstance(value, nn.Module):
        return False
    if isinstance(value, torch.optim.Optimizer):
        return True
    module = type(value).__module__ or ""
    return module.startswith(("lightning_dist.", "benchmarks.")) and hasattr(value, "__dict__")


def tensor_storages(root: Any, skip: Iterable[Any] = ()) -> dict[tuple[str, int], int]:
    """Every tensor storage reachable from ``root`` (its ``vars()`` if it is an object), by :func:`storage_key`, with
    its size in bytes. Walks dicts, lists, tuples, sets, this package's objects (:func:`_walked_type`) and optimizers'
    ``state``; ``skip`` holds objects not to enter (the training optimizers)."""
    skipped = {id(obj) for obj in skip}
    seen: set[int] = set()
    found: dict[tuple[str, int], int] = {}
    stack: list[Any] = [vars(root) if hasattr(root, "__dict__") else root]
    while stack:
        value = stack.pop()
        if id(value) in seen or id(value) in skipped:
            continue
        seen.add(id(value))
        if isinstance(value, Tensor):
            key = storage_key(value)
            if key is not None:
                found[key] = value.untyped_storage().nbytes()
        elif isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend(value)
        elif isinstance(value, torch.optim.Optimizer):
            stack.extend(value.state.values())
        elif _walked_type(value):
            stack.extend(vars(value).values())
    return found


def model_storages(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> set[tuple[str, int]]:
    """The storages a model's training holds in any strategy: parameters, buffers, gradients, optimizer state."""
    keys: set[tuple[str, int]] = set()
    tensors: list[Tensor] = [*module.parameters(), *module.buffers()]
    tensors += [parameter.grad for parameter in module.parameters() if parameter.grad is not None]
    for optimizer in optimizers:
        for state in optimizer.state.values():
            tensors += [value for value in state.values() if isinstance(value, Tensor)]
    for tensor in tensors:
        key = storage_key(tensor)
        if key is not None:
            keys.add(key)
    return keys


def state_nbytes(strategy: Any, module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> dict[str, int]:
    """Bytes of the tensors ``strategy`` holds beyond the model's training state, by device type (``{"cpu": ...}``)."""
    optimizers = list(optimizers)
    excluded = model_storages(module, optimizers)
    by_device: dict[str, int] = {}
    for key, nbytes in tensor_storages(strategy, skip=optimizers).items():
        if key not in excluded:
            device = key[0].split(":")[0]
            by_device[device] = by_device.get(device, 0) + nbytes
    return by_device
