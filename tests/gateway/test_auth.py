"""API keys: every route but /health needs one; the inventory is read from the app, so a new route is covered."""

from __future__ import annotations

import aiohttp
import pytest

from nitsum.httpauth import OPEN_ROUTES, key_matches
from nitsum_services.gateway.app import ROUTES

pytestmark = pytest.mark.timeout(120)


async def _call(url, method, path, key=None):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url + path, headers=headers, data=b"{}") as resp:
            return resp.status, await resp.text()


async def test_every_route_but_health_needs_a_key(keyed_gateway_url):
    assert OPEN_ROUTES == {"/health"}
    for method, path, _ in ROUTES:
        for key in (None, "sk-wrong", ""):
            status, text = await _call(keyed_gateway_url, method, path, key)
            if path in OPEN_ROUTES:
                assert status == 200, path
            else:
                assert status == 401, (method, path, key, status)
                assert '"invalid_api_key"' in text
                assert "sk-test" not in text


async def test_a_valid_key_passes(keyed_gateway_url):
    for key in ("sk-test-1", "sk-test-2"):
        status, _ = await _call(keyed_gateway_url, "GET", "/v1/models", key)
        assert status == 200
        status, text = await _call(keyed_gateway_url, "GET", "/metrics", key)
        assert status == 200 and "nitsum_requests_total" in text


def test_route_inventory_matches_the_application():
    """If someone adds a route to the app without listing it in ROUTES, this fails."""
    from nitsum_services.gateway.app import build_app

    class _Stub:
        config = type("C", (), {"max_body_bytes": 1024})()

        def __getattr__(self, name):
            async def handler(request):
                raise AssertionError("not called")

            return handler

    app = build_app(_Stub(), ("k",))
    registered = {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"}
    assert registered == {(m, p) for m, p, _ in ROUTES}


def test_key_comparison():
    assert key_matches("a", ("b", "a"))
    assert not key_matches("a", ())
    assert not key_matches("ab", ("a",))
    assert not key_matches("", ("a",))
