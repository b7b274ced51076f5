"""OpenAI-compatible request parsing and response shapes (pure: no I/O).

Bad input raises `ApiError` carrying the HTTP status and OpenAI's error fields; the handler maps it to
`{"error": {"message", "type", "param", "code"}}`. Nothing here touches the mesh.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from nitsum.wire.messages import SamplingSpec

MAX_STOP_STRINGS = 16
MAX_TOKEN_ID = 1 << 31
MAX_INT_OPTION = 1 << 20  # bound of max_tokens and top_k (a sanity limit; the context bounds max_tokens further)
# The worker samples in fp32. A temperature this small already makes sampling argmax in effect, but
# dividing fp32 logits by it can overflow to inf (NaN probabilities), so it is served as greedy, as vLLM does.
GREEDY_BELOW_TEMPERATURE = 1e-5
# A top_p at or below the top token's probability keeps that token alone. That probability is >= 1/vocab,
# so any top_p under 1e-6 means the same for vocabularies under a million tokens; raising it to 1e-6 keeps
# it from rounding to 0 in fp32 (5e-324 does), where the top-p filter would drop every token.
MIN_TOP_P = 1e-6


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


MAX_N = 16  # choices per request (each one is a generation in the mesh)
MAX_LOGPROBS = 20  # top alternatives per token (vLLM's default limit; OpenAI's chat limit)
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
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


def _logit_bias(body: dict) -> tuple[tuple[int, ...], tuple[float, ...]]:
    value = body.get("logit_bias")
    if value is None:
        return (), ()
    if not isinstance(value, dict):
        raise _bad("'logit_bias' must be an object mapping token ids to biases", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise _bad(f"'logit_bias' has more than {MAX_LOGIT_BIAS} entries", "logit_bias")
    pairs = []
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise _bad(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias") from None
        if not 0 <= token < MAX_TOKEN_ID or str(token) != str(key).strip():
            raise _bad(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias")
        if (
            isinstance(bias, bool)
            or not isinstance(bias, (int, float))
            or not math.isfinite(bias)
            or not -100 <= bias <= 100
        ):
            raise _bad(f"'logit_bias' values must be numbers between -100 and 100, got {bias!r}", "logit_bias")
        pairs.append((token, float(bias)))
    pairs.sort()
    return tuple(t for t, _ in pairs), tuple(b for _, b in pairs)


def _guide(body: dict) -> str:
    """The llguidance grammar of `response_format` ("" for free text)."""
    value = body.get("response_format")
    if value is None:
        return ""
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _bad("'response_format' must be an object with a 'type'", "response_format")
    if value["type"] == "text":
        return ""
    if value["type"] not in ("json_object", "json_schema"):
        raise _bad(
            f"'response_format' type {value['type']!r} is not supported (text, json_object, json_schema)",
            "response_format",
        )
    if _boolean(body, "ignore_eos"):
        raise _bad(
            "'ignore_eos' cannot be combined with a JSON 'response_format' (the document ends where its grammar ends)",
            "ignore_eos",
        )
    from nitsum.engine.guided import GuideError, grammar_for

    try:
        return grammar_for(value)
    except GuideError as exc:
        raise _bad(f"'response_format': {exc}", "response_format") from None


def _logprobs(body: dict, kind: str) -> int:
    """-1 (off) or the number of top alternatives per token."""
    if kind == "chat":
        wanted = _boolean(body, "logprobs")
        top = _integer(body, "top_logprobs", None, 0, MAX_LOGPROBS)
        if top is not None and not wanted:
            raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (top or 0) if wanted else -1
    top = _integer(body, "logprobs", None, 0, MAX_LOGPROBS)
    return -1 if top is None else top


def parse_sampling(
    body: dict, max_tokens_default: int, max_tokens_name: str = "max_tokens", kind: str = "completion"
) -> tuple[SamplingSpec, bool]:
    given = body.get(max_tokens_name) is not None or body.get("max_tokens") is not None
    max_tokens = _integer(body, max_tokens_name, None, 1, MAX_INT_OPTION)
    if max_tokens is None and max_tokens_name != "max_tokens":
        max_tokens = _integer(body, "max_tokens", None, 1, MAX_INT_OPTION)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(s for s in stop if s)
    else:
        raise _bad("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise _bad(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
    stop_ids = body.get("stop_token_ids")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -(1 << 63) <= seed < (1 << 63)):
        raise _bad("'seed' must be an integer", "seed")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0.0:
        raise _bad("'top_p' must be > 0", "top_p")
    repetition_penalty = _number(body, "repetition_penalty", 1.0, 0.0, 2.0)
    if repetition_penalty <= 0.0:
        raise _bad("'repetition_penalty' must be > 0", "repetition_penalty")
    bias_ids, bias_values = _logit_bias(body)
    top_k = _integer(body, "top_k", 0, -1, MAX_INT_OPTION) or 0
    min_tokens = _integer(body, "min_tokens", 0, 0, MAX_INT_OPTION)
    if max_tokens is not None and min_tokens > max_tokens:
        raise _bad(f"'min_tokens' ({min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens")
    if min_tokens and body.get("response_format") not in (None, {"type": "text"}):
        raise _bad(
            "'min_tokens' cannot be combined with a JSON 'response_format' (the grammar decides where the document ends)",
            "min_tokens",
        )
    spec = SamplingSpec(
        max_tokens=max_tokens if max_tokens is not None else max_tokens_default,
        temperature=0.0 if temperature < GREEDY_BELOW_TEMPERATURE else temperature,
        top_p=max(top_p, MIN_TOP_P),
        top_k=max(top_k, 0),
        seed=seed,
        stop=stops,
        stop_token_ids=_token_ids(stop_ids, "stop_token_ids") if stop_ids is not None else (),
        ignore_eos=_boolean(body, "ignore_eos"),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=repetition_penalty,
        logit_bias_ids=bias_ids,
        logit_bias_values=bias_values,
        logprobs=_logprobs(body, kind),
        guide=_guide(body),
        min_tokens=min_tokens,
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
    )
    return spec, given


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


# ---- responses -------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def chat_logprobs(entries: list, token_text) -> dict:
    """OpenAI's chat `logprobs` object for (token id, logprob, ((id, logprob), ...)) entries."""

    def one(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [{**one(t, lp), "top_logprobs": [one(i, v) for i, v in top]} for t, lp, top in entries],
        "refusal": None,
    }


def completion_logprobs(entries: list, token_text, text_offset: int) -> dict:
    """OpenAI's legacy completions `logprobs` object; `text_offset` is where these tokens' text starts."""
    tokens, offsets = [], []
    for t, _lp, _top in entries:
        offsets.append(text_offset)
        text = token_text(t)
        tokens.append(text)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for _t, lp, _top in entries],
        "top_logprobs": [_by_text(top, token_text) for _t, _lp, top in entries],
        "text_offset": offsets,
    }


def _by_text(top, token_text) -> dict:
    """{token text: logprob}, best first; tokens whose texts coincide (e.g. partial UTF-8 bytes) keep the best."""
    out: dict[str, float] = {}
    for i, v in top:
        out.setdefault(token_text(i), v)
    return out


def chunk(
    kind: str,
    request_id: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str | None,
    first: bool,
    token_ids: list[int] | None,
    index: int = 0,
    logprobs: dict | None = None,
) -> dict:
    if kind == "chat":
        delta: dict[str, Any] = {"content": text}
        if first:
            delta["role"] = "assistant"
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [choice]}


def usage_chunk(kind: str, request_id: str, model: str, created: int, usage_obj: dict) -> dict:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [], "usage": usage_obj}


def choice(
    kind: str, index: int, text: str, finish_reason: str, token_ids: list[int] | None, logprobs: dict | None = None
) -> dict:
    if kind == "chat":
        out: dict[str, Any] = {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
    else:
        out = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        out["token_ids"] = token_ids
    return out


def full_response(kind: str, request_id: str, model: str, created: int, choices: list[dict], usage_obj: dict) -> dict:
    obj = "chat.completion" if kind == "chat" else "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices, "usage": usage_obj}


def now_s() -> int:
    return int(time.time())
