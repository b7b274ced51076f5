"""Fixtures shared by every test directory: a real nats-server on a free port, free ports, the tiny model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nitsum.natsserver import NatsServer, free_port, new_passwords, render_config, write_secure

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def nats_server(tmp_path):
    """A plain nats-server (no auth) on a free loopback port, stopped after the test."""
    server = NatsServer(port=free_port(), config_path=None).start(log_path=tmp_path / "nats.log")
    yield server
    server.stop()


@pytest.fixture
def secured_nats(tmp_path):
    """A nats-server with nitsum's per-service identities; yields (server, passwords)."""
    port = free_port()
    passwords = new_passwords()
    config = tmp_path / "nats.conf"
    write_secure(config, render_config(port, passwords))
    server = NatsServer(port=port, config_path=config).start(log_path=tmp_path / "nats.log")
    yield server, passwords
    server.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The deterministic tiny checkpoint, written once per test session."""
    from nitsum.model.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-shared") / "tiny")


@pytest.fixture
def nitsum_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("NITSUM_HOME", str(home))
    return home


def pytest_report_header(config):
    shared = REPO.parent / "shared" / "traces"
    return f"nitsum: shared traces {'found at ' + str(shared) if shared.exists() else 'absent (committed excerpts are used)'}; cpu count {os.cpu_count()}"
