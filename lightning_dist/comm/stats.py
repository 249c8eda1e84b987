"""Communication counters: what a strategy sent, by purpose."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PURPOSES = ("setup", "protocol", "evaluation", "final", "checkpoint", "accounting", "gradients")
"""Why bytes were sent: ``setup`` (initial broadcast, set-up checks), ``protocol`` (the algorithm's own exchanges,
what the papers count), ``evaluation`` (averaging for validation/test), ``final`` (the average all
ranks hold after fit), ``checkpoint`` (replicas sent to rank 0 for the checkpoint file),
``accounting`` (summing these counters over ranks), ``gradients`` (DDP's per-step traffic inside a node under
``hierarchy="node"``: the gradient all-reduce, and local rank 0's buffers broadcast to its node mates)."""
LEVELS = ("intra_node", "inter_node")
"""Where bytes went under ``hierarchy="node"``: between the ranks of one node (DDP's gradient all-reduce, the
node's all-gathers), or between nodes (the protocol's exchanges). Flat strategies count no level."""


def check_level(level: str | None) -> str | None:
    if level is not None and level not in LEVELS:
        raise ValueError(f"level must be None or one of {LEVELS}; got {level!r}")
    return level


@dataclass
class CommStats:
    """Bytes and messages sent, and how many model synchronizations happened.

    ``bytes_sent`` and ``messages`` include every purpose; ``bytes_by_purpose`` breaks them down.
    ``syncs`` counts protocol averaging events (full or partial), the same number on every rank.
    ``bytes_by_level`` splits the bytes of a hierarchy's groups into intra- and inter-node.
    """

    bytes_sent: int = 0
    messages: int = 0
    syncs: int = 0
    bytes_by_purpose: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PURPOSES, 0))
    bytes_by_level: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LEVELS, 0))

    def record(self, purpose: str, num_bytes: int, num_messages: int, level: str | None = None) -> None:
        if purpose not in self.bytes_by_purpose:
            raise ValueError(f"purpose must be one of {PURPOSES}; got {purpose!r}")
        self.bytes_sent += num_bytes
        self.messages += num_messages
        self.bytes_by_purpose[purpose] += num_bytes
        if level is not None:
            self.bytes_by_level[check_level(level)] += num_bytes

    def absorb(self, other: CommStats) -> None:
        """Add ``other``'s bytes and messages (not its syncs) to these counters and zero ``other``'s: a background
        exchange counts into its own counters, folded into the strategy's by the training thread."""
        self.bytes_sent += other.bytes_sent
        self.messages += other.messages
        for purpose, num_bytes in other.bytes_by_purpose.items():
            self.bytes_by_purpose[purpose] += num_bytes
        for level, num_bytes in other.bytes_by_level.items():
            self.bytes_by_level[level] += num_bytes
        other.bytes_sent = other.messages = 0
        other.bytes_by_purpose = dict.fromkeys(other.bytes_by_purpose, 0)
        other.bytes_by_level = dict.fromkeys(other.bytes_by_level, 0)

    @property
    def protocol_bytes(self) -> int:
        """Bytes of the algorithm's own exchanges: the cumulative communication of paper 004."""
        return self.bytes_by_purpose["protocol"]

    def to_vector(self) -> list[int]:
        return ([self.bytes_sent, self.messages] + [self.bytes_by_purpose[p] for p in PURPOSES]
                + [self.bytes_by_level[level] for level in LEVELS])

    @classmethod
    def from_vector(cls, values: list[int], syncs: int) -> CommStats:
        levels = values[2 + len(PURPOSES):]  # absent in counters saved before levels existed
        return cls(
            bytes_sent=int(values[0]),
            messages=int(values[1]),
            syncs=syncs,
            bytes_by_purpose={**dict.fromkeys(PURPOSES, 0), **{p: int(v) for p, v in zip(PURPOSES, values[2:])}},
            bytes_by_level={level: int(levels[index]) if index < len(levels) else 0 for index, level in enumerate(LEVELS)},
        )

    def metrics(self, prefix: str = "comm/") -> dict[str, float]:
        """Flat float metrics for a Lightning logger."""
        out = {f"{prefix}bytes_sent": float(self.bytes_sent), f"{prefix}messages": float(self.messages)}
        out[f"{prefix}syncs"] = float(self.syncs)
        out.update({f"{prefix}bytes_{p}": float(b) for p, b in self.bytes_by_purpose.items()})
        if any(self.bytes_by_level.values()):
            out.update({f"{prefix}bytes_{level}": float(b) for level, b in self.bytes_by_level.items()})
        return out

    def progress_bar_metrics(self) -> dict[str, float]:
        """What a progress bar shows, under short keys so it stays readable: protocol MB (10^6 bytes) and syncs."""
        metrics = {"comm_MB": self.protocol_bytes / 1e6, "syncs": float(self.syncs)}
        if any(self.bytes_by_level.values()):  # a hierarchy: what crossed the slow link between nodes
            metrics["inter_node_MB"] = self.bytes_by_level["inter_node"] / 1e6
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"vector": self.to_vector(), "syncs": self.syncs}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> CommStats:
        return cls.from_vector(state["vector"], state["syncs"])
