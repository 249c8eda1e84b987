"""A small task for simulator tests: a tiny MLP on scikit-learn digits, modelled compute."""

import torch

from lightning_dist.data import DigitsDataModule
from lightning_dist.models import MLPClassifier
from lightning_dist.sim import NetworkModel, Simulation, Simulator, SpeedModel


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


def run(machines, programs):
    """Node ``i`` runs ``programs[i](node, records)``; returns what they recorded and the network."""
    simulator = Simulator(machines.network, machines=machines)
    records = {}
    for index, program in enumerate(programs):
        simulator.add_node(f"n{index}", lambda node, program=program: program(node, records))
    simulator.run()
    return records, simulator.network


def ring(members, nbytes, kind="all_reduce"):
    def program(node, records):
        if node.index in members:
            if kind == "all_reduce":
                yield from node.all_reduce("c", members, 1.0, sum, nbytes=nbytes)
            else:
                yield from node.all_gather("c", members, 1.0, nbytes=nbytes)
            records[node.index] = node.now
        yield node.sleep(0)

    return program
