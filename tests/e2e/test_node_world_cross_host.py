"""Node worlds take part in P/D across hosts (live CPU mesh, real NATS, real processes, tiny model, loopback):
the node world of host "host-a" runs `[0 TP1 prefill][1 TP1 prefill]` (`static:1p+1p`), so it has no decoding
group of its own; host "host-b" decodes, either with a standalone decode worker or with a node world of its
own set to `[0 TP1 decode][1 TP1 decode]` by `set-topology`. Every fresh request is prefilled by a TP1 group
of host-a's world and decoded on host-b, its KV over the TCP data plane (the KV mover's flows, permitted by the
flow-scheduler), and its tokens equal the in-process engine's."""

from __future__ import annotations

import asyncio
import time

import pytest

from nitsum.natsserver import NatsServer, free_port
from tests.e2e.harness import ManualMesh, _admin, prompts
from tests.e2e.test_pd_cross_host import LOOSE, MAX_TOKENS, run, samples, total
from tests.e2e.test_pd_disagg import hybrid_reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PREFILL_WORLD = ("nodeA-0", "nodeA-1")
DECODE_SIDES = {"standalone": ("nodeB-0",), "world": ("nodeB-0", "nodeB-1")}


def _world_env(node: str, host: str) -> dict[str, str]:
    return {
        "NITSUM_NODE_SIZE": "2",
        "NITSUM_MAX_TP": "2",
        "NITSUM_NODE_ID": node,
        "NITSUM_HOST_ID": host,
        "NITSUM_NODE_MASTER_PORT": str(free_port()),
    }


def _wait_roles(mesh: ManualMesh, roles: dict[str, str]) -> None:
    deadline = time.monotonic() + 120
    while True:
        workers = {w["worker_id"]: w for w in mesh.admin_status()["workers"]}
        if all(
            workers.get(w, {}).get("state") == "ready"
            and workers[w].get("role") == role
            and workers[w].get("leader")
            and workers[w].get("tp") == 1
            for w, role in roles.items()
        ):
            return
        assert time.monotonic() < deadline, f"the workers never took the roles {roles}: {workers}"
        time.sleep(0.5)


def start_two_hosts(mesh: ManualMesh, tmp, prefill_world, decode_workers, decode_world: bool) -> None:
    """Into `mesh` (the caller stops it, also when this fails half way): NATS, coordinator, flow-scheduler and
    gateway; host-a's node world of `prefill_world` (prefill workers) and host-b's `decode_workers`, a node world
    of their own when `decode_world`, else one standalone decode worker."""
    mesh.nats = NatsServer(port=free_port(), config_path=None).start(log_path=tmp / "nats.log")
    mesh.port = free_port()
    mesh.add("coordinator", "coordinator", NITSUM_POLICY="static:1p+1p").start()
    mesh.add("flow-scheduler", "flow-scheduler").start()
    a_env = _world_env("nodeA", "host-a")
    for i, worker_id in enumerate(prefill_world):
        mesh.add(f"a-{i}", "prefill-worker", NITSUM_WORKER_ID=worker_id, NITSUM_DEVICE_INDEX=str(i), **a_env).start()
    b_env = _world_env("nodeB", "host-b") if decode_world else {"NITSUM_NODE_ID": "nodeB", "NITSUM_HOST_ID": "host-b"}
    for i, worker_id in enumerate(decode_workers):
        mesh.add(f"b-{i}", "decode-worker", NITSUM_WORKER_ID=worker_id, NITSUM_DEVICE_INDEX=str(i), **b_env).start()
    mesh.add("gateway", "gateway", NITSUM_GATEWAY_PORT=str(mesh.port), NITSUM_GATEWAY_HOST="127.0.0.1").start()
    mesh.wait_workers(len(prefill_world) + len(decode_workers))


@pytest.fixture(scope="module", params=sorted(DECODE_SIDES))
def mesh(request, tmp_path_factory, tiny_model_dir):
    side = request.param
    tmp = tmp_path_factory.mktemp(f"world-cross-host-{side}")
    mesh = ManualMesh(tmp, tiny_model_dir, num_workers=0)
    try:
        start_two_hosts(mesh, tmp, PREFILL_WORLD, DECODE_SIDES[side], side == "world")
        roles = dict.fromkeys(PREFILL_WORLD, "prefill")
        if side == "world":
            # the policy lays every 2-device node out as two prefill groups; host-b's is set to decode by hand
            _wait_roles(mesh, {**roles, **dict.fromkeys(DECODE_SIDES[side], "prefill")})
            body = {"node_id": "nodeB", "topology": "[0 TP1 decode][1 TP1 decode]"}
            reply = asyncio.run(_admin(mesh.nats.url, "set-topology", body))
            assert reply["ok"], reply
            roles.update(dict.fromkeys(DECODE_SIDES[side], "decode"))
        mesh.wait_ready()  # (a one-token probe: it needs a decoding worker, which host-b's world is only now)
        _wait_roles(mesh, roles)
        mesh.side = side
        yield mesh
    finally:
        mesh.stop()


def pd_counters(mesh: ManualMesh, prefill, decode, receivers=None) -> dict[str, float]:
    """The P/D hand-off counters of the services `prefill` (senders) and `decode`; TCP bytes received are read
    from `receivers` (default: `decode`)."""

    def summed(services, name, **labels):
        return sum(total(mesh, s, name, **labels) for s in services)

    def tcp_bytes(services, direction):
        return sum(
            v
            for s in services
            for lab, v in samples(mesh, s, "nitsum_kv_tcp_bytes_total")
            if lab["direction"] == direction and lab["purpose"] == "pd"
        )

    return {
        "handed": summed(prefill, "nitsum_kv_transfers_total", purpose="pd", outcome="ok"),
        "failed": summed(decode, "nitsum_kv_transfers_total", purpose="pd", outcome="failed"),
        "sent": tcp_bytes(prefill, "sent"),
        "received": tcp_bytes(decode if receivers is None else receivers, "received"),
        "prefill_tokens": summed(prefill, "nitsum_generated_tokens_total"),
        "decode_tokens": summed(decode, "nitsum_generated_tokens_total"),
        "permits": total(mesh, "flow-scheduler", "nitsum_flow_permits_total", stage="3"),
    }


def assert_handed_off(delta: dict[str, float], requests: int) -> None:
    """`requests` requests each handed off once across hosts, every layer over TCP, byte for byte; the prefill
    side computed each one's first token only, the decode side every later one."""
    assert delta["handed"] == requests and delta["failed"] == 0, delta
    assert delta["sent"] > 0 and delta["sent"] == delta["received"], delta
    assert delta["prefill_tokens"] == requests and delta["decode_tokens"] == requests * (MAX_TOKENS - 1), delta
    assert delta["permits"] >= 4 * requests, delta  # one flow per layer (tiny model: 4), each permitted


def _counters(mesh: ManualMesh) -> dict[str, float]:
    prefill = [f"a-{i}" for i in range(len(PREFILL_WORLD))]
    return pd_counters(mesh, prefill, [f"b-{i}" for i in range(len(DECODE_SIDES[mesh.side]))])


def test_a_node_world_prefill_group_hands_off_to_another_host_over_tcp(mesh, tiny_model_dir):
    batch = prompts(4, seed=31)
    expected = hybrid_reference(tiny_model_dir, batch, MAX_TOKENS)
    before = _counters(mesh)  # (the gateway's readiness probes generated a token or two already)
    results = asyncio.run(run(mesh.url, batch, LOOSE))
    for r, want in zip(results, expected, strict=True):
        assert r.status == 200 and r.error is None, r
        assert r.token_ids == want  # every token once, in order, across the hand-off between hosts
    after = _counters(mesh)
    assert_handed_off({k: after[k] - before[k] for k in after}, len(batch))


def test_a_node_world_tp1_group_fetches_a_prefix_another_host_caches(mesh, tiny_model_dir):
    """Stage-1 reuse with a node world's TP1 group as the asker: host-b computes a prompt alone (host-a's groups
    excluded), then a prompt with the same four-block prefix is prefilled by nodeA-0, which fetches those blocks
    from host-b over TCP instead of computing them, and hands the request back to host-b to decode."""
    from tests.e2e.test_kv_reuse_live import MAX_TOKENS as REUSE_TOKENS
    from tests.e2e.test_kv_reuse_live import run_on
    from tests.e2e.test_pd_disagg import latest_stats

    if mesh.side != "standalone":
        pytest.skip("the holder here is host-b's standalone worker, which runs the first prompt alone")
    prefix = [5 + (j * 17) % 240 for j in range(64)]  # 4 full blocks of 16
    first, second = prefix + [9, 8, 7], prefix + [201, 202, 203, 204, 205]
    expected = hybrid_reference(tiny_model_dir, [first, second], REUSE_TOKENS)
    holder, asker = DECODE_SIDES["standalone"][0], PREFILL_WORLD[0]
    assert asyncio.run(run_on(mesh.nats.url, "world-reuse-a", first, exclude=PREFILL_WORLD)) == (holder, expected[0])
    deadline = time.monotonic() + 10
    while len(asyncio.run(latest_stats(mesh.nats.url, (holder,)))[holder].cached_block_hashes) < 4:
        assert time.monotonic() < deadline, "host-b never reported the prefix blocks as cached"
        time.sleep(0.2)
    time.sleep(0.5)  # the coordinator has the heartbeat that lists them
    before = asyncio.run(latest_stats(mesh.nats.url, (asker,)))[asker]
    received = sum(
        v
        for lab, v in samples(mesh, "a-0", "nitsum_kv_tcp_bytes_total")
        if lab["direction"] == "received" and lab["purpose"] == "reuse"
    )
    worker, tokens = asyncio.run(run_on(mesh.nats.url, "world-reuse-b", second, exclude=(PREFILL_WORLD[1],)))
    assert (worker, tokens) == (asker, expected[1])
    after = asyncio.run(latest_stats(mesh.nats.url, (asker,)))[asker]
    assert after.num_reused_blocks - before.num_reused_blocks == 4
    assert after.num_prefill_tokens_computed - before.num_prefill_tokens_computed == len(second) - 64
    received_after = sum(
        v
        for lab, v in samples(mesh, "a-0", "nitsum_kv_tcp_bytes_total")
        if lab["direction"] == "received" and lab["purpose"] == "reuse"
    )
    assert received_after > received  # the blocks came over TCP from the other host
