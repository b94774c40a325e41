"""Hypothesis strategies for any protobuf message, built from its descriptor.

Nothing here names a hora.v1 field: a field added to a .proto is fuzzed
the day it is generated. Each scalar type draws from the values that break
things (0, -1, the type's extremes, unknown enum numbers, empty and very long
strings, NaN) as well as from its whole range; repeated fields draw short
lists of small numbers, so duplicates (ranks named twice) come often.

:func:`message_strategy` mixes two kinds of message:

- *wild*: every field unset or drawn from the whole range. A request with a
  dozen wild fields is refused by its first check, so these probe the checks
  one at a time, and the decoding of odd values.
- *aimed*: every field named in ``aims`` gets an aimed value (the fuzzers aim
  at a live job, its workers, tensor names the ranks share, ...), every other
  field keeps its default (a oneof: one member in play), and then none or up
  to three fields are made wild. These
  get past the first checks into the code behind them, one bad field at a
  time.

``aims`` maps a field *name* (at any depth) to a strategy; for a repeated
field it may draw either one element or a whole list. ``"oneof:NAME"`` draws
which member of the oneof NAME an aimed message sets.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

__all__ = ["message_strategy", "strings"]

_F = FieldDescriptor
_INT_RANGES = {
    _F.TYPE_INT32: (-(2**31), 2**31 - 1),
    _F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    _F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    _F.TYPE_INT64: (-(2**63), 2**63 - 1),
    _F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    _F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    _F.TYPE_UINT32: (0, 2**32 - 1),
    _F.TYPE_FIXED32: (0, 2**32 - 1),
    _F.TYPE_UINT64: (0, 2**64 - 1),
    _F.TYPE_FIXED64: (0, 2**64 - 1),
}
_MAX_DEPTH = 3
_MAX_REPEATED = 6
_MAX_WILD_FIELDS = 3

Aims = Mapping[str, st.SearchStrategy[Any]]


def strings(max_long: int = 100_000) -> st.SearchStrategy[str]:
    """Short text, odd characters, and now and then a very long run of one character."""
    short = st.text(max_size=12)
    odd = st.sampled_from(["", " ", "/", "..", "\x00", "'", '"', "\\", "\n", "é", "🙂",
                           "job/gen-1/", "{job_id}", "%s", "a" * 300])
    long = st.builds(lambda c, n: c * n, st.sampled_from(["x", "é", "\x00"]),
                     st.integers(1_000, max_long))
    return st.one_of(short, short, odd, odd, long)


def _integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted({v for v in (0, 1, -1, 2, lo, hi, lo + 1, hi - 1) if lo <= v <= hi})
    return st.one_of(
        st.integers(max(lo, -2), min(hi, 8)), st.sampled_from(edges), st.integers(lo, hi)
    )


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind in _INT_RANGES:
        return _integers(*_INT_RANGES[kind])
    if kind == _F.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        # proto3 enums are open: any int32 arrives, known or not.
        return st.one_of(st.sampled_from(known), _integers(-(2**31), 2**31 - 1))
    if kind == _F.TYPE_BOOL:
        return st.booleans()
    if kind in (_F.TYPE_DOUBLE, _F.TYPE_FLOAT):
        edges = st.sampled_from([0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, math.nan, 1e308])
        return st.one_of(edges, st.floats(width=64 if kind == _F.TYPE_DOUBLE else 32))
    if kind == _F.TYPE_STRING:
        return strings()
    if kind == _F.TYPE_BYTES:
        short = st.binary(max_size=16)
        return st.one_of(
            short,
            short,
            st.sampled_from([b"", b"0", b"-1", b"9" * 30, b"\xff\xfe"]),
            st.builds(lambda n: b"\x01" * n, st.integers(1_000, 300_000)),
        )
    raise TypeError(f"no strategy for field {field.full_name} of type {kind}")


def _repeated(field: FieldDescriptor) -> bool:
    is_repeated = getattr(field, "is_repeated", None)  # protobuf >= 5.28
    if is_repeated is not None:
        return bool(is_repeated)
    return field.label == _F.LABEL_REPEATED


def _set(message: Message, field: FieldDescriptor, value: Any) -> None:
    name = field.name
    if field.type == _F.TYPE_MESSAGE:
        if field.message_type.GetOptions().map_entry:  # a map: its entries, one by one
            for item in value:
                getattr(message, name)[item.key] = item.value
        elif _repeated(field):
            for item in value:
                getattr(message, name).add().CopyFrom(item)
        else:
            getattr(message, name).CopyFrom(value)
    elif _repeated(field):
        getattr(message, name).extend(value)
    else:
        setattr(message, name, value)


def _wild_value(field: FieldDescriptor, aims: Aims, depth: int) -> st.SearchStrategy[Any]:
    if field.type == _F.TYPE_MESSAGE:
        if depth >= _MAX_DEPTH:
            one: st.SearchStrategy[Any] = st.just(GetMessageClass(field.message_type)())
        else:
            one = message_strategy(field.message_type, aims, depth + 1)
    else:
        one = _scalar(field)
    if _repeated(field):
        return st.lists(one, max_size=_MAX_REPEATED)
    return one


def _wild(descriptor: Descriptor, aims: Aims, depth: int) -> st.SearchStrategy[Message]:
    cls = GetMessageClass(descriptor)
    in_oneof = {f.name for o in descriptor.oneofs for f in o.fields}
    plain = {
        f.name: st.none() | _wild_value(f, aims, depth)
        for f in descriptor.fields if f.name not in in_oneof
    }
    oneofs = [
        st.none() | st.one_of([
            st.tuples(st.just(f.name), _wild_value(f, aims, depth)) for f in o.fields
        ])
        for o in descriptor.oneofs
    ]

    def build(values: dict[str, Any], chosen: tuple[tuple[str, Any] | None, ...]) -> Message:
        message = cls()
        items = [(k, v) for k, v in values.items() if v is not None]
        items += [c for c in chosen if c is not None]
        for name, value in items:
            _set(message, descriptor.fields_by_name[name], value)
        return message

    return st.builds(build, st.fixed_dictionaries(plain), st.tuples(*oneofs))


def _aimed(descriptor: Descriptor, aims: Aims, depth: int) -> st.SearchStrategy[Message]:
    cls = GetMessageClass(descriptor)
    names = [f.name for f in descriptor.fields]

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        message = cls()
        some_wild = st.lists(st.sampled_from(names), min_size=1, max_size=_MAX_WILD_FIELDS,
                             unique=True)
        wild = set(draw(st.just([]) | some_wild)) if names else set()
        # One member of each oneof is in play; the others stay unset.
        in_play = {f.name for f in descriptor.fields if f.containing_oneof is None}
        for oneof in descriptor.oneofs:
            members = st.sampled_from([f.name for f in oneof.fields])
            in_play.add(draw(aims.get(f"oneof:{oneof.name}", members)))
        for field in descriptor.fields:
            if field.name not in in_play:
                continue
            if field.name in wild:
                value = draw(st.none() | _wild_value(field, aims, depth))
            elif field.name in aims:
                value = draw(aims[field.name])
                if _repeated(field) and not isinstance(value, list):
                    value = [value, *draw(st.lists(aims[field.name], max_size=2))]
            elif field.type == _F.TYPE_MESSAGE and depth < _MAX_DEPTH:
                inner = _aimed(field.message_type, aims, depth + 1)
                if _repeated(field):
                    value = draw(st.lists(inner, min_size=1, max_size=3))
                elif field.containing_oneof is not None:
                    value = draw(inner)
                else:
                    value = draw(st.none() | inner)
            else:
                value = None  # the field's default
            if value is not None:
                _set(message, field, value)
        return message

    return build()


def message_strategy(
    descriptor: Descriptor, aims: Aims | None = None, _depth: int = 0
) -> st.SearchStrategy[Message]:
    """Messages of type ``descriptor``, aimed (first, and shrunk towards) or wild."""
    aims = dict(aims or {})
    return st.one_of(_aimed(descriptor, aims, _depth), _wild(descriptor, aims, _depth))
