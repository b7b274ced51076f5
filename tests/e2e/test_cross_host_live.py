"""Run-time TP changes across "hosts" on the live mesh: four workers of one node world, started service by
service as separate hosts would start them (`NITSUM_HOST_ID` A for workers 0-1, B for 2-3), behind one
gateway, coordinator and flow-scheduler. A merge 4xTP1 -> TP4 and the split back move KV between workers of
one host through shared memory and between the two hosts over the TCP KV data plane; streams in flight keep
exactly the tokens of a run without changes, and every block is free afterwards. (The engine-level version,
with the faults, is tests/model/test_cross_host_kv.py.)"""

from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest

from nitsum.natsserver import NatsServer, free_port
from nitsum.up import _free_port_span
from tests.e2e.harness import ManualMesh, _admin, counter_total, prompts, stream_across_changes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TP1 = "[0 TP1 hybrid][1 TP1 hybrid][2 TP1 hybrid][3 TP1 hybrid]"
MERGE4 = "[0-3 TP4 hybrid]"
# Slow enough per token on CPU that the streams are still running when the topology changes.
MID = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}
LENGTHS = [90, 120, 150, 110]
HOSTS = {0: "host-a", 1: "host-a", 2: "host-b", 3: "host-b"}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    from nitsum.model.tiny import make_tiny

    tmp = tmp_path_factory.mktemp("cross-host")
    mesh = ManualMesh(
        tmp,
        make_tiny(tmp / "mid", config_overrides=MID),
        num_workers=4,
        env_extra={"NITSUM_RECONFIG_INTERVAL_MS": "600000", "NITSUM_MAX_TP": "4", "NITSUM_POLICY": "static-tp:1"},
    )
    mesh.nats = NatsServer(port=free_port(), config_path=None).start(log_path=tmp / "nats.log")
    mesh.port = free_port()
    world = {"NITSUM_NODE_SIZE": "4", "NITSUM_NODE_MASTER_PORT": str(_free_port_span())}
    try:
        mesh.add("coordinator", "coordinator").start()
        mesh.add("flow-scheduler", "flow-scheduler").start()
        for i in range(4):
            mesh.add(
                f"worker-{i}",
                "decode-worker",
                NITSUM_WORKER_ID=f"node0-{i}",
                NITSUM_DEVICE_INDEX=str(i),
                NITSUM_HOST_ID=HOSTS[i],
                **world,
            ).start()
        mesh.add("gateway", "gateway", NITSUM_GATEWAY_PORT=str(mesh.port), NITSUM_GATEWAY_HOST="127.0.0.1").start()
        mesh.wait_ready()
        mesh.wait_workers(4)
        yield mesh
    finally:
        mesh.stop()


def metric(mesh: ManualMesh, service: str, name: str, **labels: str) -> float:
    return counter_total(urllib.request.urlopen(mesh.metrics_url(service), timeout=10).read().decode(), name, **labels)


async def _run(mesh: ManualMesh, changes: list[str]):
    async def change(c):
        return await _admin(mesh.nats.url, "set-topology", {"topology": c, "id": f"x-{c}-{time.monotonic()}"})

    return await stream_across_changes(mesh.url, prompts(len(LENGTHS), seed=9), LENGTHS, changes, change, timeout_s=240)


def test_kv_moves_over_tcp_between_hosts_and_shared_memory_inside_one_and_tokens_are_unchanged(mesh):
    status = mesh.admin_status()
    assert sorted((w["device_index"], w["tp"]) for w in status["workers"] if w["leader"]) == [
        (0, 1),
        (1, 1),
        (2, 1),
        (3, 1),
    ]
    reference, _ = asyncio.run(_run(mesh, []))
    assert all(r.status == 200 and len(r.token_ids) == n for r, n in zip(reference, LENGTHS))
    results, answers = asyncio.run(_run(mesh, [MERGE4, TP1]))
    assert [a["ok"] for a in answers] == [True, True], answers
    assert [a["transition"]["topology"] for a in answers] == [MERGE4, TP1]
    for ref, got, n in zip(reference, results, LENGTHS):
        assert got.status == 200 and got.error is None
        assert len(got.token_ids) == n  # no duplicated, no missing token
        assert got.token_ids == ref.token_ids
    tcp = sum(metric(mesh, f"worker-{i}", "nitsum_kv_migration_path_bytes_total", path="tcp") for i in range(4))
    shm = sum(metric(mesh, f"worker-{i}", "nitsum_kv_migration_path_bytes_total", path="shm") for i in range(4))
    assert tcp > 0 and shm > 0, (tcp, shm)  # both paths carried KV: across the hosts and inside each
    deadline = time.monotonic() + 20
    while True:
        status = mesh.admin_status()
        leaders = [w for w in status["workers"] if w["leader"]]
        if all(w["kv_blocks_free"] == w["kv_blocks_total"] for w in leaders) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert all(w["kv_blocks_free"] == w["kv_blocks_total"] for w in leaders), leaders
    assert sorted((w["device_index"], w["tp"]) for w in leaders) == [(0, 1), (1, 1), (2, 1), (3, 1)]
