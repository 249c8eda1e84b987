"""Where a language-model run's time goes (benchmarks/language_model/time_split.py), on hand-made runs."""

import pytest

from benchmarks.language_model.time_split import median_local_step_s, split

RUN = {
    "kind": "periodic", "round_steps": [4, 8],
    # rank 0: rounds at steps 4 and 8; from step 6 the local steps take 1.0, 1.2, 1.0, 1.0 s (median 1.0)
    "step_s_per_rank": [[2.0, 1.0, 1.0, 3.0, 1.0, 1.0, 1.2, 3.5, 1.0, 1.0],
                        [2.0, 1.0, 1.0, 2.0, 1.0, 1.0, 1.0, 2.0, 1.0, 1.0]],
    "round_s_per_rank": [[1.8, 2.4], [0.9, 0.9]],
}


def test_a_runs_steps_split_into_compute_protocol_and_the_rest():
    assert median_local_step_s(RUN) == 1.0  # steps 6, 7, 9, 10 of both ranks
    whole = split(RUN)
    # rank 0: 15.7 s of steps, 10 x 1.0 compute, 4.2 protocol, 1.5 other; rank 1: 13.0, 10, 1.8, 1.2
    assert whole == pytest.approx({"compute": 10.0, "protocol": 3.0, "other": 1.35})
    first_five = split(RUN, until_step=5)  # rank 0: 8.0 s, 5 compute, 1.8 protocol (step 4); rank 1: 7.0, 5, 0.9
    assert first_five == pytest.approx({"compute": 5.0, "protocol": 1.35, "other": 1.15})


def test_ddp_steps_above_the_compute_per_step_are_its_all_reduce():
    ddp = {"kind": "ddp", "round_steps": [], "step_s_per_rank": [[1.0, 1.5], [1.2, 1.3]], "round_s_per_rank": [[], []]}
    assert split(ddp, compute_step_s=0.5) == pytest.approx({"compute": 1.0, "protocol": 1.5, "other": 0.0})
