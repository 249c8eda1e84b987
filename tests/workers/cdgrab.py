"""Worker: a Lightning DDP fit with the CDGraB callback, recording what the test needs to check it.

Spec keys: ``mode``, ``projection_dim``, ``batch_size`` (or ``batch_sizes``, one per rank),
``num_samples`` (MNIST-1D), ``trainer`` (extra Trainer kwargs), ``ckpt_path``, ``checkpoint_dir``
with ``every_n_train_steps``, ``epoch_checkpoint_dir`` (a checkpoint at every epoch's end),
``nan`` (``{"rank", "step"}``: that rank's weights turn NaN before that step). Each rank writes
rank{r}.pt with, per epoch, the sampler's order, the balancer's signs at the epoch's end, whether
every batch held exactly the examples the order named, and the pair differences of each step
computed with a plain autograd loop (a reference independent of torch.func), plus the final
weights, the callback's counters and the final model's accuracy on the validation split.
``runs``: a list of spec overrides fitted one after another in the same processes (starting ranks
costs more than these fits); the result file then holds a list.
"""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_dist import CDGraB
from lightning_dist.data.datamodules import MNIST1DDataModule
from lightning_dist.models import MLPClassifier


class InjectNaN(Callback):
    """Placed before CDGraB: one rank's weights turn NaN right before a step (DDP spreads it after that step)."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            with torch.no_grad():
                next(pl_module.parameters()).fill_(float("nan"))


class Recorder(Callback):
    """Placed after CDGraB: sees each epoch's order and batches, and the signs before the next epoch resets them."""

    def __init__(self, cdgrab: CDGraB) -> None:
        self.cdgrab = cdgrab
        self.epochs: list[dict] = []

    def on_train_epoch_start(self, trainer, pl_module):
        sampler = self.cdgrab.sampler
        self.epochs.append({"epoch": sampler.epoch, "permutation": sampler.permutation.clone(),
                            "local_indices": sampler.local_indices.clone(), "first_step": trainer.global_step,
                            "batches_match": True, "differences": []})

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not self.epochs:  # resumed in the middle of an epoch: start recording from here
            self.on_train_epoch_start(trainer, pl_module)
            self.epochs[-1]["first_batch"] = batch_idx
        record = self.epochs[-1]
        sampler = self.cdgrab.sampler
        size = sampler.batch_size
        expected = sampler.local_indices[record["permutation"][batch_idx * size : (batch_idx + 1) * size]]
        dataset = trainer.train_dataloader.dataset
        expected_x = torch.stack([dataset[int(i)][0] for i in expected])
        record["batches_match"] &= bool(torch.equal(batch[0], expected_x))
        x, y = batch
        gradients = []
        for i in range(len(y)):
            loss = pl_module.per_example_loss((x[i : i + 1], y[i : i + 1])).sum()
            grads = torch.autograd.grad(loss, [p for p in pl_module.parameters() if p.requires_grad])
            gradients.append(torch.cat([g.reshape(-1) for g in grads]))
        gradients = torch.stack(gradients)
        record["differences"].append(gradients[0::2] - gradients[1::2])

    def on_train_epoch_end(self, trainer, pl_module):
        if not self.epochs:  # resumed in an epoch with no batch left to read
            self.on_train_epoch_start(trainer, pl_module)
        self.epochs[-1]["signs"] = self.cdgrab.balancer.signs.clone()
        self.epochs[-1]["next_order"] = self.cdgrab.sampler._next  # noqa: SLF001 (what set_epoch will adopt)


def fit(spec: dict, rank: int) -> dict:
    L.seed_everything(spec.get("seed", 0), workers=True)
    batch_size = spec["batch_sizes"][rank] if "batch_sizes" in spec else spec.get("batch_size", 4)
    datamodule = MNIST1DDataModule(num_samples=spec.get("num_samples", 400), batch_size=batch_size,
                                   example_order="balanced")
    model = MLPClassifier(num_features=40, num_classes=10, hidden_size=8, learning_rate=0.1)
    cdgrab = CDGraB(projection_dim=spec.get("projection_dim"), mode=spec.get("mode", "coordinated"))
    recorder = Recorder(cdgrab)
    callbacks = [InjectNaN(**spec["nan"])] if "nan" in spec else []
    callbacks += [cdgrab, recorder]
    if spec.get("checkpoint_dir"):
        callbacks.append(ModelCheckpoint(dirpath=spec["checkpoint_dir"], save_top_k=-1, filename="{step}",
                                         every_n_train_steps=spec["every_n_train_steps"]))
    if spec.get("epoch_checkpoint_dir"):  # written at every epoch's end, after CDGraB's on_train_epoch_end
        callbacks.append(ModelCheckpoint(dirpath=spec["epoch_checkpoint_dir"], save_top_k=-1, filename="{epoch}"))
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy="ddp", logger=False,
        enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=bool(spec.get("checkpoint_dir") or spec.get("epoch_checkpoint_dir")),
        callbacks=callbacks, num_sanity_val_steps=0, limit_val_batches=0, deterministic=True,
        **spec.get("trainer", {}),
    )
    error = None
    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=spec.get("ckpt_path"))
    except Exception as exc:  # reported to the test, which asserts on it
        error = f"{type(exc).__name__}: {exc}"
    result = {"error": error, "rank": rank}
    if error is None:
        with torch.no_grad():
            correct = sum(int((model(x).argmax(dim=1) == y).sum()) for x, y in datamodule.val_dataloader())
        result.update(
            epochs=recorder.epochs,
            vector=torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
            sampler_epoch=cdgrab.sampler.epoch,
            sampler_permutation=cdgrab.sampler.permutation.clone(),
            dropped=cdgrab.sampler.dropped,
            bytes_sent=cdgrab.bytes_sent,
            seconds=cdgrab.seconds,
            metrics=cdgrab.metrics(),
            global_step=trainer.global_step,
            val_acc=correct / len(datamodule.val_set),
        )
    return result


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    rank = int(os.environ["RANK"])
    if "runs" not in spec:
        torch.save(fit(spec, rank), out / f"rank{rank}.pt")
        return
    results = []
    for overrides in spec["runs"]:
        results.append(fit({**spec, **overrides}, rank))
        torch.save(results, out / f"rank{rank}.pt")  # after every run, so that the runs before a failing one report


if __name__ == "__main__":
    main()
