"""hierarchy="node" on 2 nodes x 2 ranks (two torchrun agents on this host): DDP inside a node, periodic averaging
between nodes in slices, bytes by level; refusals by name."""

import pytest
import torch

import lightning_dist
from helpers.launch import load_results, run_nodes
from lightning_dist.algorithms.subset_average import chunk_bounds
from lightning_dist.comm import CommStats
from lightning_dist.comm.nodes import NodeLayout
from lightning_dist.models import MLPClassifier

NODES, RANKS_PER_NODE, PERIOD = 2, 2, 4


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory):
    """3 nodes x 2 ranks: FedAvg's subsets of nodes and dynamic averaging's partial sets need more than 2 learners."""
    out = tmp_path_factory.mktemp("three_nodes")
    runs = [{"name": "fedavg", "record_vectors": True, "bucket": 1000,  # rounds a bucket of 1000 entries at a time
             "strategy": {"class": "PeriodicAveragingStrategy",
                          "kwargs": {"period": PERIOD, "client_fraction": 0.6, "seed": 3, "hierarchy": "node"}}},
            # Checks every 2 steps with a threshold that gave 7 full and 3 partial synchronizations in 24 steps.
            {"name": "dynamic", "record_vectors": True, "bucket": 1000,  # balancings gathered and shared in buckets
             "strategy": {"class": "DynamicAveragingStrategy",
                          "kwargs": {"divergence_threshold": 0.02, "check_every": 2, "hierarchy": "node"}}}]
    run_nodes(3, RANKS_PER_NODE, "fit", {"data": {"partition": "class_sorted"},
                                         "trainer": {"max_epochs": 3, "num_nodes": 3}, "runs": runs}, out)
    return {run["name"]: load_results(out / run["name"], 3 * RANKS_PER_NODE) for run in runs}


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    out = tmp_path_factory.mktemp("hierarchy")
    runs = [{"name": "periodic", "record_vectors": True,
             "strategy": {"class": "PeriodicAveragingStrategy", "kwargs": {"period": PERIOD, "hierarchy": "node"}}},
            # A threshold that some checks violate and some balancing sets resolve (partial synchronizations).
            {"name": "dynamic", "record_vectors": True,
             "strategy": {"class": "DynamicAveragingStrategy",
                          "kwargs": {"divergence_threshold": 0.05, "check_every": PERIOD, "hierarchy": "node"}}},
            {"name": "gossip", "record_vectors": True, "bucket": 1000,  # a round in ranges of 1000 entries
             "strategy": {"class": "SegmentedGossipStrategy",
                          "kwargs": {"segments": 2, "replicas": 1, "period": PERIOD, "hierarchy": "node"}}},
            # Blocking synchronizations a bucket of 1000 entries at a time (the model has 8970), each bucket's chunks
            # between nodes.
            {"name": "periodic_int8", "record_vectors": True, "bucket": 1000,
             "strategy": {"class": "PeriodicAveragingStrategy",
                          "kwargs": {"period": PERIOD, "compression": "int8", "hierarchy": "node"}}},
            {"name": "periodic_buckets", "record_vectors": True, "bucket": 1000,
             "strategy": {"class": "PeriodicAveragingStrategy", "kwargs": {"period": PERIOD, "hierarchy": "node"}}},
            {"name": "downpour_sync", "record_vectors": True,
             "strategy": {"class": "DownpourSGDStrategy",
                          "kwargs": {"push_every": PERIOD, "synchronous": True, "hierarchy": "node"}}},
            {"name": "downpour", "record_vectors": True,
             "strategy": {"class": "DownpourSGDStrategy", "kwargs": {"push_every": PERIOD, "hierarchy": "node"}}}]
    runs[0]["checkpoint_dir"] = str(out / "ckpt")
    downpour_sync = next(run for run in runs if run["name"] == "downpour_sync")
    downpour_sync["checkpoint_dir"] = str(out / "ckpt_downpour")
    spec = {"data": {"partition": "class_sorted"}, "trainer": {"max_epochs": 2, "num_nodes": NODES}}
    run_nodes(NODES, RANKS_PER_NODE, "fit", {**spec, "runs": runs}, out)
    results = {run["name"]: load_results(out / run["name"], NODES * RANKS_PER_NODE) for run in runs}
    # The periodic run's first-epoch checkpoint resumed by 2 nodes (as written) and by 1 node.
    checkpoint = str(next((out / "ckpt").glob("epoch=0-*.ckpt")))
    resumed = {"name": "resumed", **{key: runs[0][key] for key in ("record_vectors", "strategy")}, "ckpt_path": checkpoint}
    downpour_checkpoint = str(next((out / "ckpt_downpour").glob("epoch=0-*.ckpt")))
    resumed_downpour = {"name": "resumed_downpour", "record_vectors": True, "strategy": downpour_sync["strategy"],
                        "ckpt_path": downpour_checkpoint}
    run_nodes(NODES, RANKS_PER_NODE, "fit", {**spec, "runs": [resumed, resumed_downpour]}, out / "same")
    results["resumed_same"] = load_results(out / "same" / "resumed", NODES * RANKS_PER_NODE)
    results["resumed_downpour"] = load_results(out / "same" / "resumed_downpour", NODES * RANKS_PER_NODE)
    # One node: the 2-node checkpoint resumed, and from the start the hierarchy against Lightning's DDP.
    one_node = {**spec, "trainer": {**spec["trainer"], "num_nodes": 1}}
    single = [resumed, {**resumed_downpour, "name": "resumed_downpour"}, {"name": "ddp", "record_vectors": True, "strategy": "ddp"},
              {"name": "hierarchy", "record_vectors": True, "strategy": runs[0]["strategy"],
               "checkpoint_dir": str(out / "ckpt_one")}]
    run_nodes(1, RANKS_PER_NODE, "fit", {**one_node, "runs": single}, out / "one")
    for run in single:
        results[f"one_node_{run['name']}"] = load_results(out / "one" / run["name"], RANKS_PER_NODE)
    # One node grown to two: the one-node run's first-epoch checkpoint resumed by 2 nodes.
    one_checkpoint = str(next((out / "ckpt_one").glob("epoch=0-*.ckpt")))
    grown = {"name": "grown", "record_vectors": True, "strategy": runs[0]["strategy"], "ckpt_path": one_checkpoint}
    run_nodes(NODES, RANKS_PER_NODE, "fit", {**spec, "runs": [grown]}, out / "grown")
    results["grown"] = load_results(out / "grown" / "grown", NODES * RANKS_PER_NODE)
    results["one_node_checkpoint"] = torch.load(one_checkpoint, weights_only=False)
    results["checkpoint"] = torch.load(checkpoint, weights_only=False)
    return results


def node_vectors(results):
    """Each node's model after each step (its first rank's), checked: no rank failed, and a node's two ranks agree
    after every step."""
    for result in results:
        assert result["error"] is None, result["error"]
    vectors = [result["step_vectors"] for result in results]
    for step in range(vectors[0].shape[0]):
        for node in range(len(vectors) // RANKS_PER_NODE):
            first = vectors[node * RANKS_PER_NODE][step]
            assert all(torch.equal(first, vectors[node * RANKS_PER_NODE + local][step])
                       for local in range(1, RANKS_PER_NODE)), (step, node)
    return vectors[::RANKS_PER_NODE]


def test_a_node_is_one_learner_and_nodes_agree_after_each_average(two_nodes):
    """After every step the two ranks of a node hold the same model (DDP inside the node); after every PERIOD-th
    step all four do (the average between nodes); in between the nodes' models differ (class-sorted parts)."""
    results = two_nodes["periodic"]
    vectors = node_vectors(results)
    steps = vectors[0].shape[0]
    assert steps == results[0]["global_step"] > 2 * PERIOD
    for step in range(steps):
        if (step + 1) % PERIOD == 0:
            assert torch.equal(vectors[0][step], vectors[1][step]), step
        else:
            assert not torch.equal(vectors[0][step], vectors[1][step]), step
    assert all(torch.equal(result["vector"], results[0]["vector"]) for result in results)
    assert torch.isfinite(torch.tensor(results[0]["callback_metrics"]["val_loss"]))


def test_each_rank_carries_its_chunk_between_nodes_and_bytes_are_counted_by_level(two_nodes):
    """An average between N nodes of L ranks: local rank j all-reduces chunk j with its N - 1 peers (a ring's
    2 (N - 1) chunk sizes over the slice), then the node all-gathers the chunks (padded to the largest); DDP's
    gradient all-reduce inside each node counts 2 (L - 1) gradient sizes per node and step."""
    results = two_nodes["periodic"]
    stats = results[0]["comm"]
    numel = results[0]["vector"].numel()
    parameters = sum(parameter.numel() for parameter in MLPClassifier(64, 10).parameters())
    widths = [stop - start for start, stop in chunk_bounds(numel, list(range(RANKS_PER_NODE))).values()]
    inter_per_mean = sum(2 * (NODES - 1) * width * 4 for width in widths) * 1  # one slice per local rank
    intra_per_mean = NODES * RANKS_PER_NODE * (RANKS_PER_NODE - 1) * max(widths) * 4
    syncs = results[0]["global_step"] // PERIOD
    assert stats.syncs == syncs
    assert stats.bytes_by_purpose["protocol"] == syncs * (inter_per_mean + intra_per_mean)
    averaged = sum(stats.bytes_by_purpose[purpose] for purpose in ("protocol", "evaluation", "final"))
    means, rest = divmod(averaged, inter_per_mean + intra_per_mean)  # validations and the end of fit average too
    assert rest == 0 and means >= syncs
    gradients = results[0]["global_step"] * NODES * 2 * (RANKS_PER_NODE - 1) * parameters * 4
    assert stats.bytes_by_purpose["gradients"] == gradients
    assert stats.bytes_by_level["inter_node"] == means * inter_per_mean
    assert stats.bytes_by_level["intra_node"] == means * intra_per_mean + gradients
    # Per rank and average, 1/L of what a flat ring over all N L ranks would send (mostly across nodes).
    flat_ring_per_rank = 2 * (NODES * RANKS_PER_NODE - 1) / (NODES * RANKS_PER_NODE) * numel * 4
    assert inter_per_mean / (NODES * RANKS_PER_NODE) < flat_ring_per_rank / RANKS_PER_NODE


def test_nodes_must_be_even_and_learners_are_numbered_as_torchs_slice_groups_number_them():
    """Nodes are numbered by their lowest global rank, which is each node's rank in every slice group (torch's
    new_group sorts ranks); a numbering where slice groups would order the nodes differently is refused by name."""
    assert NodeLayout.from_node_ranks([0, 0, 1, 1]).slices() == [[0, 2], [1, 3]]
    assert NodeLayout.from_node_ranks([1, 0, 1, 0]).nodes == ((0, 2), (1, 3))  # cyclic: node 1 holds rank 0
    assert NodeLayout.from_node_ranks([1, 1, 0, 0]).slices() == [[0, 2], [1, 3]]
    for layout in (NodeLayout.from_node_ranks([2, 0, 1, 2, 0, 1]), NodeLayout.from_node_ranks([0, 1, 0, 1])):
        assert all(slice_ranks == sorted(slice_ranks) for slice_ranks in layout.slices())
    with pytest.raises(ValueError, match=r"same number of ranks on every node .* node 0: 3, node 1: 1"):
        NodeLayout.from_node_ranks([0, 0, 0, 1])
    with pytest.raises(ValueError, match=r"same node order for every local rank .* node 0: ranks \[0, 3\]; "
                                         r"node 1: ranks \[1, 2\]"):
        NodeLayout.from_node_ranks([0, 1, 1, 0])


def test_bad_settings_are_named_before_any_process_starts():
    import lightning as L

    with pytest.raises(ValueError, match=r"hierarchy must be None or one of 'node' .* got 'rack'"):
        lightning_dist.PeriodicAveragingStrategy(hierarchy="rack")
    with pytest.raises(ValueError, match=r"replicas must be an integer in \[1, 1\] \(distinct peer nodes"):
        L.Trainer(strategy=lightning_dist.SegmentedGossipStrategy(hierarchy="node", replicas=2), num_nodes=2, devices=2,
                  accelerator="cpu", logger=False)


def test_dynamic_averaging_between_nodes_keeps_nodes_whole_and_synchronizes_on_violations(two_nodes):
    """Dynamic averaging with the nodes as learners: a node's two ranks agree after every step; with two nodes a
    balancing set that starts from a violating node grows to both, so every resolved violation is a full
    synchronization, and the nodes agree at exactly the checks where one happened (class-sorted parts keep them
    apart otherwise)."""
    results = two_nodes["dynamic"]
    vectors = node_vectors(results)
    metrics = results[0]["metrics"]
    checks = [step for step in range(vectors[0].shape[0]) if (step + 1) % PERIOD == 0]
    assert metrics["dynamic/checks"] == len(checks) and metrics["dynamic/partial_syncs"] == 0
    agreed = [step for step in checks if torch.equal(vectors[0][step], vectors[1][step])]
    assert 0 < len(agreed) == metrics["dynamic/full_syncs"] < len(checks), (agreed, metrics)
    stats = results[0]["comm"]
    assert stats.bytes_by_level["inter_node"] > 0 and stats.bytes_by_purpose["gradients"] > 0
    assert all(torch.equal(result["vector"], results[0]["vector"]) for result in results)


def test_resume_on_as_many_nodes_is_bit_exact_and_on_one_node_starts_from_the_consensus(two_nodes):
    """The first epoch's checkpoint resumed by 2 nodes ends where the uninterrupted run does, bit for bit; resumed by
    1 node of 2 ranks (one learner, plain DDP then) every rank starts from the checkpoint's consensus and the two
    ranks stay equal."""
    straight, same, one = two_nodes["periodic"], two_nodes["resumed_same"], two_nodes["one_node_resumed"]
    for a, b in zip(straight, same):
        assert b["error"] is None, b["error"]
        assert torch.equal(a["vector"], b["vector"])
        assert a["comm"].bytes_by_level == b["comm"].bytes_by_level
    checkpoint = two_nodes["checkpoint"]
    consensus = torch.cat([value.flatten() for value in checkpoint["state_dict"].values()])
    assert checkpoint["lightning_dist"]["world_size"] == NODES * RANKS_PER_NODE
    for result in one:
        assert result["error"] is None, result["error"]
        assert torch.equal(result["start_vector"], consensus)
        assert torch.equal(result["step_vectors"][-1], one[0]["step_vectors"][-1])
    assert one[0]["global_step"] == checkpoint["global_step"] + one[0]["num_training_batches"]  # epoch 2 of 2
    # One node: nothing more crosses between nodes; the counters go on from the checkpoint's totals.
    saved = [CommStats.from_state_dict(replica["comm"]) for replica in checkpoint["lightning_dist"]["replicas"]]
    assert one[0]["comm"].bytes_by_level["inter_node"] == sum(stats.bytes_by_level["inter_node"] for stats in saved) > 0


def test_resume_of_one_node_on_two_starts_both_nodes_from_the_checkpoint(two_nodes):
    """1 node -> 2 nodes: the checkpoint of one node of 2 ranks (one learner) resumed by 2 nodes of 2 ranks. Every
    rank starts from the checkpoint's model; then the two nodes drift apart (class-sorted parts) and average again
    between nodes, a node's two ranks equal after every step, all four equal at the end; the counters go on from
    the checkpoint's totals."""
    grown, checkpoint = two_nodes["grown"], two_nodes["one_node_checkpoint"]
    assert checkpoint["lightning_dist"]["world_size"] == RANKS_PER_NODE
    consensus = torch.cat([value.flatten() for value in checkpoint["state_dict"].values()])
    vectors = node_vectors(grown)  # no rank failed; node mates equal after every step
    assert all(torch.equal(result["start_vector"], consensus) for result in grown)
    steps = vectors[0].shape[0]
    assert steps == grown[0]["num_training_batches"] and grown[0]["global_step"] == checkpoint["global_step"] + steps
    agreed = [step for step in range(steps) if torch.equal(vectors[0][step], vectors[1][step])]
    assert 0 < len(agreed) < steps, agreed  # the nodes drifted apart and averaged between them
    assert all(torch.equal(result["vector"], grown[0]["vector"]) for result in grown)
    saved = [CommStats.from_state_dict(replica["comm"]) for replica in checkpoint["lightning_dist"]["replicas"]]
    assert sum(stats.bytes_by_level["inter_node"] for stats in saved) == 0  # one node: nothing crossed
    assert grown[0]["comm"].bytes_by_level["inter_node"] > 0
    assert grown[0]["comm"].bytes_by_purpose["gradients"] > sum(stats.bytes_by_purpose["gradients"] for stats in saved)


def test_segmented_gossip_between_nodes_pulls_each_part_from_the_other_node(two_nodes):
    """Gossip with the nodes as peers, R = N - 1 = 1: every round each rank pulls both segments of its part from its
    peer in the other node and aggregates them weighted by the nodes' data (the sum of their ranks' parts), so all
    four ranks agree after every round; a node's two ranks always do. Per round each rank sends its whole part
    (its S segments) to the other node, and the node all-gathers the aggregated parts: all of it in ranges of 1000
    entries (each range's pieces of the segments, then the node's gather of the range)."""
    results = two_nodes["gossip"]
    vectors = node_vectors(results)
    for step in range(vectors[0].shape[0]):
        if (step + 1) % PERIOD == 0:
            assert torch.equal(vectors[0][step], vectors[1][step]), step
    numel = results[0]["vector"].numel()
    widths = [stop - start for start, stop in chunk_bounds(numel, list(range(RANKS_PER_NODE))).values()]
    rounds = results[0]["global_step"] // PERIOD
    assert results[0]["metrics"]["segmented_gossip/rounds"] == rounds
    parts = NODES * numel * 4  # every rank's part once, to its peer
    gathers = NODES * RANKS_PER_NODE * (RANKS_PER_NODE - 1) * max(widths) * 4
    flags = NODES * RANKS_PER_NODE * (NODES * RANKS_PER_NODE - 1)  # the 1-byte finiteness all-gather over all ranks
    assert results[0]["comm"].bytes_by_purpose["protocol"] == rounds * (parts + gathers + flags)


def test_a_single_node_trains_as_lightnings_ddp(two_nodes):
    """hierarchy='node' on one node of 2 ranks is allowed and is DDP: the same model as Lightning's DDPStrategy after
    every step (averaging one node changes nothing)."""
    ddp, hierarchy = two_nodes["one_node_ddp"], two_nodes["one_node_hierarchy"]
    for result in ddp + hierarchy:
        assert result["error"] is None, result["error"]
    assert torch.equal(hierarchy[0]["start_vector"], ddp[0]["start_vector"])
    assert hierarchy[0]["step_vectors"].shape == ddp[0]["step_vectors"].shape
    for rank in range(RANKS_PER_NODE):
        assert torch.allclose(hierarchy[rank]["step_vectors"], ddp[rank]["step_vectors"], rtol=0, atol=1e-6), rank
    assert hierarchy[0]["comm"].bytes_by_level["inter_node"] == 0


def test_synchronizations_in_buckets_between_nodes_are_the_whole_models(two_nodes):
    """Averaging between nodes a bucket at a time (each rank carrying its chunk of each bucket) gives every rank the
    models of averaging the model whole, bit for bit (two nodes: each entry's sum is the same two numbers), with the
    same bytes at each level."""
    whole, buckets = two_nodes["periodic"], two_nodes["periodic_buckets"]
    for a, b in zip(whole, buckets):
        assert torch.equal(a["step_vectors"], b["step_vectors"])
        assert a["comm"].bytes_by_level == b["comm"].bytes_by_level


def test_compressed_synchronizations_between_nodes_agree_with_a_quarter_of_the_bytes(two_nodes):
    """compression="int8" between nodes, in buckets: every rank compresses its chunk of each bucket's delta from the
    common model, the slice averages the codes; the nodes agree bit for bit after each synchronization, and between
    nodes the protocol sends about a quarter of the float32 run's bytes."""
    vectors = node_vectors(two_nodes["periodic_int8"])
    for step in range(PERIOD - 1, vectors[0].shape[0], PERIOD):
        assert torch.equal(vectors[0][step], vectors[1][step]), step
    exact, compressed = (two_nodes[name][0]["comm"] for name in ("periodic", "periodic_int8"))
    assert compressed.syncs == exact.syncs
    ratio = compressed.bytes_by_level["inter_node"] / exact.bytes_by_level["inter_node"]
    assert 0.2 < ratio < 0.35, ratio


def test_fedavg_averages_subsets_of_nodes(three_nodes):
    """FedAvg with C = 0.6 of 3 nodes: each round 2 nodes, drawn by the shared seeded generator, average their models
    (part by part over the slice groups) and agree afterwards; the third node keeps its own."""
    from lightning_dist.algorithms.averaging import sample_participants

    vectors = node_vectors(three_nodes["fedavg"])
    generator = torch.Generator().manual_seed(3)
    for step in range(PERIOD - 1, vectors[0].shape[0], PERIOD):
        first, second = sample_participants(3, 0.6, generator)
        (outsider,) = {0, 1, 2} - {first, second}
        assert torch.equal(vectors[first][step], vectors[second][step]), step
        assert not torch.equal(vectors[first][step], vectors[outsider][step]), step


def test_dynamic_averaging_balances_sets_of_nodes(three_nodes):
    """Dynamic averaging among 3 nodes: at a check all three agree exactly when a full synchronization happened and
    exactly two when a balancing set of two resolved the violation (class-sorted parts keep nodes apart otherwise)."""
    results = three_nodes["dynamic"]
    vectors = node_vectors(results)
    full = partial = 0
    for step in range(1, vectors[0].shape[0], 2):
        agreeing = [torch.equal(vectors[a][step], vectors[b][step]) for a, b in ((0, 1), (0, 2), (1, 2))]
        full += all(agreeing)
        partial += sum(agreeing) == 1
    metrics = results[0]["metrics"]
    assert (full, partial) == (metrics["dynamic/full_syncs"], metrics["dynamic/partial_syncs"]), metrics
    assert full > 0 and partial > 0


def test_downpour_between_nodes_serves_each_part_from_its_shard(two_nodes):
    """DownpourSGD with a node as a worker: local rank j pushes chunk j to the server shard on node 0's local rank j.
    Synchronous rounds: every rank ends a round on the round's global model, which is the mean of the nodes' models
    (the same as periodic averaging's up to float32 rounding), and each shard's version counts the rounds.
    Asynchronous: nodes push on their own; both ranks of a node always agree, and every rank ends on the global
    model. Resumed on as many nodes the synchronous run ends bit for bit where it did; on one node of 2 ranks it
    keeps the shards (same ranks per node) and their versions go on."""
    sync, periodic = node_vectors(two_nodes["downpour_sync"]), node_vectors(two_nodes["periodic"])
    results = two_nodes["downpour_sync"]
    for step in range(PERIOD - 1, sync[0].shape[0], PERIOD):
        assert torch.equal(sync[0][step], sync[1][step]), step
    assert torch.allclose(sync[0][-1], periodic[0][-1], rtol=0, atol=1e-5)
    rounds = -(-results[0]["global_step"] // PERIOD)
    assert results[0]["metrics"]["downpour/version"] == rounds
    node_vectors(two_nodes["downpour"])
    asynchronous = two_nodes["downpour"]
    assert all(torch.equal(result["vector"], asynchronous[0]["vector"]) for result in asynchronous)
    assert asynchronous[0]["comm"].bytes_by_level["inter_node"] > 0
    for a, b in zip(results, two_nodes["resumed_downpour"]):
        assert b["error"] is None, b["error"]
        assert torch.equal(a["vector"], b["vector"])
    one = two_nodes["one_node_resumed_downpour"]
    for result in one:
        assert result["error"] is None, result["error"]
        assert torch.equal(result["vector"], one[0]["vector"])
    assert one[0]["metrics"]["downpour/version"] > results[0]["metrics"]["downpour/version"] // 2


def test_downpour_between_nodes_counts_every_push_and_reply_as_inter_node(two_nodes):
    """Issue 40: the transport counted its sends under no level, so inter_node bytes missed DownpourSGD's pushes and
    replies. Local rank j of node 1 pushes chunk j to the shard on node 0's local rank j and gets it back: a 32-byte
    header and the chunk in float32 each way per push, and a header when it is done; node 0's ranks push by local
    calls. The transport's bytes (the summed counters less every rank's own group's) are exactly these, every one
    between nodes, so its per-level bytes add up to its total."""
    header = 4 * 8  # kind, rank, version, spare as int64
    numel = two_nodes["downpour"][0]["vector"].numel()
    widths = [stop - start for start, stop in chunk_bounds(numel, list(range(RANKS_PER_NODE))).values()]
    for name in ("downpour", "downpour_sync"):
        results = two_nodes[name]
        node_vectors(results)
        crossed = sum(result["syncs"] * 2 * (header + 4 * widths[local]) + header
                      for local, result in enumerate(results[RANKS_PER_NODE:]))
        summed = results[0]["comm"]
        transport = summed.bytes_sent - sum(result["local_comm"].bytes_sent for result in results)
        by_level = {level: summed.bytes_by_level[level] - sum(result["local_comm"].bytes_by_level[level]
                                                              for result in results)
                    for level in summed.bytes_by_level}
        assert transport == crossed, name
        assert by_level == {"intra_node": 0, "inter_node": crossed}, name
        assert sum(by_level.values()) == transport, name
