"""Per-rank counters of a checkpoint resumed at another world size (lightning_dist/counters.py), one process."""

from lightning_dist.counters import counters_kept_in_total


def test_counters_are_kept_in_total_whichever_way_the_world_changes():
    """Three ranks wrote (bytes, seconds); two keep their own and rank 0 takes the third's; four add a zero rank."""
    saved = [[100, 1.5], [20, 0.25], [3, 2.0]]
    shrunk = [counters_kept_in_total(saved, rank, 2) for rank in range(2)]
    assert shrunk == [[103, 3.5], [20, 0.25]]
    grown = [counters_kept_in_total(saved, rank, 4) for rank in range(4)]
    assert grown == [[100, 1.5], [20, 0.25], [3, 2.0], [0, 0.0]]
    assert type(grown[3][0]) is int and type(grown[3][1]) is float
    for counters in (shrunk, grown):
        assert [sum(column) for column in zip(*counters)] == [123, 3.75]
