"""`lightning-dist fit --config configs/<strategy>.yaml` runs a real 2-process fit, as a user runs it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("config", ["dynamic_avg", "periodic_avg", "fedavg", "downpour_sgd"])
def test_config_runs(tmp_path, config):
    command = [sys.executable, "-m", "lightning_dist.cli", "fit", "--config", str(REPO / "configs" / f"{config}.yaml"),
               "--trainer.max_steps=12", "--trainer.devices=2", "--trainer.enable_progress_bar=false",
               f"--trainer.default_root_dir={tmp_path}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-5000:]
    assert "`Trainer.fit` stopped: `max_steps=12` reached." in result.stderr + result.stdout
    (metrics,) = tmp_path.rglob("metrics.csv")  # the default CSVLogger: tensorboard is not a dependency
    header = metrics.read_text().splitlines()[0].split(",")
    assert {"comm/bytes_sent", "comm/bytes_protocol", "comm/syncs", "train_loss"} <= set(header)
