"""``lightning-dist``: LightningCLI with the package's strategies registered.

    lightning-dist fit --config configs/dynamic_avg.yaml
    lightning-dist simulate --config configs/sim/segmented_gossip.yaml   (lightning_dist.sim)

Any LightningModule / LightningDataModule can be named with ``class_path``. Sizes the data
module knows are passed to the model's arguments of the same names: ``num_features`` and
``num_classes`` (MNIST-1D, digits -> MLPClassifier), ``vocab_size`` and ``block_size`` (the
standard-library text -> TransformerLM). A link whose source the data module lacks, or whose target
the model does not take, is skipped (jsonargparse's rule for subclass-typed ``apply_on="instantiate"``
links), so any pairing of a model and a data module works.

Under ``torchrun`` the trainer's ``devices`` and ``num_nodes`` default to what torchrun's rendezvous
admitted this round (``LOCAL_WORLD_SIZE`` and ``WORLD_SIZE / LOCAL_WORLD_SIZE``): with an elastic
``--nnodes=MIN:MAX`` the number of nodes is known only when the processes start, and changes after a
restart in which a node left (``examples/elastic/``). A value given in the config or on the command
line still wins, and Lightning checks that ``devices * num_nodes`` equals the world size.
"""

from __future__ import annotations

import os
import sys

from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch.cli import LightningCLI

import lightning_dist  # noqa: F401  (registers "dynamic_avg", "periodic_avg", "fedavg")


class DistCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:  # type: ignore[no-untyped-def]
        for name in ("num_features", "num_classes", "vocab_size", "block_size"):
            parser.link_arguments(f"data.{name}", f"model.init_args.{name}", apply_on="instantiate")
        parser.set_defaults(torchrun_topology())


def torchrun_topology() -> dict[str, int]:
    """The trainer's ``devices`` and ``num_nodes`` under torchrun (empty when not under torchrun)."""
    if not TorchElasticEnvironment.detect() or "LOCAL_WORLD_SIZE" not in os.environ:
        return {}
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    return {"trainer.devices": per_node, "trainer.num_nodes": int(os.environ["WORLD_SIZE"]) // per_node}


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["simulate"]:
        from lightning_dist.sim.cli import main as simulate

        simulate(argv[1:])
        return
    DistCLI(subclass_mode_model=True, subclass_mode_data=True, args=args, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
