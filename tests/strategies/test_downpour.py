"""DownpourSGD on 3 real Gloo processes: asynchrony, the server invariant, staleness, BatchNorm
statistics, synchronous rounds against the simulator, failures, resume."""

import math
import subprocess
from types import SimpleNamespace

import pytest
import torch

from helpers.launch import load_results, run_ranks
from lightning_dist import DownpourSGDStrategy
from lightning_dist.algorithms.compressed_pushes import CompressedReplies, push_nbytes, reply_nbytes
from lightning_dist.data.datamodules import DigitsDataModule
from lightning_dist.model_vector import ModelVector
from lightning_dist.models import MLPClassifier
from lightning_dist.sim import ParameterServer, Simulation, SpeedModel
from lightning_dist.strategies.parameter_server import APPLIED, GO, HEADER_TAG, STALE, ParameterServerClient
from workers.downpour import BatchNormClassifier

HEADER = 4 * 8
# digits: 1437 training examples, 479 per rank with 3 ranks (20 batches of 24).
DATA = {"batch_size": 24, "partition": "class_sorted"}
# Synchronous with a staleness bound of 0: 20 steps per epoch, push_every 3 (epoch 1 ends mid-round), 20 rounds.
SYNC = {"strategy": {"push_every": 3, "synchronous": True, "max_staleness": 0}, "trainer": {"max_epochs": 3}}
# BatchNorm + Adam, asynchronous, 6 epochs: with the server adding buffer deltas, the running variance
# went below zero (val_loss nan) at the first epoch end in every one of 5 runs; checkpoints every epoch.
# Rank 2 is slower, so rank 0 reaches each validation while rank 2 still has its last push to make.
BATCHNORM = {"batchnorm": {"lr": 0.01}, "strategy": {"push_every": 20}, "trainer": {"max_epochs": 6},
             "slow": {"rank": 2, "seconds": 0.02}}


def _fit(tmp_path, name, nprocs=3, check_errors=True, **spec):
    out = tmp_path / name
    run_ranks(nprocs, "downpour", {"data": DATA, **spec}, out, timeout=180)
    results = load_results(out, nprocs)
    if check_errors:
        for result in results:
            assert result["error"] is None, result["error"]
    return results


def _fits(root, runs, timeout=300):
    """Several 3-rank fits in one launch (``runs``: each a spec's overrides with a ``name``): results per name."""
    run_ranks(3, "downpour", {"data": DATA, "runs": runs}, root, timeout=timeout)
    results = {run["name"]: load_results(root / run["name"], 3) for run in runs}
    for name, ranks in results.items():
        for result in ranks:
            assert result["error"] is None, f"{name}: {result['error']}"
    return results


INT8_SYNC = {**SYNC, "strategy": {**SYNC["strategy"], "compression": "int8"}}


@pytest.fixture(scope="module")
def synchronous_runs(tmp_path_factory):
    """Synchronous rounds in float32 and with int8 pushes and replies, straight through (writing a checkpoint every
    epoch), then both resumed from their epoch-1 checkpoints: two launches."""
    root = tmp_path_factory.mktemp("synchronous")
    straight = _fits(root / "straight", [{"name": "float32", **SYNC, "checkpoint_dir": str(root / "ckpt32")},
                                         {"name": "int8", **INT8_SYNC, "checkpoint_dir": str(root / "ckpt8")}])
    checkpoints = {name: sorted((root / f"ckpt{bits}").glob("epoch=1-*.ckpt"))[0]
                   for name, bits in (("float32", "32"), ("int8", "8"))}
    resumed = _fits(root / "resumed", [{"name": "float32", **SYNC, "ckpt_path": str(checkpoints["float32"])},
                                       {"name": "int8", **INT8_SYNC, "ckpt_path": str(checkpoints["int8"])}])
    return straight, checkpoints, resumed


@pytest.fixture(scope="module")
def synchronous_run(synchronous_runs):
    """The float32 synchronous fit straight through."""
    return synchronous_runs[0]["float32"]


@pytest.fixture(scope="module")
def asynchronous_runs(tmp_path_factory):
    """Asynchronous fits in one launch: float32 and int8 pushes added in full, and a staleness bound of 0 with and
    without int8 (rank 2 slower)."""
    stale = {"slow": {"rank": 2, "seconds": 0.02}, "trainer": {"max_epochs": 1, "limit_val_batches": 0}}
    return _fits(tmp_path_factory.mktemp("asynchronous"), [
        {"name": "invariant", "strategy": {"push_every": 3}, "trainer": {"max_epochs": 2, "limit_val_batches": 0}},
        {"name": "int8", "strategy": {"push_every": 3, "compression": "int8", "staleness_aware": False},
         "trainer": {"max_epochs": 2, "limit_val_batches": 0}},
        {"name": "stale_None", "strategy": {"push_every": 2, "max_staleness": 0}, **stale},
        {"name": "stale_int8", "strategy": {"push_every": 2, "max_staleness": 0, "compression": "int8"}, **stale},
    ])


@pytest.fixture(scope="module")
def batchnorm_run(tmp_path_factory):
    """One asynchronous BatchNorm + Adam fit with a checkpoint per epoch, shared by two tests."""
    root = tmp_path_factory.mktemp("batchnorm")
    return root, _fit(root, "first", checkpoint_dir=str(root / "ckpt"), save_after_fit=True, **BATCHNORM)


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


def test_server_holds_start_plus_every_accepted_update_and_bytes_are_exact(asynchronous_runs):
    results = asynchronous_runs["invariant"]
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


def test_compressed_pushes_keep_the_server_invariant_up_to_the_residuals_with_exact_bytes(asynchronous_runs):
    """int8 pushes with error feedback, updates added in full: the server holds the start plus every rank's true
    updates minus what ranks 1 and 2 still hold as residuals (rank 0 pushes exactly, without bytes), the sum
    EF-SGD telescopes to; the ranks end on the server's model; every remote push sends the int8 update and
    receives the int8 change of the model (a quarter of float32's bytes and a scale per 1024 elements)."""
    results = asynchronous_runs["int8"]
    start = results[0]["start_vector"].double()
    residuals = [result["push_residual"].double() for result in results[1:]]
    assert all(residual.abs().max() > 1e-6 for residual in residuals)
    total = start + sum(result["accepted_sum"] for result in results)
    total[: residuals[0].numel()] -= sum(residuals)
    final = results[0]["vector"].double()
    assert torch.allclose(final, total, rtol=0, atol=1e-5)
    assert not torch.allclose(final, start + sum(result["accepted_sum"] for result in results), rtol=0, atol=1e-5)
    assert all(torch.equal(results[0]["vector"], other["vector"]) for other in results[1:])
    pushes = [result["pushes"] for result in results]
    assert results[0]["server"]["version"] == sum(pushes)
    numel, parameters = final.numel(), residuals[0].numel()
    buffers = numel - parameters
    message_bytes = push_nbytes(parameters, buffers, "int8") + reply_nbytes(parameters, buffers, "int8")
    assert results[0]["comm"].protocol_bytes == sum(pushes[1:]) * (2 * HEADER + message_bytes) + 2 * HEADER
    assert message_bytes < 0.26 * 2 * 4 * numel


def test_compressed_synchronous_resume_is_bit_exact(synchronous_runs, synchronous_run):
    """The workers' residuals and mirrors and the server's mirrors are in the checkpoint: stopped after epoch 1
    (mid-round) and resumed, the run ends where the uninterrupted one does, bit for bit, with the same bytes."""
    straight, checkpoint, resumed = (runs["int8"] for runs in synchronous_runs)
    stored = torch.load(checkpoint, weights_only=False)["lightning_dist"]
    assert stored["protocol"]["server"]["replies"]["mirrors"].shape[0] == 3
    assert stored["replicas"][1]["compression"]["residual"].abs().max() > 0
    for a, b in zip(straight, resumed):
        assert torch.equal(a["vector"], b["vector"])
        assert torch.equal(a["push_residual"], b["push_residual"])
    assert straight[0]["server"]["version"] == resumed[0]["server"]["version"] == 20
    assert straight[0]["comm"].protocol_bytes == resumed[0]["comm"].protocol_bytes
    # What int8 costs in accuracy on this task, against the same rounds in float32.
    compressed, exact = (run[0]["callback_metrics"]["val_acc"] for run in (straight, synchronous_run))
    assert abs(compressed - exact) <= 0.02, (compressed, exact)


@pytest.mark.parametrize("compression", [None, "int8"])
def test_max_staleness_zero_drops_stale_updates(asynchronous_runs, compression):
    """With a bound of 0 a worker may only push onto the version it pulled; others re-pull first. The server holds
    the start plus every accepted update; with int8 pushes minus what ranks 1 and 2 still hold as residuals: a
    refused push leaves the residual owed from the accepted ones (issue 40: it was overwritten before the answer)."""
    results = asynchronous_runs[f"stale_{compression}"]
    server = results[0]["server"]
    assert server["rejected"] > 0 and server["staleness_max"] == 0
    assert server["version"] + server["rejected"] == sum(result["pushes"] for result in results)
    start = results[0]["start_vector"].double()
    expected = start + sum(result["accepted_sum"] for result in results if result["accepted_sum"] is not None)
    if compression is not None:
        assert sum(result["metrics"]["downpour/rejected_pushes_local"] for result in results[1:]) > 0
        residuals = sum(result["push_residual"].double() for result in results[1:])
        expected[: residuals.numel()] -= residuals
    assert torch.allclose(results[0]["vector"].double(), expected, rtol=0, atol=1e-5)
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


def test_synchronous_rounds_apply_the_mean_as_one_version_and_match_the_simulator(synchronous_run):
    """Paper 001's synchronous SGD: every update of a round starts from the same version (staleness 0, so a
    bound of 0 drops none), the server applies their mean, the round is one version. The simulator's server
    runs the same rule: fed the same module, data and start model, it ends on the same global model."""
    results = synchronous_run
    steps = results[0]["global_step"]
    server = results[0]["server"]
    assert steps == 60 and server["version"] == steps // 3
    assert server["rejected"] == 0 and server["accepted"] == 3 * server["version"]
    assert server["staleness_max"] == 0 and results[0]["metrics"]["downpour/staleness_mean"] == 0
    torch.manual_seed(1000)  # the worker's rank 0 model, which the strategy gives every rank
    model = MLPClassifier(num_features=64, num_classes=10)
    protocol = ParameterServer(push_every=3, synchronous=True, max_staleness=0)
    Simulation(model, DigitsDataModule(**DATA), protocol, workers=3, max_steps=steps, eval_every=steps,
               evaluate_workers=False, speed=SpeedModel(step_seconds=0.01, aggregate_seconds=0.0)).run()
    assert protocol.store.version == server["version"] and protocol.store.rejected == 0
    assert torch.allclose(protocol.store.vector, results[0]["vector"], rtol=0, atol=1e-5)


def test_synchronous_resume_is_bit_exact(synchronous_runs):
    """Stop after epoch 1 (steps 20, push_every 3: mid-round), resume to epoch 3: same model as straight through."""
    straight, checkpoint, resumed = (runs["float32"] for runs in synchronous_runs)
    stored = torch.load(checkpoint, weights_only=False)
    assert stored["lightning_dist"]["protocol"]["server"]["version"] > 0
    for a, b in zip(straight, resumed):
        assert torch.equal(a["vector"], b["vector"])
        assert a["pushes"] == b["pushes"]
    assert resumed[0]["server"]["version"] == straight[0]["server"]["version"]
    assert resumed[0]["comm"].protocol_bytes == straight[0]["comm"].protocol_bytes


def test_batchnorm_running_variance_stays_positive_and_validation_finite(batchnorm_run):
    """The server keeps each rank's latest buffers and serves their mean, so the running variance of the
    global model stays positive at every epoch end and its validation loss finite."""
    _, results = batchnorm_run
    assert len(results[0]["min_running_var"]) == len(results[0]["val_losses"]) == 6
    assert min(results[0]["min_running_var"]) > 0, results[0]["min_running_var"]
    assert all(math.isfinite(loss) for loss in results[0]["val_losses"]), results[0]["val_losses"]
    server = results[0]["server"]
    parameters = ModelVector(BatchNormClassifier(64, 10)).num_parameters
    assert server["worker_buffers"].shape == (3, server["vector"].numel() - parameters)
    assert torch.equal(server["vector"][parameters:], server["worker_buffers"].mean(0))


def test_every_epoch_checkpoint_holds_the_model_that_was_validated(batchnorm_run):
    """Validation and the checkpoint written at the epoch's end, after it, hold the same server model: every
    rank's pushes up to the epoch end are in both (rank 0 must not read the server while rank 2 still pushes;
    fails without the barrier in DownpourSGDStrategy.consensus)."""
    root, results = batchnorm_run
    for epoch, validated in enumerate(results[0]["validated"]):
        stored = torch.load(next((root / "ckpt").glob(f"epoch={epoch}-*.ckpt")), weights_only=False)
        module = BatchNormClassifier(64, 10)
        module.load_state_dict(stored["state_dict"])
        assert torch.equal(ModelVector(module).get(), validated), epoch
        for other in results[1:]:
            assert torch.equal(other["validated"][epoch], validated), epoch


def test_asynchronous_resume_restores_the_server(batchnorm_run):
    root, _ = batchnorm_run
    checkpoint = sorted((root / "ckpt").glob("epoch=2-*.ckpt"))[0]
    stored = torch.load(checkpoint, weights_only=False)
    server = stored["lightning_dist"]["protocol"]["server"]
    # The checkpoint's model is the server's global model at the same instant, buffers included.
    module = BatchNormClassifier(64, 10)
    module.load_state_dict(stored["state_dict"])
    assert torch.equal(ModelVector(module).get(), server["vector"])
    assert server["worker_buffers"].shape[0] == 3 and not torch.equal(server["worker_buffers"][0],
                                                                      server["worker_buffers"][1])
    resumed = _fit(root, "resumed", ckpt_path=str(checkpoint), **BATCHNORM)
    # Version = every accepted push of the whole run, before and after the checkpoint.
    assert resumed[0]["server"]["version"] == sum(result["pushes"] for result in resumed) > server["version"] > 0
    assert all(torch.equal(resumed[0]["vector"], other["vector"]) for other in resumed[1:])
    assert min(resumed[0]["min_running_var"]) > 0 and all(math.isfinite(v) for v in resumed[0]["val_losses"])


def test_after_fit_every_rank_last_pulled_the_final_model(batchnorm_run):
    """At the end of fit every replica takes the server's final model, which is then each rank's last pull (paper
    000: the next update is the local model minus the parameters at the last pull). A checkpoint written after fit
    holds that, at the server's version; before, each rank kept the reply to its own last push, and a fit resumed
    from it pushed every other rank's later updates a second time."""
    root, _ = batchnorm_run
    stored = torch.load(root / "first" / "after_fit.ckpt", weights_only=False)["lightning_dist"]
    server = stored["protocol"]["server"]
    for rank, replica in enumerate(stored["replicas"]):
        assert torch.equal(replica["vector"], server["vector"]), rank
        assert torch.equal(replica["worker"]["pulled"], server["vector"]), rank
        assert replica["worker"]["pulled_version"] == server["version"] and replica["worker"]["steps_since_push"] == 0


class ScriptedShard:
    """The server end of a :class:`ParameterServerClient`'s channel, in one process, with ``max_staleness`` set:
    answers each push as scripted, ``"applied"`` (GO, then the update is decoded and added), ``"stale"`` (STALE at
    the header, no update sent) or ``"stale_on_arrival"`` (GO, but versions applied while the update travelled make
    it too stale: decoded and dropped), replying compressed against rank 1's mirror as the server thread does."""

    def __init__(self, start, num_parameters, script):
        self.replies = CompressedReplies("int8", start, num_parameters, workers=2)
        self.num_parameters = num_parameters
        self.model = start.clone()
        self.applied = torch.zeros(num_parameters)
        self.script = list(script)
        self.version = 0
        self.outbox = []

    def send(self, tensor, dst, tag):
        if tag == HEADER_TAG and self.script[0] != "stale":
            self.outbox.append([GO, 0, 0, 0])
            return
        outcome = self.script.pop(0)
        if outcome == "applied":
            update = self.replies.decode_push(tensor)[: self.num_parameters]
            self.applied += update
            self.model[: self.num_parameters] += update
            self.version += 1
        status = APPLIED if outcome == "applied" else STALE
        self.outbox += [[status, self.version, 0, 0], self.replies.encode_reply(1, self.model)]

    def recv_header(self, src=None):
        return 0, self.outbox.pop(0)

    def recv_vector(self, like, src):
        return self.outbox.pop(0)


def test_a_refused_push_keeps_the_residual_of_the_accepted_ones():
    """Issue 40: a worker's compressed push moves its residual. Refused as too stale (at the header, or on arrival
    after GO) it overwrote the residual owed from the accepted pushes before it (accepted, refused, accepted: about
    two quantization errors off). In one process, through the strategy's push and the real client: the decoded
    updates the server applied plus the final residual are the accepted pushes' true updates (EF-SGD's telescoping
    sum); a refused update is dropped, and the worker goes on from the server's model."""
    strategy = DownpourSGDStrategy(max_staleness=0, compression="int8", parallel_devices=[torch.device("cpu")])
    torch.manual_seed(0)
    strategy._vector = ModelVector(MLPClassifier(num_features=64, num_classes=10))
    strategy.on_replicas_initialized(strategy.model_vector.get())
    parameters = strategy.model_vector.num_parameters
    script = ["applied", "stale", "applied", "stale_on_arrival", "applied"]
    shard = ScriptedShard(strategy._pulled, parameters, script)
    strategy._client = ParameterServerClient(SimpleNamespace(group=None, rank=1), True, torch.empty(0))
    strategy._client._channel = shard
    generator = torch.Generator().manual_seed(1)
    accepted = torch.zeros(parameters)
    for outcome in script:
        strategy.model_vector.set(strategy.model_vector.get() + torch.randn(parameters, generator=generator) * 1e-2)
        update = strategy.model_vector.get() - strategy._pulled
        strategy._push()
        if outcome == "applied":
            accepted += update
        assert torch.equal(strategy.model_vector.get(), shard.replies.mirrors[1])  # the server's model, as mirrored
    assert strategy._rejected_pushes == 2 and shard.version == 3
    residual = strategy._pushes.residual
    assert float(residual.abs().max()) > 1e-5
    gap = float((shard.applied + residual - accepted).abs().max())
    assert gap < 1e-6 * float(accepted.abs().max()), gap


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
