"""Worker of ``benchmarks/gpu_smoke/run.py``: one cell (a strategy or callback, a precision, a process layout) under torchrun.

``spec.json`` holds ``name``, ``out`` (rank 0's JSON result), ``subject`` (a strategy name of
``gpu_smoke.SUBJECTS``, or ``datagossip`` / ``cdgrab``), ``precision`` (a Lightning precision),
``layout`` (``cpu``: every rank on the host; ``gloo_shared_gpu``: every rank on GPU 0, Gloo;
``nccl``: one GPU per rank) and ``steps`` (training batches per epoch; two epochs).

Every rank runs the fit, validation after each epoch (the strategies' consensus), then
``trainer.save_checkpoint`` (every rank's replica gathered to rank 0). Each rank writes
``<out>.rank<r>.json`` with its outcome (error with traceback tail, fit seconds, global step, the
parameters' dtype and device, whether they are finite); rank 0 also writes ``<out>`` with the
checkpoint's contents. A rank that fails writes its file before the process group gives up on it.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import DDPStrategy

import lightning_dist
from lightning_dist import CDGraB, DataGossip
from lightning_dist.algorithms.outer import diloco_outer_optimizer
from lightning_dist.data.datamodules import MNIST1DDataModule
from lightning_dist.models import MLPClassifier


class SharedCUDAAccelerator(CUDAAccelerator):
    """Every process on GPU 0: ``devices=n`` means n processes sharing one GPU (Lightning would ask for n GPUs).

    NCCL refuses two ranks on one GPU, so this layout runs Gloo: the strategies' own groups then
    stage CUDA tensors through the host (``lightning_dist.comm``), which is what it checks.
    """

    @staticmethod
    def parse_devices(devices: Any) -> list[int]:
        return [0] * int(devices)

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        return [torch.device("cuda", 0) for _ in devices]


def make_strategy(subject: str, layout: str, world_size: int) -> Any:
    """The strategy of a cell, with periods short enough for its protocol to run within a few steps."""
    backend = {"process_group_backend": "gloo"} if layout != "nccl" else {}
    if subject in ("datagossip", "cdgrab"):
        return DDPStrategy(**backend)
    kwargs: dict[str, Any] = {
        "dynamic_avg": {"divergence_threshold": 1e-9, "check_every": 1},  # violations, balancing, full syncs
        "periodic_avg": {"period": 1},
        # exchanges in flight on a CUDA side stream, merged a step later; outer state and int8 residuals per fragment
        "streaming_diloco": {"period": 2, "fragments": 2, "fragment_sync_delay": 0, "fragment_update_alpha": 0.5,
                             "outer_optimizer": diloco_outer_optimizer, "compression": "int8"},
        "streaming_cpu_state": {"period": 4, "fragments": 2, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5,
                                "outer_optimizer": diloco_outer_optimizer, "state_device": "cpu", "compression": "int8"},
        # blocking DiLoCo with int8 a bucket at a time, the outer state and each bucket's int8 state in host memory
        "blocking_cpu_state": {"period": 2, "outer_optimizer": diloco_outer_optimizer, "state_device": "cpu",
                               "compression": "int8"},
        "fedavg": {"period": 1, "client_fraction": 0.5},
        "downpour_sgd": {"push_every": 1},
        "segmented_gossip": {"segments": 2, "replicas": min(2, world_size - 1), "period": 1},
    }[subject]
    cls = {"dynamic_avg": "DynamicAveragingStrategy", "periodic_avg": "PeriodicAveragingStrategy",
           "streaming_diloco": "PeriodicAveragingStrategy", "streaming_cpu_state": "PeriodicAveragingStrategy",
           "blocking_cpu_state": "PeriodicAveragingStrategy",
           "fedavg": "PeriodicAveragingStrategy", "downpour_sgd": "DownpourSGDStrategy",
           "segmented_gossip": "SegmentedGossipStrategy"}[subject]
    return getattr(lightning_dist, cls)(**kwargs, **backend)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    subject, layout, steps = spec["subject"], spec["layout"], int(spec["steps"])
    record: dict[str, Any] = {"rank": rank, "error": None}
    L.seed_everything(0, verbose=False)
    try:
        accelerator: Any = {"cpu": "cpu", "gloo_shared_gpu": SharedCUDAAccelerator(), "nccl": "gpu"}[layout]
        callbacks: list[Any] = []
        trainer_kwargs: dict[str, Any] = {"max_epochs": 2, "limit_train_batches": steps, "limit_val_batches": 2}
        if subject == "cdgrab":
            # CD-GraB reorders whole epochs: a small data set gives `steps` batches per rank per epoch.
            datamodule = MNIST1DDataModule(num_samples=max(100, int(8 * world_size * steps / 0.8) + 10), batch_size=8,
                                           example_order="balanced")
            callbacks.append(CDGraB())
            trainer_kwargs.pop("limit_train_batches")
        else:
            datamodule = MNIST1DDataModule(num_samples=400, batch_size=16)
            if subject == "datagossip":
                callbacks.append(DataGossip(records_per_exchange=4, weave_every=1))
        model = MLPClassifier(num_features=40, num_classes=10, hidden_size=32)
        trainer = L.Trainer(
            accelerator=accelerator, devices=int(os.environ["LOCAL_WORLD_SIZE"]),
            strategy=make_strategy(subject, layout, world_size), precision=spec["precision"], callbacks=callbacks,
            logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
            num_sanity_val_steps=0, **trainer_kwargs,
        )
        start = time.perf_counter()
        trainer.fit(model, datamodule=datamodule)
        record["fit_s"] = time.perf_counter() - start
        checkpoint = out.with_suffix(".ckpt")
        trainer.save_checkpoint(checkpoint)  # a collective for the local-update strategies: every replica to rank 0
        parameters = list(model.parameters())
        record.update(
            global_step=trainer.global_step,
            dtype=str(parameters[0].dtype),
            device=str(parameters[0].device),
            finite=all(bool(torch.isfinite(p).all()) for p in parameters),
        )
        if rank == 0:
            state = torch.load(checkpoint, map_location="cpu", weights_only=False)
            replicas = state.get("lightning_dist", {}).get("replicas")
            record["checkpoint"] = {"replicas": None if replicas is None else len(replicas),
                                    "state_dict_dtype": str(next(iter(state["state_dict"].values())).dtype)}
            checkpoint.unlink()
    except BaseException as exc:  # reported per rank; the driver marks the cell failed
        record["error"] = f"{type(exc).__name__}: {exc}"
        record["traceback"] = traceback.format_exc()[-3000:]
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(record))
    if rank == 0:
        out.write_text(json.dumps({"name": spec["name"], **record}))
    sys.stdout.flush()
    # Groups left behind by a failed cell must not hold the process at exit.
    os._exit(0 if record["error"] is None else 1)


if __name__ == "__main__":
    main()
