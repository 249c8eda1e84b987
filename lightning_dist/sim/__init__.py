"""The hybrid simulator (paper 001): many virtual workers in one process, virtual time, real gradients.

A discrete-event engine (simpy) owns virtual time; every worker trains a real copy of the
LightningModule and its measured (or modelled) compute time advances its virtual clock; messages
cross a modelled network (latency, serialized send and receive ports, per-node and per-link
bandwidth caps) and collectives take Gloo's ring time or, with ``collectives="nccl"``, NCCL's ring or tree
(``collectives.py``, ``nccl.py``). Protocols call the same
``lightning_dist.algorithms`` code as the strategies; ``topology="strategy"`` makes them move what
the strategy moves, and the ``ddp`` protocol is Lightning's DDP (a gradient all-reduce every step).

    from lightning_dist.sim import NetworkModel, SegmentedGossip, Simulation, SpeedModel
    result = Simulation(model, datamodule, SegmentedGossip(segments=10, replicas=2, period=40), workers=20,
                        max_steps=400, network=NetworkModel(latency=0.001, node_mbit=100, link_mbit=10),
                        speed=SpeedModel(step_seconds=0.02, aggregate_seconds=0.0)).run()

or ``lightning-dist simulate --config configs/sim/segmented_gossip.yaml``. Workers that leave and join:
``Simulation(..., churn=Churn(fraction=0.3, leave_rate=0.05, mean_absence=10.0, seed=1))``
(:mod:`lightning_dist.sim.churn`). Machines of several GPUs: ``Simulation(..., workers=256, ranks_per_node=8,
intra_node=NetworkModel(...), hierarchy="node")`` (32 machines sharing one interface each; ``hierarchy="node"``:
one learner per machine, DDP inside it, as the strategies' hierarchy; :mod:`lightning_dist.sim.machines`).
"""

from lightning_dist.sim.churn import Churn
from lightning_dist.sim.engine import Message, Node, Simulator, SpeedModel, payload_bytes
from lightning_dist.sim.network_model import NetworkModel
from lightning_dist.sim.protocols import (
    PROTOCOLS,
    DataParallel,
    DynamicAveraging,
    ParameterServer,
    PeriodicAveraging,
    Protocol,
    SegmentedGossip,
    make_protocol,
)
from lightning_dist.sim.replica import NonFiniteModelError
from lightning_dist.sim.run_state import SimulationResult
from lightning_dist.sim.simulation import Simulation

__all__ = [
    "PROTOCOLS",
    "Churn",
    "DataParallel",
    "DynamicAveraging",
    "Message",
    "NetworkModel",
    "Node",
    "NonFiniteModelError",
    "ParameterServer",
    "PeriodicAveraging",
    "Protocol",
    "SegmentedGossip",
    "Simulation",
    "SimulationResult",
    "Simulator",
    "SpeedModel",
    "make_protocol",
    "payload_bytes",
]
