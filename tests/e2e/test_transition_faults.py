"""A worker that dies in the middle of a TP change (issue 4, item 5), on the live CPU mesh: 4 worker processes
in one node world, a real nats-server, a ~27M-parameter random Llama, greedy requests of different lengths.

The victim SIGKILLs itself inside the prepare of a chosen epoch (NITSUM_FAULT_DIE_AT), right before the
span's exchange, so its peers are left in a collective with a dead member. Checked: the coordinator aborts
the transition (report, history, abort acks from every survivor), every stream ends with exactly the tokens
of a run with no fault (nothing duplicated, missing or lost), the coordinator's view is what the survivors
report, their KV is all free afterwards, and the node keeps serving (further TP changes are refused with a
clear reason: a process world cannot take a member back).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from nitsum.natsserver import free_port
from nitsum_load.bench_reconfigure import admin_call
from tests.e2e.harness import ManualMesh, prompts, stream_completion
from tests.greedy_ties import check_greedy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Generous bounds that only catch hangs, never a claim about speed.
HANG_GUARD_S = 240.0
SETTLE_S = 60.0

TP1 = "[0 TP1 hybrid][1 TP1 hybrid][2 TP1 hybrid][3 TP1 hybrid]"
SPLIT2 = "[0-1 TP2 hybrid][2-3 TP2 hybrid]"
MERGE4 = "[0-3 TP4 hybrid]"
MID = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}
LENGTHS = [240, 320, 400, 480, 560, 280]


@pytest.fixture(scope="module")
def mid_model(tmp_path_factory) -> Path:
    from nitsum.model.tiny import make_tiny

    # Slow enough per token on CPU that every stream is still running when the transition starts.
    return make_tiny(tmp_path_factory.mktemp("mid") / "mid", config_overrides=MID)


def start_world(tmp: Path, model: Path, die_at: str) -> ManualMesh:
    env = {
        "NITSUM_NODE_SIZE": "4",
        "NITSUM_NODE_MASTER_PORT": str(free_port()),
        "NITSUM_RECONFIG_INTERVAL_MS": "600000",  # only the test changes the topology
        "NITSUM_POLICY": "static-tp:1",  # the boot layout, kept: no policy epoch (queue events trigger them too) changes roles or TP before the test
        "NITSUM_WORLD_TIMEOUT_S": "20",
        "NITSUM_HEARTBEAT_TIMEOUT_MS": "5000",  # four busy workers on a small machine must not look lost
        "NITSUM_STREAM_TIMEOUT_S": "90",  # a re-route here must come from the fault, not from a slow machine
        "NITSUM_FAULT_DIE_AT": die_at,
    }
    mesh = ManualMesh(tmp, model, num_workers=4, env_extra=env)
    try:
        return mesh.start()
    except Exception:
        stop_world(mesh)
        raise


def kv_segments(mesh: ManualMesh) -> list[Path]:
    """KV segments of this mesh's node world in /dev/shm (named from its rendezvous port)."""
    port = mesh.env_extra["NITSUM_NODE_MASTER_PORT"]
    return sorted(Path("/dev/shm").glob(f"nitsum-kv-p{port}-*"))


def stop_world(mesh: ManualMesh) -> None:
    mesh.stop()  # its weight store goes too
    for leftover in kv_segments(mesh):  # only a failure of the test itself can leave one (checked below)
        leftover.unlink(missing_ok=True)


async def admin(mesh: ManualMesh, command: str, body: dict, timeout_s: float = 150.0) -> dict:
    return await admin_call(mesh.nats.url, command, body, timeout_s)


def status(mesh: ManualMesh) -> dict:
    return asyncio.run(admin(mesh, "status", {}, timeout_s=10))


def leaders(st: dict) -> list[tuple[int, int]]:
    return sorted((w["device_index"], w["tp"]) for w in st["workers"] if w["leader"])


async def run_batch(mesh: ManualMesh, change: str | None = None, before_change=None):
    """Stream the batch; with `change`, set that topology once every stream has tokens (right after
    `await before_change(status)`, given the admin status of that moment)."""
    batch = prompts(len(LENGTHS), seed=11)
    counts = [0] * len(batch)
    answer = None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG_GUARD_S)) as session:

        def tracker(i):
            def on_token(n):
                counts[i] = n

            return on_token

        tasks = [
            asyncio.create_task(stream_completion(session, mesh.url, p, n, on_token=tracker(i)))
            for i, (p, n) in enumerate(zip(batch, LENGTHS))
        ]
        if change is not None:
            while min(counts) < 1 and not all(t.done() for t in tasks):
                await asyncio.sleep(0.01)
            assert not any(t.done() for t in tasks), "every stream must still be running when the transition starts"
            if before_change is not None:
                await before_change(await admin(mesh, "status", {}, timeout_s=10))
            answer = await admin(mesh, "set-topology", {"topology": change})
        results = await asyncio.gather(*tasks)
    return results, answer


_REFERENCE: list = []


def clean_reference(mesh: ManualMesh) -> list:
    """The batch's greedy streams on a mesh with no fault yet, run once per module (the first test that asks runs
    it on its own mesh, before any fault): every test compares with it through check_greedy, which allows a
    difference only at a near-tie, so the topology it ran on does not matter."""
    if not _REFERENCE:
        reference, _ = asyncio.run(run_batch(mesh))
        assert all(r.status == 200 and r.error is None and len(r.token_ids) == n for r, n in zip(reference, LENGTHS))
        _REFERENCE.extend(reference)
    return list(_REFERENCE)


def wait_for(mesh: ManualMesh, done, what: str) -> dict:
    deadline = time.monotonic() + SETTLE_S
    st = status(mesh)
    while not done(st):
        assert time.monotonic() < deadline, f"{what}: {json.dumps(st)[:3000]}"
        time.sleep(0.3)
        st = status(mesh)
    return st


def rerouted_from(mesh: ManualMesh) -> list[str]:
    time.sleep(0.6)  # the span processors flush every 200 ms
    path = mesh.tmp / "spans.jsonl"
    spans = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [
        e["attributes"]["nitsum.from_worker"]
        for s in spans
        if s["name"] == "gateway.request"
        for e in s["events"]
        if e["name"] == "rerouted"
    ]


def running_on(st: dict) -> dict[str, int]:
    return {w["worker_id"]: w["running"] for w in st["workers"]}


def check_aborted(answer: dict, epoch: int, phase: str = "prepare") -> dict:
    from nitsum_services.coordinator.transition import PREPARE_TIMEOUT_S

    assert answer["ok"] is False and answer["error"]["code"] == "transition_failed", answer
    report = answer["transition"]
    assert report["aborted"] is True and report["phase"] == phase and report["epoch"] == epoch, report
    # The loss (or a survivor's failed exchange) ended the phase: the agent did not sit out its timeout.
    assert report["abort_ms"] < PREPARE_TIMEOUT_S * 1000.0, report
    return report


def check_served_after(mesh: ManualMesh, reference) -> None:
    """The node keeps serving: a shorter greedy run is a prefix of the clean run."""
    batch = prompts(len(LENGTHS), seed=11)

    async def go():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG_GUARD_S)) as session:
            return await asyncio.gather(*(stream_completion(session, mesh.url, p, 24) for p in batch))

    for prompt, ref, got in zip(batch, reference, asyncio.run(go())):
        assert got.status == 200 and got.error is None, got
        assert len(got.token_ids) == 24
        check_greedy(mesh.model_dir, prompt, got.token_ids, ref.token_ids[:24], got.request_id)


def kv_all_free(st: dict) -> bool:
    return all(w["kv_blocks_free"] == w["kv_blocks_total"] for w in st["workers"] if w["leader"])


def test_peer_dies_in_prepare_of_a_merge(tmp_path, mid_model):
    """2xTP2 -> TP4; device 3 (the peer of group 2-3) dies in the prepare. Group 0-1 is whole: it keeps its
    requests at TP=2. Group 2-3 cannot continue: device 2 falls back to TP=1 on the same weights and its
    requests are re-queued (the gateway re-submits them with the tokens already streamed)."""
    mesh = start_world(tmp_path, mid_model, die_at="prepare:2:3")
    try:
        assert asyncio.run(admin(mesh, "set-topology", {"topology": SPLIT2}))["ok"]  # epoch 1; pins the node
        reference = clean_reference(mesh)

        seen = {}

        async def note(st):
            seen.update(running_on(st))

        results, answer = asyncio.run(run_batch(mesh, MERGE4, before_change=note))
        report = check_aborted(answer, epoch=2)
        victim = mesh.services["worker-3"]
        assert victim.process.wait(30) == -signal.SIGKILL
        for prompt, ref, got, n in zip(prompts(len(LENGTHS), seed=11), reference, results, LENGTHS):
            assert got.status == 200 and got.error is None, got
            assert len(got.token_ids) == n  # no duplicated, no missing token
            check_greedy(mesh.model_dir, prompt, got.token_ids, ref.token_ids, got.request_id)
        # Only the broken group's requests moved (all of them); the whole group kept its own.
        moved = rerouted_from(mesh)
        assert set(moved) <= {"node0-2"} and bool(moved) == (seen["node0-2"] > 0), (moved, seen)

        # The coordinator's view is what the survivors report: 0-1 still TP2, 2 standalone TP1, 3 gone.
        st = wait_for(
            mesh,
            lambda s: (
                sorted(w["worker_id"] for w in s["workers"]) == ["node0-0", "node0-1", "node0-2"]
                and leaders(s) == [(0, 2), (2, 1)]
            ),
            "survivors did not settle",
        )
        by_id = {w["worker_id"]: w for w in st["workers"]}
        assert by_id["node0-0"]["in_world"] and by_id["node0-1"]["in_world"] and not by_id["node0-1"]["leader"]
        assert by_id["node0-2"]["in_world"] is False and by_id["node0-2"]["state"] == "ready"
        # Every survivor answered the abort (none hung in the dead collective).
        st = wait_for(mesh, lambda s: s["transitions"][-1]["abort_acks"] is not None, "abort not answered")
        entry = st["transitions"][-1]
        assert entry["epoch"] == 2 and sorted(entry["abort_sent_to"]) == ["node0-0", "node0-2"], entry
        assert all(a["ok"] for a in entry["abort_acks"]), entry
        assert report["lost_workers"] in ([], ["node0-3"])
        st = wait_for(mesh, kv_all_free, "KV blocks still held after every stream finished")
        assert kv_segments(mesh) == []  # the survivors dropped what the failed prepare had made

        refused = asyncio.run(admin(mesh, "set-topology", {"topology": MERGE4}))
        assert refused["ok"] is False and refused["error"]["code"] == "cannot_change", refused
        check_served_after(mesh, reference)
        assert leaders(status(mesh)) == [(0, 2), (2, 1)]
    finally:
        stop_world(mesh)


@pytest.mark.parametrize("phase", ["prepare", "commit"])
def test_leader_dies_in_a_merge(tmp_path, mid_model, phase):
    """4xTP1 -> TP4; device 2 (a TP=1 leader with requests) dies in the prepare, or when the commit reaches
    it (after a prepare that every worker acked). The coordinator announces its requests lost and the gateway
    re-submits them; devices 0, 1 and 3 keep their requests (TP=1 groups hold their whole KV; a commit that
    failed in its exchange changed nothing) and serve on as standalone workers."""
    mesh = start_world(tmp_path, mid_model, die_at=f"{phase}:1:2")
    try:
        assert asyncio.run(admin(mesh, "set-topology", {"topology": TP1}))["transition"]["changed"] is False  # pins
        reference = clean_reference(mesh)

        seen = {}

        async def note(st):
            seen.update(running_on(st))

        results, answer = asyncio.run(run_batch(mesh, MERGE4, before_change=note))
        check_aborted(answer, epoch=1, phase=phase)
        assert mesh.services["worker-2"].process.wait(30) == -signal.SIGKILL
        for prompt, ref, got, n in zip(prompts(len(LENGTHS), seed=11), reference, results, LENGTHS):
            assert got.status == 200 and got.error is None, got
            assert len(got.token_ids) == n
            check_greedy(mesh.model_dir, prompt, got.token_ids, ref.token_ids, got.request_id)
        moved = rerouted_from(mesh)
        assert set(moved) <= {"node0-2"} and bool(moved) == (seen["node0-2"] > 0), (moved, seen)

        st = wait_for(
            mesh,
            lambda s: (
                sorted(w["worker_id"] for w in s["workers"]) == ["node0-0", "node0-1", "node0-3"]
                and not any(w["in_world"] for w in s["workers"])
            ),
            "survivors did not settle",
        )
        assert leaders(st) == [(0, 1), (1, 1), (3, 1)]
        st = wait_for(mesh, lambda s: s["transitions"][-1]["abort_acks"] is not None, "abort not answered")
        entry = st["transitions"][-1]
        # Sent to every leader not yet known lost when the phase stopped; the dead one cannot answer.
        assert entry["epoch"] == 1 and {"node0-0", "node0-1", "node0-3"} <= set(entry["abort_sent_to"]), entry
        assert all(a["ok"] for a in entry["abort_acks"] if a["worker_id"] != "node0-2"), entry
        wait_for(mesh, kv_all_free, "KV blocks still held after every stream finished")
        assert kv_segments(mesh) == []

        refused = asyncio.run(admin(mesh, "set-topology", {"topology": SPLIT2}))
        assert refused["ok"] is False and refused["error"]["code"] == "cannot_change", refused
        check_served_after(mesh, reference)
    finally:
        stop_world(mesh)


def test_frozen_leader_is_lost_during_a_merge(tmp_path, mid_model):
    """4xTP1 -> TP4 while the busiest worker is frozen (SIGSTOP: a hung process closes no connection, so the
    others sit in the prepare's exchange until the world timeout). The coordinator stops waiting as soon as
    its membership loses the frozen worker (heartbeat timeout) and aborts; the frozen worker's requests are
    re-submitted elsewhere; the survivors' exchange times out and they serve on standalone."""
    mesh = start_world(tmp_path, mid_model, die_at="")
    frozen: dict = {}
    try:
        assert asyncio.run(admin(mesh, "set-topology", {"topology": TP1}))["ok"]  # pins the node
        reference = clean_reference(mesh)

        async def freeze_busiest(st):
            running = running_on(st)
            worker_id = max(sorted(running), key=lambda w: running[w])
            assert running[worker_id] > 0, running
            frozen["id"], frozen["service"] = worker_id, mesh.services[f"worker-{worker_id.rsplit('-', 1)[1]}"]
            frozen["service"].signal(signal.SIGSTOP)

        results, answer = asyncio.run(run_batch(mesh, MERGE4, before_change=freeze_busiest))
        victim = frozen["id"]
        report = check_aborted(answer, epoch=1)
        # The loss ended the phase, not a survivor's failed exchange (that comes only at the world timeout).
        assert report["lost_workers"] == [victim] and report["error"].startswith(
            f"worker {victim} lost (heartbeat timeout)"
        ), report
        assert victim not in report["abort_sent_to"]
        for prompt, ref, got, n in zip(prompts(len(LENGTHS), seed=11), reference, results, LENGTHS):
            assert got.status == 200 and got.error is None, got
            assert len(got.token_ids) == n
            check_greedy(mesh.model_dir, prompt, got.token_ids, ref.token_ids, got.request_id)
        moved = rerouted_from(mesh)
        assert moved and set(moved) == {victim}, moved
        st = wait_for(mesh, lambda s: s["transitions"][-1]["abort_acks"] is not None, "abort not answered")
        assert all(a["ok"] for a in st["transitions"][-1]["abort_acks"]), st["transitions"][-1]
        survivors = sorted({"node0-0", "node0-1", "node0-2", "node0-3"} - {victim})
        st = wait_for(
            mesh,
            lambda s: (
                sorted(w["worker_id"] for w in s["workers"]) == survivors
                and not any(w["in_world"] for w in s["workers"])
            ),
            "survivors did not settle",
        )
        assert leaders(st) == [(int(w.rsplit("-", 1)[1]), 1) for w in survivors]
        wait_for(mesh, kv_all_free, "KV blocks still held after every stream finished")
        assert kv_segments(mesh) == []
        check_served_after(mesh, reference)
    finally:
        if "service" in frozen:
            frozen["service"].signal(signal.SIGKILL)
        stop_world(mesh)


def test_back_to_back_changes_on_a_fresh_idle_mesh(tmp_path, tiny_model_dir):
    """Issue 4's stop note, item (5): on a freshly started idle mesh, a set-topology right after another
    (TP4 -> 4xTP1 -> 2xTP2, as `nitsum bench reconfigure`'s restart baseline does) hung in prepare. Each
    change is sent the moment the previous one is answered; every one must be answered, and succeed."""
    mesh = start_world(tmp_path, tiny_model_dir, die_at="")
    try:
        epoch = 0
        for round_ in range(4):
            for target in (MERGE4, TP1, SPLIT2, TP1):
                answer = asyncio.run(admin(mesh, "set-topology", {"topology": target}, timeout_s=HANG_GUARD_S))
                epoch += 1
                assert answer["ok"] is True and answer["transition"]["epoch"] == epoch, (round_, target, answer)
        check = status(mesh)
        assert leaders(check) == [(0, 1), (1, 1), (2, 1), (3, 1)] and all(w["in_world"] for w in check["workers"])
        results, _ = asyncio.run(run_batch(mesh))
        assert all(r.status == 200 and r.error is None and len(r.token_ids) == n for r, n in zip(results, LENGTHS))
    finally:
        stop_world(mesh)
