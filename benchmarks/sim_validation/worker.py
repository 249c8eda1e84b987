"""Worker of ``benchmarks/sim_validation/run.py``: the methods' Lightning fits under torchrun, one after the other in
the same processes (starting 16 Python processes takes most of a minute on 2 cores), one torchrun per namespace.

Each fit trains ``Directions`` (``workload.py``) with the method's strategy for ``every * syncs`` steps. Every rank
records when each step ended (``time.monotonic()``, one clock for every process of the machine; a step's end comes
after its synchronization, which the strategies run inside ``optimizer_step``) and, after fit, the bytes the
package's ``Communicator`` counted; each namespace's local rank 0 also records the TCP segments its namespace
retransmitted during the fit. The local-update strategies count their own (``refresh_comm_stats`` at the end of
fit, purpose ``protocol``). Lightning's DDP moves its gradients without one, so its hooks here count them into a
``Communicator`` of their own: plain DDP records each bucket's all-reduce, PowerSGD each all-reduce it issues (its P and
Q factors, its uncompressed tensors) through a counting stand-in for ``torch.distributed`` in the hook's module, and the
plain all-reduces of its first ``start_powerSGD_iter`` steps as buckets. The hooks are ``ddp_hooks.py``'s
``CommHookDDPStrategy`` (Lightning registers no hook on CPU), one bucket for the model.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd_module

import lightning_dist
from lightning_dist.comm import Communicator

from benchmarks.common.report import write_json
from benchmarks.language_model.ddp_hooks import CommHookDDPStrategy
from benchmarks.sim_validation.workload import Directions, SignData

PURPOSE = "protocol"
BUCKET_CAP_MB = 256.0


class StepEnds(Callback):
    """``ends[i]``: when this rank ended step ``i + 1``."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.ends.append(time.monotonic())


def tcp_retransmits() -> int:
    """TCP segments this namespace has retransmitted so far (``/proc/net/snmp`` is per namespace); 0 on every rank but
    a node's local rank 0, so that a sum over ranks counts each namespace once."""
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return 0
    header, values = (line.split() for line in Path("/proc/net/snmp").read_text().splitlines()
                      if line.startswith("Tcp:"))
    return int(values[header.index("RetransSegs")])


class CountingDist:
    """``torch.distributed`` with ``all_reduce`` counted (the ring's bytes, as ``Communicator.record_all_reduce``)."""

    def __init__(self, comm: Communicator) -> None:
        self._comm = comm

    def all_reduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self._comm.record_all_reduce(tensor, PURPOSE)
        return dist.all_reduce(tensor, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)


def ddp_strategy(run: dict[str, Any], comm: Communicator) -> CommHookDDPStrategy:
    """Lightning's DDP with a hook that counts its bytes: the plain all-reduce, or PowerSGD."""
    options = run["strategy"]
    if options["kind"] == "ddp":
        def allreduce(state, bucket):  # unannotated: DDP checks a hook's annotations against dist.GradBucket
            comm.record_all_reduce(bucket.buffer(), PURPOSE)
            return default_hooks.allreduce_hook(state, bucket)

        return CommHookDDPStrategy(ddp_comm_state=None, ddp_comm_hook=allreduce, bucket_cap_mb=BUCKET_CAP_MB)
    state = powersgd_module.PowerSGDState(process_group=None,
                                          matrix_approximation_rank=options["matrix_approximation_rank"],
                                          start_powerSGD_iter=options["start_powerSGD_iter"])

    def powersgd(hook_state, bucket):
        if hook_state.iter < hook_state.start_powerSGD_iter:  # the hook's plain all-reduce of the bucket
            comm.record_all_reduce(bucket.buffer(), PURPOSE)
        return powersgd_module.powerSGD_hook(hook_state, bucket)

    return CommHookDDPStrategy(ddp_comm_state=state, ddp_comm_hook=powersgd, bucket_cap_mb=BUCKET_CAP_MB)


def fit(spec: dict[str, Any], run: dict[str, Any], comm: Communicator) -> dict[str, Any]:
    """One method's fit; this rank's step ends and, on rank 0, the protocol bytes summed over ranks."""
    L.seed_everything(spec["seed"], verbose=False)
    model = Directions()
    steps = run["every"] * run["syncs"]
    datamodule = SignData(run["signs"], steps)
    options = dict(run["strategy"])
    kind = options.pop("kind")
    counted_before = comm.stats.bytes_by_purpose[PURPOSE]
    if kind in ("ddp", "powersgd"):
        strategy: Any = ddp_strategy(run, comm)
    else:
        strategy = getattr(lightning_dist, kind)(**options)
    recorder = StepEnds()
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    trainer = L.Trainer(accelerator="cpu", devices=local, num_nodes=int(os.environ["WORLD_SIZE"]) // local,
                        strategy=strategy, max_steps=steps, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        use_distributed_sampler=False, callbacks=[recorder])
    if kind == "powersgd":
        powersgd_module.dist = CountingDist(comm)
    retransmitted = tcp_retransmits()
    try:
        trainer.fit(model, datamodule=datamodule)
    finally:
        powersgd_module.dist = dist
    retransmitted = torch.tensor([tcp_retransmits() - retransmitted])
    dist.all_reduce(retransmitted)
    if kind in ("ddp", "powersgd"):
        protocol_bytes = torch.tensor([comm.stats.bytes_by_purpose[PURPOSE] - counted_before], dtype=torch.int64)
        dist.all_reduce(protocol_bytes)
        counted = {"protocol_bytes": int(protocol_bytes), "syncs": steps}
    else:
        stats = strategy._summed_stats  # refresh_comm_stats ran at the end of fit, on every rank
        counted = {"protocol_bytes": stats.bytes_by_purpose[PURPOSE], "syncs": stats.syncs,
                   "bytes_by_purpose": dict(stats.bytes_by_purpose), "protocol_metrics": strategy.protocol_metrics()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, recorder.ends)
    return {"name": run["name"], "steps": steps, "step_ends": gathered, "model_bytes": 4 * model.layer.weight.numel(),
            "tcp_retransmits": int(retransmitted), **counted}


def ring_step_latency(repetitions: int = 30) -> float:
    """Seconds one hop of Gloo's ring takes with nothing to carry, on this layout and machine: the median over
    ``repetitions`` all-reduces of one float (each timed from a barrier's end, the latest rank's end) over its
    ``2 (N - 1)`` steps. The simulator's per-message latency (a machine constant, like the step time)."""
    tensor, world = torch.zeros(1), dist.get_world_size()
    for _ in range(5):
        dist.all_reduce(tensor)
    spans = []
    for _ in range(repetitions):
        dist.barrier()
        start = time.monotonic()
        dist.all_reduce(tensor)
        spans.append(time.monotonic() - start)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, spans)
    slowest = sorted(max(rank_spans[index] for rank_spans in gathered) for index in range(repetitions))
    return slowest[repetitions // 2] / (2 * (world - 1))


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    comm = Communicator(dist.new_group())  # counts DDP's gradient bytes (the strategies count their own)
    latency_s = ring_step_latency()
    results = []
    for run in spec["runs"]:
        started = time.monotonic()
        result = fit(spec, run, comm)
        result["fit_wall_s"] = time.monotonic() - started
        results.append(result)
        if dist.get_rank() == 0:
            print(f"{run['name']} done in {result['fit_wall_s']:.1f} s", flush=True)
    if dist.get_rank() == 0:
        write_json(Path(spec["out"]), {"ring_step_latency_s": latency_s, "runs": results})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
