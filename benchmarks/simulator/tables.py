"""The simulator studies' results tables in ``docs/results/simulator-studies.md``, rendered from
``benchmarks/results/sim_paper001.json``, ``sim_paper002.json`` and ``sim_batched.json``
(:mod:`benchmarks.common.tables`)."""

from __future__ import annotations

from benchmarks.common.tables import result

PAPER001_ROWS = [(2, 0.0), (2, 0.1), (4, 0.0), (4, 0.001), (4, 0.01), (4, 0.1)]
"""The (workers, latency in seconds) of paper 001's sync-against-async rows, after the 1-worker baseline."""



def latency(seconds: float) -> str:
    """A latency in milliseconds, "0" for none."""
    return f"{seconds * 1e3:g} ms" if seconds else "0"


def paper001_table() -> str:
    """Virtual seconds to paper 001's loss target, synchronous against asynchronous, by workers and latency."""
    summary = result("sim_paper001")["summary"]
    study = {(run["mode"], run["workers"], run["latency"]): run for run in summary["runs"] if run["part"] == "study"}
    baseline = next(run for (mode, _, _), run in study.items() if mode == "baseline")
    lines = ["| workers | latency | sync | async | sync / async |", "|---|---|---|---|---|",
             f"| 1 (baseline) | {latency(baseline['latency'])} | {baseline['time_to_loss']:#.3g} | | |"]
    for workers, delay in PAPER001_ROWS:
        sync, asynchronous = study[("sync", workers, delay)], study[("async", workers, delay)]
        lines.append(f"| {workers} | {latency(delay)} | {sync['time_to_loss']:#.3g} | "
                     f"{asynchronous['time_to_loss']:#.3g} | "
                     f"{sync['time_to_loss'] / asynchronous['time_to_loss']:#.3g} |")
    return "\n".join(lines)


def paper002_table() -> str:
    """Virtual seconds to paper 002's accuracy target per protocol and workers, and segmented gossip's speed-up."""
    data = result("sim_paper002")
    key = f"{data['paper']['target']:g}"
    lines = ["| workers | FedAvg | gossip (S=1, R=2) | segmented gossip (S=10, R=2) | SG vs FedAvg | paper |",
             "|---|---|---|---|---|---|"]
    for workers, entry in data["paper"]["summary"].items():
        seconds = " | ".join(f"{entry[name]['seconds_to'][key]:.1f}" for name in ("fedavg", "gossip", "segmented"))
        paper = data["config"]["paper_speedup"].get(workers)
        lines.append(f"| {workers} | {seconds} | {entry['speedup_segmented_over_fedavg'][key]:.1f}x |"
                     f"{'' if paper is None else f' {paper:.2f}x'} |")
    return "\n".join(lines)


def fidelity_table() -> str:
    """Seconds per segmented-gossip round measured on the capped network against the simulator's, and its bytes."""
    lines = ["| S | measured s/round | simulator, half-duplex links | full-duplex links "
             "| bytes/round sim / real accounting |", "|---|---|---|---|---|"]
    for row in result("sim_paper002")["fidelity"]["summary"]:
        half, full = row["half"], row["full"]
        lines.append(f"| {row['segments']} | {row['measured_s']:.2f} | "
                     f"{half['predicted_s']:.2f} ({half['predicted_over_measured']:.2f}) | "
                     f"{full['predicted_s']:.2f} ({full['predicted_over_measured']:.2f}) | "
                     f"{half['bytes_over_accounted']:.6f} |")
    return "\n".join(lines)


def milliseconds(seconds: float) -> str:
    """Wall milliseconds, three decimals below 10 ms."""
    return f"{seconds * 1e3:.3f}" if seconds < 0.01 else f"{seconds * 1e3:.0f}"


def batched_table() -> str:
    """Wall ms per learner step, per worker against batched, with the speed-up, consensus difference and peak RSS."""
    rows = result("sim_batched")["rows"]
    per_worker = {(row["workload"], row["workers"]): row for row in rows if not row["batched_workers"]}
    lines = ["| workload | ranks | per worker | batched | speed-up | largest difference of the final consensus "
             "| peak RSS |", "|---|---|---|---|---|---|---|"]
    for row in (row for row in rows if row["batched_workers"]):
        alone = per_worker.get((row["workload"], row["workers"]))
        mlp = row["workload"] == "mlp"
        label = "MLP" if mlp else f"LM, {row['workers'] // row['learners']} ranks a learner"
        # ru_maxrss only grows and the LM runs after the largest MLP: that peak is not the LM's.
        rss = f" {row['peak_rss_gb']:.2f} GB" if mlp else ""
        batched = milliseconds(row["loop_s_per_learner_step"])
        if alone is None:
            compared = f"- | {batched} | - | -"
        else:
            difference = row["max_abs_difference"]
            compared = (f"{milliseconds(alone['loop_s_per_learner_step'])} | {batched} | {row['speedup']:.2f}x | "
                        f"{f'{difference:.1e}' if difference else '0'}")
        lines.append(f"| {label} | {row['workers']:,} | {compared} |{rss} |")
    return "\n".join(lines)
