"""GPU smoke test: every strategy and callback of lightning_dist for a few steps on CUDA, one command.

Cells: subject x precision x layout.

- subjects: the strategies ``dynamic_avg``, ``periodic_avg``, ``streaming_diloco`` (Streaming DiLoCo, int8, an
  exchange every step), ``streaming_cpu_state`` (exchanges in flight for a step on a CUDA side stream, the outer
  state and int8's residuals in host memory), ``blocking_cpu_state`` (blocking DiLoCo with int8 a bucket at a time,
  both states in host memory), ``fedavg``, ``downpour_sgd``,
  ``segmented_gossip`` (with periods of 1-2 steps, so that every protocol exchanges models), and the
  ``datagossip`` and ``cdgrab`` callbacks on ``strategy="ddp"``;
- precisions: ``32-true``, ``bf16-mixed``, ``bf16-true``;
- layouts: ``gloo_shared_gpu`` (``--ranks`` processes on GPU 0 with Gloo: the strategies' groups
  stage CUDA tensors through the host), and ``nccl`` (one process per GPU, up to ``--ranks``) when
  two or more GPUs are visible.

Each cell is one ``torchrun`` launch (``benchmarks/common/launch.py``) of ``_gpu_smoke_worker.py``: two
epochs of ``--steps`` batches with validation after each (the strategies' consensus), then
``trainer.save_checkpoint`` (every rank's replica gathered on rank 0). A cell is ok when every rank
finished without an error and with finite parameters. On a GPU machine the driver also checks
in-process that the count sketch (CD-GraB's projection) gives bit-identical results on CUDA twice
and equal to the host's.

Output: a JSON report on stdout and in ``--out`` (per cell: ok, error, seconds, the ranks' step
counts, parameter dtype and device). Exit status: 0 when every cell is ok, 1 when any failed,
3 when CUDA was asked for (the default) and there is none. ``--accelerator cpu`` runs the same
cells on the host (``cpu`` layout) as a dry run of the script itself; it proves nothing about GPUs.

Usage::

    python -m benchmarks.gpu_smoke.run                              # on a GPU machine: every cell
    python -m benchmarks.gpu_smoke.run --subjects cdgrab --precisions bf16-true --layouts nccl
    python -m benchmarks.gpu_smoke.run --accelerator cpu --steps 2  # dry run on the host
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common.launch import RunFailed, launch
from benchmarks.common.paths import RESULTS
from benchmarks.common.report import write_json

SUBJECTS = ("dynamic_avg", "periodic_avg", "streaming_diloco", "streaming_cpu_state", "blocking_cpu_state", "fedavg",
            "downpour_sgd", "segmented_gossip", "datagossip", "cdgrab")
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
GPU_LAYOUTS = ("gloo_shared_gpu", "nccl")
NO_CUDA = 3
WORKER = Path(__file__).with_name("worker.py")


def plan(accelerator: str, ranks: int, gpus: int, layouts: list[str] | None) -> list[tuple[str, int]]:
    """``(layout, processes)`` to run: the host only for ``cpu``; on CUDA one shared GPU, and NCCL with 2+ GPUs."""
    if accelerator == "cpu":
        available = [("cpu", ranks)]
    else:
        available = [("gloo_shared_gpu", ranks)]
        if gpus >= 2:
            available.append(("nccl", min(gpus, ranks)))
    if layouts is not None:
        unknown = sorted(set(layouts) - {layout for layout, _ in available})
        if unknown:
            raise ValueError(f"--layouts {unknown} cannot run here; available: {[layout for layout, _ in available]}")
        available = [(layout, n) for layout, n in available if layout in layouts]
    return available


def run_cell(subject: str, precision: str, layout: str, processes: int, steps: int, work_dir: Path,
             timeout: float) -> dict[str, Any]:
    name = f"{subject}-{precision}-{layout}"
    spec = {"name": name, "subject": subject, "precision": precision, "layout": layout, "steps": steps}
    cell: dict[str, Any] = {"name": name, "subject": subject, "precision": precision, "layout": layout,
                            "ranks": processes}
    for stale in work_dir.glob(f"{name}.result.json.rank*.json"):
        stale.unlink()
    start = time.perf_counter()
    try:
        launch(spec, processes, work_dir, timeout, worker=WORKER)
        launch_error = None
    except RunFailed as exc:
        launch_error = str(exc)
        _kill_leftover_ranks(work_dir / f"{name}.spec.json")
    cell["seconds"] = round(time.perf_counter() - start, 2)
    per_rank = []
    for rank in range(processes):
        path = work_dir / f"{name}.result.json.rank{rank}.json"
        per_rank.append(json.loads(path.read_text()) if path.exists() else {"rank": rank, "error": "wrote no result"})
    errors = [f"rank {r['rank']}: {r['error']}" for r in per_rank if r.get("error")]
    errors += [f"rank {r['rank']}: non-finite parameters" for r in per_rank if r.get("error") is None and not r["finite"]]
    if launch_error is not None:
        errors.append(launch_error)
    cell["ok"] = not errors
    cell["error"] = "; ".join(errors) or None
    cell["ranks_detail"] = [{k: r.get(k) for k in ("rank", "global_step", "dtype", "device", "fit_s", "checkpoint")}
                            for r in per_rank]
    failed_tracebacks = [r["traceback"] for r in per_rank if r.get("traceback")]
    if failed_tracebacks:
        cell["traceback"] = failed_tracebacks[0]
    return cell


def _kill_leftover_ranks(spec_path: Path) -> None:
    """After a timeout: end the cell's worker processes, found by their spec file on the command line.

    The launcher's timeout kills torchrun only; its ranks would live on (holding the GPU and the
    cores) through the next cells.
    """
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone, or not ours to read
        if str(WORKER).encode() in command and str(spec_path).encode() in command:
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except ProcessLookupError:
                pass


def count_sketch_determinism() -> dict[str, Any]:
    """On CUDA: the sketch of the same vectors twice is bit-identical and equals the host's (sequential) sums."""
    from lightning_dist.algorithms.projection import CountSketch

    start = time.perf_counter()
    try:
        generator = torch.Generator().manual_seed(0)
        vectors = torch.randn(16, 2_000_000, generator=generator) * torch.logspace(-3, 3, 2_000_000)
        host = CountSketch(2_000_000, 4096, seed=1)(vectors)
        sketch = CountSketch(2_000_000, 4096, seed=1, device="cuda")
        first, second = sketch(vectors.cuda()).cpu(), sketch(vectors.cuda()).cpu()
        ok = bool(torch.equal(first, second) and torch.equal(first, host))
        error = None if ok else f"max |cuda - host| = {float((first - host).abs().max())}, runs equal: {torch.equal(first, second)}"
    except Exception as exc:  # reported as a failed cell
        ok, error = False, f"{type(exc).__name__}: {exc}"
    return {"name": "count_sketch_determinism", "ok": ok, "error": error, "seconds": round(time.perf_counter() - start, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--accelerator", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default): the smoke test; cpu: a dry run of the same cells on the host")
    parser.add_argument("--ranks", type=int, default=3, help="processes per cell (NCCL: at most one per GPU); >= 2")
    parser.add_argument("--steps", type=int, default=3, help="training batches per epoch (two epochs); >= 1")
    parser.add_argument("--subjects", nargs="+", choices=SUBJECTS, default=list(SUBJECTS))
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument("--layouts", nargs="+", choices=("cpu", *GPU_LAYOUTS), default=None,
                        help="default: every layout this machine has")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per cell before it counts as hung")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON report (default benchmarks/results/gpu_smoke.json, or gpu_smoke_cpu.json for cpu)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/lightning_dist_gpu_smoke"))
    args = parser.parse_args()
    if args.ranks < 2:
        parser.error(f"--ranks must be >= 2 (the strategies average across processes); got {args.ranks}")
    if args.steps < 1:
        parser.error(f"--steps must be >= 1; got {args.steps}")
    if args.accelerator == "cuda" and not torch.cuda.is_available():
        print(f"gpu_smoke: no CUDA device is available (torch {torch.__version__}, cuda build: {torch.version.cuda}); "
              "nothing was run. Run it on a GPU machine, or use --accelerator cpu for a dry run on the host.",
              file=sys.stderr)
        return NO_CUDA
    gpus = torch.cuda.device_count() if args.accelerator == "cuda" else 0
    try:
        layouts = plan(args.accelerator, args.ranks, gpus, args.layouts)
    except ValueError as exc:
        parser.error(str(exc))
    out = args.out or RESULTS / ("gpu_smoke.json" if args.accelerator == "cuda" else "gpu_smoke_cpu.json")
    cells = []
    for layout, processes in layouts:
        for subject in args.subjects:
            for precision in args.precisions:
                cell = run_cell(subject, precision, layout, processes, args.steps, args.work_dir, args.timeout)
                print(f"{'ok   ' if cell['ok'] else 'ERROR'} {cell['name']:<40} {cell['seconds']:>7.1f} s"
                      + ("" if cell["ok"] else f"  {cell['error'][:300]}"), file=sys.stderr, flush=True)
                cells.append(cell)
    if args.accelerator == "cuda":
        cells.append(count_sketch_determinism())
    import lightning

    report = {
        "command": "python -m benchmarks.gpu_smoke.run " + " ".join(sys.argv[1:]),
        "accelerator": args.accelerator,
        "device": torch.cuda.get_device_name(0) if gpus else "cpu (dry run: no GPU involved)",
        "gpus": gpus,
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "steps": args.steps,
        "failed": sum(not cell["ok"] for cell in cells),
        "cells": cells,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, report)
    print(json.dumps({k: v for k, v in report.items() if k != "cells"} |
                     {"cells": [{k: c[k] for k in ("name", "ok", "seconds", "error")} for c in cells]}, indent=1))
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
