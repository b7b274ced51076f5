"""Bad input as `ApiError` (the HTTP status and OpenAI's error fields) and the typed readers of one body field
that raise it (protocol.py, sampling.py). Pure: no I/O."""

from __future__ import annotations

import math
from typing import Any

MAX_TOKEN_ID = 1 << 31
MAX_INT_OPTION = 1 << 20  # bound of max_tokens and top_k (a sanity limit; the context bounds max_tokens further)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str = "invalid_request",
        type_: str = "invalid_request_error",
        headers: dict | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_
        self.headers = headers or {}


def _bad(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, param)


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(f"'{name}' must be a number", name)
    if not lo <= value <= hi:
        raise _bad(f"'{name}' must be between {lo} and {hi}, got {value}", name)
    return float(value)


def _integer(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"'{name}' must be an integer", name)
    if not lo <= value <= hi:
        raise _bad(f"'{name}' must be between {lo} and {hi}, got {value}", name)
    return value


def _boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(f"'{name}' must be a boolean", name)
    return value


def _token_ids(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < MAX_TOKEN_ID for t in value
    ):
        raise _bad(f"'{name}' must be a list of non-negative token ids", name)
    return tuple(value)
