"""The OpenAPI 3.0 description served at /openapi.json (schemathesis tests the gateway against it).
Its pieces: openapi_requests.py (request bodies, headers), openapi_responses.py (responses, errors)."""

from __future__ import annotations

from nitsum_services.gateway.openapi_requests import _MAX_TOKENS, _MESSAGE_IN, _SAMPLING, _TIER_HEADERS, _TOKEN_ID
from nitsum_services.gateway.openapi_responses import (
    _CHAT,
    _CHAT_CHUNK,
    _COMPLETION,
    _COMPLETION_CHUNK,
    _errors,
    _generation_responses,
)
from nitsum_services.gateway.protocol import MAX_LOGPROBS

OPENAPI = {
    "openapi": "3.0.3",
    "info": {
        "title": "nitsum gateway",
        "version": "0.1.0",
        "description": "OpenAI-compatible API of the nitsum serving mesh.",
    },
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
                                    "prompt": {
                                        "description": "one prompt: text, or token ids (each below the vocabulary size, else 400)",
                                        "oneOf": [
                                            {"type": "string", "minLength": 1},
                                            {"type": "array", "minItems": 1, "items": _TOKEN_ID},
                                            {
                                                "type": "array",
                                                "minItems": 1,
                                                "maxItems": 1,
                                                "items": {"type": "string", "minLength": 1},
                                            },
                                            {
                                                "type": "array",
                                                "minItems": 1,
                                                "maxItems": 1,
                                                "items": {"type": "array", "minItems": 1, "items": _TOKEN_ID},
                                            },
                                        ],
                                    },
                                    "logprobs": {
                                        "type": "integer",
                                        "minimum": 0,
                                        "maximum": MAX_LOGPROBS,
                                        "nullable": True,
                                    },
                                    **_SAMPLING,
                                },
                                "additionalProperties": False,
                            }
                        }
                    },
                },
                "responses": _generation_responses(_COMPLETION, _COMPLETION_CHUNK),
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
                                        "items": _MESSAGE_IN,
                                    },
                                    "max_completion_tokens": _MAX_TOKENS,
                                    "logprobs": {"type": "boolean", "nullable": True},
                                    "top_logprobs": {
                                        "type": "integer",
                                        "minimum": 0,
                                        "maximum": MAX_LOGPROBS,
                                        "nullable": True,
                                        "description": "needs logprobs: true (else 400)",
                                    },
                                    **_SAMPLING,
                                },
                                "additionalProperties": False,
                            }
                        }
                    },
                },
                "responses": _generation_responses(_CHAT, _CHAT_CHUNK),
            }
        },
        "/v1/models": {
            "get": {
                "operationId": "listModels",
                "responses": {
                    "200": {
                        "description": "served models",
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "required": ["object", "data"],
                                    "properties": {
                                        "object": {"type": "string"},
                                        "data": {
                                            "type": "array",
                                            "items": {
                                                "type": "object",
                                                "required": ["id"],
                                                "properties": {"id": {"type": "string"}},
                                            },
                                        },
                                    },
                                }
                            }
                        },
                    },
                    **_errors(401),
                },
            }
        },
        "/health": {
            "get": {
                "operationId": "health",
                "security": [],
                "responses": {
                    "200": {"description": "alive", "content": {"application/json": {"schema": {"type": "object"}}}}
                },
            }
        },
        "/ready": {
            "get": {
                "operationId": "ready",
                "responses": {
                    "200": {
                        "description": "a 1-token generation went through the mesh",
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "required": ["ready"],
                                    "properties": {"ready": {"type": "boolean"}},
                                }
                            }
                        },
                    },
                    "503": {
                        "description": "not ready",
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "required": ["ready"],
                                    "properties": {"ready": {"type": "boolean"}, "reason": {"type": "string"}},
                                }
                            }
                        },
                    },
                    **_errors(401),
                },
            }
        },
        "/metrics": {
            "get": {
                "operationId": "metrics",
                "responses": {
                    "200": {
                        "description": "Prometheus text format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                    **_errors(401),
                },
            }
        },
        "/openapi.json": {
            "get": {
                "operationId": "openapi",
                "responses": {
                    "200": {
                        "description": "this document",
                        "content": {"application/json": {"schema": {"type": "object"}}},
                    },
                    **_errors(401),
                },
            }
        },
    },
}
