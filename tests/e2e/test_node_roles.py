"""Roles inside one node world on the live CPU mesh (`nitsum up --devices 4 --policy disagg`, real NATS, real
processes, a ~27M-parameter random Llama, greedy).

Under `disagg` the policy's layout `[0-1 TP2 prefill][2-3 TP2 decode]` is applied by the transition agent
(Prepare/Commit with the roles); every prompt is then computed on the prefill group and every later token
on the decode group -- read from the workers' own counters (prompt tokens computed, tokens generated, KV
hand-offs adopted) -- and the tokens equal a `static-hybrid` run. A combined TP and role change (one
epoch: four TP1 hybrid groups merge into a TP2 prefill and a TP2 decode group) and its way back, with
requests in flight, lose and duplicate nothing."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from tests.e2e.conftest import start_mesh, stop_mesh
from tests.e2e.harness import counter_total, prompts, stream_across_changes, stream_completion
from tests.e2e.test_adaptive_tp import MID, admin, admin_async, metric
from tests.greedy_ties import check_greedy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

DISAGG = "[0-1 TP2 prefill][2-3 TP2 decode]"  # `disagg` on 4 devices
HYBRID = "[0-1 TP2 hybrid][2 TP1 hybrid][3 TP1 hybrid]"  # `static-hybrid` on 4 devices
TP1 = "[0 TP1 hybrid][1 TP1 hybrid][2 TP1 hybrid][3 TP1 hybrid]"  # requests spread over four equal groups
MAX_TOKENS = 12
LENGTHS = [120, 160, 200, 240]


@pytest.fixture(scope="module")
def mid_dir(tmp_path_factory):
    from nitsum.model.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("mid") / "mid", config_overrides=MID)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, mid_dir):
    mesh = start_mesh(
        tmp_path_factory.mktemp("roles"),
        devices=4,
        extra_args=("--model", str(mid_dir), "--policy", "disagg"),
        env_extra={"NITSUM_RECONFIG_INTERVAL_MS": "300"},
    )
    yield mesh
    stop_mesh(mesh.process)


def layout(status: dict) -> str:
    """The node's groups as the leaders report them, in the topology's notation."""
    parts = []
    for w in sorted((w for w in status["workers"] if w["leader"]), key=lambda w: w["device_index"]):
        start, tp = w["device_index"], w["tp"]
        span = f"{start}" if tp == 1 else f"{start}-{start + tp - 1}"
        parts.append(f"[{span} TP{tp} {w['role']}]")
    return "".join(parts)


def wait_layout(mesh, want: str, timeout_s: float = 180.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        status = admin(mesh, "status")
        if layout(status) == want and all(w["role"] == _role_of(want, w) for w in status["workers"]):
            return status
        assert time.monotonic() < deadline, f"layout {layout(status)} never became {want}"
        time.sleep(0.5)


def _role_of(want: str, worker: dict) -> str:
    """The role `want` gives this worker's group (peers report their group's role too)."""
    for part in want.strip("[]").split("]["):
        span, _tp, role = part.split()
        first, _, last = span.partition("-")
        if int(first) <= worker["device_index"] <= int(last or first):
            return role
    raise AssertionError(f"device {worker['device_index']} not in {want}")


# These tests are about roles, not SLOs: a TTFT no CPU run misses, so that no request is pruned at its admission
# to a prefill group (re-run hybrid, its prompt would be computed on the decode group)
LOOSE = {"x-slo-ttft-ms": "60000"}


async def run_batch(url: str, batch: list[list[int]], max_tokens: int):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        return await asyncio.gather(*(stream_completion(session, url, p, max_tokens, LOOSE) for p in batch))


def stats_now(mesh) -> dict[int, dict]:
    """Each worker's latest heartbeat as the coordinator's status shows it, by device."""
    time.sleep(1.2)  # every worker has beaten since (every 0.5 s)
    return {w["device_index"]: w for w in admin(mesh, "status")["workers"]}


def generated(mesh, device: int) -> float:
    return metric(mesh, f"worker-{device}", "nitsum_generated_tokens_total")


def test_disagg_computes_prompts_on_the_prefill_group_and_tokens_on_the_decode_group(mesh, mid_dir):
    wait_layout(mesh, DISAGG)
    before = stats_now(mesh)
    transitions = admin(mesh, "status")["transitions"]
    assert any(t.get("topology") == DISAGG and t.get("changed") for t in transitions), transitions
    gen_before = {d: generated(mesh, d) for d in (0, 2)}
    batch = prompts(4, seed=21)
    results = asyncio.run(run_batch(mesh.url, batch, MAX_TOKENS))
    assert all(r.status == 200 and r.error is None and len(r.token_ids) == MAX_TOKENS for r in results), results
    after = stats_now(mesh)
    # Every prompt token was computed by the prefill group's leader, none by the decode group's ...
    prompt_tokens = sum(len(p) for p in batch)
    assert after[0]["prefill_tokens_computed"] - before[0]["prefill_tokens_computed"] >= prompt_tokens
    assert after[2]["prefill_tokens_computed"] == before[2]["prefill_tokens_computed"]
    # ... which adopted every request (KV written into its caches by the prefill group) ...
    assert after[2]["kv_imported"] - before[2]["kv_imported"] == len(batch)
    assert after[0]["transfer_failures"] == before[0]["transfer_failures"]  # no hand-off failed (and re-ran)
    # ... and sampled every token after the first; the prefill group sampled exactly the first ones.
    assert generated(mesh, 0) - gen_before[0] == len(batch)
    assert generated(mesh, 2) - gen_before[2] == len(batch) * (MAX_TOKENS - 1)
    # The blocks of the handed-off requests are free again on both sides.
    deadline = time.monotonic() + 20
    while True:
        leaders = [w for w in admin(mesh, "status")["workers"] if w["leader"]]
        if all(w["kv_blocks_free"] == w["kv_blocks_total"] for w in leaders) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert all(w["kv_blocks_free"] == w["kv_blocks_total"] for w in leaders), leaders

    # The same batch under static-hybrid (set by hand: the policy changes roles and TP in one transition).
    answer = admin(mesh, "set-policy", "static-hybrid")
    assert answer.get("ok"), answer
    wait_layout(mesh, HYBRID)
    reference = asyncio.run(run_batch(mesh.url, batch, MAX_TOKENS))
    for prompt, ref, got in zip(batch, reference, results):
        assert ref.status == 200 and len(ref.token_ids) == MAX_TOKENS
        check_greedy(mid_dir, prompt, got.token_ids, ref.token_ids, got.request_id)


def test_combined_tp_and_role_change_with_requests_in_flight_loses_and_duplicates_nothing(mesh, mid_dir):
    pinned = admin(mesh, "set-topology", TP1)  # pins the node: the policy leaves it to this test
    assert pinned["ok"], pinned
    batch = prompts(len(LENGTHS), seed=5)
    reference, _ = asyncio.run(stream_across_changes(mesh.url, batch, LENGTHS, None, None))
    assert all(r.status == 200 and len(r.token_ids) == n for r, n in zip(reference, LENGTHS))

    async def change(topology):
        return await admin_async(mesh, "set-topology", {"topology": topology, "id": f"t-{time.monotonic()}"})

    moved_before = stream_pauses(mesh)
    results, reports = asyncio.run(stream_across_changes(mesh.url, batch, LENGTHS, [DISAGG, TP1], change))
    assert [r["ok"] for r in reports] == [True, True], reports
    # Each change was one transition (one epoch) that changed TP and roles together.
    assert [(r["transition"]["from"], r["transition"]["topology"]) for r in reports] == [
        (TP1, DISAGG),
        (DISAGG, TP1),
    ]
    assert reports[1]["transition"]["epoch"] == reports[0]["transition"]["epoch"] + 1
    for prompt, ref, got, n in zip(batch, reference, results, LENGTHS):
        assert got.status == 200 and got.error is None, got
        assert len(got.token_ids) == n  # no duplicated, no missing token
        check_greedy(mid_dir, prompt, got.token_ids, ref.token_ids, got.request_id)
    # Streams were in flight: some moved to another worker (1 into the prefill group's leader 0 -- past their
    # first token, they decode on there --, 3 into the decode group's 2, and back at the splits).
    assert stream_pauses(mesh) - moved_before >= 1
    wait_layout(mesh, TP1)


def stream_pauses(mesh) -> float:
    """Streams the gateway saw move to another worker (the pause each saw is a phase of the reconfiguration
    metric)."""
    import urllib.request

    text = urllib.request.urlopen(mesh.url + "/metrics", timeout=10).read().decode()
    return counter_total(text, "nitsum_reconfiguration_duration_ms_count", phase="stream_pause")
