"""Averaging a subset of ranks with no hot spot: a reduce-scatter, then an all-gather, over contiguous chunks.

Dynamic averaging (paper 004, Algorithm 1) averages a balancing set ``B`` of ranks, grown round by
round (the authors' DynamicHedgeSync adds ``2 |B|`` ranks while the set's mean violates the local
condition). Paper 004 routes this through a coordinator, which receives every member's model and
sends the mean back: ``|B| - 1`` models in and out of one port, a hot spot that grows with ``|B|``
(at 256 workers on 20 Mbit/s, 2 x 255 models through one port).

Here every member owns one contiguous chunk of the model vector (``|B|`` nearly equal chunks, in
member order):

- **reduce** (per balancing round): every rank that holds something to add sends each owner the
  part of it that falls in the owner's chunk; the owner sums what it receives. In the first round
  the holders are the violators, each with its whole model. In later rounds the holders are the
  members added by the round, with their whole models, and the previous round's owners, with the
  partial sums they own: the sum grows incrementally, nothing is sent twice.
- **decide**: each owner measures its chunk of the set's mean against the reference model; the
  partial squared distances (8 bytes per rank, 0 off the set) add up to ``||mean(f_B) - r||^2``.
- **gather** (once, when balancing ends with a partial set): each owner sends its chunk of the
  mean to every other member.

Cost per member, in model sizes (``rho``: the accumulation dtype's bytes over the model's, 2 for
bfloat16 and float16 models, whose partial sums travel in float32, else 1). One round of a fixed
set (FedAvg's) is a bandwidth-optimal all-reduce among the members: ``(|B| - 1) / |B|`` of a model
sent and received in the reduce, the same in the gather. A balancing whose sets grow
``B_0 < B_1 < ... < B_K`` (DynamicHedgeSync adds ``2 |B_(k-1)|`` ranks in round ``k``, so
``|B_k| = 3 |B_(k-1)|`` and ``K < log_3(m / (2 |B_0|))``) costs a member added in round ``j`` (a
violator alone in ``B_0`` counts as added in round 1: the sum of one model is that model, which it
sends in its own dtype):

- sent: ``(|B_j| - 1) / |B_j|`` of its model in round ``j``, at most ``rho / |B_(k-1)|`` (its chunk
  of the partial sum) in each later round ``k``, and ``(|B_K| - 1) / |B_K|`` in the gather: less
  than ``2 + 1.5 rho / |B_j|``;
- received: ``(|B_0| - 1) / |B_0|`` in round 0 if it is a violator, at most ``2/3 + rho / |B_k|``
  in each growth round ``k`` it takes part in (its chunk of the ``2 |B_(k-1)|`` added models and of
  the partial sums), and ``(|B_K| - 1) / |B_K|`` in the gather: about two models plus 2/3 of one
  per growth round.

At 256 ranks a violator alone whose set grows 1, 3, 9, 27, 81 receives 3.67 model sizes and sends
1.99 (2.32 for a bfloat16 model), where a coordinator would receive 80 models and send 80. Ranks
outside the set send nothing but the 8-byte distances.

Why direct pieces rather than a ring or a subgroup all-reduce: a new process group per balancing
is a collective over all ranks and slow to create on NCCL (and sets change every time); a ring
among members needs ``|B| - 1`` sequential steps, each paying the latency. Direct pieces move the
same bytes in one batch of point-to-point transfers per phase (NCCL groups them as its own
all-to-all does; Gloo runs them on its pairwise connections at once). Each phase costs one latency.

Plain torch and plain data: the strategy moves the pieces with ``Communicator.exchange``, the
simulator over its virtual network; both sum and decide with the functions here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from lightning_dist.algorithms.averaging import accumulation_dtype, squared_distance_sum

WHOLE = "whole"
"""The payload kind of a holder that adds its whole model (the model's dtype)."""
PARTIAL = "partial"
"""The payload kind of a holder that adds a partial sum it owns (:func:`accumulation_dtype`)."""


class Piece(NamedTuple):
    """Elements ``[start, stop)`` of the model vector that ``source`` sends to ``destination``.

    ``source == destination`` is a piece a rank adds locally (nothing travels).
    """

    source: int
    destination: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


def chunk_bounds(num_elements: int, owners: Sequence[int]) -> dict[int, tuple[int, int]]:
    """``owner -> (start, stop)``: contiguous chunks of ``range(num_elements)`` in the order of ``owners``.

    Sizes differ by at most one (the first ``num_elements % len(owners)`` chunks are one larger).
    With more owners than elements the last owners own empty chunks.
    """
    if not owners:
        raise ValueError("owners must name at least one rank; got none")
    size, larger = divmod(num_elements, len(owners))
    bounds, start = {}, 0
    for index, owner in enumerate(owners):
        stop = start + size + (1 if index < larger else 0)
        bounds[owner] = (start, stop)
        start = stop
    return bounds


def reduce_pieces(
    holdings: Mapping[int, tuple[int, int]], owners: Sequence[int], num_elements: int
) -> list[Piece]:
    """The pieces that add every holder's range ``holdings[h] = (start, stop)`` into the owners' chunks.

    One piece per (holder, owner) whose ranges overlap, sorted by destination then source: an
    owner's sum of its pieces in this order is the same on every rank and in the simulator.
    """
    pieces = []
    for owner, (chunk_start, chunk_stop) in chunk_bounds(num_elements, owners).items():
        for holder in sorted(holdings):
            start, stop = max(chunk_start, holdings[holder][0]), min(chunk_stop, holdings[holder][1])
            if start < stop:
                pieces.append(Piece(holder, owner, start, stop))
    return pieces


def round_pieces(members: Sequence[int], added: Sequence[int], num_elements: int) -> tuple[list[Piece], set[int]]:
    """The reduce of one balancing round: ``(pieces, whole_holders)``.

    ``members`` is the set after the round, ``added`` the ranks the round added (all of ``members``
    in the first round). Added ranks add their whole model; the other members the chunk they own
    since the previous round (of the chunks of ``members`` less ``added``). ``whole_holders`` tells
    a receiver which pieces arrive in the model's dtype (the others are partial sums, in the
    accumulation dtype, where a sum of several models needs it to keep the mean rounded once).
    A previous set of one member (a violator alone) owns the sum of one model, its model: it is a
    whole holder, whose pieces travel in the model's dtype, exactly, and cost half the bytes of a
    float32 partial sum for a bfloat16 or float16 model.
    """
    added_set = set(added)
    previous = [member for member in members if member not in added_set]
    holdings: dict[int, tuple[int, int]] = {rank: (0, num_elements) for rank in added}
    if previous:
        holdings.update(chunk_bounds(num_elements, previous))
    whole = added_set | set(previous) if len(previous) == 1 else added_set
    return reduce_pieces(holdings, members, num_elements), whole


def rank_pieces(
    pieces: Sequence[Piece], whole: set[int], rank: int
) -> tuple[list[tuple[Piece, str]], list[tuple[Piece, str]]]:
    """``rank``'s part of a reduce round: ``(outgoing, incoming)``, each piece with its kind (``WHOLE``/``PARTIAL``).

    ``outgoing``: the pieces it sends to other ranks. ``incoming``: the pieces its chunk sums, its own included
    (``source == rank``), in the plan's order, the order :func:`sum_pieces` must add them in.
    """
    outgoing, incoming = [], []
    for piece in pieces:
        kind = WHOLE if piece.source in whole else PARTIAL
        if piece.source == rank and piece.destination != rank:
            outgoing.append((piece, kind))
        elif piece.destination == rank:
            incoming.append((piece, kind))
    return outgoing, incoming


def held_values(piece: Piece, kind: str, local: Tensor, owned: Tensor | None, chunk: tuple[int, int]) -> Tensor:
    """What a rank adds for ``piece``: a slice of its model ``local`` (``WHOLE``), or of the partial sum ``owned`` of
    its ``chunk`` (``PARTIAL``)."""
    if kind == WHOLE:
        return local[piece.start : piece.stop]
    assert owned is not None, "a rank sends a partial sum only of a chunk it owns"
    return owned[piece.start - chunk[0] : piece.stop - chunk[0]]


def piece_dtype(kind: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a piece travels in: the model's ``dtype`` for ``WHOLE``, :func:`accumulation_dtype`'s for ``PARTIAL``."""
    return accumulation_dtype(dtype) if kind == PARTIAL else dtype


def gather_pieces(members: Sequence[int], num_elements: int) -> list[Piece]:
    """The all-gather that ends a balancing: every owner's chunk of the mean to every other member."""
    return [
        Piece(owner, member, start, stop)
        for owner, (start, stop) in chunk_bounds(num_elements, members).items()
        if start < stop
        for member in members
        if member != owner
    ]


def sum_pieces(
    received: Iterable[tuple[Piece, Tensor]], chunk: tuple[int, int], dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> Tensor:
    """An owner's chunk of the sum, on ``device``: every received piece added at its offset, in the order given.

    Summed in :func:`accumulation_dtype` of the model's ``dtype``; pieces may be in the model's
    dtype (whole models) or already in the accumulation dtype (partial sums).
    """
    total = torch.zeros(chunk[1] - chunk[0], dtype=accumulation_dtype(dtype), device=device)
    for piece, values in received:
        total[piece.start - chunk[0] : piece.stop - chunk[0]] += values
    return total


def chunk_mean(chunk_sum: Tensor, count: int, dtype: torch.dtype) -> Tensor:
    """The chunk of the mean of ``count`` models: the sum divided once, rounded to the models' ``dtype`` once."""
    return (chunk_sum / count).to(dtype)


def chunk_distance(mean: Tensor, chunk: tuple[int, int], reference: Tensor) -> Tensor:
    """This chunk's share of ``||mean(f_B) - r||^2`` (float64, 0-d): the entries that are parameters.

    ``reference`` holds the parameters only (the first ``len(reference)`` entries of the model
    vector; buffers follow them and are not part of the local condition).
    """
    stop = min(chunk[1], reference.numel())
    if stop <= chunk[0]:
        return torch.zeros((), dtype=torch.float64, device=mean.device)
    return squared_distance_sum([(mean[: stop - chunk[0]], reference[chunk[0] : stop])])


def piece_bytes(piece: Piece, kind: str, dtype: torch.dtype) -> int:
    """Bytes a piece carries: the model's element size for ``WHOLE`` holders, the accumulation dtype's for ``PARTIAL``."""
    return piece.size * torch.empty((), dtype=piece_dtype(kind, dtype)).element_size()


def average_subset(
    models: Mapping[int, Tensor], rounds: Sequence[Sequence[int]], reference: Tensor
) -> tuple[Tensor, list[float]]:
    """The plan run in one process: the executable definition the strategy and the simulator are tested against.

    ``rounds`` are the balancing sets after each round (each containing the previous one); the
    models of every rank in the last set are in ``models``. Returns the mean of the last set
    (the gather's result, every member's new model) and, per round, ``||mean(f_B) - r||^2`` as
    the owners' chunks add it up.
    """
    num_elements = next(iter(models.values())).numel()
    dtype = next(iter(models.values())).dtype
    owned: dict[int, Tensor] = {}
    previous: list[int] = []
    distances: list[float] = []
    for members in rounds:
        added = [member for member in members if member not in previous]
        pieces, whole = round_pieces(members, added, num_elements)
        previous_bounds = chunk_bounds(num_elements, previous) if previous else {}
        chunks = chunk_bounds(num_elements, members)
        received: dict[int, list[tuple[Piece, Tensor]]] = {member: [] for member in members}
        for piece in pieces:
            if piece.source in whole:
                values = models[piece.source][piece.start : piece.stop]
            else:
                offset = previous_bounds[piece.source][0]
                values = owned[piece.source][piece.start - offset : piece.stop - offset]
            received[piece.destination].append((piece, values))
        owned = {member: sum_pieces(received[member], chunks[member], dtype) for member in members}
        distance = sum(
            float(chunk_distance(chunk_mean(owned[member], len(members), dtype), chunks[member], reference))
            for member in members
        )
        distances.append(distance)
        previous = list(members)
    mean = torch.cat([chunk_mean(owned[member], len(previous), dtype) for member in previous])
    return mean, distances
