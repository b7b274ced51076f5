"""Issue 23: the batched frames subject, the TokenBatch message and `nitsum up --gateways`."""

from __future__ import annotations

import pytest

from nitsum.up import parse_args
from nitsum.wire import DecodeError, decode, encode
from nitsum.wire.messages import TokenBatch, TokenChunk
from nitsum.wire.subjects import Subjects


def test_frames_subject_names_worker_and_gateway_and_never_matches_a_request_stream():
    s = Subjects()
    assert s.gateway_frames("gw-1", "n1-0") == "nitsum.stream.n1-0.gw.gw-1"
    assert s.gateway_frames("gw-1") == "nitsum.stream.*.gw.gw-1"
    assert s.frames_gateway(s.gateway_frames("gw-1", "n1-0")) == "gw-1"
    assert s.frames_gateway(s.stream("cmpl-1", "n1-0")) == ""  # a per-request stream
    assert s.frames_gateway("other.stream.n1-0.gw.gw-1") == ""  # another namespace
    assert s.stream_sender(s.gateway_frames("gw-1", "n1-0")) == ""  # five tokens: not a request's stream
    with pytest.raises(ValueError):
        s.gateway_frames("gw.1")


def test_a_batch_keeps_every_chunk_and_refuses_a_bad_one():
    chunks = (
        TokenChunk("a", "w0", 0, (1, 2), "xy", num_prompt_tokens=3, attempt=1),
        TokenChunk("b", "w0", 4, (), finished=True, finish_reason="error", error_code="shed", attempt=0),
    )
    batch = TokenBatch("w0", chunks)
    assert decode(encode(batch), TokenBatch) == batch
    frame = encode(TokenBatch("w0", (TokenChunk("a", "w0", 0, (1,)),))).replace(b"\xa1a", b"\x01\x01")
    with pytest.raises(DecodeError):
        decode(frame, TokenBatch)


def test_up_gateways_defaults_to_one_and_refuses_zero(capsys):
    assert parse_args([]).gateways == 1
    assert parse_args(["--gateways", "3"]).gateways == 3
    with pytest.raises(SystemExit):
        parse_args(["--gateways", "0"])
    assert "--gateways must be >= 1" in capsys.readouterr().err
