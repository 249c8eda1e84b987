"""Worker of ``benchmarks/fault_tolerance/failure.py``: the language model trained with DiLoCo by one replica group
(one rank, in its own network namespace), a group killed at a chosen step, and everything a scorer needs written
as it happens, so that a killed process leaves its record behind.

    torchrun --nproc_per_node=1 ... failure_worker.py spec.json GROUP   # spec["tolerant"]: one job per group
    torchrun --nnodes=4 --rdzv-backend=c10d ... failure_worker.py spec.json GROUP   # else one job, checkpoints

The task is the LM benchmark's (``benchmarks/language_model/network.py``'s ``TASK``), DiLoCo every
``spec["period"]`` steps with its outer step, ``spec["max_steps"]`` steps. With ``spec["tolerant"]``,
``fault_tolerance=TorchFT(...)`` at ``spec["lighthouse"]``, ``GROUP`` the replica group; without, the plain strategy
with a checkpoint every ``spec["checkpoint_every"]`` steps (``last.ckpt``, resumed by a torchrun restart), ``GROUP``
the namespace (torchrun may hand a restarted node another rank).

Every process appends JSON lines to ``<work>/<name>.<group>.<incarnation>.jsonl`` (the incarnation counts this group's
processes so far; torchrun's restart count stays 0 on a node restarted for another node's failure): ``up`` (the script's
first line ran), ``joined`` (fault_tolerance: the set-up quorum returned), ``train_start``, every ``step`` end, every
``window`` (its start and end, whether it was committed, ``ft/*``, the groups that met and contributed, the seconds of
its phases under the option), every ``checkpoint`` (its start and end), every ``snapshot`` and ``end``, each with the
wall clock (``time.time()``: one clock for every namespace of the host) and the namespace interface's byte counters. A
snapshot is the replica's parameters (``<work>/snapshots/<name>.<group>.<incarnation>.<k>.pt``), taken at the first step
end after ``epoch + k * every`` seconds, so the scorer averages the groups' replicas on one grid. The group
``spec["kill"]["group"]`` SIGKILLs itself at the end of step ``spec["kill"]["step"]``, once (``<work>/<name>.killed``
marks it done). ``spec["kills"]`` (``benchmarks/fault_tolerance/goodput.py``) is a list of timed kills, ``{"group": g,
"after": s}``: group ``g`` SIGKILLs itself at its first step end at least ``s`` seconds after the training origin, once
per kill (``<work>/<name>.killed.<index>`` marks it done), so a kill that falls while its group is down or writing a
checkpoint comes at its first step end after that. The origin is the first group's start of training
(``<work>/<name>.origin``, written by that group), which no launcher knows in advance.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before torch and Lightning are imported: "the process is up"

import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch.nn.utils import parameters_to_vector  # noqa: E402

from lightning_dist import PeriodicAveragingStrategy, TorchFT  # noqa: E402
from lightning_dist.data import StdlibTextDataModule  # noqa: E402
from lightning_dist.models import TransformerLM  # noqa: E402

from benchmarks.fault_tolerance.worker import timed  # noqa: E402
from benchmarks.language_model.recording import wire_bytes  # noqa: E402

BARRIER_TIMEOUT_S = 300.0


class Journal:
    """Append-only JSON lines, flushed at every line: what a SIGKILL leaves is what was recorded."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("a")

    def write(self, event: str, at: float | None = None, **fields: Any) -> None:
        sent, received = wire_bytes()
        record = {"event": event, "time": time.time() if at is None else at, "tx": sent, "rx": received, **fields}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()


class TimedKills:
    """A launch's timed kills (``spec["kills"]``) as one group sees them: its own, due by seconds from the origin."""

    def __init__(self, kills: list[dict[str, Any]], group: int, work: Path, name: str) -> None:
        self.after = {index: float(kill["after"]) for index, kill in enumerate(kills) if int(kill["group"]) == group}
        self.work, self.name = work, name
        self.origin: float | None = None

    def start(self, now: float) -> None:
        """At this process's start of training: the launch's origin, set here by the first group to get there."""
        path = self.work / f"{self.name}.origin"
        draft = path.with_name(f"{path.name}.{os.getpid()}")
        draft.write_text(repr(now))
        try:
            os.link(draft, path)  # exclusive and atomic: no group reads a half-written origin
        except FileExistsError:
            pass
        draft.unlink()
        self.origin = float(path.read_text())

    def due(self, now: float) -> list[int]:
        """The indices of this group's kills due at ``now`` and not done yet (several, if they fell while it was
        down: one death serves them all)."""
        if self.origin is None:
            return []
        return [index for index, after in self.after.items()
                if now >= self.origin + after and not self.marker(index).exists()]

    def marker(self, index: int) -> Path:
        return self.work / f"{self.name}.killed.{index}"


class Recorder(Callback):
    """Step ends, snapshots on the shared wall-clock grid, and the planned kills."""

    def __init__(self, journal: Journal, snapshots: Path, tag: str, epoch: float, every_s: float,
                 kill_step: int | None, killed_marker: Path, timed_kills: TimedKills | None) -> None:
        self.journal, self.snapshots, self.tag = journal, snapshots, tag
        self.epoch, self.every_s, self.kill_step, self.killed_marker = epoch, every_s, kill_step, killed_marker
        self.timed_kills = timed_kills
        self.last_index = -1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        now = time.time()
        self.journal.write("train_start", at=now, step=trainer.global_step)
        if self.timed_kills is not None:
            self.timed_kills.start(now)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        now = time.time()
        self.journal.write("step", at=now, step=step)
        if step == self.kill_step and not self.killed_marker.exists():
            self.killed_marker.touch()
            self.die(step=step)
        due = self.timed_kills.due(now) if self.timed_kills is not None else []
        if due:
            for index in due:
                self.timed_kills.marker(index).touch()
            self.die(step=step, kills=due)
        index = int((time.time() - self.epoch) // self.every_s)
        if index > self.last_index:
            self.last_index = index
            vector = parameters_to_vector(pl_module.parameters()).detach().float()
            torch.save(vector.clone(), self.snapshots / f"{self.tag}.{index}.pt")
            self.journal.write("snapshot", step=step, index=index)

    def die(self, **fields: Any) -> None:
        """SIGKILL this process, journaled first: no clean-up runs, as when a machine is lost."""
        self.journal.write("kill", **fields)
        os.kill(os.getpid(), signal.SIGKILL)


PHASES: dict[str, list[float]] = {}
"""Seconds this window spent in each of its phases (:func:`time_phases`), journaled with it and reset."""


def time_phases() -> None:
    """Time a window's phases under the option: taking a heal's committed state, the quorum (a heal's small part
    inside it), the contributor count's all-reduce, the exchange and ``should_commit``."""
    from lightning_dist.comm.quorum import QuorumCommunicator
    from lightning_dist.strategies._fault_tolerance import ReplicaGroups
    from lightning_dist.strategies._replica_windows import FaultTolerantWindows

    for owner, name, phase in ((ReplicaGroups, "complete_heal", "take_heal"),
                               (QuorumCommunicator, "begin_window", "quorum"),
                               (QuorumCommunicator, "count_contributors", "count"),
                               (FaultTolerantWindows, "_exchange", "exchange"),
                               (QuorumCommunicator, "commit", "commit")):
        setattr(owner, name, timed(getattr(owner, name), PHASES.setdefault(phase, [])))


def journaled_window(method: Any, journal: Journal, strategy: PeriodicAveragingStrategy) -> Any:
    """``method`` (a window's end) journaled: its start and end, the outcome, the fault-tolerance counters."""
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        began = time.time()
        outcome = method(*args, **kwargs)
        metrics = strategy.fault_tolerance_metrics() if strategy.fault_tolerance is not None else {}
        windows = strategy._windows  # under the option: how many groups met and contributed
        membership = None if windows is None else windows.quorum.membership
        journal.write("window", began=began, committed=outcome if isinstance(outcome, bool) else None,
                      step=strategy.lightning_module.trainer.global_step, metrics=metrics,
                      contributors=None if membership is None else membership.contributors,
                      groups=None if membership is None else membership.groups,
                      phases={phase: sum(durations) for phase, durations in PHASES.items()})
        for durations in PHASES.values():
            durations.clear()
        return outcome
    return wrapper


def journaled_checkpoint(method: Any, journal: Journal, trainer: L.Trainer) -> Any:
    """``Trainer.save_checkpoint`` journaled: its start and end (every rank takes part: each sends its replica)."""
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        began = time.time()
        outcome = method(*args, **kwargs)
        journal.write("checkpoint", began=began, step=trainer.global_step)
        return outcome
    return wrapper


def wait_for_peers(spec: dict[str, Any], group: int) -> None:
    """A fresh launch's groups meet before their first quorum, each with its Manager already heartbeating: the
    Lighthouse forms a quorum at once from the groups that are alive, so a group slower to start (2 cores, 4
    processes) would otherwise miss the first quorum and join as if it had restarted."""
    ready = Path(spec["work_dir"]) / f"{spec['name']}.ready"
    ready.mkdir(exist_ok=True)
    (ready / str(group)).touch()
    deadline = time.time() + BARRIER_TIMEOUT_S
    while len(list(ready.iterdir())) < int(spec["groups"]):
        if time.time() > deadline:
            raise TimeoutError(f"{spec['name']}: the other groups did not start within {BARRIER_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    group = int(sys.argv[2])
    tolerant = bool(spec["tolerant"])
    work = Path(spec["work_dir"])
    incarnation = len(list(work.glob(f"{spec['name']}.{group}.*.jsonl")))
    tag = f"{spec['name']}.{group}.{incarnation}"
    journal = Journal(work / f"{tag}.jsonl")
    journal.write("up", at=STARTED)  # the counters as the imports left them: nothing went on the wire yet
    torch.set_num_threads(1)

    seed = int(spec["seed"])
    L.seed_everything(seed, workers=True, verbose=False)
    datamodule = StdlibTextDataModule(seed=seed, **spec["data"])
    model = TransformerLM(**spec["model"])
    outer = functools.partial(torch.optim.SGD, **spec["outer"])
    callbacks: list[Callback] = []
    kill = spec.get("kill")
    kill_step = int(kill["step"]) if kill and int(kill["group"]) == group else None
    timed_kills = TimedKills(spec["kills"], group, work, spec["name"]) if spec.get("kills") else None
    callbacks.append(Recorder(journal, work / "snapshots", tag, float(spec["epoch"]), float(spec["snapshot_every_s"]),
                              kill_step, work / f"{spec['name']}.killed", timed_kills))
    if tolerant:
        option = TorchFT(num_replica_groups=int(spec["groups"]), replica_group=group, lighthouse=spec["lighthouse"],
                         timeout=timedelta(seconds=60))
        strategy = PeriodicAveragingStrategy(period=int(spec["period"]), outer_optimizer=outer, fault_tolerance=option)
        join = strategy.join_replica_groups

        def joined() -> None:
            if incarnation == 0:
                wait_for_peers(spec, group)
            join()
            journal.write("joined", step=strategy.lightning_module.trainer.global_step)

        strategy.join_replica_groups = joined
        strategy.end_window = journaled_window(strategy.end_window, journal, strategy)
        time_phases()
        nodes, checkpoint_path = 1, None
    else:
        strategy = PeriodicAveragingStrategy(period=int(spec["period"]), outer_optimizer=outer)
        strategy.synchronize_in_place = journaled_window(strategy.synchronize_in_place, journal, strategy)
        callbacks.append(ModelCheckpoint(dirpath=work / f"{spec['name']}.checkpoints", save_top_k=0, save_last=True,
                                         every_n_train_steps=int(spec["checkpoint_every"])))
        nodes, checkpoint_path = int(spec["groups"]), "last"
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, num_nodes=nodes,
                        max_steps=int(spec["max_steps"]), callbacks=callbacks, logger=False,
                        enable_checkpointing=not tolerant, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0)
    if not tolerant:
        trainer.save_checkpoint = journaled_checkpoint(trainer.save_checkpoint, journal, trainer)
    trainer.fit(model, datamodule=datamodule, ckpt_path=checkpoint_path)
    journal.write("end", step=trainer.global_step, bytes=strategy.comm_stats.bytes_sent)


if __name__ == "__main__":
    main()
