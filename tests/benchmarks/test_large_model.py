"""The large-model study's own logic (benchmarks/large_model), fast: the peak-memory measure on known allocations, the
count of a strategy's tensors, which rows are missing, the figures and the table. No training runs here."""

import json
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from benchmarks.common.launch import worker_env
from benchmarks.common.paths import REPO
from benchmarks.large_model import run
from benchmarks.large_model.memory import MALLOC_ENV, PeakRSS, state_nbytes, status_bytes
from lightning_dist.algorithms.outer import OuterStep, diloco_outer_optimizer
from lightning_dist.strategies._compressed_average import CompressedAverage

MIB = 2**20

# Run in a fresh process (glibc reads the threshold at start-up), in tensors of 4 MiB, below glibc's adaptive mmap
# threshold's 32 MiB ceiling, as most of a model's are: a 256 MiB peak, forgotten by a reset; then 64 MiB written and
# freed, and 64 MiB never written.
PROBE = textwrap.dedent("""
    import json, torch
    from benchmarks.large_model.memory import PeakRSS
    meter = PeakRSS()
    def tensors(mib, make=torch.ones):
        return [make(2**20) for _ in range(mib // 4)]
    big = tensors(256); del big                     # before the window
    start = meter.reset()
    written = tensors(64)                           # every page written
    after_alloc = meter.current()
    del written
    after_free = meter.current()
    untouched = tensors(64, torch.empty)            # never written: no memory
    print(json.dumps({"start": start, "after_alloc": after_alloc, "after_free": after_free,
                      "after_empty": meter.current(), "peak": meter.peak()}))
""")


def probe(env: dict[str, str]) -> dict[str, int]:
    output = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert output.returncode == 0, output.stderr
    return json.loads(output.stdout.strip().splitlines()[-1])


def test_peak_memory_measures_a_known_allocation_within_a_mebibyte():
    figures = probe({**worker_env(), **MALLOC_ENV})
    start = figures["start"]
    assert abs(figures["peak"] - start - 64 * MIB) < 1 * MIB            # the window's peak: the 64 MiB, not the 256
    assert abs(figures["after_alloc"] - start - 64 * MIB) < 1 * MIB
    assert abs(figures["after_free"] - start) < 1 * MIB                 # freed memory leaves the resident set
    assert abs(figures["after_empty"] - start) < 1 * MIB                # unwritten pages hold nothing


def test_peak_memory_refuses_a_process_started_without_the_fixed_threshold(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    with pytest.raises(RuntimeError, match="MALLOC_MMAP_THRESHOLD_"):
        PeakRSS()
    with pytest.raises(RuntimeError, match="reset"):
        PeakRSS(require_fixed_threshold=False).peak()


def test_status_fields_are_read_in_bytes():
    status = "Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n"
    assert status_bytes("VmHWM", status) == 2048 * 1024
    assert status_bytes("VmRSS", status) == 1024 * 1024
    with pytest.raises(RuntimeError, match="VmSwap"):
        status_bytes("VmSwap", status)


class FakeStrategy:
    """What state_nbytes walks: a reference model, DiLoCo's outer step, compression's state, the model's own
    tensors (not counted) and the training optimizer (not counted)."""


def test_strategy_state_counts_each_storage_once_and_leaves_the_model_out():
    torch.manual_seed(0)
    model = nn.Linear(100, 10)  # 1010 parameters
    numel = sum(p.numel() for p in model.parameters())
    model(torch.randn(3, 100)).sum().backward()
    training = torch.optim.AdamW(model.parameters())
    training.step()
    vector = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    strategy = FakeStrategy()
    strategy.model, strategy.optimizers = model, [training]                    # the model's training: left out
    strategy.parameters = list(model.parameters())
    strategy.reference = vector.clone()                                         # 1 copy
    strategy.same_reference = [strategy.reference[:10], {"view": strategy.reference[5:]}]  # views: not again
    outer = OuterStep(vector, diloco_outer_optimizer)                           # reference + momentum after a step
    outer.step(vector - 0.1)
    compressed = CompressedAverage("int8")
    compressed.hold(vector)                                                     # 1 copy; residuals not yet made
    strategy.outer, strategy.compressed = outer, compressed
    state = state_nbytes(strategy, model, [training])
    # The outer step's norms and their running squares: 2 pairs of float32 scalars; SGD's momentum buffer and the reference:
    # 2 copies.
    scalars = 2 * 2 * 4
    assert state == {"cpu": 4 * numel * (1 + 2 + 1) + scalars}
    strategy.extra = torch.zeros(numel)
    assert state_nbytes(strategy, model, [training]) == {"cpu": 4 * numel * 5 + scalars}


def test_rows_whose_arguments_do_not_exist_are_missing():
    rows = {row.name: row for row in run.ROWS}
    old = ["self", "period", "client_fraction", "seed", "outer_optimizer", "kwargs"]
    assert run.missing_arguments(rows["periodic"], old) == []
    assert run.missing_arguments(rows["streaming_diloco_cpu"], old) == ["fragments", "fragment_sync_delay",
                                                                        "state_device"]
    assert run.missing_arguments(rows["diloco_cpu"], old + ["state_device"]) == []
    # Every row that passes an argument PeriodicAveragingStrategy did not always take says so.
    for row in run.ROWS:
        for name in ("fragments", "fragment_sync_delay", "fragment_update_alpha", "state_device"):
            if name in row.strategy.get("kwargs", {}):
                assert name in row.needs, row.name


def record(rank, peak_mib, model_mib=100, state_mib=0, protocol=(), paired=(), synced=(), allreduce=(1.0,)):
    return {"rank": rank, "model_bytes": model_mib * MIB, "peak_rss": peak_mib * MIB, "rss_window_start": 0,
            "state_bytes": {"cpu": state_mib * MIB}, "allreduce_s": list(allreduce), "step_s": [2.0, 4.0, 3.0],
            "protocol": list(protocol), "paired_sync_s": list(paired), "paired_synced": list(synced)}


def test_summary_against_ddp_and_per_full_synchronization():
    ddp = {"name": "ddp", "ranks": [record(0, 1000), record(1, 1010)]}
    training = [{"step": s, "seconds": 0.5, "synced": int(s % 2 == 0), "phase": "training"} for s in range(1, 9)]
    paired = [{"step": 9, "seconds": 99.0, "synced": 1, "phase": "paired"}]  # phase 2 is not training's
    streaming = {"name": "streaming", "strategy": {"kwargs": {"fragments": 4}},
                 "ranks": [record(0, 1250, state_mib=200, protocol=training + paired, paired=[3.0, 2.0, 9.0],
                                  synced=[4, 4, 4], allreduce=[1.0, 1.0, 1.5])]}
    summary = run.summarize(streaming, ddp)["ranks"][0]
    assert summary["vs_ddp_mib"] == 250 and summary["vs_ddp_copies"] == 2.5
    assert summary["state_copies"] == 2.0
    assert summary["train_syncs"] == 1 and summary["train_sync_s"] == 4.0  # 8 steps' protocol, 4 fragments merged
    assert summary["sync_s"] == 3.0 and summary["sync_vs_allreduce"] == 3.0  # medians of 3, 2, 9 and 3, 2, 6
    assert summary["step_s"] == 3.0
    broken = {**streaming, "ranks": [record(0, 1250, paired=[3.0], synced=[2])]}
    with pytest.raises(ValueError, match="2 fragment"):  # half a synchronization timed as a whole one
        run.summarize(broken, ddp)


def test_table_says_which_rows_are_missing_or_failed():
    ddp = {"name": "ddp", "label": "DDP", "ranks": [record(0, 1000), record(1, 1000)]}
    ddp["summary"] = run.summarize(ddp, ddp)
    report = {"rows": [ddp, {"name": "streaming", "label": "streaming", "status": "missing", "reason": "no fragments"},
                       {"name": "dynamic", "label": "dynamic", "error": "RuntimeError: boom"}]}
    table = run.render_table(report)
    lines = table.splitlines()
    assert len(lines) == 5 and all(line.count("|") == 10 for line in lines)
    assert "missing: no fragments" in lines[3] and "failed: RuntimeError: boom" in lines[4]
    assert "1000 / 1000" in lines[2]


def test_memory_check_before_running():
    assert run.available_bytes("MemTotal: 100 kB\nMemAvailable:  2048 kB\n") == 2048 * 1024
    assert run.memory_needed(426 * MIB, 2) == 2 * (4260 + 600) * MIB


def test_round_steps_of_the_worker():
    from benchmarks.large_model.worker import round_steps

    assert round_steps(SimpleNamespace(period=8)) == 8
    assert round_steps(SimpleNamespace(check_every=4)) == 4
