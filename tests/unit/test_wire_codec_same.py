"""The codec's generated per-class functions against the general codec they replace: the same bytes, the same
decoded values and the same errors (type, code, message), on sampled and mutated messages of every kind.

The reference is a second copy of `nitsum.wire.codec` without generated functions: its dataclass decoders are
the general ones alone (the loop over field specs of nitsum 1e844f9) and its encoder packs `_to_wire`'s map (the
encoding of that commit, unchanged); the frozen digests pin that commit's bytes for a few messages.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import types
import typing

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nitsum.wire import codec
from nitsum.wire.messages import (
    ErrorReply,
    FlowSubmit,
    RunRequest,
    SamplingSpec,
    SubmitRequest,
    TokenBatch,
    TokenChunk,
    WorkerStats,
)
from nitsum.wire.node import Agreement, CommitShare, KvEntry, NodeCommand

TYPES = tuple(codec._BY_KIND.values())


def _reference():
    """A second copy of the codec module whose dataclass decoders are its general ones alone."""
    spec = importlib.util.spec_from_file_location("nitsum_wire_codec_reference", codec.__file__)
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    ref.WireError, ref.EncodeError, ref.DecodeError = codec.WireError, codec.EncodeError, codec.DecodeError
    ref.codegen = types.SimpleNamespace(make_decoder=lambda cls, fields, hints, decoders, general, error: general)
    return ref


REF = _reference()


def _reference_encode(message) -> bytes:
    """nitsum 1e844f9's encode (every message here is registered and under the size limit)."""
    cls = type(message)
    try:
        return msgpack.packb([cls.KIND, cls.VERSION, REF._to_wire(message)], use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise codec.EncodeError(f"cannot encode {cls.__name__}: {exc}", "unencodable") from exc


def _outcome(fn, *args):
    """What a call gives: its result (type and repr, so 1 and 1.0 or a list and a tuple differ) or its error."""
    try:
        value = fn(*args)
    except Exception as exc:
        return ("error", type(exc), getattr(exc, "code", None), str(exc))
    try:
        hashed = hash(value) if "nan" not in repr(value) else "nan"  # a NaN's hash is its object's, not its value's
    except TypeError as exc:
        hashed = str(exc)
    return ("ok", type(value), repr(value), hashed)


# -- sampled messages -----------------------------------------------------------------------------------------
_ODD = st.sampled_from(
    [{1, 2}, 2**70, KvEntry("r", 0, 1, 0, (1,)), [KvEntry("r", 0, 1, 0, ())], (1, SamplingSpec()), {"k": (2, "x")}]
)


def _values(tp: typing.Any, depth: int = 0, odd: bool = True) -> st.SearchStrategy:
    """Values of annotation `tp`, now and then of another type (ints for floats, lists for tuples, and with `odd`
    values the codec cannot send as they are or at all)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)][0]
        return st.none() | _values(inner, depth, odd)
    if origin is tuple:
        elems = st.lists(_values(typing.get_args(tp)[0], depth + 1, odd), max_size=3 if depth else 5)
        arrays = elems.map(tuple) | elems
        return arrays | st.lists(_ODD, min_size=1, max_size=2).map(tuple) if odd else arrays
    if origin is dict:
        return st.dictionaries(st.text(max_size=3), _values(typing.get_args(tp)[1], depth + 1, odd), max_size=3)
    if dataclasses.is_dataclass(tp):
        return _instances(tp, depth + 1, odd)
    plain = {
        bool: st.booleans(),
        int: st.integers(-(2**63), 2**64 - 1),
        float: st.floats() | st.integers(-3, 3),
        str: st.text(max_size=6),
        bytes: st.binary(max_size=6),
    }[tp]
    return plain | _ODD if depth == 0 and odd else plain


def _raw(cls: type, values: dict) -> typing.Any:
    """An instance holding these values as they are (no __init__ checks: the encoder takes what it is given)."""
    obj = object.__new__(cls)
    for name, value in values.items():
        object.__setattr__(obj, name, value)
    return obj


def _instances(cls: type, depth: int = 0, odd: bool = True) -> st.SearchStrategy:
    hints = typing.get_type_hints(cls)
    fields = {f.name: _values(hints[f.name], depth, odd) for f in dataclasses.fields(cls)}
    return st.fixed_dictionaries(fields).map(lambda values: _raw(cls, values))


_MESSAGES = st.sampled_from(TYPES).flatmap(_instances)
_SENDABLE = st.sampled_from(TYPES).flatmap(lambda cls: _instances(cls, odd=False))


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_MESSAGES)
def test_encode_gives_the_reference_bytes_or_error(message):
    assert _outcome(codec.encode, message) == _outcome(_reference_encode, message)


def _mutated(frame: bytes, data) -> bytes:
    """The frame with one of its field maps or arrays (the message's or a nested one's) changed: a field
    dropped, an unknown one added, or a value or array element replaced by any msgpack value."""
    kind, version, fields = msgpack.unpackb(frame, raw=False)
    found, todo = [], [fields]
    while todo:
        item = todo.pop()
        if isinstance(item, dict | list):
            found.append(item)
            todo.extend(item.values() if isinstance(item, dict) else item)
    target = data.draw(st.sampled_from(found))
    if isinstance(target, list):
        if target:
            target[data.draw(st.integers(0, len(target) - 1))] = data.draw(_WIRE_VALUES)
        return msgpack.packb([kind, version, fields], use_bin_type=True)
    action = data.draw(st.sampled_from(["drop", "add", "replace"] if target else ["add"]))
    if action == "add":
        target[data.draw(st.text(max_size=4))] = 1
    else:
        name = data.draw(st.sampled_from(sorted(target)))
        if action == "drop":
            del target[name]
        else:
            target[name] = data.draw(_WIRE_VALUES)
    return msgpack.packb([kind, version, fields], use_bin_type=True)


_WIRE_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats() | st.text(max_size=5) | st.binary(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_SENDABLE, st.data())
def test_decode_gives_the_reference_value_or_error(message, data):
    try:
        frame = _reference_encode(message)
    except codec.EncodeError:
        return
    assert _outcome(codec.decode, frame) == _outcome(REF.decode, frame)
    frame = _mutated(frame, data)
    assert _outcome(codec.decode, frame) == _outcome(REF.decode, frame)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(TYPES), st.dictionaries(st.sampled_from(["request_id", "kind", "x", "epoch"]), _WIRE_VALUES))
def test_decode_of_arbitrary_field_maps_matches_the_reference(cls, fields):
    frame = msgpack.packb([cls.KIND, cls.VERSION, fields], use_bin_type=True)
    assert _outcome(codec.decode, frame) == _outcome(REF.decode, frame)


# -- frozen bytes ---------------------------------------------------------------------------------------------
def _submit() -> SubmitRequest:
    sampling = SamplingSpec(max_tokens=64, temperature=0.7, seed=3, stop=("\n",), logit_bias_values=(1, 2.5))
    return SubmitRequest("req-1", tuple(range(100, 164)), sampling, "interactive", 200, 25.0, 1.0, 1.7e12, "s.r")


DIGESTS = {  # sha256 of nitsum 1e844f9's encode of each message
    "agree": "5afbe847595e63bb03a7f3b36d5f54bcedbaba0478c0e736383d45b730d0df48",
    "batch": "97f66152f8149b7aa5dcc7a9f5a41fce9715a00922fd9f7afb59da78a4bd733a",
    "command": "4834b6f6d9594838bcbe0fc1828ca671edf1ea1e68572b6807114db556f4f434",
    "error": "33cfaf5a918c0574fbfabd7d2d3ebc215296d585bf1a3af5d70c4f565842c282",
    "flow": "e2993842f0acfe02587083293551873f255a495588d8a53f8694a922a4c9e74e",  # + src/dst_link_gbps (issue 19)
    "run": "464477ef2be58c134da5ac58d5b957e892e1af0b17c017a0c26c8245a9a0494a",
    "share": "92350082933062d34d518ef8eddc9cb8d5a6fd659f43412f3a9cbce0d82f0d69",
    "stats": "db7666784d17227965ae7c90250975862c910dcb4d947883e94498b46c3a42ce",  # + kv_gather (issue 19)
    "submit": "01a262ebef5104828047eae876ab5bf0f895f5b7002edd39411a59684b8d4e2d",
}


def _frozen_messages():
    kv = tuple(KvEntry(f"req-{i}", 0, 2, 130, tuple(range(i * 9, i * 9 + 9))) for i in range(8))
    chunk = dict(text=" tok", logprobs=(-0.5,), top_k=1, top_logprob_ids=(3,), top_logprob_values=(-1,), attempt=0)
    return {
        "share": CommitShare(bytes(range(256)) * 10, kv, 41, ("req-9",), ""),
        "batch": TokenBatch("w0", tuple(TokenChunk(f"req-{i}", "w0", 17, (1000 + i,), **chunk) for i in range(4))),
        "submit": _submit(),
        "run": RunRequest(_submit(), reuse_hashes=(2**63 - 1, -5)),
        "agree": Agreement(""),
        "error": ErrorReply("c", "m", details={"a": "b", "c": "d"}),
        "command": NodeCommand(
            "prepare", 3, groups=((0, 2), (2, 2)), roles=("prefill", "decode"), leaders=("w0", "w2")
        ),
        "flow": FlowSubmit("f", "r", "u", "1", 10, "a", "b", target_layer=None, deadline_unix_ms=12.5),
        "stats": WorkerStats("w", "n", 0, "cpu", "decode", "ready", "g", 1, "m", 10, 0, 0, 1, 2, ("a",), (5,)),
    }


@pytest.mark.parametrize("name", sorted(_frozen_messages()))
def test_bytes_are_those_of_the_general_codec(name):
    message = _frozen_messages()[name]
    frame = codec.encode(message)
    assert hashlib.sha256(frame).hexdigest() == DIGESTS[name]
    assert codec.decode(frame) == message


def test_a_failed_encode_leaves_the_next_one_right():
    bad = _raw(KvEntry, {"request_id": "r", "start": {1}, "tp": 1, "num_computed_tokens": 0, "block_ids": ()})
    with pytest.raises(codec.EncodeError, match="cannot encode KvEntry") as info:
        codec.encode(bad)
    assert info.value.code == "unencodable"
    good = KvEntry("r", 0, 1, 0, (1, 2))
    assert codec.encode(good) == _reference_encode(good)


def test_a_dataclass_inside_a_plain_array_goes_as_a_map_as_before():
    share = _raw(KvEntry, {"request_id": "r", "start": 0, "tp": 1, "num_computed_tokens": 0, "block_ids": (1,)})
    odd = _raw(CommitShare, {"states": b"", "requests": (), "step_id": 0, "invalid": (share,), "error": ""})
    frame = codec.encode(odd)
    assert frame == _reference_encode(odd)
    assert msgpack.unpackb(frame)[2]["invalid"][0]["block_ids"] == [1]


def test_instances_made_without_init_are_equal_hashable_and_frozen():
    entry = KvEntry("r", 0, 2, 16, (1, 2, 3))
    back = codec.decode(codec.encode(entry))
    assert back == entry and hash(back) == hash(entry) and repr(back) == repr(entry)
    assert vars(back) == vars(entry) and list(vars(back)) == list(vars(entry))
    with pytest.raises(dataclasses.FrozenInstanceError):
        back.tp = 4


def test_post_init_validation_still_runs_on_decode():
    kind, version, fields = msgpack.unpackb(codec.encode(NodeCommand("commit", 3)))
    fields["kind"] = "explode"
    with pytest.raises(codec.DecodeError, match="node_command: unknown node command 'explode'") as info:
        codec.decode(msgpack.packb([kind, version, fields]))
    assert info.value.code == "bad_field"


def test_the_reference_runs_the_general_decoders_and_the_codec_the_generated_ones():
    for cls in (KvEntry, CommitShare, TokenChunk, SubmitRequest, NodeCommand):
        assert REF._decoder(cls).__name__ == "dec_dataclass"
        assert codec._decoder(cls).__name__ == "_decode"


def test_prepare_codecs_makes_the_encoders_too():
    codec._ENCODERS.pop(Agreement, None)
    codec.prepare_codecs((Agreement,))
    assert codec._ENCODERS[Agreement].__name__ == "_encode"
    assert codec._decoder(Agreement).__name__ == "_decode"
