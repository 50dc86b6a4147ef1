"""Helpers for sharded state dicts: splitting them by kind of leaf, renaming shard keys,
shard ids, and scoped debug logging/timing.

The ``extract_*`` functions walk dicts and lists (tuples are leaves) and return ``(matching,
rest)``, each with the input's nesting, so a part can be handled apart and put back.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sized
from contextlib import contextmanager
from typing import Any

import torch

from snapshot.sharding.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    StateDict,
    _map_leaves_inplace,
)

ShardId = tuple[str, tuple[int, ...]]
"""Identifies a shard's data across ranks: ``(key, global_offset)``."""

_Split = tuple[ShardedStateDict, StateDict]


def zip_strict(*args: Iterable[Any]) -> Iterator[tuple[Any, ...]]:
    """``zip(*args, strict=True)`` whose ``ValueError`` names every iterable's length: at the
    call when all have a length, else at the first item (the others are read into lists to be
    counted)."""
    if all(isinstance(a, Sized) for a in args):
        lengths = [len(a) for a in args]  # type: ignore[arg-type]
        if len(set(lengths)) > 1:
            raise ValueError(f"zip_strict: iterables of unequal lengths {lengths}")
        return zip(*args, strict=True)
    return _zip_lists(args)


def _zip_lists(args: tuple[Iterable[Any], ...]) -> Iterator[tuple[Any, ...]]:
    yield from zip_strict(*(a if isinstance(a, Sized) else list(a) for a in args))


def sharded_tensor_shard_id(sharded: ShardedTensor | ShardedObject) -> ShardId:
    """``(key, global_offset)``: the same on every rank holding a replica of the block (of a
    ShardedTensor) or piece (of a ShardedObject)."""
    return sharded.key, tuple(sharded.global_offset)


sharded_object_id = sharded_tensor_shard_id

_sharded_tensor_shard_id = sharded_tensor_shard_id
_sharded_object_id = sharded_object_id


def extract_matching(
    sharded_state_dict: ShardedStateDict | list[Any],
    predicate: Callable[[Any], bool],
) -> tuple[Any, Any]:
    """Splits the leaves of a nested dict/list state into ``(matching, rest)`` by
    ``predicate``, both with the input's nesting (leaves shared, containers new). A key is in
    an output that gets something below it; an empty container goes to ``rest``; a list keeps
    its order but holds only its output's elements. ``TypeError`` for a non-container."""
    if not isinstance(sharded_state_dict, (dict, list)):
        raise TypeError(
            f"extract_matching expects a dict or a list, got {type(sharded_state_dict).__name__}"
        )
    x = sharded_state_dict
    matching: Any = {} if isinstance(x, dict) else []
    rest: Any = {} if isinstance(x, dict) else []
    items: Iterable[tuple[Any, Any]] = x.items() if isinstance(x, dict) else enumerate(x)
    for k, v in items:
        if not isinstance(v, (dict, list)):
            parts = [(matching if predicate(v) else rest, v)]
        elif v:
            sub_matching, sub_rest = extract_matching(v, predicate)
            parts = [(out, sub) for out, sub in ((matching, sub_matching), (rest, sub_rest)) if sub]
        else:
            parts = [(rest, type(v)())]
        for out, value in parts:
            if isinstance(out, dict):
                out[k] = value
            else:
                out.append(value)
    return matching, rest


def _of(*kinds: type) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, kinds)


def extract_sharded_tensors(sharded_state_dict: ShardedStateDict) -> _Split:
    """``(ShardedTensors, everything else)``."""
    return extract_matching(sharded_state_dict, _of(ShardedTensor))


def extract_sharded_tensors_and_factories(sharded_state_dict: ShardedStateDict) -> _Split:
    """``(ShardedTensors and ShardedTensorFactories, everything else)``."""
    return extract_matching(sharded_state_dict, _of(ShardedTensor, ShardedTensorFactory))


def extract_sharded_tensors_or_nonpersistent(sharded_state_dict: ShardedStateDict) -> _Split:
    """``(ShardedTensors, factories and LocalNonpersistentObjects, everything else)``."""
    kinds = _of(ShardedTensor, ShardedTensorFactory, LocalNonpersistentObject)
    return extract_matching(sharded_state_dict, kinds)


def extract_sharded_base(sharded_state_dict: ShardedStateDict) -> _Split:
    """``(every ShardedBase, everything else)``."""
    return extract_matching(sharded_state_dict, _of(ShardedBase))


def extract_nonpersistent(sharded_state_dict: ShardedStateDict) -> _Split:
    """``(LocalNonpersistentObjects, everything else)``."""
    return extract_matching(sharded_state_dict, _of(LocalNonpersistentObject))


def add_prefix_for_sharding(sharded_state_dict: ShardedStateDict, prefix: str) -> None:
    """Prepends ``prefix`` to the key of every :class:`ShardedBase` in the state, in place."""
    apply_prefix_mapping(sharded_state_dict, {"": prefix})


def replace_prefix_for_sharding(
    sharded_state_dict: ShardedStateDict, old_prefix: str, new_prefix: str
) -> None:
    """Replaces ``old_prefix`` by ``new_prefix`` in every :class:`ShardedBase`'s key, in
    place; ``ValueError`` names a key without it (those before it are changed already)."""
    _rename(sharded_state_dict, {old_prefix: new_prefix}, strict=True)


def apply_prefix_mapping(sharded_state_dict: ShardedStateDict, prefix_map: dict[str, str]) -> None:
    """Renames, in place, each :class:`ShardedBase`'s key by the first prefix of
    ``prefix_map`` (old -> new) it starts with; others are left as they are."""
    _rename(sharded_state_dict, prefix_map, strict=False)


def _rename(sharded_state_dict: ShardedStateDict, prefix_map: dict[str, str], strict: bool) -> None:
    """``apply_prefix_mapping``; with ``strict``, a key that no prefix starts is refused."""

    def remap(x: Any) -> Any:
        if not isinstance(x, ShardedBase):
            return x
        for old_prefix, new_prefix in prefix_map.items():
            if x.key.startswith(old_prefix):
                x.key = f"{new_prefix}{x.key[len(old_prefix) :]}"
                return x
        if strict:
            raise ValueError(
                f"replace_prefix_for_sharding: key {x.key!r} does not start with prefix "
                + " or ".join(map(repr, prefix_map))
            )
        return x

    _map_leaves_inplace(remap, sharded_state_dict)


_FP8_DTYPES = frozenset(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
)


def _is_fp8(x: Any) -> bool:
    return getattr(x, "dtype", None) in _FP8_DTYPES


def _to_high_precision(x: Any) -> Any:
    # A quantized wrapper's own dequantize(), else float() (Tensor.dequantize is for torch's
    # quantized tensors).
    dequantize = getattr(type(x), "dequantize", None)
    if dequantize is not None and dequantize is not torch.Tensor.dequantize:
        return x.dequantize()
    return x.float()


def force_all_tensors_to_non_fp8(sharded_state_dict: ShardedStateDict) -> None:
    """Replaces, in place, every fp8 tensor of the state by its high-precision value (a
    quantized wrapper's ``dequantize()``, else float32), in ShardedTensors (their ``dtype``
    too), factories and plain leaves alike."""

    def convert(x: Any) -> Any:
        if isinstance(x, (ShardedTensor, ShardedTensorFactory)) and _is_fp8(x.data):
            x.data = _to_high_precision(x.data)
            if isinstance(x, ShardedTensor):
                x.dtype = x.data.dtype
        elif isinstance(x, torch.Tensor) and _is_fp8(x):
            return _to_high_precision(x)
        return x

    _map_leaves_inplace(convert, sharded_state_dict)


fallback_logger = logging.getLogger(__name__)
"""Where :func:`logger_stack` users log when no logger was pushed."""

# The scopes entered, innermost last, as (name, logger) pairs (either may be None); a context
# variable, so each thread and asyncio task sees its own.
_SCOPES: contextvars.ContextVar[tuple[tuple[str | None, logging.Logger | None], ...]] = (
    contextvars.ContextVar("statesnap_sharding_scopes", default=())
)


@contextmanager
def logger_stack(
    name: str | None = None, current_logger: logging.Logger | None = None
) -> Iterator[tuple[str, logging.Logger]]:
    """A named logging scope: pushes ``name`` and ``current_logger`` (those given) for the
    block. Yields the enclosing scopes' names joined by ``"."`` and the innermost logger
    (else :data:`fallback_logger`)."""
    token = _SCOPES.set((*_SCOPES.get(), (name, current_logger)))
    scopes = _SCOPES.get()
    loggers = [logger for _, logger in scopes if logger]
    try:
        yield ".".join(n for n, _ in scopes if n), loggers[-1] if loggers else fallback_logger
    finally:
        _SCOPES.reset(token)


@contextmanager
def debug_time(
    name: str,
    logger: logging.Logger | None = None,
    threshold: float = float("-inf"),
    level: int | None = None,
) -> Iterator[None]:
    """Times the block in a :func:`logger_stack` scope and logs ``"<names> took X.XXXs"``:
    every time at DEBUG, or with ``threshold`` only durations at least that long, at WARNING
    (``level`` overrides either); also when the block raises."""
    with logger_stack(name, logger) as (names, scope_logger):
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            if elapsed >= threshold:
                if level is None:
                    level = logging.DEBUG if threshold == float("-inf") else logging.WARNING
                scope_logger.log(level, "%s took %.3fs", names, elapsed)


def debug_msg(msg: str) -> None:
    """Logs ``msg`` at DEBUG to the current scope's logger, after the scope's names."""
    with logger_stack() as (names, scope_logger):
        scope_logger.debug("%s", f"{names} {msg}" if names else msg)


__all__ = [
    "ShardId",
    "add_prefix_for_sharding",
    "apply_prefix_mapping",
    "debug_msg",
    "debug_time",
    "extract_matching",
    "extract_nonpersistent",
    "extract_sharded_base",
    "extract_sharded_tensors",
    "extract_sharded_tensors_and_factories",
    "extract_sharded_tensors_or_nonpersistent",
    "fallback_logger",
    "force_all_tensors_to_non_fp8",
    "logger_stack",
    "replace_prefix_for_sharding",
    "sharded_object_id",
    "sharded_tensor_shard_id",
    "zip_strict",
]
