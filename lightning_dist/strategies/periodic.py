"""Periodic model averaging and FedAvg, the baselines of paper 004 (section 4, ``sigma_b``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

from torch import Tensor

from lightning_dist.algorithms.arguments import check_client_fraction, check_outer_optimizer, check_steps
from lightning_dist.algorithms.averaging import sample_participants
from lightning_dist.algorithms.outer import OuterOptimizerFactory, OuterStep
from lightning_dist.strategies._outer import build_outer_step, load_outer_state, outer_state
from lightning_dist.strategies._subset_average import average_subset
from lightning_dist.strategies.local_update import LocalUpdateStrategy


class PeriodicAveragingStrategy(LocalUpdateStrategy):
    """Every ``period`` optimizer steps, replace the participating replicas by their mean.

    With ``client_fraction=1`` (periodic averaging, ``sigma_b`` of paper 004) every rank takes part
    and the mean is one all-reduce. With ``client_fraction=C < 1`` (FedAvg, McMahan et al. 2017)
    a seeded random set of ``max(round(C * m), 1)`` ranks takes part; they average among themselves
    with no rank carrying more than its share (each owns a chunk of the sum: a reduce, then an
    all-gather, :mod:`lightning_dist.algorithms.subset_average`). The others keep training their own
    models.

    DiLoCo (Douillard et al. 2023): with an ``outer_optimizer``, the mean is not handed out as it is.
    Every rank keeps the reference model ``theta`` all replicas started the round from; at the end of
    the round ``Delta = theta - mean`` is the outer gradient, ``theta <- OuterOpt(theta, Delta)``
    (:class:`~lightning_dist.algorithms.outer.OuterStep`) and every replica continues from the new
    ``theta``. The exchange is the same all-reduce; each rank steps its own copy of the outer
    optimizer with the same mean, so the copies stay identical without further bytes. Between
    averagings, validation and a checkpoint see the plain mean of the replicas, as without the
    option: it is the inner optimizers' joint progress since ``theta``, and an outer step there
    would either change the training run (momentum committed for part of a round) or score a
    model training never continues from. At the end of every round, and so after a ``fit`` that
    ends on one, every rank holds the outer step's result (choose ``max_steps`` and the validation
    interval as multiples of ``period`` to score exactly those).

    Args:
        period: optimizer steps between averagings (``b`` in paper 004). Default 10, the
            period of paper 004's MNIST comparison.
        client_fraction: fraction ``C`` of ranks taking part in each averaging, in (0, 1].
        seed: seeds the choice of participants (the same on every rank).
        outer_optimizer: None (default) for plain averaging; otherwise builds DiLoCo's outer
            optimizer from a list of tensors, like Lightning's ``OptimizerCallable``: in Python
            :func:`~lightning_dist.algorithms.outer.diloco_outer_optimizer` or
            ``functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)``; in a
            LightningCLI YAML ``{class_path: torch.optim.SGD, init_args: {lr: 0.7, momentum: 0.9,
            nesterov: true}}``. Needs ``client_fraction=1``: the outer gradient assumes every averaged
            replica started the round from the reference, which FedAvg's non-participants, training
            on from their own models, did not (refused with a ValueError).
        **kwargs: passed to :class:`LocalUpdateStrategy` (Lightning's DDP arguments).
    """

    strategy_name = "periodic_avg"

    def __init__(
        self,
        period: int = 10,
        client_fraction: float = 1.0,
        seed: int = 0,
        outer_optimizer: Optional[OuterOptimizerFactory] = None,
        **kwargs: Any,
    ) -> None:
        period = check_steps("period", period, "optimizer steps between averagings")
        client_fraction = check_client_fraction(client_fraction)
        outer_optimizer = check_outer_optimizer(outer_optimizer, client_fraction)
        if client_fraction < 1 and kwargs.get("compression") is not None:
            raise ValueError(
                f"compression needs client_fraction=1 (got {client_fraction}): FedAvg's rounds average a subset of "
                "the ranks, whose models share no common model to send deltas from"
            )
        super().__init__(seed=seed, **kwargs)
        self.period = period
        self.client_fraction = client_fraction
        self.outer_optimizer = outer_optimizer
        self._outer: OuterStep | None = None

    def on_replicas_initialized(self, vector: Tensor) -> None:
        self._outer = build_outer_step(self.outer_optimizer, self.model_vector.parameters_of(vector))

    def after_local_step(self, step: int) -> None:
        if step % self.period != 0:
            return
        learners = self.learners.world_size  # ranks, or nodes under a hierarchy
        participants = sample_participants(learners, self.client_fraction, self._generator)
        if len(participants) == learners:
            mean = self.synchronize_all("protocol")
            self.set_common_model(mean if self._outer is None else self._outer.step(mean))
        else:
            local = self.model_vector.get()
            self.raise_if_non_finite(local)
            mean = average_subset(self.learners, self.learner_part(local), participants, "protocol")
            if mean is not None:  # a participant (under a hierarchy, every rank of a participating node)
                self.model_vector.set(self.learner_whole(mean, "protocol"))
        self._syncs += 1

    def protocol_state_dict(self) -> dict[str, Any]:
        return outer_state(self._outer)

    def load_protocol_state_dict(self, state: Mapping[str, Any]) -> None:
        load_outer_state(self._outer, state, type(self).__name__)

    def resized_protocol_state(self, state: Mapping[str, Any], written_by: int) -> Mapping[str, Any]:
        """Kept: the rounds count global steps, and DiLoCo's reference and outer momentum are one model's."""
        return state

    def protocol_metrics(self) -> dict[str, float]:
        return {} if self._outer is None else self._outer.metrics()
