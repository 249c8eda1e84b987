"""Makes ``Trainer(strategy="dynamic_avg")`` and friends resolve.

Lightning has no entry point for third-party strategy names, so ``import lightning_dist``
registers them in ``StrategyRegistry``. Registration is skipped for names already present:
processes launched by ``strategy="ddp"``-style launchers import the package again.
LightningCLI YAML configs that use ``class_path`` need no registration.
"""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from lightning_dist.strategies import (
    DownpourSGDStrategy,
    DynamicAveragingStrategy,
    PeriodicAveragingStrategy,
    SegmentedGossipStrategy,
)

FEDAVG_CLIENT_FRACTION = 0.5
"""Client fraction ``C`` behind the name ``"fedavg"``; pass a strategy object for another ``C``."""


def register_strategies() -> None:
    entries = [
        ("dynamic_avg", DynamicAveragingStrategy, "Dynamic model averaging (Kamp et al. 2018)", {}),
        ("periodic_avg", PeriodicAveragingStrategy, "Periodic model averaging", {}),
        ("fedavg", PeriodicAveragingStrategy, "FedAvg: periodic averaging of a random client fraction",
         {"client_fraction": FEDAVG_CLIENT_FRACTION}),
        ("downpour_sgd", DownpourSGDStrategy, "DownpourSGD: asynchronous parameter server (Dean et al. 2012)", {}),
        ("segmented_gossip", SegmentedGossipStrategy, "Segmented gossip: segments pulled from random peers (Combo, 2019)", {}),
    ]
    for name, strategy, description, init_params in entries:
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, strategy, description=description, **init_params)
