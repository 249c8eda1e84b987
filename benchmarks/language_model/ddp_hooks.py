"""DDP with a gradient-compression hook: the baselines a DDP user turns on first on a slow network.

- ``powersgd``: PowerSGD (Vogels et al., NeurIPS 2019), ``torch.distributed.algorithms.ddp_comm_hooks.
  powerSGD_hook``: each gradient matrix all-reduced as two rank-``r`` factors, with error feedback and
  warm start; plain all-reduces until ``start_powerSGD_iter``.
- ``fp16`` / ``bf16``: ``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``: the gradient
  all-reduce in 16 bits (half the bytes).

Two silent paths of the framework, which users hit too:

- Lightning registers ``DDPStrategy(ddp_comm_hook=...)`` only when the root device is CUDA
  (``DDPStrategy._register_ddp_hooks``); on CPU the hook is dropped without a word and the run is
  plain DDP. :class:`CommHookDDPStrategy` registers it on every device.
- PowerSGD on Gloo needs one DDP bucket: with several, its chained all-reduces (P, then Q, per bucket)
  reached the ranks in different orders and Gloo aborted with a size mismatch. DDP builds its final
  buckets after the first iteration, so ``bucket_cap_mb`` above the model's size and
  ``start_powerSGD_iter >= 2`` give PowerSGD one bucket (the hook itself requires ``>= 2`` with error
  feedback).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

HOOKS = ("powersgd", "fp16", "bf16")


class CommHookDDPStrategy(DDPStrategy):
    """Lightning's DDP, with its ``ddp_comm_hook`` registered on any device (Lightning: CUDA only)."""

    def _register_ddp_hooks(self) -> None:
        _register_ddp_comm_hook(model=self.model, ddp_comm_state=self._ddp_comm_state,
                                ddp_comm_hook=self._ddp_comm_hook, ddp_comm_wrapper=self._ddp_comm_wrapper)


def ddp_with_hook(name: str, matrix_approximation_rank: int = 1, start_powerSGD_iter: int = 2,
                  bucket_cap_mb: float = 256.0, **ddp_kwargs: Any) -> CommHookDDPStrategy:
    """DDP with hook ``name`` (one of :data:`HOOKS`); PowerSGD with error feedback and warm start, as its defaults.

    ``bucket_cap_mb`` (default 256) keeps a model of up to 256 MB in one bucket (see the module docstring).
    """
    if name == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=matrix_approximation_rank,
                                            start_powerSGD_iter=start_powerSGD_iter)
        hook = powerSGD_hook.powerSGD_hook
    elif name in ("fp16", "bf16"):
        state, hook = None, getattr(default_hooks, f"{name}_compress_hook")
    else:
        raise ValueError(f"hook must be one of {', '.join(HOOKS)}; got {name!r}")
    return CommHookDDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook, bucket_cap_mb=bucket_cap_mb, **ddp_kwargs)
