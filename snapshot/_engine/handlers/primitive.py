"""Primitives (bool, int, float, None, and short str / bytes) kept in the manifest itself; longer
str / bytes get a payload of their own."""

from __future__ import annotations

import typing

from manifest import PrimitiveEntry, int_fits
from snapshot._engine.handlers import objects
from snapshot._engine.handlers.table import Kind, ReadPlanner, TakeSink
from snapshot._engine.state_dicts import int_refusal
from snapshot.errors import UnsupportedValueError

if typing.TYPE_CHECKING:
    from snapshot._engine.handlers.table import Planned


class Primitive(Kind):
    """bool, int, float and None, and a str or bytes of at most ``inline_max`` bytes (a str
    encoded), are the manifest's own; a longer str or bytes is a payload of its own, and a str
    that UTF-8 cannot encode is pickled. An int of more digits than every reader converts
    (``manifest.int_fits``) is refused. By exact type only: a subclass (an IntEnum, a str enum)
    is pickled, as the object it is."""

    name = "primitive"
    value_types = (bool, int, float, type(None), str, bytes)
    entry_types = (PrimitiveEntry,)

    def accepts(self, value: typing.Any) -> bool:
        return type(value) in self.value_types

    def take(
        self, sink: TakeSink, path: str, logical: str, value: typing.Any, replicated: bool
    ) -> Planned:
        kind = type(value)
        if kind is int and not int_fits(value):
            raise UnsupportedValueError(int_refusal(path))  # ``check_nesting`` refuses most
        if kind is not str and kind is not bytes:
            return PrimitiveEntry(value=value, replicated=replicated)
        try:
            data = value.encode("utf-8") if kind is str else value
        except UnicodeEncodeError:  # lone surrogates: only pickle keeps them
            return objects.OBJECTS.take(sink, path, logical, value, replicated)
        if len(data) <= sink.inline_max:
            return PrimitiveEntry(value=value, replicated=replicated)
        serializer = "utf8" if kind is str else "bytes"
        return objects.bytes_draft(sink, path, logical, serializer, kind.__name__, data, replicated)

    def restore(
        self, reader: ReadPlanner, path: str, entry: PrimitiveEntry, target: typing.Any
    ) -> None:
        """The value recorded in the manifest, whatever the target (never filled in place)."""
        reader.objects[path] = entry.value


PRIMITIVE = Primitive()
