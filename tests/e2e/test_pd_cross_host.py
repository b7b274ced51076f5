"""P/D across hosts on the live CPU mesh (real NATS, real processes, tiny model, loopback): the prefill
worker is host "host-a", the decode worker "host-b" (NITSUM_HOST_ID), so every layer of a hand-off goes over
the TCP data plane, each flow on the connection of its permit level's DSCP. The sender reads IP_TOS back
from the socket that carried each flow, the receiver the TOS its connection's handshake arrived with; both
are counted in `nitsum_kv_tcp_bytes_total`. The flow-scheduler is told host-a's NIC is tiny
(NITSUM_FLOW_LINK_GBPS), so a request with a tight TPOT target cannot get its KV across in time: it is
pruned, the hand-off stops, the gateway re-submits it and it completes hybrid on the decode worker.
The prefill worker is a slow device (NITSUM_FAULT_PREFILL_DELAY_MS: every step that computes prompt tokens
takes 400 ms more), and it reports each request it admits to the flow-scheduler (PrefillAdmission) with its
measured prefill estimate: a request whose TTFT target is shorter than that is pruned before its prefill
(the check on batch arrival), its stream ends with the retryable overload_pruned, and it completes hybrid."""

from __future__ import annotations

import asyncio
import re
import urllib.request

import aiohttp
import pytest

from nitsum.natsserver import NatsServer, free_port
from nitsum.policy.flows import dscp_table, tos_for_dscp
from nitsum.wire.codec import decode
from nitsum.wire.messages import LayerProgress, PrefillAdmission
from tests.e2e.harness import ManualMesh, prompts, stream_completion
from tests.e2e.test_pd_disagg import DECODE, PREFILL, hybrid_reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

MAX_TOKENS = 8
# host-a's NIC as the flow-scheduler sees it: 100 kb/s, so a request's KV (tens of kB) needs seconds
LINK = "host-a=0.0001"
# the hand-off's deadline: 4 TPOTs from the end of the prefill; a TTFT the slow prefill meets
LOOSE = {"x-slo-tpot-ms": "60000", "x-slo-ttft-ms": "60000"}
PREFILL_DELAY_MS = 400
# Tight for the hand-off (pruning tests TPOT x remaining tokens, here 50 ms x 7, against seconds on the NIC) but
# within what admission accepts (the coordinator's step table says this CPU decodes in ~8 ms: a TPOT below that
# is refused at once as unattainable) and with a TTFT nothing sheds
TIGHT = {"x-slo-tpot-ms": "50", "x-slo-ttft-ms": "60000"}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("pd-cross-host")
    mesh = ManualMesh(tmp, tiny_model_dir, num_workers=0)
    mesh.nats = NatsServer(port=free_port(), config_path=None).start(log_path=tmp / "nats.log")
    mesh.port = free_port()
    try:
        mesh.add("coordinator", "coordinator").start()
        mesh.add("flow-scheduler", "flow-scheduler", NITSUM_FLOW_LINK_GBPS=LINK).start()
        mesh.add(
            "worker-p",
            "prefill-worker",
            NITSUM_WORKER_ID=PREFILL,
            NITSUM_DEVICE_INDEX="0",
            NITSUM_HOST_ID="host-a",
            NITSUM_FAULT_PREFILL_DELAY_MS=str(PREFILL_DELAY_MS),
        ).start()
        mesh.add(
            "worker-d", "decode-worker", NITSUM_WORKER_ID=DECODE, NITSUM_DEVICE_INDEX="1", NITSUM_HOST_ID="host-b"
        ).start()
        mesh.add("gateway", "gateway", NITSUM_GATEWAY_PORT=str(mesh.port), NITSUM_GATEWAY_HOST="127.0.0.1").start()
        mesh.wait_ready()
        mesh.wait_workers(2)
        yield mesh
    finally:
        mesh.stop()


def samples(mesh: ManualMesh, service: str, name: str) -> list[tuple[dict[str, str], float]]:
    text = urllib.request.urlopen(mesh.metrics_url(service), timeout=5).read().decode()
    out = []
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0])) if "{" in line else {}
            out.append((labels, float(line.rsplit(" ", 1)[1])))
    return out


def total(mesh: ManualMesh, service: str, name: str, **want: str) -> float:
    return sum(v for labels, v in samples(mesh, service, name) if all(labels.get(k) == x for k, x in want.items()))


async def run(url: str, batch: list[list[int]], headers: dict[str, str]):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        return await asyncio.gather(*(stream_completion(session, url, p, MAX_TOKENS, headers) for p in batch))


async def run_watching_progress(mesh: ManualMesh, batch: list[list[int]], headers: dict[str, str]):
    """`run`, and every LayerProgress and PrefillAdmission the workers publish meanwhile (as the flow-scheduler
    gets them)."""
    import nats

    seen: list[LayerProgress | PrefillAdmission] = []
    nc = await nats.connect(servers=[mesh.nats.url], allow_reconnect=False, connect_timeout=2)
    try:

        async def on_progress(msg) -> None:
            seen.append(decode(msg.data, (LayerProgress, PrefillAdmission)))

        await nc.subscribe("nitsum.flow.progress", cb=on_progress)
        await nc.flush()
        results = await run(mesh.url, batch, headers)
        await asyncio.sleep(0.5)
    finally:
        await nc.close()
    return results, seen


def test_pd_across_hosts_goes_over_tcp_in_the_permit_class(mesh, tiny_model_dir):
    batch = prompts(3, seed=21)
    expected = hybrid_reference(tiny_model_dir, batch, MAX_TOKENS)
    results, seen = asyncio.run(run_watching_progress(mesh, batch, LOOSE))
    for r, want in zip(results, expected):
        assert r.status == 200 and r.error is None, r
        assert r.token_ids == want  # every token once, in order, across the TCP hand-off
    # each request was reported at its admission (its TTFT deadline, a compute estimate), then as left
    admissions = [m for m in seen if isinstance(m, PrefillAdmission)]
    admitted = {rid: d for m in admissions for rid, d in zip(m.request_ids, m.ttft_deadlines_unix_ms)}
    assert sorted(admitted) == sorted(r.request_id for r in results)
    assert all(m.worker_id == PREFILL and all(c >= 0 for c in m.compute_ms) for m in admissions)
    assert sorted(rid for m in admissions for rid in m.left) == sorted(admitted)
    progress = [m for m in seen if isinstance(m, LayerProgress)]
    # each hand-off told the flow-scheduler its layer (the last of 4: computed), its deadline, and done
    assert sorted(p.unit_id for p in progress) == sorted(r.request_id for r in results)
    assert all(p.layer == 4 and p.done and len(p.request_deadlines_unix_ms) == 1 for p in progress), progress
    assert total(mesh, "worker-p", "nitsum_kv_transfers_total", purpose="pd", outcome="ok") == len(batch)
    assert total(mesh, "worker-d", "nitsum_kv_transfers_total", purpose="pd", outcome="failed") == 0
    sent = [(lab, v) for lab, v in samples(mesh, "worker-p", "nitsum_kv_tcp_bytes_total") if lab["direction"] == "sent"]
    assert sent and sum(v for _, v in sent) > 0
    table = dscp_table(8)
    for labels, _ in sent:
        # the socket that carried a flow is in the class of the level that flow went at
        assert labels["tos"] == str(tos_for_dscp(table[int(labels["level"])])), labels
    by_tos_sent: dict[str, float] = {}
    for labels, v in sent:
        by_tos_sent[labels["tos"]] = by_tos_sent.get(labels["tos"], 0.0) + v
    received = {
        lab["tos"]: v
        for lab, v in samples(mesh, "worker-d", "nitsum_kv_tcp_bytes_total")
        if lab["direction"] == "received" and lab["purpose"] == "pd"
    }
    assert received == by_tos_sent  # and the receiver saw the same classes on the wire, byte for byte
    # one flow per layer (tiny model: 4) per request, each permitted by the flow-scheduler
    assert total(mesh, "flow-scheduler", "nitsum_flow_permits_total", stage="3") >= 4 * len(batch)


def test_a_pruned_hand_off_is_retried_and_completes(mesh, tiny_model_dir):
    batch = prompts(1, seed=33)
    expected = hybrid_reference(tiny_model_dir, batch, MAX_TOKENS)
    pruned_before = total(mesh, "flow-scheduler", "nitsum_flow_pruned_total", stage="3")
    [result] = asyncio.run(run(mesh.url, batch, TIGHT))
    assert result.status == 200 and result.error is None, result
    assert result.token_ids == expected[0]  # nothing lost: re-run hybrid from the first token on
    assert total(mesh, "flow-scheduler", "nitsum_flow_pruned_total", stage="3") > pruned_before
    assert total(mesh, "worker-p", "nitsum_kv_transfers_total", purpose="pd", outcome="pruned") == 1
    assert total(mesh, "worker-p", "nitsum_flow_pruned_stopped_total") >= 1


def test_a_request_its_prefill_cannot_serve_in_time_is_pruned_on_arrival_and_completes(mesh, tiny_model_dir):
    """The prefill worker has measured its cost (every turn that computes prompt tokens takes at least 400 ms
    here, whatever the prompt), so a 43-token prompt is estimated at about 400 ms. With a 100 ms TTFT target
    (which the coordinator admits: its step table is this CPU's) the check on its arrival prunes it before its
    prefill; the gateway re-submits it and it completes hybrid, every token in order."""
    for prompt in prompts(2, seed=5):  # measured turns, one after another (the engine's first one is a warm-up)
        [warm] = asyncio.run(run(mesh.url, [prompt], LOOSE))
        assert warm.status == 200 and warm.error is None, warm
    victim = [[3 + (j * 13) % 250 for j in range(43)]]
    expected = hybrid_reference(tiny_model_dir, victim, MAX_TOKENS)
    pruned_before = total(mesh, "flow-scheduler", "nitsum_flow_admission_pruned_total")
    aborted_before = total(mesh, "worker-p", "nitsum_aborted_requests_total", reason="overload_pruned")
    handed_before = total(mesh, "worker-p", "nitsum_kv_transfers_total", purpose="pd", outcome="ok")
    [result] = asyncio.run(run(mesh.url, victim, {"x-slo-ttft-ms": "100", "x-slo-tpot-ms": "60000"}))
    assert result.status == 200 and result.error is None, result
    assert result.token_ids == expected[0]  # nothing lost: re-run hybrid from the start
    assert total(mesh, "flow-scheduler", "nitsum_flow_admission_pruned_total") == pruned_before + 1
    assert total(mesh, "worker-p", "nitsum_aborted_requests_total", reason="overload_pruned") == aborted_before + 1
    # it never got to a hand-off: pruned before its prefill, not after
    assert total(mesh, "worker-p", "nitsum_kv_transfers_total", purpose="pd", outcome="ok") == handed_before
