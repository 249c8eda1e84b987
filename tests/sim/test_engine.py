"""Virtual nodes: send/recv/recv_nowait/execute/sleep, and the speed model."""

import pytest
import torch

from lightning_dist.sim import NetworkModel, Simulator, SpeedModel, payload_bytes


def test_recv_blocks_until_the_message_arrives_and_matches_source_and_tag():
    simulator = Simulator(NetworkModel(latency=0.5))
    seen = []

    def sender(node):
        yield node.sleep(1.0)
        node.send(1, "second", tag="b")
        node.send(1, "first", tag="a")

    def receiver(node):
        assert node.recv_nowait() is None
        message = yield node.recv(source=0, tag="a")
        seen.append((node.now, message.payload, message.source, message.sent_at))
        message = yield node.recv(tag="b")
        seen.append((node.now, message.payload, message.source, message.sent_at))

    simulator.add_node("sender", sender)
    simulator.add_node("receiver", receiver)
    assert simulator.run() == pytest.approx(1.5)
    assert seen == [(1.5, "first", 0, 1.0), (1.5, "second", 0, 1.0)]


def test_recv_nowait_takes_an_arrived_message_only():
    simulator = Simulator(NetworkModel(latency=1.0))
    polls = []

    def sender(node):
        node.send(1, torch.ones(3), tag="x")
        yield node.sleep(0)

    def receiver(node):
        polls.append(node.recv_nowait(tag="x"))
        yield node.sleep(2.0)
        polls.append(node.recv_nowait(tag="x"))
        polls.append(node.recv_nowait(tag="x"))

    simulator.add_node("sender", sender)
    simulator.add_node("receiver", receiver)
    simulator.run()
    assert polls[0] is None and polls[2] is None
    assert torch.equal(polls[1].payload, torch.ones(3)) and polls[1].nbytes == 12


def test_execute_runs_the_function_and_advances_virtual_time_by_the_speed_model():
    speed = SpeedModel(step_seconds=0.2, aggregate_seconds=0.05, slowdown={1: 3.0})
    simulator = Simulator(NetworkModel(), speed)
    finished = {}

    def program(node):
        value = yield from node.execute(lambda x: x * 2, 21)
        aggregated = yield from node.execute(sum, [1, 2], kind="aggregate")
        finished[node.index] = (node.now, value, aggregated)

    simulator.add_node("fast", program)
    simulator.add_node("straggler", program)
    simulator.run()
    assert finished[0] == (pytest.approx(0.25), 42, 3)
    assert finished[1] == (pytest.approx(0.75), 42, 3)


def test_measured_execute_uses_wall_time():
    simulator = Simulator(NetworkModel())
    finished = []

    def program(node):
        yield from node.execute(torch.randn(200, 200).matmul, torch.randn(200, 200))
        finished.append(node.now)

    simulator.add_node("n", program)
    simulator.run()
    node = simulator.nodes[0]
    assert finished[0] == node.wall_compute_seconds > 0


def test_jitter_is_seeded_per_node_and_bounded():
    durations = [SpeedModel(step_seconds=1.0, jitter=0.5, seed=3).duration(0, "step", 0.0) for _ in range(2)]
    model = SpeedModel(step_seconds=1.0, jitter=0.5, seed=3)
    sequence = [model.duration(0, "step", 0.0) for _ in range(50)]
    assert durations[0] == durations[1] == sequence[0]
    assert all(0.5 <= value <= 1.5 for value in sequence) and len(set(sequence)) > 1


def test_an_update_is_inside_a_modelled_step_and_takes_its_own_time_when_measured():
    """DDP's optimizer update after the all-reduce: a modelled step_seconds already holds it."""
    assert SpeedModel(step_seconds=0.2, aggregate_seconds=0.1).duration(3, "update", 0.05) == 0.0
    assert SpeedModel(aggregate_seconds=0.1, slowdown={3: 2.0}).duration(3, "update", 0.05) == 0.1
    assert SpeedModel(step_seconds=0.2).modelled("update") and not SpeedModel(aggregate_seconds=0.1).modelled("update")


@pytest.mark.parametrize(
    ("arguments", "name"),
    [({"step_seconds": -1.0}, "step_seconds"), ({"aggregate_seconds": float("inf")}, "aggregate_seconds"),
     ({"slowdown": {2: 0.0}}, "slowdown"), ({"jitter": 1.0}, "jitter")],
)
def test_bad_speed_model_is_refused_by_name(arguments, name):
    with pytest.raises(ValueError, match=name):
        SpeedModel(**arguments)


def test_payload_bytes_counts_tensors_and_scalars():
    assert payload_bytes((torch.zeros(10, dtype=torch.float32), 3)) == 48
    assert payload_bytes({"a": torch.zeros(2, dtype=torch.float64), "b": [1.0, True]}) == 32
    with pytest.raises(TypeError, match="nbytes"):
        payload_bytes(object())


def test_execute_makes_its_effect_visible_when_its_interval_ends():
    simulator = Simulator(NetworkModel(), SpeedModel(step_seconds=1.0, aggregate_seconds=0.0))
    state, seen = {"steps": 0}, []

    def worker(node):
        yield from node.execute(state.update, {"steps": 1})

    def observer(node):
        yield node.sleep(0.5)
        seen.append(state["steps"])  # the step runs from 0 to 1: not done yet
        yield node.sleep(0.6)
        seen.append(state["steps"])

    simulator.add_node("worker", worker)
    simulator.add_node("observer", observer)
    simulator.run()
    assert seen == [0, 1]
