"""Worker: a process group made again after torchrun restarts it, with one rank coming up late.

Round 0 (``TORCHELASTIC_RESTART_COUNT=0``): every rank joins the default group over
``restart_scoped_store`` and all-reduces once; then rank 1 SIGKILLs itself, and torchrun
(``--max-restarts=1``) stops the others and starts round 1. There rank 1 waits ``late_s`` seconds
before joining, so the others look up its address first: with torch's plain ``env://`` keys they
find the one the dead process published in round 0. Every rank of round 1 writes its all-reduce
result to rank{r}.pt.
"""

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_dist.comm import restart_scoped_store

spec = json.loads(Path(sys.argv[1]).read_text())
rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if restart == 1 and rank == 1:
    time.sleep(spec["late_s"])
store = restart_scoped_store(timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
if restart == 0:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # torchrun stops this process when it sees rank 1 die
torch.save({"restart": restart, "sum": total.item(), "store": type(store).__name__},
           Path(spec["out"]) / f"rank{rank}.pt")
dist.destroy_process_group()
