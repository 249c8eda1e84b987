"""Streaming synchronization: Streaming DiLoCo's fragments, delay and mixing (Douillard et al. 2025, "Streaming
DiLoCo with overlapping communication: Towards a Distributed Free Lunch", arXiv 2501.18512, section 2 and
Algorithm 1), for periodic averaging and DiLoCo.

Plain torch: the schedule (which fragment's exchange starts and which is merged after an optimizer step) and
the merge rule. The strategies and the simulator's protocols run exactly these.

The model vector is cut into ``P`` fragments (:meth:`StreamingPlan.fragment_bounds`). Every ``H / P`` steps one
fragment, in turn, is synchronized, so each fragment is synchronized once every ``H`` steps, as the whole model
would be by blocking periodic averaging or DiLoCo with period ``H``, and every exchange carries ``1 / P`` of the
model. For fragment ``p`` synchronized at step ``t`` (Algorithm 1 of the paper, with ``theta_p`` the fragment's
global model, the same on every replica, and ``theta_{m,p}`` replica ``m``'s)::

    at step t - tau:  the replicas' mean  mean_p = 1/M sum_m theta_{m,p}^{(t - tau)}  starts in the background
    at step t:        theta_p <- OuterOpt(theta_p, theta_p - mean_p)       (DiLoCo; plain averaging: theta_p <- mean_p)
                      theta_{m,p}^{(t)} <- alpha theta_{m,p}^{(t)} + (1 - alpha) theta_p      (every replica)

The exchange overlaps the ``tau`` steps of computation between its start and its merge; what a replica merges
is the mean of the snapshots taken at step ``t - tau`` and is applied after step ``t``, so it never depends on
when the bytes arrived and a seeded run replays. ``alpha`` keeps part of the replica's own progress made while
the exchange was in flight (``alpha = 0`` discards it, torchft's default; the paper uses 0.5).

With ``P = 1``, ``tau = 0`` and ``alpha = 0`` this is blocking periodic averaging or DiLoCo, bit for bit.

Where this departs from the paper, and why:

- Fragments are ``P`` contiguous, nearly equal ranges of the flat model vector, not groups of transformer blocks
  (the paper's "sequential" and "strided" patterns): equal bytes per exchange on any model, which is what lets
  each exchange hide behind the same number of steps; a fragment boundary may cut a tensor.
- The schedule is torchft's (``torchft.local_sgd.DiLoCo``): fragment ``(j - 1) mod P`` at the ``j``-th step
  multiple of ``H / P`` (``H`` a multiple of ``P``), its exchange started ``tau < H / P`` steps before, so at most
  one exchange is in flight (the paper offsets the fragments the same way, ``t_p = p H / P``).
- The outer gradient is not quantized to 4 bits (the paper's E3M0); the package's ``compression`` (bf16 or
  int8 deltas with error feedback, per fragment) applies instead.
- Buffers (BatchNorm's statistics) lie in the last fragment; they are averaged, not stepped by the outer
  optimizer (as in blocking DiLoCo), and mixed like parameters (a convex mix of variances stays >= 0).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from lightning_dist.algorithms.arguments import check_count, check_steps
from lightning_dist.algorithms.subset_average import chunk_bounds


@dataclass(frozen=True)
class StreamingPlan:
    """``P`` fragments synchronized in turn every ``H / P`` steps, each exchange merged ``tau`` steps after it starts.

    Args:
        period: ``H``, optimizer steps between two synchronizations of the same fragment.
        fragments: ``P``, how many fragments the model is cut into; ``H`` must be a multiple of ``P``.
        delay: ``tau``, optimizer steps between an exchange's start and its merge, ``0 <= tau < H / P``.
        alpha: the share of the replica's own fragment kept at a merge, in ``[0, 1]``.
    """

    period: int
    fragments: int = 1
    delay: int = 0
    alpha: float = 0.0

    def __post_init__(self) -> None:
        check_steps("period", self.period, "optimizer steps between synchronizations of a fragment")
        check_count("fragments", self.fragments, 1, self.period,
                    " (each fragment is synchronized at its own step, at most one per step within a period)")
        if self.period % self.fragments:
            raise ValueError(
                f"period ({self.period}) must be a multiple of fragments ({self.fragments}): a fragment is "
                "synchronized every period / fragments steps, in turn"
            )
        check_count("fragment_sync_delay", self.delay, 0, self.stride - 1,
                    f" (steps an exchange overlaps; below period / fragments = {self.stride}, so that one fragment's "
                    "exchange is merged before the next one starts)")
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
            raise ValueError(f"fragment_update_alpha must be a number in [0, 1] (the replica's share at a merge); "
                             f"got {alpha!r}")

    @property
    def stride(self) -> int:
        """``H / P``: steps between two fragments' synchronizations."""
        return self.period // self.fragments

    @property
    def streaming(self) -> bool:
        """Whether this plan differs from blocking synchronization of the whole model (``P = 1, tau = 0, alpha = 0``)."""
        return (self.fragments, self.delay, self.alpha) != (1, 0, 0.0)

    def fragment_bounds(self, numel: int) -> list[tuple[int, int]]:
        """``[start, stop)`` of each fragment of a model vector of ``numel`` elements: nearly equal, in order."""
        return list(chunk_bounds(numel, list(range(self.fragments))).values())

    def started_after(self, step: int) -> int | None:
        """The fragment whose exchange starts after optimizer step ``step`` (1-based), or None."""
        due = step + self.delay
        return self._fragment_at(due)

    def merged_after(self, step: int) -> int | None:
        """The fragment whose exchange is merged after optimizer step ``step`` (1-based), or None."""
        return self._fragment_at(step)

    def _fragment_at(self, step: int) -> int | None:
        if step < self.stride or step % self.stride:
            return None
        return (step // self.stride - 1) % self.fragments


def merge(local: Tensor, synchronized: Tensor, alpha: float) -> Tensor:
    """Algorithm 1's mix: ``alpha * local + (1 - alpha) * synchronized`` (``synchronized`` exactly when ``alpha = 0``).

    ``torch.lerp`` from ``synchronized`` towards ``local`` by ``alpha``, as torchft's ``_merge_parameters``; a new
    tensor in ``local``'s dtype.
    """
    return synchronized.to(local.dtype).lerp(local, alpha)
