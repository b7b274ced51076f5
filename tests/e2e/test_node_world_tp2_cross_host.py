"""Node-world TP>1 groups take part in KV paths across hosts (live CPU mesh, real NATS, real processes, tiny
model, loopback): host "host-a"'s node world is set to `[0-1 TP2 prefill]`, so its one group's KV heads are
spread over two processes and it has no decoding group of its own; host "host-b" decodes with a node world set
to `[0-1 TP2 decode]`. The TP2 prefill leader gathers each
request's heads from its members' shm arenas into the KV mover's one-cache export and ships it over the TCP
data plane (each layer a flow in its permit level's DSCP, read back from the socket); a TP2 decode leader
scatters them into its members' arenas and adopts the request. Tokens equal the in-process engine's (greedy).
Stage 1 too: nodeA-0's TP2 group fetches a prefix host-b caches (a TP2 holder gathers it) and scatters it."""

from __future__ import annotations

import asyncio
import time

import pytest

from nitsum.policy.flows import dscp_table, tos_for_dscp
from tests.e2e.harness import ManualMesh, _admin, prompts
from tests.e2e.test_node_world_cross_host import assert_handed_off, pd_counters, start_two_hosts
from tests.e2e.test_pd_cross_host import LOOSE, MAX_TOKENS, run, samples
from tests.e2e.test_pd_disagg import hybrid_reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(360)]

PREFILL_WORLD = ("nodeA-0", "nodeA-1")
# host-b as a node world only: a standalone decode worker's side of these paths (the engine's own import and
# export of a one-cache export) is what tests/e2e/test_node_world_cross_host.py runs, so it is not run again here
# (each side is a mesh of its own, ~30 s).
DECODE_SIDES = {"world": ("nodeB-0", "nodeB-1")}


def _wait_groups(mesh: ManualMesh, want: dict[str, tuple[str, int]]) -> None:
    """Every worker of `want` ready, in a group of (role, TP); the first of each group its leader."""
    deadline = time.monotonic() + 150
    while True:
        workers = {w["worker_id"]: w for w in mesh.admin_status()["workers"]}
        if all(
            workers.get(w, {}).get("state") == "ready" and workers[w].get("role") == role and workers[w].get("tp") == tp
            for w, (role, tp) in want.items()
        ):
            return
        assert time.monotonic() < deadline, f"the workers never took the groups {want}: {workers}"
        time.sleep(0.5)


def _set(mesh: ManualMesh, node: str, topology: str) -> None:
    reply = asyncio.run(_admin(mesh.nats.url, "set-topology", {"node_id": node, "topology": topology}))
    assert reply["ok"], reply


@pytest.fixture(scope="module", params=sorted(DECODE_SIDES))
def mesh(request, tmp_path_factory, tiny_model_dir):
    side = request.param
    tmp = tmp_path_factory.mktemp(f"world-tp2-cross-host-{side}")
    mesh = ManualMesh(tmp, tiny_model_dir, num_workers=0)
    try:
        start_two_hosts(mesh, tmp, PREFILL_WORLD, DECODE_SIDES[side], side == "world")
        # the policy lays every 2-device node out as two TP1 prefill groups; both worlds are set by hand
        worlds = PREFILL_WORLD + (DECODE_SIDES[side] if side == "world" else ())
        _wait_groups(mesh, dict.fromkeys(worlds, ("prefill", 1)))
        _set(mesh, "nodeA", "[0-1 TP2 prefill]")
        want = dict.fromkeys(PREFILL_WORLD, ("prefill", 2))
        if side == "world":
            _set(mesh, "nodeB", "[0-1 TP2 decode]")
            want.update(dict.fromkeys(DECODE_SIDES[side], ("decode", 2)))
        _wait_groups(mesh, want)
        mesh.wait_ready()  # (a one-token probe: it needs a decoding worker, which host-b's world is only now)
        mesh.side = side
        yield mesh
    finally:
        mesh.stop()


def _pd_tcp(mesh: ManualMesh, service: str, direction: str) -> list[tuple[dict, float]]:
    return [
        (lab, v)
        for lab, v in samples(mesh, service, "nitsum_kv_tcp_bytes_total")
        if lab["direction"] == direction and lab["purpose"] == "pd"
    ]


def _counters(mesh: ManualMesh) -> dict[str, float]:
    # the TP2 leaders (a-0, b-0) send and receive; the decode side's tokens and failures over both members
    return pd_counters(mesh, ["a-0"], [f"b-{i}" for i in range(len(DECODE_SIDES[mesh.side]))], ["b-0"])


def test_a_tp2_prefill_group_hands_off_to_another_host_over_tcp_in_the_permit_class(mesh, tiny_model_dir):
    batch = prompts(4, seed=37)
    expected = hybrid_reference(tiny_model_dir, batch, MAX_TOKENS)
    before = _counters(mesh)  # (the gateway's readiness probes generated a token or two already)
    results = asyncio.run(run(mesh.url, batch, LOOSE))
    for r, want in zip(results, expected, strict=True):
        assert r.status == 200 and r.error is None, r
        assert r.token_ids == want  # every token once, in order, across the TP2 gather and the TCP hand-off
    after = _counters(mesh)
    assert_handed_off({k: after[k] - before[k] for k in after}, len(batch))
    table = dscp_table(8)
    sent = _pd_tcp(mesh, "a-0", "sent")
    for labels, _ in sent:  # the socket that carried a flow is in the class of the level that flow went at
        assert labels["tos"] == str(tos_for_dscp(table[int(labels["level"])])), labels
    by_tos: dict[str, float] = {}
    for labels, v in sent:
        by_tos[labels["tos"]] = by_tos.get(labels["tos"], 0.0) + v
    assert {lab["tos"]: v for lab, v in _pd_tcp(mesh, "b-0", "received")} == by_tos  # the same classes received


def test_a_tp2_group_fetches_a_prefix_another_host_caches(mesh, tiny_model_dir):
    """host-b's leader computes a prompt alone (host-a excluded; on the world side its TP2 group gathers the
    cached blocks when asked), then a prompt with the same four-block prefix is prefilled by host-a's TP2
    group, which fetches those blocks over TCP, scatters them into both members' caches and computes the rest."""
    from tests.e2e.test_kv_reuse_live import MAX_TOKENS as REUSE_TOKENS
    from tests.e2e.test_kv_reuse_live import run_on
    from tests.e2e.test_pd_disagg import latest_stats

    prefix = [7 + (j * 13) % 240 for j in range(64)]  # 4 full blocks of 16
    first, second = prefix + [9, 8, 7], prefix + [201, 202, 203, 204, 205]
    expected = hybrid_reference(tiny_model_dir, [first, second], REUSE_TOKENS)
    holder, asker = DECODE_SIDES[mesh.side][0], PREFILL_WORLD[0]
    tag = f"tp2-reuse-{mesh.side}"
    assert asyncio.run(run_on(mesh.nats.url, f"{tag}-a", first, exclude=PREFILL_WORLD)) == (holder, expected[0])
    deadline = time.monotonic() + 10
    while len(asyncio.run(latest_stats(mesh.nats.url, (holder,)))[holder].cached_block_hashes) < 4:
        assert time.monotonic() < deadline, "host-b never reported the prefix blocks as cached"
        time.sleep(0.2)
    time.sleep(0.5)  # the coordinator has the heartbeat that lists them
    reused = lambda: sum(  # noqa: E731
        v
        for lab, v in samples(mesh, "a-0", "nitsum_kv_tcp_bytes_total")
        if lab["direction"] == "received" and lab["purpose"] == "reuse"
    )
    before, received = asyncio.run(latest_stats(mesh.nats.url, (asker,)))[asker], reused()
    worker, tokens = asyncio.run(run_on(mesh.nats.url, f"{tag}-b", second, exclude=()))
    assert (worker, tokens) == (asker, expected[1])
    after = asyncio.run(latest_stats(mesh.nats.url, (asker,)))[asker]
    assert after.num_reused_blocks - before.num_reused_blocks == 4
    assert after.num_prefill_tokens_computed - before.num_prefill_tokens_computed == len(second) - 64
    assert reused() > received  # the blocks came over TCP from the other host
