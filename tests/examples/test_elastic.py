"""examples/elastic: torchrun --max-restarts=1 brings a fit back after a rank, or a whole node, is SIGKILLed mid-run.

Each case runs the shipped script as a user would (``kill_a_rank.py``: torchrun agents with a c10d
rendezvous, ``lightning_dist.cli fit --config configs/dynamic_avg.yaml --config
examples/elastic/checkpointing.yaml``) and reads the record it writes. The kill comes once the first
checkpoint is on disk, so the restarted processes must resume from it: a run that started over, or
stopped, would not end at the planned step with a restart recorded. Checkpoints come every 50 steps,
an epoch of the config's data on 2 ranks (3200 training examples, batches of 32), so a run restarted
on 2 ranks resumes at an epoch start and must end bit for bit where the uninterrupted run ends. Those two runs
take the threshold after ``calibration_steps`` (``sync_overhead: null``): with the shipped default each launch
chooses its period from its own timings, so two launches need not agree bit for bit (a resumed launch keeps the
period its checkpoint holds); the lost-node case runs the shipped config as it is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from benchmarks.common.paths import load_example
from helpers.accuracy import noise_band

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "elastic" / "kill_a_rank.py"
MAX_STEPS = 300
EPOCH_ON_TWO_RANKS = 50
VAL_EXAMPLES = 800  # configs/dynamic_avg.yaml: MNIST-1D, 4000 samples, val_fraction 0.2


def kill_a_rank(workdir: Path, *args: str) -> dict[str, Any]:
    record = workdir / "record.json"
    command = [sys.executable, str(SCRIPT), "--workdir", str(workdir), "--json", str(record),
               f"--max-steps={MAX_STEPS}", f"--every-n-train-steps={EPOCH_ON_TWO_RANKS}", "--timeout=300", *args]
    # tests/ on the path: the user-model case names helpers.user_models in its config
    result = subprocess.run(command, capture_output=True, text=True, timeout=400, cwd=workdir.parent,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "tests")})
    logs = "\n".join(f"--- {log.name}\n{log.read_text()[-4000:]}" for log in sorted(workdir.glob("agent*.log")))
    assert result.returncode == 0, f"{result.stderr[-4000:]}\n{logs}"
    return {**json.loads(record.read_text()), "workdir": workdir}


def final_model(record: dict[str, Any]) -> dict[str, torch.Tensor]:
    return torch.load(record["workdir"] / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)[
        "state_dict"]


@pytest.fixture(scope="module")
def replayable(tmp_path_factory) -> str:
    """``configs/dynamic_avg.yaml`` with the replayable threshold rule, as a ``--config`` argument."""
    config = yaml.safe_load((REPO / "configs" / "dynamic_avg.yaml").read_text())
    config["trainer"]["strategy"]["init_args"]["sync_overhead"] = None
    path = tmp_path_factory.mktemp("config") / "dynamic_avg_replayable.yaml"
    path.write_text(yaml.safe_dump(config))
    return f"--config={path}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, replayable) -> dict[str, Any]:
    return kill_a_rank(tmp_path_factory.mktemp("elastic") / "none", replayable, "--kill=none")


def test_the_uninterrupted_run_reaches_the_planned_step(uninterrupted):
    assert uninterrupted["returncodes"] == [0]
    assert uninterrupted["global_step"] == MAX_STEPS
    assert "killed_at_s" not in uninterrupted


def test_a_killed_rank_is_restarted_and_the_run_resumes_from_the_last_checkpoint(tmp_path, uninterrupted, replayable):
    record = kill_a_rank(tmp_path / "rank", replayable, "--kill=rank")
    assert record["returncodes"] == [0]
    assert record["world_size_before"] == record["world_size_after"] == 2
    assert record["killed_at_s"] < record["restarted_at_s"] < record["resumed_at_s"]
    assert 0 < record["resumable_step_at_kill"] < MAX_STEPS
    assert record["global_step"] == MAX_STEPS
    resumed, straight = final_model(record), final_model(uninterrupted)
    assert resumed.keys() == straight.keys()
    for name in straight:
        assert torch.equal(resumed[name], straight[name]), name
    assert record["val_acc"] == uninterrupted["val_acc"]


def test_a_lost_node_shrinks_the_group_and_the_survivors_finish(tmp_path, uninterrupted):
    """Two agents of two processes; the second agent and its processes are SIGKILLed: 4 ranks -> 2.

    The rest of the run trains on two ranks, so it is held to the uninterrupted two-rank run's noise band.
    """
    record = kill_a_rank(tmp_path / "node", "--kill=node", "--nodes=2")
    assert record["returncodes"] == [0]  # the surviving agent; the killed one is not waited for
    assert (record["world_size_before"], record["world_size_after"]) == (4, 2)
    assert record["killed_at_s"] < record["restarted_at_s"] < record["resumed_at_s"]
    assert record["global_step"] == MAX_STEPS
    low, high = noise_band([uninterrupted["val_acc"]], VAL_EXAMPLES)
    assert low <= record["val_acc"] <= high, (record["val_acc"], uninterrupted["val_acc"])


USER_CNN_UNDER_DOWNPOUR = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 2
  precision: bf16-mixed
  strategy:
    class_path: lightning_dist.DownpourSGDStrategy
    init_args:
      push_every: 5
model:
  class_path: helpers.user_models.DigitsCNN
data:
  class_path: helpers.user_models.DigitsImages
  init_args:
    batch_size: 32
"""


def test_a_user_cnn_under_downpour_survives_a_lost_node(tmp_path):
    """A module that is not ours (BatchNorm, Dropout, Adam with StepLR) in bf16-mixed, on the parameter server.

    The server's global model and version carry over the restart at 2 ranks (the resize rule). Its accuracy is held
    only to "learned" (chance is 0.1): a run that lost its server state or turned non-finite would not be.
    """
    config = tmp_path / "user_cnn.yaml"
    config.write_text(USER_CNN_UNDER_DOWNPOUR)
    record = kill_a_rank(tmp_path / "node", f"--config={config}", "--kill=node", "--nodes=2", "--max-steps=200",
                         "--every-n-train-steps=20")
    assert (record["world_size_before"], record["world_size_after"], record["global_step"]) == (4, 2, 200)
    assert record["killed_at_s"] < record["restarted_at_s"] < record["resumed_at_s"]
    assert all(torch.isfinite(tensor).all() for tensor in final_model(record).values() if tensor.is_floating_point())
    assert record["val_acc"] > 0.8


class AgentEndingOnLook:
    """An agent process that is running for its first ``running_looks`` polls and has exited 0 after."""

    def __init__(self, running_looks: int) -> None:
        self.looks, self.running_looks, self.returncode = 0, running_looks, None

    def poll(self) -> int | None:
        self.looks += 1
        if self.looks > self.running_looks:
            self.returncode = 0
        return self.returncode


def test_the_watch_accepts_an_end_that_comes_between_its_looks(tmp_path):
    """The agent ends after the watch's first look: waiting for the end must succeed, not report that the run
    ended before its end (a race that failed the lost-node case once)."""
    agents = [AgentEndingOnLook(running_looks=1)]
    watch = load_example("elastic/kill_a_rank").Watch(tmp_path, agents, timeout=5)
    watch.until(lambda: all(agent.poll() is not None for agent in agents), "end")
    assert agents[0].returncode == 0


def test_the_watch_fails_when_the_agents_ended_before_the_condition(tmp_path):
    agents = [AgentEndingOnLook(running_looks=0)]
    watch = load_example("elastic/kill_a_rank").Watch(tmp_path, agents, timeout=5)
    with pytest.raises(RuntimeError, match=r"the run ended before its restart \(agents exited \[0\]\)"):
        watch.until(lambda: False, "restart")
