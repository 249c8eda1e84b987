"""Segmented gossip under churn follows paper 002, section 4.2.

"Once they see the connection with the target worker is lost, they can mark it as offline, resend the
request to another worker and stop pulling from the offline worker. [...] the offline flag can be removed
as long as the communication is reestablished." "[A new worker] pulls the segments and aggregates them as
normal only without its local model. [...] When it sends the pulling requests to the target workers, the
target worker adds the newcomer to the worker list."
"""

import torch

from lightning_dist.data import DigitsDataModule
from lightning_dist.sim import Churn, SegmentedGossip, SpeedModel
from sim.helpers import simulation

PERIOD = 5  # rounds end at about 0.05 s, 0.10 s, ... (10 ms steps)


class Recorded(SegmentedGossip):
    """Every request round (the puller's offline flags then, and whom it asked), every round's pulls, every
    model entering a round, every unreachable notice, and what a joiner starts from."""

    def setup(self, simulation):
        super().setup(simulation)
        self.requested, self.pulls, self.entering, self.notices, self.joined = [], {}, {}, [], {}

    def _request_round(self, rank, round_index):
        view = set(self.offline[rank])
        super()._request_round(rank, round_index)
        chosen = set().union(*self.owed[rank].values())
        self.requested.append({"rank": rank, "round": round_index, "time": self.simulation.simulator.env.now,
                               "offline": view, "providers": chosen})

    def _pull(self, node, rank, round_index):
        pulled = yield from super()._pull(node, rank, round_index)
        self.pulls[(rank, round_index)] = [sorted(segment) for segment in pulled]
        return pulled

    def _churn_round(self, node, rank, round_index):
        self.entering.setdefault(round_index, {})[rank] = self.simulation.replicas[rank].get()
        yield from super()._churn_round(node, rank, round_index)

    def _unreachable(self, puller, provider, round_index):
        self.notices.append((puller, provider, round_index, self.simulation.simulator.env.now))
        super()._unreachable(puller, provider, round_index)

    def join(self, node, rank):
        position = yield from super().join(node, rank)
        self.joined[rank] = (self.simulation.replicas[rank].get(), position)
        return position


def run(workers, segments, absences, steps=30):
    protocol = Recorded(segments=segments, replicas=2, period=PERIOD, seed=0)
    data = DigitsDataModule(batch_size=16, partition="dirichlet", seed=0)  # unequal |D_j|
    speed = SpeedModel(step_seconds=0.01, aggregate_seconds=0.001)
    sim = simulation(protocol, workers=workers, max_steps=steps, datamodule=data, speed=speed,
                     churn=Churn(absences=absences))
    result = sim.run()
    return protocol, sim, result


def requests_of(protocol, rank, round_index):
    return [entry for entry in protocol.requested if entry["rank"] == rank and entry["round"] == round_index]


def eq3(models, sizes, providers_by_segment, bounds, own=None):
    """Paper 002's eq. (3) by hand: segment l is sum |D_j| W_j[l] / sum |D_j| over its providers (and ``own``)."""
    result = torch.empty_like(next(iter(models.values())))
    for (start, stop), providers in zip(bounds, providers_by_segment):
        members = list(providers) + ([own] if own is not None else [])
        total = sum(float(sizes[j]) for j in members)
        result[start:stop] = sum(float(sizes[j]) * models[j][start:stop].double() for j in members).float() / total
    return result


def test_a_provider_that_leaves_is_marked_offline_and_its_segments_are_pulled_from_another_worker():
    """8 workers, S = R = 2. Worker 3 leaves at 0.075 s, holding the round-2 requests sent at the end of round 1;
    it comes back at 0.18 s."""
    protocol, sim, _ = run(8, 2, {3: [(0.075, 0.18)]})
    pullers = sorted(entry["rank"] for entry in protocol.requested if entry["round"] == 2 and 3 in entry["providers"]
                     and entry["rank"] != 3)
    assert pullers  # some workers had asked worker 3 for round-2 segments
    # At the leave they learned it at once (the connection dropped) ...
    assert sorted(puller for puller, provider, round_index, time in protocol.notices
                  if provider == 3 and round_index == 2 and time == 0.075) == pullers
    assert protocol.counts["substituted"] >= len(pullers)
    for puller in pullers:
        # ... and pulled those segments from another worker: still R = 2 distinct providers, never worker 3.
        pulled = protocol.pulls[(puller, 2)]
        assert all(len(providers) == 2 and 3 not in providers and puller not in providers for providers in pulled)
    # The providers worker 3 had asked for round 2 found it away when they served it: they cancelled and marked it.
    asked = requests_of(protocol, 3, 2)[0]["providers"]
    # Offline flags when round 3 was requested (end of round 2, before worker 3 is back): exactly those two groups.
    flagged = sorted(entry["rank"] for entry in protocol.requested if entry["round"] == 3 and 3 in entry["offline"])
    assert flagged == sorted(set(pullers) | asked)
    # Nobody pulls from a worker it marks offline.
    assert all(not (entry["providers"] & entry["offline"]) for entry in protocol.requested)


def test_a_round_aggregates_the_providers_it_really_pulled_from_by_eq3():
    protocol, sim, _ = run(8, 2, {3: [(0.075, None)]}, steps=10)
    pullers = [entry["rank"] for entry in protocol.requested if entry["round"] == 2 and 3 in entry["providers"]
               and entry["rank"] != 3]
    for puller in pullers:
        expected = eq3(protocol.entering[2], sim.dataset_sizes, protocol.pulls[(puller, 2)], protocol.bounds,
                       own=puller)
        assert torch.allclose(sim.replicas[puller].get(), expected, rtol=0, atol=1e-6)


def test_the_offline_flag_is_removed_when_the_worker_communicates_again():
    protocol, sim, result = run(8, 2, {3: [(0.075, 0.18)]}, steps=40)
    back = next(event["time"] for event in result.churn if event["event"] == "join")
    contacted = set().union(*(entry["providers"] for entry in protocol.requested
                              if entry["rank"] == 3 and entry["time"] >= back))
    ever_flagged = {entry["rank"] for entry in protocol.requested if 3 in entry["offline"]}
    assert contacted and ever_flagged
    # Its requests reached them: they took it back on their list; the others still mark it offline.
    for worker in range(8):
        if worker != 3:
            assert (3 in sim.protocol.offline[worker]) == (worker in ever_flagged - contacted)
    # And a worker that had marked it offline pulls from it again once the flag is gone.
    repulled = [(rank, round_index) for (rank, round_index), pulled in protocol.pulls.items()
                if rank in ever_flagged and any(3 in providers for providers in pulled)
                and any(entry["rank"] == rank and entry["round"] < round_index and 3 in entry["offline"]
                        for entry in protocol.requested)]
    assert repulled


def test_a_request_that_reaches_a_worker_that_is_away_makes_the_puller_ask_another():
    """6 workers, S = 3, R = 2: every plan row names every peer. Worker 3 leaves at 0.02 s, before it requested
    anything; the others request round 1 at its end (0.05 s), of worker 3 too. Those requests reach nobody, and
    each puller learns it when its request arrives."""
    protocol, sim, _ = run(6, 3, {3: [(0.02, None)]}, steps=10)
    for puller in (0, 1, 2, 4, 5):
        sent = requests_of(protocol, puller, 1)[0]
        assert sent["time"] > 0.02 and 3 in sent["providers"]
        notices = [time for who, provider, _, time in protocol.notices if (who, provider) == (puller, 3)]
        assert len(notices) == 1 and notices[0] > sent["time"]  # a network latency later, not at the leave
        assert 3 in sim.protocol.offline[puller]
        assert all(len(providers) == 2 and 3 not in providers for providers in protocol.pulls[(puller, 1)])
        assert 3 not in requests_of(protocol, puller, 2)[0]["providers"]  # and it stops pulling from it


def test_a_joiner_pulls_every_segment_and_aggregates_without_a_local_model():
    """Worker 5 is away from the start (not on the initial worker list) and joins at 0.072 s, after the others
    ended round 1: it pulls every segment of their round-1 models and aggregates them by eq. (3) without its own."""
    protocol, sim, result = run(6, 3, {5: [(0.0, 0.072)]}, steps=15)
    # Nobody asked the absentee during round 1: it was not on their list, so no request was lost.
    assert all(5 not in entry["providers"] for entry in protocol.requested if entry["round"] == 1)
    assert not [notice for notice in protocol.notices if notice[1] == 5]
    model, position = protocol.joined[5]
    assert position == PERIOD
    pulled = protocol.pulls[(5, 1)]
    assert all(len(providers) == 2 and 5 not in providers for providers in pulled)
    sizes = sim.dataset_sizes
    expected = eq3(protocol.entering[1], sizes, pulled, protocol.bounds)
    assert torch.allclose(model, expected, rtol=0, atol=1e-6)
    initial = torch.cat([parameter.detach().reshape(-1) for parameter in sim.model.parameters()])  # what it held
    with_own = eq3({**protocol.entering[1], 5: initial}, sizes, pulled, protocol.bounds, own=5)
    assert not torch.allclose(model, with_own, rtol=0, atol=1e-4)
    # Its requests put it back on its providers' lists; it trains on and takes part in the later rounds.
    asked = requests_of(protocol, 5, 1)[0]["providers"]
    assert all(5 not in sim.protocol.offline[provider] for provider in asked)
    assert sim.positions[5] == 15 and (5, 2) in protocol.pulls
    assert [event["position"] for event in result.churn if event["event"] == "joined"] == [PERIOD]


def test_a_joiner_serves_the_requests_that_reached_it_while_it_joined_as_soon_as_it_has_that_round():
    """Worker 0 is twice as slow, so it requests round 1 at 0.1 s, from worker 3 too (it never found worker 3
    away). Worker 3 left at 0.015 s and is joining from 0.099 s: the request reaches it mid-join, while it holds
    only its initial model. It serves it when its join aggregation gives it round 1's model, not a local update
    later (about 0.05 s, every step of worker 0 waiting)."""

    class Served(Recorded):
        def setup(self, simulation):
            super().setup(simulation)
            self.served = []

        def _serve(self, provider, puller, round_index, segments):
            self.served.append((provider, puller, round_index, self.simulation.simulator.env.now))
            super()._serve(provider, puller, round_index, segments)

    protocol = Served(segments=3, replicas=2, period=PERIOD, seed=0)
    data = DigitsDataModule(batch_size=16, partition="dirichlet", seed=0)
    sim = simulation(protocol, workers=6, max_steps=15, datamodule=data,
                     speed=SpeedModel(step_seconds=0.01, aggregate_seconds=0.001, slowdown={0: 2.0}),
                     churn=Churn(absences={3: [(0.015, 0.099)]}))
    result = sim.run()
    joined = next(event for event in result.churn if event["event"] == "joined")
    assert joined["position"] == PERIOD  # round 1's model
    request = requests_of(protocol, 0, 1)[0]
    assert 3 in request["providers"] and 0.099 < request["time"] < joined["time"]
    assert [time for provider, puller, round_index, time in protocol.served
            if (provider, puller, round_index) == (3, 0, 1)] == [joined["time"]]
    assert any(3 in providers for providers in protocol.pulls[(0, 1)])
