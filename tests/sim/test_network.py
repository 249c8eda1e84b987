"""The network model against hand-computed transfer times (paper 001's serialized ports, paper 002's caps)."""

import pytest

from lightning_dist.sim import NetworkModel, Simulator

MB = 1_000_000


def arrival_times(model: NetworkModel, sends: list[tuple[int, int, int]], num_nodes: int) -> list[float]:
    """Post every ``(source, target, nbytes)`` at time 0 from node ``source``; return each arrival time."""
    simulator = Simulator(model)
    arrivals: dict[int, float] = {}

    def program(node):
        for index, (source, target, nbytes) in enumerate(sends):
            if source == node.index:
                event = node.send(target, None, tag=index, nbytes=nbytes)
                event.callbacks.append(lambda _event, index=index: arrivals.__setitem__(index, simulator.env.now))
        yield node.sleep(0)

    for index in range(num_nodes):
        simulator.add_node(f"n{index}", program)
    simulator.run()
    return [arrivals[index] for index in range(len(sends))]


def test_lone_transfer_takes_latency_plus_bytes_over_bandwidth():
    # 1 MB at 8 Mbit/s = 1 s, plus 0.25 s latency.
    assert arrival_times(NetworkModel(latency=0.25, node_mbit=8), [(0, 1, MB)], 2) == [pytest.approx(1.25)]


def test_sends_to_several_targets_are_serialized_without_a_link_cap():
    times = arrival_times(NetworkModel(latency=0.1, node_mbit=8), [(0, 1, MB), (0, 2, MB), (0, 3, MB)], 4)
    # One port: transmissions back to back; each arrives latency after its last byte left.
    assert times == [pytest.approx(1.1), pytest.approx(2.1), pytest.approx(3.1)]


def test_receives_from_several_sources_are_serialized():
    times = arrival_times(NetworkModel(node_mbit=8), [(1, 0, MB), (2, 0, MB)], 3)
    assert sorted(times) == [pytest.approx(1.0), pytest.approx(2.0)]


def test_node_cap_over_link_cap_gives_parallel_lanes_at_link_speed():
    # 100 / 10 Mbit/s: 10 lanes of 10 Mbit/s. 12 transfers of 1.25 MB (1 s each): 10 at once, then 2.
    model = NetworkModel(node_mbit=100, link_mbit=10)
    assert model.lanes == 10
    times = arrival_times(model, [(0, target, 1_250_000) for target in range(1, 13)], 13)
    assert times[:10] == [pytest.approx(1.0)] * 10
    assert times[10:] == [pytest.approx(2.0)] * 2


def test_only_link_caps_leave_every_link_independent():
    model = NetworkModel(link_mbit=8)
    assert model.lanes is None
    times = arrival_times(model, [(0, 1, MB), (0, 2, MB), (3, 1, MB), (0, 1, MB)], 4)
    # Each link carries one transfer at a time; the second 0 -> 1 transfer waits for the first.
    assert times == [pytest.approx(1.0), pytest.approx(1.0), pytest.approx(1.0), pytest.approx(2.0)]


def test_half_duplex_links_carry_one_direction_at_a_time():
    full = arrival_times(NetworkModel(link_mbit=8), [(0, 1, MB), (1, 0, MB)], 2)
    half = arrival_times(NetworkModel(link_mbit=8, half_duplex_links=True), [(0, 1, MB), (1, 0, MB)], 2)
    assert full == [pytest.approx(1.0), pytest.approx(1.0)]
    assert sorted(half) == [pytest.approx(1.0), pytest.approx(2.0)]


def test_a_busy_receiver_does_not_hold_up_the_senders_other_transfers():
    # Node 2 receives from node 0 first (posted first); node 1's transfer to 2 must wait for it, but
    # node 1's later transfer to 3 goes ahead (paper 001's Sender Walker skips busy destinations).
    model = NetworkModel(node_mbit=8)
    times = arrival_times(model, [(0, 2, MB), (1, 2, MB), (1, 3, MB)], 4)
    assert times == [pytest.approx(1.0), pytest.approx(2.0), pytest.approx(1.0)]


def test_unlimited_network_delivers_after_the_latency_only():
    assert arrival_times(NetworkModel(latency=0.5), [(0, 1, 10 * MB), (0, 2, 10 * MB)], 3) == [0.5, 0.5]


@pytest.mark.parametrize(
    ("arguments", "name"),
    [
        ({"node_mbit": 0}, "node_mbit"),
        ({"node_mbit": -5}, "node_mbit"),
        ({"link_mbit": 0.0}, "link_mbit"),
        ({"link_mbit": float("inf")}, "link_mbit"),
        ({"latency": -0.001}, "latency"),
        ({"latency": float("nan")}, "latency"),
    ],
)
def test_bad_network_parameters_are_refused_by_name(arguments, name):
    with pytest.raises(ValueError, match=name):
        NetworkModel(**arguments)


@pytest.mark.parametrize("half_duplex", [False, True])
def test_random_traffic_respects_the_caps_is_greedy_and_first_come_first_served(half_duplex):
    # 6 nodes, 3 lanes per port (30 / 10 Mbit/s), 80 transfers of random sizes posted at random times.
    import random

    model = NetworkModel(latency=0.01, node_mbit=30, link_mbit=10, half_duplex_links=half_duplex)
    rng = random.Random(7)
    plan = []
    for _ in range(80):
        source = rng.randrange(6)
        target = rng.choice([node for node in range(6) if node != source])
        plan.append((rng.uniform(0, 2), source, target, rng.randrange(1, 5) * 125_000))
    simulator = Simulator(model)
    records = []

    def program(node):
        for posted, source, target, nbytes in sorted(plan):
            if source != node.index:
                continue
            yield node.sleep(posted - node.now)
            event = node.send(target, None, nbytes=nbytes)
            record = {"posted": posted, "source": source, "target": target, "nbytes": nbytes}
            records.append(record)
            event.callbacks.append(lambda _event, record=record: record.__setitem__("arrived", simulator.env.now))

    for index in range(6):
        simulator.add_node(f"n{index}", program)
    simulator.run()
    for record in records:
        record["end"] = record["arrived"] - model.latency
        record["start"] = record["end"] - model.transmission_seconds(record["nbytes"])
        record["link"] = frozenset((record["source"], record["target"])) if half_duplex else (
            record["source"], record["target"])
        assert record["start"] >= record["posted"] - 1e-9

    def full_on(t, record):
        """Whether one of the record's sender, receiver or link is fully used just after time t."""
        active = [other for other in records if other["start"] <= t + 1e-9 and other["end"] > t + 1e-9]
        return (
            sum(other["source"] == record["source"] for other in active) >= model.lanes
            or sum(other["target"] == record["target"] for other in active) >= model.lanes
            or any(other["link"] == record["link"] for other in active)
        )

    times = sorted({value for record in records for value in (record["posted"], record["start"], record["end"])})
    for record in records:
        # Never more than `lanes` transfers per port, one per link.
        at_start = [o for o in records if o["start"] <= record["start"] + 1e-9 < o["end"]]
        assert sum(o["source"] == record["source"] for o in at_start) <= model.lanes
        assert sum(o["target"] == record["target"] for o in at_start) <= model.lanes
        assert sum(o["link"] == record["link"] for o in at_start) == 1
        # Greedy: while it waited, something it needed was busy.
        for t in times:
            if record["posted"] <= t < record["start"] - 1e-9:
                assert full_on(t, record), (record, t)
    # First come, first served between the same sender and receiver (which need the same resources).
    for first in records:
        for second in records:
            same_pair = (first["source"], first["target"]) == (second["source"], second["target"])
            if same_pair and first["posted"] < second["posted"]:
                assert first["start"] <= second["start"] + 1e-9
