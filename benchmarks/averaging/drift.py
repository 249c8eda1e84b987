"""The concept-drift part of ``benchmarks/averaging/run.py`` (paper 004, section 5): the drift schedule, protocol bytes
per epoch around each new concept, the summary, table and figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.averaging.summary import (
    RATIO_DEFINITIONS, SCORE_EPOCHS, TARGET, _mean, by_setting, calibrations, compare, describe, kind, stream_score,
    table,
)
from benchmarks.common.report import pyplot, save_figure

DRIFT_TITLE = "drifting digits stream (score: mean accuracy over all epochs)"


def drift_schedule(epochs: int, every: int) -> list[dict[str, Any]]:
    """A new concept every ``every`` epochs: the k-th relabels ``y`` as ``(y + k) mod 10``."""
    return [{"epoch": start, "permutation": [(label + start // every) % 10 for label in range(10)]}
            for start in range(every, epochs, every)]


def per_epoch_bytes(curve: list[dict[str, Any]]) -> list[int]:
    cumulative = [e["protocol_bytes"] for e in curve]
    return [b - a for a, b in zip([0] + cumulative[:-1], cumulative)]


def mean_per_epoch(runs: list[dict[str, Any]], field: str) -> list[float]:
    """Per epoch, the mean over seeds of protocol bytes sent in that epoch (``field="bytes"``) or of ``field``."""
    length = min(len(r["curve"]) for r in runs)
    series = [per_epoch_bytes(r["curve"]) if field == "bytes" else [e[field] for e in r["curve"]] for r in runs]
    return [_mean([values[epoch] for values in series]) for epoch in range(length)]


def concepts(starts: list[int], epochs: int) -> list[tuple[int, int]]:
    """The ``[lo, hi)`` epochs of each concept, given the epochs at which a new one starts."""
    bounds = [0] + starts + [epochs]
    return list(zip(bounds[:-1], bounds[1:]))


def concept_window(starts: list[int], epochs: int) -> int:
    """Epochs at the start and at the end of each concept that the drift summary compares: 5, or fewer when a
    concept is shorter."""
    return min([5] + [hi - lo for lo, hi in concepts(starts, epochs)])


def concept_phases(runs: list[dict[str, Any]], starts: list[int], window: int) -> list[dict[str, Any]]:
    """Per concept: mean protocol bytes per epoch (over seeds) in its first and last ``window`` epochs."""
    per_epoch = mean_per_epoch(runs, "bytes")
    return [{"epochs": [lo, hi - 1],
             "first": _mean(per_epoch[lo:lo + window]),
             "last": _mean(per_epoch[hi - window:hi])} for lo, hi in concepts(starts, len(per_epoch))]


def summarize_drift(results: list[dict[str, Any]], starts: list[int], epochs: int) -> dict[str, Any]:
    stream = compare(results, scorer=stream_score)
    if "error" in stream:
        return stream
    final = compare(results)
    window = concept_window(starts, epochs)
    return {
        **stream,
        "target": TARGET,
        **RATIO_DEFINITIONS,
        "score_definition": "mean over seeds of the mean val_acc of the averaged model over all epochs",
        "final_accuracy": {key: value for key, value in final.items() if key != "settings"},
        "final_accuracy_per_setting": {row["setting"]: {"score": row["score"], "score_std": row["score_std"]}
                                       for row in final["settings"]},
        "drift_epochs": starts,
        "concept_window_epochs": window,
        "protocol_bytes_per_epoch_by_concept": {name: concept_phases(runs, starts, window)
                                                for name, runs in by_setting(results).items()},
        "calibration": calibrations(results, parts=len(starts) + 1),
    }


def drift_table(summary: dict[str, Any]) -> str:
    lines = [table(summary, score_name="acc mean")]
    final = summary["final_accuracy_per_setting"]
    lines.append("")
    lines.append(f"final accuracy (last {SCORE_EPOCHS} epochs, mean over seeds) and protocol MB per epoch, first / "
                 f"last {summary['concept_window_epochs']} epochs of each concept (mean over seeds):")
    for row in summary["settings"]:
        phases = summary["protocol_bytes_per_epoch_by_concept"][row["setting"]]
        lines.append(f"{row['setting']:<20} {final[row['setting']]['score']:.4f}   "
                     + "  ".join(f"{phase['first'] / 1e6:5.2f}/{phase['last'] / 1e6:4.2f}" for phase in phases))
    return "\n".join(lines)


def plot_drift(results: list[dict[str, Any]], summary: dict[str, Any], path: Path) -> None:
    """Protocol MB per epoch (means over blocks of ``concept_window_epochs`` within each concept) and accuracy per
    epoch, means over seeds: the dynamic settings, the best periodic one and the cheapest periodic one within the
    target points."""
    plt = pyplot()

    groups = by_setting(results)
    shown = [name for name, runs in groups.items() if kind(runs[0]) == "dynamic"]
    for key in ("best_periodic", "cheapest_periodic_within_target_points"):
        if summary[key]["setting"] not in shown:
            shown.append(summary[key]["setting"])
    window = summary["concept_window_epochs"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for name in shown:
        runs = groups[name]
        dashed = kind(runs[0]) != "dynamic"
        label = f"{kind(runs[0])} {describe(runs[0]['params'])}"
        per_epoch = mean_per_epoch(runs, "bytes")
        blocks = [(start, min(start + window, hi)) for lo, hi in concepts(summary["drift_epochs"], len(per_epoch))
                  for start in range(lo, hi, window)]
        # One epoch's bytes are 0 or a whole sync (and b=50 syncs every 3rd epoch), so per-epoch lines only flicker;
        # block means show the rise after each new concept and the fall as the models settle.
        top.stairs([_mean(per_epoch[lo:hi]) / 1e6 for lo, hi in blocks], [lo - 0.5 for lo, _ in blocks]
                   + [blocks[-1][1] - 0.5], linestyle="--" if dashed else "-", linewidth=1.6, label=label)
        bottom.plot(range(len(per_epoch)), mean_per_epoch(runs, "val_acc"), linestyle="--" if dashed else "-",
                    label=label)
    for ax in (top, bottom):
        for start in summary["drift_epochs"]:
            ax.axvline(start - 0.5, color="black", linestyle=":", linewidth=1)
        ax.grid(True, alpha=0.3)
    top.set_yscale("symlog", linthresh=0.05)
    top.set_ylim(0, 6 * top.get_ylim()[1])
    top.set_ylabel(f"protocol MB per epoch\n(mean over {window}-epoch blocks)")
    bottom.set_ylabel("val accuracy")
    bottom.set_xlabel("epoch (dotted: new concept)")
    top.legend(fontsize=8, ncol=2)
    ok = [r for r in results if "error" not in r]
    world = ok[0]["world_size"] if ok else "?"
    top.set_title(f"Drifting stream (new labels every {summary['drift_epochs'][0]} epochs), digits, {world} ranks, "
                  "means over seeds")
    save_figure(fig, path, dpi=130)
