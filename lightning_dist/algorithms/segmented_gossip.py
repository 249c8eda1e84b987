"""Segmented gossip aggregation (paper 002, the "Combo" prototype, 2019; DESIGN section 3.4).

Every ``tau`` local steps each of the ``m`` workers splits its flattened model ``W`` into ``S``
contiguous, non-overlapping, nearly equal segments ``W = (W[1], ..., W[S])`` (eq. 1). For every
segment ``l`` it pulls the segment from ``R`` peers ("model replicas"), so it can rebuild ``R``
mixed models ``W'_r = (W_{j_{1,r}}[1], ..., W_{j_{S,r}}[S])`` (eq. 2), and aggregates each
segment over its providers ``P_l`` (the worker itself included), weighted by local dataset size
(eq. 3)::

    W~[l] = sum_{j in P_l} |D_j| W_j[l] / sum_{j in P_l} |D_j|

Peers are drawn "from all the other workers without replacement until there is no option left"
(section 4.1), so a worker's ``S * R`` pulls spread over as many links as possible: with
``S * R <= m - 1`` they all come from different workers. ``S = 1`` is plain gossip; ``R = m - 1``
gives every worker the dataset-size-weighted mean of all models, the all-reduce (FedAvg) result.

Plain torch on flat model vectors: no Lightning, no process groups. The whole pull plan of a
round is drawn from one ``torch.Generator``; every process holding the same generator state
draws the same plan, so a provider knows whom to serve without any request message.
:class:`lightning_dist.strategies.SegmentedGossipStrategy` moves the segments between processes;
:func:`gossip_round` applies a round to models held in one process (the simulator, and the
definition the distributed strategy is tested against).

Workers that leave and join (section 4.2): a puller that finds a provider unreachable marks it
offline and requests the segment from another worker (:func:`substitute_provider`,
:func:`requested_providers`); a joiner pulls every segment and aggregates them without a local
model (:func:`aggregate_pulled` with ``include_local=False``). The simulator runs this
(:mod:`lightning_dist.sim.protocols.segmented_gossip`); the strategy does not (its process group
is fixed).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch
from torch import Tensor

from lightning_dist.algorithms.arguments import check_count, check_steps
from lightning_dist.algorithms.averaging import weighted_average


DEFAULT_REPLICAS = 2
"""Paper 002's ``R``, where there are that many peers."""


def check_gossip_arguments(segments: object, replicas: object, period: object) -> None:
    """Segmented gossip's ``S``, ``R`` and ``tau``: integers >= 1, ``R`` also None (:func:`default_replicas`;
    ``R < m`` is checked once ``m`` is known)."""
    check_steps("segments", segments, "segments the model vector is split into")
    if replicas is not None:
        check_steps("replicas", replicas, "peers each segment is pulled from, or None for the default")
    check_steps("period", period, "optimizer steps between gossip rounds")


def default_replicas(peers: int) -> int:
    """``R`` when none is given: paper 002's 2, or the ``peers`` there are if fewer (1 with 2 workers), so that the
    defaults run on any number of workers. An ``R`` given explicitly is never lowered."""
    return min(DEFAULT_REPLICAS, peers)


def segment_bounds(num_elements: int, segments: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each of ``segments`` contiguous segments covering ``range(num_elements)``.

    Paper 002, eq. (1): the segments do not overlap and hold the same number of elements as far
    as possible; the first ``num_elements % segments`` segments hold one element more. Every
    segment is non-empty, so ``segments`` may not exceed ``num_elements``.
    """
    check_count("num_elements", num_elements, 1)
    check_count("segments", segments, 1, num_elements, f" (segments of a model vector of {num_elements} elements)")
    size, larger = divmod(num_elements, segments)
    bounds, start = [], 0
    for segment in range(segments):
        stop = start + size + (1 if segment < larger else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def pull_plan(world_size: int, segments: int, replicas: int, generator: torch.Generator) -> Tensor:
    """Whom every worker pulls every segment from in one round: ``plan[i, l, r]`` is a rank.

    Paper 002, section 4.1: for each of its ``S * R`` pulls a worker takes the next peer of a
    queue holding the other ranks in random order; an exhausted queue is refilled with a fresh
    random order. So no peer repeats before all others were used, over a round every peer is
    pulled from ``floor(S R / (m - 1))`` or ``ceil(S R / (m - 1))`` times, and with
    ``S * R <= m - 1`` all pulls come from different ranks. The ``R`` providers of one segment
    are always distinct: when a refill happens inside a segment, peers that already provide it
    are skipped and stay at the head of the queue for the next segment.

    Ranks are planned in order ``0 .. m - 1``, each drawing one ``torch.randperm`` per refill from
    ``generator``; equal generator states give equal plans.

    Returns:
        int64 tensor of shape ``[world_size, segments, replicas]``; ``plan[i, l]`` never holds ``i``.
    """
    check_count("world_size", world_size, 2, meaning=" (gossip needs a peer)")
    check_count("segments", segments, 1)
    check_count("replicas", replicas, 1, world_size - 1, f" (distinct peers per segment among {world_size - 1})")
    plan = torch.empty(world_size, segments, replicas, dtype=torch.int64)
    for rank in range(world_size):
        others = [peer for peer in range(world_size) if peer != rank]
        queue: list[int] = []
        for segment in range(segments):
            chosen: list[int] = []
            while len(chosen) < replicas:
                if not queue:
                    queue = [others[k] for k in torch.randperm(len(others), generator=generator).tolist()]
                # Non-empty: after a refill at most replicas - 1 queued peers already provide this segment.
                position = next(k for k, peer in enumerate(queue) if peer not in chosen)
                chosen.append(queue.pop(position))
            plan[rank, segment] = torch.tensor(chosen)
    return plan


def transfers(plan: Tensor) -> dict[tuple[int, int], list[int]]:
    """The segments each link carries in a round: ``{(provider, puller): [segment, ...]}``.

    A provider serves a puller the segments whose providers in ``plan[puller]`` include it, in
    ascending order. Each (provider, puller) pair appears at most once, so a round needs one
    message per pair; pairs that carry nothing are absent.
    """
    links: dict[tuple[int, int], list[int]] = {}
    for puller, providers_by_segment in enumerate(plan.tolist()):
        for segment, providers in enumerate(providers_by_segment):
            for provider in providers:
                links.setdefault((provider, puller), []).append(segment)
    return links


def mixed_models(models: Tensor, providers: Tensor, bounds: Sequence[tuple[int, int]]) -> Tensor:
    """The ``R`` mixed models of paper 002's eq. (2) one worker rebuilds from pulled segments.

    Args:
        models: ``[m, N]``, every worker's flat model (row ``j`` is ``W_j``).
        providers: ``[S, R]``, the puller's row of :func:`pull_plan`.
        bounds: :func:`segment_bounds` of ``N`` and ``S``.

    Returns:
        ``[R, N]``; segment ``l`` of row ``r`` is ``W_{providers[l, r]}[l]``.
    """
    _check_plan_row(providers, bounds)
    mixed = models.new_empty(providers.shape[1], models.shape[1])
    for segment, (start, stop) in enumerate(bounds):
        for replica, provider in enumerate(providers[segment].tolist()):
            mixed[replica, start:stop] = models[provider, start:stop]
    return mixed


def pack_segments(vector: Tensor, bounds: Sequence[tuple[int, int]], segments: Sequence[int]) -> Tensor:
    """The message a provider sends over one link: the listed segments of ``vector``, concatenated."""
    return torch.cat([vector[start:stop] for start, stop in (bounds[segment] for segment in segments)])


def mixed_from_pulls(
    local: Tensor,
    providers: Tensor,
    bounds: Sequence[tuple[int, int]],
    pulls: Mapping[int, tuple[Sequence[int], Tensor]],
) -> Tensor:
    """The puller's side of :func:`mixed_models`: rebuild the ``R`` mixed models from received messages.

    Args:
        local: ``[N]``, the puller's own model (gives dtype, device and size).
        providers: ``[S, R]``, the puller's row of :func:`pull_plan`.
        bounds: :func:`segment_bounds` of ``N`` and ``S``.
        pulls: ``{provider: (segments, message)}``, each message made by :func:`pack_segments`
            from the segments that :func:`transfers` lists for ``(provider, puller)``.
    """
    _check_plan_row(providers, bounds)
    mixed = local.new_empty(providers.shape[1], local.numel())
    for provider, (segments, message) in pulls.items():
        chunks = message.split([bounds[segment][1] - bounds[segment][0] for segment in segments])
        for segment, chunk in zip(segments, chunks):
            replica = providers[segment].tolist().index(provider)
            mixed[replica, slice(*bounds[segment])] = chunk
    return mixed


def aggregate(
    local: Tensor,
    mixed: Tensor,
    providers: Tensor,
    bounds: Sequence[tuple[int, int]],
    dataset_sizes: Tensor,
    rank: int,
) -> Tensor:
    """Segment-wise aggregation, paper 002's eq. (3) and (4), for worker ``rank``.

    Segment ``l`` of the result is ``sum_{j in P_l} |D_j| W_j[l] / sum_{j in P_l} |D_j|`` with
    ``P_l = {rank} + providers[l]``, ``W_rank = local`` and ``W_{providers[l, r]}[l]`` taken from
    ``mixed[r]``. Terms are summed in ascending rank order, so workers whose ``P_l`` are equal
    compute bit-identical segments (with ``R = m - 1`` every worker ends with the same model).

    Args:
        local: ``[N]``, the worker's own model.
        mixed: ``[R, N]``, the mixed models rebuilt from the pulled segments (:func:`mixed_models`).
        providers: ``[S, R]``, the worker's row of :func:`pull_plan`: distinct ranks other than ``rank``.
        bounds: :func:`segment_bounds` of ``N`` and ``S``.
        dataset_sizes: ``[m]``, ``|D_j|`` of every worker (non-negative, positive over each ``P_l``).
        rank: the aggregating worker.
    """
    _check_plan_row(providers, bounds)
    if mixed.shape != (providers.shape[1], local.numel()):
        raise ValueError(
            f"mixed must hold one model of {local.numel()} elements per replica ({providers.shape[1]}); "
            f"got shape {tuple(mixed.shape)}"
        )
    pulled = []
    for segment, (start, stop) in enumerate(bounds):
        members = [rank] + providers[segment].tolist()
        if len(set(members)) != len(members):
            raise ValueError(
                f"providers of segment {segment} must be distinct ranks other than {rank}; got {members[1:]}"
            )
        pulled.append({provider: mixed[replica, start:stop] for replica, provider in enumerate(members[1:])})
    return aggregate_pulled(local, pulled, bounds, dataset_sizes, rank)


def aggregate_pulled(
    local: Tensor,
    pulled: Sequence[Mapping[int, Tensor]],
    bounds: Sequence[tuple[int, int]],
    dataset_sizes: Tensor,
    rank: int,
    include_local: bool = True,
) -> Tensor:
    """Eq. (3) over the segments as they were pulled: ``pulled[l]`` maps each provider of segment ``l`` to it.

    Segment ``l`` of the result is ``sum_{j in P_l} |D_j| W_j[l] / sum_{j in P_l} |D_j|`` with
    ``P_l`` the providers of ``pulled[l]`` plus ``rank`` (``W_rank = local``), terms in ascending
    rank order (as :func:`aggregate`, which this serves). Providers may differ in number from
    segment to segment (section 4.2: a segment whose provider went offline comes from another
    worker, or from fewer when no other is left). ``include_local=False`` is a joiner's
    aggregation, "without its local model" (section 4.2): ``P_l`` is the providers alone, and a
    segment nobody provided keeps ``local``'s values (the joiner has nothing else).
    """
    if len(pulled) != len(bounds):
        raise ValueError(f"pulled must hold one mapping per segment ({len(bounds)}); got {len(pulled)}")
    sizes = dataset_sizes.tolist()
    result = torch.empty_like(local)
    for segment, (start, stop) in enumerate(bounds):
        terms = dict(pulled[segment])
        if rank in terms:
            raise ValueError(f"segment {segment} lists rank {rank} as its own provider")
        if include_local or not terms:
            terms[rank] = local[start:stop]
        order = sorted(terms)
        result[start:stop] = weighted_average([terms[j] for j in order], [float(sizes[j]) for j in order])
    return result


def substitute_provider(
    rank: int,
    excluded: Collection[int],
    load: Mapping[int, int],
    offline: Collection[int],
    world_size: int,
    generator: torch.Generator,
) -> int | None:
    """Another worker to request a segment from, its provider being offline (paper 002, section 4.2).

    Candidates are the workers other than ``rank``, not marked ``offline`` and not in ``excluded``
    (the segment's other providers this round: they stay distinct). As section 4.1 spreads a
    round's requests over as many workers as possible, the least loaded candidates (``load``:
    requests already sent to each this round) are preferred, one drawn uniformly from them with
    ``generator``. None when no candidate is left.
    """
    candidates = [peer for peer in range(world_size) if peer != rank and peer not in offline and peer not in excluded]
    if not candidates:
        return None
    lightest = min(load.get(peer, 0) for peer in candidates)
    candidates = [peer for peer in candidates if load.get(peer, 0) == lightest]
    return candidates[int(torch.randint(len(candidates), (1,), generator=generator))]


def requested_providers(
    providers: Tensor, rank: int, offline: Collection[int], world_size: int, generator: torch.Generator
) -> list[list[int]]:
    """Whom ``rank`` requests each segment from this round: its row of :func:`pull_plan`, each provider it marks
    offline replaced by :func:`substitute_provider` (dropped when none is left). ``providers`` is ``[S, R]``."""
    chosen: list[list[int]] = []
    load: dict[int, int] = {}
    for planned in providers.tolist():
        for peer in planned:
            if peer not in offline:
                load[peer] = load.get(peer, 0) + 1
    for planned in providers.tolist():
        segment = [peer for peer in planned if peer not in offline]
        for _ in range(len(planned) - len(segment)):
            peer = substitute_provider(rank, segment, load, offline, world_size, generator)
            if peer is None:
                break
            segment.append(peer)
            load[peer] = load.get(peer, 0) + 1
        chosen.append(segment)
    return chosen


def gossip_round(models: Tensor, plan: Tensor, bounds: Sequence[tuple[int, int]], dataset_sizes: Tensor) -> Tensor:
    """One segmented gossip round applied to all ``m`` models held in one process.

    Every worker ``i`` rebuilds its mixed models from ``plan[i]`` and aggregates them with its own
    model (:func:`mixed_models`, :func:`aggregate`), all from the models as they were before the
    round. Returns the ``[m, N]`` models after the round.
    """
    if plan.shape[0] != models.shape[0]:
        raise ValueError(f"plan must have one row per model ({models.shape[0]}); got {plan.shape[0]}")
    return torch.stack(
        [
            aggregate(models[rank], mixed_models(models, plan[rank], bounds), plan[rank], bounds, dataset_sizes, rank)
            for rank in range(models.shape[0])
        ]
    )


def _check_plan_row(providers: Tensor, bounds: Sequence[tuple[int, int]]) -> None:
    if providers.dim() != 2 or providers.shape[0] != len(bounds):
        raise ValueError(
            f"providers must be one row of pull_plan, shaped [segments, replicas] with {len(bounds)} segments; "
            f"got shape {tuple(providers.shape)}"
        )
