"""One simulated training run: N virtual workers of one LightningModule on one datamodule.

Workers are nodes ``0 .. N-1`` of a :class:`~lightning_dist.sim.engine.Simulator`; each trains its
own :class:`~lightning_dist.sim.replica.Replica` on its rank's share of the training set (the
loader the datamodule gives rank ``i`` of ``N``) and runs the protocol after every step. A
protocol's server or coordinator is node ``N``. Evaluation is an observer: it reads the models at
a virtual instant, without the steps still running then, and costs no virtual time.

With a :class:`~lightning_dist.sim.churn.Churn` schedule workers leave and join during the run
(what that means: :mod:`lightning_dist.sim.churn`); averages and the global model are then over the
workers present.

Machines of several ranks (``ranks_per_node``, ``intra_node``, ``hierarchy``; :mod:`lightning_dist.sim.machines`):
``workers`` counts the ranks, ``L`` to a machine that shares one network interface. Flat, every rank is a
worker node as above; with ``hierarchy="node"`` a machine's ``L`` ranks are one learner
(:class:`~lightning_dist.sim.replica.NodeReplica`), the workers the protocol sees are the ``workers // L``
machines, and ``num_workers`` counts them (``num_ranks`` the ranks).

Collectives (DDP's gradient all-reduce, the protocols' all-reduces and all-gathers) take Gloo's ring time by
default, or NCCL's ring or tree with ``collectives="nccl"`` (:mod:`lightning_dist.sim.nccl`).
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, Optional

import lightning as L
import simpy
import torch
from simpy.core import StopSimulation
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler

from lightning_dist.algorithms.arguments import check_count
from lightning_dist.sim.batched import BatchedSteps, check_batchable
from lightning_dist.sim.churn import Churn
from lightning_dist.sim.engine import Node, Simulator, SpeedModel
from lightning_dist.sim.machines import Machines, check_machines
from lightning_dist.sim.nccl import check_collectives
from lightning_dist.sim.network_model import NetworkModel
from lightning_dist.sim.numerics import intra_op_threads, numerics
from lightning_dist.sim.protocols.base import Program, Protocol
from lightning_dist.sim.replica import Evaluator, NodeReplica, Replica, SharedReplica
from lightning_dist.sim.run_state import RunState, SimulationResult


def worker_loader(datamodule: L.LightningDataModule, num_workers: int, rank: int, seed: int) -> DataLoader:
    """The train loader of rank ``rank`` of ``num_workers``, as the datamodule would give it under DDP.

    Datamodules with ``train_loader(num_replicas, rank)`` (this package's) choose their own sampler;
    for any other, the dataset and batch size of ``train_dataloader()`` are dealt out by a
    ``DistributedSampler``, which is what Lightning injects.
    """
    if hasattr(datamodule, "train_loader"):
        return datamodule.train_loader(num_workers, rank)
    loader = datamodule.train_dataloader()
    sampler = DistributedSampler(loader.dataset, num_replicas=num_workers, rank=rank, seed=seed, drop_last=True)
    return DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler, collate_fn=loader.collate_fn)


def _equal_lengths(loaders: list[DataLoader]) -> bool:
    """Whether the loaders all have one known length (batches per epoch)."""
    try:
        return len({len(loader) for loader in loaders}) == 1
    except TypeError:
        return False


def _check_batched(batched_workers: Optional[int], protocol: Protocol, speed: Optional[SpeedModel],
                   model: L.LightningModule) -> Optional[int]:
    """``batched_workers`` checked against what batched steps need (:mod:`lightning_dist.sim.batched`)."""
    if batched_workers is None:
        return None
    check_count("batched_workers", batched_workers, 1)
    if type(protocol).train_step is not Protocol.train_step:
        raise ValueError(
            f"batched_workers needs a local-update protocol; protocol {protocol.name!r} computes its workers' steps "
            "itself (ddp: gradients for an all-reduce every step): use batched_workers=None"
        )
    if speed is None or not speed.modelled("step"):
        raise ValueError(
            "batched_workers needs a modelled speed.step_seconds: steps that end at one virtual instant are computed "
            "together, and a measured step runs at its start; got step_seconds=None"
        )
    check_batchable(model)
    return batched_workers


class Simulation(RunState):
    """Simulate ``protocol`` on ``workers`` virtual workers of ``model`` trained on ``datamodule``.

    Args:
        model: the LightningModule every worker copies (its ``training_step``, ``validation_step``
            and ``configure_optimizers`` are used as a Trainer would use them).
        datamodule: gives each worker its train loader and the validation batches.
        protocol: a :class:`~lightning_dist.sim.protocols.Protocol`.
        workers: number of virtual workers (ranks, e.g. GPUs, in all), ``>= 1``; a multiple of ``ranks_per_node``.
        max_steps: optimizer steps per worker (per learner under a hierarchy), ``>= 1``.
        network: the :class:`~lightning_dist.sim.network_model.NetworkModel`; default: no latency, no caps. With
            ``ranks_per_node > 1`` the model of each machine's interface to the other machines, which the
            machine's ranks share.
        speed: the :class:`~lightning_dist.sim.engine.SpeedModel`; default: measured durations.
        max_virtual_seconds: stop at this virtual time even if steps are left; None: no limit.
        eval_every: evaluate the global model each time the workers have taken this many more
            steps on average, ``>= 1``; also at the start and the end.
        evaluate_workers: also evaluate every worker's own model at those points.
        stop_when: called with the global rows after every evaluation; the run stops (at that
            virtual instant) once it returns True, e.g. a few evaluations after a target accuracy.
        seed: seeds torch before the run (dropout, and anything else drawn from torch's default generator).
        churn: workers leaving and joining (:class:`~lightning_dist.sim.churn.Churn`); None: all stay. Needs a
            modelled ``speed.step_seconds``, ``ranks_per_node=1`` (a machine's shared interface and learners of
            several ranks are not simulated with churn) and, for the averaging protocols and the parameter
            server, ``topology="server"``.
        threads: torch's intra-op threads while the run trains and evaluates, restored after it. The figures
            differ in their last bits with the thread count and training amplifies that, so it is fixed; None
            keeps the caller's (faster for a large model on many cores, but the figures then depend on the
            machine's core count). The kernels torch picks for the CPU matter too:
            :func:`~lightning_dist.sim.numerics.pin_cpu_kernels`.
        ranks_per_node: ranks per machine, ``L >= 1``; rank ``r`` sits on machine ``r // L``.
        intra_node: the link between two ranks of one machine (a ``NetworkModel``); default no cap, no latency.
            Used only when ``ranks_per_node > 1``.
        hierarchy: None (every rank a worker) or ``"node"``: one learner per machine, DDP inside it, the protocol
            between machines, as the strategies' ``hierarchy="node"``. ``speed.slowdown`` then names learners.
        collectives: the cost model of every collective (DDP's gradient all-reduce, the protocols' all-reduces and
            all-gathers): ``"gloo_ring"`` (default), Gloo's ring as the strategies run it on CPU
            (:mod:`lightning_dist.sim.collectives`), or ``"nccl"``, NCCL's ring or tree, whichever its tuner predicts
            faster, as a GPU cluster runs them (:mod:`lightning_dist.sim.nccl`). Point-to-point messages keep the
            network model's timing either way.
        batched_workers: None (default): every worker's training step runs on its own. An integer ``k >= 1``: the
            steps that end at one virtual instant run together, up to ``k`` replicas in one ``torch.func.vmap``
            (:mod:`lightning_dist.sim.batched`): much faster for many workers of a small model, equal to the
            per-worker path up to float32 rounding. Needs a modelled ``speed.step_seconds`` and a local-update
            protocol (not ``ddp``, whose workers compute gradients for an all-reduce every step).
    """

    def __init__(
        self,
        model: L.LightningModule,
        datamodule: L.LightningDataModule,
        protocol: Protocol,
        workers: int,
        max_steps: int,
        network: Optional[NetworkModel] = None,
        speed: Optional[SpeedModel] = None,
        max_virtual_seconds: Optional[float] = None,
        eval_every: int = 10,
        evaluate_workers: bool = True,
        stop_when: Optional[Callable[[list[dict[str, float]]], bool]] = None,
        seed: int = 0,
        churn: Optional[Churn] = None,
        threads: Optional[int] = 1,
        ranks_per_node: int = 1,
        intra_node: Optional[NetworkModel] = None,
        hierarchy: Optional[str] = None,
        collectives: str = "gloo_ring",
        batched_workers: Optional[int] = None,
    ) -> None:
        self.num_ranks = check_count("workers", workers, 1)
        self.collectives = check_collectives(collectives)
        self.ranks_per_node, self.hierarchy = check_machines(self.num_ranks, ranks_per_node, hierarchy)
        if intra_node is not None and not isinstance(intra_node, NetworkModel):
            raise TypeError(
                f"intra_node must be a lightning_dist.sim.NetworkModel or None; got {type(intra_node).__name__}"
            )
        self.intra_node = intra_node if intra_node is not None else NetworkModel()
        self.num_workers = self.num_ranks // self.ranks_per_node if self.hierarchy else self.num_ranks
        """The workers the protocol sees: every rank, or one learner per machine under a hierarchy."""
        self.max_steps = check_count("max_steps", max_steps, 1)
        self.eval_every = check_count("eval_every", eval_every, 1)
        self.threads = None if threads is None else check_count("threads", threads, 1)
        if max_virtual_seconds is not None and (
            isinstance(max_virtual_seconds, bool)
            or not isinstance(max_virtual_seconds, (int, float))
            or not (math.isfinite(max_virtual_seconds) and max_virtual_seconds > 0)
        ):
            raise ValueError(f"max_virtual_seconds must be None or a finite number > 0; got {max_virtual_seconds!r}")
        if not isinstance(protocol, Protocol):
            raise TypeError(f"protocol must be a lightning_dist.sim Protocol; got {type(protocol).__name__}")
        protocol.validate(self.num_workers, self.max_steps)
        if churn is not None:
            if not isinstance(churn, Churn):
                raise TypeError(f"churn must be a lightning_dist.sim.Churn or None; got {type(churn).__name__}")
            churn.check(self.num_workers)
            protocol.check_churn()
            if self.ranks_per_node > 1:
                raise ValueError(
                    "churn needs ranks_per_node=1: workers sharing a machine's interface or learners of several ranks "
                    f"are not simulated leaving and joining; got ranks_per_node={self.ranks_per_node}"
                )
            if speed is None or not speed.modelled("step"):
                raise ValueError(
                    "churn needs a modelled speed.step_seconds (a finite number of seconds >= 0): a measured step runs "
                    "before its interval, so a worker leaving during it could not stop it; got step_seconds=None"
                )
        self.churn = churn
        self.batched_workers = _check_batched(batched_workers, protocol, speed, model)
        self.batched_steps = None if self.batched_workers is None else BatchedSteps(model, self.batched_workers)
        self.model = model
        self.datamodule = datamodule
        self.protocol = protocol
        self.network_model = network if network is not None else NetworkModel()
        self.speed = speed if speed is not None else SpeedModel()
        self.max_virtual_seconds = max_virtual_seconds
        self.evaluate_workers = evaluate_workers
        self.stop_when = stop_when
        self.seed = seed
        self.server = self.num_workers

    # ------------------------------------------------------------------ the run

    def run(self) -> SimulationResult:
        with intra_op_threads(self.threads):
            return self._run()

    def _run(self) -> SimulationResult:
        wall_start = time.perf_counter()
        torch.manual_seed(self.seed)
        self.datamodule.setup("fit")
        self.replicas = self._replicas()
        self.dataset_sizes = self._dataset_sizes()
        self._in_flight: list[Optional[Tensor]] = [None] * self.num_workers
        self.present = [True] * self.num_workers
        for rank in self.churn.absent_at_start(self.num_workers) if self.churn is not None else []:
            self.present[rank] = False
        self.positions = [0] * self.num_workers
        """The last step each worker finished (its ``step`` in :meth:`Protocol.after_step`)."""
        self._finished = [False] * self.num_workers
        self.evaluator = Evaluator(self.model, self.datamodule.val_dataloader())
        self.protocol.setup(self)
        self.machines = Machines(self.network_model, self.intra_node, self.ranks_per_node, self.num_ranks,
                                 self.hierarchy, self.replicas[0].gradient_bytes, self.collectives)
        self.simulator = Simulator(self.network_model, self.speed, self.machines)
        for rank in range(self.num_workers):
            self.simulator.add_node(f"worker{rank}", self._worker_program)
        if self.protocol.num_servers:
            self.simulator.add_node("server", self.protocol.server)
        elif self.protocol.server_on_worker is not None:
            self.simulator.add_program(self.protocol.server_on_worker, self.protocol.server)
        for rank in range(self.num_workers):
            self.simulator.nodes[rank].present = self.present[rank]
        self.result = SimulationResult()
        self._total_steps = 0
        self._next_eval = 0
        self._losses: list[list[float]] = [[] for _ in range(self.num_workers)]
        self._eval_wall = 0.0
        self.simulator.start()
        for rank in self.churn.churning(self.num_workers) if self.churn is not None else []:
            self.simulator.env.process(self._churn_program(rank))
        self._setup_wall = time.perf_counter() - wall_start
        self._evaluate()
        virtual_seconds = self.simulator.run(until=self.max_virtual_seconds)
        if self.result.rows[-1]["time"] != virtual_seconds or self.result.rows[-1]["steps"] != self._total_steps:
            self._evaluate()
        self.result.summary = self._summary(virtual_seconds, time.perf_counter() - wall_start)
        return self.result

    def _replicas(self) -> list[Replica]:
        """Every worker's replica; under a protocol whose replicas stay identical (DDP's) and without churn, one
        model and optimizer that all share (:class:`~lightning_dist.sim.replica.SharedReplica`)."""
        if not (self.protocol.identical_replicas and self.hierarchy is None and self.churn is None):
            return [self._replica(worker) for worker in range(self.num_workers)]
        leader = self._replica(0)
        loaders = [worker_loader(self.datamodule, self.num_ranks, worker, self.seed)
                   for worker in range(1, self.num_workers)]
        epoch_schedulers = any(interval == "epoch" for _, interval, _ in leader.schedulers)
        if epoch_schedulers and not _equal_lengths([leader.loader, *loaders]):
            # Epochs that end at different steps step each replica's epoch schedulers at different steps: the
            # replicas' learning rates part, so they do not stay identical.
            return [leader] + [Replica(self.model, loader) for loader in loaders]
        return [leader] + [SharedReplica(leader, loader) for loader in loaders]

    def _replica(self, worker: int) -> Replica:
        """Worker ``worker``'s replica: rank ``worker``'s, or under a hierarchy the learner of machine ``worker``
        with the loaders of its ranks ``worker * L + j``."""
        if self.hierarchy is None:
            return Replica(self.model, worker_loader(self.datamodule, self.num_ranks, worker, self.seed))
        ranks = range(worker * self.ranks_per_node, (worker + 1) * self.ranks_per_node)
        loaders = [worker_loader(self.datamodule, self.num_ranks, rank, self.seed) for rank in ranks]
        return NodeReplica(self.model, loaders)

    def _dataset_sizes(self) -> Tensor:
        """Every worker's ``|D_j|`` (its true part size); all equal, with a warning, if any is unknown."""
        sizes = [replica.part_size for replica in self.replicas]
        unknown = [rank for rank, size in enumerate(sizes) if not size]
        if unknown:
            warnings.warn(
                f"workers {unknown} have no known part size (a train loader without length or an empty one); "
                "every worker is weighted equally",
                stacklevel=3,
            )
            sizes = [1] * len(sizes)
        return torch.tensor(sizes, dtype=torch.float64)

    def _worker_program(self, node: Node, joining: bool = False) -> Program:
        """A worker's life: train ``max_steps`` steps (a joiner: from where :meth:`Protocol.join` puts it), then
        :meth:`Protocol.finish`. A leave ends it with :class:`simpy.Interrupt` wherever it waits."""
        rank = node.index
        replica = self.replicas[rank]
        if not self.present[rank]:
            return  # away from the start: _churn_program spawns it when it joins
        try:
            if joining:
                started = node.now
                self.positions[rank] = yield from self.protocol.join(node, rank)
                self.record_wait(rank, self.positions[rank], started)
                replica.reset_optimizer()
                self.result.churn.append({"worker": rank, "time": node.now, "event": "joined",
                                          "position": self.positions[rank]})
            for step in range(self.positions[rank] + 1, self.max_steps + 1):
                # Loading the batch is not part of the step's compute: tiny shards would start a new epoch
                # (a fresh loader iterator) almost every step, a cost that grows with the worker count.
                batch = replica.next_batch()
                if not self.speed.modelled("step"):
                    self._in_flight[rank] = replica.get()  # see worker_model
                loss = yield from self.protocol.train_step(node, rank, batch)
                self._in_flight[rank] = None
                self.positions[rank] = step
                self._losses[rank].append(loss)
                self._total_steps += 1
                if self._total_steps >= self._next_eval:
                    self._evaluate()
                started = node.now
                yield from self.protocol.after_step(node, rank, step)
                self.record_wait(rank, step, started)
            self._finished[rank] = True
            yield from self.protocol.finish(node, rank)
        except simpy.Interrupt:
            return

    def _churn_program(self, rank: int) -> Program:
        """Worker ``rank``'s leaves and joins from the churn schedule; it stops churning once it finished its steps."""
        env = self.simulator.env
        for leave, join in self.churn.intervals(rank, self.num_workers):
            if leave > 0:  # a worker away from the start was never there
                yield env.timeout(leave - env.now)
                if self._finished[rank]:
                    return
                self._leave(rank)
            if join is None:
                return
            yield env.timeout(join - env.now)
            self._join(rank)

    def _leave(self, rank: int) -> None:
        """Worker ``rank`` leaves now: it stops computing and sending, and the protocol goes on without it."""
        node = self.simulator.nodes[rank]
        self.present[rank] = False
        self.simulator.interrupt(rank)
        node.set_present(False)
        self.simulator.network.drop(rank)
        self.protocol.leave(rank)
        self.simulator.collectives.leave(rank)
        self.result.churn.append({"worker": rank, "time": node.now, "event": "leave"})

    def _join(self, rank: int) -> None:
        """Worker ``rank`` comes back now; the protocol brings it in (:meth:`Protocol.join`) before it trains."""
        node = self.simulator.nodes[rank]
        self.present[rank] = True
        node.set_present(True)
        self.result.churn.append({"worker": rank, "time": node.now, "event": "join"})
        self.simulator.spawn(rank, functools.partial(self._worker_program, joining=True))

    def _evaluate(self) -> None:
        start = time.perf_counter()
        now = self.simulator.env.now
        network = self.simulator.network
        row: dict[str, float] = {
            "time": now,
            "steps": self._total_steps,
            "mean_steps": self._total_steps / self.num_workers,
            "bytes": network.total_bytes,
            "messages": sum(network.messages_sent),
        }
        if self.ranks_per_node > 1:
            row.update({f"bytes_{level}": nbytes for level, nbytes in network.bytes_by_level.items()})
        recent = [loss for losses in self._losses for loss in losses]
        if recent:
            row["train_loss"] = sum(recent) / len(recent)
        row.update(self.evaluator(self.protocol.global_model()))
        self.result.rows.append(row)
        for rank, replica in enumerate(self.replicas):
            losses = self._losses[rank]
            worker_row: dict[str, float] = {
                "time": now,
                "worker": rank,
                "present": float(self.present[rank]),
                "steps": replica.steps - (self._in_flight[rank] is not None),
                "bytes": network.bytes_sent[rank],
            }
            if losses:
                worker_row["train_loss"] = sum(losses) / len(losses)
            if self.evaluate_workers and self.present[rank]:
                worker_row.update(self.evaluator(self.worker_model(rank)))
            self.result.worker_rows.append(worker_row)
            losses.clear()
        self._next_eval = self._total_steps + self.eval_every * self.num_workers
        self._eval_wall += time.perf_counter() - start
        if self.stop_when is not None and self.stop_when(self.result.rows):
            # How simpy's own run(until=...) ends a run: an event whose callback raises StopSimulation.
            stop = self.simulator.env.event()
            stop.callbacks.append(StopSimulation.callback)
            stop.succeed()

    def _summary(self, virtual_seconds: float, wall_seconds: float) -> dict[str, Any]:
        nodes = self.simulator.nodes
        network = self.simulator.network
        compute_wall = sum(node.wall_compute_seconds for node in nodes)
        final = self.result.rows[-1]
        return {
            "protocol": self.protocol.config(),
            "workers": self.num_ranks,
            "num_learners": self.num_workers,
            **self.machines.config(),
            "max_steps": self.max_steps,
            "network": asdict(self.network_model),
            "speed": {
                "step_seconds": self.speed.step_seconds,
                "aggregate_seconds": self.speed.aggregate_seconds,
                "slowdown": dict(self.speed.slowdown),
                "jitter": self.speed.jitter,
                "deterministic": self.speed.deterministic,
            },
            "seed": self.seed,
            "numerics": numerics(),
            "churn": None if self.churn is None else {
                **self.churn.config(),
                "churning": self.churn.churning(self.num_workers),
                "leaves": sum(event["event"] == "leave" for event in self.result.churn),
                "joins": sum(event["event"] == "join" for event in self.result.churn),
            },
            "num_parameters": self.replicas[0].vector.num_parameters,
            "model_bytes": self.replicas[0].get().nbytes,
            "virtual_seconds": virtual_seconds,
            "steps": self._total_steps,
            "bytes": network.total_bytes,
            "messages": sum(network.messages_sent),
            "bytes_by_node": list(network.bytes_sent),
            "bytes_by_level": dict(network.bytes_by_level),
            "final": {key: value for key, value in final.items()
                      if key not in ("time", "steps", "bytes", "messages") and not key.startswith("bytes_")},
            "protocol_metrics": self.protocol.metrics(),
            "batched": None if self.batched_steps is None else {
                "batched_workers": self.batched_workers,
                "steps": self.batched_steps.steps,
                "calls": self.batched_steps.calls,
            },
            # Virtual seconds workers spent waiting for the protocol (transfers, barriers), per worker.
            "wait_seconds_per_worker": sum(wait["seconds"] for wait in self.result.waits) / self.num_workers,
            "wall_seconds": wall_seconds,
            "compute_wall_seconds": compute_wall,
            "evaluation_wall_seconds": self._eval_wall,
            "setup_wall_seconds": self._setup_wall,
            # Simulator overhead: the run's wall time (set-up and evaluation left out) per second of the
            # real compute it ran (the training steps and the servers' aggregations inside execute).
            "overhead_ratio": (wall_seconds - self._eval_wall - self._setup_wall) / compute_wall
            if compute_wall > 0
            else math.nan,
            "mean_step_wall_seconds": sum(n.wall_compute_seconds for n in nodes[: self.num_workers])
            / max(self._total_steps, 1),
        }
