"""A seeded simulation replays bit for bit: whatever thread count its caller set and, with its kernels pinned,
whatever kernels the CPU would have picked (issue 26: ``make demo`` printed 175 steps to the target on one
machine, 150 on another). Across CPU models the demo's figures are documented with their measured spread instead
(issue 42): the README shows what the demo prints.

The workload is the demo's scaled down (a one-layer TransformerLM on the stdlib text, DDP, modelled compute);
at this size both the thread count and each of MKL's, ATen's and oneDNN's code paths change its last bits.
"""

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_dist.data import StdlibTextDataModule
from lightning_dist.models import TransformerLM
from lightning_dist.sim import NetworkModel, Simulation, SpeedModel, make_protocol
from lightning_dist.sim.numerics import PINNED_KERNELS

from benchmarks.common.paths import load_example

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
# What a CPU without AVX would pick: ATen's plain kernels, oneDNN's SSE4.1 ones, MKL's SSE4.2 branch.
OLDER_CPU = {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_CBWR": "SSE4_2"}
CHILD = """
import json
import sys

from lightning_dist.sim.numerics import numerics, pin_cpu_kernels

pin_cpu_kernels()
sys.path.insert(0, {tests!r})
from sim.test_numerics import fingerprint, small_lm_simulation

print(json.dumps({{"run": fingerprint(small_lm_simulation()), "numerics": numerics()}}))
"""


def small_lm_simulation(max_steps: int = 10, eval_every: int = 5, **kwargs: Any) -> Simulation:
    torch.manual_seed(0)
    model = TransformerLM(block_size=16, n_layer=1, n_head=2, n_embd=32, learning_rate=0.002)
    return Simulation(
        model, StdlibTextDataModule(block_size=16, batch_size=4, max_val_sequences=16), make_protocol("ddp"),
        workers=2, max_steps=max_steps, network=NetworkModel(latency=0.001, node_mbit=20),
        speed=SpeedModel(step_seconds=0.1, aggregate_seconds=0.0), eval_every=eval_every, **kwargs,
    )


def fingerprint(simulation: Simulation) -> dict[str, Any]:
    """Everything a run prints or decides from, floats exact: rows, per-worker rows, totals and each worker's model."""
    result = simulation.run()
    return {
        "rows": result.rows,
        "worker_rows": result.worker_rows,
        "totals": [result.summary[key] for key in ("virtual_seconds", "steps", "bytes", "messages")],
        "models": [hashlib.sha256(replica.get().numpy().tobytes()).hexdigest() for replica in simulation.replicas],
    }


def test_a_run_is_the_same_whatever_thread_count_its_caller_set_and_gives_it_back():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = fingerprint(small_lm_simulation())
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)
        one = fingerprint(small_lm_simulation())
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert two == one


def test_the_summary_records_the_threads_and_kernels_of_the_run():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        numerics = small_lm_simulation(max_steps=1, eval_every=1).run().summary["numerics"]
    finally:
        torch.set_num_threads(before)
    assert numerics["threads"] == 1 and numerics["torch"] == torch.__version__
    assert numerics["aten_cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_threads_must_be_a_positive_count_or_none():
    with pytest.raises(ValueError, match="threads must be an integer >= 1"):
        small_lm_simulation(threads=0)
    assert small_lm_simulation(threads=None).threads is None


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="pin_cpu_kernels holds on x86-64 CPUs with AVX2")
def test_pinned_kernels_replay_a_run_bit_for_bit_whatever_kernels_the_cpu_would_pick():
    """Two processes, one with the kernels this CPU picks, one as a CPU without AVX would: the same run."""
    own = {name: value for name, value in os.environ.items() if name not in PINNED_KERNELS}
    children = [
        subprocess.Popen([sys.executable, "-c", CHILD.format(tests=str(TESTS))], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for env in (own, {**own, **OLDER_CPU})
    ]
    outputs = []
    for child in children:
        stdout, stderr = child.communicate(timeout=300)
        assert child.returncode == 0, stderr[-3000:]
        outputs.append(json.loads(stdout.strip().splitlines()[-1]))
    this_cpu, older_cpu = outputs
    assert this_cpu["run"] == older_cpu["run"]
    for output in outputs:
        assert output["numerics"]["aten_cpu_capability"] == "AVX2"
        assert output["numerics"]["mkl_cbwr"] == "COMPATIBLE" and output["numerics"]["onednn_max_cpu_isa"] == "AVX2"


def test_the_docs_show_the_demos_recorded_replay_and_how_far_another_cpu_moves_it():
    """getting-started's demo output is ``demo_replay.json``'s pinned run (the wall seconds aside) and the
    line the demo prints from that file's spread, which holds the Intel Xeon's reported figures (issue 42)."""
    demo = load_example("lm_demo")
    record = json.loads(demo.REPLAYS.read_text())
    pinned = next(variant for variant in record["variants"] if variant["name"] == "pinned")
    assert pinned["numerics"]["threads"] == 1 and pinned["numerics"]["mkl_cbwr"] == "COMPATIBLE"
    wall = re.compile(r"\(\d+ s wall\)")
    shown = [wall.sub("", line) for line in (REPO / "docs/getting-started.md").read_text().splitlines()]
    for line in pinned["lines"]:
        assert wall.sub("", line) in shown, line
    assert demo.elsewhere() in shown
    assert pinned["lines"][-1] in (REPO / "README.md").read_text().splitlines()  # the README quotes the ratio line
    for reported in record["reported"]:
        for figure, value in reported["figures"].items():
            assert record["spread"][figure]["min"] <= value <= record["spread"][figure]["max"]
