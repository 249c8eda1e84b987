"""What a seeded simulation's figures depend on besides its seed, and how to hold it fixed.

With modelled compute (``SpeedModel(step_seconds=..., aggregate_seconds=...)``) a simulation uses no
wall-clock time and draws every random number from seeded generators, yet its floats also depend on
torch's float32 kernels, whose results differ in their last bits with

- the intra-op thread count: a reduction split among more threads sums in another order. A
  :class:`~lightning_dist.sim.Simulation` runs with ``threads=1`` (:func:`intra_op_threads`) unless told
  otherwise;
- the code path torch dispatches to on the CPU it finds: MKL's matrix products (chosen by CPU vendor
  and instruction set), ATen's vectorized kernels (AVX2 or AVX-512) and oneDNN's JIT kernels (the GELU:
  AVX2, AVX-512, AVX-512 with bf16). :func:`pin_cpu_kernels` makes every x86-64 CPU with AVX2 take
  the same ones.

Training amplifies last-bit differences, and dynamic averaging turns them into synchronizations at
other steps (a model crosses ``Delta`` one check earlier or later): on one AMD EPYC,
``examples/lm_demo.py`` with 1 thread reached its target after 175 steps (28.2 virtual s) on MKL's
default path and after 150 (25.2 s) on its COMPATIBLE path, the other kernels unchanged.
:func:`numerics` says which of these a run had, for results to record.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch

PINNED_KERNELS = {
    # MKL's SSE2 path: its one branch that gives the same results on Intel and other x86-64 CPUs.
    "MKL_CBWR": "COMPATIBLE",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
"""The environment :func:`pin_cpu_kernels` sets: MKL, ATen and oneDNN each read theirs when they first compute."""


def pin_cpu_kernels() -> None:
    """Make torch run the same float32 code on every x86-64 CPU with AVX2 (see the module docstring).

    Sets :data:`PINNED_KERNELS` in the environment, overriding what is there: call it before torch
    computes anything, first thing in a script (importing torch, Lightning and this package computes
    nothing). The price is MKL's SSE2 matrix products: a training step of the demo's TransformerLM takes
    twice as long (62 -> 132 ms of CPU on a 2-core AMD EPYC; pinning ATen and oneDNN to AVX2 costs
    nothing there). A CPU without AVX2 runs ATen's and oneDNN's plainer kernels (:func:`numerics` tells),
    other architectures their own.

    Raises:
        RuntimeError: ATen had chosen wider kernels already, so some of torch's work ran before the call.
    """
    os.environ.update(PINNED_KERNELS)
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        raise RuntimeError(
            f"torch chose its {capability} kernels before pin_cpu_kernels(): call it before torch computes "
            f"anything, or set {' '.join(f'{name}={value}' for name, value in PINNED_KERNELS.items())} in the "
            "environment of the process"
        )


def numerics() -> dict[str, Any]:
    """What a run's floats depend on besides its seed and code: the machine's architecture, torch's version,
    its intra-op threads now, ATen's CPU kernels, and the MKL branch and oneDNN instruction set asked for
    in the environment (None: each library's own choice for this CPU)."""
    return {
        "machine": platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl_cbwr": os.environ.get("MKL_CBWR"),
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
    }


@contextmanager
def intra_op_threads(threads: Optional[int]) -> Iterator[None]:
    """Run the block with torch's intra-op thread count set to ``threads`` (None: left as it is), restored after."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
