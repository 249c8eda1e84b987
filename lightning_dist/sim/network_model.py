"""What the simulator's network costs: the model of a link and a node's ports, and what a transfer and a ring step
take under it.

:class:`NetworkModel` holds the latency and bandwidth caps (paper 001, section 3.2, with paper 002's per-link
caps; how transfers queue for ports and links is :mod:`lightning_dist.sim.network`). The ring formulas are Gloo's
ring collectives under a model (:mod:`lightning_dist.sim.collectives` explains them and times collectives with
them; :mod:`lightning_dist.sim.machines` uses them inside a machine). This module imports nothing of the
simulator's, so every other part can build on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

BITS_PER_BYTE = 8
MEGABIT = 1e6


def _check_bandwidth(name: str, value: Optional[float]) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0 (Mbit/s) or None for no cap; got {value!r}")
    return float(value)


@dataclass(frozen=True)
class NetworkModel:
    """Latency and bandwidth caps of the simulated network (validated on construction).

    Args:
        latency: seconds from a message's last byte leaving to its arrival, ``>= 0``. Default 0.
        node_mbit: per-node cap on sending and, separately, on receiving, Mbit/s; None: no cap.
        link_mbit: per-link cap (each ordered pair of nodes), Mbit/s; None: no cap.
        half_duplex_links: the two directions of a link share it (Gloo's behaviour between two
            processes); default False.
    """

    latency: float = 0.0
    node_mbit: Optional[float] = None
    link_mbit: Optional[float] = None
    half_duplex_links: bool = False

    def __post_init__(self) -> None:
        latency = self.latency
        if isinstance(latency, bool) or not isinstance(latency, (int, float)) or not (
            math.isfinite(latency) and latency >= 0
        ):
            raise ValueError(f"latency must be a finite number of seconds >= 0; got {latency!r}")
        object.__setattr__(self, "latency", float(latency))
        object.__setattr__(self, "node_mbit", _check_bandwidth("node_mbit", self.node_mbit))
        object.__setattr__(self, "link_mbit", _check_bandwidth("link_mbit", self.link_mbit))
        if not isinstance(self.half_duplex_links, bool):
            raise ValueError(f"half_duplex_links must be a bool; got {self.half_duplex_links!r}")

    @property
    def lanes(self) -> Optional[int]:
        """Transfers a port carries at once; None when only the links limit them."""
        if self.node_mbit is None:
            return None
        if self.link_mbit is None:
            return 1
        return max(1, math.floor(self.node_mbit / self.link_mbit + 1e-9))

    @property
    def bytes_per_second(self) -> float:
        """Rate of one transfer: ``min(node, link)`` in bytes/s (``inf`` without caps)."""
        caps = [cap for cap in (self.node_mbit, self.link_mbit) if cap is not None]
        return min(caps) * MEGABIT / BITS_PER_BYTE if caps else math.inf

    def transmission_seconds(self, nbytes: int) -> float:
        """Time a transfer of ``nbytes`` occupies its ports and link."""
        return 0.0 if nbytes == 0 or math.isinf(self.bytes_per_second) else nbytes / self.bytes_per_second

    def transfer_seconds(self, nbytes: int) -> float:
        """A lone transfer's duration: ``latency + nbytes / bandwidth``."""
        return self.latency + self.transmission_seconds(nbytes)


def ring_step_seconds(model: NetworkModel, members: int, chunk_bytes: float) -> float:
    """One ring step: a chunk over one link, then the latency (two chunks on a shared half-duplex link of a pair)."""
    turns = 2 if members == 2 and model.half_duplex_links else 1
    return turns * model.transmission_seconds(chunk_bytes) + model.latency


def ring_all_reduce_seconds(model: NetworkModel, members: int, nbytes: float) -> float:
    """Duration of a ring all-reduce of ``nbytes`` among ``members``: ``2 (N - 1)`` steps of ``nbytes / N``."""
    if members < 2:
        return 0.0
    return 2 * (members - 1) * ring_step_seconds(model, members, nbytes / members)


def ring_all_gather_seconds(model: NetworkModel, members: int, nbytes: float) -> float:
    """Duration of a ring all-gather of ``nbytes`` per member among ``members``: ``N - 1`` steps of ``nbytes``."""
    if members < 2:
        return 0.0
    return (members - 1) * ring_step_seconds(model, members, nbytes)
