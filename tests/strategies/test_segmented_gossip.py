"""SegmentedGossipStrategy on real Gloo processes against paper 002's one-process definition.

One 4-process launch runs several hand-set rounds (plain gossip, all peers, a general round,
bad set-ups, a non-finite rank); 3-process Lightning fits check bytes over a whole run and a
bit-exact resume. Bad constructor arguments are checked in this process.
"""

import lightning as L
import pytest
import torch

import lightning_dist
from helpers.launch import load_results, run_case_ranks, run_ranks
from lightning_dist import SegmentedGossipStrategy
from lightning_dist.algorithms.averaging import weighted_average
from lightning_dist.algorithms.segmented_gossip import gossip_round, pull_plan, segment_bounds, transfers
from lightning_dist.data import DigitsDataModule, make_partition
from lightning_dist.model_vector import ModelVector
from lightning_dist.models import MLPClassifier
from lightning_dist.strategies.segmented_gossip import _part_size

FLOAT = 4  # bytes per float32 element
DIM = 17  # weights; the model vector adds a 3-element float buffer
N = DIM + 3
WORLD = 4
CASES = {
    "gossip": {"segments": 1, "replicas": 2, "seed": 0, "dim": DIM, "sizes": [1, 2, 3, 4]},
    "all_peers": {"segments": 3, "replicas": WORLD - 1, "seed": 1, "dim": DIM, "sizes": [5, 1, 2, 7]},
    "segmented": {"segments": 5, "replicas": 2, "seed": 2, "dim": DIM, "sizes": [3, 3, 1, 2]},
    # The same round in ranges of 7 entries (3 ranges of the 20, cutting segments 1 and 3 of 4 entries each).
    "segmented_ranges": {"segments": 5, "replicas": 2, "seed": 2, "dim": DIM, "sizes": [3, 3, 1, 2], "bucket": 7},
    "too_many_segments": {"segments": N + 1, "replicas": 1, "seed": 0, "dim": DIM, "sizes": [1, 1, 1, 1]},
    "non_finite": {"segments": 2, "replicas": 1, "seed": 3, "dim": DIM, "sizes": [1, 1, 1, 1], "nan_rank": 2},
    # The consensus of bfloat16 replicas, unequal and identical, weighted by unequal part sizes.
    "bf16_consensus": {"segments": 2, "replicas": 1, "seed": 4, "dim": 997, "sizes": [5, 1, 2, 7],
                       "dtype": "bfloat16", "consensus": True},
    "bf16_identical": {"segments": 2, "replicas": 1, "seed": 5, "dim": 997, "sizes": [5, 1, 2, 7],
                       "dtype": "bfloat16", "consensus": True, "identical": True},
}


@pytest.fixture(scope="module")
def rounds(tmp_path_factory):
    """Per case name, the 4 ranks' results of one round (one torchrun launch for all cases)."""
    out = tmp_path_factory.mktemp("segmented_gossip_rounds")
    return run_case_ranks(WORLD, "segmented_gossip", CASES, out)


def _plan(case):
    return pull_plan(WORLD, case["segments"], case["replicas"], torch.Generator().manual_seed(case["seed"]))


def _expected_sent(case):
    """Protocol bytes each rank sends in one round: the segments it serves plus its finiteness flag."""
    bounds = segment_bounds(N, case["segments"])
    sent = [WORLD - 1] * WORLD  # 1-byte flag to every other rank (all-gather)
    for (provider, _), segments in transfers(_plan(case)).items():
        sent[provider] += sum(bounds[s][1] - bounds[s][0] for s in segments) * FLOAT
    return sent


def _check_round(results, case):
    for result in results:
        assert result["error"] is None, result["error"]
    models = results[0]["models"]
    sizes = torch.tensor(case["sizes"])
    expected = gossip_round(models, _plan(case), segment_bounds(N, case["segments"]), sizes)
    for rank, result in enumerate(results):
        # The preview drawn before the round is the plan the round then used.
        assert torch.equal(result["next_plan"], _plan(case))
        assert result["bounds"] == segment_bounds(N, case["segments"])
        assert torch.equal(result["vector"], expected[rank])
        assert result["stats"].protocol_bytes == _expected_sent(case)[rank]
        # Every rank received S * R segments; over all ranks that is R models.
        assert result["metrics"]["segmented_gossip/segments_received"] == case["segments"] * case["replicas"]
        assert result["metrics"]["segmented_gossip/rounds"] == 1
    segment_bytes = sum(_expected_sent(case)) - WORLD * (WORLD - 1)
    assert segment_bytes == WORLD * case["replicas"] * N * FLOAT


def test_one_segment_is_plain_gossip(rounds):
    """S = 1: each rank ends with the weighted average of itself and its R providers from the plan."""
    case, results = CASES["gossip"], rounds["gossip"]
    _check_round(results, case)
    plan, sizes = _plan(case), torch.tensor(case["sizes"], dtype=torch.float32)
    for rank, result in enumerate(results):
        members = [rank] + plan[rank, 0].tolist()
        expected = (result["models"][members] * sizes[members, None]).sum(0) / sizes[members].sum()
        assert torch.allclose(result["vector"], expected, atol=1e-6)
        assert result["metrics"]["segmented_gossip/pull_links"] == case["replicas"]
        assert not result["in_sync"]


def test_all_peers_is_the_weighted_all_reduce(rounds):
    """R = m - 1: every rank holds the same weighted mean of all models, bit for bit."""
    case, results = CASES["all_peers"], rounds["all_peers"]
    _check_round(results, case)
    sizes = torch.tensor(case["sizes"], dtype=torch.float32)
    weighted_mean = (results[0]["models"] * sizes[:, None]).sum(0) / sizes.sum()
    for result in results:
        assert torch.equal(result["vector"], results[0]["vector"])
        assert torch.allclose(result["vector"], weighted_mean, atol=1e-6)
        assert result["in_sync"]
        assert result["metrics"]["segmented_gossip/pull_links"] == WORLD - 1
        assert result["metrics"]["segmented_gossip/links"] == WORLD - 1


def test_segmented_round_bytes_and_links(rounds):
    """S = 5, R = 2 on 4 ranks (buffer included): the one-process round, exact bytes, links from the plan."""
    case, results = CASES["segmented"], rounds["segmented"]
    _check_round(results, case)
    links = transfers(_plan(case))
    peers = [set() for _ in range(WORLD)]
    for provider, puller in links:
        peers[provider].add(puller)
        peers[puller].add(provider)
    for rank, result in enumerate(results):
        metrics = result["metrics"]
        assert metrics["segmented_gossip/pull_links"] == len({p for p, q in links if q == rank}) == WORLD - 1
        assert metrics["segmented_gossip/links"] == len(peers[rank])
        assert metrics["segmented_gossip/links_min"] == min(map(len, peers))
        assert metrics["segmented_gossip/links_max"] == max(map(len, peers))
        # Dataset-size all-gather, finiteness flag, then one message per puller served.
        assert result["stats"].messages == 2 * (WORLD - 1) + sum(1 for p, _ in links if p == rank)


def test_a_round_in_ranges_is_the_round_with_one_message_per_link_and_range(rounds):
    """A round run a range of 7 entries at a time (a large model's is AVERAGE_BUCKET's) moves the same bytes and
    gives the one-process round bit for bit: each link sends, per range, the pieces of its segments in it."""
    case, results = CASES["segmented_ranges"], rounds["segmented_ranges"]
    _check_round(results, case)
    for ranged, whole in zip(results, rounds["segmented"]):
        assert torch.equal(ranged["vector"], whole["vector"])
    bounds = segment_bounds(N, case["segments"])
    for rank, result in enumerate(results):
        messages = 0
        for begin in range(0, N, 7):
            pieces = [segment for segment, (start, stop) in enumerate(bounds) if start < begin + 7 and stop > begin]
            messages += sum(1 for provider, _ in transfers(_plan(case)[:, pieces]) if provider == rank)
        assert result["stats"].messages == 2 * (WORLD - 1) + messages


def test_more_segments_than_model_elements_is_refused_at_setup(rounds):
    for result in rounds["too_many_segments"]:
        assert result["error"] == (
            f"ValueError: segments must be an integer in [1, {N}] (segments of a model vector of {N} elements); "
            f"got {N + 1}"
        )


def test_non_finite_rank_is_named_and_nothing_is_aggregated(rounds):
    for rank, result in enumerate(rounds["non_finite"]):
        assert result["error"] is not None and "NonFiniteModelError" in result["error"] and "rank(s) [2]" in result["error"]
        assert result["stats"].protocol_bytes == WORLD - 1  # only the flag went out
        if rank != 2:
            assert torch.equal(result["vector"], result["models"][rank])


def test_the_consensus_of_16_bit_replicas_is_summed_in_float32_and_rounded_once(rounds):
    """The weighted mean every rank evaluates, checkpoints and ends fit with, for bfloat16 replicas: the package's
    weighted_average (float32 sum, one rounding), and identical replicas are their own mean. Weighted and summed in
    bfloat16 (before), 13.5% of the entries of identical replicas changed."""
    sizes = CASES["bf16_consensus"]["sizes"]
    for case in ("bf16_consensus", "bf16_identical"):
        results = rounds[case]
        models = results[0]["models"]
        assert models.dtype == torch.bfloat16
        expected = weighted_average(list(models), [float(size) for size in sizes])
        for result in results:
            assert result["error"] is None, result["error"]
            assert result["consensus"].dtype == torch.bfloat16 and torch.equal(result["consensus"], expected), case
    assert torch.equal(rounds["bf16_identical"][0]["consensus"], rounds["bf16_identical"][0]["models"][0])
    exact = (rounds["bf16_consensus"][0]["models"].double() * torch.tensor(sizes, dtype=torch.float64)[:, None]).sum(0)
    exact = (exact / sum(sizes)).to(torch.bfloat16)
    differing = (rounds["bf16_consensus"][0]["consensus"] != exact).float().mean().item()
    assert differing < 0.01, differing  # double rounding (float64 -> float32 -> bfloat16) at rare ties only


def _fit(tmp_path, name, **spec):
    out = tmp_path / name
    strategy = {"class": "SegmentedGossipStrategy", "kwargs": {"segments": 3, "replicas": 1, "period": 4, "seed": 7}}
    run_ranks(3, "fit", {"strategy": strategy, "data": {"partition": "dirichlet"}, **spec}, out)
    results = load_results(out, 3)
    for result in results:
        assert result["error"] is None, result["error"]
    return results


def test_fit_counts_every_segment_weights_true_part_sizes_and_resume_is_bit_exact(tmp_path):
    """3 ranks on Dirichlet parts, S = 3, R = 1, period 4, 3 epochs of 15 steps: exact protocol bytes over
    the run; the checkpointed model is the |D_j|-weighted mean of the ranks' replicas with the true part
    sizes; stopped after epoch 1 (step 15, not a multiple of the period) and resumed, it ends bit for bit equal."""
    full = _fit(tmp_path, "full", trainer={"max_epochs": 3}, checkpoint_dir=str(tmp_path / "ckpt"))
    steps = full[0]["local_steps"]
    rounds = steps // 4
    model_bytes = full[0]["vector"].numel() * FLOAT
    assert steps == 45 and rounds == 11
    # Per round: every rank receives S * R segments (R = 1 model) and sends a 1-byte flag to 2 ranks.
    assert full[0]["comm"].protocol_bytes == rounds * (3 * 1 * model_bytes + 3 * 2)
    assert full[0]["comm"].syncs == rounds
    for result in full:
        assert result["metrics"]["segmented_gossip/segments_received"] == 3
        assert result["metrics"]["segmented_gossip/rounds"] == rounds
        assert torch.equal(result["vector"], full[0]["vector"])  # every rank ends with the (weighted) average
    (checkpoint,) = sorted((tmp_path / "ckpt").glob("epoch=0-*.ckpt"))
    state = torch.load(checkpoint, weights_only=False)
    assert state["global_step"] % 4 != 0
    data = DigitsDataModule(partition="dirichlet")
    data.setup("fit")
    sizes = [len(part) for part in make_partition("dirichlet", data.train_set.labels.numpy(), 3, seed=0, alpha=0.5)]
    replicas = [replica["vector"] for replica in state["lightning_dist"]["replicas"]]
    module = MLPClassifier(num_features=data.num_features, num_classes=data.num_classes)
    module.load_state_dict(state["state_dict"])
    consensus = ModelVector(module).get()
    # Paper 002's global model: sum_j |D_j| W_j / sum_j |D_j| (here far from the plain mean of the replicas).
    assert torch.allclose(consensus, weighted_average(replicas, sizes), rtol=0, atol=1e-6)
    assert not torch.allclose(consensus, weighted_average(replicas), rtol=0, atol=1e-4)
    resumed = _fit(tmp_path, "resumed", trainer={"max_epochs": 3}, ckpt_path=str(checkpoint))
    for a, b in zip(full, resumed):
        assert torch.equal(a["vector"], b["vector"])
        assert a["local_steps"] == b["local_steps"]
        assert a["comm"].protocol_bytes == b["comm"].protocol_bytes and a["comm"].syncs == b["comm"].syncs
        assert a["protocol"] == b["protocol"] and a["metrics"] == b["metrics"]


def test_ranks_are_weighted_by_their_true_part_sizes():
    """Paper 002's eq. (3) with the |D_j| the strategy reads from Dirichlet parts (unequal; the sampler
    yields the same count on every rank): each segment is sum_j |D_j| W_j[l] / sum_j |D_j| over its providers."""
    data = DigitsDataModule(partition="dirichlet", seed=0)
    data.setup("fit")
    sizes = [_part_size(data.train_loader(3, rank)) for rank in range(3)]
    parts = make_partition("dirichlet", data.train_set.labels.numpy(), 3, seed=0, alpha=0.5)
    assert sizes == [len(part) for part in parts] and len(set(sizes)) == 3
    assert len({len(data.train_loader(3, rank).sampler) for rank in range(3)}) == 1
    values = [1.0, 10.0, 100.0]  # W_j: every element of rank j's model
    models = torch.tensor(values)[:, None].repeat(1, 4)
    plan = pull_plan(3, 2, 1, torch.Generator().manual_seed(0))
    after = gossip_round(models, plan, segment_bounds(4, 2), torch.tensor(sizes))
    for rank in range(3):
        for segment, (start, stop) in enumerate(segment_bounds(4, 2)):
            peer = int(plan[rank, segment, 0])
            expected = (sizes[rank] * values[rank] + sizes[peer] * values[peer]) / (sizes[rank] + sizes[peer])
            assert torch.allclose(after[rank, start:stop], torch.full((stop - start,), expected))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"segments": 0}, r"segments must be an integer >= 1 \(segments the model vector is split into\); got 0"),
        ({"segments": 2.5}, r"segments must be an integer >= 1"),
        ({"replicas": 0}, r"replicas must be an integer >= 1 \(peers each segment is pulled from, or None for the "
                          r"default\); got 0"),
        ({"replicas": True}, r"replicas must be an integer >= 1"),
        ({"period": -1}, r"period must be an integer >= 1 \(optimizer steps between gossip rounds\); got -1"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SegmentedGossipStrategy(**kwargs)


def test_replicas_must_leave_a_peer_and_one_process_is_refused_when_the_trainer_is_built():
    with pytest.raises(ValueError, match=r"replicas must be an integer in \[1, 2\] .* got 3 with world_size=3"):
        L.Trainer(strategy=SegmentedGossipStrategy(replicas=3), accelerator="cpu", devices=3, logger=False)
    with pytest.raises(ValueError, match=r"needs at least 2 \(devices \* num_nodes >= 2\)"):
        L.Trainer(strategy=SegmentedGossipStrategy(replicas=1), accelerator="cpu", devices=1, logger=False)


def test_name_resolves_with_paper_defaults():
    lightning_dist.register_strategies()
    strategy = L.Trainer(strategy="segmented_gossip", accelerator="cpu", devices=4, logger=False).strategy
    assert isinstance(strategy, SegmentedGossipStrategy)
    assert (strategy.segments, strategy.replicas, strategy.period) == (10, 2, 40)
