"""Data for distributed experiments: index partitions, the per-rank sampler, and small datamodules."""

from lightning_dist.data.cdgrab_sampler import CDGraBSampler
from lightning_dist.data.datamodules import ArrayDataModule, DigitsDataModule, MNIST1DDataModule, PermutableLabelDataset
from lightning_dist.data.partition import (
    PARTITIONS,
    class_sorted_partition,
    dirichlet_partition,
    iid_partition,
    make_partition,
)
from lightning_dist.data.sampler import PartitionSampler

__all__ = [
    "PARTITIONS",
    "ArrayDataModule",
    "CDGraBSampler",
    "DigitsDataModule",
    "MNIST1DDataModule",
    "PartitionSampler",
    "PermutableLabelDataset",
    "class_sorted_partition",
    "dirichlet_partition",
    "iid_partition",
    "make_partition",
]
