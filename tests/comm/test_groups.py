"""Process groups made by lightning_dist are destroyed in order, and a closed Communicator refuses use."""

import atexit
import warnings

import pytest
import torch
import torch.distributed as dist

from helpers.launch import load_results, run_ranks
from lightning_dist.comm import Communicator, destroy_group, new_group, restart_scoped_store
from lightning_dist.comm import groups
from lightning_dist.comm.groups import warn_if_restart_counts_diverge


@pytest.fixture
def one_rank_world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_close_destroys_the_group_and_keeps_the_counters(one_rank_world):
    comm = Communicator(new_group(backend="gloo"))
    comm.stats.record("protocol", 12, 1)
    group = comm.group
    comm.close()
    assert comm.closed and comm.stats.bytes_sent == 12
    with pytest.raises(RuntimeError, match="closed"):
        comm.all_reduce_sum_(torch.ones(3), purpose="protocol")
    with pytest.raises(ValueError, match="Invalid process group"):
        dist.destroy_process_group(group)  # really gone
    comm.close()  # idempotent
    destroy_group(group)  # a group that is gone already is not an error


def test_every_group_is_destroyed_at_exit(one_rank_world, monkeypatch):
    registered = []
    monkeypatch.setattr(groups, "_destroy_registered", False)
    monkeypatch.setattr(atexit, "register", registered.append)
    new_group(backend="gloo")
    new_group(backend="gloo")
    assert registered == [groups._destroy_all_groups]  # once, however many groups
    registered[0]()
    assert not dist.is_initialized()


def test_a_group_restarted_by_torchrun_connects_when_a_rank_comes_up_late(tmp_path):
    """torchrun --max-restarts=1 after a SIGKILL; in the new round rank 1 starts 3 s after the others."""
    result = run_ranks(2, "restart", {"late_s": 3.0}, tmp_path, timeout=120, torchrun_args=["--max-restarts=1"])
    assert "Gloo connectFullMesh failed" not in result.stderr
    assert load_results(tmp_path, 2) == [{"restart": 1, "sum": 3.0, "store": "PrefixStore"}] * 2


def test_outside_torchrun_there_is_no_restart_scoped_store(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert restart_scoped_store(None) is None


@pytest.mark.parametrize("agents, restarts, warns", [(2, 1, True), (1, 3, False), (4, 0, False)])
def test_restart_counts_that_can_diverge_are_warned_about(monkeypatch, agents, restarts, warns):
    """Several agents that may restart, sharing the rendezvous store: the restart-count prefix cannot keep rounds
    apart (pytorch/pytorch#135712), and the warning names the remedy."""
    monkeypatch.setenv("GROUP_WORLD_SIZE", str(agents))
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", str(restarts))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_if_restart_counts_diverge()
    messages = [str(warning.message) for warning in caught]
    if warns:
        assert len(messages) == 1 and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in messages[0] and "#135712" in messages[0]
    else:
        assert messages == []
