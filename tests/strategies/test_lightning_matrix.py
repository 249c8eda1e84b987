"""The Lightning compatibility matrix (issue 16): every strategy and callback with a user's own module.

Columns are the strategies and callbacks, rows the Lightning features; ``MATRIX`` says what each
cell must do: work with the semantics its check asserts, or be refused with a ``ValueError``
naming the feature before any training step. The documentation's table (docs/lightning-compatibility.md) is this
matrix.

Every cell trains ``tests/helpers/user_models.DigitsCNN`` (BatchNorm, Dropout, Adam, StepLR; CD-GraB's
column uses GroupNorm, which it needs) on 2 or 3 Gloo processes. One ``torchrun`` launch per column
runs all of its cells one after the other as separate fits in the same processes
(``tests/workers/matrix.py``); each cell's test reads that cell's records. A cell that hangs
is stopped by the worker's watchdog after ``CELL_SECONDS`` and reported as ``TIMEOUT``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from helpers.launch import run_nodes, run_ranks
from helpers.user_models import NUM_TRAIN, DigitsCNN, evaluate, predict

# column -> processes (FedAvg and segmented gossip need 3 to differ from plain averaging)
COLUMNS = {"dynamic_avg": 2, "periodic_avg": 2, "fedavg": 3, "downpour_sgd": 2, "segmented_gossip": 3,
           "datagossip": 2, "cdgrab": 2, "periodic_node": 4, "datagossip_node": 4, "cdgrab_node": 4}
LOCAL_UPDATE = ["dynamic_avg", "periodic_avg", "fedavg", "downpour_sgd", "segmented_gossip", "datagossip"]
# One learner per node (hierarchy="node"), launched as 2 nodes x 2 ranks: periodic averaging, and the callbacks on it.
NODE_COLUMNS = ["periodic_node", "datagossip_node", "cdgrab_node"]
NODES = 2

WORKS = "works"
UNEQUAL = r"ValueError: \w+Strategy needs the same number of training batches per epoch on every rank .*unequal batches per rank \(rank 0: 10, rank 1: 6"
UNSIZED = r"ValueError: \w+Strategy needs the same number of training batches per epoch on every rank, but the train loader of rank\(s\) \[0, 1(, 2)?\] has no length \(an IterableDataset without __len__\)"
TIME_BASED = r"ValueError: \w+Strategy does not support a time-based val_check_interval"
DATAGOSSIP_ITERABLE = r"ValueError: DataGossip needs a map-style train dataset .* got an IterableDataset"
CDGRAB_SAMPLER = r"ValueError: CDGraB needs the train loader to sample with lightning_dist.data.CDGraBSampler"
CDGRAB_PARTIAL = r"ValueError: CDGraB needs every epoch to read the whole CDGraBSampler \(6 batches per rank\)"
CDGRAB_BATCHNORM = r"ValueError: CDGraB needs per-example gradients, which BatchNorm layers in training mode do not have"
FEDAVG_OUTER = r"ValueError: outer_optimizer needs client_fraction=1 \(got 0.5\)"
DATAGOSSIP_NO_LOSSES = r"ValueError: DataGossip ranks training records by their loss: .*\(no 'per_example_loss', with manual optimization\)"


def _row(default: str, **columns: str) -> dict[str, str]:
    """A row over the one-node columns, and over the node columns named in ``columns``."""
    return {column: columns.get(column, default) for column in COLUMNS if column not in NODE_COLUMNS or column in columns}


# feature (cell) -> column -> WORKS or the refusal (a regex of the error every rank raises)
MATRIX: dict[str, dict[str, str]] = {
    "accumulate_grad_batches": _row(WORKS, periodic_node=WORKS),
    "gradient_clip_val": _row(WORKS, periodic_node=WORKS, cdgrab_node=WORKS),
    "bf16_mixed": _row(WORKS, periodic_node=WORKS, datagossip_node=WORKS),
    "manual_optimization": _row(WORKS, datagossip=DATAGOSSIP_NO_LOSSES,  # two_optimizers: manual, losses returned
                                periodic_node=WORKS),
    "two_optimizers": _row(WORKS, periodic_node=WORKS),
    "checkpoint_best": _row(WORKS, periodic_node=WORKS),
    "evaluate_after_fit": _row(WORKS, periodic_node=WORKS, datagossip_node=WORKS, cdgrab_node=WORKS),
    "val_check_interval": _row(WORKS),
    "val_check_interval_time": _row(TIME_BASED),
    "max_steps": _row(WORKS, periodic_node=WORKS),
    "outer_optimizer": {"dynamic_avg": WORKS, "periodic_avg": WORKS, "fedavg": FEDAVG_OUTER,  # DiLoCo's outer step
                        "periodic_node": WORKS},
    "progress_bar": {column: WORKS for column in LOCAL_UPDATE},  # the strategies' comm_MB and syncs
    "progress_bar_off": {column: WORKS for column in LOCAL_UPDATE},
    "limit_train_batches": _row(WORKS, cdgrab=CDGRAB_PARTIAL),
    "iterable_dataset": _row(WORKS, datagossip=DATAGOSSIP_ITERABLE, cdgrab=CDGRAB_SAMPLER),
    "iterable_dataset_unsized": _row(UNSIZED, datagossip=DATAGOSSIP_ITERABLE, cdgrab=CDGRAB_SAMPLER),
    "batchnorm": {"cdgrab": CDGRAB_BATCHNORM},  # every other cell of every other column trains BatchNorm
    "unequal_batches": _row(UNEQUAL, cdgrab=CDGRAB_SAMPLER),
}
# A time-based val_check_interval under plain DDP is Lightning's own affair (each rank checks its clock).
del MATRIX["val_check_interval_time"]["cdgrab"]


def _cells(column: str) -> list[str]:
    # unequal_batches last: if it hung, the watchdog ends the processes after every other cell ran.
    return [cell for cell in MATRIX if column in MATRIX[cell]]


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> Callable[[str, str], list[dict]]:
    """One torchrun launch per column, on first use; returns a cell's records, one per rank."""
    done: dict[str, Path] = {}

    def records(column: str, cell: str) -> list[dict]:
        if column not in done:
            out = tmp_path_factory.mktemp(column)
            spec = {"column": column, "cells": _cells(column)}
            if column in NODE_COLUMNS:
                run_nodes(NODES, COLUMNS[column] // NODES, "matrix", spec, out, timeout=400, check=False)
            else:
                run_ranks(COLUMNS[column], "matrix", spec, out, timeout=400, check=False)
            done[column] = out
        paths = [done[column] / cell / f"rank{rank}.pt" for rank in range(COLUMNS[column])]
        missing = [str(path) for path in paths if not path.exists()]
        assert not missing, f"no record (the launch died before this cell): {missing}"
        return [torch.load(path, weights_only=False) for path in paths]

    return records


# ------------------------------------------------------------------------------ semantics


def _close(a: float, b: float, precision: str = "32") -> bool:
    return math.isclose(a, b, rel_tol=2e-2 if precision == "bf16-mixed" else 1e-4, abs_tol=1e-5)


def _model(state: dict, column: str) -> DigitsCNN:
    model = DigitsCNN(norm="group" if column.startswith("cdgrab") else "batch")
    model.load_state_dict(state)
    return model


def _check_common(records: list[dict], column: str, precision: str = "32") -> None:
    """Every working cell: identical finite weights on every rank, the protocol ran, and every
    validation during fit evaluated one model (the same on every rank) whose one-process score is
    the one the run logged."""
    first = records[0]
    for record in records[1:]:
        assert record["state"].keys() == first["state"].keys()
        for name, value in first["state"].items():
            assert torch.equal(value, record["state"][name]), f"ranks differ in {name}"
        assert record["global_step"] == first["global_step"]
    assert all(bool(torch.isfinite(value.float()).all()) for value in first["state"].values())
    if column in LOCAL_UPDATE or column in NODE_COLUMNS:
        assert first["syncs"] > 0, "the protocol never ran"
        assert all(record["local_steps"] == record["global_step"] for record in records)
    if column in NODE_COLUMNS:  # the protocol ran between the nodes, DDP's gradients inside them
        assert first["comm"].bytes_by_level["inter_node"] > 0 and first["comm"].bytes_by_purpose["gradients"] > 0
    if column.startswith("datagossip") and len(first["batches_per_epoch"]) >= 2:
        assert all(record["callback"]["gossip/exchanges"] >= 1 for record in records)
        assert all(record["callback"]["gossip/foreign_batches"] > 0 for record in records)
    if column.startswith("cdgrab"):
        assert records[1]["callback"]["cdgrab/bytes_sent"] > 0  # differences went to the order server
    for index, validation in enumerate(first["validations"]):
        for record in records[1:]:
            other = record["validations"][index]
            assert all(torch.equal(value, other["state"][name]) for name, value in validation["state"].items())
        assert math.isfinite(validation["val_loss"])
        score = evaluate(_model(validation["state"], column), precision)["val_loss"]
        assert _close(score, validation["val_loss"], precision), (index, score, validation["val_loss"])


def _steps_per_batch(records: list[dict]) -> float:
    return sum(records[0]["batches_per_epoch"])


def check_accumulate_grad_batches(records, column):
    _check_common(records, column)
    assert records[0]["batches_per_epoch"][0] == (6 if column.startswith("cdgrab") else 8)
    # One optimizer step, and so one protocol step, per 2 batches.
    assert records[0]["global_step"] == _steps_per_batch(records) / 2


def check_gradient_clip_val(records, column):
    _check_common(records, column)
    for record in records:
        norms = record["clipped_norms"]
        assert len(norms) == record["global_step"]
        assert max(after for _, after in norms) <= 1.0 + 1e-5
        assert max(before for before, _ in norms) > 1.0  # clipping did something


def check_bf16_mixed(records, column):
    _check_common(records, column, precision="bf16-mixed")
    # Weights, and so the averaged model vector, stay float32 under mixed precision.
    assert all(record["parameter_dtypes"] == ["torch.float32"] for record in records)
    assert records[0]["validations"]


def check_manual_optimization(records, column):
    _check_common(records, column)
    assert records[0]["global_step"] == _steps_per_batch(records)


def check_two_optimizers(records, column):
    _check_common(records, column)
    # Lightning counts each optimizer's step; the protocol runs after each of them.
    assert records[0]["global_step"] == 2 * _steps_per_batch(records)


def check_checkpoint_best(records, column):
    _check_common(records, column)
    first = records[0]
    logged = [validation["val_loss"] for validation in first["validations"]]
    assert len(logged) == len(first["batches_per_epoch"]) >= 2
    assert first["best_model_score"] == min(logged)
    model = DigitsCNN.load_from_checkpoint(first["best_model_path"], map_location="cpu")
    assert _close(evaluate(model)["val_loss"], first["best_model_score"])
    # validate(ckpt_path="best") after fit, on every rank, scores the checkpoint's model too.
    for record in records:
        assert _close(record["validate_best"][0]["val_loss"], first["best_model_score"])


def check_evaluate_after_fit(records, column):
    _check_common(records, column)
    final = evaluate(_model(records[0]["state"], column))
    for record in records:
        assert all(torch.equal(value, record["state"][name]) for name, value in record["state_after_evaluation"].items())
        assert _close(record["validate"][0]["val_loss"], final["val_loss"])
        assert _close(record["test"][0]["test_loss"], final["val_loss"])
    # predict: each rank predicts its shard with the consensus model; together, every example.
    expected = predict(_model(records[0]["state"], column))
    index = torch.cat([record["predictions"]["index"] for record in records])
    prediction = torch.cat([record["predictions"]["prediction"] for record in records])
    assert set(index.tolist()) == set(range(len(expected)))
    assert torch.equal(prediction, expected[index])


def check_val_check_interval(records, column):
    _check_common(records, column)
    # val_check_interval=0.5: twice per epoch, each time on the consensus (checked in _check_common).
    first = records[0]
    assert len(first["validations"]) == 2 * len(first["batches_per_epoch"])
    per_epoch = first["batches_per_epoch"][0]
    assert first["validations"][0]["global_step"] == per_epoch // 2


def check_max_steps(records, column):
    _check_common(records, column)
    assert records[0]["global_step"] == 5


def check_outer_optimizer(records, column):
    """DiLoCo's outer step on a BatchNorm CNN with Adam: taken at every periodic round (at dynamic averaging's
    full synchronizations), moving the model further than the plain average would; the running variances the
    outer step leaves averaged stay positive."""
    _check_common(records, column)
    outer = records[0]["protocol"]
    assert outer["outer/steps"] >= 1
    if column in ("periodic_avg", "periodic_node"):
        assert outer["outer/steps"] == records[0]["syncs"] == records[0]["global_step"] // 2
    assert outer["outer/update_norm"] > outer["outer/pseudo_gradient_norm"] > 0
    variances = [value for name, value in records[0]["state"].items() if name.endswith("running_var")]
    assert variances and all(bool((value > 0).all()) for value in variances)


BAR_KEYS = {"comm_MB", "syncs"}


def check_progress_bar(records, column):
    """After every training batch the user's own bar shows comm_MB and syncs as the strategy's summed counters stood
    (their last refresh: every log_every_n_steps, or each validation for downpour_sgd), beside the user's own value;
    trainer.progress_bar_metrics still holds them after fit."""
    _check_common(records, column)
    for record in records:
        shown = record["shown"]
        assert len(shown) == record["global_step"] > 0
        for entry in shown:
            bar = entry["bar"]
            assert bar["comm_MB"] == entry["protocol_bytes"] / 1e6 and bar["syncs"] == entry["syncs"], entry
            assert "user_value" in bar
        assert all(record["progress_bar_metrics"][key] == shown[-1]["bar"][key] for key in BAR_KEYS)
    # The bar moved with the run: refreshed counters replaced the first ones.
    shown = records[0]["shown"]
    assert shown[-1]["protocol_bytes"] > 0 and len({entry["bar"]["comm_MB"] for entry in shown}) >= 2


def check_progress_bar_off(records, column):
    """enable_progress_bar=False: nothing in progress_bar_metrics from the strategy, the user's value still there."""
    _check_common(records, column)
    for record in records:
        assert not BAR_KEYS & record["progress_bar_metrics"].keys() and "user_value" in record["progress_bar_metrics"]


def check_limit_train_batches(records, column):
    _check_common(records, column)
    world = COLUMNS[column]
    full = math.ceil(math.ceil(NUM_TRAIN / world) / 32)  # DistributedSampler pads to equal shards
    assert records[0]["batches_per_epoch"][0] == int(full * 0.25)
    assert records[0]["global_step"] == _steps_per_batch(records)


def check_iterable_dataset(records, column):
    _check_common(records, column)
    world = COLUMNS[column]
    assert records[0]["batches_per_epoch"] == [math.ceil(NUM_TRAIN // world / 64)]
    assert records[0]["global_step"] == _steps_per_batch(records)


CHECKS = {name.removeprefix("check_"): check for name, check in globals().items() if name.startswith("check_")}


@pytest.mark.parametrize(("column", "cell"), [(column, cell) for column in COLUMNS for cell in _cells(column)])
def test_cell(launches, column, cell):
    records = launches(column, cell)
    expected = MATRIX[cell][column]
    errors = [record["error"] for record in records]
    if expected == WORKS:
        assert errors == [None] * len(records), errors
        CHECKS[cell](records, column)
    else:
        # Refused on every rank, by name, before any step: never a hang (TIMEOUT) or a crash elsewhere.
        for error in errors:
            assert error is not None and re.search(expected, error), error


@pytest.mark.parametrize("column", LOCAL_UPDATE)
def test_progress_bar_leaves_the_loggers_alone(launches, column):
    """With or without the bar the loggers get the same calls: comm/* as before, never the bar's keys. The same
    figures too, except downpour_sgd's, whose asynchronous ranks interleave differently from run to run."""
    with_bar, without = launches(column, "progress_bar"), launches(column, "progress_bar_off")
    assert [record["error"] for record in with_bar + without] == [None] * (len(with_bar) + len(without))
    assert any(name.startswith("comm/") for _, metrics in with_bar[0]["logged"] for name in metrics)
    for bar, off in zip(with_bar, without):
        assert [(step, sorted(metrics)) for step, metrics in bar["logged"]] == \
            [(step, sorted(metrics)) for step, metrics in off["logged"]]
        assert not any(BAR_KEYS & metrics.keys() for _, metrics in bar["logged"])
        if column != "downpour_sgd":
            assert bar["logged"] == off["logged"]


PAGE = Path(__file__).resolve().parents[2] / "docs" / "lightning-compatibility.md"
PAGE_COLUMNS = {"`dynamic_avg`": "dynamic_avg", "`periodic_avg`": "periodic_avg", "`fedavg`": "fedavg",
                  "`downpour_sgd`": "downpour_sgd", "`segmented_gossip`": "segmented_gossip",
                  "`DataGossip`": "datagossip", "`CDGraB`": "cdgrab", "`periodic_avg`, one learner per node": "periodic_node",
                  "`DataGossip`, one learner per node": "datagossip_node", "`CDGraB`, one learner per node": "cdgrab_node"}
PAGE_ROWS = {
    "`accumulate_grad_batches=2`": "accumulate_grad_batches", "`gradient_clip_val=1.0`": "gradient_clip_val",
    '`precision="bf16-mixed"`': "bf16_mixed", "manual optimization": "manual_optimization",
    "two optimizers (manual)": "two_optimizers",
    '`ModelCheckpoint(monitor="val_loss")`, best reloaded in one process': "checkpoint_best",
    "`validate` / `test` / `predict` after fit": "evaluate_after_fit", "`val_check_interval=0.5`": "val_check_interval",
    "time-based `val_check_interval`": "val_check_interval_time", "`max_steps=5`": "max_steps",
    "DiLoCo's `outer_optimizer=diloco_outer_optimizer`": "outer_optimizer",
    "`limit_train_batches=0.25`": "limit_train_batches",
    "a user's own `ProgressBar`, a logger, the user's own `prog_bar` value": "progress_bar",
    "`enable_progress_bar=False` (the user's `prog_bar` value and a logger)": "progress_bar_off",
    "`IterableDataset` with `__len__`, equal shards": "iterable_dataset",
    "`IterableDataset` without `__len__`": "iterable_dataset_unsized",
    "unequal batches per rank (`use_distributed_sampler=False`, 10 and 6 batches)": "unequal_batches",
    "BatchNorm layers": "batchnorm",
}


def test_documented_table_is_this_matrix():
    """Every cell of the documentation's table says what MATRIX asserts ("not covered" where it runs nothing)."""
    text = PAGE.read_text()
    start = text.index("| feature |")
    lines = [line for line in text[start : text.index("\n\n", start)].splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    columns = [PAGE_COLUMNS[name] for name in header[1:]]
    rows = {}
    for line in lines[1:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        rows[PAGE_ROWS[cells[0]]] = dict(zip(columns, cells[1:]))
    assert set(rows) == set(MATRIX)
    for cell, by_column in rows.items():
        for column, text_cell in by_column.items():
            expected = MATRIX[cell].get(column)
            if expected is None:
                assert text_cell.startswith("not covered") or (cell == "batchnorm" and text_cell.startswith("works")), \
                    (cell, column, text_cell)
            else:
                assert text_cell.startswith("works" if expected == WORKS else "refused"), (cell, column, text_cell)
