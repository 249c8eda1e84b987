"""Where a language-model run's time goes, from what every run already records (``lm_network.json``).

Every rank of a run records how long each training step took (``step_s_per_rank``: from one step's end to the next's,
so a step holds the batch's forward, backward and update, the strategy's work at that step and the callbacks'), and,
for the local-update strategies and torchft's DiLoCo, how long the protocol took at its round steps
(``round_s_per_rank``: ``after_local_step``, or torchft's merge hook, timed around the call: the exchange and its
encoding, blocking). A run's steps to a point then split, per rank, into:

- **protocol**: the round steps' protocol time (blocked in an exchange or a check; a streaming exchange runs in a
  background thread and blocks only where a merge waits for it);
- **compute**: the steps times the run's median step away from rounds (from step 6: the first are warm-up), what a
  step costs with no exchange in it on that machine at that time; a streaming run's background exchanges slow its
  local steps (two cores shared), which shows here as a larger median than its blocking twin's;
- **other**: the rest of the steps' time: the snapshot copies of the benchmark (a parameter copy and a broadcast of
  two numbers every few seconds), steps slower than the median, Python.

DDP's gradient all-reduce runs inside every step: its compute per step is taken from the periodic-averaging run
(``periodic_h50``) of the same bandwidth and seed (the same model, batches and ranks; one launch ran every method of a
seed, though the JSON merges reruns of some methods from other days), and everything above it is protocol.

``python -m benchmarks.language_model.time_split`` draws the stacked bars (``docs/assets/results/lm_time_split.png``);
the tables are rendered into ``docs/results/language-model.md`` (:mod:`benchmarks.common.tables`).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from benchmarks.common.paths import REPO
from benchmarks.common.tables import result
from benchmarks.language_model.network import first_reach
from benchmarks.language_model.tables import README_METHODS

WARMUP_STEPS = 5
"""Steps left out of the median step: the first ones compile kernels and fill caches."""

DDP_COMPUTE_FROM = "periodic_h50"
"""The run of the same bandwidth and seed whose median local step stands for DDP's compute per step."""

PARTS = ("compute", "protocol", "other")

SHORT_LABELS = {"ddp": "DDP", "ddp_powersgd_r4": "DDP + PowerSGD r4", "torchft_diloco": "torchft DiLoCo",
                "periodic_h50": "periodic 50", "dynamic_default": "dynamic", "periodic_h50_int8": "periodic 50 int8",
                "dynamic_default_int8": "dynamic int8", "periodic_h50_stream_a0_int8": "streaming 50 int8"}
"""The plot's names of the README's methods."""


def median_local_step_s(run: dict[str, Any]) -> float:
    """The run's median step away from its round steps, from step ``WARMUP_STEPS + 1``, over every rank."""
    rounds = set(run.get("round_steps") or [])
    steps = [duration for durations in run["step_s_per_rank"]
             for step, duration in enumerate(durations, 1) if step > WARMUP_STEPS and step not in rounds]
    return statistics.median(steps)


def split(run: dict[str, Any], until_step: int | None = None, compute_step_s: float | None = None) -> dict[str, float]:
    """Seconds of the run's first ``until_step`` steps (default: all) in compute, protocol and other, each the mean
    over the ranks (see the module). ``compute_step_s``: the compute per step where the run has no rounds (DDP)."""
    rounds = run.get("round_steps") or []
    ranks = run["step_s_per_rank"]
    step_s = median_local_step_s(run) if compute_step_s is None else compute_step_s
    parts = {part: 0.0 for part in PARTS}
    for rank, durations in enumerate(ranks):
        taken = durations[:until_step] if until_step is not None else durations
        total = sum(taken)
        if compute_step_s is None:
            protocol = sum(duration for step, duration in zip(rounds, run["round_s_per_rank"][rank])
                           if until_step is None or step <= until_step)
        else:
            protocol = max(0.0, total - step_s * len(taken))
        compute = step_s * len(taken)
        parts["compute"] += compute / len(ranks)
        parts["protocol"] += protocol / len(ranks)
        parts["other"] += (total - compute - protocol) / len(ranks)
    return parts


def runs_at(report: dict[str, Any], mbit: float) -> dict[tuple[str, int], dict[str, Any]]:
    """Every run at ``mbit`` by (method, seed)."""
    return {(run["name"], launch["seed"]): run for launch in report["launches"] if launch["node_mbit"] == mbit
            for run in launch.get("runs", [])}


def to_target(report: dict[str, Any], mbit: float, name: str) -> list[dict[str, float]]:
    """Per seed where method ``name`` reached the target at ``mbit``: the seconds to the target, the steps, the median
    local step and :func:`split` of the steps up to it."""
    runs = runs_at(report, mbit)
    target = report["summary"]["target_val_loss"]
    rows = []
    for (method, seed), run in sorted(runs.items()):
        if method != name:
            continue
        hit = first_reach(run["curve"], target)
        if hit is None:
            continue
        compute = (median_local_step_s(runs[DDP_COMPUTE_FROM, seed]) if run["kind"] == "ddp" else None)
        parts = split(run, hit["step"], compute)
        rows.append({"seed": seed, "seconds": hit["seconds"], "steps": hit["step"],
                     "step_s": compute if compute is not None else median_local_step_s(run), **parts})
    return rows


def split_table(mbit: float) -> str:
    """The README's methods at ``mbit``: seconds to the target and how they split, means over the seeds that reached
    it."""
    report = result("lm_network")
    lines = ["| method | seeds reaching | s to target | compute | protocol | other | steps | s per local step |",
             "|---|---|---|---|---|---|---|---|"]
    for name, label in README_METHODS.items():
        rows = to_target(report, mbit, name)
        seeds = sorted({seed for method, seed in runs_at(report, mbit) if method == name})
        if not seeds:
            continue
        if not rows:
            lines.append(f"| {label} | 0 of {len(seeds)} | - | - | - | - | - | - |")
            continue
        mean = {key: statistics.fmean(row[key] for row in rows) for key in ("seconds", "steps", "step_s", *PARTS)}
        lines.append(f"| {label} | {len(rows)} of {len(seeds)} | {mean['seconds']:.1f} | {mean['compute']:.1f} | "
                     f"{mean['protocol']:.1f} | {mean['other']:.1f} | {mean['steps']:.0f} | {mean['step_s']:.3f} |")
    return "\n".join(lines)


def split_table_20() -> str:
    """The split at 20 Mbit/s (3 seeds)."""
    return split_table(20.0)


def split_table_1000() -> str:
    """The split at 1000 Mbit/s (one seed): the floor."""
    return split_table(1000.0)


def plot(out: Path) -> Path:
    """Stacked bars of :func:`split_table`'s means at 20 and 1000 Mbit/s, one bar per method and bandwidth."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = result("lm_network")
    bars = []
    for name in README_METHODS:
        for mbit in (1000.0, 20.0):
            rows = to_target(report, mbit, name)
            if rows:
                bars.append((f"{SHORT_LABELS[name]}\n{mbit:g} Mbit/s",
                             {part: statistics.fmean(row[part] for row in rows) for part in PARTS}))
    figure, axes = plt.subplots(figsize=(12, 5))
    bottom = [0.0] * len(bars)
    for part, colour in zip(PARTS, ("#4c72b0", "#dd8452", "#999999")):
        heights = [parts[part] for _, parts in bars]
        axes.bar(range(len(bars)), heights, bottom=bottom, label=part, color=colour)
        bottom = [low + high for low, high in zip(bottom, heights)]
    axes.set_xticks(range(len(bars)), [label for label, _ in bars], rotation=45, ha="right", fontsize=8)
    axes.set_ylabel("s to the target (mean of seeds reaching it)")
    axes.set_title("Where the time to the target goes: 4 ranks, the language model (lm_network.json)")
    axes.legend()
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=120)
    plt.close(figure)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "assets" / "results" / "lm_time_split.png")
    args = parser.parse_args(argv)
    print(split_table_20())
    print(split_table_1000())
    print(f"wrote {plot(args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
