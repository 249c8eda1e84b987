"""The large-model study (issue 41): peak memory and synchronization time of each strategy on a 100M-parameter model.

Each row trains ``TransformerLM.preset("100m")`` (106.6M parameters, 426 MB in float32, AdamW) on 2 CPU ranks
(Gloo, torchrun, one process and one thread each) for one round of its protocol on ``StdlibTextDataModule``
batches of ``--batch-size`` windows of ``--seq-len`` bytes, the same in every row, and measures per rank
(``worker.py``, ``memory.py``, README.md): the peak resident set over the steps after the first (every
synchronization of the run falls in them), the strategy's own tensors, the protocol's time in training, and,
after training, ``--repeats`` full synchronizations each paired with ``torch.distributed.all_reduce`` of the model's
float32 bytes on the same process group.

Rows (:data:`ROWS`): Lightning's DDP (the baseline), periodic averaging, DiLoCo, periodic averaging with
``compression="int8"``, dynamic averaging (a threshold so small that every check is a full synchronization), and,
where ``PeriodicAveragingStrategy`` takes them (read from its signature before anything runs; a row whose argument
does not exist is reported as missing), streaming synchronization (``fragments=4, fragment_sync_delay=1``) of
periodic averaging and of DiLoCo, and ``state_device="cpu"`` with and without streaming, and with int8.

Usage::

    python -m benchmarks.large_model.run                 # every row; JSON, PNG, the docs table
    python -m benchmarks.large_model.run --rows ddp,diloco
    python -m benchmarks.large_model.run --quick         # the 1.3M "small" preset: a smoke run of the script
    python -m benchmarks.large_model.run --replot        # table and figure again from the JSON

Writes ``benchmarks/results/large_model.{json,png}`` and the table in ``docs/results/large-model.md``
(``--quick``: ``large_model_quick.{json,png}``, the page untouched); each row's spec and log go to
``benchmarks/results/runs/large_model/``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common.launch import RunFailed, launch
from benchmarks.common.paths import REPO, RESULTS
from benchmarks.common.report import check_names, command_line, pyplot, save_figure, write_json
from benchmarks.large_model.memory import MALLOC_ENV

WORKER = Path(__file__).resolve().parent / "worker.py"
MIB = 2**20


@dataclass(frozen=True)
class Row:
    """One row: a strategy and its arguments; ``needs`` the ``PeriodicAveragingStrategy`` arguments it uses."""

    name: str
    label: str
    strategy: dict[str, Any]
    needs: tuple[str, ...] = field(default=())
    steps: int = 4
    """Optimizer steps of its training: one round (the blocking rows' period, 4; streaming's period, 8)."""


def _periodic(period: int, outer: bool = False, **kwargs: Any) -> dict[str, Any]:
    return {"class": "PeriodicAveragingStrategy", "kwargs": {"period": period, **kwargs},
            "outer": "diloco" if outer else None}


STREAMING = ("fragments", "fragment_sync_delay")
ROWS = (
    Row("ddp", "DDP (Lightning, gradients all-reduced every step)", {"class": "ddp"}),
    Row("periodic", "periodic averaging, period 4", _periodic(4)),
    Row("diloco", "DiLoCo, period 4 (SGD Nesterov 0.7 / 0.9)", _periodic(4, outer=True)),
    Row("periodic_int8", "periodic averaging, period 4, compression int8", _periodic(4, compression="int8")),
    Row("dynamic", "dynamic averaging, Delta 1e-9, check every 4 (every check a full sync)",
        {"class": "DynamicAveragingStrategy", "kwargs": {"divergence_threshold": 1e-9, "check_every": 4}}),
    Row("streaming", "streaming periodic averaging, period 8, fragments 4, delay 1",
        _periodic(8, fragments=4, fragment_sync_delay=1), STREAMING, 8),
    Row("streaming_diloco", "streaming DiLoCo, period 8, fragments 4, delay 1",
        _periodic(8, outer=True, fragments=4, fragment_sync_delay=1), STREAMING, 8),
    Row("streaming_diloco_cpu", "streaming DiLoCo, period 8, fragments 4, delay 1, state_device cpu",
        _periodic(8, outer=True, fragments=4, fragment_sync_delay=1, state_device="cpu"), (*STREAMING, "state_device"),
        8),
    Row("diloco_cpu", "DiLoCo, period 4, state_device cpu", _periodic(4, outer=True, state_device="cpu"),
        ("state_device",)),
    Row("diloco_int8_cpu", "DiLoCo, period 4, compression int8, state_device cpu",
        _periodic(4, outer=True, compression="int8", state_device="cpu"), ("state_device",)),
)


def missing_arguments(row: Row, parameters: Any) -> list[str]:
    """The arguments ``row`` needs that ``parameters`` (a signature's parameter names) lacks."""
    return [name for name in row.needs if name not in parameters]


def periodic_parameters() -> list[str]:
    """``PeriodicAveragingStrategy.__init__``'s argument names in this checkout."""
    from lightning_dist import PeriodicAveragingStrategy

    return list(inspect.signature(PeriodicAveragingStrategy.__init__).parameters)


def memory_needed(model_bytes: int, ranks: int) -> int:
    """A generous bound on what a row needs: per rank the model, its gradients, AdamW's two moments, DDP's buckets
    or a strategy's state and its synchronization's copies (10 model sizes in all), plus 600 MiB of interpreter."""
    return ranks * (10 * model_bytes + 600 * MIB)


def available_bytes(meminfo: str | None = None) -> int:
    """``MemAvailable`` of ``/proc/meminfo``, in bytes."""
    text = Path("/proc/meminfo").read_text() if meminfo is None else meminfo
    for line in text.splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable is not in /proc/meminfo")


def launch_row(spec: dict[str, Any], ranks: int, work_dir: Path, timeout: float) -> dict[str, Any]:
    """Run one row's worker under torchrun (:func:`benchmarks.common.launch.launch`, glibc's mmap threshold fixed:
    :data:`MALLOC_ENV`); return rank 0's JSON, or a failed row's record."""
    started = time.perf_counter()
    try:
        result = launch(spec, ranks, work_dir, timeout, worker=WORKER, env=MALLOC_ENV)
    except RunFailed as exc:
        reason, _, tail = str(exc).partition("\n")
        return {"name": spec["name"], "ranks": [], "error": reason, "log_tail": tail,
                "launch_s": time.perf_counter() - started, "exit_code": None}
    errors = [rank["error"] for rank in result.get("ranks", []) if rank.get("error")]
    if errors and "error" not in result:
        result["error"] = errors[0]
    return result


def summarize(row: dict[str, Any], ddp: dict[str, Any] | None) -> dict[str, Any]:
    """The figures of one measured row (``row["ranks"]``: the worker's per-rank records), against DDP's row.

    Per rank: the peak resident set (MiB), its difference from DDP's same rank in MiB and in model sizes, the
    strategy's own tensors in model sizes; in training, the protocol's seconds per full synchronization (every
    ``after_local_step`` of the window summed, over the full synchronizations in it: fragments merged / fragments);
    after training, the median of the paired full synchronizations, of the all-reduces, and of each pair's ratio;
    the median step time without the protocol. A paired round that was not exactly one full synchronization is
    refused (the measure would be wrong).
    """
    fragments = int(row.get("strategy", {}).get("kwargs", {}).get("fragments", 1))
    ranks = []
    for index, rank in enumerate(row["ranks"]):
        model = rank["model_bytes"]
        entry: dict[str, Any] = {
            "rank": rank["rank"], "peak_mib": rank["peak_rss"] / MIB, "start_mib": rank["rss_window_start"] / MIB,
            "state_copies": sum(rank["state_bytes"].values()) / model,
            "allreduce_s": statistics.median(rank["allreduce_s"]), "step_s": statistics.median(rank["step_s"]),
        }
        if ddp is not None and index < len(ddp["ranks"]) and "peak_rss" in ddp["ranks"][index]:
            extra = rank["peak_rss"] - ddp["ranks"][index]["peak_rss"]
            entry.update(vs_ddp_mib=extra / MIB, vs_ddp_copies=extra / model)
        training = [step for step in rank.get("protocol", []) if step.get("phase", "training") == "training"]
        syncs = sum(step["synced"] for step in training) / fragments
        if syncs > 0:
            entry["train_syncs"] = syncs
            entry["train_sync_s"] = sum(step["seconds"] for step in training) / syncs
        paired = rank.get("paired_sync_s", [])
        if paired:
            wrong = [count for count in rank["paired_synced"] if count != fragments]
            if wrong:
                raise ValueError(f"{row['name']} rank {rank['rank']}: a paired round synchronized {wrong[0]} "
                                 f"fragment(s), not one full synchronization ({fragments})")
            entry["sync_s"] = statistics.median(paired)
            entry["sync_vs_allreduce"] = statistics.median(
                sync / allreduce for sync, allreduce in zip(paired, rank["allreduce_s"]))
        ranks.append(entry)
    return {"name": row["name"], "ranks": ranks}


def _cell(values: list[Any], form: str) -> str:
    return " / ".join("-" if value is None else format(value, form) for value in values)


def render_table(report: dict[str, Any]) -> str:
    """The markdown table of a report: one line per row, each figure as rank 0 / rank 1; missing and failed rows
    say so."""
    lines = [
        "| row | peak MiB per rank | vs DDP, MiB (model sizes) | strategy's tensors (model sizes) | "
        "protocol s per full sync, in training | full sync s | all_reduce s | full sync / all_reduce | step s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        label = f"`{row['name']}`: {row['label']}"
        if row.get("status") == "missing":
            lines.append(f"| {label} | missing: {row['reason']} | | | | | | | |")
            continue
        if row.get("error"):
            lines.append(f"| {label} | failed: {row['error'][:160]} | | | | | | | |")
            continue
        ranks = row["summary"]["ranks"]

        def get(key: str) -> list[Any]:
            return [rank.get(key) for rank in ranks]

        versus = (" / ".join(f"{rank['vs_ddp_mib']:+.0f} ({rank['vs_ddp_copies']:+.2f})" for rank in ranks)
                  if row["name"] != "ddp" and all("vs_ddp_mib" in rank for rank in ranks) else "-")
        lines.append(
            f"| {label} | {_cell(get('peak_mib'), '.0f')} | {versus} | {_cell(get('state_copies'), '.2f')} | "
            f"{_cell(get('train_sync_s'), '.2f')} | {_cell(get('sync_s'), '.2f')} | {_cell(get('allreduce_s'), '.2f')} | "
            f"{_cell(get('sync_vs_allreduce'), '.2f')} | {_cell(get('step_s'), '.2f')} |"
        )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Two panels: each row's peak resident set per rank less DDP's, in model sizes; its full synchronization's time
    over the all-reduce's (paired medians)."""
    plt = pyplot()
    rows = report["rows"][::-1]
    figure, (memory, speed) = plt.subplots(1, 2, figsize=(11, 0.45 * len(rows) + 1.8), sharey=True)
    positions = list(range(len(rows)))
    for offset, rank in ((0.2, 0), (-0.2, 1)):
        extra, ratios = [], []
        for row in rows:
            ranks = row.get("summary", {}).get("ranks", [])
            extra.append(ranks[rank].get("vs_ddp_copies", 0) if len(ranks) > rank else 0)
            ratios.append(ranks[rank].get("sync_vs_allreduce", 0) if len(ranks) > rank else 0)
        memory.barh([p + offset for p in positions], extra, height=0.4, label=f"rank {rank}")
        speed.barh([p + offset for p in positions], ratios, height=0.4, label=f"rank {rank}")
    memory.axvline(0, color="k", lw=1)
    speed.axvline(1.0, color="k", ls="--", lw=1, label="= all_reduce")
    for position, row in zip(positions, rows):
        if not row.get("summary"):
            text = "missing" if row.get("status") == "missing" else "failed"
            memory.text(0.02, position, text, va="center", transform=memory.get_yaxis_transform())
    memory.set_yticks(positions, [row["name"] for row in rows])
    memory.set_xlabel(f"peak memory per rank - DDP's, in model sizes ({report['model_bytes'] / MIB:.0f} MiB)")
    speed.set_xlabel("full synchronization / all_reduce of the model's float32 bytes")
    memory.legend(fontsize=8)
    speed.legend(fontsize=8)
    figure.suptitle(f"TransformerLM {report['preset']} ({report['parameters'] / 1e6:.1f}M parameters), "
                    f"{report['ranks']} CPU ranks, Gloo")
    save_figure(figure, path)


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", help="comma-separated row names (default: all)")
    parser.add_argument("--batch-size", type=int, default=1, help="windows per batch (default 1)")
    parser.add_argument("--seq-len", type=int, default=32, help="bytes per window (default 32; the model's block is 128)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="paired synchronization / all-reduce timings (default 3)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per row before it is killed")
    parser.add_argument("--quick", action="store_true", help='the "small" preset; results *_quick, docs untouched')
    parser.add_argument("--replot", action="store_true", help="table and figure from the JSON; nothing runs")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    stem = "large_model_quick" if args.quick else "large_model"
    json_path, png_path = args.out / f"{stem}.json", args.out / f"{stem}.png"
    if args.replot:
        report = json.loads(json_path.read_text())
    else:
        report = run(args)
        write_json(json_path, report)
    table = render_table(report)
    print(table)
    plot(report, png_path)
    print(f"wrote {json_path} and {png_path}")
    if not args.quick:
        print("docs/results/large-model.md's tables: python -m benchmarks.common.tables")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the chosen rows, one torchrun launch each; the report (JSON-able)."""
    import torch

    from lightning_dist.model_vector import ModelVector
    from lightning_dist.models import TransformerLM

    names = args.rows.split(",") if args.rows else [row.name for row in ROWS]
    check_names("--rows", names, [row.name for row in ROWS], "benchmarks/large_model/run.py")
    preset = "small" if args.quick else "100m"
    with torch.device("meta"):
        model = TransformerLM.preset(preset)
    vector = ModelVector(model)
    model_bytes = vector.numel * vector.dtype.itemsize
    needed, available = memory_needed(model_bytes, args.ranks), available_bytes()
    if needed > available:
        raise SystemExit(f"a row may need {needed / 2**30:.1f} GiB and {available / 2**30:.1f} GiB are available: "
                         "free memory, or pass --quick")
    parameters = periodic_parameters()
    started = time.perf_counter()
    rows = []
    for row in ROWS:
        if row.name not in names:
            continue
        record: dict[str, Any] = {"name": row.name, "label": row.label, "strategy": row.strategy}
        missing = missing_arguments(row, parameters)
        if missing:
            record.update(status="missing", reason=f"PeriodicAveragingStrategy has no {', '.join(missing)} argument in "
                                                   "this checkout")
            print(f"{row.name}: missing ({record['reason']})", flush=True)
            rows.append(record)
            continue
        spec = {"name": row.name, "preset": preset, "seq_len": args.seq_len, "batch_size": args.batch_size,
                "steps": row.steps, "seed": 0, "repeats": args.repeats, "strategy": row.strategy}
        load = os.getloadavg()[0]
        result = launch_row(spec, args.ranks, args.out / "runs" / "large_model", args.timeout)
        record.update(steps=row.steps, ranks=result.get("ranks", []), launch_s=result["launch_s"],
                      exit_code=result["exit_code"], load_before=load, load_after=os.getloadavg()[0])
        if result.get("error"):
            record.update(error=result["error"], log_tail=result.get("log_tail"))
        rows.append(record)
        print(f"{row.name}: {'failed: ' + record['error'] if record.get('error') else 'done'} "
              f"({result['launch_s']:.0f} s)", flush=True)
    ddp = next((row for row in rows if row["name"] == "ddp" and not row.get("error") and row.get("ranks")), None)
    for row in rows:
        if row.get("ranks") and not row.get("error"):
            row["summary"] = summarize(row, ddp)
    return {
        "command": command_line(), "date": time.strftime("%Y-%m-%d"), "wall_s": time.perf_counter() - started,
        "torch": torch.__version__, "ranks": args.ranks, "preset": preset, "parameters": vector.num_parameters,
        "model_bytes": model_bytes, "batch_size": args.batch_size, "seq_len": args.seq_len, "repeats": args.repeats,
        "cpus": os.cpu_count(),
        "commit": _git("rev-parse", "HEAD"), "dirty": bool(_git("status", "--porcelain", "--", "lightning_dist")),
        "periodic_arguments": parameters, "rows": rows,
    }


if __name__ == "__main__":
    main()
