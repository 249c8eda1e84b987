"""The simulator's parameter server with compressed pushes and a staleness bound: a refused push leaves the residual
owed from the accepted ones (issue 40), as the strategy's workers do."""

import torch

from lightning_dist.sim import ParameterServer
from sim.test_topologies import run


class RecordingRefusals(ParameterServer):
    """Keeps each worker's true parameter updates, push by push, and whether the server applied each."""

    def setup(self, simulation):
        super().setup(simulation)
        self.start = self.store.vector.clone()
        self.updates = {rank: [] for rank in range(simulation.num_workers)}
        self.outcomes = {rank: [] for rank in range(simulation.num_workers)}
        push = self.store.push

        def recorded(message, pulled_version, rank):
            outcome = push(message, pulled_version, rank)
            self.outcomes[rank].append(outcome.accepted)
            return outcome

        self.store.push = recorded

    def after_step(self, node, rank, step):
        if step % self.push_every == 0:
            self.updates[rank].append(self.simulation.replicas[rank].get() - self.pulled[rank])
        yield from super().after_step(node, rank, step)


def test_a_refused_compressed_push_keeps_the_residual_owed_from_the_accepted_ones():
    """3 workers pushing int8 updates at the same times to a server with max_staleness=0: the second and third push
    of each wave are too stale and dropped. The server holds the start plus every accepted push's true update minus
    the residuals the workers still hold (EF-SGD's sum over the accepted pushes); a refused push that overwrote the
    residual lost what earlier pushes' compression owed."""
    protocol = RecordingRefusals(push_every=2, max_staleness=0, compression="int8")
    sim, _ = run(protocol, 3, 8)
    parameters = sim.replicas[0].vector.num_parameters
    refused = sum(outcome is False for outcomes in protocol.outcomes.values() for outcome in outcomes)
    assert refused > 0 and protocol.store.rejected == refused
    accepted = sum(update for rank in protocol.updates
                   for update, applied in zip(protocol.updates[rank], protocol.outcomes[rank]) if applied)
    residuals = sum(pushes.residual for pushes in protocol.pushes.values())
    assert float(residuals.abs().max()) > 1e-6
    expected = protocol.start[:parameters] + accepted[:parameters] - residuals
    gap = float((protocol.store.vector[:parameters] - expected).abs().max())
    assert gap < 1e-6, gap
