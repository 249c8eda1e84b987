"""Counted communication: every byte between ranks goes through ``Communicator``."""

from lightning_dist.comm.communicator import CollectiveError, Communicator
from lightning_dist.comm.groups import check_timeout, destroy_group, new_group, restart_scoped_store, strategy_timeout
from lightning_dist.comm.stats import PURPOSES, CommStats

__all__ = ["PURPOSES", "CollectiveError", "CommStats", "Communicator", "check_timeout", "destroy_group", "new_group", "restart_scoped_store",
           "strategy_timeout"]
