"""The checkers bounds.py runs: Python made once from the request messages' descriptors
and bounds.py's tables (``BOUNDS``, ``ELSEWHERE``; the module docstring there says what
they bound), each field checked inline, so that a Step of hundreds of operations is
checked in well under a millisecond. A field past its bound raises :class:`TooLong`,
which bounds.check_request turns into INVALID_ARGUMENT."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from kvcoord.v1 import allocator_pb2 as pb

__all__ = ["SIZE_FIRST_ITEMS", "Checker", "TooLong", "compile_checkers", "is_repeated", "request_messages"]

#: (bounds, elsewhere): bounds.py's tables
_Tables = tuple[Mapping[str, "int | str"], Mapping[str, str]]


def is_repeated(f: FieldDescriptor) -> bool:
    return bool(f.is_repeated)


def _message(f: FieldDescriptor) -> Descriptor:
    """The message type of a message field."""
    d = f.message_type
    assert d is not None, f.full_name
    return d


def request_messages() -> list[Descriptor]:
    """Every message a request can contain, request types included, each once, every
    message after the messages it contains."""
    order: list[Descriptor] = []
    seen: set[str] = set()

    def visit(d: Descriptor) -> None:
        if d.full_name in seen:
            return
        seen.add(d.full_name)
        for f in d.fields:
            if f.type == FieldDescriptor.TYPE_MESSAGE:
                visit(_message(f))
        order.append(d)

    for method in pb.DESCRIPTOR.services_by_name["Allocator"].methods:
        visit(method.input_type)
    return order


_UNCHECKED_STRING = 1024  # a string field missing from the bounds (a test forbids that)

#: a list of more messages than this has each one's size read first (a small one is not
#: checked further); a shorter list has each checked at once
SIZE_FIRST_ITEMS = 16

#: checks one message: (message, limits) -> None, raising TooLong
Checker = Callable[[Any, Any], None]


class TooLong(Exception):
    """A field past its bound (``path`` from the request message down)."""

    def __init__(self, path: str, size: int, bound: int, setting: str | None, unit: str) -> None:
        self.path, self.size, self.bound, self.setting, self.unit = path, size, bound, setting, unit


def _element_too_long(path: str, values: Any, bound: int, setting: str | None) -> TooLong:
    longest = max(map(len, values))
    i = next(j for j, v in enumerate(values) if len(v) == longest)
    unit = "bytes" if isinstance(values[i], bytes) else "characters"
    return TooLong(f"{path}[{i}]", longest, bound, setting, unit)


def _bound_expr(bound: int | str) -> tuple[str, str]:
    """Python source of a bound's value and of its setting's name (``"4 * setting"``:
    a packed column's bytes, four per value)."""
    if isinstance(bound, int):
        return str(bound), "None"
    factor, _, setting = bound.rpartition(" * ")
    return (f"{factor} * limits.{setting}" if factor else f"limits.{setting}"), repr(bound)


def _smallest(d: Descriptor, tables: _Tables, seen: frozenset[str] = frozenset()) -> tuple[int, set[str]]:
    """The smallest bound in message ``d`` and every message it contains: (the smallest
    number, the settings named). A message whose serialized size is at most the
    smallest of them cannot be past any (each item of a list takes a byte or more)."""
    least, settings = _UNCHECKED_STRING, set()
    BOUNDS, ELSEWHERE = tables  # noqa: N806 - bounds.py's tables
    for f in d.fields:
        key = f"{d.name}.{f.name}"
        repeated = is_repeated(f)
        text = f.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES)
        bounds = []
        if repeated and key in BOUNDS:
            bounds.append(BOUNDS[key])
        if text and (key + "[]" if repeated else key) not in ELSEWHERE:
            bounds.append(BOUNDS.get(key + "[]" if repeated else key, _UNCHECKED_STRING))
        for b in bounds:
            if isinstance(b, int):
                least = min(least, b)
            else:
                settings.add(b)
        if f.type == FieldDescriptor.TYPE_MESSAGE and _message(f).full_name not in seen:
            n, more = _smallest(_message(f), tables, seen | {d.full_name})
            least, settings = min(least, n), settings | more
    return least, settings


def _source(d: Descriptor, name: str, subs: dict[str, str], tables: _Tables) -> list[str]:
    """The body of the checker of message ``d`` (each field checked inline: a Step of
    hundreds of operations is checked in well under a millisecond)."""
    lines: list[str] = []
    oneofs: dict[str, list[str]] = {}
    BOUNDS, ELSEWHERE = tables  # noqa: N806 - bounds.py's tables
    for f in d.fields:
        key = f"{d.name}.{f.name}"
        repeated = is_repeated(f)
        text = f.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES)
        sub = subs.get(_message(f).full_name) if f.type == FieldDescriptor.TYPE_MESSAGE else None
        if f.type == FieldDescriptor.TYPE_MESSAGE and not repeated:
            if sub is None:
                continue
            if f.containing_oneof is not None:
                oneofs.setdefault(f.containing_oneof.name, []).append(f.name)
                continue
            lines += [
                f"if m.HasField({f.name!r}):",
                "    try:",
                f"        {sub}(m.{f.name}, limits)",
                "    except _TooLong as exc:",
                f"        exc.path = {'.' + f.name!r} + exc.path",
                "        raise",
            ]
            continue
        if not (repeated or text):
            continue
        mark = len(lines)
        lines.append(f"v = m.{f.name}")
        if repeated and key in BOUNDS:
            value, setting = _bound_expr(BOUNDS[key])
            lines += [
                f"if len(v) > {value}:",
                f"    raise _TooLong({'.' + f.name!r}, len(v), {value}, {setting}, 'items')",
            ]
        if repeated and text and key + "[]" in ELSEWHERE:
            pass
        elif repeated and text:
            value, setting = _bound_expr(BOUNDS.get(key + "[]", _UNCHECKED_STRING))
            lines += [
                f"if v and max(map(len, v)) > {value}:",
                f"    raise _element_too_long({'.' + f.name!r}, v, {value}, {setting})",
            ]
        elif text and key in ELSEWHERE:
            pass
        elif text:
            value, setting = _bound_expr(BOUNDS.get(key, _UNCHECKED_STRING))
            unit = "bytes" if f.type == FieldDescriptor.TYPE_BYTES else "characters"
            lines += [
                f"if len(v) > {value}:",
                f"    raise _TooLong({'.' + f.name!r}, len(v), {value}, {setting}, {unit!r})",
            ]
        elif sub is not None:
            # Items this small cannot be past a bound: only their size is read (a Step of
            # many small operations; ByteSize costs less than reading their fields). But
            # ByteSize serializes the item: in a short list (a decode Step's few runs, a
            # new request's prompt) the items are large, and reading their size cost as
            # much as checking them again, so each is checked at once.
            least, settings = _smallest(_message(f), tables)
            parts = [str(least)] + [_bound_expr(x)[0] for x in sorted(settings)]
            safe = f"min({', '.join(parts)})" if len(parts) > 1 else parts[0]
            lines += [
                f"safe = {safe} if len(v) > {SIZE_FIRST_ITEMS} else -1",
                "for i, item in enumerate(v):",
                "    if safe >= 0 and item.ByteSize() <= safe:",
                "        continue",
                "    try:",
                f"        {sub}(item, limits)",
                "    except _TooLong as exc:",
                f"        exc.path = f'.{f.name}[{{i}}]' + exc.path",
                "        raise",
            ]
        if len(lines) == mark + 1:  # nothing checked (a column bounded elsewhere): not even read
            del lines[mark:]
    for group, members in oneofs.items():
        lines += [f"k = m.WhichOneof({group!r})"]
        for i, member in enumerate(members):
            sub = subs[_message(d.fields_by_name[member]).full_name]
            lines += [
                f"{'if' if i == 0 else 'elif'} k == {member!r}:",
                "    try:",
                f"        {sub}(m.{member}, limits)",
                "    except _TooLong as exc:",
                f"        exc.path = {'.' + member!r} + exc.path",
                "        raise",
            ]
    return lines


def compile_checkers(bounds: Mapping[str, int | str], elsewhere: Mapping[str, str]) -> dict[str, Checker]:
    """One checker per request message type (and per message they contain that has a
    bounded field), made from the descriptors and bounds.py's ``BOUNDS`` and
    ``ELSEWHERE`` (``bounds``, ``elsewhere``)."""
    tables = (bounds, elsewhere)
    names: dict[str, str] = {}
    namespace: dict[str, Any] = {"_TooLong": TooLong, "_element_too_long": _element_too_long}
    for d in request_messages():
        name = "check_" + d.full_name.replace(".", "_")
        body = _source(d, name, names, tables)
        if not body:
            continue
        source = f"def {name}(m, limits):\n" + "".join(f"    {line}\n" for line in body)
        exec(compile(source, f"<bounds {d.full_name}>", "exec"), namespace)  # noqa: S102 - from descriptors
        names[d.full_name] = name
    return {full: namespace[name] for full, name in names.items()}
