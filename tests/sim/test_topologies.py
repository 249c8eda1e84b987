"""Protocols with ``topology="strategy"``: the same models as the server topology, with the messages and the time
of what the lightning_dist strategy moves (ring all-reduce; for a subset of workers, a reduce into the members'
chunks and an all-gather of the mean's chunks, with no hot spot)."""

import pytest
import torch

from lightning_dist.algorithms.averaging import weighted_average
from lightning_dist.algorithms.subset_average import (
    PARTIAL,
    WHOLE,
    average_subset,
    gather_pieces,
    piece_bytes,
    round_pieces,
)
from lightning_dist.sim import (
    DynamicAveraging,
    NetworkModel,
    NonFiniteModelError,
    ParameterServer,
    PeriodicAveraging,
    SegmentedGossip,
    SpeedModel,
)
from sim.helpers import simulation
from sim.test_protocols import PoisonWorker, PushWorkerZero

MEGABIT = 1e6 / 8
STEP, AGGREGATE, LATENCY, MBIT = 0.01, 0.003, 0.002, 4
ONE_LANE = NetworkModel(latency=LATENCY, node_mbit=MBIT)
TWO_LANES = NetworkModel(latency=LATENCY, node_mbit=2 * MBIT, link_mbit=MBIT)
"""Each port carries two transfers at once at ``MBIT``: a member of a set of 3 sends (receives) its two pieces of a
phase side by side, so a phase takes one piece's time and one latency whatever order the members post in."""


def run(protocol, workers, max_steps, network=ONE_LANE):
    sim = simulation(protocol, workers=workers, max_steps=max_steps, network=network,
                     speed=SpeedModel(step_seconds=STEP, aggregate_seconds=AGGREGATE))
    return sim, sim.run()


class Snapshots(PeriodicAveraging):
    """Keeps every worker's model as it enters each round."""

    def setup(self, simulation):
        super().setup(simulation)
        self.snapshots = {}

    def after_step(self, node, rank, step):
        if step % self.period == 0:
            self.snapshots.setdefault(step, {})[rank] = self.simulation.replicas[rank].get()
        yield from super().after_step(node, rank, step)


def test_periodic_all_reduce_gives_the_server_topologys_models_in_the_ring_time():
    workers, period, rounds = 5, 3, 2
    server_sim, _ = run(PeriodicAveraging(period=period), workers, period * rounds)
    protocol = Snapshots(period=period, topology="strategy")
    sim, result = run(protocol, workers, period * rounds)
    for replica, reference in zip(sim.replicas, server_sim.replicas):
        assert torch.equal(replica.get(), reference.get())
    mean = weighted_average([protocol.snapshots[period][rank] for rank in range(workers)])
    assert not torch.equal(protocol.snapshots[period][0], mean)
    model_bytes = sim.replicas[0].get().nbytes  # float32: the sum travels in float32 too
    ring = 2 * (workers - 1) / workers * model_bytes / (MBIT * MEGABIT) + 2 * (workers - 1) * LATENCY
    assert result.summary["virtual_seconds"] == pytest.approx(rounds * (period * STEP + ring), rel=1e-12)
    assert sim.simulator.network.total_bytes == rounds * 2 * (workers - 1) * model_bytes
    assert len(sim.simulator.nodes) == workers  # no server node
    # The server topology's first round: 5 uploads into the server's port, one aggregation, 5 downloads out of it.
    transfer = model_bytes / (MBIT * MEGABIT)
    server_round = workers * transfer + LATENCY + AGGREGATE + workers * transfer + LATENCY
    _, one_round = run(PeriodicAveraging(period=period), workers, period)
    assert one_round.summary["virtual_seconds"] == pytest.approx(period * STEP + server_round)
    assert server_round > 1.5 * ring


@pytest.mark.parametrize(("workers", "network"), [(6, TWO_LANES), (4, ONE_LANE)])
def test_fedavg_as_the_strategy_meets_for_the_flags_then_averages_in_the_participants_chunks(workers, network):
    """Half the workers take part. Every worker all-gathers a 1-byte flag; each participant sends every other
    participant that one's chunk of its model, sums its own chunk (one aggregation), then sends its chunk of the
    mean to every other participant. 3 participants on two lanes per port, or 2 on one: a participant's transfers
    of a phase all run at once, so a phase takes one chunk's time and one latency."""
    period = 4
    protocol = Snapshots(period=period, client_fraction=0.5, topology="strategy", seed=1)
    sim, result = run(protocol, workers, period, network)
    participants = protocol.participants(1)
    count = len(participants)
    assert count == workers // 2 and participants[0] != 0
    mean = weighted_average([protocol.snapshots[period][rank] for rank in participants])
    for rank, replica in enumerate(sim.replicas):
        assert torch.equal(replica.get(), mean if rank in participants else protocol.snapshots[period][rank])
    model_bytes = sim.replicas[0].get().nbytes
    assert model_bytes % (4 * count) == 0  # float32 chunks of equal size
    chunk = model_bytes // count
    flags = workers - 1  # every worker all-gathers a 1-byte flag
    # A participant: the other participants' chunks of its model, then its chunk of the mean to each of them,
    # 2 (|P| - 1) / |P| model sizes; no participant sends more than another.
    assert sim.simulator.network.bytes_sent == [
        flags + (2 * (count - 1) * chunk if rank in participants else 0) for rank in range(workers)
    ]
    gather = (workers - 1) * (1 / (MBIT * MEGABIT) + LATENCY)
    phase = chunk / (MBIT * MEGABIT) + LATENCY
    waits = {wait["worker"]: wait["seconds"] for wait in result.waits}
    for rank in range(workers):
        assert waits[rank] == pytest.approx(gather + (phase + AGGREGATE + phase if rank in participants else 0))


@pytest.mark.parametrize(
    ("base", "arguments"),
    [
        (PeriodicAveraging, {"period": 3}),
        (PeriodicAveraging, {"period": 3, "client_fraction": 0.5}),
        (DynamicAveraging, {"divergence_threshold": 0.7, "check_every": 3, "calibration_steps": 3}),
        (DynamicAveraging, {"check_every": 3, "calibration_steps": 3}),  # Delta measured where worker 2 turns NaN
        (SegmentedGossip, {"segments": 2, "replicas": 1, "period": 3}),
    ],
)
def test_a_non_finite_worker_stops_the_strategy_topology_naming_it(base, arguments):
    protocol = type("Poisoned", (PoisonWorker, base), {})(topology="strategy", **arguments)
    with pytest.raises(NonFiniteModelError, match=r"\[2\]|worker 2"):
        simulation(protocol, workers=4, max_steps=6).run()


def test_an_unknown_topology_is_refused_by_name():
    with pytest.raises(ValueError, match="topology must be one of"):
        PeriodicAveraging(topology="ring")


class PushedDynamic(PushWorkerZero):
    """PushWorkerZero (worker 0 moves by a squared distance of 4 at step 5), run as the strategy runs it."""

    def __init__(self, **arguments):
        super().__init__(topology="strategy", **arguments)


def test_dynamic_averaging_as_the_strategy_meets_at_every_check_and_balances_in_the_members_chunks():
    """One violator (worker 0): its own model fails the condition (a round of one moves nothing and decides
    nothing), the next round adds 2 workers. The 2 send each member the piece of their model in its chunk, and
    worker 0 its sum (its own model) likewise; each member sums its chunk (one aggregation); every worker
    all-gathers its 8-byte share of the distance, and the mean of the 3 lies within Delta; each member sends its
    chunk of the mean to the other 2. Every worker all-gathers 8 bytes per check and per decision; only the 3 move
    models, 4/3 of one each (two lanes per port: each phase takes one chunk's time and one latency)."""
    workers = 8
    protocol = PushedDynamic(divergence_threshold=1.0, check_every=5, seed=3)
    sim, result = run(protocol, workers, 10, TWO_LANES)
    assert protocol.counts == {"checks": 2, "violations": 1, "full_syncs": 0, "partial_syncs": 1}
    model_bytes = sim.replicas[0].get().nbytes
    assert model_bytes % (4 * 3) == 0  # float32 chunks of equal size
    chunk = model_bytes // 3
    sent = sim.simulator.network.bytes_sent
    gathers = 3 * (workers - 1) * 8  # two checks, one decision
    added = [rank for rank in range(1, workers) if sent[rank] > gathers]
    members = [0, *added]
    assert len(added) == 2
    # A member: the other two chunks of its model (worker 0: of its one-member sum), then its chunk of the mean
    # twice, 2 (|B| - 1) / |B| model sizes.
    assert sent == [gathers + (4 * chunk if rank in members else 0) for rank in range(workers)]
    expected, _ = average_subset({rank: protocol.before[rank, 5] for rank in members}, [[0], members],
                                 protocol.references[0])
    assert torch.allclose(expected, weighted_average([protocol.before[rank, 5] for rank in members]))
    for rank in range(workers):
        assert torch.equal(protocol.after[rank, 5], expected if rank in members else protocol.before[rank, 5])
    waits = {(wait["worker"], wait["step"]): wait["seconds"] for wait in result.waits}
    starts = {(wait["worker"], wait["step"]): wait["start"] for wait in result.waits}
    gather = (workers - 1) * (8 / (MBIT * MEGABIT) + LATENCY)
    # Step 10 (no violator): the gather ends for everyone when the last arrival's gather would.
    ends = [starts[rank, 10] + waits[rank, 10] for rank in range(workers)]
    assert ends == pytest.approx([max(starts[rank, 10] for rank in range(workers)) + gather] * workers)
    # Step 5, by hand: the distances' gather; the reduce; the owners' aggregation; the decision's gather, which
    # the others join at once and which ends for all when the members join; the members' gather of the mean.
    phase = chunk / (MBIT * MEGABIT) + LATENCY
    decided = gather + phase + AGGREGATE + gather
    for rank in range(workers):
        assert waits[rank, 5] == pytest.approx(decided + (phase if rank in members else 0))


class PushedTwo(DynamicAveraging):
    """Workers 0 and 1 move by the same vector (squared length 4) at step 5, run as the strategy runs it."""

    def __init__(self, **arguments):
        super().__init__(topology="strategy", **arguments)

    def setup(self, simulation):
        super().setup(simulation)
        self.before = {}

    def after_step(self, node, rank, step):
        replica = self.simulation.replicas[rank]
        if rank in (0, 1) and step == 5:
            vector, count = replica.get(), replica.vector.num_parameters
            vector[:count] += (4.0 / count) ** 0.5
            replica.set(vector)
        self.before[rank] = replica.get()
        yield from super().after_step(node, rank, step)


def strategy_counters(workers, rounds, numel, dtype):
    """Bytes and messages per rank that the strategy's ``protocol`` counters record for a partial balancing through
    ``rounds`` (the sets after each round, the first all violators): the check's and each decision's 8-byte
    all-gathers, each round's reduce and the final gather, counted at the sender as ``Communicator.exchange`` does."""
    gathers = 1 + sum(len(members) > 1 for members in rounds)
    sent = [[gathers * (workers - 1) * 8, gathers * (workers - 1)] for _ in range(workers)]
    previous = []
    for members in rounds:
        pieces, whole = round_pieces(members, [rank for rank in members if rank not in previous], numel)
        for piece in pieces:
            if piece.source != piece.destination:
                sent[piece.source][0] += piece_bytes(piece, WHOLE if piece.source in whole else PARTIAL, dtype)
                sent[piece.source][1] += 1
        previous = members
    for piece in gather_pieces(previous, numel):
        sent[piece.source][0] += piece_bytes(piece, WHOLE, dtype)
        sent[piece.source][1] += 1
    return sent


def test_dynamic_averaging_as_the_strategy_sends_what_the_strategys_counters_record_for_a_two_round_balancing():
    """Violators 0 and 1 (round 1: B = [0, 1], their mean still violates) and 4 added workers (round 2: B of 6,
    within Delta), of 14 (6 < 14 / 2: no full synchronisation). By hand, for n float32 elements (n divisible by 6:
    chunks of n / 2, then n / 6): worker 0 sends n / 2 in round 1, then its sum [0, n / 2) less its new chunk
    [0, n / 6), then 5 chunks of the mean: 5 n / 3. Worker 1 sends n / 2, then all of its sum [n / 2, n) (its new
    chunk [n / 6, n / 3) is elsewhere), then 5 chunks: 11 n / 6. An added worker sends 5 chunks of its model and
    5 of the mean: 5 n / 3. Everyone all-gathers 8 bytes three times (the check, two decisions)."""
    workers = 14
    protocol = PushedTwo(divergence_threshold=1.0, check_every=5, seed=0)
    sim, _ = run(protocol, workers, 5)
    assert protocol.counts == {"checks": 1, "violations": 2, "full_syncs": 0, "partial_syncs": 1}
    model = sim.replicas[0].get()
    numel = model.numel()
    assert numel % 6 == 0
    sent = sim.simulator.network.bytes_sent
    gathers = 3 * (workers - 1) * 8
    added = [rank for rank in range(2, workers) if sent[rank] > gathers]
    members = [0, 1, *added]
    assert len(added) == 4
    sixth = 4 * numel // 6  # bytes of n / 6 elements
    sixths = {0: 10, 1: 11, **{rank: 10 for rank in added}}
    assert sent == [gathers + sixths.get(rank, 0) * sixth for rank in range(workers)]
    counters = strategy_counters(workers, [[0, 1], members], numel, model.dtype)
    assert sent == [nbytes for nbytes, _ in counters]
    assert sim.simulator.network.messages_sent == [messages for _, messages in counters]
    expected, _ = average_subset({rank: protocol.before[rank] for rank in members}, [[0, 1], members],
                                 protocol.references[0])
    for rank, replica in enumerate(sim.replicas):
        assert torch.equal(replica.get(), expected if rank in members else protocol.before[rank])


def test_dynamic_averaging_as_the_strategy_all_reduces_a_full_synchronisation_forced_by_the_violation_counter():
    workers = 4
    protocol = DynamicAveraging(divergence_threshold=1e-9, check_every=3, topology="strategy")
    sim, result = run(protocol, workers, 6)
    assert protocol.counts == {"checks": 2, "violations": 8, "full_syncs": 2, "partial_syncs": 0}
    model_bytes = sim.replicas[0].get().nbytes
    per_check = workers * (workers - 1) * 8 + 2 * (workers - 1) * model_bytes  # the gather and the ring
    assert sim.simulator.network.total_bytes == 2 * per_check
    gather = (workers - 1) * (8 / (MBIT * MEGABIT) + LATENCY)
    ring = 2 * (workers - 1) * (model_bytes / workers / (MBIT * MEGABIT) + LATENCY)
    assert result.summary["virtual_seconds"] == pytest.approx(2 * (3 * STEP + gather + ring), rel=1e-12)
    final = sim.replicas[0].get()
    assert all(torch.equal(replica.get(), final) for replica in sim.replicas)
    parameters = final[: sim.replicas[0].vector.num_parameters]
    assert all(torch.equal(reference, parameters) for reference in protocol.references)


@pytest.mark.parametrize("workers", [3, 4])
def test_synchronous_parameter_server_as_the_strategy_serves_from_worker_zeros_node(workers):
    """One round: the other workers' pushes (update + 32-byte header) queue at worker 0's receive port, worker 0's
    own push is a local call, one aggregation, then the server thread's blocking replies in rank order. The global
    model is the server topology's."""
    push_every = 3
    reference, _ = run(ParameterServer(push_every=push_every, synchronous=True), workers, push_every)
    protocol = ParameterServer(push_every=push_every, synchronous=True, topology="strategy")
    sim, result = run(protocol, workers, push_every)
    assert len(sim.simulator.nodes) == workers
    assert torch.equal(protocol.global_model(), reference.protocol.global_model())
    for replica in sim.replicas:
        assert torch.equal(replica.get(), protocol.global_model().to(replica.get().dtype))
    message = sim.replicas[0].get().nbytes + 32
    # Each other worker's last step ends with the strategy's 32-byte DONE header.
    assert sim.simulator.network.bytes_sent == [(workers - 1) * message] + [message + 32] * (workers - 1)
    transfer = message / (MBIT * MEGABIT)
    uploads = (workers - 1) * transfer + LATENCY
    waits = {wait["worker"]: wait["seconds"] for wait in result.waits}
    assert waits[0] == pytest.approx(uploads + AGGREGATE)
    for rank in range(1, workers):
        assert waits[rank] == pytest.approx(uploads + AGGREGATE + rank * (transfer + LATENCY))
    assert sim.simulator.network.total_bytes < reference.simulator.network.total_bytes * (workers - 1) / workers + 1e3


def test_asynchronous_parameter_server_as_the_strategy_costs_worker_zero_no_bytes():
    workers, push_every, steps = 3, 2, 6
    protocol = ParameterServer(push_every=push_every, topology="strategy")
    sim, _ = run(protocol, workers, steps)
    message = sim.replicas[0].get().nbytes + 32
    pushes = steps // push_every
    assert sim.simulator.network.bytes_sent == [(workers - 1) * pushes * message] + [pushes * message + 32] * (workers - 1)
    assert protocol.store.version == workers * pushes


def test_asynchronous_parameter_server_as_the_strategy_takes_one_push_at_a_time():
    """The strategy's server thread reads a push's header, receives its update, replies with a blocking send, and
    only then reads the next header: two remote pushes of one instant take turns with the replies on worker 0's
    interface, so the second worker waits a push and a reply longer than the first, not a push."""
    protocol = ParameterServer(push_every=2, topology="strategy")
    sim, result = run(protocol, 3, 2)
    transfer = (sim.replicas[0].get().nbytes + 32) / (MBIT * MEGABIT)
    waits = sorted(wait["seconds"] for wait in result.waits if wait["worker"] in (1, 2))
    assert waits[1] - waits[0] == pytest.approx(2 * transfer + AGGREGATE + 3 * LATENCY, rel=0.02)
    assert protocol.store.version == 3


def test_parameter_server_as_the_strategy_refuses_max_staleness():
    with pytest.raises(ValueError, match="max_staleness must be None with topology='strategy'"):
        ParameterServer(max_staleness=2, topology="strategy")


def test_segmented_gossip_as_the_strategy_adds_the_finiteness_meeting_before_each_round():
    workers, period, rounds = 5, 3, 2
    reference, reference_result = run(SegmentedGossip(segments=2, replicas=2, period=period), workers, period * rounds)
    protocol = SegmentedGossip(segments=2, replicas=2, period=period, topology="strategy")
    sim, result = run(protocol, workers, period * rounds)
    for replica, expected in zip(sim.replicas, reference.replicas):
        assert torch.equal(replica.get(), expected.get())
    flags = rounds * (workers - 1)  # 1 byte to each other worker per round
    assert sim.simulator.network.bytes_sent == [sent + flags for sent in reference.simulator.network.bytes_sent]
    gather = (workers - 1) * (1 / (MBIT * MEGABIT) + LATENCY)
    assert result.summary["virtual_seconds"] == pytest.approx(
        reference_result.summary["virtual_seconds"] + rounds * gather, rel=1e-9)
