"""``fault_tolerance=TorchFT(...)``: replica groups as separate torchrun jobs joined by an in-process torchft Lighthouse,
with failures injected as torchft's own integration tests do (a group's processes exit, once inside a window and once
inside the exchange, and one is started again); refusals by name."""

import time
from datetime import timedelta

import lightning as L
import pytest
import torch

from helpers.launch import load_results, run_nodes, run_replica_groups
from helpers.user_models import DigitsCNN
from lightning_dist.algorithms.averaging import sample_participants
from lightning_dist.algorithms.compression import compressed_mean, encoded_nbytes
from lightning_dist.algorithms.subset_average import chunk_bounds
from lightning_dist.strategies import (
    DownpourSGDStrategy,
    DynamicAveragingStrategy,
    PeriodicAveragingStrategy,
    SegmentedGossipStrategy,
    TorchFT,
)

PERIOD = 4


def group_results(out, name, groups, ranks, restarted=(), lost=()):
    """``{group: [rank 0's result, ...]}`` (a restarted group's second job under ``"<group>_restart"``; a ``lost``
    group wrote nothing)."""
    results = {group: [torch.load(out / name / f"group{group}_rank{rank}.pt", weights_only=False) for rank in range(ranks)]
               for group in range(groups) if group not in restarted and group not in lost}
    for group in restarted:
        results[f"{group}_restart"] = [torch.load(out / name / f"group{group}_rank{rank}_restart.pt", weights_only=False)
                                       for rank in range(ranks)]
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fault_tolerance")
    results = {}
    # DiLoCo on the user's CNN (BatchNorm, Adam, StepLR every epoch of 30 steps), one rank per group: group 2 dies in
    # the exchange of the window ending at step 8 (its second all-reduce there: the first of the model's buckets),
    # and its job is started again at once; the others wait after step 32 (in the second epoch) until it is up, and it
    # rejoins in the window that step ends (or a later one).
    # Every group writes a checkpoint every 4 steps, and the restarted job starts with ckpt_path at its newest (step
    # 8, written inside the window it died in), as a job started again with ``ckpt_path: last`` does.
    codes = run_replica_groups(3, 1, {"name": "rejoin", "max_steps": 48, "bucket": 200, "step_sleep": 0.1,
                                      "model": "cnn", "await_restart": 32, "checkpoint": 4, "restart_from_last": True,
                                      "start_barrier": True, "strategy": {"period": PERIOD, "diloco": True},
                                      "kill": {"group": 2, "window": 3, "all_reduce": 2}},
                               out, restart_group=2)
    results["rejoin"] = (codes, group_results(out, "rejoin", 3, 1, restarted=(2,)))
    # Periodic averaging with int8 compression on the user's CNN (BatchNorm's buffers averaged exactly beside the
    # compressed parameters, Adam), one rank per group: group 2 dies in the first batch of transfers of the window
    # ending at step 8 and is started again; the others hold after step 16 until it is up.
    codes = run_replica_groups(3, 1, {"name": "compressed", "max_steps": 24, "step_sleep": 0.1, "await_restart": 16,
                                      "model": "cnn",
                                      "start_barrier": True, "strategy": {"period": PERIOD, "compression": "int8"},
                                      "kill": {"group": 2, "window": 3, "exchange": 1}},
                               out / "compressed_jobs", restart_group=2)
    results["compressed"] = (codes, group_results(out / "compressed_jobs", "compressed", 3, 1, restarted=(2,)))
    # The same failure under one learner per group of 2 ranks (DDP inside; each local rank exchanges its chunk of
    # the model with the same local rank of the other groups): both ranks of group 2 die in their first batch of
    # transfers of the window ending at step 8.
    codes = run_replica_groups(3, 2, {"name": "compressed_node", "max_steps": 24, "step_sleep": 0.1,
                                      "await_restart": 16, "model": "cnn", "start_barrier": True,
                                      "strategy": {"period": PERIOD, "compression": "int8", "hierarchy": "node"},
                                      "kill": {"group": 2, "window": 3, "exchange": 1}},
                               out / "compressed_node_jobs", restart_group=2)
    results["compressed_node"] = (codes, group_results(out / "compressed_node_jobs", "compressed_node", 3, 2,
                                                       restarted=(2,)))
    # Periodic averaging, one rank per group: group 2 dies at step 6 and is started again; group 1 dies inside the
    # exchange of the window group 2 joins in (the first with 3 groups after one with 2).
    codes = run_replica_groups(3, 1, {"name": "join_lost", "max_steps": 28, "step_sleep": 0.1, "await_restart": 12,
                                      "start_barrier": True, "strategy": {"period": PERIOD},
                                      "kill": [{"group": 2, "step": 6}, {"group": 1, "rejoined": True, "all_reduce": 2}]},
                               out / "join_lost_jobs", restart_group=2)
    results["join_lost"] = (codes, group_results(out / "join_lost_jobs", "join_lost", 3, 1, restarted=(2,), lost=(1,)))
    # Periodic averaging, one rank per group: group 2 dies at step 6 and is started again, and the first transfer of
    # a peer's state to it fails (the others' window waits for it until the option's timeout, 10 s here), and so does
    # its first fetch of a peer's committed state after it.
    codes = run_replica_groups(3, 1, {"name": "heal_fails", "max_steps": 28, "step_sleep": 0.1, "await_restart": 12,
                                      "start_barrier": True, "timeout": 10, "heal_fails": True, "fetch_fails": True,
                                      "strategy": {"period": PERIOD}, "kill": {"group": 2, "step": 6}},
                               out / "heal_fails_jobs", restart_group=2)
    results["heal_fails"] = (codes, group_results(out / "heal_fails_jobs", "heal_fails", 3, 1, restarted=(2,)))
    # The same under one learner per group of 2 ranks (DDP inside, SGD's momentum): only local rank 1's transfer
    # fails, so the restarted group's rank 0 holds a peer's state and its rank 1 does not.
    codes = run_replica_groups(3, 2, {"name": "node_heal_fails", "max_steps": 20, "step_sleep": 0.1,
                                      "await_restart": 12, "start_barrier": True, "timeout": 10, "heal_fails": [1],
                                      "momentum": 0.9, "strategy": {"period": PERIOD, "hierarchy": "node"},
                                      "kill": {"group": 2, "step": 6}}, out / "node_heal_fails_jobs", restart_group=2)
    results["node_heal_fails"] = (codes, group_results(out / "node_heal_fails_jobs", "node_heal_fails", 3, 2,
                                                       restarted=(2,)))
    # FedAvg (half of 4 groups a round), one rank per group: group 3 dies inside the second window and is started
    # again; the others hold after step 12 until it is up.
    codes = run_replica_groups(4, 1, {"name": "fedavg", "max_steps": 20, "step_sleep": 0.1, "await_restart": 12,
                                      "start_barrier": True, "strategy": {"period": PERIOD, "client_fraction": 0.5},
                                      "kill": {"group": 3, "step": 6}}, out / "fedavg_jobs", restart_group=3)
    results["fedavg"] = (codes, group_results(out / "fedavg_jobs", "fedavg", 4, 1, restarted=(3,)))
    # Periodic averaging with SGD's momentum, one learner per group of 2 ranks (DDP inside): group 2 dies inside the
    # second window and is started again at once; the others hold after step 12 until it is up.
    codes = run_replica_groups(3, 2, {"name": "node_loss", "max_steps": 20, "start_barrier": True, "momentum": 0.9,
                                      "step_sleep": 0.2,
                                      "strategy": {"period": PERIOD, "hierarchy": "node"}, "await_restart": 12,
                                      "kill": {"group": 2, "step": 6}}, out / "node_loss_jobs", restart_group=2)
    results["node_loss"] = (codes, group_results(out / "node_loss_jobs", "node_loss", 3, 2, restarted=(2,)))
    # Periodic averaging, one rank per group: groups 1 and 2 die at step 6 and are started again together; group 0
    # holds after step 12 until both ask for their first quorum, then 6 s more, so the two form quorums of their own
    # (the Lighthouse's join timeout is 3 s) before group 0 ends its window.
    codes = run_replica_groups(3, 1, {"name": "two_restart", "max_steps": 20, "step_sleep": 0.1, "await_restart": 12,
                                      "hold_s": 6, "start_barrier": True, "strategy": {"period": PERIOD},
                                      "kill": [{"group": 1, "step": 6}, {"group": 2, "step": 6}]},
                               out / "two_restart_jobs", restart_group=(1, 2), join_timeout_ms=3000)
    results["two_restart"] = (codes, group_results(out / "two_restart_jobs", "two_restart", 3, 1,
                                                   restarted=(1, 2)))
    # FedAvg (2 of 3 groups a round) between groups of 2 ranks (hierarchy="node"): in the window ending at step 8 a
    # failure reaches local rank 0 of group 1 only (its first all-reduce fails there and succeeds on local rank 1).
    codes = run_replica_groups(3, 2, {"name": "partial", "max_steps": 16, "start_barrier": True, "timeout": 10,
                                      "strategy": {"period": PERIOD, "client_fraction": 0.5, "hierarchy": "node"},
                                      "kill": {"group": 1, "window": 3, "all_reduce": 1, "local_rank": 0,
                                               "fail_only": True}}, out / "partial_jobs")
    results["partial"] = (codes, group_results(out / "partial_jobs", "partial", 3, 2))
    # No failure: DiLoCo with int8 on 2 groups of 2 ranks, against the same fit without the option on 2 nodes of 2
    # ranks (after the first, exact window, the same compressed exchanges between the nodes' ranks). Each
    # group writes a checkpoint at step 6 (inside a window), from which it resumes on one rank.
    spec = {"max_steps": 12, "start_barrier": True,
            "strategy": {"period": PERIOD, "diloco": True, "hierarchy": "node", "compression": "int8"}}
    run_replica_groups(2, 2, {**spec, "name": "no_failure", "checkpoint": 6}, out / "no_failure_jobs")
    results["no_failure"] = group_results(out / "no_failure_jobs", "no_failure", 2, 2)
    run_replica_groups(2, 1, {**spec, "name": "resized", "resume_from": "no_failure", "resume_step": 6},
                       out / "no_failure_jobs")
    results["resized"] = group_results(out / "no_failure_jobs", "resized", 2, 1)
    run_nodes(2, 2, "fault_tolerant", {**spec, "name": "plain", "plain": True, "groups": 2}, out / "plain_jobs")
    results["plain"] = group_results(out / "plain_jobs", "plain", 2, 2)
    # DiLoCo with int8 compression on 2 groups of one rank for 60 steps (45 batches an epoch), a checkpoint per group
    # at every epoch's end (step 45, inside a window); after a total loss every group resumes from its own file.
    spec = {"max_steps": 60, "start_barrier": True, "val_batches": 2,
            "strategy": {"period": PERIOD, "diloco": True, "compression": "int8"}}
    run_replica_groups(2, 1, {**spec, "name": "straight", "checkpoint": True}, out / "resume_jobs")
    run_replica_groups(2, 1, {**spec, "name": "resumed", "resume_from": "straight"}, out / "resume_jobs")
    results["straight"] = group_results(out / "resume_jobs", "straight", 2, 1)
    results["resumed"] = group_results(out / "resume_jobs", "resumed", 2, 1)
    return results


def heal_and_catch_up(joined, survivors, groups, joiners=1):
    """A joiner's first two windows from ``windows`` on: healed (the small state in the quorum), then catching up
    (the committed state fetched meanwhile taken at its start); both committed, without its contribution (nor that
    of the other ``joiners``). From the second on it holds the survivors' model after every window, and from the
    third on it contributes."""
    heal, catch_up, *later = [window for window in joined if window["purpose"] != "final"]  # fit's own window
    assert heal["healed"] and heal["committed"] and heal["membership"]["contributors"] == groups - joiners
    assert (catch_up["catching_up"], catch_up["healed"], catch_up["committed"]) == (True, False, True)
    assert catch_up["local_steps"] == heal["local_steps"] + PERIOD
    assert catch_up["membership"]["contributors"] == groups - joiners
    assert all(window["membership"]["contributors"] == groups for window in later)
    for window in [catch_up, *later]:
        assert torch.equal(window["after"], survivors[window["local_steps"]]["after"]), window["local_steps"]
    return heal, catch_up


def windows_of(result):
    return [(window["purpose"], window["local_steps"], window["committed"], window["healed"],
             window["membership"]["groups"], window["membership"]["contributors"]) for window in result["windows"]]


def test_survivors_roll_back_a_failed_exchange_and_go_on(runs):
    codes, results = runs["rejoin"]
    assert codes[0] == codes[1] == codes[3] == 0 and codes[2] != 0  # group 2's first job died, its second finished
    survivor = results[0][0]
    windows = {window["local_steps"]: window for window in survivor["windows"]}
    # The window ending at step 8 lost a member mid-exchange: discarded, every replica back at step 4's result.
    assert not windows[8]["committed"] and windows[4]["committed"] and windows[12]["committed"]
    assert torch.equal(windows[8]["after"], windows[4]["after"])
    assert survivor["metrics"]["ft/discarded"] == 1.0
    # Every window of both survivors was the same, and they never stopped: 48 steps, 12 windows and set-up.
    assert windows_of(results[0][0]) == windows_of(results[1][0])
    assert results[0][0]["global_step"] == results[1][0]["global_step"] == 48


def test_restarted_group_rejoins_with_the_live_state(runs):
    _, results = runs["rejoin"]
    joined = results["2_restart"][0]
    survivor = {window["local_steps"]: window for window in results[0][0]["windows"]}
    heal, catch_up = heal_and_catch_up(joined["windows"], survivor, 3)
    assert heal["purpose"] == "setup"
    steps = heal["local_steps"]
    assert steps % PERIOD == 0 and 32 <= steps < 48
    assert joined["global_step"] == 48
    assert torch.equal(joined["final"], results[0][0]["final"]) and torch.equal(joined["final"], results[1][0]["final"])
    # Bit for bit the others' model after its catch-up window: the survivors' DiLoCo outer step from their mean, which
    # it took from the committed model, DiLoCo's reference and momentum it fetched meanwhile. Its optimizer state
    # is one survivor's as that survivor committed the heal window (the two survivors' differ: each trained on its
    # own shard), its schedule the peers' (StepLR halved the rate at the first epoch's end).
    sources = [{w["local_steps"]: w for w in results[group][0]["windows"]}[steps]["optimizer"] for group in (0, 1)]
    assert joined["start_step"] == steps and catch_up["optimizer"]["lr"] == sources[0]["lr"] == sources[1]["lr"] == 0.005
    assert [same_state(catch_up["optimizer"]["state"], source["state"]) for source in sources].count(True) == 1
    # The state a survivor sent, counted at the sender: in the quorum, the generators' states (FedAvg's shared one,
    # torch's and NumPy's) and a few bytes of counters; after the window, the committed model once (DiLoCo's
    # reference is its parameters, not sent again), DiLoCo's momentum and Adam's two moments.
    model, parameters = joined["final"].numel(), sum(parameter.numel() for parameter in DigitsCNN().parameters())
    generators = 2 * torch.get_rng_state().numel() + 624 * 8  # two torch generators' bytes, NumPy's 624 int64 keys
    sent = sum(results[group][0]["comm"].bytes_by_purpose["checkpoint"] for group in (0, 1))
    assert 4 * (model + 3 * parameters) + generators <= sent < 4 * (model + 3 * parameters) + generators + 256


def test_a_restart_with_ckpt_path_takes_the_peers_state_over_its_file(runs):
    """The restarted job was started with ``ckpt_path`` at its own newest file (step 8, inside the window it died
    in): the peer's live state wins (Lightning restores the file after set-up), so it starts where the others are
    and ends with them (above: bit for bit after every window), not at step 8 with its stale model."""
    _, results = runs["rejoin"]
    joined = results["2_restart"][0]
    assert joined["ckpt_path"] is not None and joined["ckpt_path"].endswith("step=8.ckpt")
    steps = joined["windows"][0]["local_steps"]
    assert joined["start_step"] == steps >= 32 and joined["global_step"] == 48
    assert torch.equal(joined["start"], joined["windows"][0]["after"])  # the model it joined with, not the file's
    assert joined["syncs"] == results[0][0]["syncs"]  # the window it joined in counted, as the peer counts it


def test_a_group_healed_mid_epoch_reads_each_sample_of_its_shard_once(runs):
    """The restarted group joins at the peers' batch of the second epoch: it reads its own shard on from that batch,
    in the epoch's order, each batch once, to the epoch's end (Lightning alone would read it from the first batch,
    the first ones twice and the last never); and it takes the peer's random number generators."""
    _, results = runs["rejoin"]
    joined = results["2_restart"][0]
    start = joined["start_step"]  # 30 batches an epoch: the joiner starts in epoch 1 at batch start - 30
    epoch, first = divmod(start, 30)
    assert epoch == 1 and first > 0
    order = joined["epoch_orders"][epoch]
    seen = [(batch_idx, print_) for seen_epoch, batch_idx, print_ in joined["batches"] if seen_epoch == epoch]
    assert [batch_idx for batch_idx, _ in seen] == list(range(first, first + len(seen)))
    assert [print_ for _, print_ in seen] == order[first:first + len(seen)]
    assert len(set(order)) == len(order)  # the fingerprints tell the batches apart
    # Every group's generator was put in a state of its own before it met the others; the joiner's is the peer's.
    healed = joined["windows"][0]
    peers = [{w["local_steps"]: w for w in results[group][0]["windows"]}[start]["rng_before"] for group in (0, 1)]
    assert not torch.equal(peers[0], peers[1]) and not torch.equal(healed["rng_before"], healed["rng_after"])
    assert any(torch.equal(healed["rng_after"], peer) for peer in peers)


def test_groups_restarted_together_wait_for_a_live_peer_instead_of_starting_over(runs):
    """Groups 1 and 2, restarted together while group 0 is inside its window, meet in quorums of their own (2 of 3
    groups, none ahead): those joins do not hold, and they join when group 0 ends its window, healed from it, at
    its step; all three end at step 20 with one model."""
    codes, results = runs["two_restart"]
    assert codes[0] == codes[3] == codes[4] == 0 and codes[1] != 0 and codes[2] != 0
    survivor = {window["local_steps"]: window for window in results[0][0]["windows"]}
    for group in (1, 2):
        joined = results[f"{group}_restart"][0]
        setups = [window for window in joined["windows"] if window["purpose"] == "setup"]
        assert any(window["membership"]["groups"] == 2 and not window["healed"] for window in setups[:-1])
        last = setups[-1]
        assert last["healed"] and last["committed"] and last["membership"]["groups"] == 3
        assert joined["start_step"] == last["local_steps"] == 12 and joined["global_step"] == 20
        heal_and_catch_up(joined["windows"][len(setups) - 1:], survivor, 3, joiners=2)
        assert torch.equal(joined["final"], results[0][0]["final"])


def test_a_failure_on_one_rank_of_a_group_discards_the_window_on_every_rank(runs):
    """FedAvg between groups of 2 ranks: the failure reaches group 1's local rank 0 only. Its ranks follow one view
    of the quorum (local rank 1's), so they issue the same collectives inside the group instead of waiting for
    each other until the timeout: the window is discarded on every rank of every group, and the run goes on."""
    codes, results = runs["partial"]
    assert codes == {0: 0, 1: 0, 2: 0}
    for group in range(3):
        for rank in range(2):
            windows = {window["local_steps"]: window for window in results[group][rank]["windows"]}
            assert not windows[8]["committed"] and windows[4]["committed"] and windows[12]["committed"]
            assert torch.equal(windows[8]["after"], windows[4]["after"])  # back at the committed model
            assert results[group][rank]["global_step"] == 16
            assert torch.equal(results[group][rank]["final"], results[0][0]["final"])


def same_state(first, second):
    """Whether two optimizer ``state_dict()["state"]`` hold equal values for the same parameters."""
    return first.keys() == second.keys() and all(
        first[index].keys() == second[index].keys()
        and all(torch.equal(torch.as_tensor(first[index][key]), torch.as_tensor(second[index][key]))
                for key in first[index]) for index in first)


def test_survivors_average_their_own_work_when_a_node_dies_inside_a_window(runs):
    codes, results = runs["node_loss"]
    assert codes[0] == codes[1] == 0 and codes[2] != 0
    first, second = (results[group][0] for group in (0, 1))
    window = {0: {w["local_steps"]: w for w in first["windows"]}, 1: {w["local_steps"]: w for w in second["windows"]}}
    assert window[0][8]["membership"] == {"quorum_id": window[0][8]["membership"]["quorum_id"], "groups": 2,
                                          "contributors": 2}
    # The two survivors' replicas at step 8, averaged: exactly what every rank of both holds after the window.
    mean = (window[0][8]["before"] + window[1][8]["before"]) / 2
    for group in (0, 1):
        for rank in range(2):
            rank_windows = {w["local_steps"]: w for w in results[group][rank]["windows"]}
            assert torch.equal(rank_windows[8]["after"], mean)
            assert all(w["committed"] for w in rank_windows.values())
    assert first["global_step"] == 20 and torch.equal(first["final"], second["final"])


def compressed_window(windows, step, contributors=None, joiner=False, owners=None, start=0):
    """A compressed window by its definition, from each group's model and residual before it (a joining group's delta,
    buffers and residual zero) and the owners' residuals (default zero: the chunks were cut anew, the quorum's groups
    changed): the parameters' :func:`compressed_mean`, the buffers' exact mean over the contributors. ``windows``
    are one local rank's of each group, whose exchange covers the model vector from ``start`` (its common model's
    length). Returns the mean of that range, each group's residual and each owner's residual after it."""
    common = windows[0][step]["compression_before"][0]["common"]
    stop = start + common.numel()
    residuals = [window[step]["compression_before"][0]["residual"] for window in windows]
    parameters = residuals[0].numel()  # the residuals are of the range's parameters; its buffers follow them
    deltas = [window[step]["before"][start:start + parameters] - common[:parameters] for window in windows]
    deltas += [torch.zeros(parameters)] * joiner
    residuals += [torch.zeros(parameters)] * joiner
    if owners is None:
        bounds = chunk_bounds(parameters, list(range(len(deltas)))).values()
        owners = [torch.zeros(last - first) for first, last in bounds]
    applied, residuals, owners = compressed_mean(deltas, residuals, owners, "int8", contributors)
    buffers = sum(window[step]["before"][start + parameters:stop] for window in windows) / (contributors or len(windows))
    return torch.cat([common[:parameters] + applied, buffers]), residuals, owners


def test_a_failed_compressed_exchange_rolls_back_the_residuals_and_the_survivors_go_on(runs):
    codes, results = runs["compressed"]
    assert codes[0] == codes[1] == codes[3] == 0 and codes[2] != 0
    survivors = [{window["local_steps"]: window for window in results[group][0]["windows"]} for group in (0, 1)]
    # The window ending at step 8 lost group 2 inside its exchange: discarded, the model and the error-feedback
    # residuals back at step 4's (each survivor had folded step 8's delta into its residual before sending it).
    assert not survivors[0][8]["committed"] and torch.equal(survivors[0][8]["after"], survivors[0][4]["after"])
    for windows in survivors:
        before_8, before_12 = (windows[step]["compression_before"][0] for step in (8, 12))
        assert before_8["residual"].abs().sum() > 0
        assert torch.equal(before_12["residual"], before_8["residual"])
        assert torch.equal(before_12["common"], survivors[0][4]["after"])
    # The next window is the two survivors' compressed mean, bit for bit the definition (every window compressed
    # but the first, which averages the groups' start models exactly).
    assert survivors[0][12]["membership"]["groups"] == 2
    mean, residuals, owners = compressed_window(survivors, 12)
    assert torch.equal(survivors[0][12]["after"], mean)
    for group, windows in enumerate(survivors):
        assert torch.equal(windows[12]["compression_after"][0]["residual"], residuals[group])
        assert torch.equal(windows[12]["compression_after"][0]["owner_residual"], owners[group])
    assert torch.equal(survivors[1][12]["after"], survivors[0][12]["after"])


def test_a_group_rejoins_a_compressed_run_with_a_zero_delta(runs):
    _, results = runs["compressed"]
    joined = results["2_restart"][0]
    survivors = [{window["local_steps"]: window for window in results[group][0]["windows"]} for group in (0, 1)]
    first = joined["windows"][0]
    assert first["healed"] and first["committed"] and first["local_steps"] == 16
    assert (first["membership"]["groups"], first["membership"]["contributors"], first["rank"]) == (3, 2, 2)
    # The survivors' deltas, divided by the 2 contributors: the joiner sent zeros (its window is the others' past).
    assert torch.equal(survivors[0][16]["after"], compressed_window(survivors, 16, contributors=2, joiner=True)[0])
    heal_and_catch_up(joined["windows"], survivors[0], 3)
    assert torch.equal(joined["final"], results[0][0]["final"])
    # Bytes, counted at the sender between groups: its int8 pieces of the two chunks it does not own, its piece of
    # the mean to both others, and the buffers' all-reduce (float32) as a ring's share, once per window; and the
    # contributor count's all-reduce (8 float64: presence, ranks, FedAvg's vote, the run's tag) as a ring's share.
    parameters = survivors[0][16]["compression_before"][0]["residual"].numel()
    buffers = first["before"].numel() - parameters
    assert buffers > 0
    owners = list(chunk_bounds(parameters, [0, 1, 2]).values())
    window = sum(encoded_nbytes(stop - start, "int8") for start, stop in owners[:2]) + 2 * encoded_nbytes(
        owners[2][1] - owners[2][0], "int8") + 2 * 2 * buffers * 4 // 3
    count = 2 * 2 * 8 * 8 // 3
    assert joined["comm"].bytes_by_purpose["setup"] == window
    assert joined["comm"].bytes_by_purpose["protocol"] == 2 * window + 3 * count
    assert joined["comm"].bytes_by_level == {"intra_node": 0, "inter_node": 3 * window + 3 * count}


def test_a_failed_compressed_exchange_between_nodes_rolls_back_and_a_restarted_node_rejoins(runs):
    codes, results = runs["compressed_node"]
    assert codes[0] == codes[1] == codes[3] == 0 and codes[2] != 0
    survivors = {(group, rank): {window["local_steps"]: window for window in results[group][rank]["windows"]}
                 for group in (0, 1) for rank in (0, 1)}
    joined = [{window["local_steps"]: window for window in results["2_restart"][rank]["windows"]} for rank in (0, 1)]
    # Every rank of both survivors: the window ending at step 8 discarded, the model and its chunk's residual back.
    for windows in survivors.values():
        assert not windows[8]["committed"] and torch.equal(windows[8]["after"], windows[4]["after"])
        before_8, before_12 = (windows[step]["compression_before"][0]["residual"] for step in (8, 12))
        assert before_8.abs().sum() > 0 and torch.equal(before_12, before_8)
    # The survivors' next window and the restarted node's first (its delta zero, 2 contributors), chunk by chunk:
    # each local rank's range is the definition over the same local rank of the groups, on every rank of every node.
    assert survivors[0, 0][12]["membership"]["groups"] == 2
    assert [joined[rank][16]["healed"] and joined[rank][16]["committed"] for rank in (0, 1)] == [True, True]
    assert (joined[0][16]["membership"]["groups"], joined[0][16]["membership"]["contributors"]) == (3, 2)
    start = 0
    for rank in (0, 1):
        windows = [survivors[group, rank] for group in (0, 1)]
        stop = start + windows[0][12]["compression_before"][0]["common"].numel()
        mean, residuals, _ = compressed_window(windows, 12, start=start)
        joining = compressed_window(windows, 16, contributors=2, joiner=True, start=start)[0]
        for holder in survivors.values():
            assert torch.equal(holder[16]["after"][start:stop], joining)
        for holder in survivors.values():
            assert torch.equal(holder[12]["after"][start:stop], mean)
        for group in (0, 1):
            assert torch.equal(windows[group][12]["compression_after"][0]["residual"], residuals[group])
        start = stop
    assert start == survivors[0, 0][12]["after"].numel()
    # From its catch-up window on every rank of the three nodes holds the same model after every window, and at the end.
    for rank in (0, 1):
        heal_and_catch_up(results["2_restart"][rank]["windows"], survivors[0, 0], 3)
        assert torch.equal(results["2_restart"][rank]["final"], results[0][0]["final"])
        assert results["2_restart"][rank]["global_step"] == 24


def test_a_join_whose_window_is_discarded_joins_at_the_next_one(runs):
    codes, results = runs["join_lost"]
    assert codes[0] == codes[3] == 0 and codes[1] != 0 and codes[2] != 0
    survivor, joined = results[0][0], results["2_restart"][0]
    # Its first window lost group 1 inside the exchange: discarded. It asks to be healed again (its received state
    # is a window old by the next one), joins there, and takes Lightning's loops from it: both end at step 28.
    first, second = joined["windows"][:2]
    assert (first["purpose"], first["committed"], first["healed"]) == ("setup", False, True)
    assert (second["purpose"], second["committed"], second["healed"]) == ("setup", True, True)
    assert second["local_steps"] == first["local_steps"] + PERIOD and joined["start_step"] == second["local_steps"]
    survivor_windows = {window["local_steps"]: window for window in survivor["windows"]}
    heal_and_catch_up(joined["windows"][1:], survivor_windows, 2)  # group 1 is lost
    assert joined["global_step"] == survivor["global_step"] == 28 and torch.equal(joined["final"], survivor["final"])


def test_a_join_whose_state_never_arrives_joins_at_the_next_window(runs):
    codes, results = runs["heal_fails"]
    assert codes[0] == codes[1] == codes[3] == 0 and codes[2] != 0
    survivor, joined = results[0][0], results["2_restart"][0]
    # torchft tried to heal it, the transfer failed: no state (its own step count), the window discarded everywhere.
    # It is still behind, is healed at the others' next window, and takes Lightning's loops there.
    first, second = joined["windows"][:2]
    assert (first["purpose"], first["committed"], first["healed"], first["behind"]) == ("setup", False, False, True)
    assert first["local_steps"] == 0
    assert (second["purpose"], second["committed"], second["healed"]) == ("setup", True, True)
    assert joined["start_step"] == second["local_steps"]
    survivor_windows = {window["local_steps"]: window for window in survivor["windows"]}
    assert not survivor_windows[second["local_steps"] - PERIOD]["committed"]
    # Its fetch of the committed state after that heal failed too: at the next window it is healed again (the
    # others commit it without it), catches up at the one after, and ends at step 28 with the others' model.
    third = joined["windows"][2]
    assert (third["catching_up"], third["healed"], third["committed"]) == (True, True, True)
    assert third["membership"]["contributors"] == 2 and survivor_windows[third["local_steps"]]["committed"]
    heal_and_catch_up(joined["windows"][2:], survivor_windows, 3)
    assert joined["global_step"] == survivor["global_step"] == 28 and torch.equal(joined["final"], survivor["final"])


def test_a_node_whose_state_arrives_on_one_rank_only_joins_whole_at_the_next_window(runs):
    codes, results = runs["node_heal_fails"]
    assert codes[0] == codes[1] == codes[3] == 0 and codes[2] != 0
    survivor, joined = results[0][0], results["2_restart"]
    # Rank 0 received a peer's state (the others' step), rank 1 did not (its own, zero): the group does not commit,
    # every rank of it is still behind, the others discard that window, and both ranks are healed at the next one.
    firsts = [ranks["windows"][0] for ranks in joined]
    assert [(first["committed"], first["behind"]) for first in firsts] == [(False, True), (False, True)]
    assert firsts[0]["local_steps"] > 0 and firsts[1]["local_steps"] == 0
    survivor_windows = {window["local_steps"]: window for window in survivor["windows"]}
    assert not survivor_windows[firsts[0]["local_steps"]]["committed"]
    for rank in (0, 1):
        second = joined[rank]["windows"][1]
        assert (second["purpose"], second["committed"], second["healed"]) == ("setup", True, True)
        assert joined[rank]["start_step"] == second["local_steps"] == firsts[0]["local_steps"] + PERIOD
        heal_and_catch_up(joined[rank]["windows"][1:], survivor_windows, 3)
        assert joined[rank]["global_step"] == 20 and torch.equal(joined[rank]["final"], survivor["final"])
    # One optimizer state in the group, one survivor's at that window (DDP inside the group needs them equal).
    steps = joined[0]["start_step"]
    caught_up = [ranks["windows"][2]["optimizer"]["state"] for ranks in joined]
    assert same_state(caught_up[1], caught_up[0])
    sources = [{w["local_steps"]: w for w in results[group][0]["windows"]}[steps]["optimizer"]["state"]
               for group in (0, 1)]
    assert [same_state(caught_up[0], source) for source in sources].count(True) == 1


def test_fedavg_draws_among_the_groups_present_and_a_restarted_group_rejoins(runs):
    codes, results = runs["fedavg"]
    assert codes[0] == codes[1] == codes[2] == codes[4] == 0 and codes[3] != 0
    jobs = [results[group][0] for group in range(3)] + [results["3_restart"][0]]
    windows = [{window["local_steps"]: window for window in job["windows"] if window["purpose"] != "final"}
               for job in jobs]
    rejoin = min(windows[3])  # the restarted group's first window, where it is healed
    assert windows[3][rejoin]["healed"] and windows[3][rejoin]["membership"]["contributors"] == 3 and rejoin > 8
    generator = torch.Generator().manual_seed(0)  # the strategy's seed: the draws of FedAvg without the option
    for step in range(PERIOD, 20 + 1, PERIOD):
        # Group 3 contributes at step 4, is dead at step 8 (killed at step 6), healed (no contribution) at its rejoin
        # and catching up at the next window.
        present = [0, 1, 2] + [3] * (step == PERIOD or step > rejoin + PERIOD)
        averaged = sample_participants(4, 0.5, generator, present)
        recorded = [group for group in present if step in windows[group]]  # group 3's first job wrote nothing
        mean = None
        if all(group in recorded for group in averaged):
            mean = (windows[averaged[0]][step]["before"] + windows[averaged[1]][step]["before"]) / 2
        for group in recorded:
            window = windows[group][step]
            assert window["committed"] and window["averaged"] == averaged, (step, group)
            # The members hold their mean; the others keep their own replicas (FedAvg's non-participants).
            if group not in averaged:
                assert torch.equal(window["after"], window["before"]), (step, group)
            elif mean is not None:
                assert torch.equal(window["after"], mean), (step, group)
    # The restarted group catches up with a survivor's committed model of its heal window (FedAvg's groups hold
    # different ones; it is not drawn in its catch-up window) and the draws' generator (the draws above agree in
    # every group after it).
    assert windows[3][rejoin + PERIOD]["catching_up"] and windows[3][rejoin + PERIOD]["averaged"] is not None
    assert any(torch.equal(windows[3][rejoin + PERIOD]["after"], windows[group][rejoin]["after"]) for group in range(3))
    # fit ends with a window of all four (after FedAvg's last round, as the consensus without the option).
    assert all(job["windows"][-1]["purpose"] == "final" and torch.equal(job["final"], jobs[0]["final"]) for job in jobs)


def test_a_restarted_group_of_two_ranks_rejoins_with_one_optimizer_state(runs):
    _, results = runs["node_loss"]
    joined = results["2_restart"]
    first = joined[0]["windows"][0]
    steps = first["local_steps"]
    assert first["purpose"] == "setup" and 12 <= steps < 20
    survivors = [{window["local_steps"]: window for window in results[group][0]["windows"]} for group in (0, 1)]
    # The survivors' window in which it catches up is their mean, by definition, bit for bit on every rank of the
    # three groups (it sends zeros; the mean is of the 2 contributors).
    mean = (survivors[0][steps + PERIOD]["before"] + survivors[1][steps + PERIOD]["before"]) / 2
    for holder in [*(results[group][rank] for group in (0, 1) for rank in (0, 1)), *joined]:
        assert torch.equal({w["local_steps"]: w for w in holder["windows"]}[steps + PERIOD]["after"], mean)
    for rank in (0, 1):
        # Both ranks hold the others' model after every window from then on, and one optimizer state: local rank 0
        # fetched one survivor's committed state and shared it, as DDP inside the group needs.
        heal_and_catch_up(joined[rank]["windows"], survivors[0], 3)
        assert same_state(joined[rank]["windows"][1]["optimizer"]["state"], joined[0]["windows"][1]["optimizer"]["state"])
        assert joined[rank]["global_step"] == 20
    # ... the momentum buffers of one survivor at its heal window (the two survivors' differ: their own shards).
    sources = [survivors[group][steps]["optimizer"]["state"] for group in (0, 1)]
    assert [same_state(joined[0]["windows"][1]["optimizer"]["state"], source) for source in sources].count(True) == 1


def test_no_failure_equals_the_run_without_the_option(runs):
    tolerant, plain = runs["no_failure"], runs["plain"]
    for group in (0, 1):
        for rank in range(2):
            assert torch.equal(tolerant[group][rank]["final"], plain[group][rank]["final"])
            # A window ends at the next batch's start under the option, inside the optimizer step without it.
            windows = {window["local_steps"]: window["after"] for window in tolerant[group][rank]["windows"]}
            for step, vector in plain[group][rank]["after_step"].items():
                ours = windows[step] if step % PERIOD == 0 else tolerant[group][rank]["after_step"][step]
                assert torch.equal(ours, vector), step
    windows = tolerant[0][0]["windows"]
    assert [window["local_steps"] for window in windows] == [0, 4, 8, 12]
    assert all(window["committed"] and window["membership"]["contributors"] == 2 for window in windows[1:])
    assert tolerant[0][0]["metrics"]["ft/groups"] == 2.0 and tolerant[0][0]["metrics"]["ft/commits"] == 4.0


def test_groups_on_separate_hosts_meet_at_the_addresses_they_advertise(tmp_path):
    """Every group's job on a host of its own (a network namespace, where the job's MASTER_ADDR 127.0.0.1 names only
    that host) and the Lighthouse on the first: the groups still build torchft's Gloo group between them, at the
    addresses their Managers advertise (a one-node job's MASTER_ADDR as the store's address sent every other group to
    itself)."""
    from benchmarks.common import netns

    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.fail(f"this test needs {netns.REQUIREMENTS} (the CI machine has them): {reason}")
    spec = {"name": "hosts", "max_steps": 8, "start_barrier": True, "strategy": {"period": PERIOD, "diloco": True}}
    with netns.Network(nodes=2) as network:
        codes = run_replica_groups(2, 1, spec, tmp_path, network=network, timeout=240)
    assert codes == {0: 0, 1: 0}
    results = group_results(tmp_path, "hosts", 2, 1)
    assert torch.equal(results[0][0]["final"], results[1][0]["final"])
    windows = results[0][0]["windows"]
    assert [window["local_steps"] for window in windows] == [0, 4, 8]
    assert all(window["committed"] for window in windows)
    assert all(window["membership"]["contributors"] == 2 for window in windows[1:])


def test_a_replica_group_running_twice_is_refused_by_name_and_the_others_go_on(tmp_path):
    """Two jobs of group 1 (as when a worker outlives its killed torchrun agent and the group is started again,
    once the run is under way): both copies stop with an error naming group 1, and group 0 discards the window
    they shared and trains on."""
    spec = {"name": "twice", "max_steps": 16, "start_barrier": True, "step_sleep": 0.2, "copy_after_setup": True,
            "await_restart": 8, "strategy": {"period": PERIOD, "diloco": True}}
    codes = run_replica_groups(2, 1, spec, tmp_path, duplicate_group=1, timeout=240)
    assert codes[0] == 0 and codes[1] != 0 and codes[2] != 0
    refusal = "replica group 1 joined this quorum 2 times"
    assert refusal in (tmp_path / "group1.log").read_text() and refusal in (tmp_path / "group1copy.log").read_text()
    windows = torch.load(tmp_path / "twice" / "group0_rank0.pt", weights_only=False)["windows"]
    discarded = [index for index, window in enumerate(windows) if not window["committed"]]  # (windows hold tensors)
    assert len(discarded) == 1 and windows[discarded[0]]["membership"]["groups"] == 3
    assert all(window["membership"]["groups"] == 1 for window in windows[discarded[0] + 1:])


def test_two_runs_that_share_a_lighthouse_are_refused_by_name(tmp_path):
    """A run's group 0 and another run's group 0 (another secret) on one Lighthouse meet in one quorum: each stops
    with the error that names the cause, before anything is averaged or any state sent."""
    spec = {"name": "two_runs", "max_steps": 8, "copy_secret": "another run's secret, 16+ bytes",
            "start_barrier": True, "copy_in_barrier": True, "strategy": {"period": PERIOD}}
    codes = run_replica_groups(1, 1, spec, tmp_path, duplicate_group=0, timeout=240)
    assert codes[0] != 0 and codes[1] != 0
    refusal = "met replica groups of another run in its quorum"
    assert refusal in (tmp_path / "group0.log").read_text() and refusal in (tmp_path / "group0copy.log").read_text()


def test_a_group_that_keeps_discarding_windows_fails_after_max_retries(tmp_path):
    """min_replicas=2 of 2 groups and group 1 lost for good: every window of group 0 is discarded (too few groups),
    and after max_retries=2 of them in a row its job fails naming the reason, instead of training on forever."""
    spec = {"name": "retries", "max_steps": 40, "start_barrier": True, "min_replicas": 2, "max_retries": 2,
            "step_sleep": 0.1, "strategy": {"period": PERIOD}, "kill": {"group": 1, "step": 6}}
    codes = run_replica_groups(2, 1, spec, tmp_path, timeout=240)
    assert codes[0] != 0 and codes[1] != 0
    log = (tmp_path / "group0.log").read_text()
    assert "3 windows in a row were discarded, more than TorchFT(max_retries=2)" in log
    assert "it met 1 group(s) (1 contributing), fewer than min_replicas" in log


def test_a_group_started_again_after_its_run_ended_fails_at_once_naming_why(tmp_path):
    """Group 1 dies at step 6 and its job is started again from its newest checkpoint (``ckpt_path: last``) only
    once group 0 has ended its fit at step 12: instead of waiting quorum_timeout (120 s here) for a quorum nobody
    will join, it fails once the option's timeout (10 s) has passed, naming the step the run ended at."""
    spec = {"name": "after_end", "max_steps": 12, "start_barrier": True, "checkpoint": 4, "restart_from_last": True,
            "timeout": 10,
            "restart_after_end": True, "strategy": {"period": PERIOD}, "kill": {"group": 1, "step": 6}}
    start = time.monotonic()
    codes = run_replica_groups(2, 1, spec, tmp_path, restart_group=1, timeout=240)
    assert time.monotonic() - start < 60  # the whole run, the restarted job's failure included
    assert codes[0] == 0 and codes[1] != 0 and codes[2] != 0
    log = (tmp_path / "group1restart.log").read_text()
    assert "replica group 1 was started again after its run ended: the run's groups ended their fit at step 12" in log


def test_every_group_resumes_from_its_own_checkpoint_after_a_total_loss(runs):
    straight, resumed = runs["straight"], runs["resumed"]
    for group in (0, 1):
        # Each group starts again from its own replica at step 45 (inside a window), not from the committed model.
        assert torch.equal(resumed[group][0]["start"], straight[group][0]["after_step"][45])
        # ... and holds the committed model of the window that ended at step 44 (from the checkpoint).
        committed = {window["local_steps"]: window["after"] for window in straight[group][0]["windows"]}
        assert torch.equal(resumed[group][0]["start_anchor"], committed[44])
        windows = resumed[group][0]["windows"]
        assert [window["local_steps"] for window in windows] == [0, 48, 52, 56, 60]  # the meeting, then the schedule
        assert all(window["committed"] and window["membership"]["contributors"] == 2 for window in windows)
        assert resumed[group][0]["global_step"] == 60
        # The compressed exchanges' state as it was: the common model and both residuals.
        saved = {window["local_steps"]: window for window in straight[group][0]["windows"]}[48]["compression_before"]
        assert all(torch.equal(resumed_state[key], saved_state[key]) for resumed_state, saved_state in
                   zip(windows[1]["compression_before"], saved) for key in ("common", "residual", "owner_residual"))
    for first, second in zip(resumed[0][0]["windows"][1:], resumed[1][0]["windows"][1:]):
        assert torch.equal(first["after"], second["after"])
    # ... and the first window after the resume used the owners' residuals (the checkpoint says which quorum they
    # were cut for; nothing cut anew), as the definition says.
    windows = [{window["local_steps"]: window for window in resumed[group][0]["windows"]} for group in (0, 1)]
    _, residuals, owners = compressed_window(windows, 48, owners=[windows[group][48]["compression_before"][0]
                                                                  ["owner_residual"] for group in (0, 1)])
    for group in (0, 1):
        assert torch.equal(windows[group][48]["compression_after"][0]["owner_residual"], owners[group])
        assert torch.equal(windows[group][48]["compression_after"][0]["residual"], residuals[group])


def test_a_group_resumes_from_its_checkpoint_on_another_number_of_ranks(runs):
    written, resized = runs["no_failure"], runs["resized"]
    for group in (0, 1):
        # In another layout every rank starts from the checkpoint's consensus (docs/launching.md), which under the
        # option is the committed model: the window that ended at step 4, not the group's replica at step 6.
        committed = {window["local_steps"]: window["after"] for window in written[group][0]["windows"]}
        assert not torch.equal(written[group][0]["after_step"][6], committed[4])
        assert torch.equal(resized[group][0]["start"], committed[4])
        assert torch.equal(resized[group][0]["start_anchor"], committed[4])
        windows = resized[group][0]["windows"]
        assert [window["local_steps"] for window in windows] == [0, 8, 12]  # the meeting, then the schedule
        assert all(window["committed"] and window["membership"]["contributors"] == 2 for window in windows)
        assert resized[group][0]["global_step"] == 12
    for first, second in zip(resized[0][0]["windows"], resized[1][0]["windows"]):
        assert torch.equal(first["after"], second["after"])


def option(**kwargs):
    return TorchFT(**{"num_replica_groups": 3, "replica_group": 0, "lighthouse": "http://127.0.0.1:1", **kwargs})


@pytest.mark.parametrize("kwargs, match", [
    ({"num_replica_groups": 0}, "num_replica_groups must be an integer >= 1"),
    ({"min_replicas": 4}, r"min_replicas must be an integer in \[1, 3\]"),
    ({"replica_group": 3}, r"replica_group must be an integer in \[0, 2\]"),
    ({"timeout": timedelta(0)}, "timeout must be a positive datetime.timedelta"),
    ({"max_retries": -1}, "max_retries must be an integer >= 0"),
    ({"lighthouse": "http://127.0.0.1:29510/lighthouse"}, r"TorchFT\(lighthouse=...\) must be http://host:port .*"
                                                          "nothing after the port; got 'http://127.0.0.1:29510/"),
    ({"lighthouse": "127.0.0.1:29510"}, r"TorchFT\(lighthouse=...\) must be http://host:port"),
    ({"lighthouse": "http://[::1]"}, "with its port; got 'http://\\[::1\\]'"),
    ({"bind_address": "eth0"}, "bind_address must be an IP address of this host"),
    ({"bind_address": "192.0.2.1"}, "bind_address '192.0.2.1' is not an address of this host"),
])
def test_torchft_arguments_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        option(**kwargs)


def test_an_ipv6_lighthouse_is_accepted_and_reached_from_this_hosts_ipv6_address():
    from lightning_dist.comm.quorum import reaching_address

    assert option(lighthouse="http://[::1]:29510").lighthouse == "http://[::1]:29510"
    assert reaching_address("http://[::1]:29510") == "::1"
    assert reaching_address("http://127.0.0.1:29510") == "127.0.0.1"


def test_the_environment_is_checked_when_the_trainer_is_built(monkeypatch):
    """What a job reads from its environment fails before training, naming the variable: an unresolvable
    Lighthouse host, a malformed TORCHFT_LIGHTHOUSE, a missing secret."""
    from lightning_dist.comm.peer_state import SECRET_ENV, SECRET_FILE_ENV

    def trainer(**kwargs):
        return L.Trainer(strategy=PeriodicAveragingStrategy(fault_tolerance=option(**kwargs)), accelerator="cpu",
                         devices=1)

    monkeypatch.setenv(SECRET_ENV, "a secret of 16 bytes or more")
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    with pytest.raises(ValueError, match="cannot resolve the Lighthouse's host 'no-such-host.invalid'"):
        trainer(lighthouse="http://no-such-host.invalid:29510")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29510/path")
    with pytest.raises(ValueError, match="TORCHFT_LIGHTHOUSE must be http://host:port"):
        trainer(lighthouse=None)
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(ValueError, match=SECRET_ENV):
        trainer()


def test_an_unreachable_lighthouse_is_named_after_the_timeout():
    from helpers.launch import free_port
    from lightning_dist.comm.quorum import wait_for_lighthouse

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConnectionError, match=f"no torchft Lighthouse answers at {url} after 0.5 s"):
        wait_for_lighthouse(url, timedelta(seconds=0.5))


def test_another_torchft_release_is_refused_by_name(monkeypatch):
    import lightning_dist.strategies._torchft_option as torchft_option

    monkeypatch.setattr(torchft_option.importlib.metadata, "version", lambda name: "0.3.0")
    with pytest.raises(ValueError, match="built on torchft 0.2.0 .*installed: torchft 0.3.0"):
        option()


def test_replica_group_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("REPLICA_GROUP_ID", "2")
    assert option(replica_group=None).group() == 2
    monkeypatch.setenv("REPLICA_GROUP_ID", "5")
    with pytest.raises(ValueError, match=r"REPLICA_GROUP_ID must be an integer in \[0, 2\]"):
        option(replica_group=None).group()
    monkeypatch.delenv("REPLICA_GROUP_ID")
    with pytest.raises(ValueError, match="REPLICA_GROUP_ID"):
        option(replica_group=None).group()


@pytest.mark.parametrize("kwargs, match", [
    ({"fragments": 2}, "fragments=2"),
])
def test_periodic_refuses_what_is_not_built_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PeriodicAveragingStrategy(period=4, fault_tolerance=option(), **kwargs)


@pytest.mark.parametrize("strategy, why", [
    (DynamicAveragingStrategy, "balancing set grows among named learners"),
    (SegmentedGossipStrategy, "peers drawn by name"),
    (DownpourSGDStrategy, "asynchronously"),
])
def test_other_strategies_refuse_fault_tolerance_by_name_and_say_why(strategy, why):
    with pytest.raises(ValueError, match=f"{strategy.__name__} does not support fault_tolerance: .*{why}"):
        strategy(fault_tolerance=option())


@pytest.mark.parametrize("trainer, match", [
    ({"devices": 1, "num_nodes": 2}, "num_nodes=2"),
    ({"devices": 2, "num_nodes": 1}, "hierarchy=None makes every rank a replica group"),
])
def test_a_job_is_one_replica_group(trainer, match):
    with pytest.raises(ValueError, match=match):
        L.Trainer(strategy=PeriodicAveragingStrategy(fault_tolerance=option()), accelerator="cpu", **trainer)
