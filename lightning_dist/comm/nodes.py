"""Which ranks share a node, and the process groups of a two-level hierarchy (``hierarchy="node"``).

Inside a node GPUs talk over NVLink or PCIe; between nodes the link is the slow one the papers'
protocols are for. A hierarchy makes the ranks of one node a DDP group (gradients all-reduced every
step, so the node's replicas stay identical: one learner per node) and runs the protocol between
nodes. Two kinds of groups serve it:

- the **node group**: the ranks of one node (DDP's all-reduce, and the all-gather that reassembles
  the model after a cross-node exchange);
- the **slice group**: the ranks with the same local rank, one per node. Local rank ``j`` carries
  chunk ``j`` of the model between nodes, so each of a node's ``L`` ranks moves ``1/L`` of the
  traffic over its own link, and all of them in parallel.

Membership comes from the cluster environment Lightning detected (torchrun's ``GROUP_RANK``,
SLURM's ``SLURM_NODEID``, ``NODE_RANK``): every rank's node index is all-gathered once, so nothing
assumes that global ranks are numbered node by node (block or cyclic numberings both work). Every node
must hold the same number of ranks, and every local rank must see the nodes in the same order
(:meth:`NodeLayout.from_node_ranks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


@dataclass(frozen=True)
class NodeLayout:
    """``nodes[n]``: the global ranks of node ``n`` in local-rank order (every node the same size)."""

    nodes: tuple[tuple[int, ...], ...]

    @classmethod
    def from_node_ranks(cls, node_of_rank: Sequence[int]) -> NodeLayout:
        """The layout from every global rank's node index (``node_of_rank[r]``), checked to be even.

        Nodes are numbered by their lowest global rank, not by the cluster's node index: torch's ``new_group``
        sorts a group's ranks, so in slice group ``j`` a node's group rank is the place of its ``j``-th rank in
        that order, and the package uses it as the node's learner index (FedAvg's participants, balancing sets,
        the server shard). That index is the same in every slice only if every local rank orders the nodes alike;
        a numbering where it does not (node A holding ranks 0 and 3, node B ranks 1 and 2) is refused by name.
        """
        indices = sorted(set(node_of_rank))
        ranks_of = {index: tuple(rank for rank, node in enumerate(node_of_rank) if node == index) for index in indices}
        sizes = {index: len(ranks) for index, ranks in ranks_of.items()}
        if len(set(sizes.values())) > 1:
            listing = ", ".join(f"node {index}: {size}" for index, size in sizes.items())
            raise ValueError(
                f"hierarchy='node' needs the same number of ranks on every node (each node is one learner whose "
                f"ranks carry equal chunks of the model); got {listing}"
            )
        nodes = tuple(sorted(ranks_of.values()))
        for local in range(len(nodes[0])):
            if [ranks[local] for ranks in nodes] != sorted(ranks[local] for ranks in nodes):
                listing = "; ".join(f"node {index}: ranks {list(ranks)}" for index, ranks in ranks_of.items())
                raise ValueError(
                    f"hierarchy='node' needs global ranks numbered in the same node order for every local rank (local "
                    f"rank {local}'s slice group would order the nodes unlike local rank 0's, and a node would be "
                    f"another learner in each slice); got {listing}: number ranks node by node (torchrun, SLURM's "
                    "block distribution) or cyclically"
                )
        return cls(nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def ranks_per_node(self) -> int:
        return len(self.nodes[0])

    def node_of(self, rank: int) -> int:
        return next(index for index, ranks in enumerate(self.nodes) if rank in ranks)

    def local_rank(self, rank: int) -> int:
        return self.nodes[self.node_of(rank)].index(rank)

    def slices(self) -> list[list[int]]:
        """``slices()[j]``: local rank ``j`` of every node, in node order."""
        return [[ranks[j] for ranks in self.nodes] for j in range(self.ranks_per_node)]


def node_groups(layout: NodeLayout, backend: str | None, timeout: timedelta | None
                ) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's node group and slice group (a collective: every rank creates every group, in the same order)."""
    node_group, _ = dist.new_subgroups_by_enumeration([list(ranks) for ranks in layout.nodes], timeout=timeout,
                                                      backend=backend)
    slice_group, _ = dist.new_subgroups_by_enumeration(layout.slices(), timeout=timeout, backend=backend)
    return node_group, slice_group
