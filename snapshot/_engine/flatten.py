"""Nested containers <-> logical paths: ``{"a": {"b": t}}`` at ``"0/m"`` is ``"0/m/a/b": t``."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import compress, count, repeat
from operator import is_
from typing import Any

from manifest import (
    MAX_INT_DIGITS,
    MAX_NESTING,
    DictEntry,
    Entry,
    ListEntry,
    TupleEntry,
    int_fits,
)
from snapshot.errors import CorruptSnapshotError, UnsupportedValueError

_KEY_TYPES = (str, int, bool, type(None))


def escape_key(key: object) -> str:
    """A key as one path component: ``/`` and ``%`` are percent-escaped, so paths split cleanly."""
    s = key if type(key) is str else str(key)
    if "%" in s or "/" in s:
        return s.replace("%", "%25").replace("/", "%2F")
    return s  # most keys: no copies (this runs a few times per tensor on take and restore)


def child_prefix(parent: str) -> str:
    """What the paths of ``parent``'s children start with (the root, ``""``, has no ``/``)."""
    return f"{parent}/" if parent else ""


def join(parent: str, key: object) -> str:
    """The path of child ``key`` under ``parent``."""
    return child_prefix(parent) + escape_key(key)


def dict_names(d: Mapping[Any, Any]) -> list[str] | None:
    """The path components of a dict's keys, or None when the keys cannot be recorded in the
    manifest or would not give distinct child paths."""
    keys = list(d)
    # Most dicts (a state dict of 20,000 tensors): distinct keys are distinct names.
    text = _verbatim_text(keys)
    if text is not None and _encodable(text):
        return keys
    names = []
    for k in d:
        kind = type(k)
        if (
            kind not in _KEY_TYPES
            or (kind is str and not _encodable(k))
            # The manifest lists the keys, in decimal: an int too long for every reader's
            # conversion is never listed (``check_nesting`` refuses it before a take plans).
            or (kind is int and not int_fits(k))
        ):
            return None
        names.append(escape_key(k))
    return names if len(set(names)) == len(names) else None


def _verbatim_text(keys: Sequence[Any]) -> str | None:
    """The keys' text, joined, when each is a string that is its own path component (no
    escapes needed: checked in a few passes in C); else None."""
    if not set(map(type, keys)) <= {str}:
        return None
    text = "".join(keys)
    return None if "%" in text or "/" in text else text


def _encodable(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates
        return False
    return True


_CONTAINERS = (dict, OrderedDict, list, tuple)
CONTAINER_TYPES = frozenset(_CONTAINERS)
"""The types ``flatten`` descends into (exact types): every other value is a leaf."""
_Node = DictEntry | ListEntry | TupleEntry


def _expand(value: Any) -> tuple[_Node, Iterator[tuple[str, Any]]] | None:
    """The entry of a container and its ``(path component, child)`` pairs; None for a leaf."""
    kind = type(value)
    if kind is list or kind is tuple:
        node: _Node = (
            ListEntry(length=len(value)) if kind is list else TupleEntry(length=len(value))
        )
        return node, zip(map(str, range(len(value))), value, strict=True)
    if kind is dict or kind is OrderedDict:
        names = dict_names(value)
        if names is None:
            return None
        node = DictEntry(keys=tuple(value), ordered=kind is OrderedDict)
        return node, zip(names, value.values(), strict=True)
    return None


def int_refusal(where: str) -> str:
    """The message refusing an int too long for the manifest, at ``where``."""
    return (
        f"{where}: an int of more than {MAX_INT_DIGITS} decimal digits, which a restore in a "
        "process with Python's default limit on int-to-text conversion refuses to read (and "
        "the pickle reader refuses too); store it as a str or bytes (str(n), or "
        "n.to_bytes(...)), or as a tensor"
    )


class _LongInt(Exception):
    """An int ``_containers_in`` found too long for the manifest; its argument says where, below
    the container."""


def _containers_in(value: Any) -> Iterator[tuple[Any, Any]] | None:
    """The ``(key, child)`` pairs of container ``value`` whose child is a container too (by
    exact type), picked in C-level passes; None when there is none. Raises ``_LongInt`` for an
    int value or dict key the manifest cannot hold (``manifest.int_fits``)."""
    kind = type(value)
    is_dict = kind is dict or kind is OrderedDict
    kinds = list(map(type, value.values() if is_dict else value))
    if int in kinds:
        pairs = value.items() if is_dict else enumerate(value)
        for key, item in compress(pairs, map(is_, kinds, repeat(int))):
            if not int_fits(item):
                raise _LongInt(f"/{_shown(key)}")
    if is_dict and int in map(type, value):
        for k in value:
            if type(k) is int and not int_fits(k):
                raise _LongInt(": a dict key")
    if CONTAINER_TYPES.isdisjoint(kinds):
        return None
    selected = map(CONTAINER_TYPES.__contains__, kinds)
    return compress(value.items() if is_dict else enumerate(value), selected)


def _shown(key: Any) -> str:
    """A key as a path component, for a message (an int too long to print is described)."""
    if type(key) is int and not int_fits(key):
        return f"<an int of {key.bit_length()} bits>"
    return escape_key(key)


def check_nesting(obj: Any, path: str) -> None:
    """Refuses, before a take writes anything, a state that the manifest cannot hold as a
    default restore reads it: containers ``flatten`` would record nested deeper than
    ``manifest.MAX_NESTING`` levels (``obj`` being level 1), which a restore does not promise
    to rebuild; a container that holds itself; an int value or dict key of more than
    ``manifest.MAX_INT_DIGITS`` digits.

    Only containers are walked (their values' types listed in C-level passes), and only those
    holding containers are kept open, so a state dict of many leaves costs a pass or two over
    its values. A dict ``flatten`` stores whole (its keys are not ones the manifest lists) is
    pickled with everything below it: once the walk finds a container too deep, or met twice
    on one path, below such a dict, that dict's subtree is skipped instead.

    Raises:
        UnsupportedValueError: naming the path of the first value at fault.
    """
    if type(obj) not in CONTAINER_TYPES:
        return
    # Each frame: an open container, its key in its parent, and its container children left.
    stack: list[tuple[Any, Any, Iterator[tuple[Any, Any]]]] = []
    at: tuple[Any, ...] = ()  # the key of the container being scanned, below the stack's top
    try:
        inner = _containers_in(obj)
        if inner is None:
            return
        stack.append((obj, None, inner))
        on_path = {id(obj)}
        while stack:
            container, _, children = stack[-1]
            for key, child in children:
                looped = id(child) in on_path
                if not looped and len(stack) < MAX_NESTING:
                    at = (key,)
                    inner = _containers_in(child)
                    at = ()
                    if inner is None:
                        continue  # nothing below it to walk
                    on_path.add(id(child))
                    stack.append((child, key, inner))
                    break
                frames = [*stack, (child, key, iter(()))]
                whole = next(
                    (i for i, f in enumerate(frames) if _expand_names(f[0]) is None), None
                )
                if whole is None:
                    where = path + "".join("/" + _shown(f[1]) for f in frames[1:])
                    if looped:
                        raise UnsupportedValueError(f"{where}: the structure contains itself")
                    raise UnsupportedValueError(
                        f"{where}: containers (dict, list, tuple) nested deeper than "
                        f"{MAX_NESTING} levels below the app_state key, more than a restore "
                        "rebuilds; flatten the structure, or store it as one object (a dict "
                        "with a non-string key, say, is pickled whole)"
                    )
                # Stored whole: nothing below frame ``whole`` is an entry of its own.
                for frame in stack[whole:]:
                    on_path.discard(id(frame[0]))
                del stack[whole:]
                break
            else:
                stack.pop()
                on_path.discard(id(container))
    except _LongInt as e:
        keys = [f[1] for f in stack[1:]] + list(at)
        where = path + "".join("/" + _shown(k) for k in keys) + e.args[0]
        raise UnsupportedValueError(int_refusal(where)) from None


def _expand_names(value: Any) -> list[str] | tuple[()] | None:
    """None when ``flatten`` stores container ``value`` whole (a dict ``dict_names`` refuses)."""
    if type(value) is dict or type(value) is OrderedDict:
        return dict_names(value)
    return ()


def flatten(obj: Any, path: str) -> Iterator[tuple[str, _Node | None, Any]]:
    """Yields ``(path, container entry, value)`` for ``obj`` and everything below it, parents
    before children; the entry is None for a leaf (a value flatten does not descend into:
    tensor, primitive or opaque object).

    dict, OrderedDict, list and tuple (exact types) are containers. A dict whose keys are not all
    str/int/bool/None, or whose keys collide once made into path components (1 and "1"), is a
    leaf: stored whole as an object rather than split.

    Raises:
        UnsupportedValueError: ``obj`` contains itself.
    """
    expanded = _expand(obj)
    if expanded is None:
        yield path, None, obj
        return
    node, children = expanded
    yield path, node, obj
    # One iterator per open container: a leaf is yielded the moment it is met (a state dict
    # is mostly leaves), a container is opened and walked before its next sibling.
    stack = [(child_prefix(path), children, obj)]
    on_path = {id(obj)}
    while stack:
        prefix, children, parent = stack[-1]
        for name, value in children:
            p = prefix + name
            if type(value) not in _CONTAINERS:
                yield p, None, value
                continue
            expanded = _expand(value)
            if expanded is None:
                yield p, None, value
                continue
            if id(value) in on_path:
                raise UnsupportedValueError(f"{p}: the structure contains itself")
            on_path.add(id(value))
            node, inner = expanded
            yield p, node, value
            stack.append((child_prefix(p), inner, value))
            break
        else:
            stack.pop()
            on_path.discard(id(parent))


def inflate(
    entries: Mapping[str, Entry],
    path: str,
    leaf: Callable[[str, Entry], Any],
    known: Mapping[str, Any] | None = None,
) -> Any:
    """Rebuilds the value at ``path`` from manifest entries; ``leaf`` supplies non-containers,
    and ``known``, where given, the leaves at hand already (by path, none of them None: the
    tensors a restore read into): those are looked up without a call of ``leaf`` each.

    Raises:
        KeyError: a container's child path is missing from ``entries`` (the caller words it).
    """
    entry = entries[path]
    kind = type(entry)
    if kind is not DictEntry and kind is not ListEntry and kind is not TupleEntry:
        return leaf(path, entry)
    paths = _children(entries, path, entry)
    found = list(map(entries.get, paths))
    if any(map(is_, found, repeat(None))):
        raise KeyError(paths[[e is None for e in found].index(True)])
    if any(map(_CONTAINER_KINDS.__contains__, map(type, found))):
        values = [inflate(entries, p, leaf, known) for p in paths]
    elif known is None:
        # No container among the children (a state dict of 20,000 tensors): one C-level pass.
        values = list(map(leaf, paths, found))
    else:
        # The same, without a Python call per leaf where it is known: a C-level pass of
        # lookups, then ``leaf`` for the others (objects, say).
        values = list(map(known.get, paths))
        for i in compress(count(), map(is_, values, repeat(None))):
            values[i] = leaf(paths[i], found[i])
    if kind is DictEntry:
        items = zip(entry.keys, values, strict=True)
        return OrderedDict(items) if entry.ordered else dict(items)
    return values if kind is ListEntry else tuple(values)


def _indices(entries: Mapping[str, Entry], path: str, entry: ListEntry | TupleEntry) -> range:
    """The item indices of a list or tuple entry, once its length is known to be possible."""
    if entry.length > len(entries):  # a damaged length: never build or walk that many paths
        raise CorruptSnapshotError(
            f"{path}: a {entry.type} of {entry.length:,} items, but the manifest holds only "
            f"{len(entries):,} entries"
        )
    return range(entry.length)


def subtree(entries: Mapping[str, Entry], path: str) -> list[str]:
    """Paths of ``path`` and every entry below it, following container entries, in preorder.

    A state dict of 20,000 tensors is one container of 20,000 leaves: each container's child
    paths are made, and the containers among them found, in C-level passes; a stack of levels
    (not recursion) follows the nested ones, however deep a manifest nests them."""
    get = entries.get
    out: list[str] = []
    stack = [_level(get, [path])]
    while stack:
        frame = stack[-1]
        paths, containers, k, pos = frame
        if k == len(containers):
            out.extend(paths[pos:])
            stack.pop()
            continue
        i = containers[k]
        out.extend(paths[pos : i + 1])
        frame[2], frame[3] = k + 1, i + 1
        children = _children(entries, paths[i], get(paths[i]))
        if children:
            stack.append(_level(get, children))
    return out


_CONTAINER_KINDS = frozenset((DictEntry, ListEntry, TupleEntry))


def _level(get: Callable[[str], Entry | None], paths: list[str]) -> list[Any]:
    """A level of ``subtree``'s walk: the sibling paths, the indices of the containers among
    them, how many of those were entered, and how many paths were listed."""
    kinds = map(type, map(get, paths))
    return [paths, list(compress(count(), map(_CONTAINER_KINDS.__contains__, kinds))), 0, 0]


def _children(entries: Mapping[str, Entry], path: str, entry: Any) -> list[str]:
    """The paths of a container entry's children, in order."""
    prefix = child_prefix(path)
    if type(entry) is DictEntry:
        keys = entry.keys
        names = keys if _verbatim_text(keys) is not None else map(escape_key, keys)
        return list(map(prefix.__add__, names))
    return list(map(prefix.__add__, map(str, _indices(entries, path, entry))))
