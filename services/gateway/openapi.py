"""The OpenAPI 3.0 description served at /openapi.json (schemathesis tests the gateway against it)."""

from __future__ import annotations

from nitsum_services.gateway.protocol import (
    MAX_INT_OPTION,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRINGS,
    MAX_TOKEN_ID,
    PRIORITY_RANGE,
)

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

# Bounds below are the ones protocol.py enforces (a value outside is a 400 there). max_tokens has one more,
# model-dependent limit the static document cannot state: prompt + max_tokens must fit the model's context
# (`max_model_len` in /v1/models), else 400 context_length_exceeded.
_MAX_TOKENS = {
    "type": "integer",
    "minimum": 1,
    "maximum": MAX_INT_OPTION,
    "nullable": True,
    "description": "prompt tokens + max_tokens must fit the model's context (max_model_len in /v1/models), else 400 context_length_exceeded",
}
_TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID - 1}

_SAMPLING = {
    "model": {"type": "string"},
    "max_tokens": _MAX_TOKENS,
    "temperature": {"type": "number", "minimum": 0, "maximum": 2, "nullable": True},
    "top_p": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1, "nullable": True},
    "top_k": {"type": "integer", "minimum": -1, "maximum": MAX_INT_OPTION, "nullable": True},
    "seed": {"type": "integer", "format": "int64", "minimum": -(1 << 63), "maximum": (1 << 63) - 1, "nullable": True},
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_N, "nullable": True},
    "best_of": {
        "type": "integer",
        "minimum": 1,
        "maximum": MAX_N,
        "nullable": True,
        "description": "only equal to n (else 400)",
    },
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2, "nullable": True},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2, "nullable": True},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 2, "nullable": True},
    "logit_bias": {
        "type": "object",
        "maxProperties": MAX_LOGIT_BIAS,
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        "nullable": True,
        "description": "token id (a decimal string, below the vocabulary size, else 400) -> bias added to its logit",
    },
    "priority": {
        "type": "integer",
        "minimum": PRIORITY_RANGE[0],
        "maximum": PRIORITY_RANGE[1],
        "nullable": True,
        "description": "vLLM: < 0 interactive tier, > 0 background",
    },
    "user": {"type": "string", "maxLength": 256, "nullable": True},
    "min_tokens": {
        "type": "integer",
        "minimum": 0,
        "maximum": MAX_INT_OPTION,
        "nullable": True,
        "description": "vLLM: no EOS/stop token before this many tokens; at most max_tokens (else 400)",
    },
    "min_p": {"type": "number", "minimum": 0, "maximum": 1, "nullable": True},
    "stop": {
        "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": MAX_STOP_STRINGS}],
        "nullable": True,
    },
    "stop_token_ids": {"type": "array", "items": _TOKEN_ID, "nullable": True},
    "stream": {"type": "boolean", "nullable": True},
    "stream_options": {
        "type": "object",
        "properties": {"include_usage": {"type": "boolean"}, "continuous_usage_stats": {"type": "boolean"}},
        "nullable": True,
        "description": "only with stream: true (else 400)",
    },
    "ignore_eos": {"type": "boolean", "nullable": True},
    "return_token_ids": {"type": "boolean", "nullable": True},
}

_TIER_HEADERS = [
    {
        "name": "x-request-tier",
        "in": "header",
        "required": False,
        "schema": {"type": "string", "enum": ["interactive", "background"]},
    },
    {
        "name": "x-slo-ttft-ms",
        "in": "header",
        "required": False,
        "schema": {"type": "number", "exclusiveMinimum": True, "minimum": 0},
    },
    {
        "name": "x-slo-tpot-ms",
        "in": "header",
        "required": False,
        "schema": {"type": "number", "exclusiveMinimum": True, "minimum": 0},
    },
    # Gateway API Inference Extension: objectives map onto tiers through NITSUM_GATEWAY_OBJECTIVES (these are the defaults).
    {
        "name": "x-gateway-inference-objective",
        "in": "header",
        "required": False,
        "schema": {"type": "string", "enum": ["critical", "standard", "sheddable", "interactive", "background"]},
    },
    {
        "name": "x-gateway-inference-fairness-id",
        "in": "header",
        "required": False,
        "schema": {"type": "string", "minLength": 1, "maxLength": 256},
    },
]


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


_CONTENT_PARTS = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
    },
}
_MESSAGE_IN = {
    "oneOf": [
        {
            "type": "object",
            "required": ["role", "content"],
            "properties": {
                "role": {"type": "string", "enum": ["system", "user", "developer", "tool"]},
                "content": {"oneOf": [{"type": "string"}, _CONTENT_PARTS]},
            },
        },
        {
            "type": "object",
            "required": ["role"],
            "properties": {
                "role": {"type": "string", "enum": ["assistant"]},
                "content": {"nullable": True, "oneOf": [{"type": "string"}, _CONTENT_PARTS]},
            },
        },
    ]
}


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
