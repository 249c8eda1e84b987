"""Simulated LM runs split over sessions (``--out`` each, then ``--merge-from``) add up to one report; the LM studies
refuse method names they do not define."""

import argparse

import pytest

from benchmarks.common.report import chosen
from benchmarks.language_model.simulated import (agreement, check_method_names, measured_run_step_s,
                                                 merged_prediction, merged_scale)


def run(name, workers, seconds):
    return {"name": name, "workers": workers, "time_to_target_s": seconds}


def test_a_merged_run_replaces_its_cell_and_keeps_the_others_sorted_by_size():
    kept = [run("ddp", 256, 285.0), run("dynamic_default_node", 256, 20.4), run("dynamic_default_node", 1024, 20.7)]
    new = [run("ddp", 1024, 300.0), run("dynamic_default_node", 256, 19.0)]
    merged = merged_scale(kept, new)
    assert [(r["name"], r["workers"], r["time_to_target_s"]) for r in merged] == [
        ("ddp", 256, 285.0), ("dynamic_default_node", 256, 19.0), ("ddp", 1024, 300.0),
        ("dynamic_default_node", 1024, 20.7)]
    # A run under NCCL's model sits beside the same cell under Gloo's ring, and replaces its own kind.
    nccl = [{**run("ddp", 256, 200.0), "collectives": "nccl"}]
    both = merged_scale(merged, nccl)
    assert [(r["name"], r["workers"], r["time_to_target_s"]) for r in both[:3]] == [
        ("ddp", 256, 285.0), ("dynamic_default_node", 256, 19.0), ("ddp", 256, 200.0)]
    again = merged_scale(both, [{**run("ddp", 256, 190.0), "collectives": "nccl"}])
    assert [r["time_to_target_s"] for r in again if r["workers"] == 256] == [285.0, 19.0, 190.0]


def test_a_merged_prediction_replaces_its_cell_in_place_and_appends_new_ones():
    kept = [{"name": "ddp", "node_mbit": 20, "p": 1}, {"name": "periodic_h50", "node_mbit": 20, "p": 2}]
    new = [{"name": "periodic_h50", "node_mbit": 20, "p": 3}, {"name": "ddp", "node_mbit": 100, "p": 4}]
    assert [cell["p"] for cell in merged_prediction(kept, new)] == [1, 3, 4]
    assert merged_prediction(kept, []) == kept
    # A cell run on its own measured step (--own-step) sits beside the machine-step one, and replaces its own kind.
    own = [{"name": "periodic_h50", "node_mbit": 20, "step": "own", "p": 5}]
    assert [cell["p"] for cell in merged_prediction(kept, own)] == [1, 2, 5]
    again = [{"name": "periodic_h50", "node_mbit": 20, "step": "own", "p": 6}]
    assert [cell["p"] for cell in merged_prediction(merged_prediction(kept, own), again)] == [1, 2, 6]


def test_a_cells_own_step_is_the_median_of_its_runs_at_that_bandwidth_past_each_ranks_first_five():
    run = {"name": "a", "step_s_per_rank": [[9, 9, 9, 9, 9, 1.0, 3.0], [9, 9, 9, 9, 9, 2.0]]}
    measured = {"launches": [{"node_mbit": 20.0, "runs": [run, {**run, "name": "b"}]},
                             {"node_mbit": 20.0, "runs": [{**run, "step_s_per_rank": [[9] * 5 + [4.0]]}]},
                             {"node_mbit": 5.0, "runs": [{**run, "step_s_per_rank": [[9] * 5 + [100.0]]}]}]}
    assert measured_run_step_s(measured, "a", 20.0) == 2.5
    with pytest.raises(ValueError, match="c has no measured run at 20 Mbit/s"):
        measured_run_step_s(measured, "c", 20.0)


def test_a_method_the_measured_run_does_not_define_is_refused_by_option_before_any_run():
    measured = {"config": {"methods": [{"name": "ddp"}, {"name": "periodic_h50_node"}]}}
    args = argparse.Namespace(methods=None, scale_methods=["ddp", "periodic_h50_nodes"], measured="m.json")
    with pytest.raises(SystemExit, match="--scale-methods: periodic_h50_nodes not among the methods of m.json: ddp, "):
        check_method_names(args, measured)
    args = argparse.Namespace(methods=["dpp"], scale_methods=["ddp"], measured="m.json")
    with pytest.raises(SystemExit, match="--methods: dpp not among"):
        check_method_names(args, measured)
    check_method_names(argparse.Namespace(methods=["ddp"], scale_methods=["periodic_h50_node"], measured="m.json"),
                       measured)


def test_a_measured_study_refuses_a_method_it_does_not_define_and_keeps_the_order_of_its_own():
    runs = [{"name": "ddp"}, {"name": "dynamic_hi"}, {"name": "diloco"}]
    assert [run["name"] for run in chosen(runs, ["diloco", "ddp"])] == ["ddp", "diloco"]
    assert chosen(runs, None) == runs
    with pytest.raises(SystemExit, match="--methods: dynamic_high not among the methods of this study: ddp, dynamic_hi"):
        chosen(runs, ["dynamic_high"])


def test_agreement_counts_the_cells_on_their_own_step_apart_and_alone_without_a_label():
    def cell(ratio, step=None):
        return {"name": "a", "node_mbit": 20, "time_ratio": ratio, "measured": {"time_to_target_s": 1.0},
                "predicted": {"time_to_target_s": 1.0}, **({"step": step} if step else {})}

    mixed = agreement([cell(1.0), cell(1.3, "own"), cell(0.9, "own")])
    assert mixed.startswith("Machine step: 1 of 1 cells") and "Own step: 1 of 2 cells" in mixed
    assert agreement([cell(1.3, "own"), cell(1.1, "own")]).startswith("1 of 2 cells")
    assert agreement([cell(0.7), cell(1.0)]).startswith("1 of 2 cells")
