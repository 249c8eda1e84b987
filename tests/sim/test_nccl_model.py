"""NCCL's collectives in the simulator (``collectives="nccl"``, :mod:`lightning_dist.sim.nccl`) against times computed
by hand from its formulas: ring and tree at a small and a large message, NCCL's choice between them and its crossover,
the same time as Gloo's ring where both run the same ring, DDP on 1024 ranks, and bad values refused by name."""

import json
from pathlib import Path

import pytest

from lightning_dist.cli import main
from lightning_dist.sim import DataParallel, NetworkModel, SpeedModel, nccl
from lightning_dist.sim.machines import Machines
from lightning_dist.sim.network_model import ring_all_gather_seconds, ring_all_reduce_seconds
from sim.helpers import ring, run, simulation

REPO = Path(__file__).resolve().parents[2]
MB = 1_000_000
NETWORK = NetworkModel(latency=0.001, node_mbit=10)  # between machines: 1 ms a hop, 1.25 MB/s
INTRA = NetworkModel(latency=0.00001, node_mbit=800)  # inside a machine: 10 us a hop, 100 MB/s
FLAT = [1] * 8  # 8 ranks, each a machine of its own
MACHINES = [8] * 4  # 4 machines of 8 ranks


@pytest.mark.parametrize(
    ("layout", "nbytes", "ring", "tree", "chosen"),
    [
        # Flat: the ring's 14 hops all cross machines, chunks of S / 8; the tree's 2 log2(8) = 6 hops, 2 S at 92%.
        (FLAT, 1_000, 14 * 0.001 + 14 * 125 / 1.25e6, 6 * 0.001 + 2_000 / (0.92 * 1.25e6), "tree"),
        (FLAT, 10 * MB, 14 * 0.001 + 14 * 1.25e6 / 1.25e6, 6 * 0.001 + 20e6 / (0.92 * 1.25e6), "ring"),
        # 4 x 8: the ring's 62 hops, 2 M = 8 of them between machines, chunks of S / 32 at the slower link's rate;
        # the tree's chain of 7 hops inside each machine and log2(4) = 2 between them, up and down.
        (MACHINES, 1_000, 54 * 0.00001 + 8 * 0.001 + 62 * 31.25 / 1.25e6,
         2 * (7 * 0.00001 + 2 * 0.001) + 2_000 / (0.92 * 1.25e6), "tree"),
        (MACHINES, 10 * MB, 54 * 0.00001 + 8 * 0.001 + 62 * 312_500 / 1.25e6,
         2 * (7 * 0.00001 + 2 * 0.001) + 20e6 / (0.92 * 1.25e6), "ring"),
    ],
    ids=["flat-small", "flat-large", "machines-small", "machines-large"],
)
def test_ring_and_tree_all_reduce_times_by_hand_and_nccls_choice(layout, nbytes, ring, tree, chosen):
    assert nccl.ring_all_reduce_seconds(NETWORK, INTRA, layout, nbytes) == pytest.approx(ring, rel=1e-12)
    assert nccl.tree_all_reduce_seconds(NETWORK, INTRA, layout, nbytes) == pytest.approx(tree, rel=1e-12)
    choice, seconds = nccl.all_reduce_seconds(NETWORK, INTRA, layout, nbytes)
    assert choice == chosen and seconds == pytest.approx(min(ring, tree), rel=1e-12)


def test_the_all_gather_is_nccls_ring_by_hand():
    # 4 x 8, 1 MB from each rank: 31 hops, M - 1 = 3 of them between machines, each a whole 1 MB at 1.25 MB/s.
    expected = 28 * 0.00001 + 3 * 0.001 + 31 * MB / 1.25e6
    assert nccl.all_gather_seconds(NETWORK, INTRA, MACHINES, MB) == pytest.approx(expected, rel=1e-12)
    # Inside one machine it goes at the intra rate with the intra latency.
    assert nccl.all_gather_seconds(NETWORK, INTRA, [8], MB) == pytest.approx(7 * 0.00001 + 7 * MB / 1e8, rel=1e-12)


def test_the_tree_is_chosen_below_the_crossover_and_the_ring_above():
    # Flat, N = 8: the tree wins while 2 l (N - 1 - log2 N) > S / B (2 / 0.92 - 2 (N - 1) / N).
    crossover = 2 * 0.001 * 1.25e6 * (7 - 3) / (2 / 0.92 - 2 * 7 / 8)  # 23,589.7 bytes
    ring = nccl.ring_all_reduce_seconds(NETWORK, INTRA, FLAT, crossover)
    assert nccl.tree_all_reduce_seconds(NETWORK, INTRA, FLAT, crossover) == pytest.approx(ring, rel=1e-12)
    assert nccl.all_reduce_seconds(NETWORK, INTRA, FLAT, 0.99 * crossover)[0] == "tree"
    assert nccl.all_reduce_seconds(NETWORK, INTRA, FLAT, 1.01 * crossover)[0] == "ring"
    # The choice depends on the ranks too: 1 MB goes by ring among 8 ranks, by tree among 1024 (2046 latencies).
    assert nccl.all_reduce_seconds(NETWORK, INTRA, FLAT, MB)[0] == "ring"
    choice, seconds = nccl.all_reduce_seconds(NETWORK, INTRA, [1] * 1024, MB)
    assert choice == "tree" and seconds == pytest.approx(20 * 0.001 + 2 * MB / (0.92 * 1.25e6), rel=1e-12)


@pytest.mark.parametrize("ranks", [2, 5, 16])
@pytest.mark.parametrize(
    "network",
    [NETWORK, NetworkModel(latency=0.003, node_mbit=100, link_mbit=10)],
    ids=["node-cap", "node-and-link-caps"],
)
def test_nccls_ring_is_gloos_ring_with_one_rank_per_machine(ranks, network):
    layout = [1] * ranks
    assert nccl.ring_all_reduce_seconds(network, INTRA, layout, 3 * MB) == pytest.approx(
        ring_all_reduce_seconds(network, ranks, 3 * MB), rel=1e-12)
    assert nccl.all_gather_seconds(network, INTRA, layout, MB) == pytest.approx(
        ring_all_gather_seconds(network, ranks, MB), rel=1e-12)


def collective_times(machines, members, nbytes, kind):
    """When each member of one collective of ``kind`` gets its result, and the network's byte counts."""
    return run(machines, [ring(members, nbytes, kind)] * machines.workers)


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather"])
@pytest.mark.parametrize(
    ("network", "intra", "ranks_per_node"),
    [
        (NETWORK, INTRA, 1),  # flat: the same ring, every hop between machines
        # Two machines of two ranks, no latency: both rings are bound by the interface, one chunk a step.
        (NetworkModel(node_mbit=10), NetworkModel(node_mbit=800), 2),
    ],
    ids=["flat", "machines-without-latency"],
)
def test_a_simulated_collective_under_nccl_takes_gloos_time_where_both_run_the_same_ring(
        kind, network, intra, ranks_per_node):
    """A large message, so NCCL picks its ring; the bytes are counted the same way under both models."""
    runs = {}
    for model in ("gloo_ring", "nccl"):
        machines = Machines(network, intra, ranks_per_node=ranks_per_node, ranks=4, collectives=model)
        runs[model] = collective_times(machines, [0, 1, 2, 3], 4 * MB, kind)
    (gloo, gloo_network), (nccl_done, nccl_network) = runs["gloo_ring"], runs["nccl"]
    assert nccl_done == {member: pytest.approx(seconds, rel=1e-12) for member, seconds in gloo.items()}
    assert nccl_network.bytes_sent == gloo_network.bytes_sent
    assert nccl_network.bytes_by_level == gloo_network.bytes_by_level


def test_ddp_on_1024_ranks_with_small_gradients_steps_sooner_under_nccl():
    """A tiny MLP's gradients (a few KB) among 1024 ranks: Gloo's ring pays 2046 latencies, NCCL's tree 20."""
    results = {}
    for model in ("gloo_ring", "nccl"):
        sim = simulation(DataParallel(), workers=1024, max_steps=1, eval_every=1, evaluate_workers=False,
                         network=NetworkModel(latency=0.001, node_mbit=100),
                         speed=SpeedModel(step_seconds=0.01, aggregate_seconds=0.0), collectives=model)
        results[model] = sim.run().summary
    gradient_bytes = sim.replicas[0].gradient_bytes
    rate = 100e6 / 8
    gloo = 0.01 + 2 * 1023 * (0.001 + gradient_bytes / 1024 / rate)
    tree = 0.01 + 2 * 10 * 0.001 + 2 * gradient_bytes / (0.92 * rate)
    assert results["gloo_ring"]["virtual_seconds"] == pytest.approx(gloo, rel=1e-12)
    assert results["nccl"]["virtual_seconds"] == pytest.approx(tree, rel=1e-12)
    assert results["nccl"]["virtual_seconds"] <= results["gloo_ring"]["virtual_seconds"]
    assert results["nccl"]["bytes"] == results["gloo_ring"]["bytes"] == 2 * 1023 * gradient_bytes
    assert (results["gloo_ring"]["collectives"], results["nccl"]["collectives"]) == ("gloo_ring", "nccl")


@pytest.mark.parametrize("value", ["mpi", "NCCL", "ring", None, 1])
def test_an_unknown_collective_model_is_refused_by_name(value):
    message = r"collectives must be one of 'gloo_ring', 'nccl'"
    with pytest.raises(ValueError, match=message):
        simulation(DataParallel(), collectives=value)
    with pytest.raises(ValueError, match=message):
        Machines(NETWORK, collectives=value)


def test_simulate_takes_the_collective_model_from_its_config(tmp_path):
    config = ["simulate", "--config", str(REPO / "configs/sim/ddp.yaml"), "--workers", "3", "--max_steps", "2",
              "--eval_every", "2", "--model.init_args.hidden_size", "16"]
    with pytest.raises(ValueError, match="collectives must be one of 'gloo_ring', 'nccl'"):
        main([*config, "--collectives", "mpi", "--out", str(tmp_path)])
    assert not (tmp_path / "summary.json").exists()
    main([*config, "--collectives", "nccl", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "summary.json").read_text())["collectives"] == "nccl"
