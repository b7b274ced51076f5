"""The incremental SSE parser and the chunk interpreter (pure code)."""

from __future__ import annotations

import json

import pytest

from nitsum_load.sse import SseParser, parse_chunk

STREAM = (
    b": keep-alive comment\r\n\r\n"
    b'data: {"a": 1}\r\n\r\n'
    b"event: message\nid: 7\ndata: line1\ndata: line2\n\n"
    b"data:no-space\r\r"
    b"data: caf\xc3\xa9\n\n"
    b"data: [DONE]\n\n"
)
EXPECTED = ['{"a": 1}', "line1\nline2", "no-space", "caf\u00e9", "[DONE]"]


def test_whole_stream():
    p = SseParser()
    assert p.feed(STREAM) == EXPECTED
    assert p.close() == []


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 64])
def test_any_split_gives_the_same_events(size):
    p = SseParser()
    out = []
    for i in range(0, len(STREAM), size):
        out += p.feed(STREAM[i : i + size])
    assert out == EXPECTED


def test_cr_at_chunk_end_waits_for_lf():
    p = SseParser()
    assert p.feed(b"data: x\r") == []
    assert p.feed(b"\n") == []  # CRLF is one line end, not two (which would end the event)
    assert p.feed(b"\r\n") == ["x"]


def test_unterminated_event_dropped_at_close():
    p = SseParser()
    assert p.feed(b"data: half") == []
    assert p.close() == []


def test_parse_chunk_chat_completions_usage_error():
    role = parse_chunk(json.dumps({"choices": [{"delta": {"role": "assistant", "content": ""}}]}))
    assert (role.tokens, role.finish_reason) == (0, None)
    tok = parse_chunk(json.dumps({"choices": [{"delta": {"content": "hi"}, "finish_reason": "length"}]}))
    assert (tok.tokens, tok.finish_reason) == (1, "length")
    comp = parse_chunk(json.dumps({"choices": [{"text": " a", "finish_reason": None}]}))
    assert comp.tokens == 1
    ids = parse_chunk(json.dumps({"choices": [{"text": "abc", "token_ids": [5, 6, 7]}]}))
    assert ids.tokens == 3
    usage = parse_chunk(json.dumps({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 4}}))
    assert (usage.tokens, usage.prompt_tokens, usage.completion_tokens) == (0, 12, 4)
    err = parse_chunk(json.dumps({"error": {"message": "boom"}}))
    assert err.error == "boom"
    with pytest.raises(ValueError, match="not JSON"):
        parse_chunk("{oops")
    with pytest.raises(ValueError, match="not a JSON object"):
        parse_chunk("[1, 2]")
