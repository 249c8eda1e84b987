"""Dynamic averaging (paper 004, Algorithm 1) in the simulator, with a coordinator node (node ``N``).

Every ``check_every`` steps each worker tests its local condition against its copy of the
reference model and sends the distance (8 bytes) to the coordinator. With no violation the
coordinator answers every worker with one byte. Otherwise it runs
:func:`~lightning_dist.algorithms.averaging.balance_models`, the executable definition that
:class:`~lightning_dist.strategies.DynamicAveragingStrategy` is tested against, and moves the
models that the balancing reads: one request byte and one model per rank, round by round (the
violators, then each augmentation), and the mean back to every member of the balancing set; a
full synchronization also replaces every worker's reference model. All workers wait at the check,
so the models the coordinator averages are the ones in flight.
"""

from __future__ import annotations

import math

import torch

from lightning_dist.algorithms.arguments import check_divergence_threshold, check_steps
from lightning_dist.algorithms.averaging import balance_models, squared_distance
from lightning_dist.sim.engine import Node
from lightning_dist.sim.protocols.base import Program, Protocol
from lightning_dist.strategies.local_update import NonFiniteModelError

_SEND_MODEL = "send_model"
_CONTINUE = "continue"


class DynamicAveraging(Protocol):
    """Args:
    divergence_threshold: ``Delta > 0``, squared L2 distance to the reference; default 0.7 (paper 004's MNIST study).
    check_every: ``b >= 1``, steps between local-condition checks; default 10.
    seed: seeds the augmentation of the balancing set.
    """

    name = "dynamic_avg"
    num_servers = 1
    arguments = ("divergence_threshold", "check_every", "seed")

    def __init__(self, divergence_threshold: float = 0.7, check_every: int = 10, seed: int = 0) -> None:
        self.divergence_threshold = check_divergence_threshold(divergence_threshold)
        self.check_every = check_steps("check_every", check_every, "steps between checks")
        self.seed = seed

    def setup(self, simulation) -> None:  # type: ignore[no-untyped-def]
        super().setup(simulation)
        self._generator = torch.Generator().manual_seed(self.seed)
        initial = simulation.replicas[0]
        self.reference = initial.vector.parameters_of(initial.get()).clone()
        self.references = [self.reference] * simulation.num_workers
        self.violation_counter = 0
        self.counts = {"checks": 0, "violations": 0, "full_syncs": 0, "partial_syncs": 0}

    def after_step(self, node: Node, rank: int, step: int) -> Program:
        if step % self.check_every:
            return
        round_index = step // self.check_every
        replica = self.simulation.replicas[rank]
        distance = squared_distance(replica.vector.parameters_of(replica.get()), self.references[rank])
        node.send(self.simulation.server, distance, tag=("distance", round_index))
        while True:
            message = yield node.recv(source=self.simulation.server, tag=("decision", round_index))
            if message.payload == _SEND_MODEL:
                node.send(self.simulation.server, replica.get(), tag=("model", round_index))
                continue
            if message.payload != _CONTINUE:
                mean, full_sync = message.payload
                replica.set(mean)
                if full_sync:
                    self.references[rank] = replica.vector.parameters_of(mean).clone()
            return

    def server(self, node: Node) -> Program:
        workers = self.simulation.num_workers
        for round_index in range(1, self.simulation.max_steps // self.check_every + 1):
            distances = {}
            for _ in range(workers):
                message = yield node.recv(tag=("distance", round_index))
                distances[message.source] = message.payload
            self.counts["checks"] += 1
            for rank in sorted(distances):
                if not math.isfinite(distances[rank]):
                    raise NonFiniteModelError(f"worker {rank} is at a non-finite distance from the reference model")
            violators = sorted(rank for rank, value in distances.items() if value > self.divergence_threshold)
            decision = ("decision", round_index)
            if not violators:
                for rank in range(workers):
                    node.send(rank, _CONTINUE, tag=decision, nbytes=1)
                continue
            self.counts["violations"] += len(violators)
            fetches: list[list[int]] = []
            models = [replica.get() for replica in self.simulation.replicas]
            new_models, self.reference, balancing_set, self.violation_counter = yield from node.execute(
                balance_models, models, self.reference, violators, self.divergence_threshold,
                self.violation_counter, self._generator, fetches.append, kind="aggregate",
            )
            fetched = {rank for ranks in fetches for rank in ranks}
            fetches.append([rank for rank in balancing_set if rank not in fetched])
            for ranks in fetches:
                for rank in ranks:
                    node.send(rank, _SEND_MODEL, tag=decision, nbytes=1)
                for _ in ranks:
                    yield node.recv(tag=("model", round_index))
            full_sync = len(balancing_set) == workers
            self.counts["full_syncs" if full_sync else "partial_syncs"] += 1
            members = set(balancing_set)
            for rank in range(workers):
                if rank in members:
                    node.send(rank, (new_models[rank], full_sync), tag=decision, nbytes=new_models[rank].nbytes)
                else:
                    node.send(rank, _CONTINUE, tag=decision, nbytes=1)

    def metrics(self) -> dict[str, float]:
        return {f"dynamic/{key}": float(value) for key, value in self.counts.items()}
