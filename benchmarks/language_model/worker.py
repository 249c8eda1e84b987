"""Worker of ``benchmarks/language_model/network.py``: the language model trained by each method under torchrun, one node
per network namespace.

Usage (normally through ``benchmarks/language_model/network.py``)::

    torchrun --nnodes=N --nproc_per_node=1 --node_rank=i ... benchmarks/language_model/worker.py spec.json

One launch runs the methods of ``spec["runs"]`` one after the other in the same processes (starting
4 Python processes with torch and Lightning takes most of a minute on 2 cores), reseeding before
each, so every method starts from the same weights and data order. Spec keys: ``data``
(``StdlibTextDataModule`` arguments), ``model`` (``TransformerLM`` arguments), ``seed``,
``budget_s``, ``snapshots`` (about how many parameter copies to take over the budget),
``eval_sequences`` (validation windows scored per copy), ``work_dir``, ``out``. A run is
``{"name", "kind", "strategy": {"class", "kwargs"}, "outer": {...} | None}``; ``kind`` ``"ddp"`` is
Lightning's DDP (gradient all-reduce every step; with ``"hook": {"name", ...}`` the compression hook of
``benchmarks/language_model/ddp_hooks.py``, registered on the CPU too), ``"torchft"`` torchft's DiLoCo in its own
training loop (``benchmarks/language_model/torchft_diloco.py``; the run's ``torchft`` gives ``sync_every``,
``fragments``, ``fragment_sync_delay``, ``fragment_update_alpha``), anything else a lightning_dist strategy class,
with ``outer`` the keyword arguments of a ``torch.optim.SGD`` outer optimizer (DiLoCo). Every kind is timed, copied
and scored the same way (``collect``).

Timing. Rank 0 decides, after every optimizer step (every ``snapshot_every`` steps for DownpourSGD,
whose ranks do not run in lockstep), whether to take a copy (every ``budget_s / snapshots`` seconds)
and whether the budget is spent; a broadcast of two numbers carries the decision, the same small
collective Lightning itself runs before every batch. At a copy every rank keeps its parameters,
its clock and the bytes its network interface has sent and received (``/sys/class/net/eth0``: the
namespace's own interface, so every byte on the wire: protocol, Lightning's collectives, TCP/IP
headers). No validation runs during fit (it would average the replicas over the capped network).
After fit the copies go to files in ``work_dir`` and rank 0 scores the model a validation would
score at each copy: the mean of the replicas (DDP's replicas are equal; DownpourSGD's is the
server's global model, copied by rank 0) on ``eval_sequences`` fixed validation windows, as loss
in nats per character. A copy's time is the latest rank's clock at that step, from the earliest
rank's start of training.

Each rank also times every training batch (``step_ends``) and, for the local-update strategies,
``after_local_step`` at round steps (every ``period / fragments`` steps when streaming; torchft's optimizer-step
hook at its merges), so the driver can tell compute from communication (the
simulator's step time comes from here). Dynamic averaging runs record each rank's
``||f_i - r||^2`` at every check (before the check acts), the quantity the thresholds are
calibrated against.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.nn.utils import parameters_to_vector

import lightning_dist
from lightning_dist.algorithms.averaging import squared_distance_sum
from lightning_dist.data import StdlibTextDataModule
from lightning_dist.models import TransformerLM

from benchmarks.language_model.ddp_hooks import ddp_with_hook
from benchmarks.language_model.recording import collect, wire_bytes
from benchmarks.segmented_gossip.worker import comm_result, time_protocol, trainer_kwargs
from benchmarks.common.report import write_json

class Snapshots(Callback):
    """Copies of the parameters at rank 0's chosen steps, and the stop after ``budget_s`` seconds of training."""

    def __init__(self, every_s: float, budget_s: float, decide_every: int, server_copy: bool) -> None:
        self.every_s, self.budget_s, self.decide_every, self.server_copy = every_s, budget_s, decide_every, server_copy
        self.start = 0.0
        self.next_copy = 0.0
        self.steps: list[int] = []
        self.times: list[float] = []
        self.wire: list[tuple[int, int]] = []
        self.vectors: list[torch.Tensor] = []
        self.step_ends: list[float] = []

    def _take(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.steps.append(trainer.global_step)
        self.times.append(time.monotonic())
        self.wire.append(wire_bytes())
        strategy = trainer.strategy
        if self.server_copy and getattr(strategy, "_server", None) is not None:
            vector = strategy._server.snapshot()[0].float()  # DownpourSGD: rank 0 hosts the global model
        else:
            vector = parameters_to_vector(pl_module.parameters()).detach().float()
        self.vectors.append(vector.clone())

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = time.monotonic()
        self.next_copy = self.start + self.every_s
        self._take(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        now = time.monotonic()
        self.step_ends.append(now)
        if trainer.global_step % self.decide_every:
            return
        decision = torch.tensor([now >= self.next_copy, now - self.start >= self.budget_s], dtype=torch.uint8)
        dist.broadcast(decision, src=0)
        copy, stop = bool(decision[0]), bool(decision[1])
        if copy or stop:
            self._take(trainer, pl_module)
            self.next_copy = max(self.next_copy + self.every_s, now)
        if stop:
            trainer.should_stop = True


def probe_distances(strategy: lightning_dist.DynamicAveragingStrategy) -> list[float]:
    """Record this rank's ``||f_i - r||^2`` at every check of dynamic averaging, before the check acts."""
    distances: list[float] = []
    original = strategy.after_local_step

    def probed(step: int) -> None:
        if step % strategy.check_every == 0:
            vector = strategy.model_vector
            distances.append(float(squared_distance_sum(zip(vector.parameters, vector.parameter_views(strategy.reference)))))
        original(step)

    strategy.after_local_step = probed  # after_local_step is looked up on the instance
    return distances


def round_period(run: dict[str, Any]) -> int:
    """Optimizer steps between two of the strategy's rounds: its period (``period / fragments`` when streaming: one
    fragment is merged every that many steps), check period or push period."""
    kwargs = run["strategy"]["kwargs"]
    period = int(kwargs.get("period") or kwargs.get("check_every") or kwargs.get("push_every") or 1)
    return period // int(kwargs.get("fragments") or 1)


def make_strategy(spec: dict[str, Any], run: dict[str, Any]) -> Any:
    if run["kind"] == "ddp":
        return ddp_with_hook(**run["hook"]) if run.get("hook") else "ddp"
    kwargs = dict(run["strategy"]["kwargs"])
    if isinstance(kwargs.get("compression"), dict):  # {"sparse": SparseCodec's arguments} (JSON has no dataclasses)
        kwargs["compression"] = lightning_dist.SparseCodec(**kwargs["compression"]["sparse"])
    if run.get("outer"):
        kwargs["outer_optimizer"] = functools.partial(torch.optim.SGD, **run["outer"])
    return getattr(lightning_dist, run["strategy"]["class"])(seed=int(spec["seed"]), **kwargs)


def fit_run(spec: dict[str, Any], run: dict[str, Any]) -> dict[str, Any] | None:
    if run["kind"] == "torchft":  # torchft's DiLoCo, its own loop (imported here: torchft is the bench extra's)
        from benchmarks.language_model import torchft_diloco

        return torchft_diloco.fit_run(spec, run)
    seed = int(spec["seed"])
    L.seed_everything(seed, workers=True, verbose=False)
    datamodule = StdlibTextDataModule(seed=seed, **spec["data"])
    model = TransformerLM(**spec["model"])
    strategy = make_strategy(spec, run)
    rounds: list[tuple[int, float]] = []
    distances: list[float] = []
    if run["kind"] != "ddp":
        rounds, _ = time_protocol(strategy, round_period(run), {})
        if isinstance(strategy, lightning_dist.DynamicAveragingStrategy):
            distances = probe_distances(strategy)
    downpour = run["kind"] == "downpour"
    budget = float(spec["budget_s"])
    snapshots = Snapshots(budget / int(spec["snapshots"]), budget, round_period(run) if downpour else 1, downpour)
    trainer = L.Trainer(**trainer_kwargs(strategy, [snapshots], max_epochs=10_000))
    wire_start = wire_bytes()
    trainer.fit(model, datamodule=datamodule)
    fit_end = time.monotonic()
    wire_end = wire_bytes()
    strategy = trainer.strategy
    stats = strategy.refresh_comm_stats() if isinstance(strategy, lightning_dist.LocalUpdateStrategy) else None

    local = {"start": snapshots.start, "fit_end": fit_end, "steps": snapshots.steps, "times": snapshots.times,
             "wire": [(tx - wire_start[0], rx - wire_start[1]) for tx, rx in snapshots.wire],
             "wire_total": (wire_end[0] - wire_start[0], wire_end[1] - wire_start[1]),
             "step_ends": snapshots.step_ends, "rounds": rounds, "distances": distances}
    result = collect(spec, run, model, datamodule, snapshots.vectors, local, trainer.global_step, downpour)
    if result is not None:
        result.update(comm_result(strategy, stats))
    return result


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    results = []
    for run in spec["runs"]:
        started = time.monotonic()
        result = fit_run(spec, run)
        if result is not None:
            result["launch_part_s"] = time.monotonic() - started
            results.append(result)
            print(f"[lm] {run['name']} done in {result['launch_part_s']:.1f} s: {result['steps']} steps, "
                  f"val_loss {result['final_val_loss']:.3f}", flush=True)
    if dist.get_rank() == 0:
        info = StdlibTextDataModule(**spec["data"]).corpus_info()
        write_json(Path(spec["out"]), {"runs": results, "corpus": info})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
