"""The strategies' compressed exchanges in the simulator: compressed_mean's models and DownpourSGD's compressed pushes
and replies, with the strategies' bytes."""

import pytest
import torch

from lightning_dist.algorithms.compressed_pushes import push_nbytes, reply_nbytes
from lightning_dist.algorithms.compression import compressed_mean, encoded_nbytes
from lightning_dist.algorithms.sparse_compression import SparseCodec
from lightning_dist.algorithms.subset_average import chunk_bounds
from lightning_dist.sim import DynamicAveraging, ParameterServer, PeriodicAveraging
from sim.test_topologies import run


class StartAndSnapshots:
    """Keeps the start model and every worker's model as it enters each synchronization."""

    def setup(self, simulation):
        super().setup(simulation)
        self.start = simulation.replicas[0].get()
        self.snapshots = {}

    def after_step(self, node, rank, step):
        if step % self.every == 0:
            self.snapshots.setdefault(step, {})[rank] = self.simulation.replicas[rank].get()
        yield from super().after_step(node, rank, step)


class PeriodicSnapshots(StartAndSnapshots, PeriodicAveraging):
    every = property(lambda self: self.period)


class DynamicSnapshots(StartAndSnapshots, DynamicAveraging):
    every = property(lambda self: self.check_every)


SPARSE = SparseCodec(density=0.1, bits=2, chunk=64, decay=0.9)


@pytest.mark.parametrize(("protocol_class", "codec"), [(PeriodicSnapshots, "int8"), (PeriodicSnapshots, "bf16"),
                                                       (PeriodicSnapshots, SPARSE), (DynamicSnapshots, "int8"),
                                                       (DynamicSnapshots, "bf16")])
def test_every_worker_takes_the_definitions_model_and_the_strategys_bytes(codec, protocol_class):
    """4 workers, a synchronization every 3 steps for 9 steps (periodic, or dynamic with a threshold every check
    violates): after each, every worker holds the common model plus compressed_mean's applied update of the deltas
    (residuals carried); every worker sent a 1-byte flag to each other (and dynamic averaging's 8-byte distance), and
    in all 2 (m - 1) times the encoded chunks' bytes, what the strategy's ranks send."""
    workers, every, syncs = 4, 3, 3
    if protocol_class is PeriodicSnapshots:
        protocol = PeriodicSnapshots(period=every, topology="strategy", compression=codec)
    else:
        protocol = DynamicSnapshots(divergence_threshold=1e-12, check_every=every, topology="strategy",
                                    compression=codec)
    sim, _ = run(protocol, workers, every * syncs)
    numel = sim.replicas[0].get().numel()
    bounds = list(chunk_bounds(numel, list(range(workers))).values())
    worker_residuals = [torch.zeros(numel) for _ in range(workers)]
    owner_residuals = [torch.zeros(stop - start) for start, stop in bounds]
    common = protocol.start
    for index in range(1, syncs + 1):
        models = [protocol.snapshots[index * every][rank] for rank in range(workers)]
        deltas = [model - common for model in models]
        applied, worker_residuals, owner_residuals = compressed_mean(deltas, worker_residuals, owner_residuals, codec)
        common = common + applied
        assert not torch.equal(common, sum(models) / workers)  # compressed: not the exact mean
    for replica in sim.replicas:
        assert torch.equal(replica.get(), common)
    encoded = sum(encoded_nbytes(stop - start, codec) for start, stop in bounds)
    checks = workers * (workers - 1) * 8 if protocol_class is DynamicSnapshots else 0  # the distances' all-gather
    assert sim.simulator.network.total_bytes == syncs * (checks + workers * (workers - 1) + 2 * (workers - 1) * encoded)


def test_compression_needs_the_strategy_topology_and_every_worker():
    with pytest.raises(ValueError, match="compression needs topology='strategy' and client_fraction=1"):
        PeriodicAveraging(compression="int8")
    with pytest.raises(ValueError, match="compression needs topology='strategy' and client_fraction=1"):
        PeriodicAveraging(compression="int8", topology="strategy", client_fraction=0.5)
    with pytest.raises(ValueError, match="compression must be None or one of"):
        DynamicAveraging(compression="int4", topology="strategy")


def test_the_measured_threshold_probes_the_compressed_synchronization():
    """With the threshold measured in the run, the probes estimate what a synchronization will send: the encoded
    chunks (a quarter of float32's with int8), so a cheap compressed synchronization gets a short period."""
    from lightning_dist.algorithms.averaging import sync_probe_bytes
    from lightning_dist.algorithms.compression import encoded_chunks_nbytes

    protocol = DynamicAveraging(check_every=3, calibration_steps=9, topology="strategy", compression="int8")
    sim, _ = run(protocol, 4, 3)
    numel = sim.replicas[0].get().numel()
    encoded = encoded_chunks_nbytes(numel, 4, "int8")
    assert encoded < numel * 4 / 3.9
    probe = sync_probe_bytes(encoded) // 4 * 4  # whole float32 entries, as the strategy's probe tensor holds
    assert protocol.calibration.probe_bytes == probe
    assert protocol.calibration.parts == encoded / probe


class RecordingServer(ParameterServer):
    """Sums every worker's true parameter update (its replica minus what it last pulled) as it pushes."""

    def setup(self, simulation):
        super().setup(simulation)
        self.start = self.store.vector.clone()
        self.true_updates = torch.zeros_like(self.start)

    def after_step(self, node, rank, step):
        if step % self.push_every == 0:
            self.true_updates += self.simulation.replicas[rank].get() - self.pulled[rank]
        yield from super().after_step(node, rank, step)


@pytest.mark.parametrize("codec", ["int8", "bf16"])
def test_parameter_server_compresses_pushes_and_replies_as_the_strategy(codec):
    """3 workers, the server on worker 0's node, pushes every 2 steps, updates added in full: the server holds the
    start plus every true update minus workers 1 and 2's residuals (worker 0's local calls are exact); every worker
    holds its mirror, which the server's copy equals bit for bit; each remote push and reply carries the codec's
    bytes and the strategy's 32-byte header."""
    workers, push_every, steps = 3, 2, 8
    protocol = RecordingServer(push_every=push_every, topology="strategy", staleness_aware=False, compression=codec)
    sim, _ = run(protocol, workers, steps)
    parameters = sim.replicas[0].vector.num_parameters
    residuals = sum(protocol.pushes[rank].residual for rank in (1, 2))
    expected = protocol.start + protocol.true_updates
    expected[:parameters] -= residuals
    assert torch.allclose(protocol.store.vector, expected, rtol=0, atol=1e-6)
    assert float(residuals.abs().max()) > 1e-6 and 0 not in protocol.pushes
    for rank in (1, 2):
        assert torch.equal(sim.replicas[rank].get(), protocol.pushes[rank].mirror)
        assert torch.equal(protocol.replies.mirrors[rank], protocol.pushes[rank].mirror)
    numel, pushes = sim.replicas[0].get().numel(), steps // push_every
    push = push_nbytes(parameters, numel - parameters, codec) + 32
    reply = reply_nbytes(parameters, numel - parameters, codec) + 32
    # DONE: each other worker's 32-byte header after its last step.
    assert sim.simulator.network.bytes_sent == [(workers - 1) * pushes * reply] + [pushes * push + 32] * (workers - 1)


def test_parameter_server_refuses_an_unknown_codec():
    with pytest.raises(ValueError, match="compression must be None or one of 'bf16', 'int8'"):
        ParameterServer(compression="fp8")


def test_a_sparse_codec_is_refused_by_name_where_the_simulator_does_not_build_it():
    with pytest.raises(ValueError, match="not built for simulated dynamic averaging yet"):
        DynamicAveraging(compression=SPARSE, topology="strategy")
    with pytest.raises(ValueError, match="not built for the simulated parameter server's pushes and replies yet"):
        ParameterServer(compression=SPARSE)
