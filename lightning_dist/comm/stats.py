"""Communication counters: what a strategy sent, by purpose."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PURPOSES = ("setup", "protocol", "evaluation", "final", "checkpoint", "accounting")
"""Why bytes were sent: ``setup`` (initial broadcast, set-up checks), ``protocol`` (the algorithm's own exchanges,
what the papers count), ``evaluation`` (averaging for validation/test), ``final`` (the average all
ranks hold after fit), ``checkpoint`` (replicas sent to rank 0 for the checkpoint file),
``accounting`` (summing these counters over ranks)."""


@dataclass
class CommStats:
    """Bytes and messages sent, and how many model synchronizations happened.

    ``bytes_sent`` and ``messages`` include every purpose; ``bytes_by_purpose`` breaks them down.
    ``syncs`` counts protocol averaging events (full or partial), the same number on every rank.
    """

    bytes_sent: int = 0
    messages: int = 0
    syncs: int = 0
    bytes_by_purpose: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PURPOSES, 0))

    def record(self, purpose: str, num_bytes: int, num_messages: int) -> None:
        if purpose not in self.bytes_by_purpose:
            raise ValueError(f"purpose must be one of {PURPOSES}; got {purpose!r}")
        self.bytes_sent += num_bytes
        self.messages += num_messages
        self.bytes_by_purpose[purpose] += num_bytes

    @property
    def protocol_bytes(self) -> int:
        """Bytes of the algorithm's own exchanges: the cumulative communication of paper 004."""
        return self.bytes_by_purpose["protocol"]

    def to_vector(self) -> list[int]:
        return [self.bytes_sent, self.messages] + [self.bytes_by_purpose[p] for p in PURPOSES]

    @classmethod
    def from_vector(cls, values: list[int], syncs: int) -> CommStats:
        return cls(
            bytes_sent=int(values[0]),
            messages=int(values[1]),
            syncs=syncs,
            bytes_by_purpose={p: int(v) for p, v in zip(PURPOSES, values[2:])},
        )

    def metrics(self, prefix: str = "comm/") -> dict[str, float]:
        """Flat float metrics for a Lightning logger."""
        out = {f"{prefix}bytes_sent": float(self.bytes_sent), f"{prefix}messages": float(self.messages)}
        out[f"{prefix}syncs"] = float(self.syncs)
        out.update({f"{prefix}bytes_{p}": float(b) for p, b in self.bytes_by_purpose.items()})
        return out

    def progress_bar_metrics(self) -> dict[str, float]:
        """What a progress bar shows, under short keys so it stays readable: protocol MB (10^6 bytes) and syncs."""
        return {"comm_MB": self.protocol_bytes / 1e6, "syncs": float(self.syncs)}

    def state_dict(self) -> dict[str, Any]:
        return {"vector": self.to_vector(), "syncs": self.syncs}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> CommStats:
        return cls.from_vector(state["vector"], state["syncs"])
