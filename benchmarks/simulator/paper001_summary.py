"""Paper 001's study in the simulator, scored: time and steps to the targets per run, the synchronous against the
asynchronous server, how the cost of a simulated step grows with the workers, and the tables."""

from __future__ import annotations

import math
from typing import Any

TARGET_LOSS = 1.5
TARGET_ACC = 0.40
TAIL = 5  # evaluations averaged for the "last-5" val_loss


# ---------------------------------------------------------------- summaries


def first_at(rows: list[dict[str, float]], key: str, target: float, below: bool, axis: str) -> float | None:
    """``axis`` of the first row whose ``key`` reaches ``target`` (``<=`` when ``below``); None if none does."""
    from lightning_dist.sim.report import first_reaching

    if below:
        rows = [{**row, key: -row[key]} for row in rows if key in row]
        target = -target
    return first_reaching(rows, key, target, axis=axis)


def run_summary(record: dict[str, Any]) -> dict[str, Any]:
    rows = record["rows"]
    losses = [row["val_loss"] for row in rows if "val_loss" in row]
    final = rows[-1] if rows else {}
    entry = {
        "name": record["name"], "part": record["part"], "mode": record["mode"], "workers": record["workers"],
        "latency": record["latency"], "learning_rate": record["learning_rate"], "status": record["status"],
        "iterations": final.get("mean_steps"), "virtual_seconds": record.get("virtual_seconds"),
        "final_val_loss": final.get("val_loss"), "final_val_acc": final.get("val_acc"),
        "final_train_loss": final.get("train_loss"),
        "tail_val_loss": sum(losses[-TAIL:]) / len(losses[-TAIL:]) if losses else None,
        "min_val_loss": min(losses) if losses else None,
        "max_val_loss": max(losses) if losses else None,
        "initial_val_loss": losses[0] if losses else None,
        "time_to_loss": first_at(rows, "val_loss", TARGET_LOSS, True, "time"),
        "iters_to_loss": first_at(rows, "val_loss", TARGET_LOSS, True, "mean_steps"),
        "time_to_acc": first_at(rows, "val_acc", TARGET_ACC, False, "time"),
        "iters_to_acc": first_at(rows, "val_acc", TARGET_ACC, False, "mean_steps"),
        "staleness_mean": record.get("protocol_metrics", {}).get("downpour/staleness_mean"),
        "wait_seconds_per_worker": record.get("wait_seconds_per_worker"),
        "wall_seconds": record.get("wall_seconds"),
    }
    # No real progress: the paper's "does not improve loss" (its 16-worker case of Fig. 14).
    entry["stalled"] = bool(losses) and entry["tail_val_loss"] is not None and entry["tail_val_loss"] > 0.97 * losses[0]
    return entry


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    runs = {record["name"]: run_summary(record) for record in report["runs"] if record["part"] != "scale"}
    by = {(entry["mode"], entry["workers"], entry["latency"]): entry for entry in runs.values()
          if entry["part"] == "study"}
    latencies = sorted({key[2] for key in by if key[0] != "baseline"})
    workers = sorted({key[1] for key in by if key[0] != "baseline"})
    sync_vs_async = []
    for n in workers:
        for latency in latencies:
            s, a = by.get(("sync", n, latency)), by.get(("async", n, latency))
            if s and a:
                sync_vs_async.append({
                    "workers": n, "latency": latency,
                    "virtual_seconds_sync_over_async": _ratio(s["virtual_seconds"], a["virtual_seconds"]),
                    "time_to_loss_sync_over_async": _ratio(s["time_to_loss"], a["time_to_loss"]),
                    "time_to_acc_sync_over_async": _ratio(s["time_to_acc"], a["time_to_acc"]),
                    "tail_val_loss_sync": s["tail_val_loss"], "tail_val_loss_async": a["tail_val_loss"],
                })
    four_vs_two = []
    if 2 in workers and 4 in workers:
        for mode in ("sync", "async"):
            for latency in latencies:
                two, four = by.get((mode, 2, latency)), by.get((mode, 4, latency))
                if two and four:
                    four_vs_two.append({
                        "mode": mode, "latency": latency,
                        "time_to_loss_4_over_2": _ratio(four["time_to_loss"], two["time_to_loss"]),
                        "iters_to_loss_4_over_2": _ratio(four["iters_to_loss"], two["iters_to_loss"]),
                        "time_to_acc_4_over_2": _ratio(four["time_to_acc"], two["time_to_acc"]),
                        "virtual_seconds_4_over_2": _ratio(four["virtual_seconds"], two["virtual_seconds"]),
                        "tail_val_loss_2": two["tail_val_loss"], "tail_val_loss_4": four["tail_val_loss"],
                    })
    scale = []
    for record in report["runs"]:
        if record["part"] == "scale":
            final = record["rows"][-1] if record["rows"] else {}
            steps = record["workers"] * record["max_steps"]
            scale.append({
                "name": record["name"], "mode": record["mode"], "workers": record["workers"],
                "steps_per_worker": record["max_steps"], "status": record["status"],
                "virtual_seconds": record.get("virtual_seconds"), "wall_seconds": record.get("wall_seconds"),
                "compute_wall_seconds": record.get("compute_wall_seconds"),
                "evaluation_wall_seconds": record.get("evaluation_wall_seconds"),
                "overhead_ratio": record.get("overhead_ratio"),
                "wall_ms_per_step": 1000 * record["wall_seconds"] / steps if record.get("wall_seconds") else None,
                "messages": record.get("messages"), "final_val_loss": final.get("val_loss"),
            })
    return {"target_loss": TARGET_LOSS, "target_acc": TARGET_ACC, "runs": list(runs.values()),
            "sync_vs_async": sync_vs_async, "four_vs_two": four_vs_two, "scale": scale}


def formatted(value: Any, spec: str = ".3g") -> str:
    """``value`` in ``spec``; "-" for a missing or NaN value."""
    if value is None:
        return "-"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return format(value, spec) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def tables(summary: dict[str, Any], config: dict[str, Any]) -> str:
    speed = config.get("speed", {})
    lines = [(f"targets: val_loss <= {summary['target_loss']}, val_acc >= {summary['target_acc']}; "
              f"step_seconds {speed.get('step_seconds')}, aggregate_seconds {speed.get('aggregate_seconds')}"), "",
             ("| run | lr | iters | virtual s | final val_loss | last-5 val_loss | final val_acc | t to loss | "
              "iters to loss | t to acc | iters to acc | staleness | note |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["runs"]:
        notes = [r["status"]] if r["status"] != "ok" else []
        if r.get("max_val_loss") is not None and r["max_val_loss"] > 1.5 * r["initial_val_loss"]:
            notes.append(f"val_loss spiked to {r['max_val_loss']:.3g}")
        if r["stalled"]:
            notes.append("stalled (last-5 val_loss > 0.97 x initial)")
        note = "; ".join(notes)
        lines.append(f"| {r['name']} | {formatted(r['learning_rate'], '.4g')} | {formatted(r['iterations'], '.0f')} | "
                     f"{formatted(r['virtual_seconds'], '.4g')} | {formatted(r['final_val_loss'])} | {formatted(r['tail_val_loss'])} | "
                     f"{formatted(r['final_val_acc'])} | {formatted(r['time_to_loss'], '.3g')} | {formatted(r['iters_to_loss'], '.0f')} | "
                     f"{formatted(r['time_to_acc'], '.3g')} | {formatted(r['iters_to_acc'], '.0f')} | "
                     f"{formatted(r['staleness_mean'], '.2g')} | {note} |")
    lines += ["", "sync / async (virtual time):", "",
              "| workers | latency | full run | to loss target | to acc target | last-5 val_loss sync | async |",
              "|---|---|---|---|---|---|---|"]
    for r in summary["sync_vs_async"]:
        lines.append(f"| {r['workers']} | {r['latency']:g} | {formatted(r['virtual_seconds_sync_over_async'])} | "
                     f"{formatted(r['time_to_loss_sync_over_async'])} | {formatted(r['time_to_acc_sync_over_async'])} | "
                     f"{formatted(r['tail_val_loss_sync'])} | {formatted(r['tail_val_loss_async'])} |")
    lines += ["", "4 workers / 2 workers:", "",
              ("| mode | latency | time to loss | iters to loss | time to acc | full-run virtual s | "
               "last-5 val_loss 2 | 4 |"), "|---|---|---|---|---|---|---|---|"]
    for r in summary["four_vs_two"]:
        lines.append(f"| {r['mode']} | {r['latency']:g} | {formatted(r['time_to_loss_4_over_2'])} | "
                     f"{formatted(r['iters_to_loss_4_over_2'])} | {formatted(r['time_to_acc_4_over_2'])} | "
                     f"{formatted(r['virtual_seconds_4_over_2'])} | {formatted(r['tail_val_loss_2'])} | {formatted(r['tail_val_loss_4'])} |")
    if summary["scale"]:
        lines += ["", "scale (wall time is real; compute = wall seconds inside execute):", "",
                  ("| protocol | workers | steps/worker | wall s | compute s | eval s "
                   "| overhead (wall-eval-setup)/compute | "
                   "wall ms/step | virtual s |"), "|---|---|---|---|---|---|---|---|---|"]
        for r in summary["scale"]:
            lines.append(f"| {r['mode']} | {r['workers']} | {r['steps_per_worker']} | {formatted(r['wall_seconds'], '.1f')} | "
                         f"{formatted(r['compute_wall_seconds'], '.1f')} | {formatted(r['evaluation_wall_seconds'], '.2f')} | "
                         f"{formatted(r['overhead_ratio'], '.2f')} | {formatted(r['wall_ms_per_step'], '.2f')} | "
                         f"{formatted(r['virtual_seconds'], '.3g')} |")
    return "\n".join(lines)
