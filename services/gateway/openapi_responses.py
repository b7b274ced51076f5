"""The response side of the OpenAPI description (openapi.py): errors, usage, completions and chat
completions, whole and as server-sent chunks."""

from __future__ import annotations

from nitsum_services.gateway.openapi_requests import _TOKEN_ID

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": "string", "nullable": True},
                "code": {"type": "string", "nullable": True},
            },
        }
    },
}

_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {"type": "object"},
    },
}


def _errors(*codes: int) -> dict:
    return {str(c): {"description": "error", "content": {"application/json": {"schema": _ERROR}}} for c in codes}


_FINISH_REASON = {"type": "string", "enum": ["stop", "length", "abort"], "nullable": True}
_CHOICE_COMMON = {
    "index": {"type": "integer", "minimum": 0},
    "finish_reason": _FINISH_REASON,
    "logprobs": {"nullable": True},
    "token_ids": {"type": "array", "items": _TOKEN_ID},
}


def _response(object_name: str, choice_props: dict, choice_required: list[str], usage_required: bool) -> dict:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", *(["usage"] if usage_required else [])],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": [object_name]},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["index", *choice_required],
                    "properties": {**_CHOICE_COMMON, **choice_props},
                },
            },
            "usage": _USAGE,
        },
    }


_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {"role": {"type": "string", "enum": ["assistant"]}, "content": {"type": "string"}},
}
_DELTA = {
    "type": "object",
    "properties": {"role": {"type": "string", "enum": ["assistant"]}, "content": {"type": "string"}},
}
_COMPLETION = _response("text_completion", {"text": {"type": "string"}}, ["text", "finish_reason"], True)
_COMPLETION_CHUNK = _response("text_completion", {"text": {"type": "string"}}, ["text", "finish_reason"], False)
_CHAT = _response("chat.completion", {"message": _MESSAGE}, ["message", "finish_reason"], True)
_CHAT_CHUNK = _response("chat.completion.chunk", {"delta": _DELTA}, ["delta", "finish_reason"], False)


def _sse_event(chunk_schema: dict) -> dict:
    """One server-sent event (OpenAPI 3.0: the schema of text/event-stream describes each event): its data
    is a JSON chunk, a JSON error (a failure after the stream started) or the final `[DONE]`."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "type": "string",
                "anyOf": [
                    {"enum": ["[DONE]"]},
                    {"contentMediaType": "application/json", "contentSchema": {"anyOf": [chunk_schema, _ERROR]}},
                ],
            }
        },
    }


def _generation_responses(body: dict, chunk_schema: dict) -> dict:
    return {
        "200": {
            "description": "the completion (JSON), or an SSE stream of chunks when stream is true (with stream_options.include_usage a last chunk carries usage; then `data: [DONE]`)",
            "content": {
                "application/json": {"schema": body},
                "text/event-stream": {"schema": _sse_event(chunk_schema)},
            },
        },
        **_errors(400, 401, 404, 413, 429, 500, 503),
    }
