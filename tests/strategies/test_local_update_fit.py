"""Full Lightning fits on 2-3 Gloo processes: schedules, bytes, identical replicas, resume, failures."""

import math

import pytest
import torch

from helpers.launch import load_results, run_ranks

FLOAT = 4


def _fit(tmp_path, name, nprocs, strategy, **spec):
    out = tmp_path / name
    run_ranks(nprocs, "fit", {"strategy": strategy, **spec}, out)
    results = load_results(out, nprocs)
    for result in results:
        assert result["error"] is None, result["error"]
    return results


def _model_size(result):
    return result["vector"].numel() * FLOAT


def test_tiny_threshold_equals_periodic_averaging_and_huge_threshold_moves_no_model(tmp_path):
    """Delta -> 0 violates at every check: a full sync every b steps, exactly periodic averaging.
    A huge Delta never violates: only the per-check flags move."""
    runs = [{"name": "periodic", "strategy": {"class": "PeriodicAveragingStrategy", "kwargs": {"period": 4}}},
            {"name": "tiny", "strategy": {"class": "DynamicAveragingStrategy",
                                          "kwargs": {"divergence_threshold": 1e-12, "check_every": 4}}},
            {"name": "huge", "strategy": {"class": "DynamicAveragingStrategy",
                                          "kwargs": {"divergence_threshold": 1e12, "check_every": 4}}}]
    run_ranks(2, "fit", {"trainer": {"max_epochs": 2}, "runs": runs}, tmp_path)  # one launch, three fits
    periodic, tiny, huge = (load_results(tmp_path / run["name"], 2) for run in runs)
    for result in periodic + tiny + huge:
        assert result["error"] is None, result["error"]
    steps = periodic[0]["local_steps"]
    checks = steps // 4
    assert checks >= 5 and tiny[0]["local_steps"] == steps
    # Same trajectory, bit for bit.
    for a, b in zip(periodic, tiny):
        assert torch.equal(a["vector"], b["vector"])
    model_bytes = _model_size(periodic[0])
    ring = 2 * (2 - 1) * model_bytes
    assert periodic[0]["comm"].protocol_bytes == checks * ring
    assert tiny[0]["comm"].protocol_bytes == checks * (ring + 2 * 8)  # plus one float64 flag per rank
    assert periodic[0]["comm"].syncs == tiny[0]["comm"].syncs == checks
    assert huge[0]["comm"].protocol_bytes == checks * 2 * 8
    assert huge[0]["comm"].syncs == 0 and huge[0]["metrics"]["dynamic/checks"] == checks
    # After fit every rank holds the same (averaged) model, whatever happened during training.
    for results in (periodic, tiny, huge):
        assert all(torch.equal(results[0]["vector"], other["vector"]) for other in results[1:])
        assert not torch.equal(results[0]["vector"], results[0]["start_vector"])


def test_identical_start_and_string_registration(tmp_path):
    """strategy="dynamic_avg" resolves in every process; replicas built from different seeds start equal."""
    results = _fit(tmp_path, "string", 2, "dynamic_avg", trainer={"max_steps": 3})
    assert torch.equal(results[0]["start_vector"], results[1]["start_vector"])
    # The start model to the other rank, and each rank's int64 batch count to the other (the check at train start).
    assert results[0]["comm"].bytes_by_purpose["setup"] == _model_size(results[0]) + 2 * 8


def test_fedavg_three_ranks(tmp_path):
    """round(0.5 * 3) = 2 participants per round: one model in, the mean out, plus 1-byte finite flags; the same
    rounds a bucket of 1000 entries at a time (the model has 8970) give the same models and bytes."""
    strategy = {"class": "PeriodicAveragingStrategy", "kwargs": {"period": 3, "client_fraction": 0.5, "seed": 1}}
    runs = [{"name": "fedavg"}, {"name": "fedavg_buckets", "bucket": 1000}]
    run_ranks(3, "fit", {"strategy": strategy, "trainer": {"max_steps": 12}, "record_vectors": True, "runs": runs},
              tmp_path)
    results, buckets = (load_results(tmp_path / run["name"], 3) for run in runs)
    for result in results + buckets:
        assert result["error"] is None, result["error"]
    model_bytes = _model_size(results[0])
    rounds = 12 // 3
    assert results[0]["comm"].protocol_bytes == rounds * (2 * model_bytes + 3 * 2)
    assert all(torch.equal(results[0]["vector"], other["vector"]) for other in results[1:])
    for whole, bucketed in zip(results, buckets):
        assert torch.equal(whole["step_vectors"], bucketed["step_vectors"])
        assert whole["comm"].protocol_bytes == bucketed["comm"].protocol_bytes


def test_no_silent_hang_a_failed_check_or_a_missing_rank_stops_every_rank_by_name(tmp_path):
    """A rank turned non-finite stops every rank with the same error naming it. A rank that does not arrive (asleep
    for 12 s before its 4th optimizer step while the other waits in the synchronization after it) makes the waiting rank raise
    within the strategy's `timeout` (2 s here) an error naming the exchange (the 'protocol' all-reduce), not hang
    for torch's 30 minutes; the late rank then fails fast (its peer tore the group down), also by name."""
    runs = [{"name": "nan", "strategy": {"class": "DynamicAveragingStrategy",
                                         "kwargs": {"divergence_threshold": 1.0, "check_every": 4}},
             "nan": {"rank": 1, "step": 6}},
            {"name": "stall", "strategy": {"class": "PeriodicAveragingStrategy", "kwargs": {"period": 4},
                                           "timeout_seconds": 2},
             "stall": {"rank": 1, "step": 3, "seconds": 12}}]
    run_ranks(2, "fit", {"trainer": {"max_epochs": 1}, "runs": runs}, tmp_path)
    for result in load_results(tmp_path / "nan", 2):
        assert result["error"] is not None and "NonFiniteModelError" in result["error"] and "rank(s) [1]" in result["error"]
    waiting, late = load_results(tmp_path / "stall", 2)
    assert waiting["error"].startswith("CollectiveError: lightning_dist: the all-reduce for 'protocol' on rank 0"), waiting
    assert "timeout (0:00:02, the strategy's `timeout` argument)" in waiting["error"]
    assert waiting["fit_seconds"] < 12 <= late["fit_seconds"]
    assert late["error"] is not None and "CollectiveError" in late["error"], late["error"]


def test_a_replica_saved_from_another_gpu_loads_on_the_host(monkeypatch):
    """Rank 0 unpickles every rank's checkpoint part in its own process. A part saved from cuda:1 must land on the
    host there, not on cuda:1 of rank 0's machine (a context and memory on another rank's GPU, or an error).
    The payload is made with a storage tagger that records cuda:1 as the tensors' location, which is what torch.save
    writes on a GPU; on this CPU-only machine loading it as saved fails, which shows it claims the GPU."""
    import io

    from lightning_dist.strategies._checkpoint import pack_replica, unpack_replica

    monkeypatch.setattr(torch.serialization, "_package_registry", list(torch.serialization._package_registry))
    torch.serialization.register_package(0, lambda storage: "cuda:1", lambda storage, location: None)
    state = {"vector": torch.arange(3.0), "optimizers": [{"state": {0: {"exp_avg": torch.full((2, 2), 0.5)}}}],
             "cuda_rng": [torch.ones(4, dtype=torch.uint8)]}
    payload = pack_replica(state)
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.load(io.BytesIO(payload), weights_only=False)
    loaded = unpack_replica(payload)
    tensors = [loaded["vector"], loaded["optimizers"][0]["state"][0]["exp_avg"], loaded["cuda_rng"][0]]
    assert all(tensor.device == torch.device("cpu") for tensor in tensors)
    assert torch.equal(tensors[0], state["vector"]) and torch.equal(tensors[1], torch.full((2, 2), 0.5))


# Resume at another world size: every strategy, written by 3 and 2 processes, resumed by the other number. Class-
# sorted parts unless said: segmented gossip pulls each segment from one peer (R <= m - 1 = 1 at 2 processes), which
# at 3 ranks mixes class-sorted replicas so little that its uninterrupted runs at 3 and 2 processes lay 0.41 apart
# (0.22 and 0.63), a spread that would accept anything; on iid parts they lie close. Downpour runs synchronous rounds:
# asynchronous runs of one configuration scored 0.41-0.49 from launch to launch, more than the spread of one pair,
# and the resize rule (server kept, workers reset) is the same in both modes.
RESIZED = {
    # The threshold measured in the run (after 8 steps, replayable: not from timings), kept in the checkpoint and at
    # the new size.
    "dynamic": {"strategy": {"class": "DynamicAveragingStrategy",
                             "kwargs": {"check_every": 4, "calibration_steps": 8, "sync_overhead": None}}},
    "periodic": {"strategy": {"class": "PeriodicAveragingStrategy", "kwargs": {"period": 4}}},
    "segmented_gossip": {"strategy": {"class": "SegmentedGossipStrategy",
                                      "kwargs": {"segments": 4, "replicas": 1, "period": 4}},
                         "data": {"partition": "iid"}},
    "downpour": {"strategy": {"class": "DownpourSGDStrategy", "kwargs": {"push_every": 4, "synchronous": True}}},
    # Every mirror, the workers' and the server's, restarts at the checkpoint's consensus with no residual.
    "downpour_int8": {"strategy": {"class": "DownpourSGDStrategy",
                                   "kwargs": {"push_every": 4, "synchronous": True, "compression": "int8"}}},
}
USER_CNN = {"name": "user_cnn", **RESIZED["dynamic"], "user_model": True, "trainer": {"max_epochs": 2}}
# fp16 with a loss scaler per rank, written with initial scales 2^8 * 2^rank and resumed with 2 * 2^rank.
LOSS_SCALER = {"name": "loss_scaler", **RESIZED["periodic"], "trainer": {"max_epochs": 2}}
# Resumed on as many processes (3), bit for bit: a fixed threshold, FedAvg's drawn participants, and int8's common
# model and error-feedback residuals, which are in every rank's part.
SAME_SIZE = {
    "same_dynamic": {"strategy": {"class": "DynamicAveragingStrategy",
                                  "kwargs": {"divergence_threshold": 0.05, "check_every": 4}}},
    "same_fedavg": {"strategy": {"class": "PeriodicAveragingStrategy", "kwargs": {"period": 4, "client_fraction": 0.5}}},
    "same_dynamic_int8": {"strategy": {"class": "DynamicAveragingStrategy",
                                       "kwargs": {"divergence_threshold": 0.05, "check_every": 4, "compression": "int8"}}},
}


@pytest.fixture(scope="module")
def resized(tmp_path_factory):
    """Five launches for all cases: uninterrupted 4-epoch runs of every strategy at 3 and at 2 processes (a
    checkpoint per epoch), then each one's epoch-1 checkpoint resumed at the other size; the user-CNN case is
    written with the 3-process runs (2 epochs) and resumed with the 2-process ones; the SAME_SIZE cases are written
    with the 3-process runs and resumed on 3."""
    root = tmp_path_factory.mktemp("resized")

    def launch(name, nprocs, runs):
        run_ranks(nprocs, "fit", {"data": {"partition": "class_sorted"}, "trainer": {"max_epochs": 4}, "runs": runs},
                  root / name, timeout=480)
        results = {run["name"]: load_results(root / name / run["name"], nprocs) for run in runs}
        for case, ranks in results.items():
            for result in ranks:
                assert result["error"] is None, (name, case, result["error"])
        return results

    full, written = {}, {}
    for size in (3, 2):
        runs = [{"name": case, **run, "checkpoint_dir": str(root / f"ckpt{size}" / case)} for case, run in RESIZED.items()]
        if size == 3:
            runs.append({**USER_CNN, "checkpoint_dir": str(root / "ckpt3" / "user_cnn")})
            runs += [{"name": case, **run, "checkpoint_dir": str(root / "ckpt3" / case)} for case, run in SAME_SIZE.items()]
        runs.append({**LOSS_SCALER, "loss_scale_base": 2.0**8, "checkpoint_dir": str(root / f"ckpt{size}" / "loss_scaler")})
        full[size] = launch(f"full{size}", size, runs)
        written[size] = {case: next((root / f"ckpt{size}" / case).glob("epoch=1-*.ckpt")) for case in RESIZED}
        written[size]["loss_scaler"] = next((root / f"ckpt{size}" / "loss_scaler").glob("epoch=0-*.ckpt"))
    written[3]["user_cnn"] = next((root / "ckpt3" / "user_cnn").glob("epoch=0-*.ckpt"))
    written[3].update({case: next((root / "ckpt3" / case).glob("epoch=1-*.ckpt")) for case in SAME_SIZE})
    resumed = {(3, 3): launch("resumed3to3", 3, [{"name": case, **run, "ckpt_path": str(written[3][case])}
                                                  for case, run in SAME_SIZE.items()])}
    for old, new in ((3, 2), (2, 3)):
        runs = [{"name": case, **run, "ckpt_path": str(written[old][case])} for case, run in RESIZED.items()]
        if old == 3:
            runs.append({**USER_CNN, "ckpt_path": str(written[3]["user_cnn"])})
        runs.append({**LOSS_SCALER, "loss_scale_base": 2.0, "ckpt_path": str(written[old]["loss_scaler"])})
        resumed[old, new] = launch(f"resumed{old}to{new}", new, runs)
    return full, written, resumed


@pytest.mark.parametrize("case", list(SAME_SIZE))
def test_resume_ends_with_the_uninterrupted_model(resized, case):
    """Stop after epoch 2 (a step count that is not a multiple of the period), resume on as many processes (3),
    compare bit for bit with the uninterrupted run (both in the ``resized`` fixture's launches)."""
    full, written, resumed = resized
    stopped_at = torch.load(written[3][case], weights_only=False)["global_step"]
    assert stopped_at % 4 != 0
    for a, b in zip(full[3][case], resumed[3, 3][case]):
        assert torch.equal(a["vector"], b["vector"])
        assert a["local_steps"] == b["local_steps"]
        assert a["comm"].protocol_bytes == b["comm"].protocol_bytes and a["comm"].syncs == b["comm"].syncs
        for key, value in a["protocol"].items():
            assert torch.equal(value, b["protocol"][key]) if isinstance(value, torch.Tensor) else value == b["protocol"][key]


@pytest.mark.parametrize("case", list(RESIZED))
def test_resume_at_another_world_size(resized, case):
    """Written by 3 processes, resumed by 2, and the other way round: every replica starts from the checkpoint's
    consensus, the run ends after the checkpoint's steps plus two epochs at the new size, and the model scores
    within noise of an uninterrupted run at that size."""
    full, written, resumed = resized
    for old, new in ((3, 2), (2, 3)):
        checkpoint = torch.load(written[old][case], weights_only=False)
        consensus = torch.cat([value.flatten() for value in checkpoint["state_dict"].values()])
        results = resumed[old, new][case]
        for result in results:
            assert torch.equal(result["start_vector"], consensus)
            assert torch.equal(result["vector"], results[0]["vector"])
            assert result["global_step"] == result["local_steps"]
            assert result["global_step"] == checkpoint["global_step"] + full[new][case][0]["global_step"] // 2
            if case == "dynamic":
                measured = checkpoint["lightning_dist"]["protocol"]["divergence_threshold"]
                assert measured is not None and result["protocol"]["divergence_threshold"] == measured
        # Noise: how far the uninterrupted runs at 3 and 2 processes lie apart (0.07-0.08 for the averaging
        # strategies and Downpour on this 4-epoch, class-sorted task); a resumed run trains half at each size and
        # must not lie further out than that.
        uninterrupted = [full[size][case][0]["callback_metrics"]["val_acc"] for size in (3, 2)]
        noise = max(uninterrupted) - min(uninterrupted)
        accuracy = results[0]["callback_metrics"]["val_acc"]
        assert min(uninterrupted) - noise <= accuracy <= max(uninterrupted) + noise, (old, new, accuracy, uninterrupted)


def test_downpour_at_another_world_size_keeps_the_server_and_resets_the_workers(resized):
    """The server's version goes on from the checkpoint's by one per synchronous round after the resume (every 4
    steps and once more at the end), each round accepts one push per rank now present, the pushes are counted on
    from the checkpoint's total, and every update is fresh (staleness 0): the workers pulled the checkpoint's
    version, not version 0."""
    _, written, resumed = resized
    for old, new in ((3, 2), (2, 3)):
        checkpoint = torch.load(written[old]["downpour"], weights_only=False)
        saved = checkpoint["lightning_dist"]
        server = saved["protocol"]["server"]
        results = resumed[old, new]["downpour"]
        rounds = math.ceil((results[0]["global_step"] - checkpoint["global_step"]) / 4)
        final = results[0]["protocol"]["server"]
        assert server["version"] > 0 and final["version"] == server["version"] + rounds
        assert final["accepted"] == server["accepted"] + new * rounds
        assert sum(result["syncs"] for result in results) == sum(r["worker"]["pushes"] for r in saved["replicas"]) + new * rounds
        assert server["staleness_max"] == final["staleness_max"] == 0


def test_resume_at_another_world_size_with_a_user_cnn(resized):
    """The same 3 -> 2 resume with a user's module: BatchNorm buffers, Dropout, Adam's moments and a StepLR."""
    from helpers.user_models import DigitsCNN
    from lightning_dist.model_vector import ModelVector

    _, written, resumed = resized
    checkpoint = torch.load(written[3]["user_cnn"], weights_only=False)
    model = DigitsCNN()
    model.load_state_dict(checkpoint["state_dict"])
    consensus = ModelVector(model).get()
    results = resumed[3, 2]["user_cnn"]
    for result in results:
        assert torch.equal(result["start_vector"], consensus)
        assert torch.equal(result["vector"], results[0]["vector"]) and bool(torch.isfinite(result["vector"]).all())
        assert result["global_step"] == checkpoint["global_step"] + result["num_training_batches"]
    assert math.isfinite(results[0]["callback_metrics"]["val_loss"])


def test_every_rank_resumes_with_its_own_loss_scale(resized):
    """precision="16-mixed": no gradient all-reduce ties the ranks' loss scalers, so each rank's scale is its own
    and is saved in its part of the checkpoint. Resumed at the other world size, rank r continues with saved rank
    r mod m's scale, like its optimizer state (before: Lightning's one scaler state, rank 0's, on every rank)."""
    full, written, resumed = resized
    for old, new in ((3, 2), (2, 3)):
        step = torch.load(written[old]["loss_scaler"], weights_only=False)["global_step"]
        saved = [result["saved_loss_scales"][step] for result in full[old]["loss_scaler"]]
        assert len(set(saved)) == old, saved  # the ranks' scales differ
        for rank, result in enumerate(resumed[old, new]["loss_scaler"]):
            assert result["restored_loss_scale"] == saved[rank % old], (old, new, rank)
