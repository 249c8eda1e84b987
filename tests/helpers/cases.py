"""The ``main`` of a worker that runs hand-set cases on real processes (see tests/helpers/launch.py)."""

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def run_cases(run_case: Callable[[dict[str, Any], int, int], Any]) -> None:
    """Under torchrun: ``run_case(case, rank, world_size)`` for every case of the spec file (``argv[1]``) on a Gloo
    group, the list of results saved to ``<out>/rank<r>.pt``."""
    spec = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = [run_case(case, rank, world_size) for case in spec["cases"]]
    torch.save(results, Path(spec["out"]) / f"rank{rank}.pt")
    dist.destroy_process_group()
