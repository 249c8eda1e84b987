"""A byte-level language-modelling corpus that exists offline wherever Python does: the standard library's source.

The corpus is the top-level ``*.py`` files of ``sysconfig.get_paths()["stdlib"]`` (168 files,
4,698,388 bytes in CPython 3.11.7), read as stored (UTF-8) and concatenated in sorted file-name
order. It depends on the Python that runs it, so :meth:`StdlibTextDataModule.corpus_info` gives the
Python version, the file counts, the byte counts and a SHA-256 of the text for every result to record.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sysconfig
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_dist.algorithms.arguments import check_count
from lightning_dist.data._rank_loaders import RankLoaderDataModule, require_setup
from lightning_dist.data.sampler import RESHUFFLED, rank_sampler

TEXT_SPLITS = ("contiguous", "iid", RESHUFFLED)
"""Accepted ``partition`` values of :class:`StdlibTextDataModule` (windows have no labels to sort or skew by)."""


class TextWindows(Dataset):
    """``(x, y)`` pairs cut from one byte tensor: window ``i`` is ``text[s : s + block_size + 1]`` with
    ``s = starts[i]``, ``x`` its first ``block_size`` bytes and ``y`` its last (``x`` shifted by one).

    Only the text (uint8) and the start offsets are held; each window is sliced and widened to int64
    when it is read.
    """

    def __init__(self, text: Tensor, starts: Tensor, block_size: int) -> None:
        self.text = text
        self.starts = starts
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = int(self.starts[index])
        window = self.text[start : start + self.block_size + 1].long()
        return window[:-1], window[1:]


class StdlibTextDataModule(RankLoaderDataModule):
    """Next-byte prediction on the Python standard library's source (see the module docstring).

    - **Split by file**: with ``k = round(1 / val_fraction)``, the files at positions ``k - 1, 2k - 1,
      ...`` of the sorted list (every k-th file) are the validation text, the others the training text,
      each concatenated in sorted order. ``val_fraction=0.1`` puts 16 of the 168 files into validation.
    - **Windows**: a text of ``n`` bytes gives ``(n - 1) // block_size`` windows of ``block_size + 1``
      bytes starting every ``block_size`` bytes, so consecutive windows share one byte and every
      byte after the first is a target exactly once per epoch.
    - **Training**: each rank reads its part of the training windows, by ``partition``:
      ``"contiguous"`` (default: rank ``i`` of ``m`` gets the ``i``-th of ``m`` consecutive stretches of
      the text, sizes differing by at most one window, shuffled within the rank every epoch),
      ``"iid"`` (a seeded random split of the windows) or ``"reshuffled"`` (a fresh random split every
      epoch). Every rank yields the same number of windows per epoch.
    - **Validation** (and test, the same split): the validation windows, or ``max_val_sequences`` of them
      spread evenly over the text (window ``floor(j * n / max_val_sequences)`` for ``j = 0, 1, ...``)
      so that its cost is bounded; ``None`` keeps all.

    ``vocab_size`` (256 byte values) is a class attribute, known before ``setup`` for sizing a model.
    """

    vocab_size = 256

    def __init__(
        self,
        block_size: int = 128,
        batch_size: int = 32,
        partition: str = "contiguous",
        val_fraction: float = 0.1,
        max_val_sequences: Optional[int] = 512,
        seed: int = 0,
        stdlib_dir: Optional[str] = None,
    ) -> None:
        super().__init__()
        self.block_size = check_count("block_size", block_size, 1)
        self.batch_size = check_count("batch_size", batch_size, 1)
        if partition not in TEXT_SPLITS:
            raise ValueError(f"partition must be one of {TEXT_SPLITS}; got {partition!r}")
        self.partition = partition
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 < val_fraction <= 0.5:
            raise ValueError(
                f"val_fraction must be a number with 0 < val_fraction <= 0.5 (every round(1 / val_fraction)-th "
                f"file is held out); got {val_fraction!r}"
            )
        self.val_fraction = float(val_fraction)
        self.max_val_sequences = (None if max_val_sequences is None
                                  else check_count("max_val_sequences", max_val_sequences, 1))
        self.seed = check_count("seed", seed, 0)
        self.stdlib_dir = Path(stdlib_dir if stdlib_dir is not None else sysconfig.get_paths()["stdlib"])
        self.save_hyperparameters()
        self.train_set: Optional[TextWindows] = None
        self.val_set: Optional[TextWindows] = None
        self._corpus: Optional[dict[str, Any]] = None

    @property
    def files(self) -> list[str]:
        """The corpus's file names in their (sorted) order: the top-level ``*.py`` files of ``stdlib_dir``."""
        if not self.stdlib_dir.is_dir():
            raise ValueError(f"stdlib_dir must be a directory; got {str(self.stdlib_dir)!r}")
        return sorted(name for name in os.listdir(self.stdlib_dir)
                      if name.endswith(".py") and (self.stdlib_dir / name).is_file())

    def _load(self) -> dict[str, Any]:
        """Read the files once: the train and validation texts and what :meth:`corpus_info` reports."""
        if self._corpus is not None:
            return self._corpus
        files = self.files
        every = round(1 / self.val_fraction)
        val_files = [name for index, name in enumerate(files) if index % every == every - 1]
        train_files = [name for index, name in enumerate(files) if index % every != every - 1]
        if not val_files:
            raise ValueError(
                f"stdlib_dir {str(self.stdlib_dir)!r} has {len(files)} .py files, fewer than the {every} that "
                f"val_fraction={self.val_fraction} needs to hold one out; raise val_fraction or add files"
            )
        contents = {name: (self.stdlib_dir / name).read_bytes() for name in files}
        texts = {split: b"".join(contents[name] for name in names)
                 for split, names in (("train", train_files), ("val", val_files))}
        for split, text in texts.items():
            if len(text) < self.block_size + 1:
                raise ValueError(
                    f"the {split} text has {len(text)} bytes, fewer than one window of block_size + 1 = "
                    f"{self.block_size + 1}; lower block_size"
                )
        self._corpus = {
            "train_text": torch.frombuffer(bytearray(texts["train"]), dtype=torch.uint8),
            "val_text": torch.frombuffer(bytearray(texts["val"]), dtype=torch.uint8),
            "info": {
                "python_version": platform.python_version(),
                "stdlib_dir": str(self.stdlib_dir),
                "files": len(files),
                "train_files": len(train_files),
                "val_files": len(val_files),
                "train_bytes": len(texts["train"]),
                "val_bytes": len(texts["val"]),
                "sha256": hashlib.sha256(b"".join(contents[name] for name in files)).hexdigest(),
            },
        }
        return self._corpus

    def corpus_info(self) -> dict[str, Any]:
        """What a result must record to say which text it was trained on.

        ``python_version`` (the running Python's), ``stdlib_dir``, ``files``, ``train_files``,
        ``val_files``, ``train_bytes``, ``val_bytes``, ``sha256`` (of all files concatenated in sorted
        order), and the windows: ``block_size``, ``train_windows``, ``val_windows`` (those validated).
        """
        corpus = self._load()
        val_windows = self._window_starts(len(corpus["val_text"]), self.max_val_sequences)
        return {
            **corpus["info"],
            "block_size": self.block_size,
            "train_windows": len(self._window_starts(len(corpus["train_text"]))),
            "val_windows": len(val_windows),
        }

    def _window_starts(self, text_bytes: int, limit: Optional[int] = None) -> Tensor:
        count = (text_bytes - 1) // self.block_size
        indices = np.arange(count, dtype=np.int64)
        if limit is not None and limit < count:
            indices = np.arange(limit, dtype=np.int64) * count // limit  # strictly increasing: limit < count
        return torch.from_numpy(indices * self.block_size)

    def setup(self, stage: Optional[str] = None) -> None:
        # Lightning calls setup once per stage; the splits do not depend on the stage.
        if self.train_set is not None:
            return
        corpus = self._load()
        self.train_set = TextWindows(
            corpus["train_text"], self._window_starts(len(corpus["train_text"])), self.block_size
        )
        self.val_set = TextWindows(
            corpus["val_text"], self._window_starts(len(corpus["val_text"]), self.max_val_sequences), self.block_size
        )

    def train_loader(self, num_replicas: int, rank: int) -> DataLoader:
        """The train loader of rank ``rank`` of ``num_replicas``."""
        train_set = require_setup(self, self.train_set)
        # The window indices stand in for labels: contiguous and iid read only how many there are.
        sampler = rank_sampler(train_set, np.arange(len(train_set)), num_replicas, rank, self.partition, self.seed)
        return DataLoader(train_set, batch_size=self.batch_size, sampler=sampler, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(require_setup(self, self.val_set), batch_size=self.batch_size, num_workers=0)

    def test_dataloader(self) -> DataLoader:
        """The validation split again: a third split would take more files from training."""
        return self.val_dataloader()
