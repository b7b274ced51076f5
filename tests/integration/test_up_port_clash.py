"""`nitsum up` probes a free port for each child's /metrics, but a probe reserves nothing: another program can
bind the port before the child does. The child then cannot start; `nitsum up` starts it again on a new port
instead of giving up on the whole mesh (seen on a shared machine: worker-3's port taken by a test run)."""

from __future__ import annotations

import os
import socket
import time
import urllib.request

from nitsum.natsserver import free_port
from nitsum.up import Child, _wait_ready


def test_a_child_whose_metrics_port_was_taken_starts_again_on_another(nats_server, tmp_path):
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("0.0.0.0", 0))
    squatter.listen(1)
    taken = squatter.getsockname()[1]
    env = {**os.environ, "NITSUM_NATS_URL": nats_server.url, "NITSUM_METRICS_PORT": str(taken), "PYTHONUNBUFFERED": "1"}
    child = Child("coordinator", "coordinator", env, tmp_path / "coordinator.log")
    child.start()
    try:
        # Nothing serves this URL: _wait_ready runs to its deadline, restarting the child on the way (the first
        # start fails at its bind, a second or two after it began; 10 s leaves room for a loaded machine).
        code = _wait_ready([child], f"http://127.0.0.1:{free_port()}", "", 10.0, {"flag": False}, tmp_path)
        assert code == 1
        log = child.log_path.read_text()
        assert "address already in use" in log and f", {taken})" in log, log  # the first start did fail on it
        assert child.port_retries == 1
        port = int(child.env["NITSUM_METRICS_PORT"])
        assert port != taken
        assert child.process.poll() is None, log  # the second start is running
        assert (tmp_path / "processes.json").read_text() == f'{{"coordinator": {child.process.pid}}}'
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
                    assert resp.status == 200
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    finally:
        squatter.close()
        if child.process.poll() is None:
            child.process.terminate()
            child.process.wait(timeout=20)


def test_a_failure_that_is_not_a_port_clash_is_not_retried(nats_server, tmp_path):
    env = {
        **os.environ,
        "NITSUM_NATS_URL": nats_server.url,
        "NITSUM_METRICS_PORT": str(free_port()),
        "NITSUM_HEARTBEAT_TIMEOUT_MS": "-5",
    }  # a bad setting: the child exits at once, with a clear error
    child = Child("coordinator", "coordinator", env, tmp_path / "coordinator.log")
    child.start()
    try:
        assert _wait_ready([child], f"http://127.0.0.1:{free_port()}", "", 60.0, {"flag": False}, tmp_path) == 1
        assert child.process.poll() is not None and child.port_retries == 0
        assert "NITSUM_HEARTBEAT_TIMEOUT_MS" in child.log_path.read_text()
    finally:
        if child.process.poll() is None:
            child.process.kill()
            child.process.wait()


def test_free_ports_lie_below_the_ephemeral_range():
    """Listener ports (gateway, NATS, /metrics) are picked where the kernel never takes a local port for an
    outgoing connection (seen: a gateway port probed free, then taken by some connection before the bind)."""
    from nitsum.natsserver import LOWEST_PICKED_PORT, ephemeral_low

    low = ephemeral_low()
    for _ in range(20):
        port = free_port()
        if low - LOWEST_PICKED_PORT > 1000:
            assert LOWEST_PICKED_PORT <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free indeed


def test_the_node_worlds_port_span_lies_below_the_ephemeral_range():
    """The rendezvous ports are picked where the kernel never takes a local port for an outgoing connection
    (a NATS client or gloo pair could otherwise take one between the probe and the bind: EADDRINUSE)."""
    from nitsum.config import NODE_PORT_SPAN
    from nitsum.natsserver import ephemeral_low
    from nitsum.up import _free_port_span, _port_free

    low = ephemeral_low()
    for _ in range(5):
        base = _free_port_span()
        if low - NODE_PORT_SPAN > 10000:
            assert 10000 <= base and base + NODE_PORT_SPAN <= low
        assert all(_port_free(base + i) for i in range(NODE_PORT_SPAN))


def test_ports_picked_in_one_process_never_collide(monkeypatch):
    """A probe reserves nothing, so `nitsum up` remembers what it handed out: a metrics port never lands inside a
    node world's rendezvous span picked before it (the world's TCPStore failed with EADDRINUSE in a CI run), and a
    span never takes a port handed out before it. Checked on a crowded range: every pick from 4,001 ports, of which
    the picks take 360 (with 1,001 the last spans now and then found no 16 unclaimed ports in a row among 200 random
    tries: a test of luck, not of the rule)."""
    from nitsum import natsserver
    from nitsum.config import NODE_PORT_SPAN
    from nitsum.up import _free_port_span

    lowest = natsserver.LOWEST_PICKED_PORT
    width = 4001
    monkeypatch.setattr(natsserver, "ephemeral_low", lambda: lowest + width)
    before = set(natsserver.HANDED_OUT)
    natsserver.HANDED_OUT.clear()
    try:
        picks = []
        for _ in range(10):
            base = _free_port_span()
            picks += list(range(base, base + NODE_PORT_SPAN))
            picks += [natsserver.free_port() for _ in range(20)]
        assert len(picks) == len(set(picks))
        assert set(picks) == natsserver.HANDED_OUT
        assert all(lowest <= p < lowest + width for p in picks)
    finally:
        natsserver.HANDED_OUT.clear()
        natsserver.HANDED_OUT.update(before)
