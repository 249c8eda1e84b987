"""`lightning-dist fit --config configs/<strategy>.yaml` runs a real 2-process fit, as a user runs it."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


# datagossip.yaml runs past its first epoch (45 local batches per rank), so records are exchanged;
# cdgrab.yaml past its first (44 batches), so the callback logs its metrics and orders epoch 2.
@pytest.mark.parametrize(("config", "max_steps"), [
    ("dynamic_avg", 12), ("periodic_avg", 12), ("fedavg", 12), ("downpour_sgd", 12), ("datagossip", 60),
    ("segmented_gossip", 12), ("cdgrab", 60),
])
def test_config_runs(tmp_path, config, max_steps):
    command = [sys.executable, "-m", "lightning_dist.cli", "fit", "--config", str(REPO / "configs" / f"{config}.yaml"),
               f"--trainer.max_steps={max_steps}", "--trainer.devices=2", "--trainer.enable_progress_bar=false",
               f"--trainer.default_root_dir={tmp_path}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-5000:]
    assert f"`Trainer.fit` stopped: `max_steps={max_steps}` reached." in result.stderr + result.stdout
    (metrics,) = tmp_path.rglob("metrics.csv")  # the default CSVLogger: tensorboard is not a dependency
    rows = list(csv.DictReader(metrics.read_text().splitlines()))
    if config == "cdgrab":  # Lightning's DDP: the callback's traffic is the only one counted
        # Logged by rank 0, the order server, which sends no differences: after the first epoch,
        # one broadcast round to the other rank (signs of 44 * 8 pairs x 2 ranks, the running sum
        # of the MLP's parameters, pairs done and 2 first-non-finite steps).
        parameters = 64 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10
        sent = [float(row["cdgrab/bytes_sent"]) for row in rows if row.get("cdgrab/bytes_sent")]
        assert sent and sent[0] == 44 * 8 * 2 + parameters * 4 + (1 + 2) * 8
        return
    assert {"comm/bytes_sent", "comm/bytes_protocol", "comm/syncs", "train_loss"} <= set(rows[0])
    if config == "datagossip":
        exchanges = [float(row["gossip/exchanges"]) for row in rows if row.get("gossip/exchanges")]
        foreign = [float(row["gossip/foreign_batches"]) for row in rows if row.get("gossip/foreign_batches")]
        assert exchanges and max(exchanges) >= 1 and max(foreign) >= 1


DILOCO_YAML = """
trainer:
  accelerator: cpu
  devices: 2
  strategy:
    class_path: lightning_dist.{strategy}
    init_args:
      outer_optimizer: {outer}
model:
  class_path: lightning_dist.models.MLPClassifier
data:
  class_path: lightning_dist.data.datamodules.DigitsDataModule
"""


@pytest.mark.parametrize("strategy", ["PeriodicAveragingStrategy", "DynamicAveragingStrategy"])
@pytest.mark.parametrize("outer", [
    "{class_path: torch.optim.SGD, init_args: {lr: 0.7, momentum: 0.9, nesterov: true}}",
    "lightning_dist.algorithms.outer.diloco_outer_optimizer",
])
def test_outer_optimizer_parses_inside_the_strategy_from_yaml(tmp_path, strategy, outer):
    """DiLoCo's outer optimizer written in a LightningCLI YAML (class_path/init_args, as for Lightning's
    OptimizerCallable, or a function's import path) reaches the strategy as a factory of SGD(0.7, Nesterov 0.9)."""
    import torch

    from lightning_dist.cli import DistCLI

    config = tmp_path / "diloco.yaml"
    config.write_text(DILOCO_YAML.format(strategy=strategy, outer=outer))
    cli = DistCLI(subclass_mode_model=True, subclass_mode_data=True, args=["--config", str(config)], run=False)
    assert type(cli.trainer.strategy).__name__ == strategy
    optimizer = cli.trainer.strategy.outer_optimizer([torch.zeros(3)])
    assert isinstance(optimizer, torch.optim.SGD)
    assert (optimizer.defaults["lr"], optimizer.defaults["momentum"], optimizer.defaults["nesterov"]) == (0.7, 0.9, True)
