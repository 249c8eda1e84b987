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


# --------------------------------------------------------------- the language-model configs (configs/lm)

LM_CONFIGS = ("ddp", "periodic_avg", "fedavg", "dynamic_avg", "segmented_gossip", "downpour_sgd", "diloco")


def parse(*args: str):
    """The Trainer, model and data module ``lightning-dist fit`` would build from ``args`` (no fit)."""
    from lightning_dist.cli import DistCLI

    return DistCLI(subclass_mode_model=True, subclass_mode_data=True, run=False, args=list(args))


def test_every_lm_config_is_tested():
    assert sorted(path.stem for path in (REPO / "configs" / "lm").glob("*.yaml")) == sorted(LM_CONFIGS)


@pytest.mark.parametrize("config", LM_CONFIGS)
def test_lm_config_builds_the_workload(config):
    import torch
    import yaml
    from lightning.pytorch.strategies import DDPStrategy

    import lightning_dist
    from lightning_dist.data import StdlibTextDataModule
    from lightning_dist.models import TransformerLM

    path = REPO / "configs" / "lm" / f"{config}.yaml"
    assert path.read_text().splitlines()[0] == f"# lightning-dist fit --config configs/lm/{config}.yaml"
    cli = parse("--config", str(path))
    model, datamodule, trainer = cli.model, cli.datamodule, cli.trainer
    assert isinstance(model, TransformerLM) and isinstance(datamodule, StdlibTextDataModule)
    # vocab_size and block_size reach the model from the data module (the configs do not set them on the model)
    assert not {"vocab_size", "block_size"} & set(yaml.safe_load(path.read_text())["model"]["init_args"])
    assert (model.hparams.vocab_size, model.hparams.block_size) == (256, datamodule.block_size) == (256, 128)
    assert model.num_parameters == 1_298_880
    assert (datamodule.partition, trainer.max_steps) == ("contiguous", 300)
    assert trainer.num_devices == (4 if config == "fedavg" else 2)
    strategy = trainer.strategy
    expected = {
        "ddp": DDPStrategy, "periodic_avg": lightning_dist.PeriodicAveragingStrategy,
        "fedavg": lightning_dist.PeriodicAveragingStrategy, "dynamic_avg": lightning_dist.DynamicAveragingStrategy,
        "segmented_gossip": lightning_dist.SegmentedGossipStrategy, "downpour_sgd": lightning_dist.DownpourSGDStrategy,
        "diloco": lightning_dist.PeriodicAveragingStrategy,
    }[config]
    assert type(strategy) is expected
    if config == "diloco":  # DiLoCo's outer step: SGD, Nesterov momentum 0.9, lr 0.7, every 50 steps
        assert strategy.period == 50
        outer = strategy.outer_optimizer([torch.zeros(1, requires_grad=True)])
        assert isinstance(outer, torch.optim.SGD)
        assert {key: outer.defaults[key] for key in ("lr", "momentum", "nesterov")} == dict(
            lr=0.7, momentum=0.9, nesterov=True)


@pytest.mark.parametrize(("args", "expected"), [
    # The MLP family: num_features / num_classes from the data module (digits: 64 features; the model's default is 40).
    (("--config", "configs/periodic_avg.yaml", "--data", "lightning_dist.data.DigitsDataModule"),
     {"num_features": 64, "num_classes": 10}),
    # The language model: vocab_size / block_size from the data module.
    (("--config", "configs/lm/ddp.yaml", "--data.init_args.block_size=64"), {"vocab_size": 256, "block_size": 64}),
    # Mixed pairs: each link whose source or target is missing is skipped, the model keeps its defaults.
    (("--config", "configs/lm/ddp.yaml", "--data", "lightning_dist.data.DigitsDataModule"),
     {"vocab_size": 256, "block_size": 128}),
    (("--config", "configs/periodic_avg.yaml", "--data", "lightning_dist.data.StdlibTextDataModule"),
     {"num_features": 40, "num_classes": 10}),
    # A user's module and data module with none of the four names.
    (("--config", "configs/lm/ddp.yaml", "--model", "helpers.user_models.DigitsCNN",
      "--data", "helpers.user_models.DigitsImages"), {"lr": 0.01}),
])
def test_data_sizes_are_linked_to_the_model_when_both_sides_have_them(args, expected, monkeypatch):
    monkeypatch.chdir(REPO)  # the configs' paths are relative to the repository
    model = parse(*args).model
    assert {key: model.hparams[key] for key in expected} == expected


def test_lm_configs_fit_on_two_processes(tmp_path):
    """configs/lm/ddp.yaml and dynamic_avg.yaml, 20 steps each, one torchrun launch: every rank ends with the same
    weights, validation ran on the linked model and fell far below the untrained ln(256), the ranks read
    disjoint contiguous halves of the training windows."""
    import math

    import torch

    from helpers.launch import load_results, run_ranks

    configs = [str(REPO / "configs" / "lm" / f"{name}.yaml") for name in ("ddp", "dynamic_avg")]
    overrides = ["--trainer.max_steps=20", "--trainer.val_check_interval=20", "--trainer.num_sanity_val_steps=0",
                 "--trainer.logger=false", "--trainer.enable_checkpointing=false",
                 "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
    run_ranks(2, "lm_fit", {"configs": configs, "overrides": overrides}, tmp_path, timeout=240)
    ranks = load_results(tmp_path, 2)
    for name in ("ddp", "dynamic_avg"):
        first, second = ranks[0][name], ranks[1][name]
        assert first["global_step"] == second["global_step"] == 20
        assert torch.equal(first["vector"], second["vector"]) and bool(torch.isfinite(first["vector"]).all())
        assert first["num_parameters"] == 1_298_880 and first["hparams"]["block_size"] == 128
        assert first["metrics"]["val_loss"] == second["metrics"]["val_loss"] < 4.0 < math.log(256)
        assert first["metrics"]["val_bpc"] == pytest.approx(first["metrics"]["val_loss"] / math.log(2))
        windows = first["corpus"]["train_windows"]
        assert torch.equal(torch.cat([first["part"], second["part"]]), torch.arange(windows))
    assert ranks[0]["dynamic_avg"]["comm"].bytes_sent > 0


TORCHRUN_ENV = {"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "ROLE_RANK": "0", "WORLD_SIZE": "6",
                "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                "TORCHELASTIC_RUN_ID": "elastic", "TORCHELASTIC_RESTART_COUNT": "1"}


def test_under_torchrun_the_trainer_takes_the_topology_the_rendezvous_admitted(monkeypatch):
    """An elastic --nnodes=1:4 run restarted with 3 nodes of 2: the config sets devices only, num_nodes comes from torchrun."""
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    trainer = parse("--config", str(REPO / "configs" / "dynamic_avg.yaml")).trainer
    assert (trainer.num_devices, trainer.num_nodes, trainer.world_size) == (2, 3, 6)
    # A value given on the command line wins (Lightning's launcher checks it against torchrun's world size).
    assert parse("--config", str(REPO / "configs" / "dynamic_avg.yaml"), "--trainer.num_nodes=2").trainer.num_nodes == 2


def test_outside_torchrun_the_trainer_topology_is_the_configs(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    trainer = parse("--config", str(REPO / "configs" / "dynamic_avg.yaml")).trainer
    assert (trainer.num_devices, trainer.num_nodes) == (2, 1)
