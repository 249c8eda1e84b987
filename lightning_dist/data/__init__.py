"""Data for distributed experiments: index partitions, the per-rank sampler, and small datamodules
(MNIST-1D, digits, and the Python standard library's source as a byte-level text corpus)."""

from lightning_dist.data.cdgrab_sampler import CDGraBSampler
from lightning_dist.data.datamodules import ArrayDataModule, DigitsDataModule, MNIST1DDataModule, PermutableLabelDataset
from lightning_dist.data.partition import (
    PARTITIONS,
    class_sorted_partition,
    contiguous_partition,
    dirichlet_partition,
    iid_partition,
    make_partition,
)
from lightning_dist.data.sampler import PartitionSampler
from lightning_dist.data.text import StdlibTextDataModule

__all__ = [
    "PARTITIONS",
    "ArrayDataModule",
    "CDGraBSampler",
    "DigitsDataModule",
    "MNIST1DDataModule",
    "PartitionSampler",
    "PermutableLabelDataset",
    "StdlibTextDataModule",
    "class_sorted_partition",
    "contiguous_partition",
    "dirichlet_partition",
    "iid_partition",
    "make_partition",
]
