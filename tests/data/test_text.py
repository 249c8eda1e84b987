"""StdlibTextDataModule: offline, a sorted file list split by file, windows shifted by one, bounded validation,
rank shards that are disjoint, cover the text and give every rank the same batches, and corpus_info."""

import hashlib
import os
import platform
import socket
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from lightning_dist.data import StdlibTextDataModule
from lightning_dist.data.sampler import PartitionSampler

# Unequal sizes and a non-ASCII byte; the file names are not created in sorted order.
FILES = {
    "c.py": b"print('c')\n" * 7,
    "a.py": "# caf\u00e9\n".encode() * 11,
    "e.py": b"x = 5\n" * 13,
    "b.py": b"import os\n" * 5,
    "d.py": b"pass\n" * 17,
}


@pytest.fixture
def stdlib(tmp_path) -> Path:
    for name, content in FILES.items():
        (tmp_path / name).write_bytes(content)
    (tmp_path / "notes.txt").write_bytes(b"not python")       # not *.py
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_bytes(b"nested")  # not top level
    (tmp_path / "dir.py").mkdir()                               # not a file
    return tmp_path


def made(stdlib: Path, **kwargs) -> StdlibTextDataModule:
    datamodule = StdlibTextDataModule(stdlib_dir=str(stdlib), **{"block_size": 8, "val_fraction": 0.5, **kwargs})
    datamodule.setup("fit")
    return datamodule


def text_of(names) -> bytes:
    return b"".join(FILES[name] for name in names)


def test_works_offline(stdlib, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the datamodule tried to open a socket")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    datamodule = made(stdlib)
    assert len(next(iter(datamodule.train_dataloader()))[0]) > 0


def test_vocab_size_is_known_before_setup():
    assert StdlibTextDataModule.vocab_size == StdlibTextDataModule(stdlib_dir="/nonexistent").vocab_size == 256


def test_sorted_top_level_files_split_by_file(stdlib):
    datamodule = made(stdlib)  # val_fraction 0.5: every 2nd file of the sorted list is validation
    assert datamodule.files == ["a.py", "b.py", "c.py", "d.py", "e.py"]
    assert bytes(datamodule.train_set.text.tolist()) == text_of(["a.py", "c.py", "e.py"])
    assert bytes(datamodule.val_set.text.tolist()) == text_of(["b.py", "d.py"])
    # val_fraction 0.2: k = 5, the 5th file alone is held out.
    assert bytes(made(stdlib, val_fraction=0.2).val_set.text.tolist()) == FILES["e.py"]


def test_windows_are_shifted_by_one_and_cover_every_transition_once(stdlib):
    datamodule = made(stdlib, max_val_sequences=None)
    for dataset, names in ((datamodule.train_set, ["a.py", "c.py", "e.py"]), (datamodule.val_set, ["b.py", "d.py"])):
        text = text_of(names)
        assert len(dataset) == (len(text) - 1) // 8
        pairs = []
        for index in range(len(dataset)):
            x, y = dataset[index]
            assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (8,)
            assert bytes(x.tolist()) == text[8 * index: 8 * index + 8]
            assert bytes(y.tolist()) == text[8 * index + 1: 8 * index + 9]
            pairs += [8 * index + j for j in range(8)]
        # (text[i], text[i + 1]) is a training pair for every i up to the last whole window, exactly once
        assert pairs == list(range(len(dataset) * 8))
    # One uint8 tensor behind the windows, no copies per window.
    assert datamodule.train_set.text.dtype == torch.uint8 and datamodule.train_set.text.numel() == len(
        text_of(["a.py", "c.py", "e.py"]))


def test_validation_is_bounded_and_spread_evenly(stdlib):
    every = made(stdlib, max_val_sequences=None).val_set
    count = len(every)  # (50 + 85 - 1) // 8 = 16
    assert count == 16
    bounded = made(stdlib, max_val_sequences=5).val_set
    # window floor(j * 16 / 5) for j = 0..4: 0, 3, 6, 9, 12
    assert [bounded[j][0].tolist() for j in range(5)] == [every[i][0].tolist() for i in (0, 3, 6, 9, 12)]
    assert len(made(stdlib, max_val_sequences=100).val_set) == count
    datamodule = made(stdlib, max_val_sequences=5, batch_size=2)
    assert sum(len(x) for x, _ in datamodule.val_dataloader()) == 5
    assert [b[0].tolist() for b in datamodule.test_dataloader()] == [b[0].tolist() for b in datamodule.val_dataloader()]


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_contiguous_shards_are_disjoint_consecutive_and_cover_the_text(stdlib, ranks):
    datamodule = made(stdlib, batch_size=2)  # (88 + 77 + 78 - 1) // 8 = 30 training windows
    windows = len(datamodule.train_set)
    parts = [datamodule.train_loader(ranks, rank).sampler.part for rank in range(ranks)]
    assert np.array_equal(np.concatenate(parts), np.arange(windows))  # in order: rank r holds the r-th stretch
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    for rank, part in enumerate(parts):
        assert set(datamodule.train_loader(ranks, rank).sampler) <= set(part.tolist())


@pytest.mark.parametrize("partition", ["contiguous", "iid", "reshuffled"])
def test_every_rank_gets_the_same_number_of_batches(stdlib, partition):
    datamodule = made(stdlib, batch_size=2, partition=partition)
    for ranks in (2, 3, 4):
        loaders = [datamodule.train_loader(ranks, rank) for rank in range(ranks)]
        sampler_type = DistributedSampler if partition == "reshuffled" else PartitionSampler
        assert all(type(loader.sampler) is sampler_type for loader in loaders)
        assert len({len(list(loader)) for loader in loaders}) == 1
        assert len(loaders[0]) == -(-(len(datamodule.train_set) // ranks) // 2)


def test_corpus_info(stdlib):
    info = made(stdlib, max_val_sequences=5).corpus_info()
    assert info == {
        "python_version": platform.python_version(),
        "stdlib_dir": str(stdlib),
        "files": 5,
        "train_files": 3,
        "val_files": 2,
        "train_bytes": len(text_of(["a.py", "c.py", "e.py"])),
        "val_bytes": len(text_of(["b.py", "d.py"])),
        "sha256": hashlib.sha256(text_of(sorted(FILES))).hexdigest(),
        "block_size": 8,
        "train_windows": 30,
        "val_windows": 5,
    }


def test_the_real_standard_library():
    datamodule = StdlibTextDataModule()
    datamodule.setup("fit")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    expected = sorted(p.name for p in stdlib.glob("*.py") if p.is_file())
    assert datamodule.files == expected and len(expected) > 100
    info = datamodule.corpus_info()
    assert (info["val_files"], info["train_files"]) == (len(expected) // 10, len(expected) - len(expected) // 10)
    assert info["train_bytes"] + info["val_bytes"] == sum(os.path.getsize(stdlib / name) for name in expected)
    assert info["val_windows"] == 512 < (info["val_bytes"] - 1) // 128
    assert StdlibTextDataModule().corpus_info()["sha256"] == info["sha256"]
    x, y = next(iter(datamodule.train_dataloader()))
    assert x.shape == y.shape == (32, 128) and torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.parametrize(
    "kwargs, parameter",
    [
        (dict(block_size=0), "block_size"),
        (dict(batch_size=0), "batch_size"),
        (dict(partition="dirichlet"), "partition"),
        (dict(val_fraction=0.0), "val_fraction"),
        (dict(val_fraction=0.7), "val_fraction"),
        (dict(max_val_sequences=0), "max_val_sequences"),
        (dict(seed=-1), "seed"),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs, parameter):
    with pytest.raises(ValueError, match=parameter):
        StdlibTextDataModule(**kwargs)


def test_bad_directories_fail_at_setup(stdlib, tmp_path_factory):
    with pytest.raises(ValueError, match="stdlib_dir"):
        StdlibTextDataModule(stdlib_dir=str(stdlib / "missing")).setup("fit")
    with pytest.raises(ValueError, match="val_fraction"):  # 5 files, but every 10th is held out
        StdlibTextDataModule(stdlib_dir=str(stdlib)).setup("fit")
    with pytest.raises(ValueError, match="block_size"):
        StdlibTextDataModule(stdlib_dir=str(stdlib), val_fraction=0.5, block_size=1000).setup("fit")
