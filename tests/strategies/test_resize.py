"""Which saved rank each rank takes after when a checkpoint is resumed at another world size (one process)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dist.comm import CommStats
from lightning_dist.comm.nodes import NodeLayout
from lightning_dist.strategies._resize import followed_saved_rank, learner_groups, resized_comm_stats


def test_resized_comm_stats_keep_the_total():
    """Counters at another world size: own ones kept, new ranks at zero, the dropped ranks' added to rank 0's."""
    saved = []
    for rank, nbytes in enumerate((100, 20, 3)):
        stats = CommStats(syncs=7)
        stats.record("protocol", nbytes, rank + 1)
        saved.append(stats.state_dict())
    shrunk = [resized_comm_stats(saved, rank, 2) for rank in range(2)]
    assert [s.protocol_bytes for s in shrunk] == [103, 20] and [s.messages for s in shrunk] == [4, 2]
    grown = [resized_comm_stats(saved, rank, 4) for rank in range(4)]
    assert [s.protocol_bytes for s in grown] == [100, 20, 3, 0] and all(s.syncs == 7 for s in grown)


def test_the_ranks_of_a_node_take_after_one_saved_learner_on_every_layout_change():
    """The layouts of issue 40, by hand: 2 x 2 -> 1 x 4 (all four ranks after old node 0, whose two ranks hold one
    optimizer state), flat 4 -> 2 x 2 (node n after old rank n), 2 x 2 -> flat 4 (rank r after old node r mod 2),
    2 x 3 -> 3 x 2 (node n after old node n mod 2), 2 x 2 -> 1 x 3 and flat 3 -> flat 5 (r mod 3, as before)."""
    two_by_two, flat4 = learner_groups(4, [[0, 1], [2, 3]]), learner_groups(4, None)
    assert [followed_saved_rank(r, learner_groups(4, [[0, 1, 2, 3]]), two_by_two) for r in range(4)] == [0, 1, 0, 1]
    assert [followed_saved_rank(r, two_by_two, flat4) for r in range(4)] == [0, 0, 1, 1]
    assert [followed_saved_rank(r, flat4, two_by_two) for r in range(4)] == [0, 2, 0, 2]
    two_by_three = learner_groups(6, [[0, 1, 2], [3, 4, 5]])
    three_by_two = learner_groups(6, [[0, 1], [2, 3], [4, 5]])
    assert [followed_saved_rank(r, three_by_two, two_by_three) for r in range(6)] == [0, 1, 3, 4, 0, 1]
    assert [followed_saved_rank(r, learner_groups(3, [[0, 1, 2]]), two_by_two) for r in range(3)] == [0, 1, 0]
    assert [followed_saved_rank(r, learner_groups(5, None), learner_groups(3, None)) for r in range(5)] == [
        0, 1, 2, 0, 1]
    assert [followed_saved_rank(r, flat4, flat4) for r in range(4)] == [0, 1, 2, 3]


def layouts(max_nodes: int = 5, max_per_node: int = 4):
    """Hypothesis: a layout as ``(world_size, nodes or None)``, nodes numbered block-wise or cyclically."""
    def build(nodes, per_node, flat, cyclic):
        world = nodes * per_node
        if flat:
            return world, None
        node_of = [rank % nodes if cyclic else rank // per_node for rank in range(world)]
        return world, [list(ranks) for ranks in NodeLayout.from_node_ranks(node_of).nodes]
    return st.builds(build, st.integers(1, max_nodes), st.integers(1, max_per_node), st.booleans(), st.booleans())


@settings(max_examples=200, deadline=None)
@given(now=layouts(), saved=layouts())
def test_property_node_mates_follow_one_saved_learner(now, saved):
    """Any layout change: every rank follows an existing saved rank; the ranks of one learner follow ranks of one
    saved learner (which share one optimizer state), learner i the saved learner i mod K."""
    learners, saved_learners = learner_groups(*now), learner_groups(*saved)
    for index, ranks in enumerate(learners):
        followed = {followed_saved_rank(rank, learners, saved_learners) for rank in ranks}
        assert followed <= set(saved_learners[index % len(saved_learners)])
    assert learners == learner_groups(*now) and sorted(r for ranks in learners for r in ranks) == list(range(now[0]))


def test_a_strategy_without_a_resize_rule_refuses_another_world_size_by_name():
    """Every strategy of the package says how its protocol state carries over; a user's subclass that does not is
    refused by name before anything is loaded (no process group needed: the world size is devices * num_nodes)."""
    from lightning_dist.strategies import LocalUpdateStrategy

    class OwnProtocol(LocalUpdateStrategy):
        def after_local_step(self, step: int) -> None:
            pass

    strategy = OwnProtocol(parallel_devices=[torch.device("cpu")] * 2)
    with pytest.raises(ValueError) as refused:
        strategy.resized_protocol_state({}, written_by=3)
    assert str(refused.value) == (
        "OwnProtocol cannot resume at another world size: it does not say how its protocol state carries over "
        "(override resized_protocol_state); the checkpoint was written by 3 processes, this run has 2 "
        "(devices * num_nodes)"
    )


def test_downpour_keeps_the_server_and_resets_its_per_worker_buffers():
    """3 -> 2: the global model, version and counters are kept; each worker's buffer entry is the global model's
    buffers (the server's buffers are the mean of the entries, so unchanged), and the next push replaces one entry:
    buffers = mean(pushed, global's) as for a worker's first push in a new run."""
    from lightning_dist.algorithms.parameter_server import GlobalModel, push_message
    from lightning_dist.strategies._downpour_resize import whole_server_state

    start = torch.tensor([1.0, 2.0, 10.0, 20.0])  # two parameters, then two buffers
    saved = GlobalModel(start, num_parameters=2, workers=3)
    for rank, buffers in enumerate(([12.0, 26.0], [16.0, 20.0], [11.0, 23.0])):
        local = torch.tensor([1.0 + rank, 2.0, *buffers])
        saved.push(push_message(local, saved.vector, 2), saved.version, rank)
    state = {"server": saved.state_dict()}
    assert not torch.equal(state["server"]["worker_buffers"][0], state["server"]["worker_buffers"][1])
    workers = [{"pushes": 1, "rejected_pushes": 0} for _ in range(3)]  # flat: no server shards

    server = GlobalModel(torch.zeros(4), num_parameters=2, workers=2)
    server.load_state_dict(whole_server_state(state["server"], workers, numel=4, learners=2))
    assert torch.equal(server.vector, saved.vector) and server.version == saved.version == 3
    assert server.accepted == 3 and server.staleness_max == saved.staleness_max
    assert torch.equal(server.vector[2:], torch.tensor([13.0, 23.0]))  # the three workers' mean
    assert torch.equal(server.worker_buffers, torch.tensor([[13.0, 23.0], [13.0, 23.0]]))
    server.push(push_message(torch.tensor([0.0, 0.0, 17.0, 27.0]), server.vector, 2), server.version, 1)
    assert torch.equal(server.vector[2:], torch.tensor([15.0, 25.0]))


def test_dynamic_averaging_at_another_world_size_starts_from_the_consensus_as_after_a_full_synchronization():
    """3 -> 2: every replica holds the checkpoint's consensus, so the reference becomes it and the violation counter
    0 (a check right after the resume must not synchronize identical models); the threshold, measured or set, and the
    counts are kept."""
    from torch import nn

    from lightning_dist.model_vector import ModelVector
    from lightning_dist.strategies import DynamicAveragingStrategy

    strategy = DynamicAveragingStrategy(parallel_devices=[torch.device("cpu")] * 2)
    module = nn.Linear(3, 1)
    strategy._vector = ModelVector(module)
    consensus = torch.tensor([0.5, -1.0, 2.0, 0.25])
    strategy.model_vector.set(consensus)
    saved = {"reference": torch.zeros(4), "divergence_threshold": 3.5, "violation_counter": 2, "checks": 9,
             "violations": 4, "full_syncs": 2, "partial_syncs": 1}
    resized = strategy.resized_protocol_state(saved, written_by=3)
    assert torch.equal(resized["reference"], consensus) and resized["violation_counter"] == 0
    assert {key: resized[key] for key in saved if key not in ("reference", "violation_counter")} == {
        key: value for key, value in saved.items() if key not in ("reference", "violation_counter")}
    strategy.load_protocol_state_dict(resized)
    assert strategy.threshold == 3.5
