"""Checks of the public API's arguments, made before anything is read or written; the
``app_state`` mapping checked, ordered, and each value's ``state_dict()`` called.

A bad argument is an ``InvalidArgumentError`` (a ``SnapshotError`` and a ``ValueError``) naming
the call and the argument, raised before any storage is opened: never a bare ``TypeError`` from
deep inside the engine, and never a write somewhere the caller did not mean (an empty path is
the working directory to the local plugin).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch.distributed

from manifest import MAX_INT_DIGITS, int_fits
from snapshot.errors import InvalidArgumentError, NotStatefulError, StatefulError
from snapshot.stateful import RNGState, Stateful


def _kind(value: object) -> str:
    """The type of a refused value, with its repr when that is short (and does not raise)."""
    try:
        text = repr(value)
    except Exception:
        text = ""
    return f"{type(value).__name__} {text}" if text and len(text) <= 80 else type(value).__name__


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
        raise InvalidArgumentError(
            f"{call} of {where}: replicated must be a list of glob strings, got {_kind(value)}"
        )
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
        raise InvalidArgumentError(
            f"{call} of {where}: storage_options must be a dict of plugin options, got "
            f"{_kind(value)}"
        )
    return value if isinstance(value, dict) else dict(value)


def process_group(value: object, call: str, where: str) -> None:
    """``pg``: None (the default group, or this process alone) or a process group."""
    if value is None:
        return
    group = getattr(torch.distributed, "ProcessGroup", None)
    if group is None or not isinstance(value, group):
        raise InvalidArgumentError(
            f"{call} of {where}: pg must be a torch.distributed.ProcessGroup or None, got "
            f"{_kind(value)}"
        )


def flag(value: object, call: str, name: str, where: str) -> bool:
    """A yes/no argument: a bool only (a string such as ``"no"`` would read as yes)."""
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"{call} of {where}: {name} must be a bool, got {_kind(value)}")
    return value


def function(value: object, call: str, name: str, where: str) -> Callable[..., Any] | None:
    """An optional callable argument."""
    if value is not None and not callable(value):
        raise InvalidArgumentError(
            f"{call} of {where}: {name} must be callable or None, got {_kind(value)}"
        )
    return value


def logical_path(value: object, call: str, name: str, where: str) -> str:
    """A manifest path or app_state key: a str (its content is the manifest's to find)."""
    if not isinstance(value, str):
        raise InvalidArgumentError(f"{call} of {where}: {name} must be a str, got {_kind(value)}")
    return value


def byte_count(value: object, call: str, name: str, where: str) -> int | None:
    """An optional positive number of bytes (a bool is not one)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(
            f"{call} of {where}: {name} must be a positive int or None, got {_kind(value)}"
        )
    return value


def state_mapping(value: object, call: str, name: str, where: str) -> Mapping[str, Any]:
    """A state dict given to the strategy API: a mapping."""
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(
            f"{call} of {where}: {name} must be a dict (a state dict), got {_kind(value)}"
        )
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
        raise InvalidArgumentError(
            f"{call} of {where}: user_metadata must be a dict, got {_kind(value)}"
        )

    def plain(v: object, at: str, depth: int) -> Any:
        if depth > _USER_DEPTH:
            raise InvalidArgumentError(
                f"{call} of {where}: user_metadata nests deeper than {_USER_DEPTH} at {at}"
            )
        if isinstance(v, int) and not isinstance(v, bool) and not int_fits(v):
            raise InvalidArgumentError(
                f"{call} of {where}: user_metadata{at} is an int of more than "
                f"{MAX_INT_DIGITS} digits, which a reader's decimal conversion refuses; "
                "store it as a str"
            )
        if v is None or isinstance(v, (bool, int, str)):
            return v
        if isinstance(v, float):
            if v != v or v in (float("inf"), float("-inf")):
                raise InvalidArgumentError(
                    f"{call} of {where}: user_metadata{at} is {v}: only finite numbers"
                )
            return v
        if isinstance(v, Mapping):
            out = {}
            for k, item in v.items():
                if not isinstance(k, str):
                    raise InvalidArgumentError(
                        f"{call} of {where}: user_metadata{at} has key {_kind(k)}: keys are str"
                    )
                out[k] = plain(item, f"{at}[{k!r}]", depth + 1)
            return out
        if isinstance(v, (list, tuple)):
            return [plain(item, f"{at}[{i}]", depth + 1) for i, item in enumerate(v)]
        raise InvalidArgumentError(
            f"{call} of {where}: user_metadata{at} is {_kind(v)}: only None, bool, int, "
            "float, str, and lists and dicts of them"
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
                f"snapshot {path}: app_state[{key!r}] is a {type(value).__name__}, which has no "
                "state_dict() and load_state_dict(); wrap plain values in snapshot.StateDict"
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
