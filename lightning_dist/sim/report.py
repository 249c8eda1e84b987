"""Write a simulation's results: CSV tables, a JSON summary and a PNG of the curves."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from lightning_dist.sim.simulation import SimulationResult


def first_reaching(
    rows: Sequence[dict[str, float]], key: str, target: float, axis: str = "time", lower_is_better: bool = False
) -> Optional[float]:
    """``axis`` of the first row whose ``key`` reaches ``target`` (at least it, or at most it with
    ``lower_is_better``, for a loss); None if no row reaches it."""
    for row in rows:
        value = row.get(key, math.nan)
        if not math.isnan(value) and (value <= target if lower_is_better else value >= target):
            return row[axis]
    return None


def _write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    columns: list[str] = []
    for row in rows:
        columns.extend(key for key in row if key not in columns)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def write_report(result: SimulationResult, out: str | Path, title: str = "") -> dict[str, Path]:
    """Write ``metrics.csv`` (global rows), ``workers.csv``, ``waits.csv``, ``summary.json`` and ``curves.png``
    under ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {
        "metrics": out / "metrics.csv",
        "workers": out / "workers.csv",
        "summary": out / "summary.json",
        "waits": out / "waits.csv",
        "plot": out / "curves.png",
    }
    _write_csv(paths["metrics"], result.rows)
    _write_csv(paths["workers"], result.worker_rows)
    _write_csv(paths["waits"], result.waits)
    paths["summary"].write_text(json.dumps({**result.summary, "rows": result.rows}, indent=1) + "\n")
    plot_curves(result, paths["plot"], title or result.summary.get("protocol", {}).get("name", ""))
    return paths


def plot_curves(result: SimulationResult, path: Path, title: str) -> None:
    """Global validation loss and accuracy against virtual time and against steps, each worker's
    training loss against virtual time, and bytes sent against virtual time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError("plots need matplotlib: pip install 'lightning-dist[bench]'") from error
    rows = result.rows
    figure, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    times = [row["time"] for row in rows]
    metric = "val_acc" if any("val_acc" in row for row in rows) else "val_loss"
    axes[0, 0].plot(times, [row.get("val_loss", math.nan) for row in rows], label="val_loss")
    axes[0, 0].set(xlabel="virtual time (s)", ylabel="global model val_loss", title="loss vs virtual time")
    axes[0, 1].plot([row["mean_steps"] for row in rows], [row.get(metric, math.nan) for row in rows])
    axes[0, 1].set(xlabel="steps per worker", ylabel=f"global model {metric}", title=f"{metric} vs steps")
    workers = sorted({int(row["worker"]) for row in result.worker_rows})
    for worker in workers[:64]:
        own = [row for row in result.worker_rows if row["worker"] == worker]
        own = [row for row in own if "train_loss" in row]
        axes[1, 0].plot([row["time"] for row in own], [row["train_loss"] for row in own], linewidth=0.6, alpha=0.6)
    shown = f" ({min(len(workers), 64)} of {len(workers)} workers)" if len(workers) > 64 else ""
    axes[1, 0].set(xlabel="virtual time (s)", ylabel="train loss", title="each worker's training loss" + shown)
    axes[1, 1].plot(times, [row["bytes"] / 1e6 for row in rows])
    axes[1, 1].set(xlabel="virtual time (s)", ylabel="MB sent (all nodes)", title="communication")
    for axis in axes.flat:
        axis.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
