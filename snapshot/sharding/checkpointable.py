"""ShardedTensors as torch.distributed.checkpoint (DCP) values: save and load them with DCP.

DCP asks a state-dict value three questions through the ``_Checkpointable`` protocol
(``torch/distributed/_checkpointable.py``), and answers them itself for plain tensors, DTensors
and torch's own ShardedTensor. The wrappers here answer them for this library's
:class:`~snapshot.sharding.mapping.ShardedTensor`:

- ``__create_write_items__(fqn, obj)``: called on every rank while DCP builds its local save plan
  (``planner_helpers._create_write_items``); one ``WriteItem`` per chunk the rank writes. The
  coordinator concatenates every rank's chunks into the checkpoint metadata, checks that they lie
  inside the global shape, do not overlap and (with more than one rank) fill it exactly.
- ``__create_chunk_list__()``: called on every rank while DCP builds its local load plan
  (``planner_helpers._create_chunk_list``); the chunks the rank wants filled. DCP intersects them
  with the stored chunks, so the saved and loaded shardings need not match.
- ``__get_tensor_shard__(index)``: called for every write item (to fetch the bytes to store) and
  every read item (to fetch the tensor to copy loaded bytes into; DCP narrows it and calls
  ``copy_`` on the result), with ``index.offset`` the chunk's global offset
  (``utils.find_tensor_shard``). Returning a view of the local data makes loading in place.

DCP also compares each value's ``size()`` with the stored global size before it loads, so the
wrappers report the GLOBAL shape (like DTensor), while the bytes they hand out are the local shard.

``dcp.save`` and ``dcp.load`` with the default planners run no tensor op on the wrappers
themselves. ``dcp.async_save`` does: its staging allocates CPU copies of every value
(``new_empty``), which the wrappers refuse, so it is not supported.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from snapshot.sharding.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedTensor,
    is_main_replica,
)

__all__ = ["CheckpointableShardedTensor", "LocalShardsContainer", "to_dcp_state_dict"]

_aten = torch.ops.aten


def _shard_chunk(data: torch.Tensor, sh_ten: ShardedTensor) -> ChunkStorageMetadata:
    """The global box a shard covers, after checking that ``data`` fits ``sh_ten``.

    ``ShardedTensor`` checks its own ``data`` when it is built; this also covers data passed
    separately, or swapped in later.
    """
    if not isinstance(data, torch.Tensor):
        raise ValueError(
            f"ShardedTensor {sh_ten.key!r} has no data tensor (got {type(data).__name__}); "
            "DCP needs the local shard's values to save and a tensor to load into"
        )
    if tuple(data.shape) != tuple(sh_ten.local_shape):
        raise ValueError(
            f"ShardedTensor {sh_ten.key!r}: data has shape {tuple(data.shape)} but local_shape "
            f"is {tuple(sh_ten.local_shape)}"
        )
    if data.dtype != sh_ten.dtype:
        raise ValueError(
            f"ShardedTensor {sh_ten.key!r}: data has dtype {data.dtype} but the ShardedTensor "
            f"says {sh_ten.dtype}; cast the data or fix the dtype"
        )
    offsets, sizes = sh_ten.global_region()
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


class CheckpointableShardedTensor(torch.Tensor):
    """One rank's shard of a global tensor, in a form DCP saves and loads.

    A wrapper tensor subclass: it has the global shape and the dtype and device of its data but
    owns no storage; the shard's values stay in ``local_data`` (the tensor it was built from,
    shared, not copied), so loading writes into that tensor. Only the main replica
    (``is_main_replica(replica_id)``) writes; every replica loads.

    Prepended axes (``prepend_axis_num > 0``, e.g. one layer of a stack of per-layer tensors)
    are absent from the data but present in the global tensor: DCP sees the chunk with a size-1
    axis for each, and reads and writes a view of the data with those axes unsqueezed.

    Tensor operations are not supported on the wrapper (it has no values of the global shape),
    except a few for code that copies values in (DCP itself needs none of them: it reads and
    writes the tensor ``__get_tensor_shard__`` returns): ``detach``/``alias``/``clone`` (a new
    wrapper over the detached/aliased/cloned data) and ``copy_`` into the wrapper (see
    :meth:`__torch_dispatch__`). Anything else raises ``NotImplementedError``.
    """

    _data: torch.Tensor
    _sh_ten: ShardedTensor
    _chunk: ChunkStorageMetadata

    # Every torch function goes straight to __torch_dispatch__, where ops are allowed or refused.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data: torch.Tensor, sh_ten: ShardedTensor) -> CheckpointableShardedTensor:
        """Wraps ``data`` (the local shard's values) described by ``sh_ten``.

        Raises:
            ValueError: ``data`` is not a tensor, or its shape or dtype disagree with ``sh_ten``.
        """
        chunk = _shard_chunk(data, sh_ten)
        self = torch.Tensor._make_wrapper_subclass(
            cls,
            torch.Size(sh_ten.global_shape),
            dtype=data.dtype,
            device=data.device,
            requires_grad=False,
        )
        self._data = data
        self._sh_ten = sh_ten
        self._chunk = chunk
        return self

    def __init__(self, data: torch.Tensor, sh_ten: ShardedTensor) -> None:
        # Everything happens in __new__; this only accepts its arguments.
        super().__init__()

    @classmethod
    def from_sh_ten(cls, sh_ten: ShardedTensor) -> CheckpointableShardedTensor:
        """Wraps ``sh_ten`` over its own ``data``."""
        return cls(sh_ten.data, sh_ten)  # type: ignore[arg-type]  # None is refused in __new__

    @property
    def local_data(self) -> torch.Tensor:
        """The shard's values, in the local shape (without prepended axes)."""
        return self._data

    @property
    def sharded_tensor(self) -> ShardedTensor:
        """The ShardedTensor this wrapper describes."""
        return self._sh_ten

    @property
    def chunk(self) -> ChunkStorageMetadata:
        """The global box of this shard: offsets and sizes in the global tensor's axes."""
        return ChunkStorageMetadata(offsets=self._chunk.offsets, sizes=self._chunk.sizes)

    def _dcp_view(self) -> torch.Tensor:
        """The data with a size-1 axis per prepended axis: the chunk's shape, sharing storage."""
        view = self._data
        for _ in range(self._sh_ten.prepend_axis_num):
            view = view.unsqueeze(0)
        return view

    # -- the _Checkpointable protocol ----------------------------------------------------------

    def __create_write_items__(
        self, fqn: str, sh_ten: CheckpointableShardedTensor, index: int | None = None
    ) -> list[WriteItem]:
        """The write items of this shard: one on the main replica, none on the others.

        Args:
            fqn: the key DCP stores the global tensor under.
            sh_ten: the object DCP asks about (DCP passes the value itself, i.e. ``self``).
            index: position of this shard in a :class:`LocalShardsContainer`, recorded as the
                lookup hint of the item's ``MetadataIndex`` (DCP's global plan rewrites hints).

        Returns:
            ``[WriteItem]`` of type ``SHARD`` at this shard's global offset, or ``[]`` for a
            non-main replica: another rank writes those bytes, so nothing needs deduplicating.
        """
        if not is_main_replica(self._sh_ten.replica_id):
            return []
        chunk = self.chunk
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets, index),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(self._data),
                    size=torch.Size(self._sh_ten.global_shape),
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """The box this rank wants loaded: ``[chunk]``, on every replica (all of them load)."""
        return [self.chunk]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The tensor DCP reads bytes from (save) or copies bytes into (load).

        Raises:
            ValueError: ``index.offset`` is not this shard's offset.
        """
        if index.offset is not None and torch.Size(index.offset) != self._chunk.offsets:
            raise ValueError(
                f"{index.fqn!r}: DCP asked for the shard at offset {tuple(index.offset)}, but "
                f"this rank holds the one at {tuple(self._chunk.offsets)}"
            )
        return self._dcp_view()

    # -- tensor operations -------------------------------------------------------------------

    @classmethod
    def __torch_dispatch__(
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """The few ops a wrapper supports; the rest raise ``NotImplementedError``.

        - ``detach``, ``alias``, ``clone``: a new wrapper of the same shard over the op's result
          on the data (``clone`` copies the values).
        - ``copy_`` into a wrapper: from another wrapper of the same box (its data is copied) or
          from a plain tensor of the global shape (this shard's box of it is copied). This is
          what ``load_state_dict``-style code does with a full tensor.
        """
        kwargs = kwargs or {}
        if func in (_aten.detach.default, _aten.alias.default, _aten.clone.default):
            src = args[0]
            return cls(func(src._data, *args[1:], **kwargs), src._sh_ten)
        if func is _aten.copy_.default:
            dst, src = args[0], args[1]
            non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            if isinstance(dst, cls):
                dst._copy_into(src, non_blocking)
                return dst
            raise NotImplementedError(
                f"copying a {cls.__name__} into a plain tensor is not supported: the wrapper holds "
                "only one shard of the global tensor; copy its .local_data instead"
            )
        raise NotImplementedError(
            f"{cls.__name__} does not support {func} (only detach, alias, clone and copy_ into "
            "it): it stands for a global tensor but holds only this rank's shard; operate on "
            ".local_data instead"
        )

    def _copy_into(self, src: Any, non_blocking: bool) -> None:
        """Copies ``src`` (a wrapper of the same box, or a full global tensor) into the data."""
        if isinstance(src, CheckpointableShardedTensor):
            if src._chunk != self._chunk:
                raise ValueError(
                    f"cannot copy shard {src._sh_ten.key!r} at {tuple(src._chunk.offsets)} (sizes "
                    f"{tuple(src._chunk.sizes)}) into shard {self._sh_ten.key!r} at "
                    f"{tuple(self._chunk.offsets)} (sizes {tuple(self._chunk.sizes)})"
                )
            self._data.copy_(src._data, non_blocking=non_blocking)
            return
        if not isinstance(src, torch.Tensor) or isinstance(src, LocalShardsContainer):
            raise NotImplementedError(
                f"copy_ into a {type(self).__name__} from {type(src).__name__} is not supported"
            )
        if src.shape != self.shape:
            raise ValueError(
                f"copy_ into shard {self._sh_ten.key!r} needs a tensor of the global shape "
                f"{tuple(self.shape)}, got {tuple(src.shape)}"
            )
        region = src
        chunk = self._chunk
        for axis, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
            region = region.narrow(axis, offset, size)
        self._dcp_view().copy_(region, non_blocking=non_blocking)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return (
            f"{type(self).__name__}(key={self._sh_ten.key!r}, "
            f"global_shape={tuple(self.shape)}, offsets={tuple(self._chunk.offsets)}, "
            f"sizes={tuple(self._chunk.sizes)}, dtype={self.dtype}, device={self.device}, "
            f"replica_id={self._sh_ten.replica_id!r})"
        )


class LocalShardsContainer(torch.Tensor):
    """Several shards of ONE global tensor held by this rank, as one DCP value.

    DCP takes one value per key per rank; a rank that holds more than one piece of a global
    tensor (e.g. non-contiguous row blocks) puts them in a container, which answers DCP's
    questions by asking each shard. Like the shards it is a wrapper with the global shape and
    no storage of its own; tensor operations on it raise ``NotImplementedError``.
    """

    _shards: tuple[CheckpointableShardedTensor, ...]

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, local_shards: list[torch.Tensor]) -> LocalShardsContainer:
        """Holds ``local_shards`` (CheckpointableShardedTensors), in the order given.

        Raises:
            ValueError: no shards, a shard that is not a CheckpointableShardedTensor,
                shards of different keys, global shapes, dtypes or devices, or two shards at
                the same offset (a load could not tell them apart).
        """
        shards = tuple(local_shards)
        if not shards:
            raise ValueError("a LocalShardsContainer needs at least one shard")
        for shard in shards:
            if not isinstance(shard, CheckpointableShardedTensor):
                raise ValueError(
                    "LocalShardsContainer holds CheckpointableShardedTensors, got "
                    f"{type(shard).__name__}; wrap ShardedTensors with "
                    "CheckpointableShardedTensor.from_sh_ten"
                )
        first = shards[0]
        seen: dict[torch.Size, int] = {}
        for i, shard in enumerate(shards):
            mine = (shard._sh_ten.key, tuple(shard.shape), shard.dtype, shard.device)
            theirs = (first._sh_ten.key, tuple(first.shape), first.dtype, first.device)
            if mine != theirs:
                raise ValueError(
                    "the shards of a LocalShardsContainer must be pieces of one global tensor: "
                    f"shard {i} is (key, global shape, dtype, device) = {mine}, shard 0 is {theirs}"
                )
            offsets = shard._chunk.offsets
            if offsets in seen:
                raise ValueError(
                    f"shards {seen[offsets]} and {i} of {first._sh_ten.key!r} are both at offset "
                    f"{tuple(offsets)}; keep one shard per box on a rank"
                )
            seen[offsets] = i
        self = torch.Tensor._make_wrapper_subclass(
            cls, first.shape, dtype=first.dtype, device=first.device, requires_grad=False
        )
        self._shards = shards
        return self

    def __init__(self, local_shards: list[torch.Tensor]) -> None:
        super().__init__()

    @property
    def local_shards(self) -> tuple[CheckpointableShardedTensor, ...]:
        """The shards, in the order given."""
        return self._shards

    def __create_write_items__(
        self, fqn: str, local_shards_cont: LocalShardsContainer
    ) -> list[WriteItem]:
        """Every shard's write items (main replicas only), each hinted with its position here.

        Args:
            fqn: the key DCP stores the global tensor under.
            local_shards_cont: the object DCP asks about (the container itself).
        """
        return [
            item
            for i, shard in enumerate(self._shards)
            for item in shard.__create_write_items__(fqn, shard, index=i)
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """Every shard's chunk, in shard order: DCP's read items then carry the shard's position
        as their index hint."""
        return [chunk for shard in self._shards for chunk in shard.__create_chunk_list__()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The tensor of the shard at ``index.offset``.

        ``index.index`` is tried first when it names a shard at that offset; otherwise (hints in
        write items are rewritten by DCP's global plan to positions in the checkpoint's chunk
        list, not in this container) the shards are searched.

        Raises:
            ValueError: ``index.offset`` is missing or no shard here starts at it.
        """
        if index.offset is None:
            raise ValueError(
                f"{index.fqn!r} is held as several shards on this rank; DCP must name the "
                "shard by its offset"
            )
        wanted = torch.Size(index.offset)
        hint = index.index
        if (
            hint is not None
            and 0 <= hint < len(self._shards)
            and self._shards[hint]._chunk.offsets == wanted
        ):
            return self._shards[hint].__get_tensor_shard__(index)
        for shard in self._shards:
            if shard._chunk.offsets == wanted:
                return shard.__get_tensor_shard__(index)
        held = [tuple(s._chunk.offsets) for s in self._shards]
        raise ValueError(
            f"{index.fqn!r}: no shard on this rank at offset {tuple(wanted)} (shards held at "
            f"{held})"
        )

    @classmethod
    def __torch_dispatch__(
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Refuses every op: the container has no values of its own, only its shards do."""
        raise NotImplementedError(
            f"{cls.__name__} does not support {func}: it only groups this rank's shards for DCP; "
            "operate on .local_shards[i].local_data instead"
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        shards = ", ".join(
            f"(offsets={tuple(s._chunk.offsets)}, sizes={tuple(s._chunk.sizes)})"
            for s in self._shards
        )
        key = self._shards[0]._sh_ten.key
        return (
            f"{type(self).__name__}(key={key!r}, global_shape={tuple(self.shape)}, "
            f"dtype={self.dtype}, device={self.device}, shards=[{shards}])"
        )


def _leaves(tree: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(dotted path, leaf) for every leaf below the dicts and lists of ``tree``, in order
    (tuples are leaves, as everywhere in :mod:`snapshot.sharding`)."""
    if isinstance(tree, Mapping):
        items: Iterable[tuple[Any, Any]] = tree.items()
    elif isinstance(tree, list):
        items = enumerate(tree)
    else:
        yield path, tree
        return
    for k, v in items:
        yield from _leaves(v, f"{path}.{k}" if path else str(k))


def to_dcp_state_dict(sharded_state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A flat state dict for ``torch.distributed.checkpoint.save`` / ``load``.

    Every :class:`ShardedTensor` below the dicts and lists of ``sharded_state_dict`` goes under
    its ``key``: a key's only shard on this rank becomes a :class:`CheckpointableShardedTensor`,
    several shards of a key become one :class:`LocalShardsContainer`. Every other leaf goes,
    unchanged, under its dotted path (``"a.b.0"``, the name DCP itself gives nested values);
    :class:`LocalNonpersistentObject` leaves are left out, since they are never saved.

    The wrappers share the shards' data, so ``dcp.load`` into the result loads into the
    ShardedTensors' own tensors; loaded non-tensor values are found in the returned dict.

    Raises:
        ValueError: two leaves would share a key; a ShardedTensor has no data; the shards of a
            key disagree on global shape, dtype or device, or two start at the same offset; or
            a leaf is a ShardedObject or ShardedTensorFactory (run
            :func:`~snapshot.sharding.mapping.apply_factories` first; sharded objects have no
            DCP form here).
    """
    shards: dict[str, list[CheckpointableShardedTensor]] = {}
    others: dict[str, Any] = {}
    for path, leaf in _leaves(sharded_state_dict, ""):
        if isinstance(leaf, ShardedTensor):
            shards.setdefault(leaf.key, []).append(CheckpointableShardedTensor.from_sh_ten(leaf))
        elif isinstance(leaf, ShardedBase):
            raise ValueError(
                f"{path!r} is a {type(leaf).__name__} ({leaf.key!r}); to_dcp_state_dict converts "
                "ShardedTensors only (build factories with apply_factories first)"
            )
        elif not isinstance(leaf, LocalNonpersistentObject):
            others[path] = leaf
    clashes = sorted(shards.keys() & others.keys())
    if clashes:
        raise ValueError(
            f"keys {clashes} name both a ShardedTensor and another value in the state dict; "
            "rename one of them"
        )
    out: dict[str, Any] = {
        key: pieces[0] if len(pieces) == 1 else LocalShardsContainer(pieces)
        for key, pieces in shards.items()
    }
    out.update(others)
    return out
