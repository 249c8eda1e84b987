"""The tables of ``docs/results/language-model-simulated.md``, rendered from ``benchmarks/results/lm_sim.json``
(:mod:`benchmarks.language_model.simulated`'s prediction of the measured table and its runs at 16 to 256 workers)
and, for the thresholds named in the labels, ``benchmarks/results/lm_network.json`` (:mod:`benchmarks.common.tables`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from benchmarks.common.tables import result
from benchmarks.language_model.simulated import agreement, collectives_of, fmt

PREDICTED_METHODS = ("ddp", "periodic_h10", "periodic_h50", "fedavg", "dynamic_lo", "dynamic_hi", "segmented_gossip",
                     "downpour", "diloco", "dynamic_outer")
"""Part 1's methods, predicted on 2026-11-24, in the page's order."""
CODEC_METHODS = ("ddp_powersgd_r4", "ddp_powersgd_r1", "ddp_fp16", "periodic_h50_int8", "dynamic_default_int8",
                 "gossip_p20_r1", "gossip_p50_r1", "gossip_p50_r2", "downpour_p50", "downpour_p20_int8",
                 "downpour_p50_int8")
"""Issue 27's methods (hooks and codecs), in the page's order."""
STREAMING_METHODS = ("diloco_stream", "diloco_stream_int8", "periodic_h50_stream_a0_int8")
"""Issue 41's streaming methods."""
SCALE_METHODS = ("ddp", "periodic_h10", "periodic_h50", "diloco", "dynamic_hi", "dynamic_default")
"""The rows of the table past this machine, in the page's order."""
SCALE_HIGHLIGHT = "dynamic_default"
"""The scale table's row set in bold: the package's defaults."""
Cell = dict[str, Any]


def within(ratio: float) -> bool:
    """Whether a predicted-to-measured ratio is within the goal's 20%."""
    return abs(ratio - 1) <= 0.2


def cells_of(methods: tuple[str, ...], step: str | None = None) -> list[Cell]:
    """Part 1's cells of ``methods`` (of step kind ``step`` if given): machine step first, fastest link first."""
    cells = [cell for cell in result("lm_sim")["prediction"] if cell["name"] in methods
             and (step is None or cell.get("step", "machine") == step)]
    return sorted(cells, key=lambda cell: (cell.get("step", "machine") != "machine", -cell["node_mbit"],
                                           methods.index(cell["name"])))


def cell_row(cell: Cell, step: bool, projected: bool, bold: Callable[[Cell], bool]) -> str:
    """One row of a prediction table, with the step and DDP's projections if asked, the ratio bold where ``bold``."""
    m, p = cell["measured"], cell["predicted"]
    time_ratio = fmt(cell["time_ratio"], 2)
    if cell["time_ratio"] is not None and bold(cell):
        time_ratio = f"**{time_ratio}**"
    columns = [f"{cell['node_mbit']:g}", cell["name"]]
    if step:
        columns.append(f"{p['step_s']:.3f}" + (" (own)" if cell.get("step") == "own" else ""))
    columns += [fmt(m["time_to_target_s"]), fmt(p["time_to_target_s"]), time_ratio]
    if projected:
        columns += [fmt(m.get("projected_time_to_target_s")), fmt(p.get("projected_time_to_target_s")),
                    fmt(cell.get("projected_ratio"), 2)]
    columns += [f"{m['final_val_loss']:.3f}", f"{p['final_val_loss']:.3f}", f"{m['steps']:.0f}", f"{p['steps']:.0f}"]
    return "| " + " | ".join(columns) + " |"


def cell_table(cells: list[Cell], step: bool, projected: bool, bold: Callable[[Cell], bool]) -> str:
    """A prediction table of ``cells`` with the columns :func:`cell_row` is asked for."""
    header = ["Mbit/s", "method", *(["step s"] if step else []), "s to target: measured", "predicted", "ratio",
              *(["DDP projected: measured", "predicted", "ratio"] if projected else []),
              "final loss: measured", "predicted", "steps: measured", "predicted"]
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                      *(cell_row(cell, step, projected, bold) for cell in cells)])


def prediction_table() -> str:
    """Part 1's prediction against the measured table, and how many cells agree within 20%."""
    cells = cells_of(PREDICTED_METHODS, "machine")
    return cell_table(cells, step=False, projected=True, bold=lambda cell: False) + "\n\n" + agreement(cells)


def codec_table() -> str:
    """Issue 27's hooks and codecs (2026-11-26): the prediction table without DDP's projections, misses in bold."""
    cells = cells_of(CODEC_METHODS, "machine")
    return cell_table(cells, step=False, projected=False, bold=lambda cell: not within(cell["time_ratio"]))


def streaming_table() -> str:
    """Issue 41's streaming methods on the machine's step, then on each cell's own step (its hits in bold)."""
    cells = cells_of(STREAMING_METHODS)
    return cell_table(cells, step=True, projected=False,
                      bold=lambda cell: cell.get("step") == "own" and within(cell["time_ratio"]))


def scale_label(name: str, thresholds: dict[str, float]) -> str:
    """A method's label in the scale table: a set threshold named, the highlighted row in bold."""
    if name == SCALE_HIGHLIGHT:
        return f"**{name}**"
    return f"{name} (Delta {thresholds[name]:.0f} set)" if name in thresholds else name


def four_workers(cell: Cell | None) -> str:
    """Part 1's predicted seconds to target at 4 workers (DDP's projection where it has one)."""
    if cell is None:
        return "not predicted"
    projected = cell["predicted"].get("projected_time_to_target_s")
    return f"{projected:.1f} (proj)" if projected else fmt(cell["predicted"]["time_to_target_s"])


def scale_table() -> str:
    """Seconds, MB sent and steps to the target at 16 to 256 simulated workers, beside part 1's 4-worker seconds."""
    report = result("lm_sim")
    mbit = report["config"]["scale_mbit"]
    kwargs = {method["name"]: method.get("strategy", {}).get("kwargs", {})
              for method in result("lm_network")["config"]["methods"]}
    thresholds = {name: given["divergence_threshold"] for name, given in kwargs.items()
                  if "divergence_threshold" in given}
    runs = {(run["name"], run["workers"]): run for run in report["scale"]
            if collectives_of(run) == "gloo_ring" and run["node_mbit"] == mbit}
    workers = sorted({count for _, count in runs})
    predicted = {cell["name"]: cell for cell in report["prediction"]
                 if cell["node_mbit"] == mbit and cell.get("step", "machine") == "machine"}
    listed = " / ".join(f"{count}" for count in workers)
    lines = [f"| method | 4 workers | {' | '.join(str(count) for count in workers)} | MB sent to target ({listed}) "
             f"| steps to target ({listed}) |", "|" + "---|" * (len(workers) + 4)]
    for name in SCALE_METHODS:
        row = [runs[name, count] for count in workers]
        strong = (lambda text: f"**{text}**") if name == SCALE_HIGHLIGHT else (lambda text: text)
        times = [strong(fmt(run["time_to_target_s"])) for run in row]
        sent = strong(" / ".join(fmt(None if run["bytes_to_target"] is None else run["bytes_to_target"] / 1e6, 0)
                                 for run in row))
        steps = " / ".join(fmt(run["steps_to_target"], 0) for run in row)
        lines.append(f"| {scale_label(name, thresholds)} | {four_workers(predicted.get(name))} | {' | '.join(times)} "
                     f"| {sent} | {steps} |")
    return "\n".join(lines)
