"""OpenAI-compatible request parsing and response shapes (pure: no I/O).

Bad input raises `ApiError` carrying the HTTP status and OpenAI's error fields; the handler maps it to
`{"error": {"message", "type", "param", "code"}}`. Nothing here touches the mesh.
The field readers and `ApiError` live in fields.py, the sampling options in sampling.py and the response
shapes in bodies.py; this module re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nitsum.wire.messages import SamplingSpec
from nitsum_services.gateway.bodies import (
    chat_logprobs,
    choice,
    chunk,
    completion_logprobs,
    full_response,
    now_s,
    usage,
    usage_chunk,
)
from nitsum_services.gateway.fields import MAX_INT_OPTION, MAX_TOKEN_ID, ApiError, _bad, _boolean, _integer, _token_ids
from nitsum_services.gateway.sampling import (
    GREEDY_BELOW_TEMPERATURE,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    MIN_TOP_P,
    parse_sampling,
)

__all__ = [
    "GREEDY_BELOW_TEMPERATURE",
    "MAX_INT_OPTION",
    "MAX_LOGIT_BIAS",
    "MAX_LOGPROBS",
    "MAX_N",
    "MAX_STOP_STRINGS",
    "MAX_TOKEN_ID",
    "MIN_TOP_P",
    "PRIORITY_RANGE",
    "ApiError",
    "ParsedRequest",
    "chat_logprobs",
    "choice",
    "chunk",
    "completion_logprobs",
    "full_response",
    "now_s",
    "parse_chat",
    "parse_completion",
    "parse_sampling",
    "usage",
    "usage_chunk",
]


@dataclass(frozen=True)
class ParsedRequest:
    kind: str  # "chat" | "completion"
    model: str
    prompt_text: str | None
    prompt_token_ids: tuple[int, ...] | None
    sampling: SamplingSpec
    max_tokens_given: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool
    n: int = 1
    priority: int | None = None  # vLLM's body field (lower = more urgent); mapped onto a tier by the gateway
    user: str = ""
    ignored_fields: tuple[str, ...] = ()  # unknown fields tolerated by NITSUM_GATEWAY_ALLOW_UNKNOWN_FIELDS
    # vLLM's stream_options.continuous_usage_stats: every streamed chunk carries the usage so far.
    continuous_usage: bool = False


MAX_N = 16  # choices per request (each one is a generation in the mesh)
PRIORITY_RANGE = (-(1 << 31), (1 << 31) - 1)

# Fields each route honours. Anything else is a 400 naming it (unless the operator tolerates unknown vendor
# fields: NITSUM_GATEWAY_ALLOW_UNKNOWN_FIELDS), and the known-but-unsupported ones below are accepted only
# with the value that means "off" (so that clients sending their defaults still work).
COMMON_FIELDS = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stop_token_ids",
        "stream",
        "stream_options",
        "ignore_eos",
        "return_token_ids",
        "n",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "priority",
        "user",
        "response_format",
        "min_tokens",
        "min_p",
    }
)
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs"}
# name -> the values that mean "off" (accepted and, being off, honoured); any other value is a 400.
NEUTRAL_VALUES: dict[str, tuple] = {
    "echo": (False,),
    "suffix": ("",),
    "best_of": (1,),
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none",),
    "function_call": ("none",),
    "parallel_tool_calls": (True, False),  # meaningless without tools, which are refused
    "store": (False,),
    "metadata": ({},),
    "service_tier": ("auto", "default"),
    "modalities": (["text"],),
}
STREAM_OPTION_FIELDS = frozenset({"include_usage", "continuous_usage_stats"})


def _check_fields(body: dict, honoured: frozenset, allow_unknown: bool) -> tuple[str, ...]:
    """400 for a field that would be ignored; returns the unknown fields that are tolerated."""
    ignored = []
    for name, value in body.items():
        if name in honoured or value is None:
            continue
        if name in NEUTRAL_VALUES:
            if name == "best_of" and value == body.get("n"):
                continue
            if any(value == v and type(value) is type(v) for v in NEUTRAL_VALUES[name]):
                continue
            raise _bad(f"'{name}' is not supported (only {NEUTRAL_VALUES[name][0]!r} is accepted)", name)
        if allow_unknown:
            ignored.append(str(name))
            continue
        raise _bad(
            f"unknown field '{name}' (set NITSUM_GATEWAY_ALLOW_UNKNOWN_FIELDS=true to ignore unknown fields)", str(name)
        )
    return tuple(ignored)


def _common(body: dict, kind: str, allow_unknown: bool) -> dict:
    """The per-request options besides sampling (validated)."""
    ignored = _check_fields(body, CHAT_FIELDS if kind == "chat" else COMPLETION_FIELDS, allow_unknown)
    n = _integer(body, "n", 1, 1, MAX_N)
    best_of = body.get("best_of")
    if best_of is not None and best_of not in (1, n):
        raise _bad("'best_of' other than n is not supported", "best_of")
    priority = _integer(body, "priority", None, *PRIORITY_RANGE)
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > 256):
        raise _bad("'user' must be a string of at most 256 characters", "user")
    return {"n": n, "priority": priority, "user": user or "", "ignored_fields": ignored}


def _model(body: dict) -> str:
    model = body.get("model")
    if model is None:
        return ""
    if not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    return model


def _stream_flags(body: dict) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats)."""
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    include_usage = continuous = False
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("'stream_options' must be an object", "stream_options")
        if not stream:
            raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        for name in options:
            if name not in STREAM_OPTION_FIELDS and options[name] not in (None, False):
                raise _bad(f"'stream_options.{name}' is not supported", "stream_options")
        value = options.get("include_usage")
        if value is not None and not isinstance(value, bool):
            raise _bad("'stream_options.include_usage' must be a boolean", "stream_options")
        include_usage = bool(value)
        value = options.get("continuous_usage_stats")
        if value is not None and not isinstance(value, bool):
            raise _bad("'stream_options.continuous_usage_stats' must be a boolean", "stream_options")
        continuous = bool(value)
        if continuous and not include_usage:  # vLLM would ignore it; refused here rather than ignored
            raise _bad("'stream_options.continuous_usage_stats' needs 'stream_options.include_usage'", "stream_options")
    return stream, include_usage, continuous


def parse_completion(body: Any, default_max_tokens: int = 16, allow_unknown: bool = False) -> ParsedRequest:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None)
    common = _common(body, "completion", allow_unknown)
    prompt = body.get("prompt")
    text, ids = None, None
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        text = prompt[0]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = _token_ids(prompt, "prompt")
    elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        ids = _token_ids(prompt[0], "prompt")
    elif prompt is None:
        raise _bad("'prompt' is required", "prompt")
    else:
        raise _bad("'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")
    if text is not None and not text:
        raise _bad("'prompt' must not be empty", "prompt")
    if ids is not None and not ids:
        raise _bad("'prompt' must not be empty", "prompt")
    sampling, given = parse_sampling(body, default_max_tokens, kind="completion")
    stream, include_usage, continuous = _stream_flags(body)
    return ParsedRequest(
        "completion",
        _model(body),
        text,
        ids,
        sampling,
        given,
        stream,
        include_usage,
        _boolean(body, "return_token_ids"),
        **common,
        continuous_usage=continuous,
    )


def parse_chat(
    body: Any, max_messages: int, default_max_tokens: int = 16, allow_unknown: bool = False
) -> tuple[ParsedRequest, list[dict]]:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None)
    common = _common(body, "chat", allow_unknown)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list", "messages")
    if len(messages) > max_messages:
        raise _bad(f"too many messages: {len(messages)} > {max_messages}", "messages")
    clean: list[dict] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}] must be an object", f"messages.{i}")
        role = message.get("role")
        if role not in ("system", "user", "assistant", "developer", "tool"):
            raise _bad(f"messages[{i}].role must be system, user, assistant, developer or tool", f"messages.{i}.role")
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise _bad(f"messages[{i}].content parts must be text parts", f"messages.{i}.content")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise _bad(f"messages[{i}].content must be a string or a list of text parts", f"messages.{i}.content")
        clean.append({"role": "system" if role == "developer" else role, "content": content})
    sampling, given = parse_sampling(body, default_max_tokens, "max_completion_tokens", kind="chat")
    stream, include_usage, continuous = _stream_flags(body)
    parsed = ParsedRequest(
        "chat",
        _model(body),
        None,
        None,
        sampling,
        given,
        stream,
        include_usage,
        _boolean(body, "return_token_ids"),
        **common,
        continuous_usage=continuous,
    )
    return parsed, clean
