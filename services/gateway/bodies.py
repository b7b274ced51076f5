"""OpenAI-compatible response shapes: usage, logprobs, stream chunks, choices and whole responses (pure)."""

from __future__ import annotations

import time
from typing import Any


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
