"""Model-free benchmark of CD-GraB's ordering: parallel herding bounds as in paper 003's appendix D, Figure 10.

No model, no processes: ``N`` random 16-d vectors stand in for per-example gradients, split over
``m`` ranks (``N / m`` each), and every method reorders each rank's vectors once per round, for
``--rounds`` rounds. After each round the parallel herding bound (paper 003, eq. 8),
``max_k || sum_{t <= k} sum_j z[t, j] ||``, is measured on the new orders, in the inf norm (as the
paper and its reference simulation) and in the 2-norm.

Data, as in the reference simulation (GarlGuo/CD-GraB, ``herding_bound_simulation.py``): for each
seed, ``N`` vectors ~ randn, normalised to norm 1, reshaped ``(N / m, m, d)`` (position, rank,
coordinate) and centred per rank (each rank's vectors sum to zero, so every order ends at zero). The
same ``N`` vectors are used for every rank count of a seed. The paper's text describes uniform [0, 1]
vectors centred and then normalised; those do not sum to zero, and the final prefix sum alone would then
floor every bound at the norm of their sum, so the reference's recipe is the one that gives Figure 10.

Methods (all from ``lightning_dist.algorithms.balancing``, the code the ``CDGraB`` callback runs):

- D-RR: every rank draws an independent random permutation each round (seeded per seed and rank count);
- ID-GraB (PairBal): ``balance_epoch(coordinated=False)``, each rank pair-balances its own differences
  with its own running sum;
- CD-GraB: ``balance_epoch(coordinated=True)``, one running sum over all ranks' pair differences in
  pair-major-then-rank order.

Paper 003's figure (1M vectors, 5 to 100 workers, 15 rounds; DESIGN 3.7): D-RR stays about 350,
ID-GraB plateaus at 4 to 24 and grows with the worker count, CD-GraB falls to about 2.5 at every worker
count. D-RR's bound scales like ``sqrt(N)`` (about 90 expected at the default 65,536 vectors); the
balanced bounds do not depend on ``N``.

Outputs (``--out``, default ``benchmarks/results``): ``herding_bound.json`` (config; per method, rank
count and round the bound per seed, mean and std over seeds, in both norms; seconds per rank count)
and ``herding_bound.png`` (bound vs round for each rank count, log y, mean and min-max band over
seeds; final bound vs rank count in both norms). Prints a markdown table of the final bounds and the
ratios D-RR / CD-GraB and ID-GraB / CD-GraB, and the total wall time.

Balancing is a sequential loop of tiny torch ops (about 5 us per pair on one thread here; the full
run is 2 min of CPU time, 3.5 min of wall time while the other core was busy). With torch's default
intra-op threads on this 2-core machine each op pays OpenMP synchronisation, which made it 2x to 8x
slower whenever the other core was busy, so the benchmark runs on ``--threads`` (1) thread.

Usage::

    python -m benchmarks.cdgrab.herding_bound            # 65,536 vectors, m = 2..64, 15 rounds, 3 seeds: 2 to 3.5 min
    python -m benchmarks.cdgrab.herding_bound --quick    # smoke run (8,192 vectors, m = 2, 8, 32, 6 rounds, 2 seeds), ~10 s
    python -m benchmarks.cdgrab.herding_bound --replot   # redraw the figure and tables from the JSON
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lightning_dist.algorithms.balancing import apply_positions, balance_epoch, parallel_herding_bound

from benchmarks.common.paths import RESULTS
from benchmarks.common.report import command_line, pyplot, save_figure, write_json

PREFIX = "herding_bound"
METHODS = ["D-RR", "ID-GraB", "CD-GraB"]
NORMS = {"inf": float("inf"), "2": 2.0}
VECTORS, DIM, RANKS, ROUNDS, SEEDS = 65536, 16, [2, 4, 8, 16, 32, 64], 15, 3
QUICK = {"vectors": 8192, "ranks": [2, 8, 32], "rounds": 6, "seeds": 2}


def make_vectors(total: int, dim: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """``(total, dim)`` unit vectors ~ randn, the seed's data for every rank count."""
    vectors = torch.randn(total, dim, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return vectors / torch.linalg.vector_norm(vectors, dim=1, keepdim=True)


def split(vectors: torch.Tensor, ranks: int) -> torch.Tensor:
    """``(n, m, d)``: rank ``j`` holds ``vectors[t * m + j]`` at position ``t``; each rank's set centred."""
    shaped = vectors.reshape(vectors.shape[0] // ranks, ranks, vectors.shape[1])
    return shaped - shaped.mean(dim=0, keepdim=True)


def bounds(vectors: torch.Tensor) -> dict[str, float]:
    return {name: parallel_herding_bound(vectors, norm=norm) for name, norm in NORMS.items()}


def run_one(
    vectors: torch.Tensor, ranks: int, rounds: int, seed: int
) -> tuple[dict[str, dict[str, list[float]]], dict[str, float]]:
    """All methods on one seed's vectors split over ``ranks``: per method and norm, the bound at rounds 0..R."""
    start = split(vectors, ranks)
    n = start.shape[0]
    shuffles = torch.Generator().manual_seed(1_000_003 * (seed + 1) + ranks)
    reorder = {
        "D-RR": lambda z: torch.stack([torch.randperm(n, generator=shuffles) for _ in range(ranks)], dim=1),
        "ID-GraB": lambda z: balance_epoch(z, coordinated=False),
        "CD-GraB": lambda z: balance_epoch(z, coordinated=True),
    }
    curves: dict[str, dict[str, list[float]]] = {}
    seconds: dict[str, float] = {}
    for method in METHODS:
        current = start
        first = bounds(current)
        curve = {name: [value] for name, value in first.items()}
        began = time.perf_counter()
        for _ in range(rounds):
            current = apply_positions(current, reorder[method](current))
            for name, value in bounds(current).items():
                curve[name].append(value)
        seconds[method] = time.perf_counter() - began
        curves[method] = curve
    return curves, seconds


def summarize(per_seed: list[list[float]]) -> dict[str, list[float]]:
    """Mean, sample std (0 for one seed), min and max over seeds, per round."""
    columns = list(zip(*per_seed))
    return {
        "mean": [statistics.fmean(c) for c in columns],
        "std": [statistics.stdev(c) if len(c) > 1 else 0.0 for c in columns],
        "min": [min(c) for c in columns],
        "max": [max(c) for c in columns],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    dtype = getattr(torch, args.dtype)
    results: dict[str, dict[str, dict[str, Any]]] = {m: {} for m in METHODS}
    timing: dict[str, dict[str, float]] = {}
    data = {seed: make_vectors(args.vectors, args.dim, seed, dtype) for seed in range(args.seeds)}
    for ranks in args.ranks:
        began = time.perf_counter()
        per_seed: dict[str, dict[str, list[list[float]]]] = {m: {n: [] for n in NORMS} for m in METHODS}
        method_seconds = {m: 0.0 for m in METHODS}
        for seed in range(args.seeds):
            curves, seconds = run_one(data[seed], ranks, args.rounds, seed)
            for method in METHODS:
                method_seconds[method] += seconds[method]
                for name in NORMS:
                    per_seed[method][name].append(curves[method][name])
        for method in METHODS:
            results[method][str(ranks)] = {
                name: {"per_seed": per_seed[method][name], **summarize(per_seed[method][name])} for name in NORMS
            }
        pairs = args.seeds * args.rounds * args.vectors // 2
        timing[str(ranks)] = {
            "seconds": time.perf_counter() - began,
            **{f"{m}_s": s for m, s in method_seconds.items()},
            "us_per_pair_cd": 1e6 * method_seconds["CD-GraB"] / pairs,
            "us_per_pair_id": 1e6 * method_seconds["ID-GraB"] / pairs,
        }
        final = {m: results[m][str(ranks)]["inf"]["mean"][-1] for m in METHODS}
        print(f"m = {ranks:3d}: final inf bound D-RR {final['D-RR']:.2f}, ID-GraB {final['ID-GraB']:.2f}, "
              f"CD-GraB {final['CD-GraB']:.2f} ({timing[str(ranks)]['seconds']:.1f} s, CD-GraB "
              f"{timing[str(ranks)]['us_per_pair_cd']:.1f} us per pair)", flush=True)
    return {"results": results, "timing": timing}


# ---------------------------------------------------------------- report


def table(report: dict[str, Any], norm: str) -> str:
    config, results = report["config"], report["results"]
    lines = [
        f"Final parallel herding bound ({norm}-norm) after {config['rounds']} rounds, {config['vectors']:,} vectors "
        f"of dim {config['dim']}, mean +- std over {config['seeds']} seeds",
        "",
        "| ranks m | vectors per rank | D-RR | ID-GraB | CD-GraB | D-RR / CD-GraB | ID-GraB / CD-GraB |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for ranks in config["ranks"]:
        cells = {m: results[m][str(ranks)][norm] for m in METHODS}
        mean = {m: cells[m]["mean"][-1] for m in METHODS}
        text = " | ".join(f"{mean[m]:.2f} +- {cells[m]['std'][-1]:.2f}" for m in METHODS)
        lines.append(
            f"| {ranks} | {config['vectors'] // ranks:,} | {text} | {mean['D-RR'] / mean['CD-GraB']:.1f} | "
            f"{mean['ID-GraB'] / mean['CD-GraB']:.2f} |"
        )
    start = results["CD-GraB"][str(config["ranks"][0])][norm]["mean"][0]
    lines.append(f"\n(round 0, the initial random order: {start:.2f} at m = {config['ranks'][0]})")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    import matplotlib.ticker

    config, results = report["config"], report["results"]
    colors = {"D-RR": "tab:gray", "ID-GraB": "tab:blue", "CD-GraB": "tab:red"}
    ranks_list = config["ranks"]
    panels = len(ranks_list) + 1
    cols = min(4, panels)
    rows = -(-panels // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    flat = axes.ravel()
    rounds = list(range(config["rounds"] + 1))
    for ax, ranks in zip(flat, ranks_list):
        for method in METHODS:
            cell = results[method][str(ranks)]["inf"]
            ax.plot(rounds, cell["mean"], color=colors[method], marker=".", label=method)
            ax.fill_between(rounds, cell["min"], cell["max"], color=colors[method], alpha=0.2, linewidth=0)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_title(f"m = {ranks} ranks, {config['vectors'] // ranks:,} vectors each", fontsize=10)
        ax.set_xlabel("round")
        ax.set_ylabel("parallel herding bound (inf)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    summary = flat[len(ranks_list)]
    for method in METHODS:
        for norm, style in (("inf", "-"), ("2", "--")):
            cell = [results[method][str(r)][norm] for r in ranks_list]
            summary.errorbar(ranks_list, [c["mean"][-1] for c in cell], yerr=[c["std"][-1] for c in cell],
                             color=colors[method], linestyle=style, marker="o", capsize=3,
                             label=f"{method} ({norm}-norm)")
    summary.set_xscale("log", base=2)
    summary.set_yscale("log")
    summary.set_xticks(ranks_list, [str(r) for r in ranks_list])
    summary.set_xlabel("ranks m")
    summary.set_ylabel(f"bound after round {config['rounds']}")
    summary.set_title("final bound vs ranks (mean +- std over seeds)", fontsize=10)
    summary.grid(True, which="both", alpha=0.3)
    summary.legend(fontsize=7)
    for ax in flat[panels:]:
        ax.axis("off")
    fig.suptitle(f"Parallel herding bound, {config['vectors']:,} unit {config['dim']}-d vectors, "
                 f"{config['seeds']} seeds (paper 003, Fig. 10)", fontsize=11)
    save_figure(fig, path, dpi=120)


def print_report(report: dict[str, Any]) -> None:
    for norm in NORMS:
        print()
        print(table(report, norm))


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vectors", type=int, default=None, help=f"N, all ranks together (default {VECTORS})")
    parser.add_argument("--dim", type=int, default=DIM)
    parser.add_argument("--ranks", type=int, nargs="+", default=None, help=f"rank counts m (default {RANKS})")
    parser.add_argument("--rounds", type=int, default=None, help=f"reorder rounds (default {ROUNDS})")
    parser.add_argument("--seeds", type=int, default=None, help=f"number of seeds, 0..S-1 (default {SEEDS})")
    parser.add_argument("--dtype", choices=["float64", "float32"], default="float64",
                        help="of the vectors (float64, as the reference's numpy)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (see the module docstring)")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: " + ", ".join(f"{k} {v}" for k, v in QUICK.items())
    )
    parser.add_argument("--replot", action="store_true", help="redraw the figure and tables from the JSON; run nothing")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    defaults = QUICK if args.quick else {"vectors": VECTORS, "ranks": RANKS, "rounds": ROUNDS, "seeds": SEEDS}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    json_path, png_path = args.out / f"{PREFIX}.json", args.out / f"{PREFIX}.png"
    if args.replot:
        report = json.loads(json_path.read_text())
        plot(report, png_path)
        print_report(report)
        return 0
    for ranks in args.ranks:
        if ranks < 1 or args.vectors % (2 * ranks):
            parser.error(f"--vectors ({args.vectors}) must split into an even number per rank for every m; m = {ranks}")
    if min(args.dim, args.rounds, args.seeds) < 1:
        parser.error("--dim, --rounds and --seeds must be >= 1")

    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    command = command_line(argv)
    report: dict[str, Any] = {
        "config": {
            "vectors": args.vectors, "dim": args.dim, "ranks": args.ranks, "rounds": args.rounds, "seeds": args.seeds,
            "dtype": args.dtype, "threads": args.threads, "methods": METHODS,
            "data": "randn, unit norm, split (n, m, d), centred per rank (reference herding_bound_simulation.py)",
            "quick": args.quick, "command": command, "python": platform.python_version(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"),
        }
    }
    report.update(run(args))
    report["config"]["wall_s"] = time.perf_counter() - started
    write_json(json_path, report)
    plot(report, png_path)
    print_report(report)
    print(f"\ntotal wall time {report['config']['wall_s']:.0f} s; results in {json_path} and {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
