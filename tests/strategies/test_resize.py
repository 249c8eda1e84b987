"""Which saved rank each rank takes after when a checkpoint is resumed at another world size (one process)."""

from lightning_dist.comm import CommStats
from lightning_dist.strategies._resize import nearest_saved_rank, resized_comm_stats


def test_resized_comm_stats_keep_the_total():
    """Counters at another world size: own ones kept, new ranks at zero, the dropped ranks' added to rank 0's."""
    saved = []
    for rank, nbytes in enumerate((100, 20, 3)):
        stats = CommStats(syncs=7)
        stats.record("protocol", nbytes, rank + 1)
        saved.append({"comm": stats.state_dict()})
    shrunk = [resized_comm_stats(saved, rank, 2) for rank in range(2)]
    assert [s.protocol_bytes for s in shrunk] == [103, 20] and [s.messages for s in shrunk] == [4, 2]
    grown = [resized_comm_stats(saved, rank, 4) for rank in range(4)]
    assert [s.protocol_bytes for s in grown] == [100, 20, 3, 0] and all(s.syncs == 7 for s in grown)
    assert [nearest_saved_rank(rank, 3) for rank in range(5)] == [0, 1, 2, 0, 1]
