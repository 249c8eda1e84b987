"""Multi-node training script for examples/slurm/dynamic_avg.sbatch.

Lightning's SLURMEnvironment reads the ranks from SLURM's variables when the script runs
under ``srun``; ``--nodes`` and ``--ntasks-per-node`` must match ``num_nodes`` and ``devices``.

Checkpoints and preemption. ModelCheckpoint writes ``<root-dir>/checkpoints/last.ckpt`` every
``--checkpoint-every`` optimizer steps. On the requeue signal (SIGUSR1, sent by SLURM
``--signal=SIGUSR1@90`` before the time limit, or by ``scancel -s USR1 <jobid>``) Lightning's
SLURM auto-requeue writes ``<root-dir>/hpc_ckpt_<n>.ckpt`` and rank 0 runs
``scontrol requeue $SLURM_JOB_ID``; SLURM then ends the job and starts it again under the same job
id, and this script resumes from the newest of those checkpoints (global_step goes on from where it
stopped). Both kinds go through the strategy's ``save_checkpoint``, so they hold every rank's
replica and the protocol state, not only the averaged model. ``<root-dir>`` defaults to
``lightning_logs/slurm-$SLURM_JOB_ID``, which a requeued job keeps.
"""

import argparse
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any, Optional

import lightning as L
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_dist
from lightning_dist.data.datamodules import MNIST1DDataModule
from lightning_dist.models import MLPClassifier


class Requeued(Exception):
    """Raised on every rank after the hpc checkpoint is written and the job requeued: stop, write nothing more."""


class RequeueAtStepBoundary(Callback):
    """Lightning's SLURM auto-requeue, run at a training-step boundary that every rank reaches together.

    Lightning's own SIGUSR1 handler writes the hpc checkpoint inside the signal handler, wherever
    each rank happens to be. With these strategies that write is a collective (every rank's replica
    goes to rank 0, plus the consensus average), and a rank blocked in a collective of the step
    cannot run its Python handler until the others join it: a rank already in the checkpoint's
    collective and one waiting in the step's collective wait for each other for ever. Here the
    handler only records the signal; after each training batch the ranks agree whether any got it
    (one small all-reduce) and then all run Lightning's own handler at the same point (hpc
    checkpoint, loggers finalized, ``scontrol requeue`` from rank 0), and stop (Requeued). Tried on
    the local cluster: with Lightning's handler 2 of 3 preempted jobs hung without a checkpoint.
    The all-reduce keeps the ranks in step once per batch, as Lightning's per-batch SIGTERM
    broadcast already does (DownpourSGD removes that broadcast and would lose its asynchrony here).
    A signal before fit starts ends the process (SIGUSR1's default action), as it does with Lightning.
    """

    def __init__(self) -> None:
        self._signum: Optional[signal.Signals] = None
        self._previous: Any = None
        self._signalled = False

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        environment = getattr(trainer.strategy, "cluster_environment", None)
        if not (isinstance(environment, SLURMEnvironment) and environment.auto_requeue):
            return
        self._signum = environment.requeue_signal
        # The Trainer registers its signal handlers after on_fit_start and adds its requeue handler
        # only where none is installed, so this one replaces it (its SIGTERM handling stays).
        self._previous = signal.signal(self._signum, self._record)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
            print(f"job {os.environ.get('SLURM_JOB_ID')} restart {restarts}: training from global_step "
                  f"{trainer.global_step} (checkpoint {trainer.ckpt_path})", flush=True)

    def _record(self, signum: int, frame: Optional[FrameType]) -> None:
        self._signalled = True

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._signum is None or not trainer.strategy.reduce_boolean_decision(self._signalled, all=False):
            return
        step = trainer.global_step
        print(f"rank {trainer.global_rank}: requeue signal, hpc checkpoint at global_step {step}", flush=True)
        trainer._signal_connector._slurm_sigusr_handler_fn(self._signum, None)
        # The checkpoint is written: SLURM's SIGTERM, which follows the requeue, may end the process
        # now. Lightning's SIGTERM handler would broadcast to ranks that are already gone.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Requeued(f"job requeued at global_step {step}")

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._signum is not None:
            signal.signal(self._signum, self._previous)
            self._signum = None


def resume_path(root_dir: Path) -> Optional[str]:
    """The newest of the hpc checkpoints (written on the requeue signal) and ``last.ckpt``.

    Left to itself, Lightning under SLURM resumes from the highest ``hpc_ckpt_<n>`` whenever one
    exists, even when a later ``last.ckpt`` exists (a job requeued once, then killed without warning).
    """
    candidates = [*root_dir.glob("hpc_ckpt_*.ckpt"), root_dir / "checkpoints" / "last.ckpt"]
    existing = [path for path in candidates if path.is_file()]
    return str(max(existing, key=lambda path: path.stat().st_mtime)) if existing else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--devices", type=int, required=True, help="processes (GPUs) per node")
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--divergence-threshold", type=float, default=0.7)
    parser.add_argument("--check-every", type=int, default=10)
    parser.add_argument("--hierarchy", choices=["none", "node"], default="none",
                        help="node: one learner per node (DDP among a node's tasks, dynamic averaging between nodes)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--max-steps", type=int, default=-1, help="optimizer steps per rank (-1: --epochs decides)")
    parser.add_argument("--num-samples", type=int, default=20000)
    parser.add_argument("--checkpoint-every", type=int, default=200, help="optimizer steps between last.ckpt writes")
    parser.add_argument("--root-dir", type=Path, default=None,
                        help="checkpoints and logs (default lightning_logs/slurm-$SLURM_JOB_ID)")
    args = parser.parse_args()
    root_dir = args.root_dir or Path("lightning_logs") / f"slurm-{os.environ.get('SLURM_JOB_ID', 'local')}"
    L.seed_everything(0)
    datamodule = MNIST1DDataModule(num_samples=args.num_samples, partition="dirichlet", dirichlet_alpha=0.5)
    model = MLPClassifier(datamodule.num_features, datamodule.num_classes, learning_rate=0.05, momentum=0.9)
    strategy = lightning_dist.DynamicAveragingStrategy(
        divergence_threshold=args.divergence_threshold, check_every=args.check_every,
        hierarchy=None if args.hierarchy == "none" else args.hierarchy,
    )
    checkpoints = ModelCheckpoint(
        dirpath=root_dir / "checkpoints", every_n_train_steps=args.checkpoint_every, save_last=True
    )
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, num_nodes=args.nodes,
                        strategy=strategy, max_epochs=args.epochs, max_steps=args.max_steps,
                        default_root_dir=root_dir, callbacks=[checkpoints, RequeueAtStepBoundary()],
                        enable_progress_bar=sys.stdout.isatty())  # a batch job's log is no terminal
    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=resume_path(root_dir))
    except Requeued as requeued:
        print(f"rank {trainer.global_rank}: {requeued}", flush=True)
        return
    if trainer.is_global_zero:
        stats = strategy.comm_stats
        print(f"finished at global_step {trainer.global_step}: val_acc {trainer.callback_metrics.get('val_acc')}, "
              f"protocol bytes {stats.protocol_bytes}, all bytes {stats.bytes_sent}, syncs {stats.syncs}", flush=True)
        if args.hierarchy == "node":
            print(f"one learner per node: {strategy.num_learners} learners, bytes between nodes "
                  f"{stats.bytes_by_level['inter_node']}, inside nodes {stats.bytes_by_level['intra_node']}", flush=True)


if __name__ == "__main__":
    main()
