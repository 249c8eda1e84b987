"""The namespace network of ``benchmarks/common/netns.py`` really caps bandwidth and leaves no namespace behind."""

import pytest

from benchmarks.common import netns

LINK_MBIT = 20.0
NBYTES = 2_500_000  # 1 s at 20 Mbit/s


def test_link_cap_holds_and_namespaces_are_deleted():
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.fail(f"this test needs {netns.REQUIREMENTS} (root in a Linux container; the CI machine has them): "
                    f"{reason}")
    with netns.Network(nodes=2, link_mbit=LINK_MBIT) as network:
        ours = {network.hub, *network.namespaces}
        assert ours <= set(netns.list_namespaces())
        [flow] = netns.measure_tcp(network, [(0, 1)], NBYTES)
    # TCP payload is about 95% of the capped Ethernet frames; loopback speed would be ~100x the cap.
    assert 0.7 <= flow.mbit_s / LINK_MBIT <= 1.15, f"{flow.mbit_s:.2f} Mbit/s through a {LINK_MBIT} Mbit/s link"
    assert not ours & set(netns.list_namespaces())
