"""The protocols the simulator runs, by the names a config uses."""

from __future__ import annotations

from typing import Any

from lightning_dist.sim.protocols.base import Protocol
from lightning_dist.sim.protocols.ddp import DataParallel
from lightning_dist.sim.protocols.dynamic import DynamicAveraging
from lightning_dist.sim.protocols.parameter_server import ParameterServer
from lightning_dist.sim.protocols.periodic import PeriodicAveraging
from lightning_dist.sim.protocols.segmented_gossip import SegmentedGossip

PROTOCOLS: dict[str, type[Protocol]] = {
    "ddp": DataParallel,
    "parameter_server": ParameterServer,
    "periodic": PeriodicAveraging,
    "fedavg": PeriodicAveraging,
    "dynamic_avg": DynamicAveraging,
    "segmented_gossip": SegmentedGossip,
}
"""``fedavg`` is ``periodic`` with ``client_fraction < 1``; ``gossip`` is ``segmented_gossip`` with ``segments=1``."""


def make_protocol(name: str, **arguments: Any) -> Protocol:
    """The protocol called ``name`` with ``arguments``; a clear error for an unknown name."""
    if name not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {sorted(PROTOCOLS)}; got {name!r}")
    return PROTOCOLS[name](**arguments)


__all__ = ["PROTOCOLS", "DataParallel", "DynamicAveraging", "ParameterServer", "PeriodicAveraging", "Protocol",
           "SegmentedGossip",
           "make_protocol"]
