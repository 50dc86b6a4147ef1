"""Sharded state: how a rank's local tensors and objects map onto the global ones.

A *sharded state dict* is a nested dict/list state whose leaves may describe shards: a
:class:`ShardedTensor` ("my ``data`` is the block at ``global_offset`` of the tensor ``key`` of
``global_shape``"), a :class:`ShardedObject` (the same for an opaque object), a
:class:`ShardedTensorFactory` (a description built just before saving, merged back after
loading), a :class:`LocalNonpersistentObject` (kept on this rank, never saved). Copies of one
shard are told apart by ``replica_id``: only the main replica writes it. A wrong description
raises ``ValueError`` naming its key when it is built, on the rank that made it.
"""

from __future__ import annotations

import abc
import copy
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

ReplicaId = int | tuple[int, ...]
"""Which copy of a shard a rank holds: 0 (or all zeros) is the main replica."""

ShardedStateDict = dict[str, Any]
"""A nested dict/list state whose leaves may be :class:`ShardedBase` objects."""

StateDict = dict[str, Any]
"""A nested dict/list state of plain values (tensors, primitives, objects)."""


def is_main_replica(replica_id: ReplicaId) -> bool:
    """Whether ``replica_id`` designates the main copy of a shard (the one that is saved): the
    int 0, or a tuple whose every element is 0."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


_Sharded = TypeVar("_Sharded", bound="ShardedBase")

# A ShardedObject's unique key: "<key>/shard_<offset>_<shape>", offset and shape dot-separated.
_UNIQUE_KEY = re.compile(r"(.*)/shard_((?:\d+(?:\.\d+)*)?)_((?:\d+(?:\.\d+)*)?)", re.DOTALL)


class ShardedBase(abc.ABC):
    """A leaf of a sharded state dict that describes one shard of a global value."""

    key: str
    data: object
    replica_id: ReplicaId

    @abc.abstractmethod
    def validate_metadata_integrity(self) -> None:
        """Raises ``ValueError`` (naming the key) if the description is inconsistent."""

    def _error(self, message: str) -> ValueError:
        return ValueError(f"{type(self).__name__} {self.key!r}: {message}")

    def without_data(self: _Sharded) -> _Sharded:
        """A copy with the same description and ``data=None``, e.g. to exchange metadata
        between ranks without the payload."""
        bare = copy.copy(self)
        bare.data = None
        return bare


def _int_tuple(value: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


@dataclass
class ShardedTensor(ShardedBase):
    """The block ``data`` (of ``dtype``) of the global tensor ``key`` that this rank holds;
    ``replica_id`` 0 marks the copy that is written when several ranks hold the same block.

    ``local_shape`` is ``data``'s shape; ``global_shape`` and ``global_offset`` locate it. The
    first ``prepend_axis_num`` global axes do not exist locally (one layer of a stack of
    layers): the block spans one index of each. ``axis_fragmentations``: blocks per axis when
    evenly sharded (None: unknown). ``allow_shape_mismatch`` is kept for Megatron's API but
    read by nothing: a restore always needs the stored global shape. ``flattened_range`` is not
    supported.
    """

    key: str
    data: torch.Tensor | None = field(repr=False)  # its repr shows the description only
    dtype: torch.dtype
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    axis_fragmentations: tuple[int, ...] | None
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: slice | None = None

    def __post_init__(self) -> None:
        # Plain int tuples, so descriptions compare, hash and serialize alike.
        self.local_shape = _int_tuple(self.local_shape)
        self.global_shape = _int_tuple(self.global_shape)
        self.global_offset = _int_tuple(self.global_offset)
        if self.axis_fragmentations is not None:
            self.axis_fragmentations = _int_tuple(self.axis_fragmentations)
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        """Checks that data, shapes and offset agree; raises ``ValueError`` naming the key."""
        if self.flattened_range is not None:
            raise self._error(
                f"flattened_range={self.flattened_range} given, but flattened ranges are not "
                "supported by statesnap: describe the shard as a block of the global tensor"
            )
        if self.data is not None:
            if tuple(self.data.shape) != self.local_shape:
                raise self._error(
                    f"data has shape {tuple(self.data.shape)}, but local_shape is "
                    f"{self.local_shape}"
                )
            if self.data.dtype != self.dtype:
                raise self._error(f"data has dtype {self.data.dtype}, but dtype is {self.dtype}")
        if len(self.global_shape) != len(self.global_offset):
            raise self._error(
                f"global_shape {self.global_shape} and global_offset {self.global_offset} have "
                "different numbers of axes"
            )
        if self.prepend_axis_num < 0:
            raise self._error(f"prepend_axis_num must be >= 0, got {self.prepend_axis_num}")
        if len(self.local_shape) + self.prepend_axis_num != len(self.global_shape):
            raise self._error(
                f"local_shape {self.local_shape} with {self.prepend_axis_num} prepended axes does "
                f"not have as many axes as global_shape {self.global_shape}"
            )
        if self.axis_fragmentations is not None and len(self.axis_fragmentations) != len(
            self.global_shape
        ):
            raise self._error(
                f"axis_fragmentations {self.axis_fragmentations} does not have one entry per "
                f"axis of global_shape {self.global_shape}"
            )
        _, sizes = self.global_region()
        for axis, (off, size, glob) in enumerate(
            zip(self.global_offset, sizes, self.global_shape, strict=True)
        ):
            if off < 0:
                raise self._error(f"global_offset {self.global_offset} is negative on axis {axis}")
            if off + size > glob:
                raise self._error(
                    f"the shard (offset {off}, size {size}) exceeds global_shape "
                    f"{self.global_shape} on axis {axis}"
                )

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        **init_kwargs: Any,
    ) -> ShardedTensor:
        """Describes ``data`` as block ``axis_rank_offset`` of ``axis_fragmentations`` equal
        blocks on each global ``axis`` of ``rank_offsets`` (``(axis, axis_rank_offset,
        axis_fragmentations)``); axes not named are whole. On a prepended axis the block is one
        index. ``key``, ``replica_id`` and ``prepend_axis_num`` are the constructor's, as are
        ``init_kwargs``.

        Raises:
            ValueError: an axis is out of range or named twice, or an offset is outside its
                fragmentation.
        """
        ndim = data.dim() + prepend_axis_num
        local_sizes = (1,) * prepend_axis_num + tuple(data.shape)
        global_shape = list(local_sizes)
        global_offset = [0] * ndim
        fragmentations = [1] * ndim
        seen: set[int] = set()
        for axis, axis_rank_offset, axis_fragm in rank_offsets:
            if not 0 <= axis < ndim:
                raise ValueError(
                    f"ShardedTensor {key!r}: axis {axis} is out of range for a global tensor of "
                    f"{ndim} axes ({prepend_axis_num} prepended + {data.dim()} local)"
                )
            if axis in seen:
                raise ValueError(f"ShardedTensor {key!r}: axis {axis} is given more than once")
            seen.add(axis)
            if axis_fragm < 1:
                raise ValueError(
                    f"ShardedTensor {key!r}: axis {axis} has {axis_fragm} fragmentations, "
                    "must be >= 1"
                )
            if not 0 <= axis_rank_offset < axis_fragm:
                raise ValueError(
                    f"ShardedTensor {key!r}: rank offset {axis_rank_offset} on axis {axis} is "
                    f"not in [0, {axis_fragm}) (the axis has {axis_fragm} fragmentations)"
                )
            global_shape[axis] = local_sizes[axis] * axis_fragm
            global_offset[axis] = local_sizes[axis] * axis_rank_offset
            fragmentations[axis] = axis_fragm
        return cls(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            tuple(global_shape),
            tuple(global_offset),
            tuple(fragmentations),
            replica_id=replica_id,
            prepend_axis_num=prepend_axis_num,
            **init_kwargs,
        )

    def global_region(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(offsets, sizes)`` of this shard per global axis (size 1 on prepended axes)."""
        sizes = (1,) * self.prepend_axis_num + self.local_shape
        return self.global_offset, sizes

    def global_slice(self) -> tuple[slice, ...]:
        """This shard's region as slices of the global tensor, one per global axis."""
        offsets, sizes = self.global_region()
        return tuple(slice(off, off + size) for off, size in zip(offsets, sizes, strict=True))

    def local_chunk_offset_in_global(self) -> tuple[int, ...]:
        """The block's index on each global axis (offset // block size; ``ValueError`` where
        the tensor is not evenly sharded)."""
        offsets, sizes = self.global_region()
        return self._per_block(offsets, sizes, "offset", 0)

    def max_allowed_chunks(self) -> tuple[int, ...]:
        """Blocks per global axis: ``axis_fragmentations``, else global size // block size
        (``ValueError`` where the tensor is not evenly sharded)."""
        if self.axis_fragmentations is not None:
            return self.axis_fragmentations
        _, sizes = self.global_region()
        return self._per_block(self.global_shape, sizes, "global size", 1)

    def _per_block(
        self, values: tuple[int, ...], sizes: tuple[int, ...], what: str, empty: int
    ) -> tuple[int, ...]:
        """``value // size`` per axis (``empty`` for a size of 0), each a whole multiple."""
        for axis, (value, size) in enumerate(zip(values, sizes, strict=True)):
            if size and value % size:
                raise self._error(
                    f"{what} {value} on axis {axis} is not a multiple of the shard size {size}: "
                    "the tensor is not evenly sharded"
                )
        return tuple(v // s if s else empty for v, s in zip(values, sizes, strict=True))


@dataclass
class ShardedObject(ShardedBase):
    """The piece ``data`` at ``global_offset`` of a grid of ``global_shape`` pieces of the
    object ``key``, saved whole (by the rank whose ``replica_id`` is 0); ``unique_key`` names
    it (``empty_from_unique_key`` parses it back)."""

    key: str
    data: object
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self) -> None:
        self.global_shape = _int_tuple(self.global_shape)
        self.global_offset = _int_tuple(self.global_offset)
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        """Checks that the offset is a position in the grid."""
        if len(self.global_shape) != len(self.global_offset):
            raise self._error(
                f"global_shape {self.global_shape} and global_offset {self.global_offset} have "
                "different numbers of axes"
            )
        for axis, (off, glob) in enumerate(zip(self.global_offset, self.global_shape, strict=True)):
            if not 0 <= off < glob:
                raise self._error(
                    f"global_offset {self.global_offset} is outside global_shape "
                    f"{self.global_shape} on axis {axis}"
                )

    @property
    def unique_key(self) -> str:
        """``"<key>/shard_<offset>_<shape>"``, offset and shape dot-separated."""
        offset = ".".join(map(str, self.global_offset))
        shape = ".".join(map(str, self.global_shape))
        return f"{self.key}/shard_{offset}_{shape}"

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> ShardedObject:
        """The data-less ``ShardedObject`` whose ``unique_key`` is ``unique_key``, of
        ``replica_id``.

        Raises:
            ValueError: ``unique_key`` is not of the form ``<key>/shard_<offset>_<shape>``.
        """
        m = _UNIQUE_KEY.fullmatch(unique_key)
        if m is None:
            raise ValueError(
                f"{unique_key!r} is not a ShardedObject unique key (<key>/shard_<offset>_<shape>, "
                "offset and shape dot-separated integers)"
            )
        offset, shape = (tuple(map(int, g.split("."))) if g else () for g in m.group(2, 3))
        return cls(m.group(1), None, shape, offset, replica_id=replica_id)


@dataclass
class ShardedTensorFactory(ShardedBase):
    """A tensor whose sharded description is built just before saving (``build_fn(key, data,
    replica_id, flattened_range)`` returns a sharded state dict: one fused parameter saved as
    several tensors, say) and whose loaded parts ``merge_fn`` merges back into the tensor."""

    key: str
    data: torch.Tensor | None
    build_fn: Callable[[str, torch.Tensor, ReplicaId, slice | None], Any]
    merge_fn: Callable[[Any], torch.Tensor]
    replica_id: ReplicaId = 0
    flattened_range: slice | None = None

    def build(self) -> Any:
        """The sharded state dict this factory stands for."""
        if self.data is None:
            raise self._error("no data to build from")
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

    def validate_metadata_integrity(self) -> None:
        """Nothing to check here: what :meth:`build` returns checks itself."""


@dataclass
class LocalNonpersistentObject:
    """A value ``obj`` kept on this rank but never saved: a restore unwraps it in its
    place."""

    obj: Any

    def unwrap(self) -> Any:
        """The wrapped value."""
        return self.obj


def _map_leaves_inplace(fn: Callable[[Any], Any], x: Any) -> Any:
    """Replaces every leaf below the dicts and lists of ``x`` (tuples are leaves) by
    ``fn(leaf)``, in place; returns ``x``, or ``fn(x)`` for a leaf."""
    for path, leaf in _leaves(x):
        if not path:
            return fn(leaf)
        parent = x
        for k in path[:-1]:
            parent = parent[k]
        parent[path[-1]] = fn(leaf)
    return x


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replaces, in place, every :class:`ShardedTensorFactory` in the dicts and lists of
    ``sharded_state_dict`` by what its :meth:`~ShardedTensorFactory.build` returns."""

    def build(x: Any) -> Any:
        return x.build() if isinstance(x, ShardedTensorFactory) else x

    _map_leaves_inplace(build, sharded_state_dict)


def _leaves(x: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """(path, leaf) for every leaf below the dicts and lists of ``x`` (tuples are leaves), in
    order; ``x`` itself, at ``()``, when it is a leaf."""
    if not isinstance(x, (dict, list)):
        yield path, x
        return
    for k, v in x.items() if isinstance(x, dict) else enumerate(x):
        yield from _leaves(v, (*path, k))


def apply_factory_merges(x: Any, factories: Any) -> Any:
    """Undoes :func:`apply_factories` on a loaded state, in place: where ``factories`` (the
    state before building) holds a factory, what ``x`` holds at that place becomes
    ``merge_fn(loaded)``; the rest is left as it is. ``ValueError`` (naming the path and the
    factory) where ``x`` lacks the structure of ``factories`` on the way to a factory."""

    def where(path: tuple[Any, ...]) -> str:
        return "/".join(map(str, path)) or "<root>"

    for path, factory in _leaves(factories):
        if not isinstance(factory, ShardedTensorFactory):
            continue
        if not path:
            return factory.merge_fn(x)
        built = f"built by factory {factory.key!r}"
        loaded, expected = x, factories
        for depth, k in enumerate(path):
            here = where(path[:depth])
            if isinstance(expected, dict):
                if not isinstance(loaded, dict):
                    raise ValueError(
                        f"apply_factory_merges: expected a dict at {here!r} of the loaded "
                        f"state ({built}), got {type(loaded).__name__}"
                    )
                if k not in loaded:
                    raise ValueError(
                        f"apply_factory_merges: key {where(path[: depth + 1])!r} ({built}) is "
                        "missing from the loaded state"
                    )
            elif not isinstance(loaded, list) or len(loaded) != len(expected):
                got = type(loaded).__name__
                if isinstance(loaded, list):
                    got = f"a list of {len(loaded)}"
                raise ValueError(
                    f"apply_factory_merges: expected a list of {len(expected)} at {here!r} "
                    f"of the loaded state ({built}), got {got}"
                )
            if depth < len(path) - 1:
                loaded, expected = loaded[k], expected[k]
        loaded[path[-1]] = factory.merge_fn(loaded[path[-1]])
    return x


__all__ = [
    "LocalNonpersistentObject",
    "ReplicaId",
    "ShardedBase",
    "ShardedObject",
    "ShardedStateDict",
    "ShardedTensor",
    "ShardedTensorFactory",
    "StateDict",
    "apply_factories",
    "apply_factory_merges",
    "is_main_replica",
]
