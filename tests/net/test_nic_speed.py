"""A worker's NIC speed, read from the kernel at boot (`nitsum.transfer.nic`), in network namespaces this test
makes: the veth that holds the namespace's address reports 10000 Mb/s once up, so its host's links are 10 Gb/s;
loopback and an address no interface holds give none (the flow-scheduler then keeps its default)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from nitsum.transfer import netns

pytestmark = [pytest.mark.netns, pytest.mark.timeout(60)]

_REASON = netns.unavailable_reason()

PROBE = (
    "import json, sys; from nitsum.transfer.nic import link_speed_gbps, interface_of; "
    "from nitsum.telemetry.metrics import Metrics; from nitsum_services.worker.kv_net import KvNet; "
    "got = {a: [interface_of(a), link_speed_gbps(a)] for a in sys.argv[1:]}; "
    # what a worker advertising the address tells its peers (KvPeerInfo) and sends with its flows
    "got['peer_info'] = KvNet(None, 'w', 'host-a', sys.argv[1], {}, Metrics('w')).info().link_gbps; "
    "print(json.dumps(got))"
)


@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
def test_the_nic_holding_a_workers_address_reports_its_link_speed():
    with netns.veth_testbed(tag=f"nic{os.getpid() % 10000}") as bed:
        out = subprocess.run(
            [*bed.exec_prefix(bed.ns_a), sys.executable, "-c", PROBE, bed.addr_a, "127.0.0.1", "10.231.0.77", "x"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        got = json.loads(out.stdout)
    assert got[bed.addr_a] == [bed.dev_a, [10.0, bed.dev_a]]
    assert got["127.0.0.1"] == ["lo", None]  # loopback: no NIC
    assert got["10.231.0.77"] == [None, None] and got["x"] == [None, None]
    assert got["peer_info"] == 10.0
