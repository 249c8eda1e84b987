"""Counted communication: every byte between ranks goes through ``Communicator``."""

from lightning_dist.comm.communicator import Communicator
from lightning_dist.comm.groups import destroy_group, new_group
from lightning_dist.comm.stats import PURPOSES, CommStats

__all__ = ["PURPOSES", "CommStats", "Communicator", "destroy_group", "new_group"]
