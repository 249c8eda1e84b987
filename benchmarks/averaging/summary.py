"""Scoring and comparing the runs of ``benchmarks/averaging/run.py``: accuracy scores, byte ratios against the periodic
settings, epochs and bytes to an accuracy, the tables. Plain functions of the result dictionaries the runs wrote."""

from __future__ import annotations

import math
from typing import Any, Callable

# One validation accuracy point is 5.4 examples, and the accuracy of a single epoch moves by about
# a point from one epoch to the next; runs are compared on the mean over the last epochs.
SCORE_EPOCHS = 5
# Paper 004's point is that dynamic averaging goes quiet once the replicas stop drifting apart,
# while periodic averaging pays at the same rate to the end: the comparison is also scored on
# the first epochs of the same runs, to show how the byte ratio grows with training length.
HORIZONS = [20, 40, 60, 80, 100]
TARGET_POINTS = 1.0
TARGET_RATIO = 10.0
# Accuracies to reach, with the epochs and protocol bytes each setting needs first (this task's "time to target"
# when the network, not the compute, is what costs): reached at the first epoch of HOLD_EPOCHS in a row at or
# above it, so one lucky epoch does not count.
ACCURACY_TARGETS = (0.95, 0.97)
HOLD_EPOCHS = 3


def score(result: dict[str, Any], epochs: int | None = None) -> float:
    """Mean validation accuracy of the averaged model over the last ``SCORE_EPOCHS`` of the first ``epochs`` epochs."""
    last = [epoch["val_acc"] for epoch in result["curve"][:epochs][-SCORE_EPOCHS:]]
    return sum(last) / len(last)


def stream_score(result: dict[str, Any], epochs: int | None = None) -> float:
    """Mean validation accuracy of the averaged model over every epoch: the accuracy analogue of
    paper 004's cumulative loss, which counts how fast each new concept is learned."""
    accuracies = [epoch["val_acc"] for epoch in result["curve"][:epochs]]
    return sum(accuracies) / len(accuracies)


def protocol_bytes(result: dict[str, Any], epochs: int | None = None) -> int:
    """Protocol bytes summed over ranks by the end of epoch ``epochs`` (by the end of training if None)."""
    return result["curve"][:epochs][-1]["protocol_bytes"] if epochs is not None else result["protocol_bytes"]


def reached(result: dict[str, Any], target: float) -> dict[str, Any] | None:
    """The epoch (its curve entry) from which the accuracy stays at or above ``target`` for ``HOLD_EPOCHS``; None if never."""
    curve = result["curve"]
    return next((curve[i] for i in range(len(curve) - HOLD_EPOCHS + 1)
                 if all(epoch["val_acc"] >= target for epoch in curve[i:i + HOLD_EPOCHS])), None)


def to_targets(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per accuracy target: the seeds reaching it, and the mean epochs and protocol bytes of those that did."""
    rows = []
    for target in ACCURACY_TARGETS:
        hits = [hit for hit in (reached(run, target) for run in runs) if hit is not None]
        rows.append({"target": target, "reached": len(hits), "seeds": len(runs),
                     "epochs": _mean([hit["epoch"] + 1 for hit in hits]) if hits else None,
                     "protocol_bytes": _mean([hit["protocol_bytes"] for hit in hits]) if hits else None})
    return rows


def kind(result: dict[str, Any]) -> str:
    if result["strategy"] == "DynamicAveragingStrategy":
        return "dynamic"
    return "fedavg" if result["params"].get("client_fraction", 1.0) < 1 else "periodic"


def by_setting(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Finished runs grouped by setting (one run per seed), in the order they ran."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for result in results:
        if "error" not in result:
            groups.setdefault(result["setting"], []).append(result)
    return groups


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _std(values: list[float]) -> float:
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0


def compare(results: list[dict[str, Any]], epochs: int | None = None,
            scorer: Callable[..., float] = score) -> dict[str, Any]:
    """Every setting against the most accurate periodic setting, on means over seeds, after ``epochs`` epochs.

    Also against the cheapest periodic setting scoring within ``TARGET_POINTS`` of the most
    accurate one: when periodic settings are tied within noise, which one is "most accurate" is
    a draw, and the ratio to it can swing by an order of magnitude between seeds or horizons.
    """
    groups = by_setting(results)
    rows = []
    for name, runs in groups.items():
        scores = [scorer(r, epochs) for r in runs]
        rows.append({
            "setting": name, "kind": kind(runs[0]), "params": runs[0]["params"], "seeds": [r["seed"] for r in runs],
            "score": _mean(scores), "score_std": _std(scores),
            "protocol_bytes": _mean([protocol_bytes(r, epochs) for r in runs]),
            "syncs": _mean([r["syncs"] for r in runs]) if epochs is None else None,
            **({"to_targets": to_targets(runs)} if epochs is None else {}),
        })
    periodic = [row for row in rows if row["kind"] == "periodic"]
    if not periodic:
        return {"error": "no periodic run finished"}
    # Best by score; among equal scores the cheaper one.
    best = max(periodic, key=lambda row: (row["score"], -row["protocol_bytes"]))
    adequate = min((row for row in periodic if 100.0 * (row["score"] - best["score"]) >= -TARGET_POINTS),
                   key=lambda row: row["protocol_bytes"])
    for row in rows:
        row["acc_diff_points"] = 100.0 * (row["score"] - best["score"])
        row["byte_ratio"] = best["protocol_bytes"] / row["protocol_bytes"] if row["protocol_bytes"] else math.inf
        row["byte_ratio_vs_cheapest_within"] = (adequate["protocol_bytes"] / row["protocol_bytes"]
                                                if row["protocol_bytes"] else math.inf)
        row["meets_target"] = (row["kind"] == "dynamic" and row["acc_diff_points"] >= -TARGET_POINTS
                               and row["byte_ratio"] >= TARGET_RATIO)
    within = [row for row in rows if row["kind"] == "dynamic" and row["acc_diff_points"] >= -TARGET_POINTS]
    return {
        "epochs": epochs if epochs is not None else "all",
        "best_periodic": _headline(best),
        "cheapest_periodic_within_target_points": _headline(adequate),
        "best_dynamic_within_target_points": max(within, key=lambda row: row["byte_ratio"])["setting"] if within else None,
        "best_byte_ratio_within_target_points": max((row["byte_ratio"] for row in within), default=None),
        "best_byte_ratio_vs_cheapest_within": max((row["byte_ratio_vs_cheapest_within"] for row in within), default=None),
        "settings": rows,
        "target_met_by": [row["setting"] for row in rows if row["meets_target"]],
    }


def _headline(row: dict[str, Any]) -> dict[str, Any]:
    return {key: row[key] for key in ("setting", "params", "score", "score_std", "protocol_bytes")}


TARGET = (f"a dynamic setting within {TARGET_POINTS:g} accuracy point of the best periodic setting "
          f"with at least {TARGET_RATIO:g}x fewer protocol bytes (means over seeds)")
RATIO_DEFINITIONS = {
    "byte_ratio_definition": "best periodic setting's mean protocol bytes / this setting's",
    "byte_ratio_vs_cheapest_within_definition": (f"protocol bytes of the cheapest periodic setting within {TARGET_POINTS:g} "
                                                 "point of the best periodic score / this setting's"),
    "acc_diff_definition": "100 * (this setting's score - best periodic score)",
}


def summarize(results: list[dict[str, Any]], epochs: int) -> dict[str, Any]:
    final = compare(results)
    if "error" in final:
        return final
    horizons = [h for h in HORIZONS if h < epochs]
    return {
        **final,
        "target": TARGET,
        **RATIO_DEFINITIONS,
        "score_definition": f"mean over seeds of the mean val_acc of the averaged model over the last {SCORE_EPOCHS} epochs",
        "by_training_length": [
            {key: value for key, value in compare(results, h).items() if key != "settings"} for h in horizons
        ],
        "calibration": calibrations(results),
    }


def calibrations(results: list[dict[str, Any]], parts: int = 6) -> dict[str, Any]:
    """``calibration`` of every dynamic setting's seed-0 run."""
    return {r["setting"]: calibration(r, parts) for r in results
            if "error" not in r and kind(r) == "dynamic" and r["seed"] == 0}


def calibration(result: dict[str, Any], parts: int = 6) -> dict[str, Any] | None:
    """Percentiles of the probed ``||f_i - r||^2`` (all ranks, before each check acts), per part of training."""
    per_rank = result.get("probe_distances")
    if not per_rank or not per_rank[0]:
        return None
    checks = len(per_rank[0])
    bounds = [round(i * checks / parts) for i in range(parts + 1)]
    rows = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        values = sorted(v for rank in per_rank for v in rank[lo:hi])
        if not values:
            continue
        pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
        rows.append({"checks": [lo, hi], "p10": pick(0.1), "p50": pick(0.5), "p90": pick(0.9), "max": values[-1]})
    return {"checks_per_rank": checks, "parts": rows}


def describe(params: dict[str, Any]) -> str:
    short = {"period": "b", "client_fraction": "C", "divergence_threshold": "Delta", "check_every": "check"}
    return " ".join(f"{short.get(key, key)}={value:g}" for key, value in params.items())


def table(summary: dict[str, Any], score_name: str = "acc last5") -> str:
    header = (f"{'setting':<20} {'strategy':<9} {'params':<20} {score_name:>9} {'+-':>6} {'d pts':>6} "
              f"{'protocol MB':>12} {'syncs':>7} {'ratio':>7} {'ratio eq':>8}")
    lines = [header, "-" * len(header)]
    for row in summary.get("settings", []):
        lines.append(
            f"{row['setting']:<20} {row['kind']:<9} {describe(row['params']):<20} {row['score']:>9.4f} "
            f"{row['score_std']:>6.4f} {row['acc_diff_points']:>+6.2f} {row['protocol_bytes'] / 1e6:>12.2f} "
            f"{row['syncs']:>7.1f} {row['byte_ratio']:>6.1f}x {row['byte_ratio_vs_cheapest_within']:>7.1f}x"
        )
    if "best_periodic" in summary:
        lines.append(f"means over seeds {summary['settings'][0]['seeds']}; ratio = protocol bytes of the best periodic "
                     f"setting ({summary['best_periodic']['setting']}) / this setting's; ratio eq = protocol bytes of "
                     f"the cheapest periodic setting within {TARGET_POINTS:g} point of it "
                     f"({summary['cheapest_periodic_within_target_points']['setting']}) / this setting's; d pts = "
                     "accuracy difference to the best in points; +- = standard deviation over seeds")
    for row in summary.get("settings", []):
        reached_targets = [f"{t['target']:g} in {t['reached']}/{t['seeds']} seeds" + (
            f", {t['epochs']:.0f} epochs, {t['protocol_bytes'] / 1e6:.2f} MB" if t["reached"] else "")
            for t in row.get("to_targets", [])]
        if reached_targets:
            lines.append(f"{row['setting']:<20} to " + "; to ".join(reached_targets))
    for horizon in summary.get("by_training_length", []):
        ratio = horizon["best_byte_ratio_within_target_points"]
        equal = horizon["best_byte_ratio_vs_cheapest_within"]
        lines.append(f"after {horizon['epochs']:>3} epochs: best periodic {horizon['best_periodic']['setting']} "
                     f"({horizon['best_periodic']['score']:.4f}); best dynamic within {TARGET_POINTS:g} point: "
                     + (f"{horizon['best_dynamic_within_target_points']} at {ratio:.1f}x fewer bytes; at equal accuracy "
                        f"(vs {horizon['cheapest_periodic_within_target_points']['setting']}) {equal:.1f}x"
                        if ratio else "none"))
    return "\n".join(lines)


def report_target(summary: dict[str, Any]) -> None:
    if "target_met_by" in summary:
        met = summary["target_met_by"]
        print(f"target ({summary['target']}): " + (f"met by {', '.join(met)}" if met else "NOT met"))
        ratio = summary["best_byte_ratio_vs_cheapest_within"]
        print(f"at equal accuracy (against {summary['cheapest_periodic_within_target_points']['setting']}, the cheapest "
              f"periodic setting within {TARGET_POINTS:g} point of the best): "
              + (f"{ratio:.1f}x fewer bytes" if ratio else "no dynamic setting within the target points"))
