"""The large-model study's results tables, rendered from ``benchmarks/results/large_model.json`` into
``docs/results/large-model.md`` (:mod:`benchmarks.common.tables`): every row's measured figures, and each peak split
into the state the strategy keeps and the synchronization's transient memory."""

from __future__ import annotations

import statistics

from benchmarks.common.tables import result
from benchmarks.large_model.run import MIB, render_table

BREAKDOWN_ROWS = (("ddp",), ("periodic",), ("dynamic",), ("diloco", "diloco_cpu"), ("periodic_int8",),
                  ("diloco_int8_cpu",), ("streaming",), ("streaming_diloco", "streaming_diloco_cpu"))
"""The rows of the peak's breakdown, those that measure the same on this machine named together."""
BASE = "periodic"
"""The row whose window start is the model's training state alone: no strategy state, no DDP buckets."""


def measured_table() -> str:
    """Every row's peak, its difference from DDP's, the strategy's tensors and the timings, rank 0 / rank 1
    (:func:`benchmarks.large_model.run.render_table`), and the run that measured them."""
    report = result("large_model")
    dirty = ", with uncommitted changes to lightning_dist" if report["dirty"] else ""
    return (f"{render_table(report)}\n\n"
            f"From `{report['command']}` ({report['date']}, {report['wall_s']:.0f} s; torch {report['torch']}, "
            f"{report['ranks']} ranks, `{report['preset']}`: {report['parameters']:,} parameters, "
            f"{report['model_bytes'] / MIB:.0f} MiB in float32; batches of {report['batch_size']} x "
            f"{report['seq_len']} bytes; {report['repeats']} paired timings; commit {report['commit'][:10]}{dirty}).")


def peak_breakdown_table() -> str:
    """Each peak above :data:`BASE`'s window start on the same rank, the part the strategy keeps and the rest, the
    synchronization's transient memory, in model sizes: means over the ranks and the rows named together."""
    report = result("large_model")
    rows = {row["name"]: row["ranks"] for row in report["rows"]}
    base = [rank["rss_window_start"] for rank in rows[BASE]]

    def above(key: str, name: str) -> list[float]:
        return [(rank[key] - start) / rank["model_bytes"] for rank, start in zip(rows[name], base)]

    lines = ["| row | peak above the model's training state | of which kept (strategy's tensors) | "
             "so transient, in the synchronization |",
             "|---|---|---|---|"]
    spread = 0.0
    for names in BREAKDOWN_ROWS:
        peaks = [value for name in names for value in above("peak_rss", name)]
        spread = max(spread, max(peaks) - min(peaks))
        if names == ("ddp",):
            kept = statistics.fmean(above("rss_window_start", "ddp"))
            kept_cell = f"{kept:.2f} (buckets, not visible to the count: its window start above `{BASE}`'s)"
        else:
            kept = statistics.fmean(sum(rank["state_bytes"].values()) / rank["model_bytes"]
                                    for name in names for rank in rows[name])
            kept_cell = f"{kept:.2f}"
        fragments = {row["strategy"].get("kwargs", {}).get("fragments") for row in report["rows"]
                     if row["name"] in names}
        label = ", ".join(f"`{name}`" for name in names) + "".join(f" (P = {count})" for count in fragments if count)
        lines.append(f"| {label} | {statistics.fmean(peaks):.2f} | {kept_cell} | "
                     f"{statistics.fmean(peaks) - kept:.2f} |")
    lines.append("")
    lines.append(f"Means of both ranks and of the rows named together, which agree within {spread:.2f}; from "
                 "`rss_window_start`, `peak_rss` and `state_bytes` in `benchmarks/results/large_model.json`.")
    return "\n".join(lines)
