"""The pure pieces of the language-model benchmark's torchft rows (issue 41): how the model is cut into torchft's
fragments, the rows' streaming settings, and which methods the bandwidth figure draws."""

import itertools
import random

import pytest
import torch

from benchmarks.language_model import network
from benchmarks.language_model.torchft_diloco import balanced_groups, model_fragments, port_of
from lightning_dist.algorithms.streaming import StreamingPlan
from lightning_dist.models import TransformerLM


def brute_force_max(sizes, groups):
    """The smallest largest group sum over every contiguous cut of ``sizes`` into ``groups`` non-empty groups."""
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(sizes)), groups - 1):
        bounds = [0, *cuts, len(sizes)]
        best = min(best, max(sum(sizes[a:b]) for a, b in zip(bounds[:-1], bounds[1:])))
    return best


def test_balanced_groups_tile_the_units_in_order_with_the_smallest_largest_group():
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.randint(1, 100) for _ in range(rng.randint(1, 9))]
        groups = rng.randint(1, len(sizes))
        bounds = balanced_groups(sizes, groups)
        assert len(bounds) == groups
        assert bounds[0][0] == 0 and bounds[-1][1] == len(sizes)
        assert all(start < stop for start, stop in bounds)
        assert all(a[1] == b[0] for a, b in zip(bounds[:-1], bounds[1:]))
        assert max(sum(sizes[a:b]) for a, b in bounds) == brute_force_max(sizes, groups)


def test_balanced_groups_refuse_more_fragments_than_modules():
    with pytest.raises(ValueError, match="cannot cut 3 modules into 4 non-empty fragments"):
        balanced_groups([1, 2, 3], 4)
    with pytest.raises(ValueError, match="into 0"):
        balanced_groups([1, 2, 3], 0)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TransformerLM(**network.TASK["model"])


@pytest.mark.parametrize("fragments", [1, 2, network.STREAM_FRAGMENTS, 7])
def test_fragments_hold_every_parameter_once_in_the_model_order(model, fragments):
    parts = model_fragments(model, fragments)
    assert len(parts) == fragments
    held = [parameter for part in parts for parameter in part.parameters()]
    # The same Parameter objects (torchft writes the fragments' .data and .grad), each once, the tied head included.
    assert [id(p) for p in held] == [id(p) for p in model.parameters()]
    assert all(next(part.parameters(), None) is not None for part in parts)
    names = [name for part in parts for name in part.model_names]
    assert names == [name for name, _ in model.named_parameters()]


def test_five_fragments_of_the_benchmark_model_are_near_equal(model):
    """The benchmark's 1.3M-parameter model in 5: whole modules, the largest within 1.2x of an equal share (its
    largest module, an MLP matrix, is 8% of the model)."""
    sizes = [sum(p.numel() for p in part.parameters()) for part in model_fragments(model, network.STREAM_FRAGMENTS)]
    assert sum(sizes) == model.num_parameters
    assert max(sizes) <= 1.2 * model.num_parameters / network.STREAM_FRAGMENTS


def test_port_of_torchfts_advertised_address():
    assert port_of("http://vm:37459") == 37459
    assert port_of("http://vm:29510/") == 29510


def test_streaming_rows_share_one_plan_with_torchfts():
    rows = {row["name"]: row for row in network.methods({"lo": 1.0, "hi": 2.0})}
    stream = {"fragments": network.STREAM_FRAGMENTS, "fragment_sync_delay": network.STREAM_DELAY,
              "fragment_update_alpha": network.STREAM_ALPHA}
    for name in ("periodic_h50_stream", "periodic_h50_stream_int8", "diloco_stream", "diloco_stream_int8"):
        kwargs = rows[name]["strategy"]["kwargs"]
        assert {key: kwargs[key] for key in stream} == stream and kwargs["period"] == network.DILOCO_PERIOD
        assert rows[name]["kind"] == "streaming"
        assert kwargs.get("compression") == ("int8" if name.endswith("int8") else None)
        assert rows[name].get("outer") == (network.DILOCO_OUTER if name.startswith("diloco") else None)
    streaming = rows["torchft_streaming_diloco"]["torchft"]
    assert streaming == {"sync_every": network.DILOCO_PERIOD, **stream}
    assert rows["torchft_diloco"]["torchft"] == {"sync_every": network.DILOCO_PERIOD, "fragments": 1,
                                                 "fragment_sync_delay": 0, "fragment_update_alpha": 0.0}
    for name in ("torchft_diloco", "torchft_streaming_diloco"):
        assert rows[name]["kind"] == "torchft" and rows[name]["outer"] == network.DILOCO_OUTER
    # The package's plan accepts the settings (torchft's own checks are the same: P divides H, tau < H / P).
    StreamingPlan(network.DILOCO_PERIOD, network.STREAM_FRAGMENTS, network.STREAM_DELAY, network.STREAM_ALPHA)


def row(name, mbit, reached, seeds, seconds, loss=3.0):
    return {"name": name, "node_mbit": mbit, "reached": reached, "seeds": list(range(seeds)),
            "time_to_target_s": seconds, "final_val_loss": loss}


def test_the_figure_draws_the_baselines_and_each_familys_fastest_at_the_headline_bandwidth():
    kinds = {"ddp": "ddp", "ddp_powersgd_r1": "ddp", "ddp_powersgd_r4": "ddp", "periodic_h50": "periodic",
             "diloco": "periodic", "fedavg": "fedavg", "dynamic_default": "dynamic", "dynamic_hi": "dynamic",
             "downpour": "downpour", "gossip_p50_r1": "gossip", "torchft_diloco": "torchft"}
    rows = [row("ddp", 20, 0, 3, None), row("ddp_powersgd_r1", 20, 3, 3, 10.0), row("ddp_powersgd_r4", 20, 2, 3, 30.0),
            row("periodic_h50", 20, 3, 3, 30.0), row("periodic_h50", 100, 3, 3, 5.0),
            row("diloco", 20, 2, 3, 20.0),  # faster, but one seed missed: periodic_h50 is the family's
            row("fedavg", 100, 1, 1, 1.0),  # the fastest anywhere, not at 20
            row("dynamic_default", 20, 3, 3, 25.0), row("dynamic_hi", 20, 3, 3, 25.0, loss=2.9),  # tie: lower loss
            row("downpour", 20, 0, 3, None, loss=3.3),  # none reached: still the family's line (absent points)
            row("gossip_p50_r1", 100, 1, 1, 12.0),  # the family has no row at 20: its lowest bandwidth, 100
            row("torchft_diloco", 20, 3, 3, 28.0)]
    chosen = network.plotted_methods({"rows": rows}, kinds, 20.0)
    assert chosen == [("DDP", "ddp"), ("DDP + PowerSGD rank 4", "ddp_powersgd_r4"),
                      ("torchft DiLoCo", "torchft_diloco"), ("periodic averaging / DiLoCo", "periodic_h50"), ("dynamic averaging", "dynamic_hi"),
                      ("segmented gossip", "gossip_p50_r1"), ("DownpourSGD", "downpour")]
    assert {slot for slot, _ in chosen} <= set(network.PLOT_STYLES)
    styles = [network.PLOT_STYLES[slot][:2] for slot in network.PLOT_STYLES]
    assert len(set(color for color, _ in styles)) == len(styles) and len(set(m for _, m in styles)) == len(styles)
