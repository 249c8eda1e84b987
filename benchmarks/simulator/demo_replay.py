"""How far ``make demo``'s figures move when only the last bits of torch's float32 arithmetic change (issue 42).

    python -m benchmarks.simulator.demo_replay                          # every variant, one after another
    python -m benchmarks.simulator.demo_replay --variants pinned threads2
    python -m benchmarks.simulator.demo_replay --merge                  # add to the JSON's variants, keep the rest

``examples/lm_demo.py`` pins torch's CPU kernels (:func:`lightning_dist.sim.numerics.pin_cpu_kernels`) and trains
with 1 thread, so that its figures replay bit for bit. Where another CPU computes a float32 result in other last
bits (another kernel, another summation order), training amplifies it and dynamic averaging synchronizes at other
steps. This driver measures by how much, on one machine, as a stand-in for other CPUs: each variant runs the demo's
two simulations (DDP and dynamic averaging's defaults, the demo's own ``run``) in a fresh process with the demo's
pinned environment and one change that alters only last bits:

- ``pinned``: none (the demo itself; with ``PYTHONHASHSEED=1``, so that it also shows the figures do not follow
  Python's hash seed);
- ``mkl_auto``: MKL's own branch for this CPU instead of ``MKL_CBWR=COMPATIBLE`` (other matrix-product kernels);
- ``aten_avx512``: ATen's AVX-512 kernels instead of AVX2 (16-wide vectors: other summation orders);
- ``onednn_auto``: oneDNN's own instruction set for this CPU instead of AVX2 (the GELU's AVX-512 approximation);
- ``threads2``: 2 intra-op threads instead of 1 (reductions split in two);
- ``native``: all three libraries' own choices, 1 thread (``--native-kernels`` of the benchmark).

Each variant takes about 4 minutes of one core (``native`` about half). Output (``--out``, default
``benchmarks/results/demo_replay.json``): per variant the environment and threads it ran with, the command,
its ``numerics``, the demo's printed lines and the figures (Delta, steps and virtual seconds to the target,
speed-up, each method's final loss and evaluations), the runs reported from other machines (``REPORTED``: the
Intel Xeon of issue 42) and the spread of each figure over both, which ``examples/lm_demo.py`` prints.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from lightning_dist.sim.numerics import PINNED_KERNELS, numerics

from benchmarks.common.paths import REPO, RESULTS, load_example
from benchmarks.common.report import check_names, command_line, write_json

# name: (what changes, environment on top of PINNED_KERNELS (None: unset, the library's own choice), threads)
VARIANTS: dict[str, tuple[str, dict[str, Optional[str]], int]] = {
    "pinned": ("the demo as it runs (PYTHONHASHSEED=1)", {"PYTHONHASHSEED": "1"}, 1),
    "mkl_auto": ("MKL's own branch for this CPU", {"MKL_CBWR": None}, 1),
    "aten_avx512": ("ATen's AVX-512 kernels", {"ATEN_CPU_CAPABILITY": "avx512"}, 1),
    "onednn_auto": ("oneDNN's own instruction set for this CPU", {"ONEDNN_MAX_CPU_ISA": None}, 1),
    "threads2": ("2 intra-op threads", {}, 2),
    "native": ("every library's own kernels for this CPU", dict.fromkeys(PINNED_KERNELS), 1),
}
# Runs on other machines, as reported (not rerun here). Their virtual seconds and speed-up came from another step
# time (0.118 s, the lm_network.json of that day; 0.135 s now), so only the figures that do not scale with it count.
REPORTED = [{
    "name": "intel_xeon_issue42", "source": "issue 42: make demo from a fresh clone on an Intel Xeon (AVX-512) that "
                                            "printed the same kernel line (ATen AVX2 / MKL COMPATIBLE / oneDNN AVX2)",
    "as_printed": {"delta": 209, "dynamic_steps": 175, "dynamic_virtual_s": 24.3, "speedup": 17.3,
                   "ddp_final_loss": 2.605, "step_s": 0.118},
    "figures": {"delta": 209, "dynamic_steps": 175, "ddp_final_loss": 2.605},
}]
FIGURES = ("delta", "dynamic_steps", "dynamic_virtual_s", "speedup", "ddp_steps", "ddp_virtual_s", "ddp_final_loss",
           "dynamic_final_loss")


def child(name: str, threads: int) -> dict[str, Any]:
    """One variant, in this process, its environment set by the parent: the demo's two runs and their figures."""
    demo = load_example("lm_demo")
    work = demo.workload(workers=4)
    lines, results = [], []
    for method in work["methods"]:
        started = time.perf_counter()
        results.append(demo.run(work, method, mbit=20.0, max_steps=400, threads=threads))
        lines.append(demo.method_line(method, results[-1], time.perf_counter() - started))
    ddp, dynamic = results
    lines.append(demo.speedup_line(ddp, dynamic) or "")
    metrics = dynamic["protocol_metrics"]
    reached = ddp["time_to_target_s"] and dynamic["time_to_target_s"]
    figures = {
        "delta": metrics.get("dynamic/divergence_threshold"),
        "calibration_period": metrics.get("dynamic/calibration_period"),
        "dynamic_steps": dynamic["steps_to_target"], "dynamic_virtual_s": dynamic["time_to_target_s"],
        "speedup": ddp["time_to_target_s"] / dynamic["time_to_target_s"] if reached else None,
        "ddp_steps": ddp["steps_to_target"], "ddp_virtual_s": ddp["time_to_target_s"],
        "ddp_final_loss": ddp["final_val_loss"], "dynamic_final_loss": dynamic["final_val_loss"],
        "dynamic_mb_sent": dynamic["protocol_bytes"] / 1e6, "ddp_mb_sent": ddp["protocol_bytes"] / 1e6,
    }
    return {"name": name, "threads": threads, "numerics": {**numerics(), "threads": ddp["numerics"]["threads"]},
            "lines": lines, "figures": figures,
            "evaluations": {result["name"]: [[row["mean_steps"], row["time"], row["val_loss"]]
                                             for row in result["rows"]] for result in results},
            "wall_s": sum(result["wall_s"] for result in results)}


def launch(name: str) -> dict[str, Any]:
    """Run variant ``name`` in a fresh process (the libraries read their environment when they first compute)."""
    what, changes, threads = VARIANTS[name]
    env = {key: value for key, value in os.environ.items() if key not in PINNED_KERNELS and key != "PYTHONHASHSEED"}
    for key, value in {**PINNED_KERNELS, **changes}.items():
        if value is not None:
            env[key] = value
    shown = " ".join([*(f"{key}={value}" for key, value in {**PINNED_KERNELS, **changes}.items() if value is not None),
                      *(f"(no {key})" for key, value in changes.items() if value is None)])
    argv = [sys.executable, "-m", "benchmarks.simulator.demo_replay", "--child", name]
    process = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    if process.returncode != 0:
        raise SystemExit(f"variant {name} failed:\n{process.stderr[-3000:]}")
    result = json.loads(process.stdout.strip().splitlines()[-1])
    result.update(what=what, environment=shown, command=f"{shown} python -m benchmarks.simulator.demo_replay "
                                                         f"--child {name}")
    return result


def spread(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's lowest and highest value over ``runs`` (the variants and :data:`REPORTED`), and which runs give
    it (a variant that did not reach the target, or a reported run from another step time, gives none)."""
    out = {}
    for figure in FIGURES:
        values = {run["name"]: run["figures"][figure] for run in runs if run["figures"].get(figure) is not None}
        out[figure] = {"min": min(values.values(), default=None), "max": max(values.values(), default=None),
                       "from": sorted(values)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), help=f"of: {', '.join(VARIANTS)}")
    parser.add_argument("--out", type=Path, default=RESULTS / "demo_replay.json")
    parser.add_argument("--merge", action="store_true", help="keep the JSON's other variants")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, VARIANTS[args.child][2])))
        return
    check_names("--variants", args.variants, list(VARIANTS), "this driver")
    kept = json.loads(args.out.read_text())["variants"] if args.merge and args.out.exists() else []
    variants = [variant for variant in kept if variant["name"] not in args.variants]
    for name in args.variants:
        variant = launch(name)
        print(f"{name} ({variant['what']}, {variant['wall_s']:.0f} s):", *variant["lines"], sep="\n", flush=True)
        variants.append(variant)
    variants.sort(key=lambda variant: list(VARIANTS).index(variant["name"]))
    write_json(args.out, {"command": command_line(), "date": time.strftime("%Y-%m-%d"),
                          "cpu": cpu_model(), "variants": variants, "reported": REPORTED,
                          "spread": spread(variants + REPORTED)})
    print(f"wrote {args.out}")


def cpu_model() -> str:
    """The CPU's model name (Linux), for the record."""
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
