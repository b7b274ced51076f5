"""Random and truncated frames fed to the decoder: always a DecodeError, never anything else."""

from __future__ import annotations

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from nitsum.wire import MESSAGE_TYPES, DecodeError, decode, encode
from nitsum.wire.messages import SamplingSpec, SubmitRequest, TokenChunk, WorkerStats

SAMPLES = [
    encode(TokenChunk("r", "w", 3, (1, 2, 3), text="hé", finished=True, finish_reason="stop")),
    encode(SubmitRequest("r", (1, 2), SamplingSpec(stop=("a",)), "interactive", 1.0, 2.0, 3.0, 4.0, "s")),
    encode(WorkerStats("w", "n", 0, "cpu", "decode", "ready", "g", 1, "m", 10, 0, 0, 1, 2, ("a",), (5,))),
]


def _decode_is_safe(frame: bytes) -> None:
    try:
        message = decode(frame)
    except DecodeError as exc:
        assert exc.code
        return
    assert type(message) in MESSAGE_TYPES


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes(frame):
    _decode_is_safe(frame)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(SAMPLES), st.data())
def test_truncated_and_flipped_frames(frame, data):
    cut = data.draw(st.integers(0, len(frame)))
    _decode_is_safe(frame[:cut])
    pos = data.draw(st.integers(0, len(frame) - 1))
    flipped = bytearray(frame)
    flipped[pos] ^= data.draw(st.integers(1, 255))
    _decode_is_safe(bytes(flipped))


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from([c.KIND for c in MESSAGE_TYPES] + ["nope"]),
    st.integers(-2, 3),
    st.dictionaries(st.text(max_size=16), _values, max_size=6),
)
def test_well_formed_frames_with_random_fields(kind, version, fields):
    _decode_is_safe(msgpack.packb([kind, version, fields], use_bin_type=True))
