"""Incremental Server-Sent Events parsing and the meaning of OpenAI streaming chunks.

Pure code (no I/O): the client feeds it whatever byte slices the socket delivers, so a chunk split anywhere
-- inside a UTF-8 character, between `\\r` and `\\n`, inside a JSON document -- still parses once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DONE = "[DONE]"


class SseParser:
    """Turns a byte stream into the `data` payload of each event (WHATWG event-stream rules, subset).

    Lines end in LF, CRLF or CR; `data:` lines of one event are joined with LF; an empty line ends the
    event; comment lines (`:`) and other fields (`event`, `id`, `retry`) are ignored. Events with no data
    are dropped.
    """

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += chunk
        out: list[str] = []
        while True:
            line, rest, ok = self._split_line(self._buf)
            if not ok:
                break
            self._buf = rest
            self._line(line, out)
        return out

    def close(self) -> list[str]:
        """End of stream: a final line without terminator still counts; an unterminated event is dropped
        (the spec says an event is dispatched only at a blank line)."""
        out: list[str] = []
        if self._buf:
            self._line(self._buf, out)
            self._buf = b""
        self._data = []
        return out

    @staticmethod
    def _split_line(buf: bytes) -> tuple[bytes, bytes, bool]:
        for i, b in enumerate(buf):
            if b == 0x0A:  # LF
                return buf[:i], buf[i + 1 :], True
            if b == 0x0D:  # CR, maybe followed by LF
                if i + 1 == len(buf):
                    return b"", buf, False  # wait: the LF may be in the next chunk
                skip = 2 if buf[i + 1] == 0x0A else 1
                return buf[:i], buf[i + skip :], True
        return b"", buf, False

    def _line(self, raw: bytes, out: list[str]) -> None:
        line = raw.decode("utf-8", errors="replace")
        if line == "":
            if self._data:
                out.append("\n".join(self._data))
            self._data = []
            return
        if line.startswith(":"):
            return
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)


@dataclass(frozen=True)
class ChunkInfo:
    """What one streamed JSON chunk says.

    `tokens` is how many output tokens the chunk carries: len(token_ids) when the server returns token ids
    (nitsum's `return_token_ids`), else 1 per choice with non-empty text / content (OpenAI-compatible servers
    stream one token per chunk in practice; an empty-text chunk, e.g. the role header, carries none).
    """

    tokens: int
    finish_reason: str | None
    prompt_tokens: int | None  # from a usage block
    completion_tokens: int | None
    error: str | None  # message of an in-stream error object


def parse_chunk(payload: str) -> ChunkInfo:
    """Interpret one `data:` payload (not `[DONE]`). Raises ValueError for payloads that are not JSON objects."""
    try:
        obj: Any = json.loads(payload)
    except json.JSONDecodeError as exc:
        raise ValueError(f"stream chunk is not JSON: {payload[:80]!r}") from exc
    if not isinstance(obj, dict):
        raise ValueError(f"stream chunk is not a JSON object: {payload[:80]!r}")
    if "error" in obj and obj["error"]:
        err = obj["error"]
        message = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        return ChunkInfo(0, None, None, None, message)
    tokens = 0
    finish: str | None = None
    for choice in obj.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        ids = choice.get("token_ids")
        if isinstance(ids, list):
            tokens += len(ids)
        else:
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if text:
                tokens += 1
        if choice.get("finish_reason"):
            finish = str(choice["finish_reason"])
    usage = obj.get("usage")
    prompt = completion = None
    if isinstance(usage, dict):
        prompt = _opt_int(usage.get("prompt_tokens"))
        completion = _opt_int(usage.get("completion_tokens"))
    return ChunkInfo(tokens, finish, prompt, completion, None)


def _opt_int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) else None
