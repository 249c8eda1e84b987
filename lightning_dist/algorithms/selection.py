"""Instance selection of DataGossip (paper 000, Dreher et al., EDBT 2022; DESIGN section 3.6).

After every local epoch each rank picks ``k`` of its local training records to send to all other
ranks. Paper 000 compares four loss-based rules, all implemented here:

- ``random``: ``k`` records uniformly at random, without replacement;
- ``hem`` (hard example mining): the ``k`` records with the highest latest loss. Deterministic,
  and the worst of the four in the paper ("too deterministic, noisy and confusing");
- ``spl`` (self-paced learning): a loss threshold ``lambda`` that starts at 0.1 and grows by a
  factor 1.2 per epoch (the paper's settings); records whose latest loss is below it are sampled
  without replacement with the loss as weight, so the focus follows the threshold to ever
  harder records;
- ``active_bias`` (Chang et al., NeurIPS 2017): records sampled without replacement with weight
  ``v = sqrt(var + var^2 / c)``, where ``var`` is the variance of the record's per-epoch loss
  history and ``c`` the number of epochs recorded for it. The paper's default selector.

``spl`` and ``active_bias`` fall back to random sampling until enough losses are recorded: when
fewer than ``k`` records have a positive weight, the remaining picks are drawn uniformly from the
records not yet picked. This also avoids two bugs of the reference implementation: SPL crashing
when ``0 < candidates < k``, and Active Bias topping up with loss *values* instead of indices.

Plain torch: no Lightning, no process groups. The callback
:class:`lightning_dist.callbacks.DataGossip` keeps a :class:`LossHistory` per rank and calls
:func:`select_records`; every random choice takes an explicit ``torch.Generator`` so that runs
(and resumed runs) are reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_dist.algorithms.arguments import check_count

SELECTORS: tuple[str, ...] = ("random", "hem", "spl", "active_bias")
"""Names accepted by :func:`select_records` (and ``DataGossip(selector=...)``)."""

SPL_INITIAL_THRESHOLD = 0.1
"""Paper 000's initial SPL loss threshold ``lambda``."""

SPL_GROWTH = 1.2
"""Paper 000's SPL growth factor: ``lambda`` is multiplied by it after every epoch."""


class LossHistory:
    """Latest loss and per-epoch loss statistics of every record of a dataset, by dataset index.

    ``record`` stores the losses of one batch; ``end_epoch`` closes an epoch. For each record the
    history keeps:

    - ``latest``: the most recent loss (NaN until the record is first trained on), used by HEM
      and SPL;
    - ``epochs_recorded`` (``c``), ``mean`` and ``variance``: statistics of the record's per-epoch
      losses, used by Active Bias. A record's loss in an epoch is the last loss recorded for it
      in that epoch (a record read twice in one epoch contributes once). The statistics are
      updated online (Welford), so memory stays three numbers per record however long training
      runs; the variance is the population variance (``numpy.nanvar`` of the reference code).
    - ``visits``: how many losses were recorded for the record in total.

    Records are indexed by their dataset index, so a rank's history covers whatever part of the
    dataset its sampler gives it.
    """

    def __init__(self, num_records: int) -> None:
        self.num_records = check_count("num_records", num_records, 1)
        self.latest = torch.full((num_records,), float("nan"), dtype=torch.float32)
        self.visits = torch.zeros(num_records, dtype=torch.int64)
        self.epochs_recorded = torch.zeros(num_records, dtype=torch.int64)
        # float64 so that the variance of losses that barely change is not lost to rounding.
        self.mean = torch.zeros(num_records, dtype=torch.float64)
        self._m2 = torch.zeros(num_records, dtype=torch.float64)
        self._epoch_latest = torch.full((num_records,), float("nan"), dtype=torch.float32)
        self.epochs_completed = 0

    def record(self, indices: Tensor, losses: Tensor) -> None:
        """Store the losses of the records at dataset ``indices`` (one loss per index, in order)."""
        indices = torch.as_tensor(indices, dtype=torch.int64).reshape(-1)
        losses = torch.as_tensor(losses).detach().reshape(-1).to(device="cpu", dtype=torch.float32)
        if len(indices) != len(losses):
            raise ValueError(f"losses must have one entry per index ({len(indices)}); got {len(losses)}")
        if len(indices) == 0:
            return
        if int(indices.min()) < 0 or int(indices.max()) >= self.num_records:
            raise ValueError(f"indices must lie in [0, {self.num_records - 1}]; got {indices.tolist()}")
        # An index may repeat within a batch (padded samplers). Assigning with repeated indices is
        # unordered in torch, so keep the last occurrence explicitly: later wins, as in a loop.
        unique, inverse = torch.unique(indices, return_inverse=True)
        last = torch.zeros(len(unique), dtype=torch.int64).scatter_reduce(
            0, inverse, torch.arange(len(indices)), reduce="amax", include_self=False
        )
        self.latest[unique] = losses[last]
        self._epoch_latest[unique] = losses[last]
        self.visits.index_add_(0, indices, torch.ones_like(indices))

    def end_epoch(self) -> None:
        """Fold this epoch's loss of every record read in it into the per-epoch statistics."""
        seen = ~torch.isnan(self._epoch_latest)
        value = self._epoch_latest[seen].double()
        count = self.epochs_recorded[seen] + 1
        delta = value - self.mean[seen]
        mean = self.mean[seen] + delta / count
        self._m2[seen] += delta * (value - mean)
        self.mean[seen] = mean
        self.epochs_recorded[seen] = count
        self._epoch_latest.fill_(float("nan"))
        self.epochs_completed += 1

    @property
    def seen(self) -> Tensor:
        """Mask of the records with at least one recorded loss."""
        return self.visits > 0

    def variance(self) -> Tensor:
        """Population variance of each record's per-epoch losses (0 with fewer than two epochs)."""
        count = self.epochs_recorded.clamp(min=1).double()
        return torch.where(self.epochs_recorded > 0, self._m2 / count, torch.zeros_like(self._m2))

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_records": self.num_records,
            "latest": self.latest.clone(),
            "visits": self.visits.clone(),
            "epochs_recorded": self.epochs_recorded.clone(),
            "mean": self.mean.clone(),
            "m2": self._m2.clone(),
            "epoch_latest": self._epoch_latest.clone(),
            "epochs_completed": self.epochs_completed,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state["num_records"] != self.num_records:
            raise ValueError(
                f"the loss history in the checkpoint covers {state['num_records']} records; this dataset has "
                f"{self.num_records}: resume with the same training dataset"
            )
        self.latest = state["latest"].clone()
        self.visits = state["visits"].clone()
        self.epochs_recorded = state["epochs_recorded"].clone()
        self.mean = state["mean"].clone()
        self._m2 = state["m2"].clone()
        self._epoch_latest = state["epoch_latest"].clone()
        self.epochs_completed = int(state["epochs_completed"])


def merge_histories(histories: Sequence[LossHistory], records: Optional[Tensor] = None) -> LossHistory:
    """One history of the records at dataset indices ``records`` (None: all) from several ranks' histories.

    DataGossip resumed at another world size gives each rank the history of the records it now
    owns, from the histories every saved rank kept. A record one history holds (each record on one
    rank, a fixed partition) keeps its entries unchanged. A record several hold (a sampler that
    deals out a fresh split every epoch) gets the statistics of all its per-epoch losses: visits and
    epochs recorded add up, and mean and variance combine exactly by the pairwise update of Chan,
    Golub and LeVeque (1979), ``M2 = M2_a + M2_b + delta^2 n_a n_b / (n_a + n_b)``. Its latest loss
    (and this epoch's, for a history saved mid-epoch) comes from the history that trained it most
    often, the first on ties: the histories do not say which rank trained it last. Records outside
    ``records`` start afresh, as unseen.
    """
    if not histories:
        raise ValueError("histories must hold at least one LossHistory; got none")
    num_records = histories[0].num_records
    if any(history.num_records != num_records for history in histories):
        sizes = [history.num_records for history in histories]
        raise ValueError(f"histories must cover the same dataset; they cover {sizes} records")
    merged = LossHistory(num_records)
    most_visits = torch.full((num_records,), -1, dtype=torch.int64)
    for history in histories:
        count_a, count_b = merged.epochs_recorded, history.epochs_recorded
        total = count_a + count_b
        delta = history.mean - merged.mean
        share = total.clamp(min=1).double()
        mean = merged.mean + delta * count_b / share
        m2 = merged._m2 + history._m2 + delta * delta * count_a * count_b / share
        # Copied where only one side has epochs, so that a record held once keeps its values bit for bit.
        merged.mean = torch.where(count_a == 0, history.mean, torch.where(count_b == 0, merged.mean, mean))
        merged._m2 = torch.where(count_a == 0, history._m2, torch.where(count_b == 0, merged._m2, m2))
        merged.epochs_recorded = total
        more = history.visits > most_visits
        merged.latest = torch.where(more, history.latest, merged.latest)
        this_epoch = ~torch.isnan(history._epoch_latest) & (more | torch.isnan(merged._epoch_latest))
        merged._epoch_latest = torch.where(this_epoch, history._epoch_latest, merged._epoch_latest)
        most_visits = torch.where(more, history.visits, most_visits)
        merged.visits = merged.visits + history.visits
        merged.epochs_completed = max(merged.epochs_completed, history.epochs_completed)
    if records is not None:
        fresh = LossHistory(num_records)
        drop = torch.ones(num_records, dtype=torch.bool)
        drop[torch.as_tensor(records, dtype=torch.int64)] = False
        for name in ("latest", "visits", "epochs_recorded", "mean", "_m2", "_epoch_latest"):
            setattr(merged, name, torch.where(drop, getattr(fresh, name), getattr(merged, name)))
    return merged


# ---------------------------------------------------------------------------------------- helpers


def _check_k(k: int, eligible: Tensor) -> int:
    available = int(eligible.sum())
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= available:
        raise ValueError(f"k must be an integer with 1 <= k <= {available} (the eligible records); got {k!r}")
    return k


def _uniform(mask: Tensor, count: int, generator: torch.Generator) -> Tensor:
    """``count`` distinct indices of ``mask``'s True entries, uniformly at random."""
    candidates = torch.nonzero(mask).reshape(-1)
    return candidates[torch.randperm(len(candidates), generator=generator)[:count]]


def _weighted_then_uniform(weights: Tensor, eligible: Tensor, k: int, generator: torch.Generator) -> Tensor:
    """Sample without replacement proportionally to ``weights`` among eligible records with a positive
    weight, then top up uniformly from the eligible records not yet picked (indices, not values)."""
    weights = torch.where(eligible & torch.isfinite(weights) & (weights > 0), weights, torch.zeros_like(weights))
    positive = int((weights > 0).sum())
    # multinomial without replacement can only draw as many categories as have positive weight.
    picked = torch.multinomial(weights.double(), min(k, positive), replacement=False, generator=generator) \
        if positive else torch.zeros(0, dtype=torch.int64)
    return _top_up(picked, eligible, k, generator)


def _top_up(picked: Tensor, eligible: Tensor, k: int, generator: torch.Generator) -> Tensor:
    if len(picked) >= k:
        return picked[:k]
    remaining = eligible.clone()
    remaining[picked] = False
    return torch.cat([picked, _uniform(remaining, k - len(picked), generator)])


# -------------------------------------------------------------------------------------- selectors


def select_random(eligible: Tensor, k: int, generator: torch.Generator) -> Tensor:
    """``k`` distinct eligible records, uniformly at random without replacement (paper 000's Random).

    Args:
        eligible: boolean mask over dataset indices: the records this rank may send.
        k: how many records to pick; ``1 <= k <= eligible.sum()``.
        generator: source of randomness.

    Returns:
        ``k`` dataset indices (int64), in the order drawn.
    """
    return _uniform(eligible, _check_k(k, eligible), generator)


def select_hem(latest: Tensor, eligible: Tensor, k: int, generator: Optional[torch.Generator] = None) -> Tensor:
    """The ``k`` eligible records with the highest latest loss (Hard Example Mining).

    Deterministic, as in paper 000: ties go to the lower dataset index, and records without a
    recorded loss rank below every record with one. ``generator`` is accepted for a uniform
    signature and unused.
    """
    k = _check_k(k, eligible)
    key = torch.where(eligible & ~torch.isnan(latest), latest.double(), torch.full_like(latest, -math.inf).double())
    key = torch.where(eligible, key, torch.full_like(key, math.nan))  # ineligible: never picked
    # A stable sort on the negated key ranks by loss descending with ties in index order;
    # NaN (ineligible) sorts last.
    order = torch.sort(-key, stable=True).indices
    return order[:k]


def spl_threshold(epoch: int, initial: float = SPL_INITIAL_THRESHOLD, growth: float = SPL_GROWTH) -> float:
    """SPL's loss threshold after ``epoch`` completed-epoch steps: ``initial * growth ** epoch``.

    The first selection (after epoch 0) uses ``initial``; each later epoch multiplies it by
    ``growth`` (paper 000: 0.1 and 1.2).
    """
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"epoch must be an integer >= 0; got {epoch!r}")
    return float(initial) * float(growth) ** epoch


def select_spl(
    latest: Tensor, eligible: Tensor, k: int, threshold: float, generator: torch.Generator
) -> Tensor:
    """Self-Paced Learning: sample among records whose latest loss is below ``threshold``, weighted by loss.

    Candidates are the eligible records with a recorded loss ``< threshold``. Up to ``k`` are drawn
    without replacement with probability proportional to their loss (the hardest of the easy
    records are preferred). If fewer than ``k`` candidates have a positive loss, the rest of the
    candidates are added uniformly at random, and if there are fewer than ``k`` candidates at all,
    the remaining picks are uniform among the other eligible records: so a record above the
    threshold is picked only when fewer than ``k`` records lie below it, and with no candidate
    (no loss recorded yet, or all above the threshold) SPL is plain random selection.
    """
    k = _check_k(k, eligible)
    candidates = eligible & ~torch.isnan(latest) & (latest < threshold)
    picked = _weighted_then_uniform(latest.double(), candidates, min(k, int(candidates.sum())), generator) \
        if bool(candidates.any()) else torch.zeros(0, dtype=torch.int64)
    return _top_up(picked, eligible, k, generator)


def active_bias_weights(variance: Tensor, epochs_recorded: Tensor) -> Tensor:
    """Active Bias weight of each record: ``v = sqrt(var + var^2 / c)``, 0 where ``c = 0``.

    ``var`` is the variance of the record's per-epoch loss history and ``c`` the number of epochs
    recorded for it (DESIGN 3.6, after the reference code). A record seen in fewer than two
    epochs has variance 0 and therefore weight 0.
    """
    variance = variance.double()
    count = epochs_recorded.double()
    safe = count.clamp(min=1.0)
    weights = torch.sqrt((variance + variance**2 / safe).clamp(min=0.0))
    return torch.where(count > 0, weights, torch.zeros_like(variance))


def select_active_bias(weights: Tensor, eligible: Tensor, k: int, generator: torch.Generator) -> Tensor:
    """Active Bias: sample ``k`` eligible records without replacement, proportionally to ``weights``.

    When fewer than ``k`` eligible records have a positive weight (the first two epochs, or a
    model that no longer changes), the missing picks are uniform random *indices* among the
    eligible records not yet picked.
    """
    return _weighted_then_uniform(weights, eligible, _check_k(k, eligible), generator)


def select_records(
    selector: str,
    history: LossHistory,
    eligible: Tensor,
    k: int,
    generator: torch.Generator,
    spl_initial: float = SPL_INITIAL_THRESHOLD,
    spl_growth: float = SPL_GROWTH,
) -> Tensor:
    """Pick ``k`` records to gossip with the named selector, from ``history`` as of the last ``end_epoch``.

    SPL's threshold is :func:`spl_threshold` of the index of the last completed epoch, so the
    first selection uses ``spl_initial``.
    """
    if selector == "random":
        return select_random(eligible, k, generator)
    if selector == "hem":
        return select_hem(history.latest, eligible, k, generator)
    if selector == "spl":
        epoch = max(history.epochs_completed - 1, 0)
        return select_spl(history.latest, eligible, k, spl_threshold(epoch, spl_initial, spl_growth), generator)
    if selector == "active_bias":
        weights = active_bias_weights(history.variance(), history.epochs_recorded)
        return select_active_bias(weights, eligible, k, generator)
    raise ValueError(f"selector must be one of {SELECTORS}; got {selector!r}")
