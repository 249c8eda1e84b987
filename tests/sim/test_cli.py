"""``lightning-dist simulate --config``: a YAML run writes its CSV, JSON and PNG; bad input fails fast."""

import json
from pathlib import Path

import pytest

from lightning_dist.cli import main

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--workers", "3", "--max_steps", "6", "--eval_every", "3", "--model.init_args.hidden_size", "16"]


def test_simulate_runs_a_config_and_writes_its_outputs(tmp_path, capsys):
    out = tmp_path / "run"
    main(["simulate", "--config", str(REPO / "configs/sim/segmented_gossip.yaml"), *SMALL,
          "--protocol", '{"name": "segmented_gossip", "segments": 2, "replicas": 2, "period": 3}', "--out", str(out)])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["protocol"]["name"] == "segmented_gossip" and summary["workers"] == 3
    assert summary["steps"] == 18 and summary["bytes"] > 0
    header = (out / "metrics.csv").read_text().splitlines()[0]
    assert {"time", "steps", "bytes", "val_loss", "val_acc"} <= set(header.split(","))
    assert (out / "workers.csv").exists() and (out / "curves.png").stat().st_size > 10_000
    assert '"virtual_seconds"' in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(path.name for path in (REPO / "configs/sim").glob("*.yaml")))
def test_every_shipped_sim_config_parses_and_runs_briefly(tmp_path, name):
    main(["simulate", "--config", str(REPO / "configs/sim" / name), *SMALL, "--max_virtual_seconds", "0.5",
          "--out", str(tmp_path)])
    assert json.loads((tmp_path / "summary.json").read_text())["workers"] == 3


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["--protocol", '{"name": "ring_allreduce"}'], "protocol must be one of"),
        (["--network.node_mbit", "0"], "node_mbit"),
        (["--network.latency", "-0.1"], "latency"),
        (["--workers", "0"], "workers"),
    ],
)
def test_simulate_refuses_bad_input_by_name(tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        main(["simulate", "--config", str(REPO / "configs/sim/segmented_gossip.yaml"), *override,
              "--out", str(tmp_path)])
    assert not (tmp_path / "summary.json").exists()


def test_simulate_takes_a_churn_schedule(tmp_path):
    main(["simulate", "--config", str(REPO / "configs/sim/periodic.yaml"), *SMALL, "--out", str(tmp_path),
          "--churn", '{"absences": {"1": [[0.0, 0.02]], "2": [[0.01, null]]}}'])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["churn"]["churning"] == [1, 2]
    assert summary["churn"]["leaves"] == 1 and summary["churn"]["joins"] == 1
    assert "present" in (tmp_path / "workers.csv").read_text().splitlines()[0].split(",")


@pytest.mark.parametrize(
    ("churn", "message"),
    [
        ('{"fraction": 2, "leave_rate": 1}', r"churn.fraction must lie in \[0, 1\]"),
        ('{"fraction": 0.5, "rate": 1}', "churn takes absences, fraction, leave_rate, mean_absence and seed"),
        ('{"absences": {"7": [[1, 2]]}}', r"churn.absences names worker 7; workers are in \[0, 2\]"),
    ],
)
def test_simulate_refuses_a_bad_churn_schedule_by_name(tmp_path, churn, message):
    with pytest.raises(ValueError, match=message):
        main(["simulate", "--config", str(REPO / "configs/sim/periodic.yaml"), *SMALL, "--churn", churn,
              "--out", str(tmp_path)])
    assert not (tmp_path / "summary.json").exists()


def test_simulate_computes_the_workers_together_with_batched_workers(tmp_path):
    runs = {}
    for batched in ([], ["--batched_workers", "8"]):
        out = tmp_path / str(bool(batched))
        main(["simulate", "--config", str(REPO / "configs/sim/periodic.yaml"), *SMALL, *batched, "--out", str(out)])
        runs[bool(batched)] = json.loads((out / "summary.json").read_text())
    assert runs[False]["batched"] is None
    assert runs[True]["batched"] == {"batched_workers": 8, "steps": 18, "calls": runs[True]["batched"]["calls"]}
    assert runs[True]["bytes"] == runs[False]["bytes"]
    assert runs[True]["final"]["val_loss"] == pytest.approx(runs[False]["final"]["val_loss"], abs=1e-5)
