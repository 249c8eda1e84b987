"""Worker: the Communicator's operations on a Gloo group, then the timeout of every process group this package makes.

Part 1 runs every Communicator operation on float32, bfloat16 and int64 tensors from rank-dependent
values and records what came back (values, dtype, device) for the test to check against the
definitions.

Part 2 sets up a Lightning fit with ``PeriodicAveragingStrategy(timeout=spec["timeout_s"])`` and the
DataGossip and CDGraB callbacks, whose own timeouts are left at None (the strategy's). The default
group is initialised beforehand with torch's default timeout, so only the groups the strategy and
the callbacks create can carry the short one. A last callback, whose ``setup`` runs after theirs,
probes each group: rank 0 starts an all-reduce on it that no other rank joins and records how long
until it fails and the error; the other ranks wait for rank 0 to finish. Then every rank stops the
fit. Rank results go to rank{r}.pt.
"""

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_dist import CDGraB, DataGossip, PeriodicAveragingStrategy
from lightning_dist.comm import Communicator, new_group
from lightning_dist.data.datamodules import MNIST1DDataModule
from lightning_dist.models import MLPClassifier

DTYPES = (torch.float32, torch.bfloat16, torch.int64)


def communicator_operations(rank: int, world_size: int) -> dict:
    """Every operation once per dtype on rank-dependent tensors; what came back, for the test to check."""
    comm = Communicator(new_group(backend="gloo"))
    out = {}
    for dtype in DTYPES:
        mine = (torch.arange(6) + 10 * rank).to(dtype).view(2, 3)
        results = {
            "all_gather": comm.all_gather(mine, "protocol"),
            "gather": comm.start_gather(mine, 1, "protocol").wait(),
            "all_reduce": comm.all_reduce_sum_(mine.clone(), "protocol"),
            "broadcast": comm.broadcast_(mine.clone(), 2, "protocol"),
        }
        # A ring: each rank sends to the next and receives from the previous, point to point and batched.
        following, previous = (rank + 1) % world_size, (rank - 1) % world_size
        if rank == 0:
            comm.send(mine, [following], "protocol")
            results["receive"] = comm.receive(mine, [previous])[0]
        else:
            results["receive"] = comm.receive(mine, [previous])[0]
            comm.send(mine, [following], "protocol")
        buffer = torch.empty_like(mine)
        comm.exchange([(mine, following)], [(buffer, previous)], "protocol")
        results["exchange"] = buffer
        out[str(dtype)] = results
    if rank == 0:
        comm.send_object(b"payload from rank 0", 1, "checkpoint", torch.device("cpu"))
    elif rank == 1:
        out["object"] = comm.receive_object(0, torch.device("cpu"))
    out["summed_syncs"] = comm.summed_stats(syncs=rank, device=torch.device("cpu"), sum_syncs=True).syncs
    comm.close()
    return out


class ProbeDone(Exception):
    """Ends the fit once the groups were probed."""


class ProbeGroups(Callback):
    """After the strategy's and the callbacks' set-up: rank 0 starts an all-reduce nobody joins on each of their groups."""

    def __init__(self, gossip: DataGossip, cdgrab: CDGraB, out: Path, bound_s: float) -> None:
        self.gossip, self.cdgrab, self.out, self.bound_s = gossip, cdgrab, out, bound_s
        self.probes: dict = {}

    def setup(self, trainer, pl_module, stage):
        groups = {
            "strategy": trainer.strategy.comm.group,
            "gossip_data": self.gossip._data_group,  # noqa: SLF001
            "gossip_control": self.gossip._control_group,  # noqa: SLF001
            "cdgrab": self.cdgrab._comm.group,  # noqa: SLF001
            "cdgrab_control": self.cdgrab._control_group,  # noqa: SLF001
        }
        done = self.out / "probed"
        if trainer.global_rank == 0:
            start = time.perf_counter()
            works = {name: dist.all_reduce(torch.zeros(1), group=group, async_op=True) for name, group in groups.items()}
            for name, work in works.items():
                try:
                    # A bound of our own, so that a group with torch's 30-minute default fails the test quickly.
                    left = max(0.1, self.bound_s - (time.perf_counter() - start))
                    work.wait(timeout=timedelta(seconds=left))
                    self.probes[name] = {"error": None, "seconds": time.perf_counter() - start}
                except Exception as exc:  # the timeout under test
                    self.probes[name] = {"error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - start}
            done.touch()
        else:
            deadline = time.monotonic() + 3 * self.bound_s
            while not done.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
        raise ProbeDone


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    dist.init_process_group("gloo")  # torch's default timeout: Lightning keeps an initialised default group
    rank, world_size = dist.get_rank(), dist.get_world_size()
    result = {"operations": communicator_operations(rank, world_size)}
    torch.save(result, out / f"rank{rank}.pt")
    timeout = timedelta(seconds=spec["timeout_s"])
    gossip, cdgrab = DataGossip(), CDGraB()
    probe = ProbeGroups(gossip, cdgrab, out, bound_s=4 * spec["timeout_s"])
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=PeriodicAveragingStrategy(timeout=timeout),
        callbacks=[gossip, cdgrab, probe], logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, max_steps=1,
    )
    try:
        trainer.fit(MLPClassifier(num_features=40, num_classes=10, hidden_size=8),
                    datamodule=MNIST1DDataModule(num_samples=200, batch_size=4, example_order="balanced"))
    except ProbeDone:
        pass
    result["probes"] = probe.probes
    torch.save(result, out / f"rank{rank}.pt")
    os._exit(0)  # the probed groups hold operations that never completed; do not wait on them at exit


if __name__ == "__main__":
    main()
