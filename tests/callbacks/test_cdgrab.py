"""CDGraB callback: checks in one process; balancing, orders, bytes, resume and failures on 2-3 Gloo ranks.

The multi-process runs (tests/workers/cdgrab.py) train a small MLP on 320 MNIST-1D examples
with ``strategy="ddp"``: with 3 ranks and batch size 4 the sampler keeps 312 examples (drops 8),
104 per rank, 26 steps per epoch. The worker records, independently of the callback, each step's
pair differences from a plain autograd loop; the tests replay paper 003's balancing on them in
this process and compare with what the ranks decided and with the orders they then read.
"""

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from helpers.accuracy import noise_band
from helpers.launch import load_results, run_ranks
from lightning_dist import CDGraB, CDGraBSampler
from lightning_dist.algorithms.balancing import PairBalancer, reorder_positions
from lightning_dist.data.datamodules import MNIST1DDataModule
from lightning_dist.models import MLPClassifier

RANKS = 3
BATCH = 4
PER_RANK = 104
STEPS_PER_EPOCH = PER_RANK // BATCH
NUM_PARAMETERS = 40 * 8 + 8 + 8 * 8 + 8 + 8 * 10 + 10


def _launch(tmp_path, name, ranks=RANKS, **spec):
    out = tmp_path / name
    run_ranks(ranks, "cdgrab", {"num_samples": 400, "batch_size": BATCH, **spec}, out)
    return load_results(out, ranks)


def _ok(results):
    for result in results:
        assert result["error"] is None, result["error"]
    return results


def _replay(results, epoch_index, coordinated):
    """Signs (pairs, ranks) of paper 003's balancing over the recorded reference differences of one epoch."""
    per_rank = [torch.cat(r["epochs"][epoch_index]["differences"]) for r in results]  # (pairs, d) each
    differences = torch.stack(per_rank, dim=1)  # (pairs, ranks, d): pair-major, then rank
    if coordinated:
        balancer = PairBalancer(len(results), 2 * differences.shape[0], differences.shape[2])
        return balancer.step(differences)
    columns = []
    for rank in range(len(results)):
        balancer = PairBalancer(1, 2 * differences.shape[0], differences.shape[2])
        columns.append(balancer.step(differences[:, rank : rank + 1])[:, 0])
    return torch.stack(columns, dim=1)


@pytest.fixture(scope="module")
def coordinated(tmp_path_factory):
    """3 ranks, 3 epochs of CD-GraB with full gradients."""
    return _ok(_launch(tmp_path_factory.mktemp("cdgrab"), "coordinated", trainer={"max_epochs": 3}))


def test_every_batch_holds_the_examples_the_order_names(coordinated):
    for result in coordinated:
        assert [e["epoch"] for e in result["epochs"]] == [0, 1, 2]
        for epoch in result["epochs"]:
            assert epoch["batches_match"]
            assert len(epoch["differences"]) == STEPS_PER_EPOCH
    # A fixed random partition: disjoint, the same every epoch, 8 examples dropped.
    parts = [set(r["epochs"][0]["local_indices"].tolist()) for r in coordinated]
    assert all(len(p) == PER_RANK for p in parts) and len(set.union(*parts)) == RANKS * PER_RANK
    for result in coordinated:
        assert result["dropped"] == 8
        assert all(torch.equal(e["local_indices"], result["epochs"][0]["local_indices"]) for e in result["epochs"])


def test_all_ranks_agree_on_the_signs_of_the_shared_balancing(coordinated):
    for epoch_index in range(3):
        signs = [r["epochs"][epoch_index]["signs"] for r in coordinated]
        assert signs[0].shape == (PER_RANK // 2, RANKS)
        assert all(torch.equal(s, signs[0]) for s in signs)
        # Balancing must have decided something non-trivial.
        assert (signs[0] == 1).any() and (signs[0] == -1).any()


def test_signs_are_paper_003s_balancing_of_every_ranks_differences(coordinated):
    for epoch_index in range(3):
        expected = _replay(coordinated, epoch_index, coordinated=True)
        assert torch.equal(coordinated[0]["epochs"][epoch_index]["signs"], expected)


def test_next_epochs_order_is_front_list_then_reversed_back_list(coordinated):
    for rank, result in enumerate(coordinated):
        for this, following in zip(result["epochs"], result["epochs"][1:]):
            positions = reorder_positions(this["signs"][:, rank])
            assert torch.equal(following["permutation"], this["permutation"][positions])
            assert not torch.equal(following["permutation"], this["permutation"])
        # Epoch 0 is a seeded random order, different on every rank.
    firsts = [r["epochs"][0]["permutation"] for r in coordinated]
    assert not torch.equal(firsts[0], firsts[1])


def test_bytes_are_every_steps_differences_to_the_order_server_and_its_broadcasts(coordinated):
    epochs = 3
    differences = epochs * STEPS_PER_EPOCH * (BATCH // 2) * NUM_PARAMETERS * 4
    # per epoch, to each other rank: the signs (int8), the running sum (float32), pairs done and
    # the first non-finite step per rank (int64)
    broadcasts = epochs * (RANKS - 1) * ((PER_RANK // 2) * RANKS + NUM_PARAMETERS * 4 + (1 + RANKS) * 8)
    for rank, result in enumerate(coordinated):
        assert result["bytes_sent"] == (broadcasts if rank == 0 else differences)
        assert result["metrics"]["cdgrab/bytes_sent"] == result["bytes_sent"]


def test_independent_mode_balances_each_rank_alone_and_sends_nothing(tmp_path):
    results = _ok(_launch(tmp_path, "independent", mode="independent", trainer={"max_epochs": 2}))
    expected = _replay(results, 0, coordinated=False)
    for rank, result in enumerate(results):
        assert result["bytes_sent"] == 0
        assert torch.equal(result["epochs"][0]["signs"][:, 0], expected[:, rank])
        positions = reorder_positions(expected[:, rank])
        assert torch.equal(result["epochs"][1]["permutation"], result["epochs"][0]["permutation"][positions])
    assert not torch.equal(expected, _replay(results, 0, coordinated=True))


RESUME_RANKS = 2
TRAIN_EXAMPLES = 320  # num_samples=400 less the validation fifth
VAL_EXAMPLES = 80
STEPS_PER_EPOCH_AT = {2: TRAIN_EXAMPLES // (2 * BATCH), 3: TRAIN_EXAMPLES // (3 * BATCH)}  # 40, 26 (8 dropped)
RESUME_STEPS_PER_EPOCH = STEPS_PER_EPOCH_AT[RESUME_RANKS]
EPOCHS = 3
RESUME_SPEC = {"projection_dim": 32, "trainer": {"max_epochs": EPOCHS}}
# Checkpoints resumed at the other world size: (written by, file, global step at the checkpoint, the epoch and
# batch where Lightning resumes at the new size, the steps the resumed run ends with). Lightning resumes a
# checkpoint written within an epoch at the old batch count k: in that epoch, or in the next when k was the whole
# epoch, if the new epoch has more than k batches, else the next epoch from its start.
RESIZES = {
    # the last batch of epoch 0 (40 >= 26 batches): epoch 1 from its start
    "2to3_last_batch": (2, "step=40", 40, 1, 0, 40 + 26 + 26),
    "2to3_mid_epoch": (2, "step=44", 44, 1, 4, 44 + 22 + 26),  # 4 batches into epoch 1
    # 32 batches into epoch 1, more than its 26 at 3 ranks: nothing of it left
    "2to3_epoch_read": (2, "step=72", 72, 1, 26, 72 + 0 + 26),
    "3to2_epoch_end": (3, "epoch=0", 26, 1, 0, 26 + 40 + 40),  # written at the end of epoch 0
    # the last batch of epoch 0, 26 of the 40 an epoch has at 2 ranks: Lightning resumes epoch 1 at batch 26
    "3to2_last_batch": (3, "step=26", 26, 1, 26, 26 + 14 + 40),
    "3to2_mid_epoch": (3, "step=39", 39, 1, 13, 39 + 27 + 40),  # 13 batches into epoch 1
}


def _launch_runs(out, ranks, runs):
    run_ranks(ranks, "cdgrab", {"num_samples": 400, "batch_size": BATCH, **RESUME_SPEC, "runs": runs}, out)
    return [[_ok([rank_runs[i]])[0] for rank_runs in load_results(out, ranks)] for i in range(len(runs))]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The 2-rank run the resume tests compare with; it writes a checkpoint every 4 steps."""
    out = tmp_path_factory.mktemp("cdgrab_resume")
    results = _ok(_launch(out, "full", ranks=RESUME_RANKS, checkpoint_dir=str(out / "ckpt"), every_n_train_steps=4,
                          **RESUME_SPEC))
    return results, out / "ckpt"


@pytest.fixture(scope="module")
def three_rank_resumes(tmp_path_factory, uninterrupted):
    """One 3-rank launch: the uninterrupted run at 3 ranks, writing a checkpoint every 13 steps and at every epoch's
    end, then the 2-rank run resumed at 3 ranks from each of its checkpoints in RESIZES."""
    out = tmp_path_factory.mktemp("cdgrab_three")
    _, written = uninterrupted
    cases = [case for case, spec in RESIZES.items() if spec[0] == 2]
    runs = [{"checkpoint_dir": str(out / "ckpt"), "every_n_train_steps": 13, "epoch_checkpoint_dir": str(out / "ckpt")}]
    runs += [{"ckpt_path": str(written / f"{RESIZES[case][1]}.ckpt")} for case in cases]
    full, *resumed = _launch_runs(out, 3, runs)
    return full, dict(zip(cases, resumed)), out / "ckpt"


@pytest.fixture(scope="module")
def two_rank_resumes(tmp_path_factory, uninterrupted, three_rank_resumes):
    """One 2-rank launch: the 2-rank run resumed from its own checkpoints at 4 batches into epoch 1 and at the end of
    epoch 0, then the 3-rank run resumed at 2 ranks from each of its checkpoints in RESIZES."""
    out = tmp_path_factory.mktemp("cdgrab_two")
    (_, written2), (_, _, written3) = uninterrupted, three_rank_resumes
    same = [RESUME_STEPS_PER_EPOCH + 4, RESUME_STEPS_PER_EPOCH]
    cases = [case for case, spec in RESIZES.items() if spec[0] == 3]
    runs = [{"ckpt_path": str(written2 / f"step={step}.ckpt")} for step in same]
    runs += [{"ckpt_path": str(written3 / f"{RESIZES[case][1]}.ckpt")} for case in cases]
    results = _launch_runs(out, 2, runs)
    return dict(zip(same, results)), dict(zip(cases, results[len(same):]))


@pytest.mark.parametrize("stop_step", [RESUME_STEPS_PER_EPOCH + 4, RESUME_STEPS_PER_EPOCH])
def test_resume_mid_epoch_or_at_epoch_end_is_bit_exact(uninterrupted, two_rank_resumes, stop_step):
    """A run resumed from the checkpoint at ``stop_step`` ends with the uninterrupted run's weights and order.

    Two ranks: DDP rebuilds its gradient buckets after a process's first step, which with three
    or more Gloo ranks changes the summation order of some gradient elements (a resumed process
    starts with the initial buckets), so there the weights agree only to rounding. Two-rank sums
    are commutative, so every difference here would be CD-GraB's.
    """
    full, _ = uninterrupted
    resumed = two_rank_resumes[0][stop_step]
    total_steps = EPOCHS * RESUME_STEPS_PER_EPOCH
    for a, b in zip(full, resumed):
        assert b["global_step"] == a["global_step"] == total_steps
        assert torch.equal(a["vector"], b["vector"])
        assert torch.equal(a["sampler_permutation"], b["sampler_permutation"])
        assert torch.equal(a["epochs"][-1]["signs"], b["epochs"][-1]["signs"])
        # The resumed run read the rest of the interrupted epoch, or the next epoch, in the same order.
        first = b["epochs"][0]
        assert first["batches_match"] and first["epoch"] == stop_step // RESUME_STEPS_PER_EPOCH
        assert torch.equal(first["permutation"], a["epochs"][first["epoch"]]["permutation"])
    # Counted over the whole run (restored counter). Rank 1 sent projected differences, 32 floats
    # per pair; rank 0, the order server, only its broadcasts, one round per epoch end and per
    # checkpoint (the uninterrupted run wrote more checkpoints).
    assert resumed[1]["bytes_sent"] == full[1]["bytes_sent"] == total_steps * (BATCH // 2) * 32 * 4
    pairs = RESUME_STEPS_PER_EPOCH * BATCH // 2
    round_bytes = pairs * RESUME_RANKS + 32 * 4 + (1 + RESUME_RANKS) * 8
    for result in (full[0], resumed[0]):
        assert result["bytes_sent"] > 0 and result["bytes_sent"] % round_bytes == 0


@pytest.mark.parametrize("case", list(RESIZES))
def test_resume_at_another_world_size_restarts_from_a_seeded_random_order_of_the_new_part(
    uninterrupted, three_rank_resumes, two_rank_resumes, case
):
    """Written by ``old`` ranks, resumed by ``new``: each rank reads the epoch Lightning resumes in the seeded
    random permutation of exactly its part at the new world size (the permutation D-RR reads, the part the
    uninterrupted run at that size reads), from the batch Lightning resumes at; balancing starts again there (the
    pairs before it count as +1) and decides the next epoch's order; the run ends after Lightning's steps, and the
    model scores within the spread of the uninterrupted runs at 2 and 3 ranks."""
    old, _, step, epoch, start, steps = RESIZES[case]
    new = 5 - old
    full = {2: uninterrupted[0], 3: three_rank_resumes[0]}
    resumed = (three_rank_resumes if new == 3 else two_rank_resumes)[1][case]
    skipped = start * BATCH // 2  # pairs of the resumed epoch not read since the resume
    for rank, result in enumerate(resumed):
        assert result["global_step"] == steps
        first, following = result["epochs"][0], result["epochs"][1]
        reference = CDGraBSampler(list(range(TRAIN_EXAMPLES)), BATCH, new, rank, order="random")
        reference.set_epoch(epoch)
        assert first["epoch"] == epoch and first["batches_match"] and first["first_step"] == step
        assert torch.equal(first["local_indices"], reference.local_indices)
        assert torch.equal(first["local_indices"], full[new][rank]["epochs"][0]["local_indices"])
        assert torch.equal(first["permutation"], reference.permutation)
        assert len(first["differences"]) == STEPS_PER_EPOCH_AT[new] - start  # the batches read since the resume
        signs = first["signs"][:, rank]
        assert (signs[:skipped] == 1).all() and set(signs[skipped:].tolist()) <= {-1, 1}
        assert following["epoch"] == epoch + 1
        assert torch.equal(following["permutation"], first["permutation"][reorder_positions(signs)])
    if start < STEPS_PER_EPOCH_AT[new]:  # something was balanced since the resume: both signs occur
        assert {-1, 1} <= set(resumed[0]["epochs"][0]["signs"][skipped:].flatten().tolist())
    uninterrupted_accuracy = [full[size][0]["val_acc"] for size in (2, 3)]  # 0.25-0.29 here; chance is 0.1
    low, high = noise_band(uninterrupted_accuracy, VAL_EXAMPLES)
    assert low <= resumed[0]["val_acc"] <= high, (case, resumed[0]["val_acc"], uninterrupted_accuracy)


def test_different_batch_sizes_and_non_finite_gradients_stop_every_rank_with_a_clear_error(tmp_path):
    results = _launch(tmp_path, "batch_sizes", ranks=2, batch_sizes=[4, 6], trainer={"max_epochs": 1})
    for result in results:
        assert "same batch_size and examples per rank on every rank" in result["error"]
        assert "rank 0: batch_size=4" in result["error"] and "rank 1: batch_size=6" in result["error"]
    results = _launch(tmp_path, "nan", ranks=2, nan={"rank": 1, "step": 5}, trainer={"max_epochs": 2})
    for result in results:
        assert result["error"].startswith("FloatingPointError: CDGraB: non-finite per-example gradients on rank(s) [1] from step 5 on")


# ----------------------------------------------------------------------------- one process


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(projection_dim=0), "projection_dim must be None or an integer >= 1"),
        (dict(projection_dim=2.5), "projection_dim"),
        (dict(mode="central"), "mode must be one of"),
        (dict(loss_fn="mean"), "loss_fn must be callable"),
        (dict(per_example_gradients="hooks"), "per_example_gradients must be one of"),
    ],
)
def test_bad_arguments_name_the_parameter(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CDGraB(**kwargs)


def _fit(callback, datamodule=None, model=None, **trainer):
    datamodule = datamodule or MNIST1DDataModule(num_samples=400, batch_size=BATCH, example_order="balanced")
    model = model or MLPClassifier(num_features=40, num_classes=10, hidden_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[callback],
                        limit_val_batches=0, num_sanity_val_steps=0, **{"max_epochs": 2, **trainer})
    trainer.fit(model, datamodule=datamodule)
    return trainer


def test_one_process_is_centralised_pair_balancing():
    callback = CDGraB()
    _fit(callback)
    sampler = callback.sampler
    assert sampler.epoch == 1 and sampler.dropped == 320 % BATCH
    assert callback.bytes_sent == 0 and callback.metrics()["cdgrab/seconds"] > 0


class _BalancedEpochRecorder(L.Callback):
    """After CDGraB: each step's per-example gradients at the step's starting weights, cast to float32, and their
    pair differences; the callback's signs at the end of the first epoch. The gradients come from the callback's own
    torch.func function (an independent autograd loop agrees with it in float32, see the multi-process tests, but
    not bit for bit in bfloat16, and one differing sign changes the rest of the walk)."""

    def __init__(self, cdgrab):
        self.cdgrab, self.differences, self.signs, self.dtypes = cdgrab, [], None, set()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.current_epoch:
            return
        gradients = self.cdgrab._gradients(batch)  # noqa: SLF001
        self.dtypes.add(gradients.dtype)
        gradients = gradients.float()
        self.differences.append(gradients[0::2] - gradients[1::2])

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch == 0:
            self.signs = self.cdgrab.balancer.signs.clone()


def test_bfloat16_parameters_are_balanced_in_float32():
    """precision="bf16-true" makes the gradients bfloat16; the running sum is float32 (it failed at the first step:
    a float32 sum against bfloat16 differences). The signs are paper 003's balancing of the bfloat16 gradients'
    differences taken in float32."""
    callback = CDGraB(per_example_gradients="vmap")
    recorder = _BalancedEpochRecorder(callback)
    datamodule = MNIST1DDataModule(num_samples=400, batch_size=BATCH, example_order="balanced")
    model = MLPClassifier(num_features=40, num_classes=10, hidden_size=8)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, precision="bf16-true",
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[callback, recorder],
                        limit_val_batches=0, num_sanity_val_steps=0, max_epochs=2)
    trainer.fit(model, datamodule=datamodule)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert recorder.dtypes == {torch.bfloat16}
    assert callback.balancer.running_sum.dtype == torch.float32 and callback.sampler.epoch == 1
    differences = torch.cat(recorder.differences).unsqueeze(1)  # (pairs, 1 rank, d)
    expected = PairBalancer(1, 2 * differences.shape[0], differences.shape[2]).step(differences)
    assert torch.equal(recorder.signs, expected)
    assert (expected == 1).any() and (expected == -1).any()


def test_a_random_order_sampler_is_refused():
    datamodule = MNIST1DDataModule(num_samples=400, batch_size=BATCH, example_order="random")
    with pytest.raises(ValueError, match="order='balanced'"):
        _fit(CDGraB(), datamodule=datamodule)


def test_a_loader_without_the_sampler_is_refused():
    datamodule = MNIST1DDataModule(num_samples=400, batch_size=BATCH)
    with pytest.raises(ValueError, match="CDGraBSampler"):
        _fit(CDGraB(), datamodule=datamodule)


def test_partial_epochs_are_refused():
    with pytest.raises(ValueError, match="read the whole CDGraBSampler"):
        _fit(CDGraB(), limit_train_batches=0.5)


def test_a_module_without_per_example_loss_needs_loss_fn():
    class Plain(MLPClassifier):
        per_example_loss = None

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.cross_entropy(self(batch[0]), batch[1])

    with pytest.raises(ValueError, match="define per_example_loss"):
        _fit(CDGraB(), model=Plain(num_features=40, num_classes=10, hidden_size=8))
    # With loss_fn the same module trains.
    callback = CDGraB(loss_fn=lambda module, batch: torch.nn.functional.cross_entropy(
        module(batch[0]), batch[1], reduction="none"))
    _fit(callback, model=Plain(num_features=40, num_classes=10, hidden_size=8), max_epochs=1)
    assert callback.balancer.epoch_complete


def test_loader_batch_size_must_match_the_sampler():
    class Mismatch(MNIST1DDataModule):
        def train_dataloader(self):
            return DataLoader(self.train_set, batch_size=6, sampler=CDGraBSampler(self.train_set, 4, 1, 0))

    with pytest.raises(ValueError, match=r"batch_size \(6\) must equal the CDGraBSampler's batch_size \(4\)"):
        _fit(CDGraB(), datamodule=Mismatch(num_samples=400, batch_size=BATCH))
