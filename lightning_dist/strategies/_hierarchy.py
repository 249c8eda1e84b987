"""One learner per node (``hierarchy="node"``): DDP inside a node, the protocol between nodes, in slices.

Under a hierarchy the ranks of a node wrap the model in PyTorch's ``DistributedDataParallel`` over
their node group (:mod:`lightning_dist.comm.nodes`): gradients are all-reduced every step with DDP's
own buckets and overlap with backward (NCCL on GPU, Gloo on CPU), so the node's replicas stay
identical and the node is one learner. A cross-node average then needs no reduce-scatter inside the
node first (every rank already holds the node's model): local rank ``j`` all-reduces chunk ``j`` of
it with local rank ``j`` of every other node (its slice group), and the node all-gathers the chunks
of the mean. Each rank's link carries ``1/L`` of the model (``L`` ranks per node), all ``L`` links at
once: ``2 (N - 1) / N`` of ``1/L`` of the model sent per rank and exchange between ``N`` nodes, ``2 (N - 1) /
N`` models out of each node. A flat ring all-reduce over the ``N L`` ranks, placed node by node (Gloo's ring
runs ``rank -> rank - 1``), has one edge leaving each node: ``2 (N L - 1) / (N L)`` models out of each node,
in ``2 (N L - 1)`` steps, so at most twice the bytes (``N = 2``), about the same for many nodes, and ``L``
times the latencies. What one learner per node changes for an all-reduce is the learners: ``N`` of them
instead of ``N L``, each training on its node's ``L`` batches. Protocols that send whole models per learner
(gossip's pulls, DownpourSGD's pushes, dynamic averaging's balancing of a few learners) move ``L`` times less
through a node's interface. A leader per node (one rank exchanging the whole model for its node while the
others wait) would move the same bytes through one rank's link, ``L`` times slower where each GPU has its own
network path (multi-rail nodes), and gains nothing where they share one NIC.

BatchNorm's running statistics are computed by each rank on its own batch, so DDP would let a node's ranks
hold different buffers between its broadcasts of local rank 0's before each forward, and each rank would
send its own buffers' chunk between nodes (a node's model mixed from its ranks' statistics). Here local rank
0's floating-point buffers are broadcast to its node mates after every optimizer step instead (DDP's
``broadcast_buffers`` off, the same bytes): a node's ranks hold one model, buffers included, after every
step, and that model is local rank 0's, as the simulator's node is.

Bytes are counted in the strategy's counters and by level (:data:`lightning_dist.comm.stats.LEVELS`): the
slice groups' ``inter_node``, the node groups' ``intra_node``, DDP's gradient all-reduce included (a comm hook that
counts each bucket and runs torch's default all-reduce, registered on every device: Lightning
registers DDP hooks on CUDA only).
"""

from __future__ import annotations

from datetime import timedelta

import torch
from lightning.pytorch import LightningModule
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from lightning_dist.algorithms import averaging
from lightning_dist.algorithms.averaging import accumulation_dtype
from lightning_dist.algorithms.subset_average import chunk_bounds
from lightning_dist.comm import Communicator
from lightning_dist.comm.nodes import NodeLayout, node_groups
from lightning_dist.model_vector import ModelVector

def _counted_allreduce(comm: Communicator, bucket):  # type: ignore[no-untyped-def]
    """DDP's default gradient all-reduce over the node group (a ``GradBucket`` in, a ``Future[Tensor]`` out), its
    bytes counted as a ring's. Unannotated: DDP rejects the string annotations of ``from __future__ import
    annotations``."""
    comm.record_all_reduce(bucket.buffer(), "gradients")
    return default_hooks.allreduce_hook(comm.group, bucket)


class NodeHierarchy:
    """This rank's place in the hierarchy: its node's group and its slice group, as counted communicators."""

    def __init__(self, layout: NodeLayout, node: Communicator, inter_node: Communicator) -> None:
        self.layout = layout
        self.node = node
        self.inter_node = inter_node

    @classmethod
    def create(cls, comm: Communicator, node_rank: int, ranks_per_node: int, num_nodes: int, backend: str | None,
               timeout: timedelta | None, device: torch.device) -> NodeHierarchy:
        """Find the nodes from every rank's ``node_rank`` (an all-gather on ``comm``, all ranks) and create the groups.

        ``ranks_per_node`` and ``num_nodes`` are what the Trainer was given (``devices``, ``num_nodes``); a
        layout that disagrees is refused.
        """
        node_of_rank = comm.all_gather(torch.tensor([node_rank], dtype=torch.int64, device=device), "setup")
        layout = NodeLayout.from_node_ranks(node_of_rank.view(-1).tolist())
        if (layout.num_nodes, layout.ranks_per_node) != (num_nodes, ranks_per_node):
            raise ValueError(
                f"hierarchy='node' found {layout.num_nodes} node(s) of {layout.ranks_per_node} rank(s) from the cluster "
                f"environment's node ranks, but the Trainer has num_nodes={num_nodes}, devices={ranks_per_node}"
            )
        node_group, slice_group = node_groups(layout, backend, timeout)
        return cls(layout, Communicator(node_group, "intra_node", counted_by=comm),
                   Communicator(slice_group, "inter_node", counted_by=comm))

    def wrap(self, module: LightningModule, device_ids: list[int] | None) -> DistributedDataParallel:
        """``module`` in DDP over this node's ranks, with the counting all-reduce hook; buffers are shared after each
        step (:meth:`share_buffers`), not before each forward."""
        ddp = DistributedDataParallel(module, device_ids=device_ids, process_group=self.node.group,
                                      broadcast_buffers=False)
        ddp.register_comm_hook(self.node, _counted_allreduce)
        return ddp

    @torch.no_grad()
    def share_buffers(self, buffers: list[Tensor]) -> None:
        """Local rank 0's floating-point ``buffers`` on every rank of the node (one broadcast, counted as DDP's)."""
        if not buffers or self.node.world_size == 1:
            return
        flat = torch.cat([buffer.reshape(-1) for buffer in buffers])
        self.node.broadcast_(flat, src=0, purpose="gradients")
        for buffer, chunk in zip(buffers, flat.split([buffer.numel() for buffer in buffers])):
            buffer.copy_(chunk.view_as(buffer))

    def bounds(self, numel: int) -> list[tuple[int, int]]:
        """The ``L`` nearly equal chunks of a vector of ``numel`` elements, local rank ``j`` carrying chunk ``j``."""
        return list(chunk_bounds(numel, list(range(self.node.world_size))).values())

    def own_bounds(self, numel: int) -> tuple[int, int]:
        """``[start, stop)`` of the chunk this rank carries."""
        return self.bounds(numel)[self.node.rank]

    def part(self, vector: Tensor, numel: int) -> Tensor:
        """This rank's chunk of a model-sized vector of ``numel`` elements; ``vector`` may be shorter (the parameters
        only, as a reference model is), and its part then ends where it does."""
        start, stop = self.own_bounds(numel)
        return vector[start:stop]

    def whole(self, part: Tensor, numel: int, purpose: str) -> Tensor:
        """The vector whose chunks the node's ranks hold (``part`` is this rank's): an all-gather inside the node
        (chunks padded to the largest, at most one element more)."""
        return torch.cat([values for _, values in self.gather_pieces(part, 0, numel, numel, purpose)])

    def gather_pieces(self, piece: Tensor, offset: int, length: int, numel: int,
                      purpose: str) -> list[tuple[int, Tensor]]:
        """Every node rank's ``piece`` of a vector of ``numel`` elements: entries ``[offset, offset + length)`` of its
        own chunk, cut short where the chunk ends (``piece`` is this rank's); an all-gather inside the node, padded
        to the longest piece. Returns ``(position in the vector, values)`` per rank, so a vector can be rebuilt a
        range at a time without the node's whole model (:meth:`whole`)."""
        bounds = self.bounds(numel)
        lengths = [max(0, min(offset + length, end - begin) - offset) for begin, end in bounds]
        width = max(lengths)
        gathered = self.node.all_gather(torch.nn.functional.pad(piece, (0, width - piece.numel())), purpose)
        return [(begin + offset, gathered[index, :size])
                for index, ((begin, _), size) in enumerate(zip(bounds, lengths)) if size]

    def share_parts(self, vector: ModelVector, purpose: str) -> None:
        """Every rank of the node has written its chunk of ``vector``'s model: each rank's chunk to the others, a
        bucket (``AVERAGE_BUCKET`` entries of a chunk) at a time, never the node's whole model at once."""
        numel, bucket = vector.numel, averaging.AVERAGE_BUCKET
        begin, stop = self.own_bounds(numel)
        widest = max(end - start for start, end in self.bounds(numel))  # the same ranges on every rank of the node
        for offset in range(0, widest, bucket):
            piece = vector.get_range(min(begin + offset, stop), min(begin + offset + bucket, stop))
            for position, values in self.gather_pieces(piece, offset, bucket, numel, purpose):
                vector.set_range(position, values)

    def node_sum(self, value: float, device: torch.device, purpose: str) -> float:
        """``value`` summed over this node's ranks (each holds its part's share of a node-wide quantity)."""
        total = self.node.all_reduce_sum_(torch.tensor([value], dtype=torch.float64, device=device), purpose)
        return float(total[0])

    def mean(self, local: Tensor, purpose: str) -> Tensor:
        """The mean of the nodes' models (each node's ranks hold the same ``local``), the same on every rank.

        Chunk ``j`` is summed between nodes by local rank ``j`` in :func:`accumulation_dtype` and rounded to the
        model's dtype once; the node all-gathers the chunks of the mean.
        """
        total = self.part(local, local.numel()).to(accumulation_dtype(local.dtype), copy=True)
        self.inter_node.all_reduce_sum_(total, purpose)
        return self.whole((total / self.inter_node.world_size).to(local.dtype), local.numel(), purpose)

    def close(self) -> None:
        self.node.close()
        self.inter_node.close()
