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
other steps (a model crosses ``Delta`` one check earlier or later). ``examples/lm_demo.py`` (1 thread,
pinned kernels: Delta 211.9, the target after 150 steps, 23.9 virtual s) moved on one AMD EPYC to Delta 213.4,
212.2 and 211.8 and 175 steps (27.3 s) with MKL's own branch, ATen's AVX-512 kernels and 2 threads, to 212.9
and 211.1 and still 150 steps with oneDNN's own instruction set and with all three libraries' own kernels;
DDP's final loss stayed within 2.605-2.607 (``benchmarks/results/demo_replay.json``,
``python -m benchmarks.simulator.demo_replay``). :func:`numerics` says which of these a run had, for results to
record.

What the pins leave, in the demo's training step (its kernels listed with ``MKL_VERBOSE=1``,
``ONEDNN_VERBOSE=1`` and ``torch.profiler``: every matrix product, the attention's included, is MKL's SGEMM on
1 thread; the GELU and its gradient are oneDNN's ``jit:avx2`` eltwise; the rest, AdamW included, is ATen's):

- MKL's COMPATIBLE branch is documented as SSE2 without ``rcpps``/``rsqrtps`` (the two instructions whose
  results differ between CPU vendors) and as giving the same results on Intel and compatible CPUs for a fixed
  thread count, aligned or not (oneMKL developer guide, "Specifying Code Branches", "Reproducibility
  Conditions"; here its products came out the same at 16 alignments of their operands). ``STRICT`` applies only
  to the AVX2 and AVX-512 branches; torch already turns MKL's dynamic threading off.
- ATen's AVX2 kernels and oneDNN's AVX2 GELU are fixed code of additions, multiplications, FMAs, divisions and
  square roots, each exactly rounded on every x86-64 CPU (ATen's ``reciprocal``/``rsqrt`` divide; oneDNN's
  GELU divides too). oneDNN promises bitwise repeatability only on one platform; switching it off
  (``torch.backends.mkldnn``) would move the GELU to ATen and change every pinned figure.
- Python's float ``**`` (AdamW's bias corrections) is the C library's ``pow``: the same on any x86-64 CPU
  with FMA given the same C library. numpy only shuffles integers; Python's hash seed changes nothing
  (``demo_replay``'s ``pinned`` variant runs with another).

Nothing found there depends on the CPU model, yet an Intel Xeon that printed the demo's kernel line printed
other figures (issue 42: Delta 209, 175 steps, DDP's final loss 2.605, against 211.9, 150 and 2.606 on an AMD
EPYC). Its cause is not known: the figures replay bit for bit on one CPU model, and across models they are
documented with their spread rather than promised.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch

PINNED_KERNELS = {
    # MKL's SSE2 path without rcpps/rsqrtps: its one branch documented to give the same results on Intel and
    # other x86-64 CPUs.
    "MKL_CBWR": "COMPATIBLE",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
"""The environment :func:`pin_cpu_kernels` sets: MKL, ATen and oneDNN each read theirs when they first compute."""


def pin_cpu_kernels() -> None:
    """Make torch run the same float32 code on every x86-64 CPU with AVX2 (see the module docstring: the same
    code, whose results are the same on any one CPU model and have differed between an AMD and an Intel one).

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
