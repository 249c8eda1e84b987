"""What ``fault_tolerance=TorchFT(...)`` costs a window when nothing fails (issue 43): DiLoCo on the language model,
2 learners, with and without the option, in the same run, several seeds.

    python -m benchmarks.fault_tolerance.overhead             # 3 seeds x 2 ways, about 4 min on 2 cores
    python -m benchmarks.fault_tolerance.overhead --replot    # the table and figure from the JSON

Without the option, one torchrun job of 2 ranks averages with one all-reduce per bucket inside the optimizer step.
With it, 2 jobs of 1 rank (2 replica groups) and a torchft Lighthouse in this process: a window adds the quorum
(a round trip to the Lighthouse through each group's Manager server), an all-reduce of the contributor count, the
committed model's copy to the host, ``should_commit`` (a round trip to the group's Manager server) and an
all-reduce of one flag inside the group. Both on loopback, so this is the option's fixed cost per window, not the
network's: ``benchmarks/fault_tolerance/worker.py`` times every window where it runs, and every training batch.

Reported per way: the median window (over windows and seeds; with the option as the group that arrived last saw
it, since the first to arrive also waits for the others' steps: the jobs are not kept in step between windows),
the median step without a window, the fits' wall times, and the overhead per window (the two medians' difference). Writes
``benchmarks/results/ft_overhead.{json,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common.launch import free_port, worker_env
from benchmarks.common.paths import BENCHMARKS, RESULTS
from benchmarks.common.report import command_line, one_figure, publish, pyplot, replot, save_figure
from lightning_dist.comm.peer_state import SECRET_ENV

PREFIX = "ft_overhead"
WORKER = BENCHMARKS / "fault_tolerance" / "worker.py"
SEEDS = (0, 1, 2)
PERIOD = 10
MAX_STEPS = 60
GROUPS = 2
RUN_SECRET = secrets.token_hex(16)  # every group's LIGHTNING_DIST_FT_SECRET in this benchmark's launches


def torchrun(nproc: int, spec_path: Path, *extra: str, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(WORKER), str(spec_path), *extra]
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**worker_env(), SECRET_ENV: RUN_SECRET}, start_new_session=True)


def run_seed(seed: int, work: Path) -> dict[str, Any]:
    """One seed: the fit without the option, then with it; each job's record."""
    from torchft.coordination import LighthouseServer

    base = {"seed": seed, "period": PERIOD, "max_steps": MAX_STEPS, "groups": GROUPS, "out": str(work)}
    plain_spec = work / f"plain{seed}.spec.json"
    plain_spec.write_text(json.dumps({**base, "name": f"plain{seed}"}))
    if torchrun(GROUPS, plain_spec, log=work / f"plain{seed}.log").wait(timeout=900) != 0:
        raise RuntimeError(f"the run without the option failed: see {work / f'plain{seed}.log'}")
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=GROUPS, join_timeout_ms=60000)
    try:
        tolerant_spec = work / f"tolerant{seed}.spec.json"
        tolerant_spec.write_text(json.dumps({**base, "name": f"tolerant{seed}", "lighthouse": lighthouse.address()}))
        jobs = [torchrun(1, tolerant_spec, str(group), log=work / f"tolerant{seed}.{group}.log")
                for group in range(GROUPS)]
        if any(job.wait(timeout=900) != 0 for job in jobs):
            raise RuntimeError(f"a run with the option failed: see {work}/tolerant{seed}.*.log")
    finally:
        lighthouse.shutdown()
    read = lambda name: json.loads((work / name).read_text())  # noqa: E731
    return {"seed": seed, "plain": read(f"plain{seed}.job.json"),
            "tolerant": [read(f"tolerant{seed}.{group}.json") for group in range(GROUPS)]}


def last_arrivals(tolerant: list[dict[str, Any]]) -> list[float]:
    """Each window of a run with the option as the group that arrived last saw it (the shortest of the groups'):
    the groups' jobs are not kept in step between windows, so the first to arrive also waits for the others' steps.
    The first window (set-up: the groups' first meeting) is left out."""
    return [min(times) for times in zip(*(record["windows_s"] for record in tolerant))][1:]


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """Medians over seeds and windows, and the fits' wall times (with the option: its slowest group's)."""
    def steps(records: list[dict[str, Any]]) -> list[float]:
        # Batches that carry no window either way: one ends inside step k * PERIOD without the option, at the start
        # of step k * PERIOD + 1 with it.
        return [seconds for record in records for index, seconds in enumerate(record["steps_s"])
                if (index + 1) % PERIOD not in (0, 1)]

    plain = [seed["plain"] for seed in report["seeds"]]
    summary = {
        "plain_window_s": statistics.median(seconds for record in plain for seconds in record["windows_s"]),
        "tolerant_window_s": statistics.median(seconds for seed in report["seeds"]
                                               for seconds in last_arrivals(seed["tolerant"])),
        "plain_step_s": statistics.median(steps(plain)),
        "tolerant_step_s": statistics.median(steps([record for seed in report["seeds"] for record in seed["tolerant"]])),
        "plain_fit_s": [record["fit_s"] for record in plain],
        "tolerant_fit_s": [max(record["fit_s"] for record in seed["tolerant"]) for seed in report["seeds"]],
    }
    summary["overhead_per_window_s"] = summary["tolerant_window_s"] - summary["plain_window_s"]
    return summary


def table(summary: dict[str, Any]) -> str:
    fits = lambda values: " / ".join(f"{value:.1f}" for value in values)  # noqa: E731
    return "\n".join([
        "| way | median window | median step without a window | fit, s (seeds) |",
        "|---|---|---|---|",
        f"| without the option (one job of {GROUPS} ranks) | {summary['plain_window_s'] * 1000:.1f} ms | "
        f"{summary['plain_step_s'] * 1000:.1f} ms | {fits(summary['plain_fit_s'])} |",
        f"| `fault_tolerance=TorchFT(...)` ({GROUPS} jobs, Lighthouse; the last group to arrive) | "
        f"{summary['tolerant_window_s'] * 1000:.1f} ms | {summary['tolerant_step_s'] * 1000:.1f} ms | "
        f"{fits(summary['tolerant_fit_s'])} |",
        f"\nOverhead per window: {summary['overhead_per_window_s'] * 1000:.1f} ms.",
    ])


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(6.5, 3.8))
    series = {"without the option": [seconds for seed in report["seeds"] for seconds in seed["plain"]["windows_s"]],
              "fault_tolerance\n(last group to arrive)": [seconds for seed in report["seeds"]
                                                          for seconds in last_arrivals(seed["tolerant"])],
              "fault_tolerance\n(every group)": [seconds for seed in report["seeds"] for record in seed["tolerant"]
                                                 for seconds in record["windows_s"][1:]]}
    for position, values in enumerate(series.values()):
        milliseconds = [seconds * 1000 for seconds in values]
        axis.scatter([position] * len(milliseconds), milliseconds, alpha=0.6)
        axis.hlines(statistics.median(milliseconds), position - 0.2, position + 0.2, color="black")
    axis.set_xticks(range(len(series)), list(series))
    axis.set_yscale("log")
    axis.set_ylabel("window (ms)")
    axis.set_title(f"DiLoCo, TransformerLM 1.3M, {GROUPS} learners, loopback, {len(report['seeds'])} seeds")
    save_figure(figure, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replot", action="store_true")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    json_path = args.out / f"{PREFIX}.json"
    draw = one_figure(plot, args.out, PREFIX)
    if args.replot:
        return replot(json_path, summarize, table, draw)
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ft_overhead_") as scratch:
        seeds = [run_seed(seed, Path(scratch)) for seed in args.seeds]
    report = {"command": command_line(argv), "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "period": PERIOD, "max_steps": MAX_STEPS, "groups": GROUPS,
              "seeds": seeds, "wall_s": time.perf_counter() - began}
    return publish(json_path, report, summarize, table, draw)


if __name__ == "__main__":
    sys.exit(main())
