"""The admin plane over NATS (JSON): status, idempotent commands by id, policy switch, drain."""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e.harness import ManualMesh, _admin, http_get

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    m = ManualMesh(tmp_path_factory.mktemp("admin"), tiny_model_dir, num_workers=2).start()
    yield m
    m.stop()


def admin(mesh, command: str, body: dict) -> dict:
    return asyncio.run(_admin(mesh.nats.url, command, body))


def test_status_shape(mesh):
    status = admin(mesh, "status", {})
    assert status["ok"] is True
    assert {w["worker_id"] for w in status["workers"]} == {"node0-0", "node0-1"}
    assert all(w["state"] == "ready" and w["tp"] == 1 and w["leader"] for w in status["workers"])
    assert {g["group_id"] for g in status["groups"]} == {"node0-g0-tp1", "node0-g1-tp1"}
    assert status["policy"] == "adaptive"
    assert set(status["queue_depth"]) == {"interactive", "background"}


def test_set_policy_is_validated_and_idempotent_by_id(mesh):
    bad = admin(mesh, "set-policy", {"id": "p0", "policy": "static-tp:three"})
    assert bad["ok"] is False and bad["error"]["code"] == "bad_policy"
    assert admin(mesh, "status", {})["policy"] == "adaptive"  # unchanged
    too_wide = admin(mesh, "set-policy", {"id": "p0w", "policy": "static-tp:4"})  # two workers cannot make a TP4
    assert too_wide["ok"] is False and too_wide["error"]["code"] == "bad_policy"
    assert "does not fit node node0" in too_wide["error"]["message"]
    assert admin(mesh, "status", {})["policy"] == "adaptive"
    first = admin(mesh, "set-policy", {"id": "p1", "policy": "static-tp:1"})
    assert first == {"ok": True, "policy": "static-tp:1", "previous": "adaptive"}
    # The same id again (a retry): the first answer, and nothing changes twice.
    assert admin(mesh, "set-policy", {"id": "p1", "policy": "static-tp:1"}) == first
    assert admin(mesh, "status", {})["policy"] == "static-tp:1"
    back = admin(mesh, "set-policy", {"id": "p2", "policy": "adaptive"})
    assert back["ok"] and back["previous"] == "static-tp:1"
    missing = admin(mesh, "set-policy", {"id": "p3"})
    assert missing["ok"] is False and missing["error"]["code"] == "bad_request"


def test_drain_stops_routing_to_a_worker_and_undo_resumes(mesh):
    assert admin(mesh, "drain", {"id": "d1", "worker_id": "node0-0"}) == {
        "ok": True,
        "worker_id": "node0-0",
        "draining": True,
    }
    workers = {http_get(mesh.url + "/ready")[1]["worker"] for _ in range(8)}
    assert workers == {"node0-1"}
    status = admin(mesh, "status", {})
    assert {w["worker_id"]: w["state"] for w in status["workers"]}["node0-0"] == "draining"
    assert admin(mesh, "drain", {"id": "d2", "worker_id": "node0-0", "undo": True})["draining"] is False
    assert admin(mesh, "drain", {"id": "d3", "worker_id": "nobody"})["error"]["code"] == "unknown_worker"


def test_bad_json_and_types_get_coded_errors(mesh):
    async def raw(subject: str, payload: bytes) -> dict:
        import json

        import nats

        nc = await nats.connect(servers=[mesh.nats.url])
        try:
            msg = await nc.request(subject, payload, timeout=2)
            return json.loads(msg.data)
        finally:
            await nc.close()

    assert asyncio.run(raw("nitsum.admin.status", b"{not json"))["error"]["code"] == "bad_json"
    assert asyncio.run(raw("nitsum.admin.status", b"[1, 2]"))["error"]["code"] == "bad_json"
    assert admin(mesh, "status", {"id": 5})["error"]["code"] == "bad_request"
    # An empty payload is an empty request (the stock `nats req nitsum.admin.status ''`).
    assert asyncio.run(raw("nitsum.admin.status", b""))["ok"] is True


def test_role_changes_at_run_time(mesh):
    import aiohttp

    from tests.e2e.harness import prompts, stream_completion

    async def run_batch():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(stream_completion(s, mesh.url, p, 12) for p in prompts(4, seed=11)))

    before = asyncio.run(run_batch())
    answer = admin(mesh, "role", {"id": "r1", "worker_id": "node0-1", "role": "prefill"})
    assert answer["ok"] is True and answer["change"] == "hybrid -> prefill"
    roles = {w["worker_id"]: w["role"] for w in admin(mesh, "status", {})["workers"]}
    assert roles == {"node0-0": "hybrid", "node0-1": "prefill"}
    # Requests now go prefill (node0-1) -> decode (node0-0) and produce the very same greedy tokens.
    after = asyncio.run(run_batch())
    assert [r.token_ids for r in after] == [r.token_ids for r in before]
    assert all(r.status == 200 and len(r.token_ids) == 12 for r in after)
    assert admin(mesh, "role", {"id": "r2", "worker_id": "node0-1", "role": "hybrid"})["ok"] is True
    assert admin(mesh, "role", {"id": "r3", "worker_id": "node0-1", "role": "wizard"})["error"]["code"] == "bad_request"
    assert (
        admin(mesh, "role", {"id": "r4", "worker_id": "ghost", "role": "decode"})["error"]["code"] == "unknown_worker"
    )
