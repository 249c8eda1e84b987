"""Streaming synchronization (Streaming DiLoCo, issue 41) in PeriodicAveragingStrategy, on 3 Gloo processes.

Expected models are computed here, in float64, from the definition (lightning_dist/algorithms/streaming.py, Algorithm 1
of Douillard et al. 2025) and the vectors each rank recorded before the protocol ran after every optimizer step:
the mean of the replicas' fragment at its start step, DiLoCo's Nesterov outer step per fragment (lr 0.7, momentum
0.9), and the mix ``alpha * local + (1 - alpha) * synchronized`` at the merge step, ``tau`` steps later.
"""

import pytest
import torch
import torch.distributed as dist

from helpers.launch import load_results, run_ranks
from lightning_dist.algorithms.compression import compressed_model_mean
from lightning_dist.algorithms.streaming import StreamingPlan
from lightning_dist.algorithms.subset_average import chunk_bounds
from lightning_dist.comm import Communicator
from lightning_dist.model_vector import ModelVector
from lightning_dist.strategies._fragment_exchange import Lanes
from lightning_dist.strategies._streaming import StreamingSync

LR, MU = 0.7, 0.9
PERIOD, FRAGMENTS, DELAY, ALPHA = 6, 3, 1, 0.5  # stride 2: starts after steps 1, 3, 5, ...; merges after 2, 4, 6, ...
STREAM = {"period": PERIOD, "fragments": FRAGMENTS, "fragment_sync_delay": DELAY, "fragment_update_alpha": ALPHA}
TRAINER = {"max_epochs": 2}  # 30 steps: digits, class-sorted over 3 ranks: 15 batches an epoch; the epoch-0 checkpoint is
# written after step 15, with fragment 1's exchange (started after step 15) in flight
EXACT = {**TRAINER, "precision": "64-true"}  # float64: the replay's rounding and the strategy's agree to 1e-12
# fit ends after step 3 with fragment 0's exchange in flight (stride 4, alpha 0: fragment 0 starts after step 3 and
# merges after step 4, fragment 1 starts after step 7 and merges after step 8), a checkpoint written after it, resumed
ENDED = {"period": 8, "fragments": 2, "fragment_sync_delay": 1}
ENDED_IN_FLIGHT = {"kwargs": ENDED, "trainer": {"max_steps": 3, "precision": "64-true"},
                   "save_after_fit": "ended_in_flight.ckpt"}
RESUMED_AFTER_FIT = {"kwargs": ENDED, "trainer": {"max_steps": 8, "precision": "64-true"}}
CASES = [
    {"name": "stream_avg", "kwargs": STREAM, "trainer": EXACT},
    {"name": "stream_diloco_float64", "kwargs": STREAM, "outer": True, "trainer": EXACT},
    {"name": "stream_diloco", "kwargs": STREAM, "outer": True, "trainer": TRAINER, "checkpoint_dir": "ckpt"},
    {"name": "stream_diloco_resumed", "kwargs": STREAM, "outer": True, "trainer": TRAINER,
     "resume": "three/ckpt/epoch=0-*.ckpt"},
    {"name": "stream_int8", "kwargs": {**STREAM, "compression": "int8"}, "trainer": EXACT},
    {"name": "blocking_avg", "kwargs": {"period": PERIOD}, "trainer": EXACT},
    {"name": "engine_avg", "kwargs": {"period": PERIOD}, "engine": True, "trainer": EXACT},
    {"name": "blocking_diloco", "kwargs": {"period": PERIOD}, "outer": True, "trainer": TRAINER},
    {"name": "engine_diloco", "kwargs": {"period": PERIOD}, "engine": True, "outer": True, "trainer": TRAINER},
    {"name": "blocking_diloco_cpu", "kwargs": {"period": PERIOD, "state_device": "cpu"}, "outer": True,
     "trainer": TRAINER},
    {"name": "engine_diloco_int8", "kwargs": {"period": PERIOD, "state_device": "cpu", "compression": "int8"},
     "engine": True, "outer": True, "trainer": TRAINER},
    {"name": "blocking_diloco_int8_cpu", "kwargs": {"period": PERIOD, "state_device": "cpu", "compression": "int8"},
     "outer": True, "trainer": TRAINER},
    {"name": "blocking_diloco_int8", "kwargs": {"period": PERIOD, "compression": "int8"}, "outer": True,
     "trainer": TRAINER},
    # The allocator's peak during the protocol: blocking averaging in buckets of 1000 elements; streaming without delay
    # or mixing (its exchange in the training thread, where the profiler sees it); streaming DiLoCo with both.
    {"name": "memory_blocking", "kwargs": {"period": PERIOD}, "trainer": EXACT, "memory": True, "bucket": 1000},
    {"name": "memory_blocking_diloco", "kwargs": {"period": PERIOD}, "outer": True, "trainer": TRAINER, "memory": True,
     "bucket": 1000},
    {"name": "memory_blocking_int8", "kwargs": {"period": PERIOD, "compression": "int8"}, "trainer": TRAINER,
     "memory": True, "bucket": 1000},
    {"name": "memory_stream", "kwargs": {"period": PERIOD, "fragments": FRAGMENTS}, "trainer": TRAINER,
     "memory": True},
    {"name": "memory_stream_diloco", "kwargs": {**STREAM, "fragment_sync_delay": 0}, "outer": True,
     "trainer": TRAINER, "memory": True},
    {"name": "stream_ended_in_flight_on_three", **ENDED_IN_FLIGHT},
]
ON_TWO = [
    {"name": "stream_diloco_on_two", "kwargs": STREAM, "outer": True, "trainer": TRAINER,
     "resume": "three/ckpt/epoch=0-*.ckpt"},
    {"name": "stream_ended_in_flight", **ENDED_IN_FLIGHT},
    {"name": "stream_resumed_after_fit", **RESUMED_AFTER_FIT, "resume": "two/ended_in_flight.ckpt"},
    {"name": "stream_resized_after_fit", **RESUMED_AFTER_FIT, "resume": "three/ended_in_flight.ckpt"},
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("streaming")
    run_ranks(3, "streaming", {"cases": CASES}, root / "three", timeout=400)
    run_ranks(2, "streaming", {"cases": ON_TWO}, root / "two", timeout=200)
    results = {case["name"]: load_results(root / "three" / case["name"], 3) for case in CASES}
    results.update({case["name"]: load_results(root / "two" / case["name"], 2) for case in ON_TWO})
    results["checkpoint"] = torch.load(next((root / "three" / "ckpt").glob("epoch=0-*.ckpt")), weights_only=False)
    for ranks in ("three", "two"):
        results[f"after_fit/{ranks}"] = torch.load(root / ranks / "ended_in_flight.ckpt", weights_only=False)
    return results


def _ok(results):
    for rank, result in enumerate(results):
        assert result["error"] is None, f"rank {rank}: {result['error']}"
    return results


def _bounds(numel, fragments=FRAGMENTS):
    base, extra = divmod(numel, fragments)
    sizes = [base + (1 if index < extra else 0) for index in range(fragments)]
    starts = [sum(sizes[:index]) for index in range(fragments)]
    return [(start, start + size) for start, size in zip(starts, sizes)]


class _Outer:
    """DiLoCo's Nesterov outer step on one fragment, in float64."""

    def __init__(self, theta, buffer=None):
        self.theta, self.buffer = theta.double(), None if buffer is None else buffer.double()

    def step(self, mean):
        delta = self.theta - mean
        self.buffer = delta if self.buffer is None else MU * self.buffer + delta
        self.theta = self.theta - LR * (delta + MU * self.buffer)
        return self.theta


def _replay(results, outer: bool, atol: float):
    """Check every rank's model after every step against the definition; return the number of merges seen."""
    steps = [list(ranks) for ranks in zip(*(result["records"] for result in results))]
    numel = results[0]["start"].numel()
    bounds = _bounds(numel)
    outers = [_Outer(results[0]["start"][start:stop]) for start, stop in bounds] if outer else None
    snapshot, merges = None, 0
    for records in steps:
        step = records[0]["step"]
        fragment = (step // (PERIOD // FRAGMENTS) - 1) % FRAGMENTS
        if (step + DELAY) % (PERIOD // FRAGMENTS) == 0:  # a start: the mean of the copies taken now
            start, stop = bounds[(((step + DELAY) // (PERIOD // FRAGMENTS)) - 1) % FRAGMENTS]
            snapshot = torch.stack([record["before"][start:stop].double() for record in records]).mean(0)
        merging = step % (PERIOD // FRAGMENTS) == 0
        if merging:  # one outer step per merge, the same on every rank
            start, stop = bounds[fragment]
            synchronized = outers[fragment].step(snapshot) if outer else snapshot
        for record in records:
            expected = record["before"].double().clone()
            if merging:
                expected[start:stop] = ALPHA * expected[start:stop] + (1 - ALPHA) * synchronized
            torch.testing.assert_close(record["after"].double(), expected, rtol=0, atol=atol)
        if step % (PERIOD // FRAGMENTS) == 0:
            merges += 1
            moved = (records[0]["after"] - records[0]["before"]).abs()
            start, stop = bounds[fragment]
            assert moved[start:stop].max() > 0 and moved[:start].sum() == 0 and moved[stop:].sum() == 0
    return merges


@pytest.mark.parametrize("name, outer, atol", [("stream_avg", False, 1e-12), ("stream_diloco_float64", True, 1e-12),
                                               ("stream_diloco", True, 2e-5)])
def test_every_merge_is_the_definition_on_every_rank(runs, name, outer, atol):
    """In float64 to rounding; in float32 (the resumed run's model) to float32's rounding of the sums."""
    results = _ok(runs[name])
    assert _replay(results, outer, atol) == 30 // (PERIOD // FRAGMENTS)
    assert results[0]["comm"].syncs == 15


def test_streaming_sends_the_blocking_bytes_plus_one_finiteness_flag_per_exchange(runs):
    """Each fragment once per period: the bytes of blocking averaging, in 3x as many exchanges, each preceded by an
    all-gather of one byte per rank; int8 sends about an eighth of float64's."""
    stream, blocking, int8 = _ok(runs["stream_avg"]), _ok(runs["blocking_avg"]), _ok(runs["stream_int8"])
    flags = 15 * 3 * 2  # exchanges x ranks x (ranks - 1) bytes
    assert stream[0]["comm"].protocol_bytes == blocking[0]["comm"].protocol_bytes + flags
    assert int8[0]["comm"].protocol_bytes < 0.15 * stream[0]["comm"].protocol_bytes
    assert all(torch.isfinite(result["vector"]).all() for result in int8)


@pytest.mark.parametrize("name", ["avg", "diloco", "diloco_int8"])
def test_one_fragment_without_delay_is_blocking_synchronization_bit_for_bit(runs, name):
    """P = 1, tau = 0, alpha = 0 through the fragment engine (forced; with int8 its state in host memory) gives what
    the blocking path gives, at every step, on every rank; so does blocking DiLoCo with state_device="cpu" (its
    outer state, and with int8 the compressed state, on the host, each bucket's mean moved to it)."""
    engine, blocking = _ok(runs[f"engine_{name}"]), _ok(runs[f"blocking_{name}"])
    for a, b in zip(engine, blocking):
        assert len(a["records"]) == len(b["records"]) == 30
        for x, y in zip(a["records"], b["records"]):
            assert torch.equal(x["after"], y["after"]), x["step"]
        assert torch.equal(a["vector"], b["vector"])
    assert engine[0]["comm"].syncs == blocking[0]["comm"].syncs == 5
    assert ("streaming" in engine[0]["protocol"]) and ("streaming" not in blocking[0]["protocol"])
    if name != "avg":
        for a, b in zip(_ok(runs[f"blocking_{name}_cpu"]), blocking):
            assert "streaming" not in a["protocol"] and torch.equal(a["vector"], b["vector"])
            assert all(torch.equal(x["after"], y["after"]) for x, y in zip(a["records"], b["records"]))


def test_resume_with_an_exchange_in_flight_is_bit_for_bit(runs):
    """The checkpoint after step 15 holds fragment 1's exchange, started and not merged; resumed on 3 ranks the run
    ends with the uninterrupted models (the exchange merged once, after step 16, neither lost nor doubled)."""
    state = runs["checkpoint"]["lightning_dist"]["protocol"]["streaming"]
    assert state["in_flight"]["fragment"] == 1 and state["in_flight"]["started_at"] == 15
    full, resumed = _ok(runs["stream_diloco"]), _ok(runs["stream_diloco_resumed"])
    for a, b in zip(full, resumed):
        assert [record["step"] for record in b["records"]] == list(range(16, 31))
        for x, y in zip(a["records"][15:], b["records"]):
            assert torch.equal(x["after"], y["after"]), x["step"]
        assert torch.equal(a["vector"], b["vector"])
        assert a["metrics"] == b["metrics"]


def test_resume_on_another_number_of_ranks_merges_the_exchange_in_flight_once(runs):
    """On 2 ranks every replica starts from the checkpoint's consensus; after step 16 fragment 1 is the mix of each
    replica with the outer step of the saved mean (the saved reference and momentum), and nothing else moves."""
    results = _ok(runs["stream_diloco_on_two"])
    state = runs["checkpoint"]["lightning_dist"]["protocol"]["streaming"]
    assert torch.equal(results[0]["start"], results[1]["start"])
    numel = results[0]["start"].numel()
    start, stop = _bounds(numel)[1]
    saved = state["outer"][1]
    outer = _Outer(saved["reference"], saved["optimizer"]["state"][0]["momentum_buffer"])
    synchronized = outer.step(state["in_flight"]["mean"].double())
    for result in results:
        first = result["records"][0]
        assert first["step"] == 16
        expected = first["before"].double().clone()
        expected[start:stop] = ALPHA * expected[start:stop] + (1 - ALPHA) * synchronized
        torch.testing.assert_close(first["after"].double(), expected, rtol=0, atol=2e-5)
    merges = sum(1 for record in results[0]["records"] if record["step"] % (PERIOD // FRAGMENTS) == 0)
    assert results[0]["comm"].syncs == 7 + merges  # 7 merged before the checkpoint, the one in flight after step 16


@pytest.mark.parametrize("name, saved_by, ended", [
    ("stream_resumed_after_fit", "two", "stream_ended_in_flight"),
    ("stream_resized_after_fit", "three", "stream_ended_in_flight_on_three"),
])
def test_a_checkpoint_written_after_fit_ended_in_an_exchange_resumes_past_its_merge_step(runs, name, saved_by, ended):
    """fit ended after step 3 with fragment 0's exchange in flight: merged then and counted once, and the checkpoint
    written after fit records it. Resumed from it (on the 2 ranks that wrote it, or on 2 from 3), step 4, the plan's
    merge step of that exchange, moves nothing (the early merge was the merge); fragment 1 starts after step 7 and
    merges after step 8, every replica's fragment 1 then the mean of the copies taken after step 7 (alpha 0)."""
    results = _ok(runs[name])
    saved = runs[f"after_fit/{saved_by}"]["lightning_dist"]
    assert saved["protocol"]["streaming"]["in_flight"] is None
    assert saved["protocol"]["streaming"]["merged_early"] == {"fragment": 0, "started_at": 3}
    assert saved["syncs"] == 1 and all(result["comm"].syncs == 1 for result in _ok(runs[ended]))
    start, stop = _bounds(results[0]["start"].numel(), 2)[1]
    steps = list(zip(*(result["records"] for result in results)))
    assert [records[0]["step"] for records in steps] == [4, 5, 6, 7, 8]
    mean = torch.stack([record["before"][start:stop] for record in steps[3]]).mean(0)  # the copies after step 7
    for records in steps:
        for record in records:
            if record["step"] != 8:
                assert torch.equal(record["after"], record["before"]), record["step"]
                continue
            expected = record["before"].clone()
            expected[start:stop] = mean
            torch.testing.assert_close(record["after"], expected, rtol=0, atol=1e-12)
            assert not torch.equal(record["after"], record["before"])
    assert all(result["protocol"]["streaming"]["merged_early"] is None for result in results)
    assert all(result["comm"].syncs == 2 for result in results)


@pytest.fixture
def one_rank_world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("stale", [{"fragment": 1, "started_at": 3}, {"fragment": 0, "started_at": 7}, "absent"])
def test_an_exchange_merged_when_fit_ended_passes_its_own_merge_step_only(one_rank_world, stale):
    """StreamingSync on one rank, plan period 8, 2 fragments, delay 1 (alpha 0: a merge sets the fragment to the copy
    taken at its start). Fragment 0's exchange, started after step 3, merged when fit ends: recorded, saved and
    restored; its merge step 4 then moves nothing and the plan goes on (fragment 1 started after step 7, merged after
    step 8). Restored with another record, or none (a checkpoint written before records were kept), step 4 raises."""
    vector = ModelVector(torch.nn.Linear(5, 4))
    (start, middle), (_, stop) = StreamingPlan(8, 2).fragment_bounds(vector.numel)

    def streaming():
        return StreamingSync(StreamingPlan(8, 2, 1), vector, Lanes(Communicator(), None), None, None, None, None,
                             lambda ranks, step: None)

    def train():
        vector.set(vector.get() + 1)

    ended = streaming()
    assert [ended.after_step(step) for step in (1, 2, 3)] == [False] * 3
    copy = vector.get()
    train()
    assert ended.merge_early() and not ended.merge_early()
    assert torch.equal(vector.get()[start:middle], copy[start:middle])
    state = ended.state_dict()
    assert state["in_flight"] is None and state["merged_early"] == {"fragment": 0, "started_at": 3}

    resumed = streaming()
    resumed.load_state_dict(state, "PeriodicAveragingStrategy")
    train()
    before = vector.get()
    assert not resumed.after_step(4) and torch.equal(vector.get(), before)
    assert resumed.state_dict()["merged_early"] is None
    assert [resumed.after_step(step) for step in (5, 6, 7)] == [False] * 3 and resumed.in_flight.fragment == 1
    copy = vector.get()
    train()
    assert resumed.after_step(8) and torch.equal(vector.get()[middle:stop], copy[middle:stop])

    inconsistent = streaming()
    saved = {key: value for key, value in state.items() if key != "merged_early"}
    inconsistent.load_state_dict(saved if stale == "absent" else {**saved, "merged_early": stale},
                                 "PeriodicAveragingStrategy")
    with pytest.raises(RuntimeError, match="fragment 0 is due to merge after step 4, but nothing is in flight"):
        inconsistent.after_step(4)


def test_a_non_finite_replica_or_a_missing_rank_stops_every_rank_by_name_during_an_exchange_in_flight(tmp_path):
    """Rank 1 turns non-finite after step 6: the exchange started after step 7 refuses it on every rank, naming it;
    so does blocking averaging after step 8, in buckets.
    Rank 1 asleep for 12 s before its 4th step, while the exchange started after step 3 (and then 5) is in flight:
    rank 0 raises, within the 2 s timeout, an error naming the exchange instead of hanging."""
    stream = {"period": 4, "fragments": 2, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5}
    # Two launches: Lightning's own collective before each batch runs on the default group, which keeps the timeout
    # of the launch's first fit (and the late rank of the stall would miss the next fit's first collective).
    nan = {"name": "nan", "strategy": {"class": "PeriodicAveragingStrategy", "kwargs": stream},
           "nan": {"rank": 1, "step": 6}}
    # Blocking averaging in buckets of 100 (the first holds the NaN): it stops while the second bucket's all-reduce
    # is in flight, which must finish before the ranks are named on the same group.
    nan_bucketed = {"name": "nan_bucketed", "strategy": {"class": "PeriodicAveragingStrategy", "kwargs": {"period": 4}},
                    "nan": {"rank": 1, "step": 6}, "bucket": 100}
    stall = {"name": "stall", "strategy": {"class": "PeriodicAveragingStrategy", "kwargs": stream, "timeout_seconds": 2},
             "stall": {"rank": 1, "step": 3, "seconds": 12}}
    for runs in ([nan, nan_bucketed], [stall]):
        run_ranks(2, "fit", {"trainer": {"max_epochs": 1}, "runs": runs}, tmp_path)
    for name, step in (("nan", 7), ("nan_bucketed", 8)):
        for result in load_results(tmp_path / name, 2):
            assert result["error"] is not None and "NonFiniteModelError" in result["error"], result["error"]
            assert f"rank(s) [1] hold non-finite parameters after local step {step}" in result["error"], result["error"]
    waiting, late = load_results(tmp_path / "stall", 2)
    assert waiting["error"].startswith("CollectiveError: lightning_dist: the "), waiting
    assert "for 'protocol'" in waiting["error"] and "timeout (0:00:02" in waiting["error"]
    assert waiting["fit_seconds"] < 12 <= late["fit_seconds"]
    assert late["error"] is not None and "CollectiveError" in late["error"], late["error"]


def test_blocking_int8_in_buckets_is_the_definition_applied_bucket_by_bucket(runs):
    """Blocking int8 in buckets of 1000 entries: after every synchronization every rank holds, bucket by bucket and
    bit for bit, compressed_model_mean of the replicas' buckets from the bucket's common model, with the residuals
    each bucket carried from its last synchronization."""
    results = _ok(runs["memory_blocking_int8"])
    numel, parameters = results[0]["start"].numel(), results[0]["num_parameters"]
    buckets = [(start, min(start + 1000, numel)) for start in range(0, numel, 1000)]
    carried = {}  # bucket -> (worker residuals, owner residuals)
    for start, stop in buckets:
        count = max(0, min(stop, parameters) - start)
        owners = chunk_bounds(count, list(range(3))).values()
        carried[start] = ([torch.zeros(count) for _ in range(3)], [torch.zeros(end - begin) for begin, end in owners])
    common, syncs = results[0]["start"], 0
    for records in zip(*(result["records"] for result in results)):
        if records[0]["step"] % PERIOD:
            continue
        expected = torch.empty_like(common)
        for start, stop in buckets:
            models = [record["before"][start:stop] for record in records]
            count = max(0, min(stop, parameters) - start)
            expected[start:stop], *carried[start] = compressed_model_mean(models, common[start:stop], count,
                                                                          *carried[start], "int8")
        for record in records:
            assert torch.equal(record["after"], expected), record["step"]
        common, syncs = expected, syncs + 1
    assert syncs == 5 and len(buckets) > 2


@pytest.mark.parametrize("kwargs, message", [
    ({"period": 10, "fragments": 3}, "period (10) must be a multiple of fragments (3)"),
    ({"period": 10, "fragments": 2, "fragment_sync_delay": 5}, "fragment_sync_delay must be an integer in [0, 4]"),
    ({"period": 10, "fragment_update_alpha": 1.5}, "fragment_update_alpha must be a number in [0, 1]"),
    ({"period": 10, "fragments": 11}, "fragments must be an integer in [1, 10]"),
    ({"period": 10, "fragments": 2, "client_fraction": 0.5}, "need client_fraction=1"),
    ({"period": 10, "state_device": "cuda"}, "state_device must be None or one of 'cpu'"),
])
def test_bad_streaming_arguments_are_refused_by_name(kwargs, message):
    from lightning_dist import PeriodicAveragingStrategy

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        PeriodicAveragingStrategy(**kwargs)


def test_a_synchronization_allocates_one_bucket_or_one_fragment(runs):
    """Measured with the allocator (the profiler's memory events, in the training thread): blocking averaging's
    peak is two buckets (1000 float64 elements each: one all-reduced while the next is copied in) and it gives the
    unbucketed average to rounding, blocking DiLoCo's four (after the first outer step, which makes the momentum); a
    streaming
    exchange's peak is one fragment (its copy, summed in place); streaming DiLoCo's merge, with the outer step and
    the mix, stays within five fragments (the outer step's start copy, pseudo-gradient, update and result, and the
    mix) and six at a fragment's first merge (its momentum buffer is created then and kept)."""
    blocking, bucketed = _ok(runs["blocking_avg"]), _ok(runs["memory_blocking"])
    flag = 64  # the finiteness flags and their all-gather: a few bytes each, in allocations of at least 8
    for a, b in zip(blocking, bucketed):
        torch.testing.assert_close(b["vector"], a["vector"], rtol=0, atol=1e-12)
        assert max(record["peak_bytes"] for record in b["records"]) <= 2 * 1000 * 8 + flag  # two buckets in flight
    # Blocking DiLoCo a bucket at a time (OuterStep.step_range): the two buckets in flight, the start a bucket is
    # stepped from and the Nesterov update's temporary, after the first outer step, which also makes the kept
    # momentum (one model).
    diloco, diloco_bucketed = _ok(runs["blocking_diloco"]), _ok(runs["memory_blocking_diloco"])
    numel = blocking[0]["vector"].numel()
    for a, b in zip(diloco, diloco_bucketed):
        torch.testing.assert_close(b["vector"], a["vector"])  # the sums' order differs with the buckets: rounding
        assert a["metrics"]["outer/steps"] == b["metrics"]["outer/steps"] == 5
        peaks = [record["peak_bytes"] for record in b["records"] if record["step"] % PERIOD == 0]
        assert len(peaks) == 5 and peaks[0] >= numel * 4, peaks
        assert max(peaks[1:]) <= 4 * 1000 * 4 + flag, peaks
    # Blocking int8 a bucket at a time: the bucket's copy, its delta (kept as the residual, the last one freed), the
    # codes and a chunk's encoding temporaries, the new common bucket, after the first synchronization (which makes
    # the residuals, one float32 model and a third).
    for result in _ok(runs["memory_blocking_int8"]):
        peaks = [record["peak_bytes"] for record in result["records"] if record["step"] % PERIOD == 0]
        assert len(peaks) == 5 and peaks[0] >= numel * 4, peaks
        assert max(peaks[1:]) <= 5 * 1000 * 4 + flag, peaks
    fragment = -(-numel // FRAGMENTS) * 4  # float32
    for result in _ok(runs["memory_stream"]):
        peaks = [record["peak_bytes"] for record in result["records"] if record["step"] % (PERIOD // FRAGMENTS) == 0]
        assert len(peaks) == 15 and fragment <= max(peaks) <= fragment + flag, (max(peaks), fragment)
    for result in _ok(runs["memory_stream_diloco"]):
        peaks = [record["peak_bytes"] for record in result["records"] if record["peak_bytes"]]
        assert max(peaks[:FRAGMENTS]) <= 6 * fragment + flag and max(peaks[FRAGMENTS:]) <= 5 * fragment + flag, peaks
