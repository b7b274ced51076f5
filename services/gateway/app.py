"""The gateway's aiohttp application: its routes (every one listed in ROUTES, the inventory the API-key test
reads), the API-key middleware and the JSON errors for requests no route takes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from nitsum.httpauth import auth_middleware, json_error

if TYPE_CHECKING:
    from nitsum_services.gateway.main import Gateway


ROUTES = (
    ("POST", "/v1/chat/completions", "chat_completions"),
    ("POST", "/v1/completions", "completions"),
    ("GET", "/v1/models", "models"),
    ("GET", "/health", "health"),
    ("GET", "/ready", "ready"),
    ("GET", "/metrics", "metrics"),
    ("GET", "/openapi.json", "openapi"),
)


def build_app(gateway: Gateway, api_keys: tuple[str, ...]) -> web.Application:
    app = web.Application(
        middlewares=[auth_middleware(api_keys), _error_middleware], client_max_size=gateway.config.max_body_bytes
    )
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, getattr(gateway, handler))
    return app


@web.middleware
async def _error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge as exc:
        refusal = json_error(
            413, f"the request body is over the limit ({exc.text})", "invalid_request_error", "body_too_large"
        )
        refusal.force_close()  # the rest of the body is never read
        return refusal
    except web.HTTPNotFound:
        return json_error(404, f"no route {request.method} {request.path}", "invalid_request_error", "not_found")
    except web.HTTPMethodNotAllowed:
        return json_error(
            405,
            f"method {request.method} is not allowed on {request.path}",
            "invalid_request_error",
            "method_not_allowed",
        )
