"""The suite's launcher (tests/helpers/forked.py) runs a worker as torchrun does: the same environment, the same
view of the launch from Lightning and torch, one job of several nodes meeting in one group, and a failed rank
failing its job."""

import json
import time

import pytest

from helpers.launch import run_nodes, run_ranks, run_torchrun, write_spec

def ranks_seen(out, nprocs):
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(nprocs)]


def test_forked_ranks_see_what_torchrun_ranks_see(tmp_path):
    run_ranks(2, "environment", {}, tmp_path / "forked")
    run_torchrun(2, write_spec({}, tmp_path / "torchrun"), "environment", timeout=120, check=True, torchrun_args=())
    forked, torchrun = ranks_seen(tmp_path / "forked", 2), ranks_seen(tmp_path / "torchrun", 2)
    for rank, (ours, theirs) in enumerate(zip(forked, torchrun)):
        assert ours["environment"] == theirs["environment"], rank
        for key in ("detected", "global_rank", "node_rank", "rank_zero_only", "threads", "sum"):
            assert ours[key] == theirs[key], (rank, key)
        assert ours["cwd"] == str(tmp_path / "forked") and ours["argv"] == [str(tmp_path / "forked" / "spec.json")]
    assert forked[0]["rank_zero_only"] == 0 and forked[1]["rank_zero_only"] == 1
    assert forked[0]["numpy_draw"] != forked[1]["numpy_draw"]  # each rank's own numpy state, as a fresh process


def test_nodes_meet_in_one_group_with_their_node_ranks(tmp_path):
    run_nodes(2, 2, "environment", {}, tmp_path)
    seen = ranks_seen(tmp_path, 4)
    assert [rank["node_rank"] for rank in seen] == [0, 0, 1, 1]
    assert [rank["environment"]["LOCAL_RANK"] for rank in seen] == ["0", "1", "0", "1"]
    assert {rank["sum"] for rank in seen} == {1.0 + 2.0 + 3.0 + 4.0}


def test_a_failed_rank_fails_its_job_and_stops_the_others(tmp_path):
    start = time.monotonic()
    result = run_ranks(2, "environment", {"fail_rank": 1}, tmp_path, timeout=120, check=False)
    assert result.returncode == 1 and time.monotonic() - start < 60  # rank 0 would sleep 600 s
    with pytest.raises(AssertionError, match="exited 1"):
        run_ranks(2, "environment", {"fail_rank": 0}, tmp_path, timeout=120)
