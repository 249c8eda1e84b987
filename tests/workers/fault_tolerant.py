"""Worker for the fault-tolerance tests: one replica group's job (torchrun, 1 or more ranks) of a periodic-averaging fit
whose windows run through torchft; each rank writes ``<out>/<name>/group<g>_rank<r>[_restart].pt``.

Usage: torchrun ... fault_tolerant.py spec.json GROUP [restart] (tests/helpers/launch.py's ``run_replica_groups``);
with ``"plain": true`` the same fit without the option on ``run_nodes``' nodes (``GROUP_RANK`` is the group), the
baseline a run without failures must equal. The spec names the Lighthouse, the groups, the
strategy's arguments, and the failure to inject into this group: ``{"kill": {"group": 2, "step": 6}}`` exits this
job's processes right after that optimizer step (inside a window), ``{"kill": {"group": 2, "window": 2,
"all_reduce": 3}}`` during the third all-reduce of its second window (inside the exchange). A restarted job (the
``restart`` argument) injects nothing. ``"start_barrier"`` makes every group's job wait for the others' before fit, so
the first quorum has every group. ``"checkpoint"`` writes each group's checkpoint at every epoch's end;
``"resume_from": NAME`` resumes every group from its own first-epoch checkpoint of run NAME. ``"step_sleep"`` slows every optimizer step (room for a restarted job to start).
"""

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import lightning_dist.algorithms.averaging as averaging
from lightning_dist.algorithms.outer import diloco_outer_optimizer
from lightning_dist.comm.quorum import QuorumCommunicator
from lightning_dist.data.datamodules import DigitsDataModule
from lightning_dist.models import MLPClassifier
from lightning_dist.strategies import PeriodicAveragingStrategy, TorchFT


class Record(Callback):
    """The model after every optimizer step (and its window, if one ended there), with the global step."""

    def __init__(self, kill_step: int | None, step_sleep: float) -> None:
        self.kill_step, self.step_sleep = kill_step, step_sleep
        self.after_step: dict[int, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module):
        self.start = trainer.strategy.model_vector.get().clone()
        windows = trainer.strategy._windows
        self.anchor = None if windows is None else windows.anchor.clone()  # the committed model training starts with

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after_step[trainer.global_step] = trainer.strategy.model_vector.get().clone()
        if trainer.global_step == self.kill_step:
            os._exit(17)  # a crash: no clean-up, no goodbye to the quorum
        time.sleep(self.step_sleep)


def record_windows(strategy: PeriodicAveragingStrategy, kill: dict | None):
    """Keep every window's replica before the exchange, and whether it was committed; inject the exchange failure."""
    windows: list[dict] = []
    end_window = strategy.end_window
    all_reduce = QuorumCommunicator.all_reduce_sum_
    calls = {"window": 0, "all_reduce": 0}

    def dying_all_reduce(self, tensor, purpose):
        calls["all_reduce"] += 1
        if kill and calls["window"] == kill.get("window") and calls["all_reduce"] == kill.get("all_reduce"):
            os._exit(17)
        return all_reduce(self, tensor, purpose)

    def recorded(purpose: str) -> bool:
        calls["window"] += 1
        calls["all_reduce"] = 0
        before = strategy.model_vector.get().clone()
        committed = end_window(purpose)
        windows.append({"purpose": purpose, "before": before, "after": strategy.model_vector.get().clone(),
                        "committed": committed, "healed": strategy._windows.quorum.healed,
                        "local_steps": strategy._local_steps,
                        "membership": strategy._windows.quorum.membership.__dict__})
        return committed

    QuorumCommunicator.all_reduce_sum_ = dying_all_reduce
    strategy.end_window = recorded
    return windows


def wait_for_others(barrier: Path, group: int, groups: int) -> None:
    barrier.mkdir(parents=True, exist_ok=True)
    (barrier / f"{group}_{os.environ['LOCAL_RANK']}").touch()
    ranks = int(os.environ["LOCAL_WORLD_SIZE"])
    while len(list(barrier.iterdir())) < groups * ranks:
        time.sleep(0.05)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    plain = spec.get("plain", False)
    group = int(os.environ["GROUP_RANK"]) if plain else int(sys.argv[2])
    restart = len(sys.argv) > 3
    torch.set_num_threads(1)
    averaging.AVERAGE_BUCKET = spec.get("bucket", averaging.AVERAGE_BUCKET)
    out = Path(spec["out"]) / spec["name"]
    out.mkdir(parents=True, exist_ok=True)
    kill = None if restart else spec.get("kill")
    kill = kill if kill and kill["group"] == group else None
    if spec.get("start_barrier") and not restart and not plain:
        wait_for_others(Path(spec["out"]) / f"{spec['name']}_barrier", group, spec["groups"])

    L.seed_everything(0, workers=True, verbose=False)
    datamodule = DigitsDataModule(batch_size=16)
    model = MLPClassifier(num_features=datamodule.num_features, num_classes=datamodule.num_classes, hidden_size=32)
    kwargs = dict(spec.get("strategy", {}))
    if kwargs.pop("diloco", False):
        kwargs["outer_optimizer"] = diloco_outer_optimizer
    if plain:
        strategy = PeriodicAveragingStrategy(**kwargs)
        windows = []
    else:
        option = TorchFT(num_replica_groups=spec["groups"], min_replicas=spec.get("min_replicas", 1),
                         replica_group=group, lighthouse=spec["lighthouse"], timeout=timedelta(seconds=30),
                         quorum_timeout=timedelta(seconds=120))
        strategy = PeriodicAveragingStrategy(fault_tolerance=option, **kwargs)
        windows = record_windows(strategy, kill)
    record = Record(kill.get("step") if kill else None, spec.get("step_sleep", 0.0))
    callbacks: list[Callback] = [record]
    if spec.get("checkpoint"):  # every group its own file at every epoch's end
        callbacks.append(ModelCheckpoint(dirpath=out / f"ckpt_group{group}", every_n_epochs=1, save_top_k=-1,
                                         filename="{epoch}-{step}"))
    ckpt_path = None
    if spec.get("resume_from"):
        ckpt_path = str(next((Path(spec["out"]) / spec["resume_from"] / f"ckpt_group{group}").glob("epoch=0-*.ckpt")))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                        num_nodes=spec["groups"] if plain else 1,
                        max_steps=spec["max_steps"], callbacks=callbacks, logger=False,
                        enable_checkpointing=bool(spec.get("checkpoint")),
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=spec.get("val_batches", 0), deterministic=True)
    started = time.monotonic()
    trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    suffix = "_restart" if restart else ""
    torch.save({"windows": windows, "after_step": record.after_step, "final": strategy.model_vector.get(),
                "start": record.start, "start_anchor": record.anchor,
                "global_step": trainer.global_step, "fit_s": time.monotonic() - started, "comm": strategy.comm.stats,
                "metrics": strategy.protocol_metrics()},
               out / f"group{group}_rank{os.environ['LOCAL_RANK']}{suffix}.pt")


if __name__ == "__main__":
    main()
