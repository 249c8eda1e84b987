"""Where a blocking synchronization's time goes on this machine: the bucket copies against the all-reduce.

On ``TransformerLM.preset("100m")`` (2 Gloo ranks, one thread each), medians of ``--repeats`` timings, each after a
barrier: an ``all_reduce`` of the model vector's float32 bytes; the copies alone (every bucket of ``AVERAGE_BUCKET``
entries read out of the model's tensors and written back, no exchange); and the pipelined in-place average the
strategies run (:func:`lightning_dist.strategies._bucketed_average.average_in_place`). Writes
``<out>/large_model_copy_cost.json`` and prints the three times and the average's ratio to the all-reduce.

Usage::

    python -m benchmarks.large_model.copy_cost
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

WORKER = Path(__file__).resolve()


def worker(spec_path: Path) -> None:
    """One rank under torchrun: the timings, written by rank 0 to the spec's ``out``."""
    import torch
    import torch.distributed as dist

    from lightning_dist.algorithms.averaging import AVERAGE_BUCKET
    from lightning_dist.comm import Communicator
    from lightning_dist.model_vector import ModelVector
    from lightning_dist.models import TransformerLM
    from lightning_dist.strategies._bucketed_average import average_in_place

    spec = json.loads(spec_path.read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())
    vector = ModelVector(TransformerLM.preset(spec["preset"]))
    comm = Communicator(dist.new_group())
    flat = torch.empty(vector.numel)
    bucket = torch.empty(min(AVERAGE_BUCKET, vector.numel))

    def copies() -> None:
        for start in range(0, vector.numel, AVERAGE_BUCKET):
            stop = min(start + AVERAGE_BUCKET, vector.numel)
            vector.set_range(start, vector.get_range(start, stop, out=bucket[:stop - start]))

    def refuse(_: Any) -> None:
        raise FloatingPointError("a replica turned non-finite")

    timed = {"all_reduce": lambda: dist.all_reduce(flat, group=comm.group), "copies": copies,
             "average_in_place": lambda: average_in_place(vector, comm, "protocol", refuse)}
    seconds: dict[str, list[float]] = {name: [] for name in timed}
    dist.all_reduce(flat, group=comm.group)  # untimed: the group's connections are made
    for _ in range(spec["repeats"]):
        for name, run in timed.items():
            dist.barrier()
            started = time.perf_counter()
            run()
            dist.barrier()
            seconds[name].append(time.perf_counter() - started)
    if dist.get_rank() == 0:
        medians = {name: statistics.median(values) for name, values in seconds.items()}
        Path(spec["out"]).write_text(json.dumps({
            "preset": spec["preset"], "parameters": vector.num_parameters, "tensors": len(vector.parameters),
            "bucket": AVERAGE_BUCKET, "ranks": dist.get_world_size(), "seconds": seconds, "median_s": medians,
            "average_over_all_reduce": medians["average_in_place"] / medians["all_reduce"]}, indent=1))
    dist.destroy_process_group()


def main() -> None:
    from benchmarks.common.launch import launch
    from benchmarks.common.paths import RESULTS
    from benchmarks.common.report import command_line, write_json

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="100m")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = launch({"name": "large_model_copy_cost", "preset": args.preset, "repeats": args.repeats}, 2,
                    args.out / "runs" / "large_model", timeout=600, worker=WORKER)
    result.update(command=command_line(), date=time.strftime("%Y-%m-%d"))
    path = args.out / "large_model_copy_cost.json"
    write_json(path, result)
    medians = result["median_s"]
    print(f"all_reduce {medians['all_reduce']:.3f} s, copies alone {medians['copies']:.3f} s, average_in_place "
          f"{medians['average_in_place']:.3f} s: {result['average_over_all_reduce']:.2f}x the all-reduce; wrote {path}")


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:  # a rank under torchrun
        worker(Path(sys.argv[1]))
    else:
        main()
