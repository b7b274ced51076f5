"""The request side of the OpenAPI description (openapi.py): the sampling fields with the bounds protocol.py
enforces, the tier headers, and the chat messages."""

from __future__ import annotations

from nitsum_services.gateway.protocol import (
    MAX_INT_OPTION,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_STRINGS,
    MAX_TOKEN_ID,
    PRIORITY_RANGE,
)

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
