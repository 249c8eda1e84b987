"""CD-GraB's results tables, rendered into ``docs/results/cdgrab.md`` (:mod:`benchmarks.common.tables`): the
model-free herding bounds from ``benchmarks/results/herding_bound.json`` and the training comparison from
``benchmarks/results/cdgrab.json``."""

from __future__ import annotations

from benchmarks.cdgrab.summary import LABELS, METHODS, pm
from benchmarks.common.tables import result



def herding_table() -> str:
    """Parallel herding bound (inf norm) after the last round per rank count, mean ± sd over seeds, and the ratios."""
    report = result("herding_bound")
    config, results = report["config"], report["results"]
    methods = config["methods"]
    lines = [f"| ranks m | vectors per rank | {' | '.join(methods)} | D-RR / CD-GraB | ID-GraB / CD-GraB |",
             "|" + "---:|" * (len(methods) + 4)]
    for ranks in config["ranks"]:
        cells = {method: results[method][str(ranks)]["inf"] for method in methods}
        final = {method: {"mean": cell["mean"][-1], "std": cell["std"][-1]} for method, cell in cells.items()}
        lines.append(f"| {ranks} | {config['vectors'] // ranks:,} | "
                     + " | ".join(pm(final[method], 2) for method in methods)
                     + f" | {final['D-RR']['mean'] / final['CD-GraB']['mean']:.1f}"
                     f" | {final['ID-GraB']['mean'] / final['CD-GraB']['mean']:.2f} |")
    return "\n".join(lines)


def training_table() -> str:
    """Per task and method: final full-train loss and test accuracy (mean ± sd over seeds), epoch time, the callback's
    cost per step and the bytes it sent."""
    summary = result("cdgrab")["summary"]
    lines = ["| task | method | final full-train loss | test acc | epoch s | vs D-RR "
             "| callback ms/step (grad / gather / balance) | KB sent/epoch/rank |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for task, s in summary.items():
        digits = 5 if "optimum" in s else 4
        base = s["methods"]["drr"]["epoch_s"]["mean"]
        for method in (m for m in METHODS if m in s["methods"]):
            r = s["methods"][method]
            ms = r["callback_ms_per_step"]
            callback = ("-" if method == "drr" else
                        f"{ms['cdgrab_s']:.2f} ({ms['grad_s']:.2f} / {ms['gather_s']:.2f} / {ms['balance_s']:.2f})")
            lines.append(f"| {task} | {LABELS[method]} | {pm(r['final']['train_loss'], digits)} "
                         f"| {pm(r['final']['test_acc'], 3)} | {r['epoch_s']['mean']:.2f} "
                         f"| {r['epoch_s']['mean'] / base:.2f}x | {callback} "
                         f"| {r['bytes_sent_per_epoch_per_rank'] / 1e3:,.0f} |")
    return "\n".join(lines)
