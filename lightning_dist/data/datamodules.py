"""Small classification datamodules that need no download: MNIST-1D (generated) and sklearn digits.

They are sized for running many distributed-training experiments on CPUs. Training batches come from
a :class:`~lightning_dist.data.sampler.PartitionSampler`, so the partition scheme (iid, class-sorted,
Dirichlet) is a datamodule argument; ``partition="reshuffled"`` keeps no fixed split and draws a new
random one every epoch (torch's ``DistributedSampler``); with ``example_order`` ("balanced" for the
CDGraB callback, "random" for D-RR) they come from a :class:`~lightning_dist.data.CDGraBSampler`
instead. Validation and test loaders are plain sequential loaders that Lightning shards itself.
``set_label_permutation`` relabels all splits in place, for concept-drift experiments that change
the task mid-training.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import zipfile
from abc import abstractmethod
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler

from lightning_dist.algorithms.arguments import check_count, check_number
from lightning_dist.data._rank_loaders import RankLoaderDataModule, require_setup
from lightning_dist.data.cdgrab_sampler import ORDERS, CDGraBSampler
from lightning_dist.data.partition import PARTITIONS
from lightning_dist.data.sampler import RESHUFFLED, rank_sampler

TRAIN_SPLITS = (*PARTITIONS, RESHUFFLED)
"""Accepted ``partition`` values: the fixed partitions, and ``reshuffled``."""

Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""``(train_features, train_labels, val_features, val_labels)``."""


class PermutableLabelDataset(Dataset):
    """``(features[i], labels[i])`` pairs whose labels can be remapped through ``permutation`` at any time.

    The remapping happens in ``__getitem__``, so it reaches dataloaders that already exist (with
    ``num_workers=0``, where no worker holds a copy of the dataset).
    """

    def __init__(self, features: Tensor, labels: Tensor) -> None:
        self.features = features
        self.labels = labels
        self.permutation: Optional[Tensor] = None

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        label = self.labels[index]
        if self.permutation is not None:
            label = self.permutation[label]
        return self.features[index], label


class ArrayDataModule(RankLoaderDataModule):
    """Shared behaviour of the in-memory datamodules; subclasses only say how to load their arrays.

    Subclasses set ``num_features`` and ``num_classes`` as class attributes, so they are known
    before ``setup`` (to size a model, e.g. through LightningCLI's ``link_arguments``).
    """

    num_features: int
    num_classes: int

    def __init__(
        self,
        batch_size: int = 32,
        partition: str = "iid",
        dirichlet_alpha: float = 0.5,
        seed: int = 0,
        val_fraction: float = 0.2,
        example_order: Optional[str] = None,
    ) -> None:
        super().__init__()
        if example_order is not None:
            if example_order not in ORDERS:
                raise ValueError(f"example_order must be None or one of {ORDERS}; got {example_order!r}")
            if partition != "iid":
                raise ValueError(
                    "example_order uses CDGraBSampler's fixed random partition; it needs partition='iid', got "
                    f"partition={partition!r}"
                )
        self.example_order = example_order
        self.batch_size = check_count("batch_size", batch_size, 1)
        if partition not in TRAIN_SPLITS:
            raise ValueError(f"partition must be one of {TRAIN_SPLITS}; got {partition!r}")
        self.partition = partition
        self.dirichlet_alpha = check_number("dirichlet_alpha", dirichlet_alpha, 0.0, strict=True)
        self.seed = check_count("seed", seed, 0)
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must be a number with 0 < val_fraction < 1; got {val_fraction!r}")
        self.val_fraction = float(val_fraction)
        self.train_set: Optional[PermutableLabelDataset] = None
        self.val_set: Optional[PermutableLabelDataset] = None
        self._label_permutation: Optional[Tensor] = None

    @abstractmethod
    def _load_arrays(self) -> Arrays:
        """Return the train and validation arrays; called once, by the first ``setup``."""

    def setup(self, stage: Optional[str] = None) -> None:
        # Lightning calls setup once per stage; the splits do not depend on the stage.
        if self.train_set is not None:
            return
        x_train, y_train, x_val, y_val = self._load_arrays()
        self.train_set = _to_dataset(x_train, y_train)
        self.val_set = _to_dataset(x_val, y_val)
        self._apply_label_permutation()

    def set_label_permutation(self, perm: Optional[Sequence[int]]) -> None:
        """From now on, let every split return ``perm[y]`` instead of ``y``; ``None`` restores ``y``.

        ``perm`` must be a permutation of ``range(num_classes)``. Applies to dataloaders already
        created, and is kept for datasets created by a later ``setup``.
        """
        if perm is None:
            self._label_permutation = None
        else:
            values = np.asarray(perm)
            if values.shape != (self.num_classes,) or sorted(values.tolist()) != list(range(self.num_classes)):
                raise ValueError(f"perm must be a permutation of range({self.num_classes}) or None; got {perm!r}")
            self._label_permutation = torch.as_tensor(values, dtype=torch.int64)
        self._apply_label_permutation()

    def _apply_label_permutation(self) -> None:
        for dataset in (self.train_set, self.val_set):
            if dataset is not None:
                dataset.permutation = self._label_permutation

    def train_loader(self, num_replicas: int, rank: int) -> DataLoader:
        """The train loader of rank ``rank`` of ``num_replicas``."""
        train_set = require_setup(self, self.train_set)
        sampler: Sampler
        if self.example_order is not None:
            sampler = CDGraBSampler(
                train_set, self.batch_size, num_replicas, rank, order=self.example_order, seed=self.seed
            )
        else:
            sampler = rank_sampler(
                train_set, train_set.labels.numpy(), num_replicas, rank, self.partition, self.seed, self.dirichlet_alpha
            )
        return DataLoader(train_set, batch_size=self.batch_size, sampler=sampler, num_workers=0)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(require_setup(self, self.val_set), batch_size=self.batch_size, num_workers=0)

    def test_dataloader(self) -> DataLoader:
        """The validation split again: these datasets are too small to hold out a third split."""
        return self.val_dataloader()

def _to_dataset(features: np.ndarray, labels: np.ndarray) -> PermutableLabelDataset:
    return PermutableLabelDataset(
        torch.from_numpy(np.asarray(features, dtype=np.float32).copy()),
        torch.from_numpy(np.asarray(labels, dtype=np.int64).copy()),
    )


class DigitsDataModule(ArrayDataModule):
    """scikit-learn's 1797 8x8 digit images (shipped with sklearn), as 64 features in [0, 1].

    Train and validation come from a seeded stratified split with ``val_fraction`` held out; the
    test loader reuses the validation split.
    """

    num_features = 64
    num_classes = 10

    def __init__(
        self,
        batch_size: int = 32,
        partition: str = "iid",
        dirichlet_alpha: float = 0.5,
        seed: int = 0,
        val_fraction: float = 0.2,
        example_order: Optional[str] = None,
    ) -> None:
        super().__init__(batch_size, partition, dirichlet_alpha, seed, val_fraction, example_order)
        self.save_hyperparameters()

    def _load_arrays(self) -> Arrays:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        digits = load_digits()
        features = digits.data / 16.0  # pixel intensities are 0..16
        x_train, x_val, y_train, y_val = train_test_split(
            features, digits.target, test_size=self.val_fraction, stratify=digits.target, random_state=self.seed
        )
        return x_train, y_train, x_val, y_val


class MNIST1DDataModule(ArrayDataModule):
    """MNIST-1D (Greydanus, 2020): 10 classes of length-40 signals, generated offline.

    ``num_samples`` examples are generated with ``seed`` (``num_samples`` is rounded down to a
    multiple of 10, one tenth per class) and split into ``1 - val_fraction`` for training and the
    rest for validation; the test loader reuses the validation split. Generating 4000 examples takes
    about 1.6 s, so the arrays are cached in-process and as ``.npz`` files under
    ``$XDG_CACHE_HOME/lightning_dist`` (default ``~/.cache/lightning_dist``).
    """

    num_features = 40
    num_classes = 10

    def __init__(
        self,
        num_samples: int = 4000,
        batch_size: int = 32,
        partition: str = "iid",
        dirichlet_alpha: float = 0.5,
        seed: int = 0,
        val_fraction: float = 0.2,
        example_order: Optional[str] = None,
    ) -> None:
        super().__init__(batch_size, partition, dirichlet_alpha, seed, val_fraction, example_order)
        self.num_samples = check_count("num_samples", num_samples, self.num_classes)
        usable = self.num_samples // self.num_classes * self.num_classes
        num_train = int(usable * (1 - self.val_fraction))
        if not 0 < num_train < usable:
            raise ValueError(
                f"num_samples={num_samples} with val_fraction={val_fraction} leaves an empty train or "
                "validation split; raise num_samples or move val_fraction away from 0 and 1"
            )
        self.save_hyperparameters()

    def prepare_data(self) -> None:
        # Runs on one process per node before setup, so the other ranks read the disk cache
        # instead of each generating the same data.
        _mnist1d_arrays(self.num_samples, self.seed, 1 - self.val_fraction)

    def _load_arrays(self) -> Arrays:
        return _mnist1d_arrays(self.num_samples, self.seed, 1 - self.val_fraction)


_ARRAY_NAMES = ("x", "y", "x_test", "y_test")


@functools.lru_cache(maxsize=8)
def _mnist1d_arrays(num_samples: int, seed: int, train_split: float) -> Arrays:
    # Imported here: mnist1d pulls in matplotlib and scipy (about 1 s), needed only on a cache miss.
    from mnist1d.data import get_dataset_args

    args = get_dataset_args(as_dict=True)
    args.update(num_samples=num_samples, seed=seed, train_split=train_split)
    key = json.dumps({"args": args, "mnist1d": version("mnist1d")}, sort_keys=True)
    path = _cache_dir() / f"mnist1d-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz"
    arrays = _read_cache(path)
    if arrays is None:
        arrays = _generate_mnist1d(args)
        _write_cache(path, arrays)
    return arrays


def _read_cache(path: Path) -> Optional[Arrays]:
    try:
        with np.load(path, allow_pickle=False) as cached:
            return tuple(cached[name] for name in _ARRAY_NAMES)  # type: ignore[return-value]
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        return None  # missing or unreadable: the caller generates the data again


def _write_cache(path: Path, arrays: Arrays) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename, so a rank reading concurrently never sees a half-written file.
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
        np.savez(tmp, **dict(zip(_ARRAY_NAMES, arrays)))
        os.replace(tmp, path)
    except OSError:
        pass  # the disk cache is an optimization; an unwritable cache dir must not stop training


def _generate_mnist1d(args: dict) -> Arrays:
    from mnist1d.data import make_dataset
    from mnist1d.utils import ObjectView

    # make_dataset reseeds the global `random` and `numpy.random` generators; restore them so that
    # building a datamodule does not change the caller's random stream.
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        data = make_dataset(ObjectView(args))
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)
    return data["x"], data["y"], data["x_test"], data["y_test"]


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lightning_dist"
