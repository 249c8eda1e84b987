"""A small task for simulator tests: a tiny MLP on scikit-learn digits, modelled compute."""

import torch

from lightning_dist.data import DigitsDataModule
from lightning_dist.models import MLPClassifier
from lightning_dist.sim import NetworkModel, Simulation, SpeedModel


def simulation(protocol, workers=4, max_steps=20, network=None, speed=None, datamodule=None, **kwargs) -> Simulation:
    torch.manual_seed(0)
    model = MLPClassifier(num_features=64, hidden_size=16, learning_rate=0.1)
    return Simulation(
        model,
        datamodule if datamodule is not None else DigitsDataModule(batch_size=16),
        protocol,
        workers=workers,
        max_steps=max_steps,
        network=network if network is not None else NetworkModel(latency=0.001, node_mbit=100),
        speed=speed if speed is not None else SpeedModel(step_seconds=0.01, aggregate_seconds=0.001),
        **kwargs,
    )
