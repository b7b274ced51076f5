"""A whole mesh on a two-server NATS cluster: the server the gateway and one worker use is SIGKILLed while
requests stream; both move to the other member, and every stream completes with exactly the tokens of the same
greedy requests served before the fault (nothing lost, nothing doubled; a gap re-routes from the last token).

Real processes (gateway, coordinator, worker with the tiny model), real nats-servers joined by a route.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from nitsum.natscluster import LocalCluster
from nitsum.natsserver import NatsServer, free_port
from tests.e2e.harness import ManualMesh, prompts, stream_completion

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MAX_TOKENS = 120


class ClusterMesh(ManualMesh):
    """ManualMesh whose services each get their own ordered NITSUM_NATS_URL list over the cluster's members."""

    cluster: LocalCluster | None = None

    def start_on(self, cluster: LocalCluster, lists: dict[str, str]) -> ClusterMesh:
        self.cluster = cluster
        first = cluster.members[1]  # admin calls go to the member that stays up
        self.nats = NatsServer(port=first.client_port, config_path=None)
        self.port = free_port()
        self.add("coordinator", "coordinator", NITSUM_NATS_URL=lists["coordinator"]).start()
        for i, urls in enumerate(lists["workers"]):
            self.add(
                f"worker-{i}",
                "decode-worker",
                NITSUM_WORKER_ID=f"node0-{i}",
                NITSUM_DEVICE_INDEX=str(i),
                NITSUM_NATS_URL=urls,
            ).start()
        self.add(
            "gateway",
            "gateway",
            NITSUM_GATEWAY_PORT=str(self.port),
            NITSUM_GATEWAY_HOST="127.0.0.1",
            NITSUM_NATS_URL=lists["gateway"],
        ).start()
        self.wait_ready()
        self.wait_workers(len(lists["workers"]))
        return self

    def stop(self) -> None:
        for svc in reversed(list(self.services.values())):
            svc.stop()


async def _streams(url: str, batch, on_token=None):
    """Stream the batch; `on_token(i, n)` when stream i has n tokens."""

    def tracker(i):
        return None if on_token is None else (lambda n: on_token(i, n))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        return await asyncio.gather(
            *(stream_completion(session, url, p, MAX_TOKENS, on_token=tracker(i)) for i, p in enumerate(batch))
        )


def test_mesh_streams_through_the_loss_of_the_gateways_nats_server(tmp_path, tiny_model_dir):
    cluster = LocalCluster(tmp_path, None, size=2).start()
    a, b = cluster.members
    mesh = ClusterMesh(tmp_path, tiny_model_dir, num_workers=2, env_extra={"NITSUM_STREAM_TIMEOUT_S": "5"})
    try:
        # The gateway and worker-0 on member a (killed below), the coordinator and worker-1 on member b.
        lists = {
            "gateway": f"{a.url},{b.url}",
            "coordinator": f"{b.url},{a.url}",
            "workers": [f"{a.url},{b.url}", f"{b.url},{a.url}"],
        }
        mesh.start_on(cluster, lists)
        assert (cluster.server_of("gateway"), cluster.server_of("coordinator")) == (0, 1)
        batch = prompts(3, seed=5)
        reference = asyncio.run(_streams(mesh.url, batch))
        assert all(r.status == 200 and r.error is None and len(r.token_ids) == MAX_TOKENS for r in reference), reference

        async def through_the_kill():
            killed = {"at": None}
            counts = [0] * len(batch)

            def on_token(i, n):
                counts[i] = n
                # Mid-stream for every request (all were placed: a submit the dying server swallows is answered
                # 503 coordinator_unavailable with Retry-After, which is not what this test is about).
                if min(counts) >= 10 and killed["at"] is None:
                    killed["at"] = list(counts)
                    cluster.kill(0)  # the gateway's and worker-0's server

            results = await _streams(mesh.url, batch, on_token=on_token)
            return results, killed["at"]

        results, killed_at = asyncio.run(through_the_kill())
        assert killed_at is not None
        for ref, got in zip(reference, results):
            assert got.status == 200 and got.error is None, got
            assert got.token_ids == ref.token_ids, (got.request_id, len(got.token_ids))
        # Everyone is on the surviving member now, and the mesh still serves new requests.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and cluster.server_of("gateway") != 1:
            time.sleep(0.1)
        assert cluster.server_of("gateway") == 1
        again = asyncio.run(_streams(mesh.url, batch[:1]))[0]
        assert again.status == 200 and again.token_ids == reference[0].token_ids
        assert all(svc.process.poll() is None for svc in mesh.services.values())
    finally:
        mesh.stop()
        cluster.stop()
