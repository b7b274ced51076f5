"""Round trips for every message kind, and strict refusal of bad frames."""

from __future__ import annotations

import dataclasses
import typing

import msgpack
import pytest

from nitsum.wire import MESSAGE_TYPES, DecodeError, EncodeError, decode, encode
from nitsum.wire.messages import ErrorReply, RunRequest, SamplingSpec, SubmitRequest, TokenChunk, WorkerStats


def _sample(tp, name: str):
    """A non-default value of annotation `tp`, derived from the field name so that fields differ."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, __import__("types").UnionType):
        return _sample([a for a in typing.get_args(tp) if a is not type(None)][0], name)
    if tp is bool:
        return True
    if tp is int:
        return 7 + len(name)
    if tp is float:
        return 1.5 + len(name)
    if tp is str:
        return f"v-{name}"
    if tp is bytes:
        return name.encode()
    if origin is tuple:
        return (_sample(typing.get_args(tp)[0], name + "0"), _sample(typing.get_args(tp)[0], name + "1"))
    if origin is dict:
        return {"k": _sample(typing.get_args(tp)[1], name)}
    if dataclasses.is_dataclass(tp):
        return _instance(tp)
    raise AssertionError(f"no sample for {tp}")


def _instance(cls):
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: _sample(hints[f.name], f.name) for f in dataclasses.fields(cls)})


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.KIND)
def test_every_message_round_trips(cls):
    message = _instance(cls)
    frame = encode(message)
    back = decode(frame)
    assert back == message
    assert type(back) is cls
    # and the defaults-only form where one exists
    required = [
        f
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if not required:
        assert decode(encode(cls())) == cls()


def test_kinds_are_unique_and_versioned():
    kinds = [c.KIND for c in MESSAGE_TYPES]
    assert len(kinds) == len(set(kinds))
    assert all(isinstance(c.VERSION, int) and c.VERSION >= 1 for c in MESSAGE_TYPES)


def test_unknown_kind_is_a_typed_error():
    frame = msgpack.packb(["no_such_kind", 1, {}])
    with pytest.raises(DecodeError) as info:
        decode(frame)
    assert info.value.code == "unknown_kind"


def test_newer_version_is_refused():
    frame = msgpack.packb(["abort", 99, {"request_id": "r"}])
    with pytest.raises(DecodeError) as info:
        decode(frame)
    assert info.value.code == "bad_version"


@pytest.mark.parametrize(
    "fields, why",
    [
        ({"request_id": 5}, "str"),
        ({"request_id": "r", "reason": None}, "str"),
        ({"request_id": "r", "extra": 1}, "unknown field"),
        ({}, "missing required field"),
    ],
)
def test_bad_fields_are_refused(fields, why):
    with pytest.raises(DecodeError) as info:
        decode(msgpack.packb(["abort", 1, fields]))
    assert info.value.code == "bad_field"
    assert why in str(info.value)


def test_bool_is_not_an_int_and_nested_types_are_checked():
    good = encode(TokenChunk("r", "w", 0, (1, 2)))
    kind, version, fields = msgpack.unpackb(good)
    fields["index"] = True
    with pytest.raises(DecodeError, match="index"):
        decode(msgpack.packb([kind, version, fields]))
    fields["index"] = 0
    fields["token_ids"] = [1, "x"]
    with pytest.raises(DecodeError, match=r"token_ids\[1\]"):
        decode(msgpack.packb([kind, version, fields]))


def test_nested_message_round_trip_and_validation():
    req = SubmitRequest(
        "r1",
        (1, 2, 3),
        SamplingSpec(max_tokens=3, stop=("x",), seed=4),
        "interactive",
        200.0,
        25.0,
        10.0,
        1.0,
        "nitsum.stream.r1",
    )
    run = RunRequest(req, decode_worker="w3")
    assert decode(encode(run)) == run
    kind, version, fields = msgpack.unpackb(encode(run))
    fields["request"]["sampling"]["max_tokens"] = "3"
    with pytest.raises(DecodeError, match="sampling.max_tokens"):
        decode(msgpack.packb([kind, version, fields]))


def test_size_limits_both_ways():
    big = TokenChunk("r", "w", 0, tuple(range(100)), text="x" * 5000)
    with pytest.raises(EncodeError) as info:
        encode(big, max_bytes=1000)
    assert info.value.code == "too_large"
    frame = encode(big)
    with pytest.raises(DecodeError) as dinfo:
        decode(frame, max_bytes=1000)
    assert dinfo.value.code == "too_large"


@pytest.mark.parametrize(
    "frame", [b"", b"\xc1", b"\x93\xa5abort", msgpack.packb({"a": 1}), msgpack.packb([1, 2, 3]), msgpack.packb("text")]
)
def test_garbage_is_a_decode_error(frame):
    with pytest.raises(DecodeError):
        decode(frame)


def test_expected_type_is_enforced():
    frame = encode(ErrorReply("x", "y"))
    with pytest.raises(DecodeError) as info:
        decode(frame, WorkerStats)
    assert info.value.code == "unexpected_kind"


def test_non_message_cannot_be_encoded():
    with pytest.raises(EncodeError):
        encode({"kind": "abort"})


def test_no_pickle_in_project_code():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    offenders = []
    for folder in ("libs", "services", "load"):
        for path in (root / folder).rglob("*.py"):
            text = path.read_text()
            if "import pickle" in text or "cloudpickle" in text or "pickle.load" in text:
                offenders.append(str(path.relative_to(root)))
    assert offenders == []


def test_errors_inside_arrays_of_messages_name_the_element():
    from nitsum.wire.node import CommitShare, KvEntry

    entries = tuple(KvEntry(f"r{i}", 0, 2, 16, (1, 2, 3)) for i in range(4))
    kind, version, fields = msgpack.unpackb(encode(CommitShare(b"s", entries, 7, (), "")))
    fields["requests"][3]["block_ids"][2] = True  # a bool is not a block id
    with pytest.raises(DecodeError, match=r"requests\[3\]\.block_ids\[2\]: expected int, got bool"):
        decode(msgpack.packb([kind, version, fields]))
    fields["requests"][3]["block_ids"][2] = 3
    fields["requests"][1]["tp"] = 1.5
    with pytest.raises(DecodeError, match=r"requests\[1\]\.tp: expected int"):
        decode(msgpack.packb([kind, version, fields]))
    fields["requests"][1]["tp"] = 2
    assert decode(msgpack.packb([kind, version, fields])) == CommitShare(b"s", entries, 7, (), "")
