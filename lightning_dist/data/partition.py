"""Ways to split a training set's example indices among ranks.

Decentralized algorithms (local SGD, gossip, DataGossip) behave very differently when ranks see
i.i.d. data and when each rank sees only a few classes, so experiments choose the split:

* ``iid``: a seeded random permutation cut into nearly equal parts.
* ``class_sorted``: examples sorted by label and cut into contiguous shards, so each rank sees one
  or a few classes (the non-i.i.d. setting of the DataGossip paper).
* ``dirichlet``: per class, proportions drawn from ``Dirichlet(alpha)`` over ranks; small ``alpha``
  gives skewed label mixes, large ``alpha`` nearly balanced ones.
* ``contiguous``: consecutive index ranges in order, no labels needed; for data whose order carries
  meaning, such as the windows of a text, where rank ``i`` then reads its own stretch of the text.

Every function returns one ``int64`` index array per part, and every example is in exactly one part.
All randomness comes from the ``seed`` argument, so every rank computes the same partition.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from lightning_dist.algorithms.arguments import check_count, check_number

PARTITIONS = ("iid", "class_sorted", "dirichlet", "contiguous")
"""Names accepted by :func:`make_partition`."""

_MAX_DIRICHLET_ATTEMPTS = 100


def _check_labels(labels: ArrayLike) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            f"labels must be a 1-D array of integers; got shape {labels.shape}, dtype {labels.dtype}"
        )
    if len(labels) == 0:
        raise ValueError("labels must not be empty")
    return labels


def iid_partition(num_examples: int, num_parts: int, seed: int) -> list[np.ndarray]:
    """Split ``range(num_examples)`` at random into ``num_parts`` parts whose sizes differ by at most 1.

    Each part is returned in ascending index order.
    """
    num_examples = check_count("num_examples", num_examples, 1)
    num_parts = check_count("num_parts", num_parts, 1, num_examples)
    seed = check_count("seed", seed, 0)
    permutation = np.random.default_rng(seed).permutation(num_examples).astype(np.int64)
    return [np.sort(part) for part in np.array_split(permutation, num_parts)]


def contiguous_partition(num_examples: int, num_parts: int) -> list[np.ndarray]:
    """Cut ``range(num_examples)`` in order into ``num_parts`` consecutive ranges whose sizes differ by at most 1.

    The first ``num_examples % num_parts`` parts hold one index more.
    """
    num_examples = check_count("num_examples", num_examples, 1)
    num_parts = check_count("num_parts", num_parts, 1, num_examples)
    return np.array_split(np.arange(num_examples, dtype=np.int64), num_parts)


def class_sorted_partition(labels: ArrayLike, num_parts: int) -> list[np.ndarray]:
    """Sort indices by label (stably) and cut them into ``num_parts`` contiguous shards.

    Shard sizes differ by at most 1; within a shard, indices keep label order.
    """
    labels = _check_labels(labels)
    num_parts = check_count("num_parts", num_parts, 1, len(labels))
    order = np.argsort(labels, kind="stable").astype(np.int64)
    return list(np.array_split(order, num_parts))


def dirichlet_partition(labels: ArrayLike, num_parts: int, alpha: float, seed: int) -> list[np.ndarray]:
    """Split each class among parts in proportions drawn from ``Dirichlet(alpha)``.

    Small ``alpha`` (e.g. 0.1) gives each part a few dominant classes; large ``alpha`` (e.g. 100)
    gives near-i.i.d. parts. If a draw leaves some part empty, the next draw from the same seeded
    generator is used, so the result is still determined by ``seed``; after
    ``_MAX_DIRICHLET_ATTEMPTS`` failed draws a ValueError asks for a larger ``alpha`` or fewer parts.
    Each part is returned in ascending index order.
    """
    labels = _check_labels(labels)
    num_parts = check_count("num_parts", num_parts, 1, len(labels))
    alpha = check_number("alpha", alpha, 0.0, strict=True)
    seed = check_count("seed", seed, 0)

    rng = np.random.default_rng(seed)
    class_indices = [np.flatnonzero(labels == c).astype(np.int64) for c in np.unique(labels)]
    for _ in range(_MAX_DIRICHLET_ATTEMPTS):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_parts)]
        for indices in class_indices:
            shuffled = rng.permutation(indices)
            proportions = rng.dirichlet(np.full(num_parts, alpha))
            # Rounding (not flooring) the cut points keeps the leftovers from piling up in the last part.
            cuts = np.round(np.cumsum(proportions)[:-1] * len(shuffled)).astype(np.int64)
            for part, chunk in zip(parts, np.split(shuffled, cuts)):
                part.append(chunk)
        result = [np.sort(np.concatenate(chunks)) for chunks in parts]
        if all(len(part) > 0 for part in result):
            return result
    raise ValueError(
        f"dirichlet_partition left a part empty in {_MAX_DIRICHLET_ATTEMPTS} draws with alpha={alpha}, "
        f"num_parts={num_parts}, {len(labels)} examples; use a larger alpha or fewer parts"
    )


def make_partition(
    name: str, labels: ArrayLike, num_parts: int, seed: int = 0, alpha: float = 0.5
) -> list[np.ndarray]:
    """Partition the indices of ``labels`` by the scheme ``name`` (one of :data:`PARTITIONS`).

    ``seed`` is ignored by ``class_sorted`` and ``contiguous``, ``alpha`` is used only by ``dirichlet``,
    and ``contiguous`` reads only the number of labels, not their values.
    """
    if name == "iid":
        return iid_partition(len(_check_labels(labels)), num_parts, seed)
    if name == "class_sorted":
        return class_sorted_partition(labels, num_parts)
    if name == "dirichlet":
        return dirichlet_partition(labels, num_parts, alpha, seed)
    if name == "contiguous":
        return contiguous_partition(len(_check_labels(labels)), num_parts)
    raise ValueError(f"name must be one of {PARTITIONS}; got {name!r}")
