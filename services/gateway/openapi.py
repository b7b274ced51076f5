"""The OpenAPI 3.0 description served at /openapi.json (schemathesis tests the gateway against it)."""

from __future__ import annotations

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

_SAMPLING = {
    "model": {"type": "string"},
    "max_tokens": {"type": "integer", "minimum": 1, "nullable": True},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2, "nullable": True},
    "top_p": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1, "nullable": True},
    "top_k": {"type": "integer", "minimum": -1, "nullable": True},
    "seed": {"type": "integer", "nullable": True},
    "n": {"type": "integer", "minimum": 1, "maximum": 1, "nullable": True},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 16}], "nullable": True},
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}, "nullable": True},
    "stream": {"type": "boolean", "nullable": True},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}, "nullable": True},
    "ignore_eos": {"type": "boolean", "nullable": True},
    "return_token_ids": {"type": "boolean", "nullable": True},
}

_TIER_HEADERS = [
    {"name": "x-request-tier", "in": "header", "required": False, "schema": {"type": "string", "enum": ["interactive", "background"]}},
    {"name": "x-slo-ttft-ms", "in": "header", "required": False, "schema": {"type": "number", "exclusiveMinimum": True, "minimum": 0}},
    {"name": "x-slo-tpot-ms", "in": "header", "required": False, "schema": {"type": "number", "exclusiveMinimum": True, "minimum": 0}},
]


def _errors(*codes: int) -> dict:
    return {str(c): {"description": "error", "content": {"application/json": {"schema": _ERROR}}} for c in codes}


_CHOICE_COMMON = {"index": {"type": "integer"}, "finish_reason": {"type": "string", "nullable": True}, "logprobs": {"nullable": True}, "token_ids": {"type": "array", "items": {"type": "integer"}}}

_COMPLETION_RESPONSE = {
    "type": "object",
    "required": ["id", "object", "created", "model", "choices"],
    "properties": {
        "id": {"type": "string"},
        "object": {"type": "string"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {"type": "array", "items": {"type": "object", "properties": {**_CHOICE_COMMON, "text": {"type": "string"}, "message": {"type": "object"}}}},
        "usage": _USAGE,
    },
}

_GENERATION_RESPONSES = {
    "200": {
        "description": "the completion (JSON), or an SSE stream of chunks when stream is true",
        "content": {"application/json": {"schema": _COMPLETION_RESPONSE}, "text/event-stream": {"schema": {"type": "string"}}},
    },
    **_errors(400, 401, 404, 413, 429, 500, 503),
}

OPENAPI = {
    "openapi": "3.0.3",
    "info": {"title": "nitsum gateway", "version": "0.1.0", "description": "OpenAI-compatible API of the nitsum serving mesh."},
    "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    "security": [{"bearer": []}],
    "paths": {
        "/v1/completions": {
            "post": {
                "operationId": "createCompletion",
                "parameters": _TIER_HEADERS,
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "required": ["prompt"],
                                "properties": {
                                    "prompt": {"oneOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}]},
                                    **_SAMPLING,
                                },
                            }
                        }
                    },
                },
                "responses": _GENERATION_RESPONSES,
            }
        },
        "/v1/chat/completions": {
            "post": {
                "operationId": "createChatCompletion",
                "parameters": _TIER_HEADERS,
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "required": ["messages"],
                                "properties": {
                                    "messages": {
                                        "type": "array",
                                        "minItems": 1,
                                        "items": {
                                            "type": "object",
                                            "required": ["role", "content"],
                                            "properties": {"role": {"type": "string", "enum": ["system", "user", "assistant", "developer"]}, "content": {"type": "string"}},
                                        },
                                    },
                                    "max_completion_tokens": {"type": "integer", "minimum": 1, "nullable": True},
                                    **_SAMPLING,
                                },
                            }
                        }
                    },
                },
                "responses": _GENERATION_RESPONSES,
            }
        },
        "/v1/models": {
            "get": {
                "operationId": "listModels",
                "responses": {
                    "200": {
                        "description": "served models",
                        "content": {"application/json": {"schema": {"type": "object", "required": ["object", "data"], "properties": {"object": {"type": "string"}, "data": {"type": "array", "items": {"type": "object", "required": ["id"], "properties": {"id": {"type": "string"}}}}}}}},
                    },
                    **_errors(401),
                },
            }
        },
        "/health": {"get": {"operationId": "health", "security": [], "responses": {"200": {"description": "alive", "content": {"application/json": {"schema": {"type": "object"}}}}}}},
        "/ready": {
            "get": {
                "operationId": "ready",
                "responses": {
                    "200": {"description": "a 1-token generation went through the mesh", "content": {"application/json": {"schema": {"type": "object", "required": ["ready"], "properties": {"ready": {"type": "boolean"}}}}}},
                    "503": {"description": "not ready", "content": {"application/json": {"schema": {"type": "object", "required": ["ready"], "properties": {"ready": {"type": "boolean"}, "reason": {"type": "string"}}}}}},
                    **_errors(401),
                },
            }
        },
        "/metrics": {"get": {"operationId": "metrics", "responses": {"200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}, **_errors(401)}}},
        "/openapi.json": {"get": {"operationId": "openapi", "responses": {"200": {"description": "this document", "content": {"application/json": {"schema": {"type": "object"}}}}, **_errors(401)}}},
    },
}
