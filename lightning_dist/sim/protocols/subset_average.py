"""The strategies' averaging of a subset of workers with no hot spot, on the simulator's network.

:class:`SubsetAverage` is :class:`lightning_dist.strategies._subset_average.SubsetAverage` with
virtual nodes for ranks: the same plan (:mod:`lightning_dist.algorithms.subset_average`:
``round_pieces``, ``gather_pieces``, ``chunk_bounds``), the same arithmetic (``sum_pieces``,
``chunk_mean``, ``chunk_distance``) and the same bytes per piece (``piece_bytes``: whole models in
the model's dtype, partial sums in the accumulation dtype). Every member owns a contiguous chunk;
a reduce sends each owner the pieces of the round's holders that fall in its chunk, a gather sends
each owner's chunk of the mean to the other members.

Time. Each phase is one :meth:`Communicator.exchange <lightning_dist.comm.Communicator.exchange>`:
a worker posts all its sends of the phase at once (in the plan's order: by destination) and goes on
when its sends have arrived and every piece it expects has arrived, so a phase costs a worker one
latency after its last transfer. The pieces go through the network model as messages: a port
carries as many at once as it has lanes, the rest queue (:mod:`lightning_dist.sim.network`). A
worker with nothing to send or receive in a phase does not wait for it (the strategy's exchange
with no operations returns at once).

Summing. An owner charges one aggregation (``execute(..., kind="aggregate")``, the time the
coordinator's aggregation was charged before) per reduce in which pieces reach it, after they have
all arrived; the chunk of the mean and its distance to the reference are part of it. A
single-member round (dynamic averaging's first round with one violator) moves nothing and charges
nothing: the sum of one model is that model. With a modelled ``aggregate_seconds`` an owner pays
it whatever the size of its chunk; measured, it pays the real time of summing its chunk (about one
model's additions, where the coordinator summed ``|B|`` models).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_dist.algorithms.subset_average import (
    WHOLE,
    Piece,
    chunk_bounds,
    chunk_distance,
    chunk_mean,
    gather_pieces,
    held_values,
    piece_bytes,
    rank_pieces,
    round_pieces,
    sum_pieces,
)
from lightning_dist.sim.engine import Node
from lightning_dist.sim.protocols.base import Program


def exchange(node: Node, sends: Sequence[tuple[int, Any, int]], sources: Sequence[int], tag: Hashable) -> Program:
    """One batch of transfers as the strategy's ``exchange``: post every ``(target, payload, nbytes)`` send,
    wait until they have arrived and a message ``tag`` from each of ``sources`` has; returns ``{source: payload}``.

    One message per (source, target) and phase: the plan never sends two pieces between a pair in one phase.
    """
    events = [node.send(target, payload, tag=tag, nbytes=nbytes) for target, payload, nbytes in sends]
    arrivals = [node.recv(source=source, tag=tag) for source in sources]
    if events or arrivals:
        yield node.simulator.env.all_of(events + arrivals)
    return {arrival.value.source: arrival.value.payload for arrival in arrivals}


class SubsetAverage:
    """One averaging of a set of workers in progress, as worker ``node.index`` runs it.

    Every worker of the run creates one with its own model vector and calls the same methods with
    the same arguments; workers outside the set move nothing.
    """

    def __init__(self, node: Node, local: Tensor) -> None:
        self.node = node
        self.local = local
        self.members: list[int] = []
        self._owned: Optional[Tensor] = None  # this worker's chunk of the members' sum, in the accumulation dtype
        self._chunk: tuple[int, int] = (0, 0)

    def reduce(self, members: Sequence[int], added: Sequence[int], tag: Hashable) -> Program:
        """Add the models of ``added`` to the sum; ``members`` (the set after this round) now own its chunks."""
        rank, local, numel = self.node.index, self.local, self.local.numel()
        outgoing, incoming = rank_pieces(*round_pieces(members, added, numel), rank)
        sends = [(piece.destination, self._held(piece, kind), piece_bytes(piece, kind, local.dtype))
                 for piece, kind in outgoing]
        # This owner's pieces in the plan's order; None: arriving.
        mine: list[tuple[Piece, Optional[Tensor]]] = [
            (piece, self._held(piece, kind) if piece.source == rank else None) for piece, kind in incoming]
        sources = [piece.source for piece, values in mine if values is None]
        received = yield from exchange(self.node, sends, sources, tag)
        self.members = list(members)
        if rank not in self.members:
            self._owned, self._chunk = None, (0, 0)
            return
        self._chunk = chunk_bounds(numel, self.members)[rank]
        summands = [(piece, received[piece.source] if values is None else values) for piece, values in mine]
        if sources:
            self._owned = yield from self.node.execute(sum_pieces, summands, self._chunk, local.dtype, kind="aggregate")
        else:
            self._owned = sum_pieces(summands, self._chunk, local.dtype)

    def _held(self, piece: Piece, kind: str) -> Tensor:
        return held_values(piece, kind, self.local, self._owned, self._chunk)

    def share(self, reference: Tensor) -> float:
        """This worker's share of ``||mean(f_B) - r||^2`` (its chunk's, 0 outside the set): what it all-gathers."""
        if self._owned is None:
            return 0.0
        return float(chunk_distance(self._mean_chunk(), self._chunk, reference))

    def _mean_chunk(self) -> Tensor:
        assert self._owned is not None
        return chunk_mean(self._owned, len(self.members), self.local.dtype)

    def gather(self, tag: Hashable) -> Program:
        """The mean of the members' models on every member (None elsewhere): each owner's chunk to the others."""
        rank, local = self.node.index, self.local
        if rank not in self.members:
            return None
        mean = torch.empty_like(local)
        own = self._mean_chunk()
        mean[self._chunk[0] : self._chunk[1]] = own
        pieces = gather_pieces(self.members, local.numel())
        sends = [(piece.destination, own, piece_bytes(piece, WHOLE, local.dtype)) for piece in pieces
                 if piece.source == rank]
        incoming = [piece for piece in pieces if piece.destination == rank]
        received = yield from exchange(self.node, sends, [piece.source for piece in incoming], tag)
        for piece in incoming:
            mean[piece.start : piece.stop] = received[piece.source]
        return mean
