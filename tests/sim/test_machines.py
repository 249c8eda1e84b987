"""Machines of several ranks in the simulator's network and collectives, against hand-computed times and bytes:
a machine's ranks share its interface, the ranks of one machine talk over their own intra-node link, a learner
machine all-gathers what reaches it."""

import json
import math
from pathlib import Path

import pytest

from lightning_dist.cli import main
from lightning_dist.sim import Churn, NetworkModel, PeriodicAveraging
from lightning_dist.sim.network_model import ring_all_gather_seconds
from lightning_dist.sim.machines import Machines
from sim.helpers import ring, run, simulation

MB = 1_000_000
INTER = NetworkModel(latency=0.001, node_mbit=8)  # 1 MB/s per machine interface
INTRA = NetworkModel(latency=0.0001, node_mbit=80)  # 10 MB/s between two ranks of a machine


@pytest.mark.parametrize(
    ("members", "step", "inter_share"),
    [
        # Contiguous by machine: edges 0->3 and 2->1 cross (one chunk out of each machine), 1->0 and 3->2 stay inside.
        ([0, 1, 2, 3], max(0.1 + 0.001, 0.01 + 0.0001), 2),
        # Interleaved: every edge crosses, and machine 0's interface carries the chunks of ranks 0 and 1 each step.
        ([0, 2, 1, 3], 2 * 0.1 + 0.001, 4),
    ],
    ids=["contiguous", "interleaved"],
)
def test_a_flat_ring_over_two_machines_of_two_ranks_shares_each_machines_interface(members, step, inter_share):
    machines = Machines(INTER, INTRA, ranks_per_node=2, ranks=4)
    records, network = run(machines, [ring(members, 4 * 100_000)] * 4)
    assert records == {member: pytest.approx(6 * step, rel=1e-12) for member in members}  # 2 (N - 1) steps
    total = 2 * 3 * 400_000  # the ring's bytes, counted as the Communicator does
    assert network.bytes_sent == [total // 4] * 4
    inter = total * inter_share // 4
    assert network.bytes_by_level == {"inter_node": inter, "intra_node": total - inter}


def test_a_ring_inside_one_machine_goes_at_the_intra_node_rate():
    machines = Machines(INTER, INTRA, ranks_per_node=4, ranks=4)
    records, network = run(machines, [ring([0, 1, 2, 3], 400_000)] * 4)
    assert records == {member: pytest.approx(6 * (0.01 + 0.0001), rel=1e-12) for member in range(4)}
    assert network.bytes_by_level == {"inter_node": 0, "intra_node": 2 * 3 * 400_000}


def test_two_members_on_two_machines_take_turns_on_a_half_duplex_link():
    """Gloo's two-member rule, now between machines: both directions of the step cross one link."""
    inter = NetworkModel(latency=0.001, node_mbit=8, half_duplex_links=True)
    records, _ = run(Machines(inter, INTRA, ranks_per_node=2, ranks=4), [ring([0, 2], 200_000)] * 4)
    assert records == {0: pytest.approx(2 * (2 * 0.1 + 0.001)), 2: pytest.approx(2 * (2 * 0.1 + 0.001))}


def test_two_pairs_of_ranks_between_two_machines_are_two_connections_on_half_duplex_links():
    """The contiguous ring's crossing edges 0->3 and 2->1 are two pairs of processes: each takes its own turns, so
    a step is one chunk through each interface, as with full-duplex links (the measured 4-rank periodic round on
    2 x 2 ranks: 3.3 s at 20 Mbit/s, 1.5 models' time)."""
    inter = NetworkModel(latency=0.001, node_mbit=8, half_duplex_links=True)
    records, _ = run(Machines(inter, INTRA, ranks_per_node=2, ranks=4), [ring([0, 1, 2, 3], 400_000)] * 4)
    assert records == {member: pytest.approx(6 * (0.1 + 0.001), rel=1e-12) for member in range(4)}


def test_two_learners_of_two_ranks_do_not_take_turns():
    """Between two learner machines each of the L slice pairs takes turns on its own, and together they fill both
    directions of the interface: a 2-member ring step is one chunk, then the machine's all-gather."""
    inter = NetworkModel(latency=0.001, node_mbit=8, half_duplex_links=True)
    machines = Machines(inter, INTRA, ranks_per_node=2, ranks=4, hierarchy="node")
    records, _ = run(machines, [ring([0, 1], 200_000)] * 2)
    gather = ring_all_gather_seconds(INTRA, 2, 100_000)
    assert records == {node: pytest.approx(2 * (0.1 + 0.001) + gather, rel=1e-12) for node in (0, 1)}


def sends(transfers):
    """Every node posts its ``(source, target, nbytes)`` transfers at 0; records each arrival time by index."""

    def program(node, records):
        for index, (source, target, nbytes) in enumerate(transfers):
            if source == node.index:
                node.send(target, None, tag=index, nbytes=nbytes).callbacks.append(
                    lambda _event, index=index: records.__setitem__(index, node.now))
        yield node.sleep(0)

    return program


def test_transfers_out_of_one_machine_queue_for_its_interface_and_transfers_inside_it_do_not():
    network = NetworkModel(latency=0.1, node_mbit=8)
    transfers = [(0, 2, MB), (1, 3, MB), (0, 1, MB), (2, 0, MB)]
    records, counted = run(Machines(network, INTRA, ranks_per_node=2, ranks=4), [sends(transfers)] * 4)
    # Rank 1's transfer waits for rank 0's on machine 0's interface; rank 0's to rank 1 goes at the intra rate.
    assert records == {0: pytest.approx(1.1), 1: pytest.approx(2.1), 2: pytest.approx(0.1 + 0.0001),
                       3: pytest.approx(1.1)}
    assert counted.bytes_by_level == {"inter_node": 3 * MB, "intra_node": MB}
    assert counted.bytes_sent == [2 * MB, MB, MB, 0]


def test_what_reaches_a_learner_of_several_ranks_waits_for_its_machines_all_gather():
    """Two learners of 3 ranks and a server node: a message to a learner arrives after its machine's all-gather of
    3 chunks of ceil(nbytes / 3) bytes; one to the server (a machine of one rank) does not."""
    network = NetworkModel(latency=0.1, node_mbit=8)
    machines = Machines(network, INTRA, ranks_per_node=3, ranks=6, hierarchy="node")
    records, counted = run(machines, [sends([(0, 1, MB), (1, 2, MB)])] * 3)
    chunk = math.ceil(MB / 3)
    assert records == {0: pytest.approx(1.1 + ring_all_gather_seconds(INTRA, 3, chunk), rel=1e-12),
                       1: pytest.approx(1.1, rel=1e-12)}
    assert counted.bytes_sent == [MB, MB, 0]
    assert counted.bytes_by_level == {"inter_node": 2 * MB, "intra_node": 2 * 3 * chunk}


def test_flat_runs_count_bytes_by_level_and_report_the_machines():
    sim = simulation(PeriodicAveraging(period=5, topology="strategy"), workers=4, max_steps=10, ranks_per_node=2,
                     intra_node=INTRA)
    result = sim.run()
    levels = sim.simulator.network.bytes_by_level
    # Two rounds of a ring over ranks 0..3, contiguous by machine: half of its edges cross between machines.
    assert levels["inter_node"] == levels["intra_node"] == result.summary["bytes"] // 2 > 0
    summary = result.summary
    assert summary["bytes_by_level"] == levels and summary["workers"] == summary["num_learners"] == 4
    assert (summary["ranks_per_node"], summary["hierarchy"]) == (2, None)
    assert summary["intra_node"] == {"latency": 0.0001, "node_mbit": 80.0, "link_mbit": None,
                                     "half_duplex_links": False}
    last = result.rows[-1]
    assert (last["bytes_inter_node"], last["bytes_intra_node"]) == (levels["inter_node"], levels["intra_node"])
    single = simulation(PeriodicAveraging(period=5, topology="strategy"), workers=4, max_steps=10).run()
    assert "bytes_inter_node" not in single.rows[-1]
    assert single.summary["bytes_by_level"] == {"intra_node": 0, "inter_node": single.summary["bytes"]}


@pytest.mark.parametrize(
    ("arguments", "message"),
    [({"workers": 6, "ranks_per_node": 4}, "workers must be a multiple of ranks_per_node"),
     ({"workers": 4, "ranks_per_node": 0}, "ranks_per_node must be an integer >= 1"),
     ({"workers": 4, "ranks_per_node": 2, "hierarchy": "rack"}, "hierarchy must be None or one of 'node'")],
)
def test_bad_machine_layouts_are_refused_by_name(arguments, message):
    with pytest.raises(ValueError, match=message):
        simulation(PeriodicAveraging(), max_steps=4, **arguments)


def test_churn_is_refused_with_several_ranks_per_machine():
    with pytest.raises(ValueError, match="churn needs ranks_per_node=1"):
        simulation(PeriodicAveraging(), workers=4, max_steps=4, ranks_per_node=2,
                   churn=Churn(absences={1: [(0.01, None)]}))


def test_simulate_takes_machines_from_the_config(tmp_path):
    config = Path(__file__).resolve().parents[2] / "configs/sim/periodic.yaml"
    small = ["--workers", "4", "--max_steps", "4", "--eval_every", "2", "--model.init_args.hidden_size", "16"]
    main(["simulate", "--config", str(config), *small, "--ranks_per_node", "2", "--hierarchy", "node",
          "--intra_node", '{"latency": 0.00001, "node_mbit": 1000}', "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["workers"], summary["num_learners"], summary["ranks_per_node"]) == (4, 2, 2)
    assert summary["intra_node"]["node_mbit"] == 1000 and summary["bytes_by_level"]["intra_node"] > 0
    with pytest.raises(ValueError, match="workers must be a multiple of ranks_per_node"):
        main(["simulate", "--config", str(config), *small, "--ranks_per_node", "3", "--out", str(tmp_path / "bad")])
