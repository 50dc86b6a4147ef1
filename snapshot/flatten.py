"""Nested containers <-> logical paths: ``{"a": {"b": t}}`` at ``"0/m"`` is ``"0/m/a/b": t``."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from manifest import DictEntry, Entry, ListEntry, TupleEntry
from snapshot.errors import CorruptSnapshotError, UnsupportedValueError

_KEY_TYPES = (str, int, bool, type(None))


def escape_key(key: object) -> str:
    """A key as one path component: ``/`` and ``%`` are percent-escaped, so paths split cleanly."""
    s = key if type(key) is str else str(key)
    if "%" in s or "/" in s:
        return s.replace("%", "%25").replace("/", "%2F")
    return s  # most keys: no copies (this runs a few times per tensor on take and restore)


def join(parent: str, key: object) -> str:
    """The path of child ``key`` under ``parent``."""
    return f"{parent}/{escape_key(key)}" if parent else escape_key(key)


def _dict_keys_ok(d: Mapping[Any, Any]) -> bool:
    """Whether a dict's keys can be recorded in the manifest and give distinct child paths."""
    names = set()
    for k in d:
        if type(k) not in _KEY_TYPES:
            return False
        if type(k) is str and not _encodable(k):
            return False
        names.add(escape_key(k))
    return len(names) == len(d)


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates
        return False
    return True


def flatten(
    obj: Any, path: str
) -> Iterator[tuple[str, DictEntry | ListEntry | TupleEntry | None, Any]]:
    """Yields ``(path, container entry, value)`` for ``obj`` and everything below it, parents
    before children; the entry is None for a leaf (a value flatten does not descend into:
    tensor, primitive or opaque object).

    dict, OrderedDict, list and tuple (exact types) are containers. A dict whose keys are not all
    str/int/bool/None, or whose keys collide once made into path components (1 and "1"), is a
    leaf: stored whole as an object rather than split.

    Raises:
        UnsupportedValueError: ``obj`` contains itself.
    """
    stack: list[tuple[str, Any, bool]] = [(path, obj, False)]
    on_path: set[int] = set()
    while stack:
        p, value, leaving = stack.pop()
        if leaving:
            on_path.discard(id(value))
            continue
        kind = type(value)
        if kind in (dict, OrderedDict) and _dict_keys_ok(value):
            node: DictEntry | ListEntry | TupleEntry = DictEntry(
                keys=tuple(value), ordered=kind is OrderedDict
            )
            children = [(join(p, k), v) for k, v in value.items()]
        elif kind is list:
            node = ListEntry(length=len(value))
            children = [(join(p, i), v) for i, v in enumerate(value)]
        elif kind is tuple:
            node = TupleEntry(length=len(value))
            children = [(join(p, i), v) for i, v in enumerate(value)]
        else:
            yield p, None, value
            continue
        if id(value) in on_path:
            raise UnsupportedValueError(f"{p}: the structure contains itself")
        on_path.add(id(value))
        yield p, node, value
        stack.append((p, value, True))
        stack.extend((cp, cv, False) for cp, cv in reversed(children))


def inflate(entries: Mapping[str, Entry], path: str, leaf: Callable[[str, Entry], Any]) -> Any:
    """Rebuilds the value at ``path`` from manifest entries; ``leaf`` supplies non-containers.

    Raises:
        KeyError: a container's child path is missing from ``entries`` (the caller words it).
    """
    entry = entries[path]
    if isinstance(entry, DictEntry):
        items = [(k, inflate(entries, join(path, k), leaf)) for k in entry.keys]
        return OrderedDict(items) if entry.ordered else dict(items)
    if isinstance(entry, ListEntry):
        return [inflate(entries, join(path, i), leaf) for i in _indices(entries, path, entry)]
    if isinstance(entry, TupleEntry):
        return tuple(inflate(entries, join(path, i), leaf) for i in _indices(entries, path, entry))
    return leaf(path, entry)


def _indices(entries: Mapping[str, Entry], path: str, entry: ListEntry | TupleEntry) -> range:
    """The item indices of a list or tuple entry, once its length is known to be possible."""
    if entry.length > len(entries):  # a damaged length: never build or walk that many paths
        raise CorruptSnapshotError(
            f"{path}: a {entry.type} of {entry.length:,} items, but the manifest holds only "
            f"{len(entries):,} entries"
        )
    return range(entry.length)


def subtree(entries: Mapping[str, Entry], path: str) -> Iterator[str]:
    """Paths of ``path`` and every entry below it, following container entries, in preorder."""
    stack = [path]
    while stack:
        p = stack.pop()
        yield p
        entry = entries.get(p)
        if isinstance(entry, DictEntry):
            stack.extend(join(p, k) for k in reversed(entry.keys))
        elif isinstance(entry, (ListEntry, TupleEntry)):
            stack.extend(join(p, i) for i in reversed(_indices(entries, p, entry)))
