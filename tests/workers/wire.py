"""Worker: compare the Communicator's byte counts with the bytes that crossed the loopback device.

Runs inside a private network namespace (``unshare -n``), so the loopback counters of
/proc/net/dev see only this job's traffic.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_dist.comm import Communicator

ELEMENTS = 1 << 20  # 4 MiB of float32: framing and barriers are negligible against it


def loopback_bytes() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            return int(fields.split()[8])  # transmitted bytes
    raise RuntimeError("no loopback device")


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    comm = Communicator(dist.new_group(backend="gloo"))
    rank, world_size = comm.rank, comm.world_size
    tensor = torch.full((ELEMENTS,), float(rank))
    measured = {}
    for operation in ("all_reduce", "all_gather", "broadcast", "send"):
        before_counted = comm.stats.bytes_sent
        dist.barrier()
        start = loopback_bytes()
        dist.barrier()
        for _ in range(3):
            if operation == "all_reduce":
                comm.all_reduce_sum_(tensor.clone(), "protocol")
            elif operation == "all_gather":
                comm.all_gather(tensor, "protocol")
            elif operation == "broadcast":
                comm.broadcast_(tensor.clone(), 0, "protocol")
            elif rank == 0:
                comm.send(tensor, list(range(1, world_size)), "protocol")
            else:
                comm.receive(tensor, [0])
        dist.barrier()
        end = loopback_bytes()
        counted = torch.tensor([comm.stats.bytes_sent - before_counted], dtype=torch.int64)
        dist.all_reduce(counted)
        measured[operation] = {"wire": end - start, "counted": int(counted)}
    if rank == 0:
        Path(spec["out"], "wire.json").write_text(json.dumps(measured))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
