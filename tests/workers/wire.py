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
# Ethernet (14, loopback uses it too) + IPv4 (20) + TCP with the timestamp option (32) per packet.
# How TCP segments a transfer, and how many pure ACKs it sends, depends on how busy the machine
# is (at worst 10% of the bytes were headers); the payload that crossed does not.
HEADER_BYTES = 66
# A loaded machine can drop loopback packets (the per-CPU backlog overflows) and TCP resends
# them; each operation is measured in several windows and the test takes the cleanest.
WINDOWS = 3


def loopback_payload_bytes() -> int:
    """Bytes transmitted on the loopback device, less each packet's headers."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, fields = line.partition(":")
        if name.strip() == "lo":
            values = fields.split()
            return int(values[8]) - HEADER_BYTES * int(values[9])  # transmitted bytes, packets
    raise RuntimeError("no loopback device")


def measure(comm: Communicator, operation: str, tensor: torch.Tensor) -> dict[str, int]:
    """Bytes counted (summed over ranks) and payload bytes on the wire for three calls of ``operation``."""
    rank, world_size = comm.rank, comm.world_size
    before_counted = comm.stats.bytes_sent
    dist.barrier()
    start = loopback_payload_bytes()
    dist.barrier()
    for _ in range(3):
        if operation == "all_reduce":
            comm.all_reduce_sum_(tensor.clone(), "protocol")
        elif operation == "all_gather":
            comm.all_gather(tensor, "protocol")
        elif operation == "broadcast":
            comm.broadcast_(tensor.clone(), 0, "protocol")
        elif operation == "gather":
            gathered = comm.start_gather(tensor, 0, "protocol").wait()
            if rank == 0:
                assert gathered.shape == (world_size, *tensor.shape) and gathered[:, 0].tolist() == list(range(world_size))
        elif rank == 0:
            comm.send(tensor, list(range(1, world_size)), "protocol")
        else:
            comm.receive(tensor, [0])
    dist.barrier()
    end = loopback_payload_bytes()
    counted = torch.tensor([comm.stats.bytes_sent - before_counted], dtype=torch.int64)
    dist.all_reduce(counted)
    return {"wire": end - start, "counted": int(counted)}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    comm = Communicator(dist.new_group(backend="gloo"))
    tensor = torch.full((ELEMENTS,), float(comm.rank))
    measured: dict[str, list[dict[str, int]]] = {}
    for operation in ("all_reduce", "all_gather", "broadcast", "gather", "send"):
        measured[operation] = [measure(comm, operation, tensor) for _ in range(WINDOWS)]
    if comm.rank == 0:
        Path(spec["out"], "wire.json").write_text(json.dumps(measured))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
