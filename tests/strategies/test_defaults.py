"""Defaults that run anywhere (issue 29): every strategy name trains with its defaults on 2 ranks, as a newcomer writes
``Trainer(strategy="segmented_gossip", devices=2)``; a default that depends on the world size adapts to it, an
explicit impossible value is still refused by name."""

import lightning as L
import pytest
import torch

import lightning_dist
from helpers.launch import load_results, run_ranks
from lightning_dist.algorithms.segmented_gossip import default_replicas

NAMES = ["dynamic_avg", "periodic_avg", "fedavg", "downpour_sgd", "segmented_gossip"]
RANKS = 2


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    """One launch of 2 processes: each name as a plain string, 2 epochs of the digits MLP."""
    out = tmp_path_factory.mktemp("defaults")
    runs = [{"name": name, "strategy": name} for name in NAMES]
    run_ranks(RANKS, "fit", {"trainer": {"max_epochs": 2}, "runs": runs}, out)
    return {name: load_results(out / name, RANKS) for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_every_strategy_name_trains_with_its_defaults_on_two_ranks(fits, name):
    results = fits[name]
    for result in results:
        assert result["error"] is None, result["error"]
        assert result["global_step"] > 0
        assert torch.isfinite(result["vector"]).all()
    # Every strategy ends fit on one model (the consensus, or DownpourSGD's global model) on every rank.
    assert torch.equal(results[0]["vector"], results[1]["vector"])
    assert results[0]["callback_metrics"]["val_acc"] > 0.3  # it learned: 10 classes, chance is 0.1


def test_segmented_gossip_replicas_default_to_the_peers_there_are():
    """Paper 002's R = 2 where there are 2 peers or more, else as many as there are; never above an explicit R."""
    assert [default_replicas(peers) for peers in (1, 2, 3, 7)] == [1, 2, 2, 2]
    strategy = lightning_dist.SegmentedGossipStrategy()
    L.Trainer(strategy=strategy, devices=2, accelerator="cpu", logger=False)
    assert strategy.replicas == 1
    with pytest.raises(ValueError, match=r"replicas must be an integer in \[1, 1\] .* got 2 with world_size=2"):
        L.Trainer(strategy=lightning_dist.SegmentedGossipStrategy(replicas=2), devices=2, accelerator="cpu",
                  logger=False)
    with pytest.raises(ValueError, match=r"hierarchy='node' needs num_nodes >= 2: .* got num_nodes=1"):
        L.Trainer(strategy=lightning_dist.SegmentedGossipStrategy(hierarchy="node"), devices=2, accelerator="cpu",
                  logger=False)
