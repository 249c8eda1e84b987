"""Fixed-size byte rows for training records, so that records can travel in one all-gather.

A record is whatever ``dataset[i]`` returns: a tensor, array or number, or a tuple/list/dict of
them (e.g. ``(features, label)``). DataGossip sends ``k`` records per exchange as one ``uint8``
tensor of shape ``(k, record_nbytes)``: fixed shapes let every rank allocate the receive buffers
without a size exchange, and one collective per exchange keeps the collective order trivial.
Receivers rebuild the records with the same structure and types, so foreign records can be
batched with the train loader's own ``collate_fn`` exactly like local ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils import _pytree as pytree

_SCALARS = {bool: torch.bool, int: torch.int64, float: torch.float64}


@dataclass(frozen=True)
class _Leaf:
    """How one leaf of a record is stored: its kind, dtype, shape and size in bytes."""

    kind: str  # "tensor", "ndarray", "numpy_scalar", "bool", "int", "float", "none"
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @staticmethod
    def of(value: Any, where: str) -> _Leaf:
        if value is None:
            return _Leaf("none", "", (), 0)
        if isinstance(value, Tensor):
            return _Leaf("tensor", str(value.dtype), tuple(value.shape), value.numel() * value.element_size())
        if isinstance(value, np.ndarray) or isinstance(value, np.generic):
            kind = "ndarray" if isinstance(value, np.ndarray) else "numpy_scalar"
            try:
                torch.from_numpy(np.asarray(value).reshape(-1)[:0].copy())
            except TypeError as error:
                raise ValueError(f"DataGossip cannot send numpy dtype {value.dtype} (record leaf {where})") from error
            return _Leaf(kind, str(value.dtype), tuple(np.shape(value)), int(np.asarray(value).nbytes))
        for python_type, dtype in _SCALARS.items():
            if type(value) is python_type:
                return _Leaf(python_type.__name__, str(dtype), (), torch.empty((), dtype=dtype).element_size())
        raise ValueError(
            "DataGossip sends records made of tensors, numpy arrays and numbers (in tuples, lists or dicts); "
            f"record leaf {where} is a {type(value).__name__}"
        )

    def to_bytes(self, value: Any) -> Tensor:
        if self.kind == "none":
            return torch.zeros(0, dtype=torch.uint8)
        if self.kind == "tensor":
            tensor = value.detach().cpu()
        elif self.kind in ("ndarray", "numpy_scalar"):
            tensor = torch.from_numpy(np.ascontiguousarray(value))
        else:
            tensor = torch.tensor(value, dtype=_SCALARS[type(value)])
        return tensor.contiguous().reshape(-1).view(torch.uint8)

    def from_bytes(self, row: Tensor) -> Any:
        if self.kind == "none":
            return None
        if self.kind in ("tensor", "bool", "int", "float"):
            dtype = getattr(torch, self.dtype.removeprefix("torch."))
            tensor = row.clone().view(dtype).reshape(self.shape)
            return tensor if self.kind == "tensor" else tensor.item()
        array = row.clone().numpy().view(np.dtype(self.dtype)).reshape(self.shape)
        return array if self.kind == "ndarray" else array[()]


class RecordCodec:
    """Packs records shaped like ``example`` into ``uint8`` rows of ``record_nbytes`` and back."""

    def __init__(self, example: Any) -> None:
        leaves, self.treespec = pytree.tree_flatten(example)
        self.leaves = [_Leaf.of(leaf, f"#{i}") for i, leaf in enumerate(leaves)]
        self.record_nbytes = sum(leaf.nbytes for leaf in self.leaves)

    def describe(self) -> str:
        """Structure, dtypes and shapes, comparable across ranks."""
        leaves = ", ".join(f"{leaf.kind}[{leaf.dtype}]{list(leaf.shape)}" for leaf in self.leaves)
        structure = " ".join(str(self.treespec).split())  # TreeSpec's repr spans lines
        return f"{structure} with leaves ({leaves})"

    def encode(self, records: Sequence[Any], indices: Sequence[int]) -> Tensor:
        """Rows of ``records`` (``dataset[i]`` for ``i`` in ``indices``); raises if one differs in shape or dtype."""
        rows = torch.zeros(len(records), self.record_nbytes, dtype=torch.uint8)
        for row, record, index in zip(rows, records, indices):
            leaves, treespec = pytree.tree_flatten(record)
            specs = [_Leaf.of(leaf, f"#{i}") for i, leaf in enumerate(leaves)]
            if treespec != self.treespec or specs != self.leaves:
                other = RecordCodec(record).describe()
                raise ValueError(
                    "DataGossip exchanges fixed-shape records: every record must have the structure, shapes "
                    f"and dtypes of the first one ({self.describe()}); dataset[{index}] is {other}"
                )
            if self.record_nbytes:
                row.copy_(torch.cat([spec.to_bytes(leaf) for spec, leaf in zip(specs, leaves)]))
        return rows

    def decode(self, rows: Tensor) -> list[Any]:
        """The records packed in ``rows`` (shape ``(n, record_nbytes)``)."""
        if rows.dim() != 2 or rows.shape[1] != self.record_nbytes or rows.dtype != torch.uint8:
            raise ValueError(
                f"foreign records must be uint8 rows of {self.record_nbytes} bytes (the local record size); "
                f"got {rows.dtype} rows of shape {tuple(rows.shape)}"
            )
        records = []
        for row in rows:
            leaves, offset = [], 0
            for spec in self.leaves:
                leaves.append(spec.from_bytes(row[offset : offset + spec.nbytes]))
                offset += spec.nbytes
            records.append(pytree.tree_unflatten(leaves, self.treespec))
        return records
