"""Lightning callbacks: algorithms that extend any strategy rather than replace it."""

from lightning_dist.callbacks.cdgrab import CDGraB
from lightning_dist.callbacks.data_gossip import DataGossip

__all__ = ["CDGraB", "DataGossip"]
