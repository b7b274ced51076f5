"""Straight-line encode and decode functions made once per message dataclass, for `nitsum.wire.codec`.

Each function is Python source built from the class's own field names and annotations (never from wire data)
and compiled with `exec` on first use, the way attrs and msgspec build per-class code: no loop over field specs
at run time, each attribute or map entry read directly. The encoder hands values to msgpack as they are (but
nested messages); the decoder takes a map of exactly the class's fields whose values have the classes a
well-formed frame gives in one test, checks only arrays and nested maps further, and hands any other map to the
codec's general decoder, which goes field after field as the codec always did. The results are those of the general
codec: the same bytes, the same values, the same errors with the same paths (a path is built only after a
failure, by decoding the failed value again with it). tests/unit/test_wire_codec_same.py compares them.
"""

from __future__ import annotations

import dataclasses
import inspect
import keyword
import operator
import types
import typing
from typing import Any

_PLAIN = (str, int, float, bool, bytes)
_MISSING = object()  # a field absent from the wire map (never a msgpack value)


def _optional_of(tp: Any) -> type | None:
    """T for an annotation `T | None` of a plain T, else None."""
    if typing.get_origin(tp) not in (typing.Union, types.UnionType):
        return None
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if len(args) == 1 and len(typing.get_args(tp)) == 2 and args[0] in _PLAIN else None


def _tuple_elem(tp: Any) -> Any:
    """T for an annotation `tuple[T, ...]`, else None."""
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return args[0]
    return None


def _attr(name: str) -> str:
    return f"_o.{name}" if name.isidentifier() and not keyword.iskeyword(name) else f"getattr(_o, {name!r})"


def _compile(func: str, cls: type, lines: list[str], namespace: dict[str, Any]):
    source = "\n".join(lines) + "\n"
    exec(compile(source, f"<nitsum.wire.codegen {func} {cls.__qualname__}>", "exec"), namespace)
    return namespace[func]


def make_encoder(cls: type, names: tuple[str, ...], hints: dict[str, Any] | None, to_wire, encoder_of):
    """A function message -> its field map for msgpack, values as they are but for nested dataclasses (through
    `encoder_of(X)`, None while X's is being made) and values of another class than the annotation's dataclass
    (through `to_wire`). The map packs to the bytes `to_wire`'s map does whenever msgpack packs it at all:
    `to_wire` only turns dataclasses into maps and sequences into lists, and msgpack refuses a dataclass (the
    codec then packs `to_wire`'s map, for its bytes or its error). The one value this does not hold for, a
    dataclass that also subclasses int, str, list or dict, which msgpack would pack as that type, no message
    has."""
    ns: dict[str, Any] = {"_tw": to_wire, "_tuple": tuple}
    body, items = [], []
    for i, name in enumerate(names):
        tp = hints.get(name) if hints is not None else None
        elem = _tuple_elem(tp)
        v = f"_v{i}"
        if elem is not None and dataclasses.is_dataclass(elem) and encoder_of(elem) is not None:
            ns[f"_X{i}"], ns[f"_e{i}"] = elem, encoder_of(elem)
            body.append(f"    {v} = {_attr(name)}")
            body.append(f"    if {v}.__class__ is _tuple:")
            body.append(f"        {v} = [_e{i}(_x) if _x.__class__ is _X{i} else _tw(_x) for _x in {v}]")
            body.append("    else:")
            body.append(f"        {v} = _tw({v})")
            items.append(f"{name!r}: {v}")
        elif dataclasses.is_dataclass(tp) and encoder_of(tp) is not None:
            ns[f"_X{i}"], ns[f"_e{i}"] = tp, encoder_of(tp)
            body.append(f"    {v} = {_attr(name)}")
            items.append(f"{name!r}: _e{i}({v}) if {v}.__class__ is _X{i} else _tw({v})")
        elif dataclasses.is_dataclass(elem) or dataclasses.is_dataclass(tp):  # its encoder is being made
            items.append(f"{name!r}: _tw({_attr(name)})")
        else:
            items.append(f"{name!r}: {_attr(name)}")
    lines = ["def _encode(_o):", *body, "    return {" + ", ".join(items) + "}"]
    return _compile("_encode", cls, lines, ns)


def _bypasses_init(cls: type, fields: tuple[dataclasses.Field, ...]) -> bool:
    """Whether an instance can be made without the dataclass's __init__ (object.__new__ + its __dict__): only
    where __init__ is the one dataclasses generated and would do nothing but store the fields as given."""
    init = cls.__dict__.get("__init__")
    return (
        not hasattr(cls, "__post_init__")
        and len(fields) == len(dataclasses.fields(cls))
        and all(f.default_factory is dataclasses.MISSING for f in fields)
        and all("__slots__" not in c.__dict__ for c in cls.__mro__[:-1])
        and cls.__new__ is object.__new__
        and init is not None
        and getattr(getattr(init, "__code__", None), "co_filename", None) == "<string>"
        and list(inspect.signature(init).parameters)[1:] == [f.name for f in fields]
    )


def _retry(i: int, name: str, indent: str) -> list[str]:
    """`_v{i} = _d{i}(_v{i}, _path)`, called again with the field's path when it fails."""
    return [
        f"{indent}try:",
        f"{indent}    _v{i} = _d{i}(_v{i}, _path)",
        f"{indent}except _DecodeError:",
        f"{indent}    _d{i}(_v{i}, _path + {'.' + name!r})",
        f"{indent}    raise",
    ]


def _wire_check(i: int, tp: Any, ns: dict[str, Any]) -> str | None:
    """A test that `_v{i}` has the class msgpack gives for a well-formed value of annotation `tp` (None: no such
    test here, the class has no fast path)."""
    ns[f"_W{i}"] = tp if tp in _PLAIN else _optional_of(tp)
    if tp in _PLAIN:
        return f"_v{i}.__class__ is _W{i}"
    if _optional_of(tp) is not None:
        return f"(_v{i} is None or _v{i}.__class__ is _W{i})"
    if _tuple_elem(tp) is not None:
        return f"_v{i}.__class__ is _list"
    if dataclasses.is_dataclass(tp) or typing.get_origin(tp) is dict:
        return f"_v{i}.__class__ is _dict"
    return None


def _fast_lines(fields, hints: dict[str, Any], ns: dict[str, Any]) -> list[str]:
    """The fast path: a map of exactly the class's fields (as every encoder writes it) whose values all have
    the classes a well-formed frame gives is read in one `itemgetter` call and one test of its values'
    classes; only arrays and maps then go on to their own checks (no lines: the class has no fast path)."""
    checks = [_wire_check(i, hints[f.name], ns) for i, f in enumerate(fields)]
    if not fields or None in checks:
        return []
    if len(fields) > 1:
        ns["_get"] = operator.itemgetter(*(f.name for f in fields))
        get = "_get(_m)"
    else:
        get = f"(_m[{fields[0].name!r}],)"
    lines = [
        f"    if _m.__class__ is _dict and len(_m) == {len(fields)}:",
        "        try:",
        "            " + "".join(f"_v{i}, " for i in range(len(fields))) + f"= {get}",
        "        except KeyError:",
        "            _v0 = _MISSING",
        f"        if {' and '.join(checks)}:",
    ]
    changed = []  # the fields whose value is not the map's own (arrays made tuples, nested messages)
    for i, f in enumerate(fields):
        tp = hints[f.name]
        if _tuple_elem(tp) in _PLAIN:
            ns[f"_S{i}"] = frozenset({_tuple_elem(tp)})
            lines.append(f"            if _S{i}.issuperset(map(_type, _v{i})):")
            lines.append(f"                _v{i} = _tuple(_v{i})")
            lines.append("            else:")
            lines += _retry(i, f.name, "                ")
        elif _tuple_elem(tp) is not None or tp not in _PLAIN and _optional_of(tp) is None:
            lines += _retry(i, f.name, "            ")
        else:
            continue
        changed.append(i)
    if not _bypasses_init(ns["_cls"], fields):
        args = [f"{f.name}=_v{i}" if f.kw_only else f"_v{i}" for i, f in enumerate(fields)]
        return [*lines, f"            return _cls({', '.join(args)})"]
    # The map holds exactly the fields: the instance's __dict__ is a copy of it, changed values put back.
    stores = [f"            _od[{fields[i].name!r}] = _v{i}" for i in changed]
    return [
        *lines,
        "            _o = _new(_cls)",
        "            _od = _o.__dict__",
        "            _od.update(_m)",
        *stores,
        "            return _o",
    ]


def make_decoder(cls: type, fields, hints: dict[str, Any], decoders: list, general, decode_error: type):
    """A function (field map, path) -> the instance of `cls`, or DecodeError, as `general` gives them: the fast
    path above, where it applies, and `general` (the codec's field-by-field decoder) for every other map.
    `decoders[i]` decodes field i (called again with the field's path when it fails)."""
    ns: dict[str, Any] = {
        "_cls": cls,
        "_general": general,
        "_MISSING": _MISSING,
        "_DecodeError": decode_error,
        "_dict": dict,
        "_list": list,
        "_tuple": tuple,
        "_type": type,
        "_new": object.__new__,
    }
    ns.update({f"_d{i}": dec for i, dec in enumerate(decoders)})
    fast = _fast_lines(fields, hints, ns)
    if not fast:
        return general
    return _compile("_decode", cls, ["def _decode(_m, _path):", *fast, "    return _general(_m, _path)"], ns)
