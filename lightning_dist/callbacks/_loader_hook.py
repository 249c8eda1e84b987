"""Let a callback see, and wrap, the train loader of ``fit`` before Lightning iterates it.

Lightning builds the train loader in ``FitLoop.setup_data`` and fetches its first batch right
away, before any ``on_train_start`` or ``on_train_epoch_start`` hook. The one place a callback
can act in between is ``Strategy.process_dataloader``, which ``setup_data`` calls on the new
loader; this wraps it on the strategy instance, and puts it back on removal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import lightning.pytorch as pl


class TrainLoaderHook:
    """Call ``on_train_loader(loader)`` on the train loader of fit and train on what it returns.

    Validation and test loaders pass through untouched. Install it in the callback's ``setup``
    (every rank), :meth:`remove` it in ``teardown`` and ``on_exception``.
    """

    def __init__(self, trainer: pl.Trainer, on_train_loader: Callable[[object], object]) -> None:
        strategy = trainer.strategy
        self._strategy: Optional[object] = strategy
        # An instance attribute set by another hook before us, to put back on removal.
        self._previous = strategy.__dict__.get("process_dataloader")
        inner = strategy.process_dataloader

        def process_dataloader(dataloader: object) -> object:
            dataloader = inner(dataloader)
            return on_train_loader(dataloader) if trainer.training else dataloader

        self._ours = process_dataloader
        strategy.process_dataloader = process_dataloader

    def remove(self) -> None:
        strategy, self._strategy = self._strategy, None
        if strategy is None or strategy.__dict__.get("process_dataloader") is not self._ours:
            return
        if self._previous is None:
            del strategy.process_dataloader
        else:
            strategy.process_dataloader = self._previous
