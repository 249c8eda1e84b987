"""Model-averaging math of dynamic averaging (paper 004, Kamp et al., ECML-PKDD 2018) and FedAvg.

Plain torch on flat model vectors: no Lightning, no process groups. The strategies in
``lightning_dist.strategies`` and the simulator call these functions; the distributed
strategies only decide *where* the vectors live and *how* they travel.

Notation follows paper 004: ``m`` local learners with models ``f^i``, reference model ``r``,
divergence threshold ``Delta``, check period ``b``, violation counter ``v``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Generator, Iterable, Sequence

import torch
from torch import Tensor


DISTANCE_CHUNK = 1 << 20
"""Elements per float64 temporary in :func:`squared_distance_sum` (8 MiB)."""

AVERAGE_BUCKET = 2**24
"""Entries a strategy averages (and DiLoCo steps) at a time: 64 MiB in float32, two in flight (DDP's bucket is
25 MB; fewer latencies on a slow link). Read when a strategy sets up, so a test may lower it."""


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums of models in ``dtype`` accumulate in: at least float32.

    A bfloat16 sum rounds to 8 significant bits at every addition; m models summed that way lose
    up to ``log2(m)`` bits of the mean. Sums run in float32 (float64 stays float64) and the mean is
    rounded to the models' dtype once.
    """
    return torch.promote_types(dtype, torch.float32)


FINITE_CHUNK = 2**20
"""Elements per piece of :func:`all_finite`'s exact check."""


def all_finite(tensor: Tensor) -> bool:
    """Whether every element of ``tensor`` is finite, without a temporary of its size.

    ``torch.isfinite(t).all()`` builds ``|t|`` and three masks of ``t``'s size (a model copy and more, per check). The
    sum of ``t`` in its own dtype is non-finite whenever an element is (NaN and infinities propagate), and can only
    be wrongly non-finite by overflowing; then the exact check decides, a piece of :data:`FINITE_CHUNK` elements at a
    time.
    """
    if bool(torch.isfinite(tensor.sum())):
        return True
    return all(bool(torch.isfinite(piece).all()) for piece in tensor.reshape(-1).split(FINITE_CHUNK))


def accumulated_nbytes(numel: int, dtype: torch.dtype) -> int:
    """The bytes of ``numel`` entries summed in :func:`accumulation_dtype` of ``dtype``: what a full
    synchronization's all-reduce moves."""
    return numel * torch.empty(0, dtype=accumulation_dtype(dtype)).element_size()


def squared_distance_sum(pairs: Iterable[tuple[Tensor, Tensor]], chunk_elements: int = DISTANCE_CHUNK) -> Tensor:
    """``sum_j ||a_j - b_j||^2`` over pairs of equally long tensors, in float64, as a 0-d tensor.

    The float64 definition (each entry converted to float64, then subtracted and squared), computed
    ``chunk_elements`` entries at a time: the float64 temporaries stay at ``8 * chunk_elements``
    bytes whatever the model size (converting whole models costs 36 bytes per parameter: 36 GB
    for a billion). The sum stays on the tensors' device, so an accelerator is not waited for.
    """
    total: Tensor | None = None
    for first, second in pairs:
        first, second = first.detach().reshape(-1), second.detach().reshape(-1)
        if first.numel() != second.numel():
            raise ValueError(f"tensors to compare must have equal sizes; got {first.numel()} and {second.numel()}")
        for start in range(0, first.numel(), chunk_elements):
            difference = first[start : start + chunk_elements].to(torch.float64, copy=True)
            difference -= second[start : start + chunk_elements]
            part = torch.dot(difference, difference)
            total = part if total is None else total + part
    return total if total is not None else torch.zeros((), dtype=torch.float64)


def squared_distance(model: Tensor, reference: Tensor) -> float:
    """``||model - reference||^2`` over all entries (the quantity in the local condition), in float64."""
    return float(squared_distance_sum([(model, reference)]))


def local_condition_holds(model: Tensor, reference: Tensor, divergence_threshold: float) -> bool:
    """Algorithm 1's local condition ``||f^i - r||^2 <= Delta``.

    A non-finite model never satisfies it, so it is reported as a violation rather than
    being silently treated as in sync.
    """
    distance = squared_distance(model, reference)
    return math.isfinite(distance) and distance <= divergence_threshold


def calibrated_threshold(drifts: Sequence[float], steps: int) -> float:
    """``Delta`` for a run that did not set one: the mean over ranks of ``||f^i - r||^2`` after ``steps`` local steps.

    Every replica starts from ``r`` and trains alone for ``steps`` steps; the squared distance each
    has moved by then is what a periodic protocol with period ``steps`` lets build up before its first
    synchronization. Taking that as ``Delta`` makes the local conditions (paper 004, Algorithm 1) fire
    when the replicas have moved as far as they moved in ``steps`` steps at the start of training: as
    often as ``sigma_steps`` while the drift per step stays what it was, less often as it falls (the
    regime where paper 004 saves communication), more often after a concept drift. Units then come
    from the run (model size, learning rate, optimizer), not from paper 004's MNIST net, whose
    absolute 0.1-1.0 are orders of magnitude off on other models; this measurement is our extension.
    Paper 004's link between the two protocols is Theorem 5 (appendix): dynamic averaging keeps a
    periodic protocol's loss bound when ``Delta`` bounds the divergence that protocol allows.

    Raises when the mean is not a positive finite number (the replicas did not move): then no
    threshold can be measured and the caller must set one.
    """
    mean = math.fsum(drifts) / len(drifts) if drifts else math.nan
    if not (math.isfinite(mean) and mean > 0):
        raise ValueError(
            f"divergence_threshold=None measures Delta as the replicas' mean squared drift after calibration_steps="
            f"{steps} local steps, but that was {mean!r} (the parameters did not move): set divergence_threshold"
        )
    return mean


def calibration_periods(check_every: int, calibration_steps: int) -> list[int]:
    """The periods whose drift can become ``Delta``: every check up to ``calibration_steps``."""
    return list(range(check_every, calibration_steps + 1, check_every))


def calibration_period(
    periods: Sequence[int], step_seconds: float, sync_seconds: float, sync_overhead: float | None
) -> int:
    """The period whose drift becomes ``Delta``: the shortest of ``periods`` (local steps, ascending) over which a
    full synchronization costs at most ``sync_overhead`` times the computing it follows.

    ``sync_seconds <= sync_overhead * period * step_seconds``: a periodic protocol with that period spends at
    most that share of its time communicating. Paper 004 leaves ``Delta`` to the user and relates it to a
    periodic protocol (Theorem 5, appendix: dynamic averaging keeps the loss bound of the periodic protocol
    whose divergence ``Delta`` bounds, communicating no more). Which periodic protocol is worth matching
    depends on the network: synchronizing every 20 steps costs little where an all-reduce takes a fraction of
    a step and dominates where it takes 30 steps. Choosing the period by its cost, then ``Delta`` as its drift
    (:func:`calibrated_threshold`), is our extension; the paper's protocol then runs unchanged. The longest
    period when none qualifies, when ``sync_overhead`` is None (the drift of the longest period whatever the
    network: a run that replays without timings), or when a time is not a finite number > 0.
    """
    longest = periods[-1]
    if sync_overhead is None or not all(math.isfinite(t) and t > 0 for t in (step_seconds, sync_seconds)):
        return longest
    return next((period for period in periods if sync_seconds <= sync_overhead * period * step_seconds), longest)


SYNC_PROBE_PARTS = 8
"""The calibration's probe all-reduces ``1 / SYNC_PROBE_PARTS`` of a full synchronization's bytes ..."""
SYNC_PROBE_MAX_BYTES = 64 << 20
"""... and at most this many: the probe is a temporary buffer on the device, next to a large model."""


def sync_probe_bytes(sync_bytes: int) -> int:
    """The probe's size for a full synchronization of ``sync_bytes`` (:data:`SYNC_PROBE_PARTS`, at most
    :data:`SYNC_PROBE_MAX_BYTES`, at least one byte)."""
    return max(min(sync_bytes // SYNC_PROBE_PARTS, SYNC_PROBE_MAX_BYTES), 1)


def sync_probe(
    numel: int, ranks_per_learner: int, element_size: int, sync_bytes: Callable[[int], int]
) -> tuple[int, float]:
    """The probe every rank all-reduces while ``Delta`` is measured: ``(elements, parts)``, ``elements`` entries of
    ``element_size`` bytes (:func:`sync_probe_bytes` of a synchronization, rounded down to whole entries, at least
    one) and ``parts``, a full synchronization's bytes over the probe's (:func:`estimated_sync_seconds`).

    ``numel``: the model's entries; ``ranks_per_learner``: ``L``, the ranks of a learner (1, or a node's under
    ``hierarchy="node"``, where local rank ``j`` carries chunk ``j`` of every exchange and the ``L`` slice groups
    synchronize at once); ``sync_bytes(n)``: what a full synchronization sends for ``n`` entries (the accumulated
    sum, or compressed deltas). The synchronization lasts as long as its largest chunk, ``ceil(numel / L)``
    entries, so that chunk is probed, on every rank. The result depends on nothing a rank holds alone (the chunks
    differ by one entry): every rank computes the same ``parts``, so :func:`probed_period` gives every rank the
    same period, which decides at which steps all ranks meet in collectives.
    """
    chunk_bytes = sync_bytes(-(-numel // ranks_per_learner))
    elements = max(sync_probe_bytes(chunk_bytes) // element_size, 1)
    return elements, chunk_bytes / (elements * element_size)


def estimated_sync_seconds(latency_seconds: float, probe_seconds: float, parts: float = SYNC_PROBE_PARTS) -> float:
    """A full synchronization's time from two probes: an all-reduce of 8 bytes (``latency_seconds``) and one of
    ``1 / parts`` of the model's bytes (``probe_seconds``).

    A collective's time is about ``a + c * bytes``; the line through both probes gives ``parts * probe -
    (parts - 1) * latency`` for the whole model, and never less than the probe itself (a noisy pair). Probing an
    eighth costs an eighth of a synchronization, where timing a real one would cost it all before ``Delta`` is known.
    """
    return max(probe_seconds, parts * probe_seconds - (parts - 1) * latency_seconds)


def probed_period(
    periods: Sequence[int],
    step_seconds: Sequence[float],
    latency_seconds: Sequence[float],
    probe_seconds: Sequence[float],
    sync_overhead: float,
    parts: float = SYNC_PROBE_PARTS,
) -> int:
    """:func:`calibration_period` from every replica's mean step time and probe times (:func:`estimated_sync_seconds`;
    ``parts``: the full synchronization's bytes over the probe's).

    Step times are averaged; each probe's time is the fastest replica's, the one that arrived last and waited for
    nobody (the others' times include waiting for it). Non-finite times are left out.
    """

    def finite(values: Sequence[float]) -> list[float]:
        return [value for value in values if math.isfinite(value)]

    steps, latencies, probes = finite(step_seconds), finite(latency_seconds), finite(probe_seconds)
    if not (steps and latencies and probes):
        return periods[-1]
    sync_seconds = estimated_sync_seconds(min(latencies), min(probes), parts)
    return calibration_period(periods, math.fsum(steps) / len(steps), sync_seconds, sync_overhead)


def divergence(models: Sequence[Tensor]) -> float:
    """Model divergence ``delta(f) = 1/m sum_i ||f^i - mean(f)||^2`` (paper 004, eq. 2)."""
    stacked = torch.stack([model.double() for model in models])
    return float(torch.sum((stacked - stacked.mean(dim=0)) ** 2) / len(models))


def weighted_average(models: Sequence[Tensor], weights: Sequence[float] | None = None) -> Tensor:
    """``sum_i w_i f^i / sum_i w_i``; the plain mean when ``weights`` is None.

    Computed in :func:`accumulation_dtype` (weights included: 343 is 344 in bfloat16) and rounded
    to the models' dtype once.
    """
    if not models:
        raise ValueError("models must hold at least one model vector; got an empty sequence")
    dtype = models[0].dtype
    stacked = torch.stack(list(models)).to(accumulation_dtype(dtype))
    if weights is None:
        return stacked.mean(dim=0).to(dtype)
    if len(weights) != len(models):
        raise ValueError(f"weights must have one entry per model ({len(models)}); got {len(weights)}")
    weight_tensor = torch.as_tensor(weights, dtype=stacked.dtype, device=stacked.device)
    if not torch.all(weight_tensor >= 0) or float(weight_tensor.sum()) <= 0:
        raise ValueError("weights must be non-negative with a positive sum")
    shape = (-1,) + (1,) * (stacked.dim() - 1)
    return ((stacked * weight_tensor.view(shape)).sum(dim=0) / weight_tensor.sum()).to(dtype)


def running_average(models: Iterable[Tensor], weights: Sequence[float] | None = None) -> Tensor:
    """:func:`weighted_average` without the stack: the models added one at a time, in order, to a sum in
    :func:`accumulation_dtype`, which is then divided once. It holds the sum and one model, not all of them (the
    simulator's consensus of thousands of workers). Bit for bit :func:`weighted_average`'s for up to 4 models;
    past that ATen may sum a stack in another order (it depends on the models' length), and the two differ in the
    last bits: a sum of ``m`` float32 terms in order is within ``(m - 1)`` roundings of the exact one.
    """
    total: Tensor | None = None
    weight_tensor: Tensor | None = None
    count = 0
    for model in models:
        term = model.to(accumulation_dtype(model.dtype))
        if total is None:
            dtype = model.dtype
            if weights is not None:
                weight_tensor = torch.as_tensor(weights, dtype=term.dtype)
                if not torch.all(weight_tensor >= 0) or float(weight_tensor.sum()) <= 0:
                    raise ValueError("weights must be non-negative with a positive sum")
        if weight_tensor is not None:
            if count >= len(weight_tensor):
                raise ValueError(f"weights must have one entry per model; got {len(weight_tensor)} for more models")
            term = term * weight_tensor[count]
        total = (term.clone() if term is model else term) if total is None else total.add_(term)
        count += 1
    if total is None:
        raise ValueError("models must hold at least one model vector; got none")
    if weight_tensor is None:
        return total.div_(count).to(dtype)
    if len(weight_tensor) != count:
        raise ValueError(f"weights must have one entry per model ({count}); got {len(weight_tensor)}")
    return total.div_(weight_tensor.sum()).to(dtype)


def count_violations(violators: Sequence[int], violation_counter: int, num_ranks: int) -> tuple[bool, int]:
    """Violation-counter update of Algorithm 1: ``v += |B|; if v >= m: B = [m], v = 0``.

    Returns ``(force_full_sync, new_violation_counter)``. The paper writes ``v = m``; with several
    violators per check ``v`` can jump past ``m``, so ``>=`` is the faithful reading.
    """
    violation_counter += len(violators)
    if violation_counter >= num_ranks:
        return True, 0
    return False, violation_counter


def augment_balancing_set(
    balancing_set: Sequence[int], num_ranks: int, generator: torch.Generator
) -> tuple[list[int], bool]:
    """One augmentation round of the authors' DynamicHedgeSync (fraunhofer-iais/dlplatform).

    Draws ``2 |B|`` further ranks uniformly without replacement (all remaining ranks if fewer are
    left). If ``B`` would then reach half of all ranks, balancing gives up and the caller performs
    a full synchronization; this hedge bounds the number of balancing rounds by ``O(log m)``.

    Returns ``(ranks_to_add, full_sync)``; ``ranks_to_add`` is sorted. With ``full_sync`` it holds
    every rank not yet in ``B``. The draw uses ``generator`` so that every process holding the same
    generator state computes the same set without exchanging it.
    """
    members = set(balancing_set)
    remaining = [rank for rank in range(num_ranks) if rank not in members]
    wanted = 2 * len(members)
    if wanted >= len(remaining):
        chosen = remaining
    else:
        order = torch.randperm(len(remaining), generator=generator).tolist()
        chosen = sorted(remaining[i] for i in order[:wanted])
    if len(members) + len(chosen) >= num_ranks / 2:
        return remaining, True
    return chosen, False


def balancing_rounds(
    violators: Sequence[int], num_ranks: int, violation_counter: int, generator: torch.Generator
) -> Generator[tuple[list[int], list[int]], bool, tuple[list[int], int]]:
    """The coordinator's violation resolution of Algorithm 1 (paper 004), one round at a time.

    Starts from the violator set ``B``, applies the violation counter, then, while ``B`` is not
    all ranks and ``||mean(f_B) - r||^2 > Delta``, augments ``B`` (``augment_balancing_set``).

    A generator, so that a caller can wait for models between rounds (the simulator's
    coordinator fetches them over its virtual network): it yields ``(B, newly_added)`` whenever
    the while-condition must be answered for the current ``B``, ``newly_added`` being the ranks
    added since the last yield (first the violators), and takes the answer through ``send``:
    True when the mean of ``B`` lies within the threshold. It yields nothing once ``B`` is all
    ranks. Returns (as ``StopIteration.value``) ``(B, new_violation_counter)``;
    ``len(B) == num_ranks`` means a full synchronization: the caller averages all models and sets
    the reference model to the mean.
    """
    balancing_set = sorted(set(violators))
    if not balancing_set:
        return [], violation_counter
    force_full_sync, violation_counter = count_violations(balancing_set, violation_counter, num_ranks)
    if force_full_sync:
        return list(range(num_ranks)), violation_counter
    newly_added = list(balancing_set)
    while not (yield balancing_set, newly_added):
        newly_added, full_sync = augment_balancing_set(balancing_set, num_ranks, generator)
        balancing_set = sorted(balancing_set + newly_added)
        if full_sync:
            break
    return balancing_set, violation_counter


def plan_balancing(
    violators: Sequence[int],
    num_ranks: int,
    violation_counter: int,
    generator: torch.Generator,
    mean_within_threshold: Callable[[list[int], list[int]], bool],
) -> tuple[list[int], int]:
    """:func:`balancing_rounds` answered by ``mean_within_threshold(B, newly_added)`` until it ends.

    The callback receives the ranks added since its last call so a distributed caller can fetch
    exactly those models. It is not called once ``B`` is all ranks. Returns ``(B, new_violation_counter)``.
    """
    rounds = balancing_rounds(violators, num_ranks, violation_counter, generator)
    try:
        balancing_set, newly_added = next(rounds)
        while True:
            balancing_set, newly_added = rounds.send(mean_within_threshold(balancing_set, newly_added))
    except StopIteration as done:
        return done.value


def balance_models(
    models: Sequence[Tensor],
    reference: Tensor,
    violators: Sequence[int],
    divergence_threshold: float,
    violation_counter: int,
    generator: torch.Generator,
    on_fetch: Callable[[list[int]], None] | None = None,
) -> tuple[list[Tensor], Tensor, list[int], int]:
    """Apply Algorithm 1's synchronization operator to models held in one process.

    The executable definition the distributed strategy is tested against (the simulator runs
    :func:`balancing_rounds` itself, fetching models between rounds). ``on_fetch(newly_added)`` is called whenever the coordinator needs the models of
    further ranks (first the violators, then each augmentation), so a caller that moves models
    over a network knows which transfers each round of balancing takes. Returns
    ``(new_models, new_reference, balancing_set, new_violation_counter)``.
    """

    def mean_within_threshold(balancing_set: list[int], newly_added: list[int]) -> bool:
        if on_fetch is not None:
            on_fetch(list(newly_added))
        mean = weighted_average([models[i] for i in balancing_set])
        return local_condition_holds(mean, reference, divergence_threshold)

    balancing_set, violation_counter = plan_balancing(
        violators, len(models), violation_counter, generator, mean_within_threshold
    )
    new_models = list(models)
    if not balancing_set:
        return new_models, reference, balancing_set, violation_counter
    mean = weighted_average([models[i] for i in balancing_set])
    for rank in balancing_set:
        new_models[rank] = mean.clone()
    new_reference = mean.clone() if len(balancing_set) == len(models) else reference
    return new_models, new_reference, balancing_set, violation_counter


def sample_participants(num_ranks: int, client_fraction: float, generator: torch.Generator,
                        present: Collection[int] | None = None) -> list[int]:
    """FedAvg client sampling (McMahan et al. 2017): ``max(round(C * m), 1)`` ranks, uniformly.

    The ``max(., 1)`` is FedAvg's own definition, not a clamp of the user's value: ``C`` itself is
    validated to lie in (0, 1]. Returns sorted ranks.

    ``present``: the ranks that can take part this round (default: all), as the clients FedAvg finds available: the
    first ``count`` of them in the same uniform permutation of all ``m``, so with every rank present the same draw.
    The generator advances the same whoever is present, so ranks that disagree on who is present (a failed round)
    stay in step for the next one.
    """
    count = max(round(client_fraction * num_ranks), 1)
    if count >= num_ranks:
        return list(range(num_ranks)) if present is None else sorted(present)
    order = torch.randperm(num_ranks, generator=generator).tolist()
    return sorted([rank for rank in order if present is None or rank in present][:count])
