"""Periodic model averaging and FedAvg, the baselines of paper 004 (section 4, ``sigma_b``)."""

from __future__ import annotations

from typing import Any

from lightning_dist.algorithms.arguments import check_client_fraction, check_steps
from lightning_dist.algorithms.averaging import sample_participants
from lightning_dist.strategies.local_update import LocalUpdateStrategy


class PeriodicAveragingStrategy(LocalUpdateStrategy):
    """Every ``period`` optimizer steps, replace the participating replicas by their mean.

    With ``client_fraction=1`` (periodic averaging, ``sigma_b`` of paper 004) every rank takes part
    and the mean is one all-reduce. With ``client_fraction=C < 1`` (FedAvg, McMahan et al. 2017)
    a seeded random set of ``max(round(C * m), 1)`` ranks takes part; they send their models to
    the lowest-ranked participant, which sends their mean back to them. The others keep training
    their own models.

    Args:
        period: optimizer steps between averagings (``b`` in paper 004). Default 10, the
            period of paper 004's MNIST comparison.
        client_fraction: fraction ``C`` of ranks taking part in each averaging, in (0, 1].
        seed: seeds the choice of participants (the same on every rank).
        **kwargs: passed to :class:`LocalUpdateStrategy` (Lightning's DDP arguments).
    """

    strategy_name = "periodic_avg"

    def __init__(self, period: int = 10, client_fraction: float = 1.0, seed: int = 0, **kwargs: Any) -> None:
        period = check_steps("period", period, "optimizer steps between averagings")
        client_fraction = check_client_fraction(client_fraction)
        super().__init__(seed=seed, **kwargs)
        self.period = period
        self.client_fraction = client_fraction

    def after_local_step(self, step: int) -> None:
        if step % self.period != 0:
            return
        world_size = self.comm.world_size
        participants = sample_participants(world_size, self.client_fraction, self._generator)
        if len(participants) == world_size:
            self.model_vector.set(self.average_all("protocol"))
            self._replicas_in_sync = True
        else:
            self.raise_if_non_finite(self.model_vector.get())
            mean = self.star_average(participants, participants[0], "protocol")
            if mean is not None:
                self.model_vector.set(mean)
        self._syncs += 1
