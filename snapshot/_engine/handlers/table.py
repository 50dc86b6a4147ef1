"""The handler table (see the package's docstring): ``Handler``, ``register``, ``for_value``,
``for_entry``. Kind modules import this module only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from manifest import Entry


@dataclass(frozen=True)
class Handler:
    """One kind of value.

    ``value_types`` are the exact types looked up first (a dict hit); ``accepts`` decides for
    a value of any other type (asked in registration order) and, when set together with
    ``value_types``, also confirms a hit by type (a strided tensor, not a nested one).
    ``take(planner, path, logical, value, replicated)`` returns the entry (or draft) recorded
    at ``path`` and hands the value's payloads to the planner; ``restore(loader, path, entry,
    target)`` plans the reads that rebuild ``entry``, into ``target`` where it can.
    """

    name: str
    take: Callable[..., Any] | None = None
    restore: Callable[..., None] | None = None
    value_types: tuple[type, ...] = ()
    accepts: Callable[[Any], bool] | None = None
    entry_types: tuple[type[Entry], ...] = ()


_handlers: list[Handler] = []
_by_value_type: dict[type, Handler] = {}
_by_entry_type: dict[type, Handler] = {}


def register(handler: Handler, *, before: str | None = None) -> Callable[[], None]:
    """Adds ``handler`` to the table (before the handler named ``before``, if given: its
    ``accepts`` is then asked first). Its ``value_types`` and ``entry_types`` take over those
    types from any handler registered earlier. Returns a function that undoes the
    registration (the types go back to the handlers that had them)."""
    at = len(_handlers)
    if before is not None:
        at = next(i for i, h in enumerate(_handlers) if h.name == before)
    _handlers.insert(at, handler)
    values = {t: _by_value_type.get(t) for t in handler.value_types}
    entries = {t: _by_entry_type.get(t) for t in handler.entry_types}
    for t in handler.value_types:
        _by_value_type[t] = handler
    for t in handler.entry_types:
        _by_entry_type[t] = handler

    def undo() -> None:
        _handlers.remove(handler)
        for table, before_ in ((_by_value_type, values), (_by_entry_type, entries)):
            for t, earlier in before_.items():
                if earlier is None:
                    table.pop(t, None)
                else:
                    table[t] = earlier

    return undo


def handler_of_type(kind: type) -> Handler | None:
    """The handler registered for values of exactly this type, if any (one dict lookup: the
    hot paths ask it once per tensor)."""
    return _by_value_type.get(kind)


def types_of(name: str) -> tuple[type, ...]:
    """The value types registered now for the handler named ``name``."""
    return tuple(t for t, h in _by_value_type.items() if h.name == name)


def for_value(value: Any) -> Handler:
    """The handler of a leaf value: by its exact type, else the first whose ``accepts`` does."""
    handler = _by_value_type.get(type(value))
    if handler is not None and (handler.accepts is None or handler.accepts(value)):
        return handler
    for handler in _handlers:
        if handler.accepts is not None and handler.accepts(value):
            return handler
    raise LookupError(f"no handler for a {type(value).__name__}")  # the object kind takes all


def for_entry(entry: Entry) -> Handler | None:
    """The handler that restores ``entry`` (None for a container: ``flatten`` rebuilds those)."""
    return _by_entry_type.get(type(entry))
