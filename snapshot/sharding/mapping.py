"""Sharded state: how a rank's local tensors and objects map onto the global ones.

A *sharded state dict* is an ordinary nested dict/list state whose leaves may be descriptions of
a shard instead of (or besides) plain values: a :class:`ShardedTensor` says "my ``data`` is the
block at ``global_offset`` of a tensor of ``global_shape`` named ``key``"; a
:class:`ShardedObject` does the same for an opaque object; a :class:`ShardedTensorFactory`
defers the description to a function run just before saving (and undoes it after loading); a
:class:`LocalNonpersistentObject` is a value kept on this rank and never saved.

Ranks holding copies of the same shard tell them apart with ``replica_id``: only the main
replica (:func:`is_main_replica`) needs to write it, any of them may read it.

Every check on a shard's description raises ``ValueError`` naming the shard's key, at
construction, so a wrong description fails on the rank that made it instead of corrupting the
snapshot.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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


class ShardedBase(abc.ABC):
    """A leaf of a sharded state dict that describes one shard of a global value."""

    key: str
    data: object
    replica_id: ReplicaId

    @abc.abstractmethod
    def validate_metadata_integrity(self) -> None:
        """Raises ``ValueError`` (naming the key) if the description is inconsistent."""

    @abc.abstractmethod
    def without_data(self) -> ShardedBase:
        """A copy with the same description and ``data=None``, e.g. to exchange metadata
        between ranks without the payload."""


def _int_tuple(value: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


@dataclass
class ShardedTensor(ShardedBase):
    """The block of a global tensor that this rank holds.

    ``local_shape`` is the block's shape (``data``'s shape), ``global_shape`` and
    ``global_offset`` locate it in the global tensor. The first ``prepend_axis_num`` global axes
    are *prepended*: they do not exist in the local tensor (think of one layer of a stack of
    layers), so the block spans exactly one index on each of them.

    ``axis_fragmentations`` is how many blocks each global axis is split into, when the tensor
    is evenly sharded (``None`` when unknown). ``allow_shape_mismatch`` lets a restore accept a
    stored tensor whose shape differs from this one (the caller reconciles them).
    ``flattened_range`` (a range of the flattened block) is not supported and is rejected.
    """

    key: str
    data: torch.Tensor | None
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
        # Accept lists and torch.Size for shapes; store plain int tuples so that descriptions
        # compare, hash into ids and serialize the same whichever the caller passed.
        self.local_shape = _int_tuple(self.local_shape)
        self.global_shape = _int_tuple(self.global_shape)
        self.global_offset = _int_tuple(self.global_offset)
        if self.axis_fragmentations is not None:
            self.axis_fragmentations = _int_tuple(self.axis_fragmentations)
        self.validate_metadata_integrity()

    def _error(self, message: str) -> ValueError:
        return ValueError(f"ShardedTensor {self.key!r}: {message}")

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
        """Describes ``data`` as the block number ``axis_rank_offset`` (of
        ``axis_fragmentations`` equal blocks) on each axis named in ``rank_offsets``.

        Each rank offset is ``(axis, axis_rank_offset, axis_fragmentations)``, ``axis`` indexing
        the *global* tensor. An axis below ``prepend_axis_num`` is prepended: the block is one
        index of it, the global size is ``axis_fragmentations`` and the offset is
        ``axis_rank_offset``. On a regular axis the global size is ``local_size *
        axis_fragmentations`` and the offset ``axis_rank_offset * local_size``. Axes not named
        are whole: offset 0, one fragment. ``init_kwargs`` go to the constructor.

        Raises:
            ValueError: an axis given twice or out of range, a rank offset outside
                ``[0, axis_fragmentations)``, or an inconsistent result.
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
        """``(offsets, sizes)`` of this shard in the global tensor, one entry per global axis
        (size 1 on prepended axes)."""
        sizes = (1,) * self.prepend_axis_num + self.local_shape
        return self.global_offset, sizes

    def global_slice(self) -> tuple[slice, ...]:
        """This shard's region as slices of the global tensor, one per global axis: indexing
        the global tensor with it gives the block (with size-1 prepended axes)."""
        offsets, sizes = self.global_region()
        return tuple(slice(off, off + size) for off, size in zip(offsets, sizes, strict=True))

    def local_chunk_offset_in_global(self) -> tuple[int, ...]:
        """The block's index on each global axis (offset // block size), for an evenly sharded
        tensor.

        Raises:
            ValueError: an offset is not a multiple of the block's size on its axis.
        """
        offsets, sizes = self.global_region()
        chunks = []
        for axis, (off, size) in enumerate(zip(offsets, sizes, strict=True)):
            if size == 0:
                chunks.append(0)
                continue
            if off % size:
                raise self._error(
                    f"offset {off} on axis {axis} is not a multiple of the shard size {size}: "
                    "the tensor is not evenly sharded"
                )
            chunks.append(off // size)
        return tuple(chunks)

    def max_allowed_chunks(self) -> tuple[int, ...]:
        """How many blocks each global axis is split into: ``axis_fragmentations`` or, when it
        is None, global size // block size per axis.

        Raises:
            ValueError: (without ``axis_fragmentations``) a global size is not a multiple of
                the block's size.
        """
        if self.axis_fragmentations is not None:
            return self.axis_fragmentations
        _, sizes = self.global_region()
        chunks = []
        for axis, (size, glob) in enumerate(zip(sizes, self.global_shape, strict=True)):
            if size == 0:
                chunks.append(1)
                continue
            if glob % size:
                raise self._error(
                    f"global size {glob} on axis {axis} is not a multiple of the shard size "
                    f"{size}: the tensor is not evenly sharded"
                )
            chunks.append(glob // size)
        return tuple(chunks)

    def without_data(self) -> ShardedTensor:
        return dataclasses.replace(self, data=None)

    def __repr__(self) -> str:
        return (
            f"ShardedTensor(key={self.key!r}, dtype={self.dtype}, local_shape={self.local_shape}, "
            f"global_shape={self.global_shape}, global_offset={self.global_offset}, "
            f"replica_id={self.replica_id})"
        )


@dataclass
class ShardedObject(ShardedBase):
    """One piece of an object split over ranks: the piece at ``global_offset`` of a grid of
    ``global_shape`` pieces, saved as a whole (pickled) object.

    ``unique_key`` names the piece in a snapshot; :meth:`empty_from_unique_key` parses it back.
    """

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
        """Checks that the offset is a position in the grid; raises ``ValueError`` naming the
        key."""
        if len(self.global_shape) != len(self.global_offset):
            raise ValueError(
                f"ShardedObject {self.key!r}: global_shape {self.global_shape} and global_offset "
                f"{self.global_offset} have different numbers of axes"
            )
        for axis, (off, glob) in enumerate(zip(self.global_offset, self.global_shape, strict=True)):
            if not 0 <= off < glob:
                raise ValueError(
                    f"ShardedObject {self.key!r}: global_offset {self.global_offset} is outside "
                    f"global_shape {self.global_shape} on axis {axis}"
                )

    @property
    def unique_key(self) -> str:
        """``"<key>/shard_<offset>_<shape>"``, offset and shape dot-separated."""
        offset = ".".join(map(str, self.global_offset))
        shape = ".".join(map(str, self.global_shape))
        return f"{self.key}/shard_{offset}_{shape}"

    def without_data(self) -> ShardedObject:
        return dataclasses.replace(self, data=None)

    @classmethod
    def empty_from_unique_key(cls, unique_key: str, replica_id: ReplicaId = 0) -> ShardedObject:
        """The data-less :class:`ShardedObject` whose :attr:`unique_key` is ``unique_key``.

        Raises:
            ValueError: ``unique_key`` is not of the form ``"<key>/shard_<offset>_<shape>"``.
        """
        key, sep, shard = unique_key.rpartition("/")
        parts = shard.split("_")
        if not sep or len(parts) != 3 or parts[0] != "shard":
            raise ValueError(
                f"{unique_key!r} is not a ShardedObject unique key (<key>/shard_<offset>_<shape>)"
            )

        def ints(text: str) -> tuple[int, ...]:
            return tuple(int(p) for p in text.split(".")) if text else ()

        try:
            offset, shape = ints(parts[1]), ints(parts[2])
        except ValueError:
            raise ValueError(
                f"{unique_key!r} is not a ShardedObject unique key: offset and shape must be "
                "dot-separated integers"
            ) from None
        return cls(key, None, shape, offset, replica_id=replica_id)


@dataclass
class ShardedTensorFactory(ShardedBase):
    """A tensor whose sharded description is built just before saving, and whose loaded parts
    are merged back just after restoring.

    ``build_fn(key, data, replica_id, flattened_range)`` returns a sharded state dict (a
    :class:`ShardedTensor` or a nested dict/list of them), e.g. to save one fused parameter as
    several tensors. ``merge_fn`` takes what was loaded for that sharded state dict (same
    structure, tensors in place of descriptions) and returns the tensor.
    """

    key: str
    data: torch.Tensor
    build_fn: Callable[[str, torch.Tensor, ReplicaId, slice | None], Any]
    merge_fn: Callable[[Any], torch.Tensor]
    replica_id: ReplicaId = 0
    flattened_range: slice | None = None

    def build(self) -> Any:
        """The sharded state dict this factory stands for."""
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)

    def validate_metadata_integrity(self) -> None:
        """Nothing to check here: what :meth:`build` returns checks itself."""

    def without_data(self) -> ShardedTensorFactory:
        return dataclasses.replace(self, data=None)


@dataclass
class LocalNonpersistentObject:
    """A value kept on this rank through a take/restore but never saved: on restore it is
    unwrapped in place of the loaded value."""

    obj: Any

    def unwrap(self) -> Any:
        """The wrapped value."""
        return self.obj


def _map_leaves_inplace(fn: Callable[[Any], Any], x: Any) -> Any:
    """Replaces every leaf below the dicts and lists of ``x`` by ``fn(leaf)``, in place, and
    returns ``x`` (or ``fn(x)`` if ``x`` is itself a leaf). Tuples and other containers are
    leaves."""
    if isinstance(x, dict):
        for k, v in x.items():
            x[k] = _map_leaves_inplace(fn, v)
        return x
    if isinstance(x, list):
        for i, v in enumerate(x):
            x[i] = _map_leaves_inplace(fn, v)
        return x
    return fn(x)


def apply_factories(sharded_state_dict: ShardedStateDict) -> None:
    """Replaces, in place, every :class:`ShardedTensorFactory` in the dicts and lists of
    ``sharded_state_dict`` by what its :meth:`~ShardedTensorFactory.build` returns."""

    def build(x: Any) -> Any:
        return x.build() if isinstance(x, ShardedTensorFactory) else x

    _map_leaves_inplace(build, sharded_state_dict)


def _factories_in(x: Any) -> list[ShardedTensorFactory]:
    """The factories in the dicts and lists of ``x``, in order (``x`` is not changed)."""
    if isinstance(x, ShardedTensorFactory):
        return [x]
    if isinstance(x, dict):
        return [f for v in x.values() for f in _factories_in(v)]
    if isinstance(x, list):
        return [f for v in x for f in _factories_in(v)]
    return []


def apply_factory_merges(x: Any, factories: Any) -> Any:
    """Undoes :func:`apply_factories` on a loaded state: where ``factories`` (the state before
    the factories were built, or just its factories) holds a :class:`ShardedTensorFactory`,
    what was loaded at the same place in ``x`` is replaced by ``merge_fn(loaded)``.

    ``x`` is changed in place and returned (a factory at the root returns its merge). Values
    of ``factories`` that are not factories, and the parts of ``x`` they correspond to, are
    left as they are; so are keys of ``x`` that ``factories`` lacks.

    Raises:
        ValueError: ``x`` does not have the structure of ``factories`` where a factory is
            (a missing key, a list of another length, a leaf for a container); the message
            names the path in the state and the factory's key.
    """

    def where(path: tuple[Any, ...]) -> str:
        return "/".join(map(str, path)) or "<root>"

    def built_by(sub: Any) -> str:
        return "factory " + ", ".join(repr(f.key) for f in _factories_in(sub))

    def merge(loaded: Any, expected: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(expected, ShardedTensorFactory):
            return expected.merge_fn(loaded)
        if not _factories_in(expected):
            return loaded
        if isinstance(expected, dict):
            if not isinstance(loaded, dict):
                raise ValueError(
                    f"apply_factory_merges: expected a dict at {where(path)!r} of the loaded "
                    f"state (built by {built_by(expected)}), got {type(loaded).__name__}"
                )
            for k, v in expected.items():
                if k in loaded:
                    loaded[k] = merge(loaded[k], v, (*path, k))
                elif _factories_in(v):
                    raise ValueError(
                        f"apply_factory_merges: key {where((*path, k))!r} (built by "
                        f"{built_by(v)}) is missing from the loaded state"
                    )
            return loaded
        # A list, since it holds a factory.
        if not isinstance(loaded, list) or len(loaded) != len(expected):
            got = f"a list of {len(loaded)}" if isinstance(loaded, list) else type(loaded).__name__
            raise ValueError(
                f"apply_factory_merges: expected a list of {len(expected)} at {where(path)!r} "
                f"of the loaded state (built by {built_by(expected)}), got {got}"
            )
        for i, v in enumerate(expected):
            loaded[i] = merge(loaded[i], v, (*path, i))
        return loaded

    return merge(x, factories, ())


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
