"""DataGossip: argument checks and weaving in one process; exchanges, resume and failures on 2-3 Gloo ranks.

The multi-process tests run tests/workers/gossip.py under torchrun on class-sorted partitions of
the digits data (two ranks: classes 0-4 and 4-9), batch size 64: 718 local examples per rank and
epoch, so 12 local batches, plus 12 // weave_every foreign batches once foreign records arrived.
"""

import math
import re
import time
from datetime import timedelta
from types import SimpleNamespace

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from helpers.accuracy import noise_band
from helpers.launch import load_results, run_ranks
from lightning_dist.algorithms.selection import LossHistory
from lightning_dist.callbacks import DataGossip
from lightning_dist.callbacks._gossip_checkpoint import resized_rank_state
from lightning_dist.callbacks._records import RecordCodec
from lightning_dist.callbacks._weaving import FOREIGN, WovenLoader
from lightning_dist.data.datamodules import DigitsDataModule
from lightning_dist.models import MLPClassifier

RECORD_BYTES = 64 * 4 + 8  # float32 features + int64 label
BATCH = 64
DATA = {"partition": "class_sorted", "batch_size": BATCH}
VAL_EXAMPLES = 360  # the digits' validation fifth


# ----------------------------------------------------------------------------- one process


@pytest.mark.parametrize(
    "kwargs, parameter",
    [
        (dict(records_per_exchange=0), "records_per_exchange must be an integer >= 1"),
        (dict(records_per_exchange=True), "records_per_exchange"),
        (dict(records_per_exchange=2.5), "records_per_exchange"),
        (dict(weave_every=0), "weave_every must be an integer >= 1"),
        (dict(selector="easy"), "selector must be one of"),
        (dict(spl_threshold=0.0), "spl_threshold must be a finite number > 0"),
        (dict(spl_threshold=float("nan")), "spl_threshold"),
        (dict(spl_growth=0.5), "spl_growth must be a finite number >= 1"),
        (dict(wait_for_exchange="yes"), "wait_for_exchange"),
        (dict(seed=-1), "seed"),
        (dict(timeout=timedelta(0)), "timeout"),
    ],
)
def test_bad_arguments_name_the_parameter_and_range(kwargs, parameter):
    with pytest.raises(ValueError, match=parameter):
        DataGossip(**kwargs)


def test_defaults_are_the_papers():
    gossip = DataGossip()
    assert (gossip.records_per_exchange, gossip.weave_every, gossip.selector) == (5, 4, "active_bias")
    assert (gossip.spl_threshold, gossip.spl_growth) == (0.1, 1.2)


def test_refuses_a_single_process_run():
    datamodule = DigitsDataModule(batch_size=BATCH)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[DataGossip()])
    with pytest.raises(ValueError, match="at least 2 processes"):
        trainer.fit(MLPClassifier(num_features=64), datamodule=datamodule)


def test_record_codec_round_trip_and_shape_check():
    example = {"x": torch.arange(6, dtype=torch.float16).reshape(2, 3), "y": 3, "w": 0.5,
               "a": np.array([1, 2], dtype=np.int32), "flag": True, "none": None}
    codec = RecordCodec(example)
    assert codec.record_nbytes == 6 * 2 + 8 + 8 + 2 * 4 + 1
    other = {**example, "x": example["x"] + 1, "y": 7, "a": np.array([5, 6], dtype=np.int32)}
    rows = codec.encode([example, other], [0, 1])
    assert rows.shape == (2, codec.record_nbytes) and rows.dtype == torch.uint8
    first, second = codec.decode(rows)
    assert torch.equal(second["x"], other["x"]) and second["x"].dtype == torch.float16
    assert second["y"] == 7 and type(second["y"]) is int and first["w"] == 0.5 and first["flag"] is True
    assert np.array_equal(second["a"], other["a"]) and second["a"].dtype == np.int32 and first["none"] is None
    with pytest.raises(ValueError, match=r"fixed-shape records.*dataset\[4\]"):
        codec.encode([{**example, "x": torch.zeros(3, 3, dtype=torch.float16)}], [4])
    with pytest.raises(ValueError, match="uint8 rows"):
        codec.decode(torch.zeros(1, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="str"):
        RecordCodec(("text", 1))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_woven_loader_inserts_foreign_batches_and_tags_every_batch_with_its_indices(num_workers):
    """11 local batches of 2, weave_every=3: L L L F L L L F L L L F L L; each local batch is tagged
    with the indices the sampler gave it (worker processes prefetch ahead; tags must not drift)."""
    dataset = TensorDataset(torch.arange(22.0), torch.arange(22))
    order = torch.randperm(22, generator=torch.Generator().manual_seed(0)).tolist()
    source = DataLoader(dataset, batch_size=2, sampler=order, num_workers=num_workers)
    foreign = [(torch.tensor(100.0 + i), torch.tensor(100 + i)) for i in range(3)]
    state = {"position": 0}

    def next_foreign_batch(collate_fn, batch_size):
        size = min(batch_size, len(foreign))
        rows = [foreign[(state["position"] + j) % len(foreign)] for j in range(size)]
        state["position"] += size
        return collate_fn(rows)

    gossip = SimpleNamespace(weave_every=3, has_foreign_records=False, next_foreign_batch=next_foreign_batch)
    woven = WovenLoader(source, gossip)
    assert len(woven) == 11 and [batch[1].tolist() for batch in woven] == [order[i:i + 2] for i in range(0, 22, 2)]
    gossip.has_foreign_records = True
    assert len(woven) == 11 + 3
    batches, tags = [], []
    for batch in woven:
        batches.append(batch)
        tags.append(woven.tags.popleft())  # the callback pops one tag per batch it sees
    assert len(batches) == 14
    kinds = ["F" if tag is FOREIGN else "L" for tag in tags]
    assert "".join(kinds) == "LLLFLLLFLLLFLL"
    local = [(batch, tag) for batch, tag in zip(batches, tags) if tag is not FOREIGN]
    assert [tag for _, tag in local] == [order[i:i + 2] for i in range(0, 22, 2)]
    assert all(batch[1].tolist() == tag for batch, tag in local)
    foreign_labels = [batch[1].tolist() for batch, tag in zip(batches, tags) if tag is FOREIGN]
    assert foreign_labels == [[100, 101], [102, 100], [101, 102]]  # cycling through the buffer
    assert woven.sampler is source.sampler and woven.dataset is dataset and woven.batch_size == 2


def test_a_rank_state_at_another_world_size_follows_the_rule():
    """Three saved ranks (rank r trained records 2r and 2r + 1), resumed by two and by four: the history of exactly
    the records a rank now owns with the saved values, its own selector RNG (a new rank has none: it keeps its
    seed), no foreign buffer or exchange, and counters whose sum over the ranks is the saved one."""
    ranks = []
    for rank in range(3):
        history = LossHistory(6)
        history.record(torch.tensor([2 * rank, 2 * rank + 1]), torch.tensor([1.5 + rank, 0.25 * rank]))
        history.end_epoch()
        ranks.append({"history": history.state_dict(), "generator": torch.Generator().manual_seed(rank).get_state(),
                      "foreign_rows": torch.ones(4, 3, dtype=torch.uint8), "foreign_order": torch.tensor([1, 0, 3, 2]),
                      "foreign_position": 2, "received": None, "pending": torch.ones(2, 3, dtype=torch.uint8),
                      "last_payload": torch.ones(2, 3, dtype=torch.uint8), "selected_indices": torch.tensor([2 * rank]),
                      "record_format": "(x, y)", "counters": {"bytes_sent": 10 ** rank, "exchanges": 3}})
    state = resized_rank_state(ranks, 1, 2, torch.tensor([3, 4, 5]))  # new part: records of saved ranks 1 and 2
    history = state["history"]
    assert history["visits"].tolist() == [0, 0, 0, 1, 1, 1]
    torch.testing.assert_close(history["latest"], torch.tensor([math.nan] * 3 + [0.25, 3.5, 0.5]), equal_nan=True)
    assert history["mean"][3:].tolist() == [0.25, 3.5, 0.5] and history["epochs_completed"] == 1
    assert torch.equal(state["generator"], ranks[1]["generator"]) and state["record_format"] == "(x, y)"
    assert state["foreign_rows"] is None and state["pending"] is None and state["received"] is None
    assert state["last_payload"] is None and state["selected_indices"] is None and len(state["foreign_order"]) == 0
    shrunk = [resized_rank_state(ranks, rank, 2, None)["counters"] for rank in range(2)]
    assert shrunk == [{"bytes_sent": 101, "exchanges": 6}, {"bytes_sent": 10, "exchanges": 3}]
    new = resized_rank_state(ranks, 3, 4, torch.tensor([0]))
    assert new["generator"] is None and new["counters"] == {"bytes_sent": 0, "exchanges": 0}
    assert new["history"]["visits"].tolist() == [1, 0, 0, 0, 0, 0]


# ----------------------------------------------------------------------------- Gloo ranks
# Starting a rank (torch, Lightning) costs far more than these fits, so each launch below runs
# several fits in the same processes and the tests share their results.


def _launch(out, nprocs, spec, check=True):
    started = time.monotonic()
    process = run_ranks(nprocs, "gossip", spec, out, timeout=240, check=check)
    return process, time.monotonic() - started


FAIL_RUN = {"gossip": {"timeout_s": 120}, "trainer": {"max_epochs": 3}, "checkpoint_dir": None,
            "fail": {"rank": 1, "epoch": 0}, "delay": {"rank": 0, "seconds": 3}}


# ddp_runs' fits: DataGossip's defaults under ddp, 4 epochs. Learning rate 0.5: the default 0.1 leaves the
# model at 0.1-0.3 validation accuracy after 4 epochs, too near chance to compare runs by.
DDP_DEFAULTS = {"strategy": "ddp", "gossip": {}, "trainer": {"max_epochs": 4}, "model_kwargs": {"learning_rate": 0.5}}


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """ddp, 2 ranks, DataGossip's defaults (active_bias, k=5, f=4, wait_for_exchange), one fit after another:
    4 epochs with a checkpoint per epoch; the same run resumed from the checkpoint of epoch 1
    (after 2 epochs); a 2-epoch run whose DataModule returns a plain shuffling DataLoader; last, a
    run in which rank 1 fails (which ends the processes)."""
    out = tmp_path_factory.mktemp("ddp")
    spec = {**DDP_DEFAULTS, "data": DATA, "checkpoint_dir": str(out / "ckpt"),
            "runs": [{}, {"ckpt_path": "epoch=1"}, {"plain_loader": True, "trainer": {"max_epochs": 2},
                                                    "checkpoint_dir": None}, FAIL_RUN]}
    process, seconds = _launch(out, 2, spec, check=False)
    runs = load_results(out, 2)
    return runs, process.returncode, seconds, out / "ckpt"


def _ddp(ddp_runs, index):
    runs, returncode, _, _ = ddp_runs
    if index < 3 and any(len(rank_runs) <= index for rank_runs in runs):
        raise AssertionError(f"run {index} did not finish (torchrun exited {returncode})")
    return _run_results(runs, index) if index < 3 else [rank_runs[index] for rank_runs in runs]


BAD_CASES = [
    ({"gossip": {"records_per_exchange": 480}},
     r"ValueError: records_per_exchange must be between 1 and 479 \(the examples in the smallest local partition"),
    ({"dtype_rank": 1},
     r"ValueError: DataGossip needs foreign records with the structure, shapes and dtypes of local ones"
     r".*rank 1: .*float64"),
    ({"model": "scalar_loss"},
     r"ValueError: DataGossip ranks training records by their loss: training_step must return .*per_example_loss"),
    ({"model": "short_losses"},
     r"ValueError: per_example_loss must hold one loss per example of the batch \(64\); got 63"),
]


ASYNC_RUN = {"strategy": "downpour_sgd",
             "gossip": {"records_per_exchange": 3, "weave_every": 2, "wait_for_exchange": False},
             "trainer": {"max_epochs": 4, "limit_val_batches": 0},
             "delay": {"rank": 2, "seconds": {"0": 3, "1": 0.5}}}


FIRST_BAD = 3  # the bad inputs' runs in three_rank_runs come after the SPL run and the two DDP_DEFAULTS runs


def _checkpoint(directory, epoch):
    (path,) = directory.glob(f"epoch={epoch}-*.ckpt")
    return path


@pytest.fixture(scope="module")
def three_rank_runs(tmp_path_factory, ddp_runs):
    """3 ranks, one fit after another: dynamic_avg with SPL, k=4, f=2, logging to CSV; ddp_runs' first
    fit at 3 ranks, with a checkpoint per epoch, and resumed at 3 ranks from the 2-rank checkpoint of
    epoch 1; then each bad input; then downpour_sgd with the fully asynchronous gossip
    (wait_for_exchange=False) and one rank reaching its first epoch end 3 s late (last: it depends on
    a strategy of its own)."""
    out = tmp_path_factory.mktemp("three")
    resized = [{**DDP_DEFAULTS, "checkpoint_dir": str(out / "ckpt")},
               {**DDP_DEFAULTS, "ckpt_path": str(_checkpoint(ddp_runs[3], 1))}]
    spec = {"strategy": "dynamic_avg", "gossip": {"records_per_exchange": 4, "weave_every": 2, "selector": "spl"},
            "data": DATA, "trainer": {"max_epochs": 4, "log_every_n_steps": 1},
            "runs": [{"log_dir": str(out / "logs")}] + resized + [case for case, _ in BAD_CASES] + [ASYNC_RUN]}
    _launch(out, 3, spec, check=False)
    return load_results(out, 3), out


def _run_results(runs, index):
    """Every rank's result of run ``index`` of a launch, which must have finished without error."""
    results = [rank_runs[index] if len(rank_runs) > index else None for rank_runs in runs]
    for result in results:
        assert result is not None, f"run {index} did not finish"
        assert result["error"] is None, result["error"]
    return results


def _check_buffers_hold_the_other_ranks_selections(results):
    """Whichever exchange a rank's buffer comes from, it holds exactly the other ranks' selections
    for that exchange (their all-gather call of the same number), in rank order."""
    sent = [{epoch["exchange_id"]: epoch for epoch in result["epochs"] if epoch["exchange_id"] is not None}
            for result in results]
    adoptions = 0
    for rank, result in enumerate(results):
        for epoch in result["epochs"]:
            exchange = epoch["foreign_exchange_id"]
            if exchange is None:
                continue
            adoptions += 1
            others = [r for r in range(len(results)) if r != rank]
            assert torch.equal(epoch["foreign_x"], torch.cat([sent[r][exchange]["selected_x"] for r in others]))
            assert torch.equal(epoch["foreign_y"], torch.cat([sent[r][exchange]["selected_y"] for r in others]))
    assert adoptions > 0


def _rows(x, y):
    """Records as sorted hashable rows, to compare a buffer with what other ranks selected."""
    return sorted((tuple(xi.tolist()), int(yi)) for xi, yi in zip(x, y))


def _check_batches_and_history(results, weave_every):
    for result in results:
        examples = len(result["labels"]) // len(results)  # PartitionSampler: the same count on every rank
        partition = set(result["partition"].tolist())
        local_batches = math.ceil(examples / BATCH)
        for epoch in result["epochs"]:
            holds_foreign = epoch["foreign_x"] is not None
            inserted = local_batches // weave_every if holds_foreign else 0
            # Lightning's count equals what was trained: all local batches plus the inserted ones.
            assert epoch["num_training_batches"] == epoch["batches"] == local_batches + inserted
            assert epoch["foreign_batches"] == inserted and epoch["local_examples"] == examples
        state = result["state"]["history"]
        epochs = len(result["epochs"])
        # Only local examples were recorded: one loss per local example per epoch, all in the partition.
        assert int(state["visits"].sum()) == epochs * examples
        assert set(torch.nonzero(state["visits"]).reshape(-1).tolist()) <= partition
        # Each latest loss is the loss the model computed for that very example in its last local
        # batch (batches and index lists stayed paired); foreign batches hold other ranks' records.
        features, labels = result["features"], result["labels"]
        index_of = {(features[i].numpy().tobytes(), int(labels[i])): i for i in range(len(labels))}
        last_loss = {}
        for batch in result["last_epoch_batches"]:
            for x, y, loss in zip(batch["x"], batch["y"], batch["loss"]):
                i = index_of[(x.numpy().tobytes(), int(y))]
                if batch["foreign"]:
                    assert i not in partition
                else:
                    last_loss[i] = float(loss)
        assert len(last_loss) == min(examples, len(partition))
        assert all(state["latest"][i].item() == loss for i, loss in last_loss.items())


def _assert_same_state(a, b):
    """Bit-for-bit equal DataGossip rank states (NaN equal to NaN), bytes aside."""
    for key, value in a.items():
        other = b[key]
        if key == "counters":
            assert {k: v for k, v in value.items() if k != "bytes_sent"} == \
                {k: v for k, v in other.items() if k != "bytes_sent"}
        elif isinstance(value, dict):
            _assert_same_state(value, other)
        elif isinstance(value, torch.Tensor):
            torch.testing.assert_close(value, other, rtol=0, atol=0, equal_nan=True, msg=key)
        else:
            assert value == other, key


def test_ddp_buffer_is_exactly_what_the_other_rank_selected(ddp_runs):
    full = _ddp(ddp_runs, 0)
    for rank, result in enumerate(full):
        other = full[1 - rank]
        epochs = result["epochs"]
        assert epochs[0]["foreign_x"] is None  # nothing to weave before the first exchange
        for e in range(1, 4):
            # wait_for_exchange: epoch e trains on what the other rank selected after epoch e - 1.
            sent = other["epochs"][e - 1]
            assert epochs[e]["foreign_exchange_id"] == sent["exchange_id"] == e
            received = _rows(epochs[e]["foreign_x"], epochs[e]["foreign_y"])
            assert received == _rows(sent["selected_x"], sent["selected_y"])
            assert set(sent["selected_indices"].tolist()) <= set(other["partition"].tolist())
        # No exchange after the last epoch: nobody would train on it.
        assert result["metrics"]["gossip/exchanges"] == 3 and result["catch_up"] == 0
        assert result["metrics"]["gossip/bytes_sent"] == 3 * 5 * RECORD_BYTES * (2 - 1)
        assert result["metrics"]["gossip/foreign_batches"] == 3 * (12 // 4)
        assert result["metrics"]["gossip/foreign_records"] == 5


def test_ddp_batch_counts_and_loss_history(ddp_runs):
    full = _ddp(ddp_runs, 0)
    _check_batches_and_history(full, weave_every=4)
    assert torch.equal(full[0]["weights"], full[1]["weights"])  # ddp keeps replicas identical


def test_ddp_resume_after_two_epochs_ends_bit_for_bit_like_the_uninterrupted_run(ddp_runs):
    full, resumed = _ddp(ddp_runs, 0), _ddp(ddp_runs, 1)
    for a, b in zip(full, resumed):
        assert torch.equal(a["weights"], b["weights"])
        _assert_same_state(a["state"], b["state"])  # loss history, selector RNG, foreign buffer, counters
        # The exchange in flight at the checkpoint was replayed once on resume.
        assert b["metrics"]["gossip/bytes_sent"] == a["metrics"]["gossip/bytes_sent"] + 5 * RECORD_BYTES
        assert len(b["epochs"]) == 2
        for ea, eb in zip(a["epochs"][2:], b["epochs"]):
            assert torch.equal(ea["foreign_x"], eb["foreign_x"]) and ea["batches"] == eb["batches"]


def test_lightning_still_injects_its_distributed_sampler_into_a_plain_loader(ddp_runs):
    """A shuffling DataLoader without sampler: Lightning shards it with a DistributedSampler (719 of
    1437 examples per rank, padded) and reshuffles it every epoch through set_epoch on the woven loader."""
    plain = _ddp(ddp_runs, 2)
    for result in plain:
        assert result["sampler"] == "DistributedSampler"
        assert [epoch["batches"] for epoch in result["epochs"]] == [12, 12 + 12 // 4]
        visits = result["state"]["history"]["visits"]
        assert int(visits.sum()) == 2 * 719
        assert int((visits > 0).sum()) > 719  # epoch 1 read a different half than epoch 0


def test_dynamic_avg_three_ranks(three_rank_runs):
    """Epoch e trains on the two other ranks' selections after epoch e - 1, concatenated in rank order."""
    runs, out = three_rank_runs
    results = _run_results(runs, 0)
    _check_buffers_hold_the_other_ranks_selections(results)
    for result in results:
        assert [epoch["foreign_exchange_id"] for epoch in result["epochs"]] == [None, 1, 2, 3]
        metrics = result["metrics"]
        assert metrics["gossip/exchanges"] == 3 and result["catch_up"] == 0
        assert metrics["gossip/bytes_sent"] == 3 * 4 * RECORD_BYTES * (3 - 1)
        assert metrics["gossip/foreign_records"] == 8
        assert metrics["gossip/spl_threshold"] == pytest.approx(0.1 * 1.2**3)
    _check_batches_and_history(results, weave_every=2)
    assert all(torch.equal(results[0]["weights"], r["weights"]) for r in results[1:])  # averaged at the end
    header = (out / "logs" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"gossip/bytes_sent", "gossip/exchanges", "gossip/foreign_batches", "gossip/spl_threshold"} <= set(header)


@pytest.mark.parametrize("case", range(len(BAD_CASES)),
                         ids=["k_too_large", "dtype_differs", "no_losses", "short_losses"])
def test_bad_inputs_raise_clear_errors_on_every_rank(three_rank_runs, case):
    runs, _ = three_rank_runs
    pattern = BAD_CASES[case][1]
    for rank_runs in runs:
        assert len(rank_runs) > FIRST_BAD + case, "the bad-input run did not finish"
        error = rank_runs[FIRST_BAD + case]["error"]
        assert error is not None and re.match(pattern, error, re.DOTALL), error


def test_downpour_ranks_out_of_step_drop_requests_and_catch_up_at_the_end(three_rank_runs):
    """Asynchronous training: while rank 2 sleeps 3 s at its first epoch end, ranks 0 and 1 run ahead
    and finish, their later requests finding the first exchange still running (dropped). Rank 2
    (sleeping again briefly, so that its first exchange completes) starts a second one that nobody
    answers during training. The final agreement evens out the counts without a hang."""
    runs, _ = three_rank_runs
    results = _run_results(runs, FIRST_BAD + len(BAD_CASES))
    dropped = [r["metrics"]["gossip/dropped_exchanges"] for r in results]
    catch_up = [r["catch_up"] for r in results]
    assert dropped[0] >= 1 and dropped[1] >= 1 and sum(catch_up) >= 1, (dropped, catch_up)
    (calls,) = {r["metrics"]["gossip/exchanges"] + r["catch_up"] for r in results}  # equal on every rank
    for result in results:
        assert result["metrics"]["gossip/bytes_sent"] == calls * 3 * RECORD_BYTES * (3 - 1)
    _check_buffers_hold_the_other_ranks_selections(results)
    _check_batches_and_history(results, weave_every=2)


@pytest.fixture(scope="module")
def resized_runs(tmp_path_factory, ddp_runs, three_rank_runs):
    """ddp_runs' first fit resumed at another world size from its checkpoint of epoch 1 (after 2 of 4 epochs):
    3 -> 2 in a launch of its own, 2 -> 3 in three_rank_runs. Returns the uninterrupted fits at 2 and 3 ranks,
    the resumed ones by (written by, resumed by), and the checkpoints by the number of ranks that wrote them."""
    out = tmp_path_factory.mktemp("resized")
    runs3, out3 = three_rank_runs
    written = {2: _checkpoint(ddp_runs[3], 1), 3: _checkpoint(out3 / "ckpt", 1)}
    _launch(out, 2, {**DDP_DEFAULTS, "data": DATA, "ckpt_path": str(written[3])})
    to_two = load_results(out, 2)
    for result in to_two:
        assert result["error"] is None, result["error"]
    full = {2: _ddp(ddp_runs, 0), 3: _run_results(runs3, 1)}
    return full, {(3, 2): to_two, (2, 3): _run_results(runs3, 2)}, written


HISTORY_FIELDS = ("latest", "visits", "epochs_recorded", "mean", "m2", "epoch_latest")


@pytest.mark.parametrize("old, new", [(3, 2), (2, 3)], ids=["3to2", "2to3"])
def test_resume_at_another_world_size_keeps_the_loss_history_of_the_records_each_rank_now_owns(
    resized_runs, old, new
):
    """Written by ``old`` ranks after 2 of 4 epochs, resumed by ``new``: each rank starts with the saved entries of
    exactly the records of its part at the new world size (those of the saved rank that trained each one, bit
    for bit; every other record unseen), trains the first epoch on local records only (the foreign buffers were
    the old ranks'), exchanges after it and trains the last epoch with foreign batches: the planned steps. The
    counters' sum over ranks goes on from the checkpoint's, and the model scores within the spread of the
    uninterrupted runs at 2 and 3 ranks."""
    full, resumed, written = resized_runs
    checkpoint = torch.load(written[old], weights_only=False)
    (state,) = [value for key, value in checkpoint["callbacks"].items() if key.startswith("DataGossip")]
    saved = [rank["history"] for rank in state["ranks"]]
    visited = torch.stack([history["visits"] > 0 for history in saved])
    assert len(saved) == old and int(visited.sum(dim=0).max()) == 1  # class-sorted parts: one trainer per record
    results = resumed[(old, new)]
    examples = len(results[0]["labels"]) // new
    local = math.ceil(examples / BATCH)
    sources = []
    for result in results:
        owned = torch.zeros(len(result["labels"]), dtype=torch.bool)
        owned[result["partition"]] = True
        expected = LossHistory(len(owned)).state_dict()
        for history, seen in zip(saved, visited):
            for name in HISTORY_FIELDS:
                expected[name] = torch.where(owned & seen, history[name], expected[name])
        for name in HISTORY_FIELDS:
            torch.testing.assert_close(result["start_history"][name], expected[name], rtol=0, atol=0, equal_nan=True,
                                       msg=name)
        assert int(result["start_history"]["visits"][owned].sum()) > 0
        sources.append(sum(bool((seen & owned).any()) for seen in visited))
        assert result["global_step"] == checkpoint["global_step"] + local + (local + local // 4)
        first, last = result["epochs"]
        assert first["foreign_x"] is None and first["batches"] == local
        assert last["batches"] == local + local // 4 and len(last["foreign_y"]) == 5 * (new - 1)
    assert max(sources) >= 2  # some rank's new part holds records that different saved ranks trained
    saved_bytes = sum(rank["counters"]["bytes_sent"] for rank in state["ranks"])
    assert sum(r["metrics"]["gossip/bytes_sent"] for r in results) == saved_bytes + new * 5 * RECORD_BYTES * (new - 1)
    uninterrupted = [full[size][0]["val_acc"] for size in (2, 3)]
    low, high = noise_band(uninterrupted, VAL_EXAMPLES)
    assert low <= results[0]["val_acc"] <= high, (old, new, results[0]["val_acc"], uninterrupted)


def test_one_rank_failing_mid_exchange_stops_every_rank(ddp_runs):
    """Rank 1 raises while its exchange waits for rank 0 (which reaches its epoch end 3 s late): rank 1
    exits although its exchange thread is still blocked in the all-gather, and rank 0 stops with an
    error (a closed connection, or torchrun's SIGTERM, whichever reaches it first) instead of
    waiting for a timeout; torchrun reports the failure."""
    _, returncode, seconds, _ = ddp_runs
    assert all(len(rank_runs) == 4 for rank_runs in ddp_runs[0]), "a rank did not report the failing run"
    survivor, failed = _ddp(ddp_runs, 3)
    assert failed["error"] == "RuntimeError: injected failure on rank 1"
    assert survivor["error"] is not None and survivor["seconds"] < 60, survivor
    assert returncode != 0
    assert seconds < 150, f"the launch took {seconds:.0f} s: something waited for a timeout"
