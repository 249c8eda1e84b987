"""A lock-step run re-timed under NCCL's model from its Gloo-ring run equals the run under NCCL's model; what cannot be
re-timed is refused."""

import math

import pytest

from benchmarks.language_model.retime import retimed
from benchmarks.language_model.simulated import simulate

CONFIG = {"model": {"block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 16, "learning_rate": 0.002,
                    "warmup_steps": 2},
          "data": {"block_size": 16, "batch_size": 4, "partition": "contiguous", "max_val_sequences": 8}}
DDP = {"name": "ddp", "kind": "ddp"}
POWERSGD = {"name": "ddp_powersgd_r2", "kind": "ddp", "hook": {"name": "powersgd", "matrix_approximation_rank": 2}}


def run(method, collectives, steps=12, eval_every=4):
    """8 machines at 1000 Mbit/s, where the latencies set an all-reduce's time and NCCL's tree beats the ring."""
    return simulate(CONFIG, method, 8, 1000.0, 1000.0, 0.1, None, steps, None, 1, None, 1, collectives,
                    eval_every=eval_every)


def rerun_of(method):
    return lambda steps, collectives: run(method, collectives, steps, eval_every=1)


@pytest.mark.parametrize("method", [DDP, POWERSGD], ids=lambda method: method["name"])
def test_a_run_retimed_under_nccl_equals_the_run_under_nccl(method):
    gloo, nccl = run(method, "gloo_ring"), run(method, "nccl")
    assert gloo["rows"][-1]["time"] != pytest.approx(nccl["rows"][-1]["time"])  # the models differ on this layout
    recorded = {**gloo, "steps_to_target": 8.0}
    again = retimed(recorded, method, "nccl", rerun_of(method))
    assert [row["mean_steps"] for row in again["rows"]] == [row["mean_steps"] for row in nccl["rows"]]
    for mine, theirs in zip(again["rows"], nccl["rows"]):
        assert math.isclose(mine["time"], theirs["time"], rel_tol=1e-9)
        assert (mine["val_loss"], mine["bytes"]) == (theirs["val_loss"], theirs["bytes"])
    assert again["time_to_target_s"] == next(row["time"] for row in again["rows"] if row["mean_steps"] == 8.0)
    assert again["collectives"] == "nccl" and again["retimed"]["from_collectives"] == "gloo_ring"
    assert again["retimed"]["checked_steps"] == 4


def test_what_cannot_be_retimed_is_refused_by_name():
    dynamic = {"name": "dynamic_default_node", "kind": "dynamic"}
    with pytest.raises(ValueError, match="dynamic_default_node .dynamic. cannot be re-timed"):
        retimed({}, dynamic, "nccl", rerun_of(DDP))
    gloo = run(DDP, "gloo_ring")
    changed = {**gloo, "steps_to_target": None,
               "rows": [gloo["rows"][0], {**gloo["rows"][1], "val_loss": gloo["rows"][1]["val_loss"] + 1e-6},
                        *gloo["rows"][2:]]}
    with pytest.raises(ValueError, match="after 4 steps the re-run's loss and bytes .* not the same trajectory"):
        retimed(changed, DDP, "nccl", rerun_of(DDP))
    uneven = {**gloo, "rows": [*gloo["rows"][:-1], {**gloo["rows"][-1], "time": gloo["rows"][-1]["time"] + 0.5}]}
    with pytest.raises(ValueError, match="not lock-step"):
        retimed(uneven, DDP, "nccl", rerun_of(DDP))
    other = {**gloo, "numerics": {**gloo["numerics"], "threads": 2}}
    with pytest.raises(ValueError, match="give --threads and --native-kernels as the recorded run had them"):
        retimed(other, DDP, "nccl", rerun_of(DDP))


def test_a_run_recorded_on_another_cpu_is_retimed_within_a_stated_loss_tolerance():
    """A recorded run whose kernels differ (here its numerics name another CPU capability than this machine's and
    its losses moved in the last digits) is refused bit for bit, re-timed within a tolerance that covers the
    difference, refused within one that does not, and refused whatever the tolerance if its bytes differ."""
    gloo, nccl = run(DDP, "gloo_ring"), run(DDP, "nccl")
    other = "AVX2" if gloo["numerics"]["aten_cpu_capability"] == "AVX512" else "AVX512"  # not this machine's
    other_cpu = {**gloo, "numerics": {**gloo["numerics"], "aten_cpu_capability": other},
                 "rows": [{**row, "val_loss": row["val_loss"] * (1 + 3e-6)} for row in gloo["rows"]],
                 "steps_to_target": 8.0}
    with pytest.raises(ValueError, match="or a loss tolerance .--retime-loss-tolerance. for a run recorded on another"):
        retimed(other_cpu, DDP, "nccl", rerun_of(DDP))
    again = retimed(other_cpu, DDP, "nccl", rerun_of(DDP), loss_tolerance=1e-4)
    for mine, theirs, recorded in zip(again["rows"], nccl["rows"], other_cpu["rows"]):
        assert math.isclose(mine["time"], theirs["time"], rel_tol=1e-9)  # the time axis of a run under NCCL
        assert (mine["val_loss"], mine["bytes"]) == (recorded["val_loss"], recorded["bytes"])  # the recorded run's
    assert again["retimed"]["loss_tolerance"] == 1e-4 and again["retimed"]["numerics"] == gloo["numerics"]
    assert again["retimed"]["largest_loss_difference"] == pytest.approx(3e-6, rel=1e-3)
    with pytest.raises(ValueError, match="not the recorded .* within a relative 1e-06"):
        retimed(other_cpu, DDP, "nccl", rerun_of(DDP), loss_tolerance=1e-6)
    first, checked, *later = other_cpu["rows"]
    more_bytes = {**other_cpu, "rows": [first, {**checked, "bytes": checked["bytes"] + 1}, *later]}
    with pytest.raises(ValueError, match="not the same trajectory"):
        retimed(more_bytes, DDP, "nccl", rerun_of(DDP), loss_tolerance=0.5)
    with pytest.raises(ValueError, match=r"loss_tolerance must be in \[0, 1\)"):
        retimed(other_cpu, DDP, "nccl", rerun_of(DDP), loss_tolerance=1.0)


@pytest.mark.parametrize(("arguments", "message"), [
    (["--retime", "x.json", "--retime-loss-tolerance", "-0.1"],
     r"--retime-loss-tolerance: loss_tolerance must be in \[0, 1\)"),
    (["--retime-loss-tolerance", "0.001"], "--retime-loss-tolerance applies to --retime only"),
])
def test_a_bad_retime_loss_tolerance_is_refused_before_anything_runs(arguments, message):
    from benchmarks.language_model.simulated import check_retime_arguments, parts_parser

    args = parts_parser("test", "lm_hierarchy", []).parse_args(arguments)
    with pytest.raises(SystemExit, match=message):
        check_retime_arguments(args)
