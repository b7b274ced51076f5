"""KV reuse (stage 1) on the live CPU mesh: a worker that lacks a prefix another worker caches fetches those
blocks instead of computing them. Placement is pinned by submitting to the coordinator directly with
`exclude_workers`; outputs equal the hybrid path's and the fetching worker computes only the rest."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest

from nitsum.wire.codec import decode, encode
from nitsum.wire.messages import SamplingSpec, SubmitReply, SubmitRequest, TokenChunk
from tests.e2e.harness import ManualMesh
from tests.e2e.test_pd_disagg import hybrid_reference, latest_stats, metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

W0, W1 = "node0-0", "node0-1"
MAX_TOKENS = 8


async def run_on(nats_url: str, request_id: str, prompt: list[int], exclude: tuple[str, ...]) -> tuple[str, list[int]]:
    """Submit like a gateway would, with `exclude` steering placement; (worker, token ids) once finished."""
    import nats

    nc = await nats.connect(servers=[nats_url], allow_reconnect=False, connect_timeout=2)
    tokens: list[int] = []
    done = asyncio.Event()

    async def on_chunk(msg):
        chunk = decode(msg.data, TokenChunk)
        assert not chunk.error_code, chunk
        assert chunk.index == len(tokens), chunk  # in order, none repeated, none missing
        tokens.extend(chunk.token_ids)
        if chunk.finished:
            done.set()

    try:
        subject = f"nitsum.stream.*.{request_id}"  # from whichever worker runs it
        await nc.subscribe(subject, cb=on_chunk)
        req = SubmitRequest(
            request_id=request_id,
            prompt_token_ids=tuple(prompt),
            sampling=SamplingSpec(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
            tier="interactive",
            ttft_ms=10_000.0,
            tpot_ms=1_000.0,
            weight=1.0,
            arrival_unix_ms=time.time() * 1000.0,
            stream_subject=subject,
            exclude_workers=exclude,
        )
        reply = decode((await nc.request("nitsum.req.submit", encode(req), timeout=10)).data, SubmitReply)
        assert reply.accepted, reply
        await asyncio.wait_for(done.wait(), timeout=60)
    finally:
        await nc.close()
    return reply.worker_id, tokens


@pytest.fixture(params=["one-host", "two-hosts"])
def mesh2(request, tmp_path, tiny_model_dir):
    mesh = ManualMesh(tmp_path, tiny_model_dir, num_workers=2)
    if request.param == "two-hosts":  # NITSUM_HOST_ID apart: the prefix blocks go over TCP, not shared memory
        hosts = ("host-a", "host-b")
        mesh.add_worker = lambda i: mesh.add(
            f"worker-{i}",
            "decode-worker",
            NITSUM_WORKER_ID=f"node0-{i}",
            NITSUM_DEVICE_INDEX=str(i),
            NITSUM_HOST_ID=hosts[i],
        )
    mesh.two_hosts = request.param == "two-hosts"
    mesh.start()
    mesh.add("flow-scheduler", "flow-scheduler").start()
    # Up before the test's fetch asks it for permits (else the worker falls back to the lowest level, unscheduled).
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(mesh.metrics_url("flow-scheduler"), timeout=2).read()
            break
        except OSError:
            assert time.monotonic() < deadline, "the flow-scheduler did not start"
            time.sleep(0.2)
    yield mesh
    mesh.stop()


def test_a_worker_fetches_a_cached_prefix_instead_of_computing_it(mesh2, tiny_model_dir):
    prefix = [3 + (j * 13) % 250 for j in range(64)]  # 4 full blocks of 16
    first = prefix + [7, 8, 9, 10, 11]
    second = prefix + [200, 201, 202, 203, 204, 205, 206, 207, 208, 209]
    expected = hybrid_reference(tiny_model_dir, [first, second], MAX_TOKENS)
    before = asyncio.run(latest_stats(mesh2.nats.url, (W0, W1)))

    worker, tokens = asyncio.run(run_on(mesh2.nats.url, "reuse-a", first, exclude=(W1,)))
    assert (worker, tokens) == (W0, expected[0])
    # The coordinator learns W0's cached hashes from its next heartbeats (every 200 ms here).
    deadline = time.monotonic() + 10
    while (
        time.monotonic() < deadline
        and len(asyncio.run(latest_stats(mesh2.nats.url, (W0,)))[W0].cached_block_hashes) < 4
    ):
        time.sleep(0.2)
    time.sleep(0.5)

    worker, tokens = asyncio.run(run_on(mesh2.nats.url, "reuse-b", second, exclude=(W0,)))
    assert (worker, tokens) == (W1, expected[1])
    after = asyncio.run(latest_stats(mesh2.nats.url, (W0, W1)))[W1]
    assert after.num_reused_blocks - before[W1].num_reused_blocks == 4
    assert after.num_cached_prompt_tokens - before[W1].num_cached_prompt_tokens == 64
    # only the 10 tokens after the fetched prefix were computed (74 without the fetch)
    assert after.num_prefill_tokens_computed - before[W1].num_prefill_tokens_computed == len(second) - 64
    assert metric(mesh2, "worker-0", "nitsum_kv_transfers_total", purpose="reuse", outcome="ok") == 1
    tcp_sent = metric(mesh2, "worker-0", "nitsum_kv_tcp_bytes_total", purpose="reuse", direction="sent")
    tcp_received = metric(mesh2, "worker-1", "nitsum_kv_tcp_bytes_total", purpose="reuse", direction="received")
    if mesh2.two_hosts:  # 4 layers of 4 blocks, every byte over TCP, as many received as sent
        assert tcp_sent > 0 and tcp_received == tcp_sent
    else:
        assert tcp_sent == 0 and tcp_received == 0
    assert (
        metric(mesh2, "flow-scheduler", "nitsum_flow_permits_total", stage="1")
        - metric(mesh2, "flow-scheduler", "nitsum_flow_promotions_total", stage="1")
        == 4
    )
