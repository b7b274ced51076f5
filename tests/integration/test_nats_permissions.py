"""NATS least privilege: one identity per service; anonymous refused; only admin publishes admin subjects."""

from __future__ import annotations

import asyncio

import nats
import pytest
from nats.errors import Error as NatsError

from nitsum.natsserver import IDENTITIES, permissions


async def _connect(url, user=None, password=None, errors=None):
    async def on_error(exc):
        if errors is not None:
            errors.append(str(exc))

    return await nats.connect(servers=[url], user=user, password=password, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2, error_cb=on_error)


async def test_anonymous_and_wrong_password_are_refused(secured_nats):
    server, passwords = secured_nats
    with pytest.raises((NatsError, OSError, Exception)) as info:
        await _connect(server.url)
    assert "Authorization" in str(info.value) or "authorization" in str(info.value).lower()
    with pytest.raises(Exception):
        await _connect(server.url, "gateway", "wrong-password")


async def _publish_denied(nc, errors, subject) -> bool:
    errors.clear()
    await nc.publish(subject, b"{}")
    await nc.flush(timeout=2)
    await asyncio.sleep(0.15)
    return any("permissions violation for publish" in e.lower() for e in errors)


@pytest.mark.parametrize("identity", [i for i in IDENTITIES if i != "admin"])
async def test_only_admin_may_publish_admin_subjects(secured_nats, identity):
    server, passwords = secured_nats
    errors: list[str] = []
    nc = await _connect(server.url, identity, passwords[identity], errors)
    try:
        assert await _publish_denied(nc, errors, "nitsum.admin.status")
        assert await _publish_denied(nc, errors, "nitsum.admin.set-policy")
    finally:
        await nc.close()


async def test_admin_may_publish_admin_but_not_request_path(secured_nats):
    server, passwords = secured_nats
    errors: list[str] = []
    nc = await _connect(server.url, "admin", passwords["admin"], errors)
    try:
        assert not await _publish_denied(nc, errors, "nitsum.admin.status")
        assert await _publish_denied(nc, errors, "nitsum.req.submit")
        assert await _publish_denied(nc, errors, "nitsum.stream.abc")
    finally:
        await nc.close()


@pytest.mark.parametrize(
    "identity, allowed, denied",
    [
        ("gateway", ["nitsum.req.submit", "nitsum.req.abort"], ["nitsum.stream.x", "nitsum.stats.worker", "nitsum.worker.w.run"]),
        ("worker", ["nitsum.stream.x", "nitsum.stats.worker"], ["nitsum.req.submit", "nitsum.worker.w.run", "nitsum.event.worker_lost"]),
        ("coordinator", ["nitsum.worker.w.run", "nitsum.event.worker_lost"], ["nitsum.stream.x", "nitsum.stats.worker"]),
        ("flow-scheduler", ["nitsum.flow.permit.w"], ["nitsum.req.submit", "nitsum.stream.x"]),
    ],
)
async def test_each_identity_publishes_only_its_subjects(secured_nats, identity, allowed, denied):
    server, passwords = secured_nats
    errors: list[str] = []
    nc = await _connect(server.url, identity, passwords[identity], errors)
    try:
        for subject in allowed:
            assert not await _publish_denied(nc, errors, subject), subject
        for subject in denied:
            assert await _publish_denied(nc, errors, subject), subject
    finally:
        await nc.close()


async def test_subscribe_permissions(secured_nats):
    server, passwords = secured_nats
    errors: list[str] = []
    nc = await _connect(server.url, "gateway", passwords["gateway"], errors)
    try:
        await nc.subscribe("nitsum.stats.worker")
        await nc.flush(timeout=2)
        await asyncio.sleep(0.15)
        assert any("permissions violation for subscription" in e.lower() for e in errors), errors
    finally:
        await nc.close()


def test_every_identity_has_rules():
    perms = permissions("nitsum")
    assert set(perms) == set(IDENTITIES)
    assert all(not any(s.startswith("nitsum.admin") for s in p["publish"]) for name, p in perms.items() if name != "admin")
