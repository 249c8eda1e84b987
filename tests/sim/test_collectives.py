"""The simulator's ring collectives: duration from the ring's formula, bytes as the Communicator counts them,
and the same duration as a ring of real chunk messages through the network model."""

import pytest
import torch

from lightning_dist.sim import NetworkModel, Simulator

MEGABIT = 1e6 / 8  # bytes per second in one Mbit/s


def run_collective(network, joins, nbytes, kind="all_reduce", payloads=None):
    """Nodes join one collective at the virtual times ``joins``; returns {node: (finish time, result)}, the
    simulator and the calls of ``combine``."""
    simulator = Simulator(network)
    members = list(range(len(joins)))
    finished = {}
    calls = []

    def combine(values):
        calls.append(list(values))
        return sum(values)

    def program(node):
        yield node.sleep(joins[node.index])
        payload = payloads[node.index] if payloads else node.index + 1
        if kind == "all_reduce":
            result = yield from node.all_reduce("c", members, payload, combine, nbytes=nbytes)
        else:
            result = yield from node.all_gather("c", members, payload, nbytes=nbytes)
        finished[node.index] = (node.now, result)

    for index in members:
        simulator.add_node(f"n{index}", program)
    simulator.run()
    return finished, simulator, calls


@pytest.mark.parametrize(
    "members, nbytes, network, rate",
    [
        (5, 12_345, NetworkModel(latency=0.003, node_mbit=8), 8 * MEGABIT),
        (3, 1_000_001, NetworkModel(latency=0.0005, node_mbit=100, link_mbit=10), 10 * MEGABIT),
        (7, 4_800_000, NetworkModel(latency=0.0, node_mbit=20), 20 * MEGABIT),
        (4, 999, NetworkModel(latency=0.01, link_mbit=3), 3 * MEGABIT),
    ],
)
def test_all_reduce_takes_the_ring_time_after_the_last_member_joins(members, nbytes, network, rate):
    joins = [0.5 * index for index in range(members)][::-1]  # the last to join is node 0, at 0
    joins[1] = 1.7
    finished, _, _ = run_collective(network, joins, nbytes)
    ring = 2 * (members - 1) / members * nbytes / rate + 2 * (members - 1) * network.latency
    for index in range(members):
        assert finished[index][0] == pytest.approx(max(joins) + ring, rel=1e-12)
        assert finished[index][1] == sum(range(1, members + 1))


def test_two_members_on_half_duplex_links_take_turns_on_their_one_link():
    network = NetworkModel(latency=0.002, node_mbit=16, half_duplex_links=True)
    finished, _, _ = run_collective(network, [0.0, 0.0], 3_000)
    # 2 (N - 1) = 2 steps; in each both 1500-byte chunks cross the one link, one after the other.
    assert finished[0][0] == pytest.approx(2 * (2 * 1_500 / (16 * MEGABIT) + 0.002))
    full_duplex, _, _ = run_collective(NetworkModel(latency=0.002, node_mbit=16), [0.0, 0.0], 3_000)
    assert full_duplex[0][0] == pytest.approx(2 * (1_500 / (16 * MEGABIT) + 0.002))


def test_all_reduce_counts_bytes_and_messages_as_the_communicator_does():
    finished, simulator, calls = run_collective(NetworkModel(node_mbit=100), [0.0, 0.1, 0.2], 1_001)
    network = simulator.network
    # Ring total 2 (m - 1) |t| = 4004 bytes, 1334 per rank, the remainder 2 on the first member.
    assert network.bytes_sent == [1336, 1334, 1334]
    assert network.messages_sent == [4, 4, 4]
    assert calls == [[1, 2, 3]]  # combined once, in member order


def test_all_gather_returns_every_payload_in_member_order_after_the_ring_time():
    network = NetworkModel(latency=0.004, node_mbit=12)
    payloads = [torch.tensor([2.0]), torch.tensor([5.0]), torch.tensor([7.0]), torch.tensor([11.0])]
    finished, simulator, _ = run_collective(network, [0.3, 0.0, 0.1, 0.2], 8, kind="all_gather", payloads=payloads)
    for index in range(4):
        time, gathered = finished[index]
        assert time == pytest.approx(0.3 + 3 * (8 / (12 * MEGABIT) + 0.004))
        assert [value.item() for value in gathered] == [2.0, 5.0, 7.0, 11.0]
    assert simulator.network.bytes_sent == [24] * 4 and simulator.network.messages_sent == [3] * 4


def test_members_must_agree_on_the_collective():
    simulator = Simulator(NetworkModel())

    def program(node):
        members = [0, 1] if node.index == 0 else [0, 1, 2]
        yield from node.all_reduce("c", members, 1.0, sum, nbytes=8)

    for index in range(3):
        simulator.add_node(f"n{index}", program)
    with pytest.raises(ValueError, match="collective 'c'"):
        simulator.run()


def message_ring_finish(network, members, nbytes, joins):
    """The textbook ring as real messages: 2 (N - 1) steps, each rank sends one nbytes / N chunk to rank - 1 and
    waits for the chunk from rank + 1 before the next step (reduce-scatter, then all-gather)."""
    simulator = Simulator(network)
    chunk = nbytes // members
    finished = {}

    def program(node):
        yield node.sleep(joins[node.index])
        for step in range(2 * (members - 1)):
            node.send((node.index - 1) % members, None, tag=step, nbytes=chunk)
            yield node.recv(source=(node.index + 1) % members, tag=step)
        finished[node.index] = node.now

    for index in range(members):
        simulator.add_node(f"n{index}", program)
    simulator.run()
    return max(finished.values()), simulator.network.total_bytes


@pytest.mark.parametrize(
    "members, network",
    [
        (3, NetworkModel(latency=0.002, node_mbit=10)),
        (4, NetworkModel(latency=0.0007, node_mbit=100, link_mbit=25)),
        (5, NetworkModel(latency=0.001, node_mbit=7, half_duplex_links=True)),
        (2, NetworkModel(latency=0.003, node_mbit=10)),
        (2, NetworkModel(latency=0.0, node_mbit=10, half_duplex_links=True)),
    ],
)
def test_analytic_ring_equals_the_ring_of_chunk_messages_when_all_start_together(members, network):
    nbytes = 60_000 * members
    expected, message_bytes = message_ring_finish(network, members, nbytes, [0.0] * members)
    finished, simulator, _ = run_collective(network, [0.0] * members, nbytes)
    assert finished[0][0] == pytest.approx(expected, rel=1e-12)
    assert simulator.network.total_bytes == message_bytes


@pytest.mark.parametrize("latency", [0.0005, 0.01])
def test_analytic_ring_bounds_the_message_ring_of_two_on_a_half_duplex_link(latency):
    network = NetworkModel(latency=latency, node_mbit=10, half_duplex_links=True)
    messages, _ = message_ring_finish(network, 2, 120_000, [0.0, 0.0])
    finished, _, _ = run_collective(network, [0.0, 0.0], 120_000)
    assert messages <= finished[0][0] <= messages + 2 * latency + 2 * 60_000 / (10 * MEGABIT)
