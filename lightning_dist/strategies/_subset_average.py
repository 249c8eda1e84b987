"""Averaging a subset of ranks over a :class:`~lightning_dist.comm.Communicator`, with no hot spot.

Runs :mod:`lightning_dist.algorithms.subset_average`'s plan (reduce into per-member chunks, then
all-gather the chunks of the mean) as batches of point-to-point transfers. Dynamic averaging's
balancing grows the set round by round and asks after each round whether the set's mean lies
within the threshold; FedAvg averages its participants in one round.

Execution order: each phase is one :meth:`Communicator.exchange` of all its pieces (every member
sends to and receives from the ``|B| - 1`` others at once, receives posted first). The ring order
of a ring reduce-scatter / all-gather, ``|B| - 1`` steps per phase in which every member sends one
piece and receives one, moves the same bytes but was no faster on the capped network of
``benchmarks/balancing_sync/run.py`` (4 ranks, 20 Mbit/s per node, same passes): sets of 3 and 4 took
1.24 and 1.40 times the members' all-reduce in steps against 1.23 and 1.19 in one batch, and 1.29
and 1.62 against 1.12 and 1.15 with every step's receives posted at the phase's start. Each step
waits for its slowest pair and starts its flows on connections idle since the previous phase, so a
phase pays ``|B| - 1`` TCP ramp-ups behind the caps' queues where one batch pays one (our reading,
not measured apart).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lightning_dist.algorithms import averaging
from lightning_dist.algorithms.subset_average import (
    Piece,
    chunk_bounds,
    chunk_distance,
    chunk_mean,
    gather_pieces,
    held_values,
    piece_dtype,
    rank_pieces,
    round_pieces,
    sum_pieces,
)
from lightning_dist.comm import Communicator
from lightning_dist.model_vector import VectorRange


class SubsetAverage:
    """One averaging of a set of ranks in progress, as this rank sees it.

    Every rank of the group creates one with its own model vector and calls the same methods with
    the same arguments (the plan is computed, never exchanged). Members own a chunk of the running
    sum between rounds; ranks outside the set move nothing but the distances.

    Args:
        comm: the strategy's communicator (all ranks).
        local: this rank's model vector (parameters, then floating-point buffers), or a
            :class:`~lightning_dist.model_vector.VectorRange` that reads the model's entries slice by slice
            (no copy of the model: a large model's balancing).
        purpose: the byte counter the transfers are recorded under.
    """

    def __init__(self, comm: Communicator, local: Tensor | VectorRange, purpose: str) -> None:
        self.comm = comm
        self.local = local
        self.purpose = purpose
        self.members: list[int] = []
        self._owned: Tensor | None = None  # this rank's chunk of the members' sum, in the accumulation dtype
        self._chunk: tuple[int, int] = (0, 0)

    def reduce(self, members: Sequence[int], added: Sequence[int]) -> None:
        """Add the models of ``added`` to the sum; ``members`` (the set after this round) now own its chunks."""
        rank, local, numel = self.comm.rank, self.local, self.local.numel()
        outgoing, incoming = rank_pieces(*round_pieces(members, added, numel), rank)
        sends = [(self._held(piece, kind), piece.destination) for piece, kind in outgoing]
        receives, mine = [], []
        for piece, kind in incoming:
            if piece.source == rank:
                mine.append((piece, self._held(piece, kind)))
            else:
                buffer = torch.empty(piece.size, dtype=piece_dtype(kind, local.dtype), device=local.device)
                receives.append((buffer, piece.source))
                mine.append((piece, buffer))
        self.comm.exchange(sends, receives, self.purpose)
        self.members = list(members)
        if rank in self.members:
            self._chunk = chunk_bounds(numel, self.members)[rank]
            self._owned = sum_pieces(mine, self._chunk, local.dtype, local.device)
        else:
            self._owned, self._chunk = None, (0, 0)

    def _held(self, piece: Piece, kind: str) -> Tensor:
        return held_values(piece, kind, self.local, self._owned, self._chunk)

    def squared_distance(self, reference: Tensor) -> float:
        """``||mean(f_B) - r||^2`` over the parameters, the same float on every rank (an all-gather of 8 bytes).

        ``reference`` holds the parameters only. Each member measures its chunk of the mean; the
        shares are added in rank order on every rank.
        """
        if self._owned is None:
            share = torch.zeros((), dtype=torch.float64, device=self.local.device)
        else:
            share = chunk_distance(self._mean_chunk(), self._chunk, reference)
        shares = self.comm.all_gather(share.view(1), purpose=self.purpose).view(-1).tolist()
        total = math.fsum(shares)
        return total if math.isfinite(total) else math.inf

    def _mean_chunk(self) -> Tensor:
        assert self._owned is not None
        return chunk_mean(self._owned, len(self.members), self.local.dtype)

    def gather(self) -> Tensor | None:
        """The mean of the members' models on every member (None elsewhere): each owner's chunk to the others."""
        if self.comm.rank not in self.members:
            return None
        mean = torch.empty(self.local.numel(), dtype=self.local.dtype, device=self.local.device)
        self.gather_into(lambda start, values: mean[start:start + values.numel()].copy_(values))
        return mean

    def gather_into(self, write: Callable[[int, Tensor], object]) -> bool:
        """On a member, hand every piece of the members' mean to ``write(start, values)`` (its own chunk first) and
        return True; False elsewhere. Each owner's chunk goes to the other members in windows of at most
        ``AVERAGE_BUCKET / (|B| - 1)`` entries, so a member receives at most a bucket at a time (one window for a
        chunk that fits: one message per pair, as :func:`gather_pieces` plans)."""
        rank, members = self.comm.rank, self.members
        if rank not in members:
            return False
        own = self._mean_chunk()
        write(self._chunk[0], own)
        pieces = gather_pieces(members, self.local.numel())
        window = max(1, averaging.AVERAGE_BUCKET // max(1, len(members) - 1))
        longest = max((piece.stop - piece.start for piece in pieces), default=0)  # the same on every member
        for begin in range(0, longest, window):
            sends, receives = [], []
            for piece in pieces:
                start, stop = piece.start + begin, min(piece.stop, piece.start + begin + window)
                if start >= stop:
                    continue
                if piece.source == rank:
                    sends.append((own[start - self._chunk[0]:stop - self._chunk[0]], piece.destination))
                elif piece.destination == rank:
                    receives.append((start, own.new_empty(stop - start, dtype=self.local.dtype), piece.source))
            self.comm.exchange(sends, [(buffer, source) for _, buffer, source in receives], self.purpose)
            for start, buffer, _ in receives:
                write(start, buffer)
        return True


def average_subset(comm: Communicator, local: Tensor, members: Sequence[int], purpose: str) -> Tensor | None:
    """The mean of ``members``' models on every member, None elsewhere (every rank calls it with the same members)."""
    averaging = SubsetAverage(comm, local, purpose)
    averaging.reduce(members, members)
    return averaging.gather()
