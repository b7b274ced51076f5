"""The one msgpack codec for every nitsum message.

Frame layout: a msgpack array `[kind, version, {field: value, ...}]`. Nested messages (for example
`SubmitRequest.sampling`) travel as plain field maps; their type comes from the annotation, so only
the outer frame carries a kind. Decoding is strict: the frame size is bounded, the kind must be
known, the version must not be newer than ours, required fields must be present, unknown fields
are refused and every value must have its declared type. Nothing but msgpack is ever used.

Each message class gets a generated encoder and decoder on first use (`nitsum.wire.codegen`); they give what
the general functions here give (`_to_wire`, and the per-type decoders for each field), faster.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, TypeVar

import msgpack

from nitsum.wire import codegen
from nitsum.wire.messages import MESSAGE_TYPES
from nitsum.wire.node import NODE_MESSAGE_TYPES

MAX_FRAME_BYTES = 8 * 1024 * 1024

T = TypeVar("T")


class WireError(Exception):
    """Base of codec failures; `code` is a short stable identifier (also used as a metric label)."""

    code = "wire_error"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class EncodeError(WireError):
    code = "encode_error"


class DecodeError(WireError):
    code = "decode_error"


_BY_KIND: dict[str, type] = {}
for _cls in (*MESSAGE_TYPES, *NODE_MESSAGE_TYPES):
    assert _cls.KIND not in _BY_KIND, f"duplicate message kind {_cls.KIND!r}"
    assert dataclasses.is_dataclass(_cls) and not issubclass(_cls, (list, tuple, dict)), _cls
    _BY_KIND[_cls.KIND] = _cls


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def _fields(cls: type) -> tuple[dataclasses.Field, ...]:
    return tuple(f for f in dataclasses.fields(cls) if f.init)


_PRIMITIVES = frozenset({str, int, float, bool, bytes, type(None)})


@functools.cache
def _field_names(cls: type) -> tuple[str, ...] | None:
    """The init fields of a dataclass type (None for any other type)."""
    if not dataclasses.is_dataclass(cls):
        return None
    return tuple(f.name for f in _fields(cls))


def _to_wire(value: Any) -> Any:
    """The field map of a message, checked value by value (the reference encoding, see `_encoder`)."""
    cls = value.__class__
    if cls in _PRIMITIVES:
        return value
    if cls is tuple or cls is list:
        # msgpack packs a tuple as it packs a list: arrays of plain values go as they are.
        if _PRIMITIVES.issuperset(map(type, value)):
            return value
        return [v if v.__class__ in _PRIMITIVES else _to_wire(v) for v in value]
    if isinstance(value, (list, tuple)):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    names = _field_names(cls) if not isinstance(value, type) else None
    if names is not None:
        fields = {}
        for name in names:
            v = getattr(value, name)
            fields[name] = v if v.__class__ in _PRIMITIVES else _to_wire(v)
        return fields
    return value


_ENCODERS: dict[type, Any] = {}  # dataclass type -> its generated encoder
_ENCODING: set[type] = set()  # dataclass types whose encoder is being made (a type that contains itself)


def _encoder(cls: type):
    """The generated encoder of a dataclass type (None while it is being made): the field map `_to_wire`
    makes, without looking into values that msgpack packs as they are (see `codegen.make_encoder`)."""
    enc = _ENCODERS.get(cls)
    if enc is not None or cls in _ENCODING:
        return enc
    try:
        hints = _hints(cls)
    except Exception:  # annotations that do not resolve: nested values through _to_wire
        hints = None
    _ENCODING.add(cls)
    try:
        enc = _ENCODERS[cls] = codegen.make_encoder(cls, _field_names(cls), hints, _to_wire, _encoder)
    finally:
        _ENCODING.discard(cls)
    return enc


def encode(message: Any, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """Serialize a message dataclass; raises EncodeError if it is not a registered message or too large."""
    cls = type(message)
    if _BY_KIND.get(getattr(cls, "KIND", None)) is not cls:
        raise EncodeError(f"{cls.__name__} is not a registered wire message", "unknown_kind")
    try:
        frame = msgpack.packb(
            [cls.KIND, cls.VERSION, (_ENCODERS.get(cls) or _encoder(cls) or _to_wire)(message)], use_bin_type=True
        )
    except (TypeError, ValueError, OverflowError):
        frame = None  # something msgpack does not pack as it is: the reference encoding's bytes or error
    if frame is None:
        try:
            frame = msgpack.packb([cls.KIND, cls.VERSION, _to_wire(message)], use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise EncodeError(f"cannot encode {cls.__name__}: {exc}", "unencodable") from exc
    if len(frame) > max_bytes:
        raise EncodeError(f"{cls.__name__} is {len(frame)} bytes, over the {max_bytes}-byte limit", "too_large")
    return frame


def _bad(path: str, expected: str, value: Any) -> DecodeError:
    return DecodeError(f"field {path}: expected {expected}, got {type(value).__name__}", "bad_field")


@functools.cache
def _decoder(tp: Any):
    """A function (value, path) -> the value checked (and built) as `tp`, or DecodeError; made once per type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _union_decoder(tp)
    if tp in _SCALAR_DECODERS:
        return _SCALAR_DECODERS[tp]
    if origin is tuple:
        return _tuple_decoder(tp)
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        key_dec, val_dec = _decoder(key_tp), _decoder(val_tp)

        def dec_dict(value, path):
            if not isinstance(value, dict):
                raise _bad(path, "map", value)
            return {key_dec(k, f"{path}.key"): val_dec(v, f"{path}[{k!r}]") for k, v in value.items()}

        return dec_dict
    if dataclasses.is_dataclass(tp):
        return _dataclass_decoder(tp)

    def unsupported(value, path):
        raise DecodeError(f"field {path}: unsupported type {tp}", "bad_field")

    return unsupported


def _union_decoder(tp: Any):
    args = typing.get_args(tp)
    allows_none = type(None) in args
    non_none = [a for a in args if a is not type(None)]
    inner = _decoder(non_none[0]) if len(non_none) == 1 else None

    def dec_union(value, path):
        if value is None and allows_none:
            return None
        if inner is None:
            raise DecodeError(f"field {path}: unsupported union {tp}", "bad_field")
        return inner(value, path)

    return dec_union


def _dec_bool(value, path):
    if not isinstance(value, bool):
        raise _bad(path, "bool", value)
    return value


def _dec_int(value, path):
    if not isinstance(value, int) or isinstance(value, bool):
        raise _bad(path, "int", value)
    return value


def _dec_float(value, path):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(path, "float", value)
    return float(value)


def _dec_str(value, path):
    if not isinstance(value, str):
        raise _bad(path, "str", value)
    return value


def _dec_bytes(value, path):
    if not isinstance(value, bytes):
        raise _bad(path, "bytes", value)
    return value


_SCALAR_DECODERS = {bool: _dec_bool, int: _dec_int, float: _dec_float, str: _dec_str, bytes: _dec_bytes}
# Values msgpack gives that a scalar decoder returns unchanged (the fast path skips the call; floats from ints
# and anything else take the decoder).
_PASS = {bool: bool, int: int, float: float, str: str, bytes: bytes}


def _tuple_decoder(tp: Any):
    args = typing.get_args(tp)
    assert len(args) == 2 and args[1] is Ellipsis, f"only tuple[T, ...] is supported on the wire ({tp})"
    elem = _decoder(args[0])
    same = _PASS.get(args[0])

    def dec_tuple(value, path):
        if not isinstance(value, (list, tuple)):
            raise _bad(path, "array", value)
        if same is not None:
            kinds = set(map(type, value))
            if not kinds or kinds == {same}:
                return tuple(value)
        try:
            return tuple([elem(v, path) for v in value])
        except DecodeError:
            # Again with each element's own path in the message (paths are only built on failure).
            for i, v in enumerate(value):
                elem(v, f"{path}[{i}]")
            raise

    return dec_tuple


_BUILDING: set[Any] = set()  # dataclass types whose decoder is being made (a type that contains itself)


def _dataclass_decoder(cls: type):
    hints = _hints(cls)
    fields = _fields(cls)
    _BUILDING.add(cls)
    try:
        decoders = [_later(hints[f.name]) if hints[f.name] in _BUILDING else _decoder(hints[f.name]) for f in fields]
    finally:
        _BUILDING.discard(cls)
    general = _general_decoder(cls, fields, hints, decoders)
    return codegen.make_decoder(cls, fields, hints, decoders, general, DecodeError)


def _general_decoder(cls: type, fields: tuple[dataclasses.Field, ...], hints: dict[str, Any], decoders: list):
    """The field-by-field decoder of any map (the generated one hands it every map its fast path does not take):
    its type, unknown fields, then each field in order (missing, or the first bad value), then the instance."""
    specs = []
    for f, dec in zip(fields, decoders):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        specs.append((f.name, _PASS.get(hints[f.name]), dec, required))
    known = frozenset(name for name, *_ in specs)

    def dec_dataclass(fields_map, path):
        if not isinstance(fields_map, dict):
            raise _bad(path, "map", fields_map)
        if not known.issuperset(fields_map):
            unknown = set(fields_map) - known
            raise DecodeError(f"{path}: unknown field(s) {sorted(map(str, unknown))}", "bad_field")
        kwargs = {}
        for name, same, dec, required in specs:
            if name not in fields_map:
                if required:
                    raise DecodeError(f"{path}: missing required field {name!r}", "bad_field")
                continue
            value = fields_map[name]
            if value.__class__ is same:
                kwargs[name] = value
                continue
            try:
                kwargs[name] = dec(value, path)
            except DecodeError:
                dec(value, f"{path}.{name}")  # again with the field's path in the message
                raise
        return cls(**kwargs)

    return dec_dataclass


def _later(tp: Any):
    """A decoder of `tp` looked up when first called (for a field whose type is the dataclass being made)."""

    def dec_later(value, path):
        return _decoder(tp)(value, path)

    return dec_later


def prepare_codecs(types: tuple[type, ...]) -> None:
    """Make the decoders and encoders of these message types now (each is made on its first use otherwise: type
    hints resolved, source generated and compiled, ~0.1-1 ms a type), e.g. before a latency-critical first use
    such as a node's first TP change."""
    for cls in types:
        _decoder(cls)
        _encoder(cls)


def decode(frame: bytes, expected: type[T] | tuple[type, ...] | None = None, max_bytes: int = MAX_FRAME_BYTES) -> T:
    """Parse one frame into its message dataclass, or raise DecodeError (never anything else)."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise DecodeError(f"frame must be bytes, got {type(frame).__name__}", "malformed")
    if len(frame) > max_bytes:
        raise DecodeError(f"frame of {len(frame)} bytes is over the {max_bytes}-byte limit", "too_large")
    try:
        obj = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=max_bytes,
            max_bin_len=max_bytes,
            max_array_len=1 << 20,
            max_map_len=1 << 16,
        )
    except Exception as exc:  # msgpack raises several unrelated types for broken input
        raise DecodeError(f"not a msgpack frame: {type(exc).__name__}: {exc}", "malformed") from None
    if not (isinstance(obj, list) and len(obj) == 3):
        raise DecodeError("frame must be [kind, version, fields]", "malformed")
    kind, version, fields_map = obj
    if not isinstance(kind, str) or kind not in _BY_KIND:
        raise DecodeError(f"unknown message kind {kind!r}", "unknown_kind")
    cls = _BY_KIND[kind]
    if not isinstance(version, int) or isinstance(version, bool) or version < 1 or version > cls.VERSION:
        raise DecodeError(
            f"{kind}: unsupported schema version {version!r} (this build speaks {cls.VERSION})", "bad_version"
        )
    try:
        message = _decoder(cls)(fields_map, kind)
    except DecodeError:
        raise
    except (TypeError, ValueError) as exc:  # a message's own __post_init__ validation
        raise DecodeError(f"{kind}: {exc}", "bad_field") from None
    if expected is not None and not isinstance(message, expected):
        names = expected.__name__ if isinstance(expected, type) else "/".join(t.__name__ for t in expected)
        raise DecodeError(f"expected {names}, got {kind}", "unexpected_kind")
    return message
