"""Communicator: which tensors travel through host memory, and every operation's results on real Gloo ranks;
the timeout the strategies and callbacks give their own process groups."""

import re

import pytest
import torch

from helpers.launch import load_results, run_ranks
from lightning_dist.comm.communicator import stages_through_host

RANKS = 3
TIMEOUT_S = 10


@pytest.mark.parametrize(
    ("config", "device", "staged"),
    [
        ("cpu:gloo,cuda:gloo", "cuda:1", True),  # process_group_backend="gloo" with a GPU model; Downpour's group
        ("cpu:gloo,cuda:gloo", "cpu", False),
        ("cuda:nccl", "cuda:0", False),  # NCCL moves device memory itself
        ("cpu:gloo,cuda:nccl", "cuda:0", False),
        ("cpu:gloo,cuda:nccl", "cpu", False),
        ("gloo", "cuda:0", True),  # a bare backend name holds for every device
        ("cpu:gloo", "cuda:0", True),  # no entry for the device: the host's backend would carry it
        ("CPU:GLOO,CUDA:GLOO", "xpu:0", True),
        ("cuda:nccl", "cpu", False),
    ],
)
def test_gloo_groups_carry_device_tensors_through_the_host(config, device, staged):
    assert stages_through_host(config, torch.device(device)) is staged


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """One launch of 3 ranks: the Communicator's operations, then the probes of every group's timeout."""
    out = tmp_path_factory.mktemp("groups")
    run_ranks(RANKS, "groups", {"timeout_s": TIMEOUT_S}, out, timeout=240, check=False)
    return load_results(out, RANKS)


def _value(rank, dtype):
    return (torch.arange(6) + 10 * rank).to(dtype).view(2, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_every_operation_returns_the_definitions_values_in_the_callers_dtype_and_device(ranks, dtype):
    everyone = torch.stack([_value(r, dtype) for r in range(RANKS)])
    for rank, result in enumerate(ranks):
        got = result["operations"][str(dtype)]
        expected = {
            "all_gather": everyone,
            "all_reduce": sum(_value(r, dtype) for r in range(RANKS)),  # 0 + 10 + 20 offsets: exact in bfloat16
            "broadcast": _value(2, dtype),
            "receive": _value((rank - 1) % RANKS, dtype),
            "exchange": _value((rank - 1) % RANKS, dtype),
        }
        if rank == 1:
            expected["gather"] = everyone
        else:
            assert got["gather"] is None
        for name, value in expected.items():
            assert got[name].dtype == dtype and got[name].device.type == "cpu", name
            assert torch.equal(got[name], value), name
    assert ranks[1]["operations"]["object"] == b"payload from rank 0"
    assert all(result["operations"]["summed_syncs"] == 0 + 1 + 2 for result in ranks)


def test_the_strategys_timeout_reaches_every_group_the_strategy_and_the_callbacks_make(ranks):
    """PeriodicAveragingStrategy(timeout=10 s) with DataGossip and CDGraB left at timeout=None: on each of their
    groups an all-reduce that the other ranks never join fails on rank 0 after 10 s, Gloo's message naming 10000 ms,
    instead of waiting out torch's 30-minute default (the probe gives up after 40 s)."""
    probes = ranks[0]["probes"]
    assert set(probes) == {"strategy", "gossip_data", "gossip_control", "cdgrab", "cdgrab_control"}
    for name, probe in probes.items():
        assert probe["error"] is not None, f"{name}: the all-reduce completed without the other ranks?"
        waited = re.search(r"Timed out waiting (\d+)ms", probe["error"])
        assert waited is not None, f"{name}: no group timeout within 40 s: {probe['error']}"
        assert int(waited.group(1)) == TIMEOUT_S * 1000, name
        assert probe["seconds"] < 2 * TIMEOUT_S + 10, (name, probe["seconds"])
