"""The ``app_state`` of a take or a restore: the public API's arguments checked before anything
is read or written, the mapping ordered and each value's ``state_dict()`` called, and nested
containers <-> logical paths (``{"a": {"b": t}}`` at ``"0/m"`` is ``"0/m/a/b": t``).

A bad argument is an ``InvalidArgumentError`` (a ``SnapshotError`` and a ``ValueError``) naming
the call and the argument, raised before any storage is opened: never a bare ``TypeError`` from
deep inside the engine, and never a write somewhere the caller did not mean (an empty path is
the working directory to the local plugin).
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from operator import is_not
from typing import Any

import torch.distributed

from manifest import (
    MAX_INT_DIGITS,
    MAX_NESTING,
    DictEntry,
    Entry,
    ListEntry,
    TupleEntry,
    int_fits,
)
from snapshot.errors import (
    CorruptSnapshotError,
    InvalidArgumentError,
    NotStatefulError,
    StatefulError,
    UnsupportedValueError,
    a_or_an,
)
from snapshot.stateful import RNGState, Stateful


def _kind(value: object) -> str:
    """The type of a refused value, with its repr when that is short (and does not raise)."""
    try:
        text = repr(value)
    except Exception:
        text = ""
    return f"{type(value).__name__} {text}" if text and len(text) <= 80 else type(value).__name__


def _refused(call: str, where: str, what: str, value: object) -> InvalidArgumentError:
    """The error of ``call`` on snapshot ``where`` refusing ``value``: ``what`` it must be."""
    return InvalidArgumentError(f"{call} of {where}: {what}, got {_kind(value)}")


def snapshot_path(value: object, call: str, name: str = "path") -> str:
    """``value`` as the str of a snapshot's location: a str, or an ``os.PathLike`` giving one.

    Refused: other types (bytes included: the plugins address blobs by str), a path that is
    empty or only whitespace (to the local plugin, the working directory; no one names a
    snapshot directory so), a URL whose location after ``://`` is such, and a NUL character
    (no store takes it; the local one would fail only when listing).
    """
    path = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(path, str):
        raise InvalidArgumentError(
            f"{call}: {name} must be a str or os.PathLike naming the snapshot's location, got "
            f"{_kind(value)}"
        )
    if "\0" in path:
        raise InvalidArgumentError(f"{call}: {name} {path!r} contains a NUL character")
    _, sep, location = path.partition("://")
    if not (location if sep else path).strip():
        raise InvalidArgumentError(
            f"{call}: {name} {path!r} names no location (empty or whitespace only); give the "
            "snapshot's directory or URL"
        )
    return path


def same_location(a: str, b: str) -> bool:
    """Whether two spellings of a snapshot's path name one location."""
    if a == b:
        return True
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.normpath(a) == os.path.normpath(b)


def glob_list(value: object, call: str, where: str) -> list[str]:
    """The ``replicated`` globs as a list: None is none; otherwise any iterable of str but a
    str itself (whose characters would each become a glob)."""
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise _refused(call, where, "replicated must be a list of glob strings", value)
    globs = list(value)
    for glob in globs:
        if not isinstance(glob, str):
            raise InvalidArgumentError(
                f"{call} of {where}: replicated must be a list of glob strings, and "
                f"{_kind(glob)} is not one"
            )
    return globs


def options(value: object, call: str, where: str) -> dict[str, Any] | None:
    """``storage_options``: None or a mapping (given to the plugin as a dict)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _refused(call, where, "storage_options must be a dict of plugin options", value)
    return value if isinstance(value, dict) else dict(value)


def process_group(value: object, call: str, where: str) -> None:
    """``pg``: None (the default group, or this process alone) or a process group."""
    if value is None:
        return
    group = getattr(torch.distributed, "ProcessGroup", None)
    if group is None or not isinstance(value, group):
        raise _refused(call, where, "pg must be a torch.distributed.ProcessGroup or None", value)


def typed(value: object, kind: type, call: str, name: str, where: str) -> None:
    """An argument that must be a ``kind``: a yes/no one a bool only (a string such as ``"no"``
    would read as yes); a manifest path or app_state key a str (its content is the manifest's
    to find)."""
    if not isinstance(value, kind):
        raise _refused(call, where, f"{name} must be {a_or_an(kind.__name__)}", value)


def function(value: object, call: str, name: str, where: str) -> Callable[..., Any] | None:
    """An optional callable argument."""
    if value is not None and not callable(value):
        raise _refused(call, where, f"{name} must be callable or None", value)
    return value


def byte_count(value: object, call: str, name: str, where: str) -> int | None:
    """An optional positive number of bytes (a bool is not one)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _refused(call, where, f"{name} must be a positive int or None", value)
    return value


def state_mapping(value: object, call: str, name: str, where: str) -> Mapping[str, Any]:
    """A state dict given to the strategy API: a mapping."""
    if not isinstance(value, Mapping):
        raise _refused(call, where, f"{name} must be a dict (a state dict)", value)
    return value


# How deep ``user_metadata`` may nest: it is written into the manifest, whose reader bounds
# nesting (``manifest.MAX_DEPTH``) well above this.
_USER_DEPTH = 8


def user_metadata(value: object, call: str, where: str) -> dict[str, Any] | None:
    """The caller's metadata of a take, as plain data the manifest can hold: a dict with str
    keys of None, bool, int, finite float, str, and lists and dicts of them (copied)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise _refused(call, where, "user_metadata must be a dict", value)

    def plain(v: object, at: str, depth: int) -> Any:
        def refused(why: str) -> InvalidArgumentError:
            return InvalidArgumentError(f"{call} of {where}: user_metadata{at} {why}")

        if depth > _USER_DEPTH:
            raise refused(f"nests deeper than {_USER_DEPTH}")
        if isinstance(v, int) and not isinstance(v, bool) and not int_fits(v):
            raise refused(
                f"is an int of more than {MAX_INT_DIGITS} digits, which a reader's decimal "
                "conversion refuses; store it as a str"
            )
        if isinstance(v, float) and not math.isfinite(v):
            raise refused(f"is {v}: only finite numbers")
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, Mapping):
            for k in v:
                if not isinstance(k, str):
                    raise refused(f"has key {_kind(k)}: keys are str")
            return {k: plain(item, f"{at}[{k!r}]", depth + 1) for k, item in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(item, f"{at}[{i}]", depth + 1) for i, item in enumerate(v)]
        raise refused(
            f"is {_kind(v)}: only None, bool, int, float, str, and lists and dicts of them"
        )

    return plain(value, "", 0)


def metrics(value: Mapping[str, float] | None) -> dict[str, float]:
    """A checkpoint manager's ``metrics`` checked: str names, finite numbers (a one-element
    tensor taken as its number)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(
            f"metrics must be a dict of name -> number, got {type(value).__name__}"
        )
    out = {}
    for name, number in value.items():
        if isinstance(number, torch.Tensor) and number.numel() == 1:
            number = number.item()
        if (
            not isinstance(name, str)
            or isinstance(number, bool)
            or not isinstance(number, (int, float))
            or not math.isfinite(number)
        ):
            raise InvalidArgumentError(
                f"metrics must map str names to finite numbers, got {name!r}: {number!r}"
            )
        out[name] = number
    return out


def ordered_keys(app_state: Mapping[str, Any]) -> list[str]:
    """app_state keys with RNGState values last, so capturing or restoring the other objects
    cannot move the generators after their state is taken or set."""
    keys = list(app_state)
    return [k for k in keys if not isinstance(app_state[k], RNGState)] + [
        k for k in keys if isinstance(app_state[k], RNGState)
    ]


def check_app_state(app_state: Any, path: str) -> None:
    """Refuses an app_state that is not a mapping of str -> Stateful; ``path`` is the snapshot's."""
    if not isinstance(app_state, Mapping):
        raise NotStatefulError(
            f"snapshot {path}: app_state must be a dict of name -> Stateful, "
            f"got {type(app_state).__name__}"
        )
    for key, value in app_state.items():
        if type(key) is not str:
            raise NotStatefulError(f"snapshot {path}: app_state key {key!r} is not a str")
        if not isinstance(value, Stateful):
            raise NotStatefulError(
                f"snapshot {path}: app_state[{key!r}] is {a_or_an(type(value).__name__)}, "
                "which has no state_dict() and load_state_dict(); pass an object that has both "
                "(an nn.Module, an optimizer, a class of your own), or wrap plain values in a "
                f"snapshot.StateDict: app_state[{key!r}] = StateDict(value=...)"
            )


def state_dict_of(key: str, value: Stateful, path: str) -> Any:
    """``value.state_dict()`` of ``app_state[key]``; what it raises becomes a
    ``StatefulError`` that names the key."""
    try:
        return value.state_dict()
    except Exception as e:
        raise StatefulError(
            f"snapshot {path}: app_state[{key!r}].state_dict() raised {type(e).__name__}: {e}"
        ) from e


# ---------------------------------------------------------------------------------------------
# Nested containers <-> logical paths.


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
    manifest (str, int, bool or None; an int the manifest can write in decimal) or would not
    give distinct child paths."""
    keys = list(d)
    # Most dicts: str keys that are their own path components, found in a few passes in C.
    if set(map(type, keys)) <= {str}:
        text = "".join(keys)
        if "%" not in text and "/" not in text and _encodable(text):
            return keys
    names = []
    for k in keys:
        kind = type(k)
        if (
            kind not in _KEY_TYPES
            or (kind is str and not _encodable(k))
            or (kind is int and not int_fits(k))
        ):
            return None
        names.append(escape_key(k))
    return names if len(set(names)) == len(names) else None


def _encodable(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates
        return False
    return True


CONTAINER_TYPES = frozenset((dict, OrderedDict, list, tuple))
"""The types ``flatten`` descends into (exact types): every other value is a leaf."""
_Node = DictEntry | ListEntry | TupleEntry


def _open(value: Any) -> tuple[_Node, Sequence[str], Sequence[Any]] | None:
    """Container ``value``'s entry, its children's path components and its children; None for
    a dict stored whole (``dict_names`` refuses its keys)."""
    kind = type(value)
    if kind is dict or kind is OrderedDict:
        names = dict_names(value)
        if names is None:
            return None
        node = DictEntry(keys=tuple(value), ordered=kind is OrderedDict)
        return node, names, list(value.values())
    n = len(value)
    return (ListEntry if kind is list else TupleEntry)(length=n), list(map(str, range(n))), value


def int_refusal(where: str) -> str:
    """The message refusing an int too long for the manifest, at ``where``."""
    return (
        f"{where}: an int of more than {MAX_INT_DIGITS} decimal digits, which a restore in a "
        "process with Python's default limit on int-to-text conversion refuses to read (and "
        "the pickle reader refuses too); store it as a str or bytes (str(n), or "
        "n.to_bytes(...)), or as a tensor"
    )


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
    ``manifest.MAX_INT_DIGITS`` digits. A dict ``flatten`` stores whole (its keys are not ones
    the manifest lists) is pickled with everything below it: a container too deep, or met twice
    on one path, below such a dict skips that dict's subtree instead.

    Raises:
        UnsupportedValueError: naming the path of the first value at fault.
    """
    chain: list[tuple[Any, Any]] = []  # the open containers from ``obj`` down, with their keys
    on_path: set[int] = set()

    def where(frames: list[tuple[Any, Any]]) -> str:
        return path + "".join("/" + _shown(key) for _, key in frames[1:])

    def walk(container: Any, key: Any) -> int | None:
        """Walks ``container``; the level to return to (of a dict stored whole, above a
        container too deep or looped), or None."""
        chain.append((container, key))
        on_path.add(id(container))
        try:
            is_dict = type(container) in (dict, OrderedDict)
            for k, item in container.items() if is_dict else enumerate(container):
                if type(item) is int and not int_fits(item):
                    raise UnsupportedValueError(int_refusal(f"{where(chain)}/{_shown(k)}"))
            if is_dict and any(type(k) is int and not int_fits(k) for k in container):
                raise UnsupportedValueError(int_refusal(f"{where(chain)}: a dict key"))
            for k, child in container.items() if is_dict else enumerate(container):
                if type(child) not in CONTAINER_TYPES:
                    continue
                looped = id(child) in on_path
                if not looped and len(chain) < MAX_NESTING:
                    level = walk(child, k)
                    if level is not None and level < len(chain):
                        return level
                    continue
                frames = [*chain, (child, k)]
                level = next((i for i, (c, _) in enumerate(frames) if _stored_whole(c)), None)
                if level is None:
                    if looped:
                        problem = "the structure contains itself"
                        raise UnsupportedValueError(f"{where(frames)}: {problem}")
                    raise UnsupportedValueError(
                        f"{where(frames)}: containers (dict, list, tuple) nested deeper than "
                        f"{MAX_NESTING} levels below the app_state key, more than a restore "
                        "rebuilds; flatten the structure, or store it as one object (a dict "
                        "with a non-string key, say, is pickled whole)"
                    )
                if level < len(chain):  # stored whole: nothing below it is an entry
                    return level
            return None
        finally:
            chain.pop()
            on_path.discard(id(container))

    if type(obj) in CONTAINER_TYPES:
        walk(obj, None)


def _stored_whole(value: Any) -> bool:
    """Whether ``flatten`` stores container ``value`` whole (a dict ``dict_names`` refuses)."""
    return type(value) in (dict, OrderedDict) and dict_names(value) is None


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
    opened = _open(obj) if type(obj) in CONTAINER_TYPES else None
    if opened is None:
        yield path, None, obj
        return
    # Each frame: the path prefix of an open container's children, the (name, child, type)
    # triples left to walk, and the container. Only containers holding containers get one:
    # the children of the others are yielded in one pass in C.
    stack: list[tuple[str, Iterator[tuple[str, Any, type]], Any]] = []
    on_path: set[int] = set()
    p, value = path, obj
    while True:
        if opened is not None:  # enter ``value``, at ``p``
            node, names, values = opened
            yield p, node, value
            kinds = list(map(type, values))
            prefix = child_prefix(p)
            if CONTAINER_TYPES.isdisjoint(kinds):
                yield from zip(map(prefix.__add__, names), repeat(None), values)
            else:
                stack.append((prefix, zip(names, values, kinds, strict=True), value))
                on_path.add(id(value))
            opened = None
        if not stack:
            return
        prefix, children, parent = stack[-1]
        for name, value, kind in children:
            p = prefix + name
            if kind not in CONTAINER_TYPES or (opened := _open(value)) is None:
                yield p, None, value
                continue
            if id(value) in on_path:
                raise UnsupportedValueError(f"{p}: the structure contains itself")
            break
        else:
            stack.pop()
            on_path.discard(id(parent))


def inflate(
    entries: Mapping[str, Entry],
    path: str,
    leaf: Callable[[str, Entry], Any],
    known: Mapping[str, Any],
) -> Any:
    """Rebuilds the value at ``path`` from manifest entries; ``leaf`` supplies non-containers,
    and ``known`` the leaves at hand already (by path, none of them None: the tensors a
    restore read into).

    Raises:
        KeyError: a container's child path is missing from ``entries`` (the caller words it).
    """
    entry = entries[path]
    if not isinstance(entry, _CONTAINER_ENTRIES):
        return leaf(path, entry)
    paths = _children(entries, path, entry)
    values = list(map(known.get, paths))
    if not all(map(is_not, values, repeat(None))):
        for i, p in enumerate(paths):
            if values[i] is None:
                values[i] = inflate(entries, p, leaf, known)
    if isinstance(entry, DictEntry):
        items = zip(entry.keys, values, strict=True)
        return OrderedDict(items) if entry.ordered else dict(items)
    return values if isinstance(entry, ListEntry) else tuple(values)


_CONTAINER_ENTRIES = (DictEntry, ListEntry, TupleEntry)


def subtree(entries: Mapping[str, Entry], path: str) -> list[str]:
    """Paths of ``path`` and every entry below it, following container entries, in preorder
    (a stack, not recursion: however deep a manifest nests them)."""
    out: list[str] = []
    stack = [path]
    while stack:
        p = stack.pop()
        out.append(p)
        entry = entries.get(p)
        if isinstance(entry, _CONTAINER_ENTRIES):
            children = _children(entries, p, entry)
            kinds = set(map(type, map(entries.get, children)))
            if kinds.isdisjoint(_CONTAINER_ENTRIES):
                out += children  # leaves only (most containers): in one pass
            else:
                stack.extend(reversed(children))
    return out


def _children(
    entries: Mapping[str, Entry], path: str, entry: DictEntry | ListEntry | TupleEntry
) -> list[str]:
    """The paths of a container entry's children, in order."""
    prefix = child_prefix(path)
    if isinstance(entry, DictEntry):
        keys = entry.keys
        if set(map(type, keys)) <= {str}:
            text = "".join(keys)  # type: ignore[arg-type]
            if "%" not in text and "/" not in text:
                return list(map(prefix.__add__, keys))  # type: ignore[arg-type]
        return [prefix + escape_key(k) for k in keys]
    if entry.length > len(entries):  # a damaged length: never build or walk that many paths
        raise CorruptSnapshotError(
            f"{path}: {a_or_an(entry.tag)} of {entry.length:,} items, but the manifest holds only "
            f"{len(entries):,} entries"
        )
    return [prefix + str(i) for i in range(entry.length)]
