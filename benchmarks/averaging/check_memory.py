"""Peak memory and time of dynamic averaging's local-condition check, before and after issue 16 item 10.

Every ``check_every`` steps each rank computes ``||f_i - r||^2`` (paper 004's local condition). The
old code built the flat model vector and took both it and the reference to float64 for the whole
model: about 36 bytes per parameter of temporaries (4 for the flat copy, 8 + 8 for the float64
copies, 8 for the difference, 8 for its square), 36 GB for a billion parameters. The new code,
``DynamicAveragingStrategy.after_local_step``, goes parameter by parameter against views of the
reference with :func:`lightning_dist.algorithms.averaging.squared_distance_sum`, in float64 chunks
of ``DISTANCE_CHUNK`` entries.

Each variant runs in a fresh process (``--variant``) holding the model (an MLP of ``--width``: about
``--params`` parameters, float32) and a reference model next to it. Measured there, on CPU:

- ``peak_extra_mib``: the growth of the process's peak resident set (``VmHWM``, reset through
  ``/proc/self/clear_refs`` right before the first check) over its resident set before the check.
  The child runs with ``MALLOC_MMAP_THRESHOLD_=131072``, which fixes glibc's threshold: every large
  block is mapped when allocated and unmapped when freed, so the resident set follows the live
  tensors (with the default, adaptive threshold a freed block can stay in the heap and be reused
  without showing up);
- ``seconds``: the check's wall time, best of ``--repeats``;
- ``distance``: the value, so both variants can be seen to agree.

Usage::

    python -m benchmarks.averaging.check_memory                      # 4.2M parameters; writes the JSON + PNG
    python -m benchmarks.averaging.check_memory --params 16000000    # another size

Writes ``benchmarks/results/dynamic_check_memory.{json,png}`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from lightning_dist.algorithms.averaging import DISTANCE_CHUNK, squared_distance_sum
from lightning_dist.model_vector import ModelVector

from benchmarks.common.paths import REPO, RESULTS
from benchmarks.common.report import pyplot, save_figure, write_json

VARIANTS = ("before", "after")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _model(params: int) -> nn.Module:
    """Two square-ish linear layers with about ``params`` parameters in total."""
    width = int(math.sqrt(params / 2))
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))


def _check(variant: str, vector: ModelVector, reference: torch.Tensor) -> float:
    if variant == "before":  # the code as it was: the flat copy, then whole-model float64 arithmetic
        local = vector.get()
        return float(torch.sum((vector.parameters_of(local).double() - reference.double()) ** 2))
    return float(squared_distance_sum(zip(vector.parameters, vector.parameter_views(reference))))


def measure(variant: str, params: int, repeats: int) -> dict[str, float]:
    """Run in the child process: one variant, fresh memory high-water mark."""
    torch.set_num_threads(1)
    module = _model(params)
    vector = ModelVector(module)
    generator = torch.Generator().manual_seed(1)
    reference = vector.parameters_of(vector.get()) + 1e-3 * torch.randn(vector.num_parameters, generator=generator)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    distance = _check(variant, vector, reference)
    peak = _status_kib("VmHWM")
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        _check(variant, vector, reference)
        seconds.append(time.perf_counter() - start)
    return {"variant": variant, "parameters": vector.num_parameters, "peak_extra_mib": (peak - before) / 1024,
            "bytes_per_parameter": (peak - before) * 1024 / vector.num_parameters, "seconds": min(seconds),
            "distance": distance}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=4_200_000, help="about this many parameters (default 4.2M)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # the child's role
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.variant is not None:
        print(json.dumps(measure(args.variant, args.params, args.repeats)))
        return
    rows = []
    for variant in VARIANTS:
        command = [sys.executable, "-m", "benchmarks.averaging.check_memory", "--variant", variant, "--params", str(args.params),
                   "--repeats", str(args.repeats)]
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
        output = subprocess.run(command, check=True, capture_output=True, text=True, env=env, cwd=REPO).stdout
        rows.append(json.loads(output.strip().splitlines()[-1]))
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"command": "python -m benchmarks.averaging.check_memory" + (f" --params {args.params}" if args.params != 4_200_000 else ""),
              "distance_chunk": DISTANCE_CHUNK, "torch": torch.__version__, "rows": rows}
    write_json(args.out / "dynamic_check_memory.json", result)
    print("variant  parameters  peak extra MiB  bytes/parameter  seconds  distance")
    for row in rows:
        print(f"{row['variant']:<8} {row['parameters']:>10,}  {row['peak_extra_mib']:>14.1f}  "
              f"{row['bytes_per_parameter']:>15.1f}  {row['seconds']:>7.3f}  {row['distance']:.12g}")
    _plot(rows, args.out / "dynamic_check_memory.png")


def _plot(rows: list[dict[str, float]], path: Path) -> None:
    plt = pyplot()

    figure, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    names = [row["variant"] for row in rows]
    axes[0].bar(names, [row["peak_extra_mib"] for row in rows], color=["tab:red", "tab:green"])
    axes[0].set_ylabel("peak extra memory (MiB)")
    axes[1].bar(names, [row["seconds"] * 1000 for row in rows], color=["tab:red", "tab:green"])
    axes[1].set_ylabel("check time (ms)")
    figure.suptitle(f"dynamic averaging's local-condition check, {rows[0]['parameters']:,} float32 parameters, CPU")
    save_figure(figure, path, dpi=120)


if __name__ == "__main__":
    main()
