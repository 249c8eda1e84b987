"""What the Lighthouse's status page says of a run (torchft 0.2.0's Lighthouse in this process): its groups that
heartbeat now, and the step its groups marked it ended at."""

import time
from datetime import timedelta

from lightning_dist.comm.quorum import mark_ended, run_at_lighthouse, run_replica_prefix

TAG, OTHER_RUN = 0x1234567890, 0x0987654321


def test_the_status_page_gives_the_runs_live_groups_and_its_end_mark():
    from torchft.coordination import LighthouseClient, LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=500)
    try:
        url = lighthouse.address()
        client = LighthouseClient(url, connect_timeout=timedelta(seconds=5))
        assert run_at_lighthouse(url, TAG, 5.0).ended_at_step is None  # nothing heard yet
        client.heartbeat(f"{run_replica_prefix(TAG)}3:0e2f-uuid")  # torchft adds a UUID per process
        time.sleep(0.7)  # past the Lighthouse's heartbeat timeout: old
        for replica in (f"{run_replica_prefix(TAG)}0:1a2b-uuid", f"{run_replica_prefix(TAG)}12:3c4d-uuid",
                        f"{run_replica_prefix(OTHER_RUN)}1:5e6f-uuid"):
            client.heartbeat(replica)
        mark_ended(url, TAG, 40, timedelta(seconds=5))
        mark_ended(url, TAG, 48, timedelta(seconds=5))
        mark_ended(url, OTHER_RUN, 96, timedelta(seconds=5))
        run = run_at_lighthouse(url, TAG, 5.0)
        assert run.live_groups == {0, 12} and run.ended_at_step == 48
        assert run_at_lighthouse(url, OTHER_RUN, 5.0).live_groups == {1}
    finally:
        lighthouse.shutdown()


def test_an_unreadable_status_page_is_none():
    assert run_at_lighthouse("http://127.0.0.1:9", TAG, 1.0) is None
