"""A real gateway process (`nitsum serve gateway`) on a real nats-server, with no worker behind it:
input validation and auth happen before anything reaches the mesh."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import pytest

from nitsum.natsserver import NatsServer, free_port


def _start_gateway(tmp_path, nats_url: str, model_dir, extra_env: dict | None = None):
    port = free_port()
    env = dict(os.environ)
    env.update(
        {
            "NITSUM_NATS_URL": nats_url,
            "NITSUM_GATEWAY_PORT": str(port),
            "NITSUM_GATEWAY_HOST": "127.0.0.1",
            "NITSUM_MODEL": str(model_dir),
            "NITSUM_RUN_DIR": str(tmp_path),
            "NITSUM_READY_TIMEOUT_S": "1",
        }
    )
    env.update(extra_env or {})
    log = open(tmp_path / f"gateway-{port}.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "nitsum.cli", "serve", "gateway"], env=env, stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError((tmp_path / f"gateway-{port}.log").read_text())
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("gateway did not start")


@pytest.fixture(scope="module")
def bare_nats(tmp_path_factory):
    server = NatsServer(port=free_port(), config_path=None).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory, bare_nats, tiny_model_dir):
    proc, url = _start_gateway(tmp_path_factory.mktemp("gw"), bare_nats.url, tiny_model_dir)
    yield url
    proc.terminate()
    # A gateway's stop can take the bus's two drain bounds (5 s each) when NATS is slow to answer a drain
    # (seen intermittently on a loaded machine): wait past them rather than fail the module's last test.
    proc.wait(30)


@pytest.fixture(scope="module")
def keyed_gateway_url(tmp_path_factory, bare_nats, tiny_model_dir):
    proc, url = _start_gateway(
        tmp_path_factory.mktemp("gwk"), bare_nats.url, tiny_model_dir, {"NITSUM_API_KEYS": "sk-test-1,sk-test-2"}
    )
    yield url
    proc.terminate()
    # A gateway's stop can take the bus's two drain bounds (5 s each) when NATS is slow to answer a drain
    # (seen intermittently on a loaded machine): wait past them rather than fail the module's last test.
    proc.wait(30)
