"""Lightning strategies: thin adapters from Lightning hooks to ``algorithms/`` and ``comm/``."""

from lightning_dist.strategies._averaging import NonFiniteModelError
from lightning_dist.strategies._torchft_option import TorchFT
from lightning_dist.strategies.downpour import DownpourSGDStrategy
from lightning_dist.strategies.dynamic import DynamicAveragingStrategy
from lightning_dist.strategies.local_update import LocalUpdateStrategy
from lightning_dist.strategies.periodic import PeriodicAveragingStrategy
from lightning_dist.strategies.segmented_gossip import SegmentedGossipStrategy

__all__ = [
    "DownpourSGDStrategy",
    "DynamicAveragingStrategy",
    "LocalUpdateStrategy",
    "NonFiniteModelError",
    "PeriodicAveragingStrategy",
    "SegmentedGossipStrategy",
    "TorchFT",
]
