"""Periodic averaging and FedAvg in the simulator (paper 004's baselines, paper 002's FedAvg).

Every ``period`` steps the participants of the round (all workers, or FedAvg's seeded
``max(round(C * m), 1)`` drawn by :func:`~lightning_dist.algorithms.averaging.sample_participants`)
send their models to an aggregation server (node ``N``, paper 002's FedAvg setting), which sends
back their mean (:func:`~lightning_dist.algorithms.averaging.weighted_average`). The others keep
training. :class:`~lightning_dist.strategies.PeriodicAveragingStrategy` computes the same mean with
an all-reduce (or, for ``C < 1``, a star through the lowest participant): only the topology differs.
"""

from __future__ import annotations

import torch

from lightning_dist.algorithms.arguments import check_client_fraction, check_steps
from lightning_dist.algorithms.averaging import sample_participants, weighted_average
from lightning_dist.sim.engine import Node
from lightning_dist.sim.protocols.base import Program, Protocol
from lightning_dist.sim.replica import check_finite


class PeriodicAveraging(Protocol):
    """Args:
    period: local steps between averagings (``b`` in paper 004); default 10; ``>= 1``.
    client_fraction: FedAvg's ``C`` in (0, 1]; 1 is periodic averaging.
    seed: seeds the choice of participants.
    """

    name = "periodic"
    num_servers = 1
    arguments = ("period", "client_fraction", "seed")

    def __init__(self, period: int = 10, client_fraction: float = 1.0, seed: int = 0) -> None:
        self.period = check_steps("period", period, "local steps between averagings")
        self.client_fraction = check_client_fraction(client_fraction)
        self.seed = seed

    def setup(self, simulation) -> None:  # type: ignore[no-untyped-def]
        super().setup(simulation)
        self._generator = torch.Generator().manual_seed(self.seed)
        self._participants: list[list[int]] = []
        self.rounds = simulation.max_steps // self.period

    def participants(self, round_index: int) -> list[int]:
        """Participants of round ``round_index`` (from 1), drawn in round order from the shared seed."""
        while len(self._participants) < round_index:
            self._participants.append(
                sample_participants(self.simulation.num_workers, self.client_fraction, self._generator)
            )
        return self._participants[round_index - 1]

    def after_step(self, node: Node, rank: int, step: int) -> Program:
        if step % self.period:
            return
        round_index = step // self.period
        if rank not in self.participants(round_index):
            return
        replica = self.simulation.replicas[rank]
        node.send(self.simulation.server, replica.get(), tag=("model", round_index))
        message = yield node.recv(source=self.simulation.server, tag=("mean", round_index))
        replica.set(message.payload)

    def server(self, node: Node) -> Program:
        for round_index in range(1, self.rounds + 1):
            participants = self.participants(round_index)
            models = {}
            for _ in participants:
                message = yield node.recv(tag=("model", round_index))
                check_finite(message.payload, message.source)
                models[message.source] = message.payload
            mean = yield from node.execute(weighted_average, [models[rank] for rank in participants], kind="aggregate")
            for rank in participants:
                node.send(rank, mean, tag=("mean", round_index))
