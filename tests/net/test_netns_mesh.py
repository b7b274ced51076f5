"""Two hosts for real: network namespaces A and B joined by a veth pair (10.231.0.x, nothing leaves the machine), each
with one member of a two-server NATS cluster and its own worker (own NITSUM_HOST_ID and node). Host A also runs the
gateway and the coordinator. Each host's worker has a /dev/shm of its own. A's worker is a prefill worker, B's a decode worker: every request is prefilled on A
and its KV handed to B over the TCP data plane across the veth (P/D between hosts), and B streams it on. A's
nats-server is SIGKILLed while requests stream: the gateway, the coordinator and A's worker move to B's server
across the veth, and every stream ends with exactly the tokens of the same greedy requests served before the fault.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nitsum.natscluster import Member, render_member_config, start_member_process
from nitsum.natsserver import free_port
from nitsum.transfer import netns

from .test_nats_cluster import _wait_log

ROOT = Path(__file__).resolve().parents[2]
_NETNS = netns.unavailable_reason()

pytestmark = [
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.timeout(400),
    pytest.mark.skipif(_NETNS is not None, reason=str(_NETNS)),
]


def _serve(prefix: list[str], service: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    from nitsum.up import _die_with_parent

    with open(log, "ab") as out:
        return subprocess.Popen(
            [*prefix, sys.executable, "-m", "nitsum.cli", "serve", service],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )


def _own_shm(prefix: list[str], host: str) -> list[str]:
    """Run in the host's namespace with a /dev/shm of its own (a private mount namespace with a fresh tmpfs):
    shared memory is per host, as on two machines, so nothing between the hosts can go through it."""
    mount = f'mount -t tmpfs -o size=256m nitsum-shm-{host} /dev/shm && exec "$@"'
    return [*prefix, "unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh"]


def _shm_source(pid: int) -> str:
    """The mount source of /dev/shm as process `pid` sees it (the last mount there: the one on top)."""
    source = ""
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        if fields[4] == "/dev/shm":
            source = fields[fields.index("-") + 2]
    return source


def _client(bed, url: str, nats_url: str, mid: int) -> subprocess.Popen:
    return subprocess.Popen(
        [
            *bed.exec_prefix(bed.ns_a),
            sys.executable,
            str(ROOT / "tests/net/mesh_client.py"),
            "--url",
            url,
            "--nats",
            nats_url,
            "--workers",
            "2",
            "--mid",
            str(mid),
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _metric_in(bed, ns: str, port: str, name: str, **labels: str) -> float:
    """A counter of a service inside namespace `ns` (its metrics listen there), summed over matching samples."""
    code = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/metrics', timeout=5).read().decode())"
    text = subprocess.run(
        [*bed.exec_prefix(ns), sys.executable, "-c", code], capture_output=True, text=True, timeout=30
    )
    assert text.returncode == 0, text.stderr[-2000:]
    total = 0.0
    for line in text.stdout.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            got = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0])) if "{" in line else {}
            if all(got.get(k) == v for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_host_a_nats_killed_mid_stream_nothing_lost(tmp_path, tiny_model_dir):
    with netns.veth_testbed(rate_mbit=1000.0, tag=f"{os.getpid() % 100000}m") as bed:
        a = Member("nats-a", bed.addr_a, 4222, 6222)
        b = Member("nats-b", bed.addr_b, 4222, 6222)
        procs: dict[str, subprocess.Popen] = {}
        route_pw = "rpw-" + os.urandom(6).hex()
        try:
            for m, ns in ((a, bed.ns_a), (b, bed.ns_b)):
                conf = tmp_path / f"{m.name}.conf"
                conf.write_text(render_member_config(m, [a, b], None, route_pw))
                procs[m.name] = start_member_process(conf, tmp_path / f"{m.name}.log", prefix=bed.exec_prefix(ns))
            for m in (a, b):
                _wait_log(tmp_path / f"{m.name}.log", "Server is ready", 15)
            _wait_log(tmp_path / "nats-a.log", "Route connection created", 15)
            base = {k: v for k, v in os.environ.items() if k != "OTEL_EXPORTER_OTLP_ENDPOINT"}
            base.update(
                {
                    "NITSUM_MODEL": str(tiny_model_dir),
                    "NITSUM_RUN_DIR": str(tmp_path),
                    "PYTHONUNBUFFERED": "1",
                    "NITSUM_HEARTBEAT_INTERVAL_MS": "200",
                    "NITSUM_HEARTBEAT_TIMEOUT_MS": "1500",
                    "NITSUM_STREAM_TIMEOUT_S": "5",
                    "NITSUM_READY_TIMEOUT_S": "2",
                }
            )
            on_a, on_b = f"{a.url},{b.url}", f"{b.url},{a.url}"
            port = free_port()
            pa, pb = bed.exec_prefix(bed.ns_a), bed.exec_prefix(bed.ns_b)

            def env(**extra):
                return {**base, "NITSUM_METRICS_PORT": str(free_port()), **extra}

            procs["coordinator"] = _serve(pa, "coordinator", env(NITSUM_NATS_URL=on_a), tmp_path / "coordinator.log")
            worker_env = {}
            procs["worker-a"] = _serve(
                _own_shm(pa, "a"),
                "prefill-worker",
                worker_env.setdefault(
                    "a",
                    env(
                        NITSUM_NATS_URL=on_a,
                        NITSUM_WORKER_ID="host-a-0",
                        NITSUM_NODE_ID="node-a",
                        NITSUM_HOST_ID="host-a",
                        NITSUM_KV_ADVERTISE_ADDR=bed.addr_a,
                    ),
                ),
                tmp_path / "worker-a.log",
            )
            procs["worker-b"] = _serve(
                _own_shm(pb, "b"),
                "decode-worker",
                worker_env.setdefault(
                    "b",
                    env(
                        NITSUM_NATS_URL=on_b,
                        NITSUM_WORKER_ID="host-b-0",
                        NITSUM_NODE_ID="node-b",
                        NITSUM_HOST_ID="host-b",
                        NITSUM_KV_ADVERTISE_ADDR=bed.addr_b,
                    ),
                ),
                tmp_path / "worker-b.log",
            )
            procs["gateway"] = _serve(
                pa,
                "gateway",
                env(NITSUM_NATS_URL=on_a, NITSUM_GATEWAY_PORT=str(port), NITSUM_GATEWAY_HOST="127.0.0.1"),
                tmp_path / "gateway.log",
            )
            url = f"http://127.0.0.1:{port}"

            ref = _client(bed, url, on_a, mid=10**6)
            out, err = ref.communicate(timeout=200)
            assert ref.returncode == 0, err[-3000:]
            reference = json.loads(out.strip().splitlines()[-1])["results"]
            # each host's worker has its own shared memory (the process behind Popen is the worker: each step execs;
            # read once it served, so past the mount)
            shm_sources = {h: _shm_source(procs[f"worker-{h}"].pid) for h in ("a", "b")}
            assert all(r["status"] == 200 and r["error"] is None and len(r["tokens"]) == 120 for r in reference), (
                reference
            )

            run = _client(bed, url, on_a, mid=10)
            mid = json.loads(run.stdout.readline())
            assert mid["event"] == "mid", mid
            procs["nats-a"].kill()  # host A's NATS server dies under the streams
            procs["nats-a"].wait()
            out, err = run.communicate(timeout=200)
            assert run.returncode == 0, err[-3000:]
            results = json.loads(out.strip().splitlines()[-1])["results"]
            alive = {name: p.poll() is None for name, p in procs.items() if name != "nats-a"}
            port_a, port_b = worker_env["a"]["NITSUM_METRICS_PORT"], worker_env["b"]["NITSUM_METRICS_PORT"]
            handed = _metric_in(bed, bed.ns_a, port_a, "nitsum_kv_transfers_total", purpose="pd", outcome="ok")
            tcp_sent = _metric_in(bed, bed.ns_a, port_a, "nitsum_kv_tcp_bytes_total", purpose="pd", direction="sent")
            tcp_got = _metric_in(bed, bed.ns_b, port_b, "nitsum_kv_tcp_bytes_total", purpose="pd", direction="received")
        finally:
            for _name, p in reversed(list(procs.items())):
                if p.poll() is None:
                    p.terminate()
                    try:
                        p.wait(timeout=20)
                    except subprocess.TimeoutExpired:
                        p.kill()
                        p.wait()
    assert shm_sources == {"a": "nitsum-shm-a", "b": "nitsum-shm-b"}, shm_sources
    for ref_r, got in zip(reference, results):
        assert got["status"] == 200 and got["error"] is None, got
        assert got["tokens"] == ref_r["tokens"]
    assert all(alive.values()), alive
    # every request (3 for the reference, 3 across the fault) prefilled on A, decoded on B, its KV over the veth
    assert handed == len(reference) + len(results), handed
    assert tcp_sent > 0 and tcp_got == tcp_sent, (tcp_sent, tcp_got)
    assert "Authorization Violation" not in (tmp_path / "nats-b.log").read_text()
    for name in ("gateway", "coordinator", "worker-a"):
        assert f"reconnected to NATS at {bed.addr_b}:4222" in (tmp_path / f"{name}.log").read_text(), name
