"""DownpourSGD on 3 real Gloo processes: asynchrony, the server invariant, staleness, failures, resume."""

import subprocess

import pytest
import torch

from helpers.launch import load_results, run_ranks
from lightning_dist import DownpourSGDStrategy

HEADER = 4 * 8
# digits: 1437 training examples, 479 per rank with 3 ranks.
DATA = {"batch_size": 24, "partition": "class_sorted"}


def _fit(tmp_path, name, nprocs=3, check_errors=True, **spec):
    out = tmp_path / name
    run_ranks(nprocs, "downpour", {"data": DATA, **spec}, out, timeout=180)
    results = load_results(out, nprocs)
    if check_errors:
        for result in results:
            assert result["error"] is None, result["error"]
    return results


@pytest.mark.parametrize("synchronous", [False, True])
def test_slow_rank_slows_the_others_only_when_synchronous(tmp_path, synchronous):
    """Rank 2 sleeps 0.15 s before every batch. Asynchronous: ranks 0 and 1 finish their 20 steps
    long before it (Lightning's per-step SIGTERM broadcast is gone). Synchronous: they wait every round."""
    results = _fit(tmp_path, f"sync{synchronous}", strategy={"push_every": 2, "synchronous": synchronous},
                   slow={"rank": 2, "seconds": 0.15}, trainer={"max_epochs": 1, "limit_val_batches": 0})
    steps = [len(result["batch_end_times"]) for result in results]
    assert steps == [20, 20, 20]
    # From each rank's first to its last step (start-up times differ between processes).
    durations = [result["batch_end_times"][-1] - result["batch_end_times"][0] for result in results]
    slow_done, fast_done = durations[2], durations[:2]
    assert slow_done > 19 * 0.15
    if synchronous:
        assert min(fast_done) > 0.8 * slow_done, (fast_done, slow_done)
    else:
        assert max(fast_done) < 0.5 * slow_done, (fast_done, slow_done)
    assert all(torch.equal(results[0]["vector"], other["vector"]) for other in results[1:])


def test_server_holds_start_plus_every_accepted_update_and_bytes_are_exact(tmp_path):
    results = _fit(tmp_path, "invariant", strategy={"push_every": 3},
                   trainer={"max_epochs": 2, "limit_val_batches": 0})
    start = results[0]["start_vector"].double()
    assert all(torch.equal(results[0]["start_vector"], other["start_vector"]) for other in results[1:])
    total = start + sum(result["accepted_sum"] for result in results)
    final = results[0]["vector"].double()
    assert torch.allclose(final, total, rtol=0, atol=1e-5)
    assert not torch.allclose(final, start)
    # Every rank ends with the server's final model.
    assert all(torch.equal(results[0]["vector"], other["vector"]) for other in results[1:])
    server = results[0]["server"]
    pushes = [result["pushes"] for result in results]
    steps = results[0]["global_step"]
    assert pushes == [-(-steps // 3)] * 3  # one per 3 steps, plus the final flush
    assert server["version"] == sum(pushes) and server["rejected"] == 0
    assert torch.equal(server["vector"], results[0]["vector"])
    # Remote pushes: header + update there, header + model back; DONE headers; rank 0 pushes for free.
    model_bytes = results[0]["vector"].numel() * 4
    remote_pushes = sum(pushes[1:])
    assert results[0]["comm"].protocol_bytes == remote_pushes * 2 * (HEADER + model_bytes) + 2 * HEADER
    assert results[0]["comm"].syncs == sum(pushes)


def test_max_staleness_zero_drops_stale_updates(tmp_path):
    """With a bound of 0 a worker may only push onto the version it pulled; others re-pull first."""
    results = _fit(tmp_path, "stale", strategy={"push_every": 2, "max_staleness": 0},
                   slow={"rank": 2, "seconds": 0.02}, trainer={"max_epochs": 1, "limit_val_batches": 0})
    server = results[0]["server"]
    assert server["rejected"] > 0 and server["staleness_max"] == 0
    assert server["version"] + server["rejected"] == sum(result["pushes"] for result in results)
    start = results[0]["start_vector"].double()
    accepted = [result["accepted_sum"] for result in results if result["accepted_sum"] is not None]
    assert torch.allclose(results[0]["vector"].double(), start + sum(accepted), rtol=0, atol=1e-5)
    assert results[0]["metrics"]["downpour/rejected_stale"] == server["rejected"]


@pytest.mark.parametrize("failure", ["raise_at", "nan"])
def test_a_failing_rank_stops_every_rank_with_an_error_naming_it(tmp_path, failure):
    out = tmp_path / failure
    completed = run_ranks(3, "downpour", {"data": DATA, "strategy": {"push_every": 2},
                                          failure: {"rank": 1, "step": 6},
                                          "trainer": {"max_epochs": 3, "limit_val_batches": 0}},
                          out, timeout=120, check=False)
    assert isinstance(completed, subprocess.CompletedProcess)  # finished within the timeout: no hang
    errors = [torch.load(out / f"rank{rank}.pt", weights_only=False)["error"] for rank in range(3)]
    assert all(error is not None for error in errors), errors
    if failure == "raise_at":
        assert "injected failure on rank 1" in errors[1]
    else:
        assert "rank 1 pushed a non-finite update" in errors[1] or "rank 1" in errors[1]
    for rank in (0, 2):
        assert "rank 1" in errors[rank], errors


def test_synchronous_resume_is_bit_exact(tmp_path):
    """Stop after epoch 1 (steps 20, push_every 3: mid-round), resume to epoch 3: same model as straight through."""
    spec = {"strategy": {"push_every": 3, "synchronous": True}, "trainer": {"max_epochs": 3}}
    straight = _fit(tmp_path, "straight", **spec)
    first = _fit(tmp_path, "first", checkpoint_dir=str(tmp_path / "ckpt"), **spec)
    checkpoint = sorted((tmp_path / "ckpt").glob("epoch=1-*.ckpt"))[0]
    stored = torch.load(checkpoint, weights_only=False)
    assert stored["lightning_dist"]["protocol"]["server"]["version"] > 0
    resumed = _fit(tmp_path, "resumed", ckpt_path=str(checkpoint), **spec)
    assert torch.equal(first[0]["vector"], straight[0]["vector"])
    for a, b in zip(straight, resumed):
        assert torch.equal(a["vector"], b["vector"])
        assert a["pushes"] == b["pushes"]
    assert resumed[0]["server"]["version"] == straight[0]["server"]["version"]
    assert resumed[0]["comm"].protocol_bytes == straight[0]["comm"].protocol_bytes


def test_asynchronous_resume_restores_the_server(tmp_path):
    spec = {"strategy": {"push_every": 3}, "trainer": {"max_epochs": 2}}
    _fit(tmp_path, "first", checkpoint_dir=str(tmp_path / "ckpt"), **spec)
    checkpoint = sorted((tmp_path / "ckpt").glob("epoch=0-*.ckpt"))[0]
    stored = torch.load(checkpoint, weights_only=False)
    server = stored["lightning_dist"]["protocol"]["server"]
    # The checkpoint's model is the server's global model at the same instant.
    flat = torch.cat([value.reshape(-1) for value in stored["state_dict"].values()])
    assert torch.equal(flat, server["vector"])
    resumed = _fit(tmp_path, "resumed", ckpt_path=str(checkpoint), **spec)
    # Version = every accepted push of the whole run, before and after the checkpoint.
    assert resumed[0]["server"]["version"] == sum(result["pushes"] for result in resumed) > server["version"] > 0
    assert all(torch.equal(resumed[0]["vector"], other["vector"]) for other in resumed[1:])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"push_every": 0}, "push_every must be an integer >= 1"),
        ({"push_every": 2.5}, "push_every must be an integer >= 1"),
        ({"synchronous": "yes"}, "synchronous must be True or False"),
        ({"max_staleness": -1}, "max_staleness must be None or an integer >= 0"),
        ({"finish_timeout": 0}, "finish_timeout must be a number of seconds > 0"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DownpourSGDStrategy(**kwargs)


def test_one_process_is_refused_before_launch():
    import lightning as L

    with pytest.raises(ValueError, match="needs at least 2"):
        L.Trainer(accelerator="cpu", devices=1, strategy="downpour_sgd")
