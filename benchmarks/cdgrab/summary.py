"""Paper 003's benchmark, scored: the methods and tasks, the statistics of the runs (the sweep's choice, CD-GraB against
D-RR per epoch and in time, the callback's overhead) and their tables; ``run.py`` launches the runs and draws the
figure."""

from __future__ import annotations

import math
import statistics
from typing import Any

METHODS = ["drr", "cdgrab", "idgrab"]
LABELS = {"drr": "D-RR", "cdgrab": "CD-GraB", "idgrab": "ID-GraB"}

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
SWEEP_LAST = 3  # the sweep scores a rate by the mean full-train loss of its last epochs
FIRST_FEW = 3  # the target: CD-GraB below D-RR at every epoch from this one on (0-based)
TIME_RATIO_TARGET = 1.3


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
