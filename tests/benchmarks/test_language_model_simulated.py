"""Simulated LM runs split over sessions (``--out`` each, then ``--merge-from``) add up to one report."""

from benchmarks.language_model.simulated import merged_prediction, merged_scale


def run(name, workers, seconds):
    return {"name": name, "workers": workers, "time_to_target_s": seconds}


def test_a_merged_run_replaces_its_cell_and_keeps_the_others_sorted_by_size():
    kept = [run("ddp", 256, 285.0), run("dynamic_default_node", 256, 20.4), run("dynamic_default_node", 1024, 20.7)]
    new = [run("ddp", 1024, 300.0), run("dynamic_default_node", 256, 19.0)]
    merged = merged_scale(kept, new)
    assert [(r["name"], r["workers"], r["time_to_target_s"]) for r in merged] == [
        ("ddp", 256, 285.0), ("dynamic_default_node", 256, 19.0), ("ddp", 1024, 300.0),
        ("dynamic_default_node", 1024, 20.7)]


def test_a_merged_prediction_replaces_its_cell_in_place_and_appends_new_ones():
    kept = [{"name": "ddp", "node_mbit": 20, "p": 1}, {"name": "periodic_h50", "node_mbit": 20, "p": 2}]
    new = [{"name": "periodic_h50", "node_mbit": 20, "p": 3}, {"name": "ddp", "node_mbit": 100, "p": 4}]
    assert [cell["p"] for cell in merged_prediction(kept, new)] == [1, 3, 4]
    assert merged_prediction(kept, []) == kept
