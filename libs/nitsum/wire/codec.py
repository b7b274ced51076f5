"""The one msgpack codec for every nitsum message.

Frame layout: a msgpack array `[kind, version, {field: value, ...}]`. Nested messages (for example
`SubmitRequest.sampling`) travel as plain field maps; their type comes from the annotation, so only
the outer frame carries a kind. Decoding is strict: the frame size is bounded, the kind must be
known, the version must not be newer than ours, required fields must be present, unknown fields
are refused and every value must have its declared type. Nothing but msgpack is ever used.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, TypeVar

import msgpack

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
    _BY_KIND[_cls.KIND] = _cls


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def _fields(cls: type) -> tuple[dataclasses.Field, ...]:
    return tuple(f for f in dataclasses.fields(cls) if f.init)


def _to_wire(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_wire(getattr(value, f.name)) for f in _fields(type(value))}
    if isinstance(value, (list, tuple)):
        return [_to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    return value


def encode(message: Any, max_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """Serialize a message dataclass; raises EncodeError if it is not a registered message or too large."""
    cls = type(message)
    if _BY_KIND.get(getattr(cls, "KIND", None)) is not cls:
        raise EncodeError(f"{cls.__name__} is not a registered wire message", "unknown_kind")
    try:
        frame = msgpack.packb([cls.KIND, cls.VERSION, _to_wire(message)], use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise EncodeError(f"cannot encode {cls.__name__}: {exc}", "unencodable") from exc
    if len(frame) > max_bytes:
        raise EncodeError(f"{cls.__name__} is {len(frame)} bytes, over the {max_bytes}-byte limit", "too_large")
    return frame


def _bad(path: str, expected: str, value: Any) -> DecodeError:
    return DecodeError(f"field {path}: expected {expected}, got {type(value).__name__}", "bad_field")


def _from_wire(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return _from_wire(non_none[0], value, path)
        raise DecodeError(f"field {path}: unsupported union {tp}", "bad_field")
    if tp is bool:
        if not isinstance(value, bool):
            raise _bad(path, "bool", value)
        return value
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _bad(path, "int", value)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _bad(path, "float", value)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _bad(path, "str", value)
        return value
    if tp is bytes:
        if not isinstance(value, bytes):
            raise _bad(path, "bytes", value)
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise _bad(path, "array", value)
        assert len(args) == 2 and args[1] is Ellipsis, f"only tuple[T, ...] is supported on the wire ({tp})"
        return tuple(_from_wire(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise _bad(path, "map", value)
        return {_from_wire(key_tp, k, f"{path}.key"): _from_wire(val_tp, v, f"{path}[{k!r}]") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    raise DecodeError(f"field {path}: unsupported type {tp}", "bad_field")


def _build(cls: type[T], fields_map: Any, path: str) -> T:
    if not isinstance(fields_map, dict):
        raise _bad(path, "map", fields_map)
    hints = _hints(cls)
    known = {f.name: f for f in _fields(cls)}
    unknown = set(fields_map) - set(known)
    if unknown:
        raise DecodeError(f"{path}: unknown field(s) {sorted(map(str, unknown))}", "bad_field")
    kwargs = {}
    for name, f in known.items():
        if name not in fields_map:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise DecodeError(f"{path}: missing required field {name!r}", "bad_field")
            continue
        kwargs[name] = _from_wire(hints[name], fields_map[name], f"{path}.{name}")
    return cls(**kwargs)


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
        message = _build(cls, fields_map, kind)
    except DecodeError:
        raise
    except (TypeError, ValueError) as exc:  # a message's own __post_init__ validation
        raise DecodeError(f"{kind}: {exc}", "bad_field") from None
    if expected is not None and not isinstance(message, expected):
        names = expected.__name__ if isinstance(expected, type) else "/".join(t.__name__ for t in expected)
        raise DecodeError(f"expected {names}, got {kind}", "unexpected_kind")
    return message
