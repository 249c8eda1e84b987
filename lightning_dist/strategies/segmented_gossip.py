"""Segmented gossip (paper 002, the "Combo" prototype, 2019; DESIGN section 3.4)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lightning_dist.algorithms import averaging
from lightning_dist.algorithms.segmented_gossip import (
    aggregate,
    check_gossip_arguments,
    default_replicas,
    mixed_from_pulls,
    pack_segments,
    pull_plan,
    segment_bounds,
    transfers,
)
from lightning_dist.data.sampler import part_size
from lightning_dist.strategies.local_update import LocalUpdateStrategy


class SegmentedGossipStrategy(LocalUpdateStrategy):
    """Every ``period`` steps, pull each model segment from a few random peers and aggregate.

    Every ``period`` optimizer steps (``tau``) every rank splits its model vector (parameters and
    floating-point buffers, the vector the other strategies average) into ``segments`` (``S``)
    contiguous, nearly equal segments. For each segment it pulls ``replicas`` (``R``) copies from
    distinct peers; peers are drawn without replacement from the other ranks until all were
    used, then refilled, so with ``S * R <= m - 1`` every pull comes from a different rank and the
    traffic spreads over ``S * R`` links. Each segment is then replaced by the average over its
    providers and the rank itself, weighted by local dataset size (paper 002, eq. 3):
    ``W[l] = sum_j |D_j| W_j[l] / sum_j |D_j|``. ``S = 1`` is plain gossip; ``R = m - 1`` gives
    every rank the weighted all-reduce result.

    The math is :mod:`lightning_dist.algorithms.segmented_gossip`; this class moves segments.
    The round's whole pull plan is drawn from the strategy's seeded generator, identical on all
    ranks, so each rank knows whom to serve: there are no request messages. A round is one batch
    of point-to-point transfers, one message per (provider, puller) pair carrying all segments
    that pair exchanges, preceded by a 1-byte finiteness flag per rank (all-gather) so that a
    non-finite replica stops every rank before anything is aggregated.

    ``|D_j|`` is the number of training examples in rank ``j``'s part of the data, by
    :func:`lightning_dist.data.sampler.part_size` (a :class:`~lightning_dist.data.PartitionSampler`'s
    true part size, not the per-epoch count it equalises across ranks; otherwise the examples the
    sampler yields per epoch), summed over train loaders and all-gathered once at the start of
    every ``fit`` (purpose ``setup``). If a rank cannot tell (a loader without length), every rank
    weights equally, with a warning. The model used for validation, checkpoints and the end of
    ``fit`` is the same weighted mean over all ranks, the global model of paper 002's analysis
    (FedAvg's aggregate). Optimizer state stays local.

    A checkpoint resumed by another number of processes (:mod:`lightning_dist.strategies._resize`)
    starts every replica from its consensus, the weighted mean above, and rank ``r`` takes saved rank
    ``r mod m``'s optimizer and RNG states. What depends on the world size is rebuilt, not
    translated: each round draws its pull plan for the ranks now present (from the shared generator,
    kept), ``|D_j|`` is gathered again at the start of ``fit`` for the new partition, and the last
    round's link counts (per rank and fewest/most) are reset to 0; the round count goes on.

    Args:
        segments: ``S >= 1``, segments the model vector is split into; at most its number of
            elements. Paper 002's default 10.
        replicas: ``R``, peers each segment is pulled from, in ``[1, m - 1]`` (``m`` the ranks, or the nodes under
            ``hierarchy="node"``). None (default): paper 002's 2, or ``m - 1`` where that is fewer (1 on 2 ranks),
            chosen at set-up; an explicit value out of range is refused.
        period: ``tau >= 1``, optimizer steps between rounds. Paper 002's default 40.
        seed: seeds the pull plans (the same on every rank).
        **kwargs: passed to :class:`LocalUpdateStrategy` (Lightning's DDP arguments).
    """

    fault_tolerance_unsupported = (
        ": every round each learner pulls segments from peers drawn by name from a plan all ranks share, point to "
        "point, where a quorum would need a collective over whoever is alive. Use PeriodicAveragingStrategy "
        "(periodic averaging or DiLoCo) with fault_tolerance")

    strategy_name = "segmented_gossip"

    def __init__(self, segments: int = 10, replicas: int | None = None, period: int = 40, seed: int = 0,
                 **kwargs: Any) -> None:
        check_gossip_arguments(segments, replicas, period)
        if kwargs.get("compression") is not None:
            raise ValueError(
                "SegmentedGossipStrategy does not support compression: its ranks pull segments of each other's "
                "models, which share no common model to send deltas from"
            )
        super().__init__(seed=seed, **kwargs)
        self.segments = segments
        self.requested_replicas = replicas
        self.replicas = replicas  # set at set-up: the default depends on the ranks (or nodes) there are
        self.period = period
        self._bounds: list[tuple[int, int]] = []
        self._dataset_sizes: Tensor | None = None
        self._rounds = 0
        self._links_min = 0
        self._links_max = 0
        self._segments_received = 0
        self._pull_links = 0
        self._links = 0

    # ------------------------------------------------------------------ set-up

    def _configure_launcher(self) -> None:
        super()._configure_launcher()  # refuses fewer than 2 processes
        if self.hierarchy is not None and self.num_nodes < 2:
            raise ValueError(
                "SegmentedGossipStrategy with hierarchy='node' needs num_nodes >= 2: the nodes are its peers (one "
                f"node is plain DDP: use strategy='ddp'); got num_nodes={self.num_nodes}"
            )
        peers = self.world_size - 1 if self.hierarchy is None else self.num_nodes - 1
        self.replicas = default_replicas(peers) if self.requested_replicas is None else self.requested_replicas
        if self.hierarchy is None and self.replicas > self.world_size - 1:
            raise ValueError(
                f"replicas must be an integer in [1, {self.world_size - 1}] (distinct peers per segment among the "
                f"other world_size - 1 ranks); got {self.replicas} with world_size={self.world_size}"
            )
        if self.hierarchy is not None and self.replicas > self.num_nodes - 1:
            raise ValueError(
                f"replicas must be an integer in [1, {self.num_nodes - 1}] (distinct peer nodes per segment among the "
                f"other num_nodes - 1 nodes, hierarchy='node'); got {self.replicas} with num_nodes={self.num_nodes}"
            )

    def on_replicas_initialized(self, vector: Tensor) -> None:
        # Under a hierarchy a rank gossips its part of the model with its slice group: the segments are the part's.
        self._bounds = segment_bounds(self.learner_numel(), self.segments)

    def on_train_start(self) -> None:
        super().on_train_start()
        self.exchange_dataset_sizes(_part_size(self.lightning_module.trainer.train_dataloader))

    def exchange_dataset_sizes(self, local_size: int) -> Tensor:
        """All-gather every learner's ``|D_j|`` (a collective; a node's is the sum of its ranks'); 0 means unknown
        and makes all weights equal."""
        node_size = int(self.learner_sum(float(local_size), "setup"))
        local = torch.tensor([node_size], dtype=torch.int64, device=self.root_device)
        sizes = self.learners.all_gather(local, purpose="setup").view(-1).cpu()
        if not bool((sizes > 0).all()):
            rank_zero_warn(
                f"SegmentedGossipStrategy weights ranks by local dataset size, but rank(s) "
                f"{(sizes <= 0).nonzero().view(-1).tolist()} report none (a train loader without length or "
                "an empty one); every rank is weighted equally"
            )
            sizes = torch.ones_like(sizes)
        self._dataset_sizes = sizes
        return sizes

    @property
    def segment_bounds(self) -> list[tuple[int, int]]:
        """``[start, stop)`` of every segment in the model vector (known once the replicas are set up)."""
        if not self._bounds:
            raise RuntimeError("SegmentedGossipStrategy knows no segment bounds before the model is set up")
        return list(self._bounds)

    def next_plan(self) -> Tensor:
        """The pull plan of the next round, ``(m, S, R)`` providers, drawn from a copy of the plan RNG.

        The strategy's own generator is untouched, so the round itself draws this same plan; useful
        to predict a round's traffic (the benchmarks compare it with the network caps).
        """
        generator = torch.Generator()
        generator.set_state(self._generator.get_state())
        return pull_plan(self.learners.world_size, self.segments, self.replicas, generator)

    @property
    def dataset_sizes(self) -> Tensor:
        if self._dataset_sizes is None:
            raise RuntimeError("SegmentedGossipStrategy knows no dataset sizes before training starts")
        return self._dataset_sizes

    # ------------------------------------------------------------------ the protocol

    def after_local_step(self, step: int) -> None:
        if step % self.period == 0:
            self.gossip_round()

    def gossip_round(self) -> None:
        """One round on every rank: draw the plan, move the segments, aggregate (paper 002, section 4.1). Under a
        hierarchy the learners are nodes and every rank gossips its part of its node's model with its slice group.

        The round runs a range of ``AVERAGE_BUCKET`` entries of the part at a time (:meth:`_gossip_range`), so its
        temporaries are a range's, never a model's; a part under one bucket is one range, one message per link.
        Aggregation is entry by entry, so the ranges change no value. Under a hierarchy the node then shares its
        ranks' parts (:meth:`NodeHierarchy.share_parts`), a bucket at a time too."""
        learners = self.learners
        rank, world_size = learners.rank, learners.world_size
        self.raise_unless_finite(self.model_vector.all_finite())
        plan = pull_plan(world_size, self.segments, self.replicas, self._generator)
        width, hierarchy = self.learner_numel(), self._hierarchy  # a slice group's ranks have parts of one width
        offset = 0 if hierarchy is None else hierarchy.own_bounds(self.model_vector.numel)[0]
        bucket = averaging.AVERAGE_BUCKET
        for begin in range(0, width, bucket):
            stop = min(begin + bucket, width)
            self.model_vector.set_range(offset + begin, self._gossip_range(plan, offset, begin, stop))
        if hierarchy is not None:  # the node's ranks hold their aggregated parts: each to the others
            hierarchy.share_parts(self.model_vector, "protocol")

        links = transfers(plan)
        pulls = {provider: segments for (provider, puller), segments in links.items() if puller == rank}
        self._rounds += 1
        self._syncs += 1
        # With R = m - 1 every segment is aggregated over all ranks in rank order: identical replicas.
        self._replicas_in_sync = self.replicas == world_size - 1
        self._segments_received = sum(len(segments) for segments in pulls.values())
        self._pull_links = len(pulls)
        peers: list[set[int]] = [set() for _ in range(world_size)]
        for provider, puller in links:
            peers[provider].add(puller)
            peers[puller].add(provider)
        self._links = len(peers[rank])
        self._links_min = min(len(p) for p in peers)
        self._links_max = max(len(p) for p in peers)

    def _gossip_range(self, plan: Tensor, offset: int, begin: int, stop: int) -> Tensor:
        """Entries ``[begin, stop)`` of this rank's part (at ``offset`` in the model vector) after the round: each
        segment's piece in the range pulled from the segment's providers (one message per link) and aggregated."""
        rank = self.learners.rank
        pieces = [(segment, max(start, begin) - begin, min(end, stop) - begin)
                  for segment, (start, end) in enumerate(self._bounds) if start < stop and end > begin]
        bounds = [(start, end) for _, start, end in pieces]
        range_plan = plan[:, [segment for segment, _, _ in pieces]]  # the pieces' providers, as their segments'
        links = transfers(range_plan)
        local = self.model_vector.get_range(offset + begin, offset + stop)
        sends = [(pack_segments(local, bounds, segments), puller)
                 for (provider, puller), segments in links.items() if provider == rank]
        pulls = {provider: segments for (provider, puller), segments in links.items() if puller == rank}
        buffers = {provider: local.new_empty(sum(bounds[piece][1] - bounds[piece][0] for piece in segments))
                   for provider, segments in pulls.items()}
        self.learners.exchange(sends, [(buffer, provider) for provider, buffer in buffers.items()], purpose="protocol")
        providers = range_plan[rank]
        mixed = mixed_from_pulls(local, providers, bounds,
                                 {provider: (pulls[provider], buffers[provider]) for provider in pulls})
        return aggregate(local, mixed, providers, bounds, self.dataset_sizes, rank)

    def consensus(self, purpose: str) -> Tensor:
        """The dataset-size-weighted mean of all learners' models, ``sum_j |D_j| W_j / sum_j |D_j|`` (an all-reduce).

        Summed in float32 for 16-bit models (:meth:`start_sum`) and rounded to the model's dtype once, as
        :func:`~lightning_dist.algorithms.averaging.weighted_average` and the other strategies'
        averages: weighted and summed in bfloat16, a 3-rank mean of identical replicas changed
        13.5% of their entries.
        """
        if self._dataset_sizes is None:
            return super().consensus(purpose)
        local = self.model_vector.get()
        weighted = self.start_sum(self.learner_part(local)).mul_(float(self._dataset_sizes[self.learners.rank]))
        total = self.learners.all_reduce_sum_(weighted, purpose)
        mean = self.learner_whole((total / float(self._dataset_sizes.sum())).to(local.dtype), purpose)
        if not bool(torch.isfinite(mean).all()):
            self.raise_if_non_finite(local)
        return mean

    # ------------------------------------------------------------------ state and counters

    def protocol_state_dict(self) -> dict[str, Any]:
        return {"rounds": self._rounds, "links_min": self._links_min, "links_max": self._links_max}

    def load_protocol_state_dict(self, state: Mapping[str, Any]) -> None:
        self._rounds = state["rounds"]
        self._links_min = state["links_min"]
        self._links_max = state["links_max"]

    def resized_protocol_state(self, state: Mapping[str, Any], written_by: int) -> Mapping[str, Any]:
        """Rounds are counted over the run and kept; the fewest/most links describe the last round's plan among
        ``written_by`` ranks and are reset (plans themselves are drawn per round for the ranks present)."""
        return {"rounds": state["rounds"], "links_min": 0, "links_max": 0}

    def resized_worker_state(self, saved: Sequence[Mapping[str, Any]], written_by: int) -> Mapping[str, Any]:
        """Reset: a rank's segments and links of the last round, whose plan was drawn for ``written_by`` ranks."""
        return {"segments_received": 0, "pull_links": 0, "links": 0}

    def worker_state_dict(self) -> dict[str, Any]:
        return {"segments_received": self._segments_received, "pull_links": self._pull_links, "links": self._links}

    def load_worker_state_dict(self, state: Mapping[str, Any]) -> None:
        self._segments_received = state["segments_received"]
        self._pull_links = state["pull_links"]
        self._links = state["links"]

    def protocol_metrics(self) -> dict[str, float]:
        """Round count, and for the last round: segments this rank received (``S * R``), the
        distinct peers it pulled from, the distinct peers it exchanged segments with in either
        direction, and the fewest and most such peers of any rank (from the shared plan)."""
        return {
            "segmented_gossip/rounds": float(self._rounds),
            "segmented_gossip/segments_received": float(self._segments_received),
            "segmented_gossip/pull_links": float(self._pull_links),
            "segmented_gossip/links": float(self._links),
            "segmented_gossip/links_min": float(self._links_min),
            "segmented_gossip/links_max": float(self._links_max),
        }


def _part_size(loaders: Any) -> int:
    """``|D_j|`` of this rank, summed over its train loaders (:func:`part_size`); 0 if any is unknown."""
    if isinstance(loaders, Mapping):
        loaders = list(loaders.values())
    elif not isinstance(loaders, (list, tuple)):
        loaders = [loaders]
    sizes = [part_size(loader) for loader in loaders]
    return 0 if None in sizes else sum(sizes)
