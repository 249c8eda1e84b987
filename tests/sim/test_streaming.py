"""Streaming synchronization in the simulator's periodic averaging and DiLoCo (``fragments``, ``fragment_sync_delay``,
``fragment_update_alpha``; :mod:`lightning_dist.sim.protocols.streaming`): the models Algorithm 1 of Streaming DiLoCo
gives from the same replicas, the blocking synchronization when ``P = 1, tau = 0, alpha = 0``, and the virtual time
``compute + max(0, exchange - tau steps)`` per exchange."""

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from lightning_dist.algorithms.averaging import weighted_average
from lightning_dist.algorithms.compression import compressed_model_mean, compressed_sync_nbytes
from lightning_dist.algorithms.outer import OuterStep, diloco_outer_optimizer
from lightning_dist.algorithms.streaming import merge
from lightning_dist.algorithms.subset_average import chunk_bounds
from lightning_dist.cli import main
from lightning_dist.sim import NetworkModel, NonFiniteModelError, PeriodicAveraging, SpeedModel
from lightning_dist.sim.network_model import ring_all_gather_seconds, ring_all_reduce_seconds
from sim.helpers import simulation
from sim.test_protocols import PoisonWorker
from workers.downpour import BatchNormClassifier

REPO = Path(__file__).resolve().parents[2]
STEP, LATENCY, MBIT = 0.01, 0.002, 4
NETWORK = NetworkModel(latency=LATENCY, node_mbit=MBIT)
SPEED = SpeedModel(step_seconds=STEP, aggregate_seconds=0.0)
LR, MU = 0.7, 0.9
DILOCO = "lightning_dist.algorithms.outer.diloco_outer_optimizer"


class Recording(PeriodicAveraging):
    """Keeps the start model, every worker's model as it enters the protocol after each step and as it leaves it,
    and as it leaves the run (after the end's merge)."""

    def setup(self, simulation):
        super().setup(simulation)
        self.start = simulation.replicas[0].get()
        self.before, self.after, self.final = {}, {}, {}

    def after_step(self, node, rank, step):
        replica = self.simulation.replicas[rank]
        self.before[step, rank] = replica.get()
        yield from super().after_step(node, rank, step)
        self.after[step, rank] = replica.get()

    def finish(self, node, rank):
        yield from super().finish(node, rank)
        self.final[rank] = self.simulation.replicas[rank].get()


class Forced(PeriodicAveraging):
    """The streaming machinery (background exchange, merge) even with ``P = 1, tau = 0, alpha = 0``, which the
    protocol otherwise runs as the blocking synchronization."""

    def setup(self, simulation):
        super().setup(simulation)
        self.streaming = self.streaming_sync()


def run(protocol, workers=3, max_steps=12, model=None, **kwargs):
    sim = simulation(protocol, workers=workers, max_steps=max_steps, network=NETWORK, speed=SPEED, **kwargs)
    if model is not None:
        torch.manual_seed(0)
        sim.model = model
    return sim, sim.run()


def fragments_of(numel, count):
    """``count`` contiguous fragments, sizes differing by at most one, the larger first (written out here)."""
    size, larger = divmod(numel, count)
    bounds, start = [], 0
    for index in range(count):
        stop = start + size + (index < larger)
        bounds.append((start, stop))
        start = stop
    return bounds


def _nesterov(theta, buffer, mean):
    delta = theta - mean
    buffer = delta if buffer is None else MU * buffer + delta
    return theta - LR * (delta + MU * buffer), buffer


# ---------------------------------------------------------------------------------------------- (a) the models


@pytest.mark.parametrize("outer", [None, DILOCO], ids=["averaging", "diloco"])
def test_every_merge_is_algorithm_1_from_the_snapshots_taken_tau_steps_before(outer):
    """3 workers, period 6 in P = 3 fragments (one every 2 steps), tau = 1, alpha = 0.5, 13 steps (the exchange
    started after step 13 is merged at the end). DiLoCo on a BatchNorm model: the last fragment holds the running
    statistics, averaged and not stepped. Every merge, from the recorded replicas:
    theta_p <- mean of the fragment's snapshots after step t - 1 (DiLoCo: Nesterov outer step from theta_p), then
    fragment <- 0.5 local + 0.5 theta_p on every worker; nothing else changes a model."""
    workers, period, count, tau, alpha, steps = 3, 6, 3, 1, 0.5, 13
    stride = period // count
    model = BatchNormClassifier(64, 10, hidden_size=16) if outer else None
    protocol = Recording(period=period, topology="strategy", outer_optimizer=outer, fragments=count,
                         fragment_sync_delay=tau, fragment_update_alpha=alpha)
    sim, _ = run(protocol, workers, steps, model=model)
    start = protocol.start
    size = sim.replicas[0].vector.num_parameters
    bounds = fragments_of(start.numel(), count)
    assert protocol.streaming.bounds == bounds
    if outer:
        assert bounds[-1][0] < size < start.numel()  # the running statistics: the end of the last fragment
    for step in range(1, steps + 1):
        if step % stride:  # no merge: the protocol leaves every model as it is
            assert all(torch.equal(protocol.after[step, rank], protocol.before[step, rank]) for rank in range(workers))
    # The strategy's path, exact: a mean, an OuterStep per fragment, merge(). And by hand in float64.
    steppers = [OuterStep(start[begin:min(stop, size)], diloco_outer_optimizer) for begin, stop in bounds]
    theta = [start[begin:min(stop, size)].double() for begin, stop in bounds]
    momentum = [None] * count
    merges = 0
    for step in range(stride, steps + 2, stride):  # step 14: the end's merge of the exchange started after step 13
        end = step > steps
        fragment = (step // stride - 1) % count
        begin, stop = bounds[fragment]
        parameters = min(stop, size) - begin
        snapshots = [protocol.before[step - tau, rank][begin:stop] for rank in range(workers)]
        mean = weighted_average(snapshots)
        synchronized = mean if not outer else steppers[fragment].step(mean)
        by_hand = torch.stack(snapshots).double().mean(0)
        if outer:
            stepped, momentum[fragment] = _nesterov(theta[fragment], momentum[fragment], by_hand[:parameters])
            torch.testing.assert_close(synchronized[:parameters].double(), stepped, rtol=0, atol=1e-5)
            theta[fragment] = synchronized[:parameters].double()
            # Buffers (only the last fragment has any): averaged, not stepped.
            torch.testing.assert_close(synchronized[parameters:].double(), by_hand[parameters:], rtol=0, atol=1e-6)
            assert (synchronized - mean).abs().max() > 1e-3
        else:
            torch.testing.assert_close(synchronized.double(), by_hand, rtol=0, atol=1e-6)
        for rank in range(workers):
            current = protocol.after[steps, rank] if end else protocol.before[step, rank]
            local = current[begin:stop]
            if not end:
                assert not torch.equal(local, snapshots[rank])  # tau = 1: the snapshot is a step older
            expected = current.clone()
            expected[begin:stop] = merge(local, synchronized, alpha)
            torch.testing.assert_close(expected[begin:stop].double(),
                                       alpha * local.double() + (1 - alpha) * synchronized.double(), rtol=0, atol=1e-6)
            assert not torch.equal(expected[begin:stop], synchronized)  # alpha = 0.5 keeps some of the local
            assert torch.equal(protocol.final[rank] if end else protocol.after[step, rank], expected)
        merges += 1
    assert merges == 7  # after steps 2, 4, ..., 12 and at the end
    assert protocol.metrics() == ({} if not outer else {
        "outer/steps": 7.0,
        "outer/pseudo_gradient_norm": pytest.approx(math.sqrt(sum(float(s.pseudo_gradient_norm) ** 2
                                                                  for s in steppers))),
        "outer/update_norm": pytest.approx(math.sqrt(sum(float(s.update_norm) ** 2 for s in steppers)))})


def test_compressed_fragments_keep_their_own_error_feedback():
    """int8, P = 2, tau = 1, alpha = 0.5: each fragment's exchange is compressed_model_mean of the snapshots' deltas
    from that fragment's last synchronized model, with that fragment's worker and chunk-owner residuals carried from
    its previous exchange."""
    workers, period, count, tau, alpha, steps = 3, 4, 2, 1, 0.5, 12
    stride = period // count
    protocol = Recording(period=period, topology="strategy", compression="int8", fragments=count,
                         fragment_sync_delay=tau, fragment_update_alpha=alpha)
    sim, _ = run(protocol, workers, steps)
    bounds = fragments_of(protocol.start.numel(), count)
    common = [protocol.start[begin:stop] for begin, stop in bounds]
    residuals = [[torch.zeros(stop - begin) for _ in range(workers)] for begin, stop in bounds]
    owners = [[torch.zeros(b - a) for a, b in chunk_bounds(stop - begin, list(range(workers))).values()]
              for begin, stop in bounds]
    for step in range(stride, steps + 1, stride):
        fragment = (step // stride - 1) % count
        begin, stop = bounds[fragment]
        snapshots = [protocol.before[step - tau, rank][begin:stop] for rank in range(workers)]
        mean, residuals[fragment], owners[fragment] = compressed_model_mean(
            snapshots, common[fragment], stop - begin, residuals[fragment], owners[fragment], "int8")
        assert not torch.equal(mean, weighted_average(snapshots))  # compressed: not the exact mean
        common[fragment] = mean
        for rank in range(workers):
            expected = protocol.before[step, rank].clone()
            expected[begin:stop] = merge(expected[begin:stop], mean, alpha)
            assert torch.equal(protocol.after[step, rank], expected)
    assert all(float(residual.abs().max()) > 0 for per_fragment in residuals for residual in per_fragment)


def test_a_fragment_of_buffers_only_is_averaged_without_an_outer_step():
    """A small BatchNorm model (714 parameters, 32 running statistics) in 25 fragments, one a step: the last holds
    running statistics only and has no outer step of its own (as in the strategy); DiLoCo with tau = 0, alpha = 0
    gives it the plain mean of the workers' buffers."""
    protocol = Recording(period=25, topology="strategy", outer_optimizer=DILOCO, fragments=25)
    sim, _ = run(protocol, 3, 25, model=BatchNormClassifier(num_features=64, num_classes=10, hidden_size=8))
    size, numel = sim.replicas[0].vector.num_parameters, protocol.start.numel()
    begin, stop = protocol.streaming.bounds[-1]
    assert size <= begin and stop == numel
    assert protocol.streaming.outers[-1] is None and all(outer is not None for outer in protocol.streaming.outers[:-1])
    mean = weighted_average([protocol.before[25, rank][begin:] for rank in range(3)])
    assert not torch.equal(protocol.before[25, 0][begin:], mean)
    assert all(torch.equal(protocol.after[25, rank][begin:], mean) for rank in range(3))
    assert protocol.metrics()["outer/steps"] == 24.0


# ------------------------------------------------------------------------------------- (b) blocking when P = 1


@pytest.mark.parametrize(("outer", "compression"), [(None, None), (DILOCO, None), (None, "int8"), (DILOCO, "bf16")],
                         ids=["averaging", "diloco", "int8", "diloco-bf16"])
def test_one_fragment_without_delay_or_mixing_is_the_blocking_synchronization(outer, compression):
    """P = 1, tau = 0, alpha = 0 through the streaming machinery (background exchange, merge) against the blocking
    synchronization: the same models bit for bit, after every round and at the end, the same evaluations and
    outer-step metrics. The same virtual time and bytes with compression (whose blocking synchronization checks
    finiteness too); without, the streaming exchange adds what the strategy's adds, the 1-byte finiteness
    all-gather per round, exactly. The protocol runs these arguments as the blocking synchronization."""
    workers, period, rounds = 3, 4, 3
    arguments = dict(period=period, topology="strategy", outer_optimizer=outer, compression=compression)
    blocking_sim, blocking = run(PeriodicAveraging(**arguments), workers, period * rounds)
    streamed_sim, streamed = run(Forced(**arguments), workers, period * rounds)
    assert streamed_sim.protocol.streaming is not None
    for a, b in zip(streamed_sim.replicas, blocking_sim.replicas):
        assert torch.equal(a.get(), b.get())
    flags = 0.0 if compression else ring_all_gather_seconds(NETWORK, workers, 1)
    flag_bytes = 0 if compression else workers * (workers - 1)
    assert len(streamed.rows) == len(blocking.rows)
    for row, reference in zip(streamed.rows, blocking.rows):
        done = int(row["mean_steps"]) // period  # rounds finished before the evaluation
        assert row["time"] == pytest.approx(reference["time"] + done * flags, rel=1e-12, abs=1e-12)
        assert row["bytes"] == reference["bytes"] + done * flag_bytes
        assert {k: v for k, v in row.items() if k not in ("time", "bytes", "messages")} == \
            {k: v for k, v in reference.items() if k not in ("time", "bytes", "messages")}
    if compression:
        assert streamed.summary["virtual_seconds"] == blocking.summary["virtual_seconds"]
    assert streamed.summary["virtual_seconds"] == pytest.approx(blocking.summary["virtual_seconds"] + rounds * flags,
                                                                rel=1e-12)
    assert streamed.summary["bytes"] == blocking.summary["bytes"] + rounds * flag_bytes
    assert streamed.summary["protocol_metrics"] == blocking.summary["protocol_metrics"]
    assert (streamed.summary["protocol_metrics"].get("outer/steps") == rounds) == bool(outer)
    # Given explicitly, the three arguments' defaults run the blocking synchronization itself.
    explicit_sim, explicit = run(PeriodicAveraging(**arguments, fragments=1, fragment_sync_delay=0,
                                                   fragment_update_alpha=0), workers, period * rounds)
    assert explicit_sim.protocol.streaming is None and explicit.rows == blocking.rows


# -------------------------------------------------------------------------------------------- (c) the time


def exchange_seconds(nbytes, workers=3, network=NETWORK):
    """A fragment's exchange: the 1-byte finiteness all-gather, then the ring all-reduce of ``nbytes``."""
    return ring_all_gather_seconds(network, workers, 1) + ring_all_reduce_seconds(network, workers, nbytes)


@pytest.mark.parametrize("compression", [None, "int8"])
@pytest.mark.parametrize("tau", [0, 1, 3])
def test_a_worker_waits_only_for_what_is_left_of_an_exchange_after_tau_steps(tau, compression):
    """3 workers, P = 2 fragments of the 1482-parameter MLP, one every 4 steps, 16 steps: 4 exchanges of X seconds
    (19.9 ms plain, 14.0 ms int8, on 4 Mbit/s with 2 ms latency) and 10 ms steps. tau = 3: X hides behind the 30 ms
    of compute, the run takes the compute time of a run that never synchronizes; tau = 1: each merge waits exactly
    X - 10 ms; tau = 0: each waits X, the blocking time (with one fragment and compression, the blocking run's)."""
    workers, period, count, steps = 3, 8, 2, 16
    protocol = PeriodicAveraging(period=period, topology="strategy", compression=compression, fragments=count,
                                 fragment_sync_delay=tau, fragment_update_alpha=0.5)
    sim, result = run(protocol, workers, steps)
    _, alone = run(PeriodicAveraging(period=100, topology="strategy"), workers, steps)
    compute = alone.summary["virtual_seconds"]
    assert compute == pytest.approx(steps * STEP, rel=1e-12) and alone.summary["bytes"] == 0
    numel = sim.replicas[0].get().numel()
    assert numel == 1482
    nbytes = (4 * numel // count if compression is None
              else compressed_sync_nbytes(numel // count, 0, workers, compression, torch.float32))
    exchange = exchange_seconds(nbytes)
    assert 0.013 < exchange < 0.0205
    wait = max(0.0, exchange - tau * STEP)
    exchanges = steps // (period // count)
    if tau == 3:
        assert wait == 0 and result.summary["virtual_seconds"] == compute  # bit for bit: nothing waited
        assert result.waits == []
    else:
        assert wait > 0.003
        assert result.summary["virtual_seconds"] == pytest.approx(compute + exchanges * wait, rel=1e-12)
        assert sorted((w["worker"], w["step"]) for w in result.waits) == sorted(
            (rank, step) for rank in range(workers) for step in (4, 8, 12, 16))
        assert all(w["seconds"] == pytest.approx(wait, rel=1e-9) for w in result.waits)
    assert result.summary["bytes"] == exchanges * (workers * (workers - 1) + 2 * (workers - 1) * nbytes)
    if tau == 0 and compression:  # one fragment: the blocking compressed synchronization's time, bit for bit
        whole = compressed_sync_nbytes(numel, 0, workers, compression, torch.float32)
        _, one = run(PeriodicAveraging(period=4, topology="strategy", compression=compression,
                                       fragment_update_alpha=0.5), workers, steps)
        _, blocking = run(PeriodicAveraging(period=4, topology="strategy", compression=compression), workers, steps)
        assert one.summary["virtual_seconds"] == blocking.summary["virtual_seconds"] == pytest.approx(
            compute + 4 * exchange_seconds(whole), rel=1e-12)


def test_an_exchange_in_flight_at_the_end_is_waited_for_and_merged():
    """14 steps, tau = 3: the exchange started after step 13 (due after 16) has one step of compute to hide behind;
    the run ends when it is merged, X - 10 ms after the last step."""
    workers = 3
    protocol = Recording(period=8, topology="strategy", fragments=2, fragment_sync_delay=3)
    sim, result = run(protocol, workers, 14)
    exchange = exchange_seconds(4 * 741)
    assert result.summary["virtual_seconds"] == pytest.approx(14 * STEP + exchange - STEP, rel=1e-12)
    assert [(w["worker"], w["step"]) for w in result.waits] == [(rank, 14) for rank in range(workers)]
    begin, stop = protocol.streaming.bounds[1]
    mean = weighted_average([protocol.before[13, rank][begin:stop] for rank in range(workers)])
    for rank in range(workers):
        expected = protocol.after[14, rank].clone()
        expected[begin:stop] = mean
        assert torch.equal(protocol.final[rank], expected)
        assert torch.equal(sim.replicas[rank].get(), expected)


def test_one_learner_per_node_hides_the_exchange_too():
    """hierarchy="node", 2 machines of 2 ranks: the learners' exchange hides behind tau = 3 steps."""
    arguments = dict(workers=4, max_steps=16, ranks_per_node=2, hierarchy="node")
    _, streamed = run(PeriodicAveraging(period=8, topology="strategy", fragments=2, fragment_sync_delay=3),
                      **arguments)
    _, alone = run(PeriodicAveraging(period=100, topology="strategy"), **arguments)
    _, blocking = run(PeriodicAveraging(period=8, topology="strategy", fragments=2), **arguments)
    assert streamed.summary["virtual_seconds"] == alone.summary["virtual_seconds"]
    assert blocking.summary["virtual_seconds"] > alone.summary["virtual_seconds"] + 4 * 0.005
    assert streamed.summary["bytes_by_level"]["inter_node"] == blocking.summary["bytes_by_level"]["inter_node"] > 0


# ------------------------------------------------------------------------------------ arguments and failures


def test_the_arguments_are_checked_as_the_strategy_checks_them():
    strategy = {"topology": "strategy"}
    with pytest.raises(ValueError, match=r"period \(10\) must be a multiple of fragments \(3\)"):
        PeriodicAveraging(period=10, fragments=3, **strategy)
    with pytest.raises(ValueError, match=r"fragment_sync_delay must be an integer in \[0, 4\]"):
        PeriodicAveraging(period=10, fragments=2, fragment_sync_delay=5, **strategy)
    with pytest.raises(ValueError, match="fragment_update_alpha must be a number in"):
        PeriodicAveraging(period=10, fragment_update_alpha=1.5, **strategy)
    with pytest.raises(ValueError, match="fragments must be an integer in"):
        PeriodicAveraging(period=4, fragments=0, **strategy)
    with pytest.raises(ValueError, match="need topology='strategy' and client_fraction=1"):
        PeriodicAveraging(period=4, fragments=2)
    with pytest.raises(ValueError, match="need topology='strategy' and client_fraction=1"):
        PeriodicAveraging(period=4, fragment_update_alpha=0.5, client_fraction=0.5, **strategy)
    protocol = PeriodicAveraging(period=10, fragments=5, fragment_sync_delay=1, fragment_update_alpha=0.5, **strategy)
    assert {key: protocol.config()[key] for key in ("fragments", "fragment_sync_delay", "fragment_update_alpha")} == \
        {"fragments": 5, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5}


def test_a_non_finite_worker_stops_a_streaming_run_naming_it():
    protocol = type("Poisoned", (PoisonWorker, PeriodicAveraging), {})(
        period=4, topology="strategy", fragments=2, fragment_sync_delay=1)
    with pytest.raises(NonFiniteModelError, match=r"workers \[2\] have non-finite models"):
        simulation(protocol, workers=3, max_steps=6, network=NetworkModel()).run()


def test_streaming_from_a_sim_yaml(tmp_path):
    """``protocol: {name: periodic, fragments, fragment_sync_delay, fragment_update_alpha, ...}`` in a sim config."""
    config = yaml.safe_load((REPO / "configs/sim/periodic.yaml").read_text())
    config["protocol"] = {"name": "periodic", "period": 4, "topology": "strategy", "outer_optimizer": DILOCO,
                          "fragments": 2, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5}
    path = tmp_path / "streaming.yaml"
    path.write_text(yaml.safe_dump(config))
    main(["simulate", "--config", str(path), "--workers", "3", "--max_steps", "8", "--eval_every", "4",
          "--model.init_args.hidden_size", "16", "--out", str(tmp_path / "run")])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert {key: summary["protocol"][key] for key in ("fragments", "fragment_sync_delay", "fragment_update_alpha")} \
        == {"fragments": 2, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5}
    assert summary["protocol_metrics"]["outer/steps"] == 4
