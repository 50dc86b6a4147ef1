"""Primitives (bool, int, float, None, and short str / bytes) kept in the manifest itself; longer
str / bytes get a payload of their own."""

from __future__ import annotations

import typing

from manifest import int_fits
from snapshot._engine.flatten import int_refusal
from snapshot._engine.handlers import objects
from snapshot._engine.handlers.table import Handler
from snapshot.errors import UnsupportedValueError

# ==== take ===================================================================================
# bool, int, float and None, and a str or bytes of at most ``inline_max_bytes`` (a str
# encoded), are the manifest's own; a longer str or bytes is a payload of its own
# (``objects.bytes_draft``), and a str that UTF-8 cannot encode is pickled. An int of more
# digits than every reader converts (``manifest.int_fits``) is refused.
# (``PrimitiveEntry`` is imported with the restore section below.)

if typing.TYPE_CHECKING:
    from snapshot._engine.take.plan import Collector, Planned


def take(
    planner: Collector, path: str, logical: str, value: typing.Any, replicated: bool
) -> Planned:
    """A primitive's entry, or the draft of a long str's or bytes' payload."""
    kind = type(value)
    if kind is str:
        try:
            data = value.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: only pickle keeps them
            return objects.take(planner, path, logical, value, replicated)
        if len(data) <= planner.inline_max:
            return PrimitiveEntry(value=value, replicated=replicated)
        return objects.bytes_draft(planner, path, logical, "utf8", "str", data, replicated)
    if kind is bytes:
        if len(value) <= planner.inline_max:
            return PrimitiveEntry(value=value, replicated=replicated)
        return objects.bytes_draft(planner, path, logical, "bytes", "bytes", value, replicated)
    if kind is int and not int_fits(value):
        # ``flatten.check_nesting`` refuses it before the take writes anything; this guards
        # any other way in.
        raise UnsupportedValueError(int_refusal(path))
    return PrimitiveEntry(value=value, replicated=replicated)


# ==== restore ================================================================================
# Nothing to read: the value is the manifest's own (a long str or bytes has an ObjectEntry).

from typing import TYPE_CHECKING, Any  # noqa: E402

from manifest import PrimitiveEntry  # noqa: E402

if TYPE_CHECKING:
    from snapshot._engine.restore.loader import Loader


def restore(loader: Loader, path: str, entry: PrimitiveEntry, target: Any) -> None:
    """The value recorded in the manifest, whatever the target (never filled in place)."""
    loader.objects[path] = entry.value


# ==== registration ===========================================================================
# By exact type only: a subclass (an IntEnum, a str enum) is pickled, as the object it is.
HANDLER = Handler(
    name="primitive",
    take=take,
    restore=restore,
    value_types=(bool, int, float, type(None), str, bytes),
    entry_types=(PrimitiveEntry,),
)
