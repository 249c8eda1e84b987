"""lightning-dist: distributed-training algorithms from research papers as Lightning strategies.

Importing the package registers the strategy names ``"dynamic_avg"``, ``"periodic_avg"``,
``"fedavg"``, ``"downpour_sgd"`` and ``"segmented_gossip"`` with Lightning's ``StrategyRegistry``.
"""

from lightning_dist.algorithms.sparse_compression import SparseCodec
from lightning_dist.callbacks import CDGraB, DataGossip
from lightning_dist.comm import CommStats
from lightning_dist.data import CDGraBSampler
from lightning_dist.registry import register_strategies
from lightning_dist.strategies import (
    DownpourSGDStrategy,
    DynamicAveragingStrategy,
    LocalUpdateStrategy,
    NonFiniteModelError,
    PeriodicAveragingStrategy,
    SegmentedGossipStrategy,
    TorchFT,
)

register_strategies()

__all__ = [
    "CDGraB",
    "CDGraBSampler",
    "CommStats",
    "DataGossip",
    "DownpourSGDStrategy",
    "DynamicAveragingStrategy",
    "LocalUpdateStrategy",
    "NonFiniteModelError",
    "PeriodicAveragingStrategy",
    "SegmentedGossipStrategy",
    "SparseCodec",
    "TorchFT",
    "register_strategies",
]
__version__ = "0.1.0"
