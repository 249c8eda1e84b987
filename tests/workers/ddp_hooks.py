"""Worker: DDP with a gradient-compression hook on the CPU (``benchmarks/language_model/ddp_hooks.py``), one fit per case.

Each case of ``spec["cases"]`` (``name``; ``hook``: keyword arguments of ``ddp_with_hook``, or ``lightning_fp16``:
Lightning's own ``DDPStrategy(ddp_comm_hook=fp16_compress_hook)``) trains the digits MLP for 3 steps on 2 ranks and
records, at the last step, whether every averaged gradient is representable in fp16 and PowerSGD's iteration count.
Usage: see tests/helpers/launch.py.
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_dist.data.datamodules import DigitsDataModule
from lightning_dist.models import MLPClassifier

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # a launched script: the repository importable
from benchmarks.language_model.ddp_hooks import ddp_with_hook  # noqa: E402


class Gradients(Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.fp16_exact = all(torch.equal(g.half().float(), g) for g in grads)
        self.nonzero = all(bool(g.abs().sum() > 0) for g in grads)


def fit(case: dict) -> dict:
    L.seed_everything(0, workers=True, verbose=False)
    if "hook" in case:
        strategy = ddp_with_hook(**case["hook"])
    else:
        strategy = DDPStrategy(ddp_comm_hook=default_hooks.fp16_compress_hook)
    datamodule = DigitsDataModule(batch_size=32)
    model = MLPClassifier(num_features=datamodule.num_features, num_classes=datamodule.num_classes)
    gradients = Gradients()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[gradients])
    trainer.fit(model, datamodule=datamodule)
    state = trainer.strategy._ddp_comm_state
    return {"name": case["name"], "fp16_exact": gradients.fp16_exact, "nonzero": gradients.nonzero,
            "powersgd_iter": getattr(state, "iter", None), "rank": trainer.global_rank}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    results = [fit(case) for case in spec["cases"]]
    torch.save(results, Path(spec["out"]) / f"rank{results[0]['rank']}.pt")
    # Lightning leaves the process group up after fit; torn down at interpreter exit, Gloo's threads once aborted a
    # rank ("terminate called without an active exception") after its results were written.
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
