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
    def __init__(self, status: int, message: str, param: str | None = None, code: str = "invalid_request", type_: str = "invalid_request_error", headers: dict | None = None) -> None:
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
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < MAX_TOKEN_ID for t in value):
        raise _bad(f"'{name}' must be a list of non-negative token ids", name)
    return tuple(value)


def parse_sampling(body: dict, max_tokens_default: int, max_tokens_name: str = "max_tokens") -> tuple[SamplingSpec, bool]:
    n = _integer(body, "n", 1, 1, 128)
    if n != 1:
        raise _bad("only n = 1 is supported", "n")
    best_of = _integer(body, "best_of", None, 1, 128)
    if best_of not in (None, 1):
        raise _bad("only best_of = 1 is supported", "best_of")
    for unsupported in ("logprobs", "top_logprobs", "logit_bias", "tools", "functions", "suffix"):
        value = body.get(unsupported)
        if value not in (None, False, {}, []) and not (unsupported == "logprobs" and value is False):
            raise _bad(f"'{unsupported}' is not supported", unsupported)
    if body.get("echo") not in (None, False):
        raise _bad("'echo' is not supported", "echo")
    for penalty in ("presence_penalty", "frequency_penalty"):
        if _number(body, penalty, 0.0, -2.0, 2.0) != 0.0:
            raise _bad(f"'{penalty}' other than 0 is not supported", penalty)
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
    spec = SamplingSpec(
        max_tokens=max_tokens if max_tokens is not None else max_tokens_default,
        temperature=0.0 if temperature < GREEDY_BELOW_TEMPERATURE else temperature,
        top_p=max(top_p, MIN_TOP_P),
        top_k=_integer(body, "top_k", 0, -1, MAX_INT_OPTION) or 0,
        seed=seed,
        stop=stops,
        stop_token_ids=_token_ids(stop_ids, "stop_token_ids") if stop_ids is not None else (),
        ignore_eos=_boolean(body, "ignore_eos"),
    )
    if spec.top_k < 0:
        spec = SamplingSpec(**{**spec.__dict__, "top_k": 0})
    return spec, given


def _model(body: dict) -> str:
    model = body.get("model")
    if model is None:
        return ""
    if not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    return model


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    include_usage = True
    if options is not None:
        if not isinstance(options, dict):
            raise _bad("'stream_options' must be an object", "stream_options")
        value = options.get("include_usage")
        if value is not None and not isinstance(value, bool):
            raise _bad("'stream_options.include_usage' must be a boolean", "stream_options")
    return stream, include_usage


def parse_completion(body: Any, default_max_tokens: int = 16) -> ParsedRequest:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None)
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
    sampling, given = parse_sampling(body, default_max_tokens)
    stream, include_usage = _stream_flags(body)
    return ParsedRequest("completion", _model(body), text, ids, sampling, given, stream, include_usage, _boolean(body, "return_token_ids"))


def parse_chat(body: Any, max_messages: int, default_max_tokens: int = 16) -> tuple[ParsedRequest, list[dict]]:
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None)
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
    sampling, given = parse_sampling(body, default_max_tokens, "max_completion_tokens")
    stream, include_usage = _stream_flags(body)
    parsed = ParsedRequest("chat", _model(body), None, None, sampling, given, stream, include_usage, _boolean(body, "return_token_ids"))
    return parsed, clean


# ---- responses -------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def chunk(kind: str, request_id: str, model: str, created: int, text: str, finish_reason: str | None, first: bool, token_ids: list[int] | None) -> dict:
    if kind == "chat":
        delta: dict[str, Any] = {"content": text}
        if first:
            delta["role"] = "assistant"
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [choice]}


def usage_chunk(kind: str, request_id: str, model: str, created: int, usage_obj: dict) -> dict:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [], "usage": usage_obj}


def full_response(kind: str, request_id: str, model: str, created: int, text: str, finish_reason: str, usage_obj: dict, token_ids: list[int] | None) -> dict:
    if kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [choice], "usage": usage_obj}


def now_s() -> int:
    return int(time.time())
