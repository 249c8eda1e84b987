"""Benchmark of paper 003's claim: CD-GraB's coordinated example orders train faster than random reshuffling.

Three example orders on the same distributed training (Lightning ``strategy="ddp"``, Gloo on CPU,
``--ranks`` processes, the same seed, learning rate, per-rank batch size, partition and
initialization), each run as ``torchrun`` launches of ``_cdgrab_worker.py``:

- ``drr``: D-RR, each rank reshuffles its fixed shard every epoch (``CDGraBSampler(order="random")``,
  no callback), the paper's baseline;
- ``cdgrab``: CD-GraB (``CDGraB()`` + ``CDGraBSampler(order="balanced")``): per-example gradient
  differences all-gathered every step, one shared running sum;
- ``idgrab``: ID-GraB (``CDGraB(mode="independent")``): every rank balances its own differences.

Two tasks, as paper 003's appendix D.1 (SGD with momentum 0.9, learning rate tuned for D-RR
first and then used for all methods):

- ``logreg``: binary logistic regression on a synthetic tabular task shaped like the paper's HMDA
  mortgage data (18 standardized features, ``make_classification`` with 5 % label noise, 10,000
  rows, 80/20 split); 19 parameters;
- ``mlp``: the examples' MLP (40-64-64-10, 7,434 parameters) on MNIST-1D (8,000 samples, 80/20).

Sections (``--sections``):

- ``sweep``: D-RR alone, seed 0, over a learning-rate grid per task, as many epochs as
  ``compare``; picks the rate with the lowest full-train loss (mean of the last 3 epochs).
  ``compare`` uses that rate (or ``--lr``; without a sweep result, the rate in ``TASKS``).
- ``compare``: the three methods x ``--seeds``; one launch per (task, method), the seeds run one
  after the other inside it, so the launch's peak RSS is the method's.
- ``overhead``: the same three methods on 2 ranks (one process per core), few epochs, seed 0: the
  per-step cost of the callback without 4 processes time-slicing 2 cores.

Recorded per epoch (see ``_cdgrab_worker.py``): full-train loss/accuracy (rank 0, whole training
split, after the epoch, outside the epoch clock), test loss/accuracy, epoch training time, the
callback's seconds (split into per-example gradients, all-gather, balancing) and bytes.

Outputs (``--out``, default ``benchmarks/results``): ``cdgrab.json``, ``cdgrab.png`` and
``runs/cdgrab_*`` (each launch's spec, log and raw result).

Usage::

    python -m benchmarks.cdgrab.run                       # sweep + compare + overhead (about 22 min on 2 cores)
    python -m benchmarks.cdgrab.run --sections compare    # rerun one section; the others stay in the JSON
    python -m benchmarks.cdgrab.run --quick               # smoke run (one launch, 2 epochs; writes under runs/quick)
    python -m benchmarks.cdgrab.run --replot              # recompute summary, tables and figure from the JSON
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common.launch import RunFailed, launch
from benchmarks.common.paths import RESULTS

WORKER = Path(__file__).with_name("worker.py")
METHODS = ["drr", "cdgrab", "idgrab"]
LABELS = {"drr": "D-RR", "cdgrab": "CD-GraB", "idgrab": "ID-GraB"}
COLORS = {"drr": "tab:blue", "cdgrab": "tab:red", "idgrab": "tab:green"}

# Per task: data (generated with data["seed"], the same for every run seed), per-rank batch size,
# SGD momentum 0.9 (paper 003), epochs, the D-RR learning-rate grid of the sweep and the rate used
# when no sweep result is available (the sweep's choice on this machine).
TASKS: dict[str, dict[str, Any]] = {
    "logreg": {
        "title": "logistic regression (synthetic HMDA-like, 18 features)",
        "data": {"seed": 0, "n_samples": 10000},
        "batch_size": 16,
        "momentum": 0.9,
        "epochs": 15,
        "grid": [0.03, 0.01, 0.003, 0.001],
        "learning_rate": 0.003,
    },
    "mlp": {
        "title": "MLP 40-64-64-10 on MNIST-1D",
        "data": {"seed": 0, "num_samples": 8000},
        "hidden_size": 64,
        "batch_size": 16,
        "momentum": 0.9,
        "epochs": 20,
        "grid": [0.3, 0.1, 0.03, 0.01],
        "learning_rate": 0.03,
    },
}
QUICK_DATA = {"logreg": {"seed": 0, "n_samples": 2000}, "mlp": {"seed": 0, "num_samples": 2000}}
SWEEP_LAST = 3  # the sweep scores a rate by the mean full-train loss of its last epochs
FIRST_FEW = 3  # the target: CD-GraB below D-RR at every epoch from this one on (0-based)
TIME_RATIO_TARGET = 1.3
OVERHEAD_RANKS = 2
OVERHEAD_EPOCHS = 6


def run_spec(
    task: str, method: str, seed: int, learning_rate: float, epochs: int, data: dict[str, Any]
) -> dict[str, Any]:
    config = TASKS[task]
    spec = {
        "name": f"{task}_{method}_s{seed}_lr{learning_rate:g}",
        "task": task, "method": method, "seed": seed, "epochs": epochs, "learning_rate": learning_rate,
        "momentum": config["momentum"], "batch_size": config["batch_size"], "data": data,
    }
    if "hidden_size" in config:
        spec["hidden_size"] = config["hidden_size"]
    return spec


def run_launch(name: str, runs: list[dict[str, Any]], ranks: int, args: argparse.Namespace) -> dict[str, Any]:
    """One torchrun launch running ``runs`` one after the other; returns its result (or ``{"error": ...}``)."""
    print(f"  {name}: {len(runs)} fit(s) on {ranks} ranks ...", end=" ", flush=True)
    try:
        result = launch({"name": f"cdgrab_{name}", "runs": runs}, ranks, args.out / "runs", timeout=args.timeout,
                        worker=WORKER)
    except RunFailed as exc:
        print("FAILED")
        print(exc, file=sys.stderr)
        return {"name": name, "error": str(exc), "runs": []}
    fits = ", ".join(f"{r['name']} {r['fit_s']:.0f} s" for r in result["runs"])
    print(f"{result['launch_s']:.0f} s ({fits})", flush=True)
    for index, run in enumerate(result["runs"]):  # each fit carries its launch's memory
        run["launch"] = {"name": name, "index": index, "memory": result["memory"], "launch_s": result["launch_s"]}
    return result


# ---------------------------------------------------------------- statistics


def mean_std(values: list[float]) -> dict[str, float]:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return {"mean": math.nan, "std": math.nan, "n": 0}
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values)}


def trained_epochs(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in run["curve"] if e["epoch"] >= 0]


def steady_epoch_s(run: dict[str, Any]) -> float:
    """Mean training time of an epoch, the first (warm-up: tracing, allocator, lazy imports) left out."""
    epochs = trained_epochs(run)
    steady = epochs[1:] or epochs
    return statistics.fmean(e["epoch_s"] for e in steady)


def steady_median_epoch_s(run: dict[str, Any]) -> float:
    epochs = trained_epochs(run)
    return statistics.median(e["epoch_s"] for e in (epochs[1:] or epochs))


def steady_mean(run: dict[str, Any], key: str) -> float:
    epochs = trained_epochs(run)
    steady = epochs[1:] or epochs
    return statistics.fmean(e.get(key, 0.0) for e in steady)


def bytes_per_epoch_per_rank(runs: list[dict[str, Any]]) -> float:
    """Bytes the callback sent per epoch (epochs 1..), averaged over ranks and runs.

    The order server (rank 0) sends only its broadcasts and the other ranks their differences, so
    rank 0 alone is not representative.
    """
    return statistics.fmean(
        statistics.fmean(statistics.fmean(rank["cdgrab_bytes"][1:] or rank["cdgrab_bytes"]) for rank in run["per_rank"])
        for run in runs
    )


def sweep_score(run: dict[str, Any]) -> float:
    return statistics.fmean(e["train_loss"] for e in trained_epochs(run)[-SWEEP_LAST:])


def summarize_sweep(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for task in TASKS:
        mine = [r for r in runs if r["task"] == task]
        if not mine:
            continue
        finite = [r for r in mine if math.isfinite(sweep_score(r))]
        best = min(finite, key=sweep_score) if finite else None
        out[task] = {
            "criterion": f"lowest D-RR full-train loss, mean of the last {SWEEP_LAST} epochs, seed {mine[0]['seed']}",
            "rows": [{"learning_rate": r["learning_rate"], "score": sweep_score(r),
                      "final_train_loss": trained_epochs(r)[-1]["train_loss"],
                      "final_test_acc": trained_epochs(r)[-1]["test_acc"],
                      "final_test_loss": trained_epochs(r)[-1]["test_loss"], "epochs": r["epochs"]}
                     for r in sorted(mine, key=lambda r: -r["learning_rate"])],
            "selected": best["learning_rate"] if best else None,
        }
    return out


def summarize_compare(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for task in TASKS:
        by_method = {m: sorted((r for r in runs if r["task"] == task and r["method"] == m), key=lambda r: r["seed"])
                     for m in METHODS}
        if not by_method["drr"]:
            continue
        epochs = min(len(r["curve"]) for rs in by_method.values() for r in rs)
        methods: dict[str, Any] = {}
        for method, rs in by_method.items():
            if not rs:
                continue
            curve = []
            for i in range(epochs):
                point: dict[str, Any] = {"epoch": rs[0]["curve"][i]["epoch"]}
                for key in ("train_loss", "test_loss", "test_acc", "train_s"):
                    point[key] = mean_std([r["curve"][i][key] for r in rs])
                curve.append(point)
            epoch_s = mean_std([steady_epoch_s(r) for r in rs])
            steps = rs[0]["steps_per_epoch"]
            parts = {key: mean_std([steady_mean(r, key) for r in rs])["mean"]
                     for key in ("cdgrab_s", "grad_s", "gather_s", "gather_wait_s", "balance_s", "cdgrab_bytes")}
            memory = rs[0]["launch"]["memory"]
            # The launch's first fit alone: ru_maxrss read on every rank right after it. The launch's
            # peak covers all its fits; each CDGraB setup adds two process groups that stay open.
            first = next((r for r in rs if r["launch"].get("index") == 0), rs[0])
            first_fit = [rank["peak_rss_mib"] for rank in first["per_rank"]]
            methods[method] = {
                "seeds": [r["seed"] for r in rs],
                "curve": curve,
                "final": {key: mean_std([trained_epochs(r)[-1][key] for r in rs])
                          for key in ("train_loss", "train_acc", "test_loss", "test_acc")},
                "epoch_s": epoch_s,
                "step_ms": 1000 * epoch_s["mean"] / steps,
                "steps_per_epoch": steps,
                "callback_s_per_epoch": parts,
                "callback_share_of_epoch": parts["cdgrab_s"] / epoch_s["mean"] if epoch_s["mean"] else math.nan,
                "callback_ms_per_step": {key: 1000 * value / steps for key, value in parts.items()
                                         if key != "cdgrab_bytes"},
                "bytes_sent_per_epoch_per_rank": bytes_per_epoch_per_rank(rs),
                "peak_rss_mib": {"first_fit_max": max(first_fit), "first_fit_mean": statistics.fmean(first_fit),
                                 "first_fit_seed": first["seed"],
                                 "launch_max": max(memory["peak_rss_mib"]),
                                 "launch_mean": statistics.fmean(memory["peak_rss_mib"]),
                                 "before_fit_mean": statistics.fmean(memory["peak_rss_before_fit_mib"])},
                "buffers_bytes": rs[0].get("cdgrab_buffers_bytes", {}),
                # rank 0's resident set at the end of the first and the last epoch (mean over seeds): growth = a leak
                "rank0_rss_mib_first_last_epoch": [
                    statistics.fmean(trained_epochs(r)[0].get("rss_mib", math.nan) for r in rs),
                    statistics.fmean(trained_epochs(r)[-1].get("rss_mib", math.nan) for r in rs),
                ],
            }
        drr = methods["drr"]
        for method, r in methods.items():
            # Epoch time above D-RR's per step, and the part of it not spent inside the callback's
            # timed parts (the background gather's and other ranks' CPU on shared cores, DDP waiting longer).
            extra = r["step_ms"] - drr["step_ms"]
            timed = sum(r["callback_ms_per_step"][k] for k in ("grad_s", "gather_s", "balance_s"))
            r["extra_ms_per_step_vs_drr"] = extra
            r["extra_not_in_timed_parts_ms"] = extra - timed
        target = drr["final"]["train_loss"]["mean"]
        for method, r in methods.items():
            # Epochs and training seconds (means over seeds) until the mean full-train loss first
            # reaches D-RR's final one.
            hit = next((p for p in r["curve"] if p["epoch"] >= 0 and p["train_loss"]["mean"] <= target), None)
            r["to_drr_final_loss"] = ({"epochs": hit["epoch"] + 1, "train_s": hit["train_s"]["mean"]} if hit
                                      else {"epochs": None, "train_s": None})
        info = by_method["drr"][0]
        summary: dict[str, Any] = {
            "title": TASKS[task]["title"],
            "learning_rate": info["learning_rate"], "momentum": info["momentum"],
            "batch_size_per_rank": info["batch_size"], "world_size": info["world_size"],
            "num_parameters": info["num_parameters"], "train_examples": info["train_examples"],
            "test_examples": info["test_examples"], "examples_per_rank": info["examples_per_rank"],
            "dropped": info["dropped"], "steps_per_epoch": info["steps_per_epoch"], "epochs": info["epochs"],
            "methods": methods,
        }
        if "cdgrab" in methods:
            cd = methods["cdgrab"]
            below = [p["epoch"] for p, q in zip(cd["curve"], drr["curve"])
                     if p["epoch"] >= 0 and p["train_loss"]["mean"] < q["train_loss"]["mean"]]
            per_seed = {}
            for a, b in zip(by_method["cdgrab"], by_method["drr"]):
                per_seed[a["seed"]] = [x["epoch"] for x, y in zip(trained_epochs(a), trained_epochs(b))
                                       if x["train_loss"] < y["train_loss"]]
            after = [p["epoch"] for p in cd["curve"] if p["epoch"] >= FIRST_FEW]
            summary["cdgrab_below_drr_epochs"] = below
            summary["cdgrab_below_drr_epochs_per_seed"] = per_seed
            summary["loss_target_met"] = bool(after) and all(e in below for e in after)
            summary["loss_target"] = (f"mean (over seeds) full-train loss of CD-GraB below D-RR's at every epoch "
                                      f">= {FIRST_FEW} (0-based)")
            summary["time_ratio_cdgrab"] = cd["epoch_s"]["mean"] / drr["epoch_s"]["mean"]
            summary["time_target_met"] = summary["time_ratio_cdgrab"] <= TIME_RATIO_TARGET
            cd_rss, drr_rss = cd["peak_rss_mib"], drr["peak_rss_mib"]
            summary["rss_overhead_mib_cdgrab"] = cd_rss["first_fit_max"] - drr_rss["first_fit_max"]
            summary["rss_overhead_mib_cdgrab_launch"] = cd_rss["launch_max"] - drr_rss["launch_max"]
            summary["buffers_analytic_bytes"] = analytic_buffers(summary)
        if "idgrab" in methods:
            summary["time_ratio_idgrab"] = methods["idgrab"]["epoch_s"]["mean"] / drr["epoch_s"]["mean"]
            idg = methods["idgrab"]["peak_rss_mib"]
            summary["rss_overhead_mib_idgrab"] = idg["first_fit_max"] - drr["peak_rss_mib"]["first_fit_max"]
            summary["rss_overhead_mib_idgrab_launch"] = idg["launch_max"] - drr["peak_rss_mib"]["launch_max"]
        out[task] = summary
    return out


def analytic_buffers(summary: dict[str, Any]) -> dict[str, int]:
    """Float32 bytes the callback holds per rank at its peak (per step), from the formulas of the design."""
    d, b, m = summary["num_parameters"], summary["batch_size_per_rank"], summary["world_size"]
    n = summary["examples_per_rank"]
    return {
        "per_example_gradients (B x d)": 4 * b * d,
        "differences (B/2 x d)": 4 * (b // 2) * d,
        "gathered differences (m x B/2 x d), held ~3x: gather list, stacked, pair-major copy": 3 * 4 * m * (b // 2) * d,
        "running sum (d)": 4 * d,
        "signs (n/2 x m int8)": (n // 2) * m,
    }


def summarize_overhead(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for task in TASKS:
        mine = {r["method"]: r for r in runs if r["task"] == task}
        if "drr" not in mine:
            continue
        # Median over epochs (the first left out): one seed, so one slow epoch (other load) would move a mean.
        base = steady_median_epoch_s(mine["drr"])
        rows = {}
        for method, r in mine.items():
            steps = r["steps_per_epoch"]
            rows[method] = {"epoch_s": steady_median_epoch_s(r), "ratio": steady_median_epoch_s(r) / base,
                            "step_ms": 1000 * steady_median_epoch_s(r) / steps,
                            "callback_ms_per_step": {
                                k: 1000 * steady_mean(r, k) / steps
                                for k in ("cdgrab_s", "grad_s", "gather_s", "gather_wait_s", "balance_s")}}
        out[task] = {"world_size": mine["drr"]["world_size"], "epochs": mine["drr"]["epochs"], "methods": rows}
    return out


# ---------------------------------------------------------------- tables


def pm(stat: dict[str, float], digits: int = 4) -> str:
    return f"{stat['mean']:.{digits}f} ± {stat['std']:.{digits}f}"


def sweep_table(sweep: dict[str, Any]) -> str:
    lines = ["| task | learning rate | D-RR full-train loss (last 3 epochs) | final test acc | selected |",
             "|---|---|---|---|---|"]
    for task, s in sweep.items():
        for row in s["rows"]:
            mark = "**yes**" if row["learning_rate"] == s["selected"] else ""
            lines.append(f"| {task} | {row['learning_rate']:g} | {row['score']:.4f} | {row['final_test_acc']:.4f} "
                         f"| {mark} |")
    return "\n".join(lines)


def curve_table(task: str, s: dict[str, Any]) -> str:
    methods = [m for m in METHODS if m in s["methods"]]
    digits = 5 if "optimum" in s else 4
    head = "| epoch | " + " | ".join(f"{LABELS[m]} full-train loss" for m in methods) + " | CD-GraB < D-RR |"
    lines = [head, "|" + "---|" * (len(methods) + 2)]
    curves = {m: s["methods"][m]["curve"] for m in methods}
    for i, point in enumerate(curves["drr"]):
        if point["epoch"] < 0:
            continue
        cells = [pm(curves[m][i]["train_loss"], digits) for m in methods]
        below = ("yes" if curves["cdgrab"][i]["train_loss"]["mean"] < point["train_loss"]["mean"] else "no") \
            if "cdgrab" in curves else ""
        lines.append(f"| {point['epoch']} | " + " | ".join(cells) + f" | {below} |")
    return "\n".join(lines)


def method_table(s: dict[str, Any]) -> str:
    digits = 5 if "optimum" in s else 4
    lines = ["| method | final full-train loss | final test loss | final test acc | epoch s | vs D-RR | "
             "step ms (+ vs D-RR) | callback ms/step: hook (grad / gather [wait] / balance) | hook share of epoch | "
             "KB sent/epoch/rank (mean over ranks) | "
             "peak RSS MiB, 1 fit / 3 fits |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = s["methods"]["drr"]["epoch_s"]["mean"]
    for method in METHODS:
        if method not in s["methods"]:
            continue
        r = s["methods"][method]
        cb = _callback_parts(r["callback_ms_per_step"], method)
        share = f"{100 * r['callback_share_of_epoch']:.0f} %" if method != "drr" else "-"
        step = f"{r['step_ms']:.1f}" + (f" (+{r['extra_ms_per_step_vs_drr']:.1f})" if method != "drr" else "")
        lines.append(
            f"| {LABELS[method]} | {pm(r['final']['train_loss'], digits)} | {pm(r['final']['test_loss'], digits)} | "
            f"{pm(r['final']['test_acc'])} | {pm(r['epoch_s'], 2)} | {r['epoch_s']['mean'] / base:.2f}x | {step} | "
            f"{cb} | {share} | "
            f"{r['bytes_sent_per_epoch_per_rank'] / 1e3:.1f} | {r['peak_rss_mib']['first_fit_max']:.1f} / "
            f"{r['peak_rss_mib']['launch_max']:.1f} |"
        )
    return "\n".join(lines)


def _callback_parts(parts: dict[str, float], method: str) -> str:
    """``hook (grad / gather [wait] / balance)`` in ms per step; D-RR has no callback."""
    if method == "drr":
        return "-"
    return (f"{parts['cdgrab_s']:.2f} ({parts['grad_s']:.2f} / {parts['gather_s']:.2f} "
            f"[{parts.get('gather_wait_s', 0.0):.2f}] / {parts['balance_s']:.2f})")


def overhead_table(overhead: dict[str, Any]) -> str:
    lines = ["| task | ranks | method | epoch s (median) | vs D-RR | step ms | "
             "callback ms/step: hook (grad / gather [wait] / balance) |",
             "|---|---|---|---|---|---|---|"]
    for task, s in overhead.items():
        for method in METHODS:
            if method not in s["methods"]:
                continue
            r = s["methods"][method]
            cb = _callback_parts(r["callback_ms_per_step"], method)
            lines.append(f"| {task} | {s['world_size']} | {LABELS[method]} | {r['epoch_s']:.3f} | {r['ratio']:.2f}x | "
                         f"{r['step_ms']:.2f} | {cb} |")
    return "\n".join(lines)


def report_text(report: dict[str, Any]) -> str:
    parts = []
    if report.get("sweep_summary"):
        parts += ["### Learning-rate sweep (D-RR, seed 0)", "", sweep_table(report["sweep_summary"]), ""]
    for task, s in report.get("summary", {}).items():
        seeds = s["methods"]["drr"]["seeds"]
        parts += [f"### {task}: {s['title']}",
                  "",
                  f"{s['world_size']} ranks, lr {s['learning_rate']:g}, momentum {s['momentum']:g}, batch "
                  f"{s['batch_size_per_rank']}/rank, {s['num_parameters']} parameters, {s['train_examples']} train "
                  f"examples ({s['examples_per_rank']}/rank, {s['dropped']} dropped), "
                  f"{s['steps_per_epoch']} steps/epoch, "
                  f"seeds {seeds}; mean ± std over seeds.",
                  "",
                  curve_table(task, s),
                  *([f"", f"Minimum of the full-train loss (scikit-learn, no regularization): "
                     f"{s['optimum']['train_loss']:.5f} (train acc {s['optimum']['train_acc']:.4f}, test loss "
                     f"{s['optimum']['test_loss']:.5f}, test acc {s['optimum']['test_acc']:.4f})."]
                    if "optimum" in s else []),
                  "",
                  method_table(s),
                  ""]
        if "cdgrab_below_drr_epochs" in s:
            parts.append(
                f"CD-GraB below D-RR (mean) at epochs {s['cdgrab_below_drr_epochs']}; per seed "
                f"{s['cdgrab_below_drr_epochs_per_seed']}. Loss target ({s['loss_target']}): "
                f"{'met' if s['loss_target_met'] else 'NOT met'}. To D-RR's final loss: "
                + ", ".join(f"{LABELS[m]} {s['methods'][m]['to_drr_final_loss']['epochs']} epochs / "
                            f"{s['methods'][m]['to_drr_final_loss']['train_s'] or math.nan:.1f} s"
                            for m in METHODS if m in s["methods"])
                + f". Epoch time CD-GraB/D-RR {s['time_ratio_cdgrab']:.2f}x "
                f"(target <= {TIME_RATIO_TARGET}x: {'met' if s['time_target_met'] else 'NOT met'}), ID-GraB/D-RR "
                f"{s.get('time_ratio_idgrab', math.nan):.2f}x. Peak RSS (max over ranks) CD-GraB - D-RR: "
                f"{s['rss_overhead_mib_cdgrab']:+.1f} MiB after one fit, "
                f"{s['rss_overhead_mib_cdgrab_launch']:+.1f} MiB after "
                f"the launch's {len(seeds)} fits (ID-GraB {s.get('rss_overhead_mib_idgrab', math.nan):+.1f} / "
                f"{s.get('rss_overhead_mib_idgrab_launch', math.nan):+.1f} MiB); "
                "rank 0 RSS after the first / last epoch: "
                + ", ".join(f"{LABELS[m]} {s['methods'][m]['rank0_rss_mib_first_last_epoch'][0]:.1f} / "
                            f"{s['methods'][m]['rank0_rss_mib_first_last_epoch'][1]:.1f} MiB"
                            for m in METHODS if m in s["methods"])
                + "; callback buffers (measured): "
                + ", ".join(f"{k} {v / 1024:.1f} KiB" for k, v in s["methods"]["cdgrab"]["buffers_bytes"].items()))
            parts.append("")
    if report.get("overhead_summary"):
        parts += ["### Per-step cost without oversubscription", "", overhead_table(report["overhead_summary"]), ""]
    return "\n".join(parts)


# ---------------------------------------------------------------- plot


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = report.get("summary", {})
    tasks = list(summary)
    if not tasks:
        return
    fig, axes = plt.subplots(len(tasks), 3, figsize=(15, 4.2 * len(tasks)), squeeze=False)
    for row, task in zip(axes, tasks):
        s = summary[task]
        offset = s.get("optimum", {}).get("train_loss")  # logreg: plot the excess over the minimum, log scale
        lows, highs = [], []
        for method in METHODS:
            if method not in s["methods"]:
                continue
            curve = s["methods"][method]["curve"]  # from the initial model (epoch -1: 0 epochs, 0 s)
            epochs = [p["epoch"] + 1 for p in curve]  # epochs completed
            seconds = [p["train_s"]["mean"] for p in curve]
            panels = ((row[0], epochs, "train_loss"), (row[1], seconds, "train_loss"), (row[2], epochs, "test_acc"))
            for ax, xs, key in panels:
                shift = offset if (offset is not None and key == "train_loss") else 0.0
                mean = [p[key]["mean"] - shift for p in curve]
                std = [p[key]["std"] for p in curve]
                ax.plot(xs, mean, color=COLORS[method], marker=".", label=LABELS[method])
                ax.fill_between(xs, [a - b for a, b in zip(mean, std)], [a + b for a, b in zip(mean, std)],
                                color=COLORS[method], alpha=0.2)
            tail = [p["train_loss"]["mean"] for p in curve if p["epoch"] >= 1] or [curve[-1]["train_loss"]["mean"]]
            lows.append(min(tail))
            highs.append(max(tail))
        for ax in row[:2]:
            if offset is not None:
                ax.set_yscale("log")
                ax.set_ylabel(f"full-train loss - minimum ({offset:.5f})")
            else:
                pad = 0.1 * (max(highs) - min(lows) or 1e-3)
                ax.set_ylim(min(lows) - pad, max(highs) + pad)  # epoch 1 on; the first epoch's drop flattens the rest
                ax.set_ylabel("full-train loss")
        row[0].set_xlabel("epochs completed")
        row[1].set_xlabel("training seconds (mean over seeds; evaluation excluded)")
        row[2].set_xlabel("epochs completed")
        row[2].set_ylabel("test accuracy")
        seeds = len(s["methods"]["drr"]["seeds"])
        row[0].set_title(f"{task}: {s['title']}\n{s['world_size']} ranks, lr {s['learning_rate']:g}, "
                         f"mean ± std over {seeds} seeds", fontsize=9)
        for ax in row:
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- main


def logreg_optimum(data: dict[str, Any]) -> dict[str, float]:
    """The minimum of the logistic-regression full-train loss (scikit-learn, no regularization), for excess losses."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import log_loss

    from _cdgrab_worker import load_arrays

    x, y, x_test, y_test = load_arrays("logreg", data)
    model = LogisticRegression(C=math.inf, max_iter=10000, tol=1e-10).fit(x, y)
    return {"train_loss": float(log_loss(y, model.predict_proba(x))), "train_acc": float(model.score(x, y)),
            "test_loss": float(log_loss(y_test, model.predict_proba(x_test))),
            "test_acc": float(model.score(x_test, y_test))}


def finish(report: dict[str, Any], out: Path, json_name: str, png_name: str) -> None:
    runs = [r for launch_result in report.get("compare", {}).get("launches", []) for r in launch_result["runs"]]
    report["summary"] = summarize_compare(runs) if runs else {}
    if "logreg" in report["summary"]:
        data = next(r["data"] for r in runs if r["task"] == "logreg")
        reference = report.setdefault("reference", {})
        if reference.get("logreg_data") != data:
            reference.update(logreg_data=data, logreg_optimum=logreg_optimum(data))
        report["summary"]["logreg"]["optimum"] = reference["logreg_optimum"]
    sweep_runs = [r for launch_result in report.get("sweep", {}).get("launches", []) for r in launch_result["runs"]]
    report["sweep_summary"] = summarize_sweep(sweep_runs) if sweep_runs else {}
    overhead_runs = [r for launch_result in report.get("overhead", {}).get("launches", [])
                     for r in launch_result["runs"]]
    report["overhead_summary"] = summarize_overhead(overhead_runs) if overhead_runs else {}
    (out / json_name).write_text(json.dumps(report, indent=1))
    plot(report, out / png_name)
    print()
    print(report_text(report))


def merge_section(previous: dict[str, Any] | None, launches: list[dict[str, Any]], wall_s: float,
                  command: str) -> dict[str, Any]:
    """The section's new launches, plus earlier launches of other names (tasks not rerun) from the JSON."""
    names = {launch_result["name"] for launch_result in launches}
    kept = [old for old in (previous or {}).get("launches", []) if old["name"] not in names]
    history = (previous or {}).get("history", [])
    if previous and "wall_s" in previous:
        history = history + [{"command": previous.get("command"), "wall_s": previous["wall_s"]}]
    return {"launches": kept + launches, "wall_s": wall_s, "command": command, "history": history}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4, help="processes per run (default 4)")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=None, help="epochs of every comparison run (default per task)")
    parser.add_argument("--sweep-epochs", type=int, default=None,
                        help="epochs of the sweep runs (default: the comparison's, per task)")
    parser.add_argument("--lr", nargs="+", default=[], metavar="TASK=LR",
                        help="learning rate per task for compare, overriding the sweep (e.g. mlp=0.03)")
    parser.add_argument("--sections", nargs="+", default=["sweep", "compare", "overhead"],
                        choices=["sweep", "compare", "overhead"])
    parser.add_argument("--out", type=Path, default=None, help="output folder (default benchmarks/results)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: both tasks, small data, 2 epochs, seed 0, one launch; writes under runs/quick")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds allowed per launch")
    parser.add_argument("--replot", action="store_true", help="recompute summary, tables and figure from the JSON")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = RESULTS / ("runs/quick" if args.quick else "")
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "cdgrab.json"
    if args.replot:
        finish(json.loads(json_path.read_text()), args.out, "cdgrab.json", "cdgrab.png")
        return 0

    started = time.perf_counter()
    command = "python " + " ".join([str(Path(sys.argv[0]))] + (argv if argv is not None else sys.argv[1:]))
    environment: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine()}
    try:
        import lightning
        import torch

        environment.update(torch=torch.__version__, lightning=lightning.__version__)
    except ImportError:
        pass
    report: dict[str, Any] = {}
    if json_path.exists() and not args.quick:
        report = json.loads(json_path.read_text())  # sections not rerun keep their results
    failed = False

    if args.quick:
        runs = [run_spec(task, method, 0, TASKS[task]["learning_rate"], args.epochs or 2, QUICK_DATA[task])
                for task in args.tasks for method in METHODS]
        print(f"quick: {len(runs)} fits in one launch, {args.ranks} ranks")
        result = run_launch("quick", runs, args.ranks, args)
        report = {"config": {"quick": True, "ranks": args.ranks, "command": command, **environment},
                  "compare": {"launches": [result]}}
        failed = "error" in result
        finish(report, args.out, "cdgrab.json", "cdgrab.png")
        print(f"\ntotal wall time {time.perf_counter() - started:.0f} s; results in {args.out}")
        return 1 if failed else 0

    overrides = {key: float(value) for key, value in (item.split("=", 1) for item in args.lr)}
    if "sweep" in args.sections:
        print(f"sweep: D-RR, seed 0, {args.ranks} ranks")
        t0 = time.perf_counter()
        launches = []
        for task in args.tasks:
            epochs = args.sweep_epochs or args.epochs or TASKS[task]["epochs"]
            runs = [run_spec(task, "drr", 0, lr, epochs, TASKS[task]["data"]) for lr in TASKS[task]["grid"]]
            launches.append(run_launch(f"sweep_{task}", runs, args.ranks, args))
        failed |= any("error" in r for r in launches)
        report["sweep"] = merge_section(report.get("sweep"), launches, time.perf_counter() - t0, command)
        report["sweep_summary"] = summarize_sweep([r for result in report["sweep"]["launches"] for r in result["runs"]])
        print(sweep_table(report["sweep_summary"]))
    selected = {task: s["selected"] for task, s in report.get("sweep_summary", {}).items() if s.get("selected")}
    rates = {task: overrides.get(task, selected.get(task, TASKS[task]["learning_rate"])) for task in TASKS}

    if "compare" in args.sections:
        print(f"compare: {METHODS} x seeds {args.seeds}, {args.ranks} ranks, learning rates {rates}")
        t0 = time.perf_counter()
        launches = []
        for task in args.tasks:
            epochs = args.epochs or TASKS[task]["epochs"]
            for method in METHODS:
                runs = [run_spec(task, method, seed, rates[task], epochs, TASKS[task]["data"]) for seed in args.seeds]
                launches.append(run_launch(f"{task}_{method}", runs, args.ranks, args))
        failed |= any("error" in r for r in launches)
        report["compare"] = merge_section(report.get("compare"), launches, time.perf_counter() - t0, command)
        report["compare"]["learning_rates"] = {**report["compare"].get("learning_rates", {}),
                                               **{task: rates[task] for task in args.tasks}}

    if "overhead" in args.sections:
        print(f"overhead: {METHODS} on {OVERHEAD_RANKS} ranks, {OVERHEAD_EPOCHS} epochs, seed 0")
        t0 = time.perf_counter()
        launches = []
        for task in args.tasks:
            runs = [run_spec(task, method, 0, rates[task], OVERHEAD_EPOCHS, TASKS[task]["data"]) for method in METHODS]
            launches.append(run_launch(f"overhead_{task}", runs, OVERHEAD_RANKS, args))
        failed |= any("error" in r for r in launches)
        report["overhead"] = merge_section(report.get("overhead"), launches, time.perf_counter() - t0, command)

    previous_tasks = report.get("config", {}).get("tasks", {})
    report["config"] = {**report.get("config", {}), "ranks": args.ranks,
                        "tasks": {**previous_tasks, **{t: TASKS[t] for t in args.tasks}},
                        "methods": METHODS, "seeds": args.seeds, "last_command": command, **environment,
                        "last_wall_s": time.perf_counter() - started}
    finish(report, args.out, "cdgrab.json", "cdgrab.png")
    print(f"\ntotal wall time {time.perf_counter() - started:.0f} s; results in {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
