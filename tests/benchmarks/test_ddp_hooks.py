"""The DDP baselines of the benchmarks really compress on the CPU, where Lightning drops ``ddp_comm_hook``."""

import pytest

from helpers.launch import load_results, run_ranks

from benchmarks.language_model.ddp_hooks import ddp_with_hook

CASES = [
    {"name": "fp16", "hook": {"name": "fp16"}},
    {"name": "powersgd", "hook": {"name": "powersgd", "matrix_approximation_rank": 1}},
    {"name": "lightning_fp16"},
]


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_hooks")
    run_ranks(2, "ddp_hooks", {"cases": CASES}, out)
    return {case["name"]: [load_results(out, 2)[rank][index] for rank in range(2)] for index, case in enumerate(CASES)}


def test_hooks_run_on_the_cpu_and_lightnings_own_drops_them(fits):
    """fp16: every averaged gradient is an fp16 value (the all-reduce ran in 16 bits). PowerSGD: its state counted
    the 3 steps. Lightning's DDPStrategy with the same fp16 hook: float32 averages, the hook never ran (if a Lightning
    upgrade registers hooks on the CPU, this fails and the benchmarks' subclass can go)."""
    for rank in range(2):
        assert fits["fp16"][rank]["fp16_exact"] and fits["fp16"][rank]["nonzero"]
        assert fits["powersgd"][rank]["powersgd_iter"] == 3
        assert fits["powersgd"][rank]["nonzero"] and not fits["powersgd"][rank]["fp16_exact"]
        assert not fits["lightning_fp16"][rank]["fp16_exact"]


def test_unknown_hook_is_refused_by_name():
    with pytest.raises(ValueError, match="hook must be one of powersgd, fp16, bf16; got 'int4'"):
        ddp_with_hook("int4")
