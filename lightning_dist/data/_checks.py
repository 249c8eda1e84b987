"""What the data modules raise when a loader is asked for before ``setup``."""

from __future__ import annotations

from typing import Optional, TypeVar

T = TypeVar("T")


def require_setup(owner: object, dataset: Optional[T]) -> T:
    """``dataset``, or the error a datamodule raises when a loader is asked for before ``setup``."""
    if dataset is None:
        raise RuntimeError(f"{type(owner).__name__}.setup() must run before its dataloaders are requested")
    return dataset

