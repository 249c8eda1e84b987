"""Worker for the language-model config test: ``lightning-dist fit --config configs/lm/<name>.yaml`` for each
config in turn, in one torchrun launch, with the test's overrides; results per rank and config.

Usage: torchrun --nproc_per_node=2 lm_fit.py spec.json (see tests/helpers/launch.py).
"""

import json
import sys
from pathlib import Path

import torch

from lightning_dist.cli import DistCLI


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    results = {}
    for config in spec["configs"]:
        cli = DistCLI(subclass_mode_model=True, subclass_mode_data=True, run=False,
                      args=["--config", config, *spec["overrides"], f"--trainer.default_root_dir={out / Path(config).stem}"])
        trainer, model, datamodule = cli.trainer, cli.model, cli.datamodule
        trainer.fit(model, datamodule=datamodule)
        strategy = trainer.strategy
        results[Path(config).stem] = {
            "rank": trainer.global_rank,
            "strategy": type(strategy).__name__,
            "global_step": trainer.global_step,
            "metrics": {key: float(value) for key, value in trainer.callback_metrics.items()},
            "hparams": dict(model.hparams),
            "num_parameters": model.num_parameters,
            "vector": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            "part": torch.as_tensor(trainer.train_dataloader.sampler.part),
            "corpus": datamodule.corpus_info(),
            "comm": getattr(strategy, "comm_stats", None),
        }
    torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
