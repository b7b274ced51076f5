"""Bearer-key authentication shared by every HTTP surface (gateway routes and service /metrics).

Keys are compared in constant time (hmac.compare_digest against every configured key, no early exit),
and the key is never logged. Routes listed in `OPEN_ROUTES` need no key.
"""

from __future__ import annotations

import hmac
import json

from aiohttp import web

OPEN_ROUTES = frozenset({"/health"})


def key_matches(presented: str, keys: tuple[str, ...]) -> bool:
    ok = False
    candidate = presented.encode()
    for key in keys:
        # Every key is compared (no short-circuit) so timing does not reveal which prefix matched.
        ok |= hmac.compare_digest(candidate, key.encode())
    return ok


def error_body(message: str, type_: str, code: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def json_error(
    status: int, message: str, type_: str, code: str, param: str | None = None, headers: dict | None = None
) -> web.Response:
    return web.Response(
        status=status,
        text=json.dumps(error_body(message, type_, code, param)),
        content_type="application/json",
        headers=headers,
    )


def auth_middleware(keys: tuple[str, ...]):
    @web.middleware
    async def middleware(request: web.Request, handler):
        if keys and request.path not in OPEN_ROUTES:
            header = request.headers.get("Authorization", "")
            scheme, _, presented = header.partition(" ")
            if scheme.lower() != "bearer" or not presented or not key_matches(presented.strip(), keys):
                return json_error(
                    401,
                    "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                    "authentication_error",
                    "invalid_api_key",
                )
        return await handler(request)

    return middleware
