"""What every method of the LM benchmark records and how its copies are scored, whichever loop trained it: the
Lightning strategies' (``benchmarks/language_model/worker.py``) and torchft's DiLoCo
(``benchmarks/language_model/torchft_diloco.py``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.utils import vector_to_parameters

from lightning_dist.data import StdlibTextDataModule
from lightning_dist.models import TransformerLM

from benchmarks.segmented_gossip.worker import per_rank_step_s

INTERFACE_STATS = Path("/sys/class/net/eth0/statistics")


def wire_bytes() -> tuple[int, int]:
    """Bytes this namespace's interface has sent and received so far (0, 0 outside a namespace). Only a node's local
    rank 0 reads them, so that a sum over ranks counts each namespace (node) once."""
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return (0, 0)
    try:
        return (int((INTERFACE_STATS / "tx_bytes").read_text()), int((INTERFACE_STATS / "rx_bytes").read_text()))
    except OSError:
        return (0, 0)


@torch.no_grad()
def evaluate(model: TransformerLM, vectors: torch.Tensor, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    """Loss in nats per character of each model in ``vectors`` on ``batches``."""
    model.eval()
    losses = []
    for vector in vectors:
        vector_to_parameters(vector, model.parameters())
        total, count = 0.0, 0
        for x, y in batches:
            logits = model(x)
            total += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"))
            count += y.numel()
        losses.append(total / count)
    return losses


def eval_batches(datamodule: StdlibTextDataModule, sequences: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``sequences`` validation windows (the same for every run), in batches of 32."""
    batches, taken = [], 0
    for x, y in datamodule.val_dataloader():
        keep = min(len(x), sequences - taken)
        batches.extend(zip(x[:keep].split(32), y[:keep].split(32)))
        taken += keep
        if taken >= sequences:
            break
    return batches


def collect(spec: dict[str, Any], run: dict[str, Any], model: TransformerLM, datamodule: StdlibTextDataModule,
            vectors: list[torch.Tensor], local: dict[str, Any], steps_taken: int,
            server_copy: bool = False) -> dict[str, Any] | None:
    """What every method records, after its fit: this rank's copies (``vectors``, emptied) to a file, every rank's
    ``local`` record (``start``, ``fit_end``, ``steps``, ``times``, ``wire``, ``wire_total``, ``step_ends``,
    ``rounds``, ``distances``) gathered, and on rank 0 the copies scored (the replicas' mean, or rank 0's copy alone
    where ``server_copy``: DownpourSGD's global model) into the run's result; None on the other ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    work_dir = Path(spec["work_dir"])
    torch.save(torch.stack(vectors), work_dir / f"{run['name']}.rank{rank}.snapshots.pt")
    vectors.clear()
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, local)  # also a barrier: every rank's file is written
    if rank != 0:
        return None
    steps = gathered[0]["steps"]
    if not server_copy and any(part["steps"] != steps for part in gathered):
        raise RuntimeError(f"{run['name']}: ranks took copies at different steps")
    paths = [work_dir / f"{run['name']}.rank{other}.snapshots.pt" for other in range(world)]
    if server_copy:
        averaged = torch.load(paths[0])  # the server's global model
    else:
        averaged = sum(torch.load(path) for path in paths) / world
    for path in paths:
        path.unlink()
    losses = evaluate(model, averaged, eval_batches(datamodule, int(spec["eval_sequences"])))
    start = min(part["start"] for part in gathered)
    curve = []
    for index, step in enumerate(steps):
        seconds = max(part["times"][index] for part in gathered) - start
        sent = sum(part["wire"][index][0] for part in gathered)
        curve.append({"step": step, "seconds": seconds, "val_loss": losses[index], "wire_bytes": sent})
    budget = float(spec["budget_s"])
    result = {
        "name": run["name"], "kind": run["kind"], "strategy": run.get("strategy"), "outer": run.get("outer"),
        "world_size": world, "num_parameters": sum(p.numel() for p in model.parameters()),
        "model_bytes": averaged[0].nbytes, "budget_s": budget, "steps": steps_taken,
        "fit_s": max(part["fit_end"] for part in gathered) - start,
        "step_s_per_rank": per_rank_step_s(gathered),
        "round_steps": [step for step, _ in gathered[0]["rounds"]],
        "round_s_per_rank": [[duration for _, duration in part["rounds"]] for part in gathered],
        "distances_per_rank": [part["distances"] for part in gathered],
        "wire_sent_bytes": sum(part["wire_total"][0] for part in gathered),
        "wire_received_bytes": sum(part["wire_total"][1] for part in gathered),
        "curve": curve, "final_val_loss": curve[-1]["val_loss"],
    }
    if not math.isfinite(result["final_val_loss"]):
        print(f"warning: {run['name']} ended with a non-finite validation loss", flush=True)
    return result
