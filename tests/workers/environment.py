"""Worker: what a rank sees of how it was launched, written to ``rank<r>.json``: the environment variables torchrun
sets, Lightning's view of the rank (its rank-zero guard, the cluster environment it detects), the threads torch
uses, a draw from numpy's global generator, and a sum all-reduced over the job's default group. With ``fail_rank``,
that rank exits 3 after the all-reduce and the others sleep ten minutes (the launcher must stop them)."""

import json
import os
import sys
import time
from pathlib import Path

import numpy
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning_utilities.core.rank_zero import rank_zero_only

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
                      "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT",
                      "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
                      "OMP_NUM_THREADS")

spec = json.loads(Path(sys.argv[1]).read_text())
environment = TorchElasticEnvironment()
dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
seen = {"environment": {name: os.environ.get(name) for name in TORCHRUN_VARIABLES},
        "detected": TorchElasticEnvironment.detect(), "global_rank": environment.global_rank(),
        "node_rank": environment.node_rank(), "rank_zero_only": rank_zero_only.rank,
        "threads": torch.get_num_threads(), "numpy_draw": float(numpy.random.rand()), "sum": total.item(),
        "cwd": os.getcwd(), "argv": sys.argv[1:]}
(Path(spec["out"]) / f"rank{dist.get_rank()}.json").write_text(json.dumps(seen))
if "fail_rank" in spec:
    if dist.get_rank() == spec["fail_rank"]:
        sys.exit(3)
    time.sleep(600)
dist.destroy_process_group()
