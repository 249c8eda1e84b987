"""Multi-node training script for examples/slurm/dynamic_avg.sbatch.

Lightning's SLURMEnvironment reads the ranks from SLURM's variables when the script runs
under ``srun``; ``--nodes`` and ``--ntasks-per-node`` must match ``num_nodes`` and ``devices``.
"""

import argparse

import lightning as L

import lightning_dist
from lightning_dist.data.datamodules import MNIST1DDataModule
from lightning_dist.models import MLPClassifier


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--devices", type=int, required=True, help="processes (GPUs) per node")
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--divergence-threshold", type=float, default=0.7)
    parser.add_argument("--check-every", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    L.seed_everything(0)
    datamodule = MNIST1DDataModule(num_samples=20000, partition="dirichlet", dirichlet_alpha=0.5)
    model = MLPClassifier(datamodule.num_features, datamodule.num_classes, learning_rate=0.05, momentum=0.9)
    strategy = lightning_dist.DynamicAveragingStrategy(
        divergence_threshold=args.divergence_threshold, check_every=args.check_every
    )
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, num_nodes=args.nodes,
                        strategy=strategy, max_epochs=args.epochs)
    trainer.fit(model, datamodule=datamodule)
    if trainer.is_global_zero:
        stats = strategy.comm_stats
        print(f"protocol bytes {stats.protocol_bytes}, all bytes {stats.bytes_sent}, syncs {stats.syncs}")


if __name__ == "__main__":
    main()
