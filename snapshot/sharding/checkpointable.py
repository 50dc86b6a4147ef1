"""ShardedTensors as torch.distributed.checkpoint (DCP) values: save and load them with DCP.

DCP asks a state-dict value three questions (the ``_Checkpointable`` protocol,
``torch/distributed/_checkpointable.py``): ``__create_write_items__`` (the chunks a rank writes),
``__create_chunk_list__`` (the chunks it wants loaded; DCP intersects them with the stored ones,
so shardings may differ) and ``__get_tensor_shard__`` (the tensor to read bytes from or copy
them into: a view of the local data, so loading is in place). The wrappers here answer them for
:class:`~snapshot.sharding.mapping.ShardedTensor`. They report the GLOBAL shape, as DCP checks
it, while the bytes they hand out are the local shard's. ``dcp.async_save`` stages copies of
every value (``new_empty``), which the wrappers refuse: it is not supported.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
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
    _leaves,
    is_main_replica,
)

__all__ = ["CheckpointableShardedTensor", "LocalShardsContainer", "to_dcp_state_dict"]

_aten = torch.ops.aten


class _Wrapper(torch.Tensor):
    """A tensor subclass with a global shape and no storage: every torch function goes to
    ``__torch_dispatch__``, which allows a few ops and refuses the rest."""

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})

    def __repr__(  # type: ignore[override]  # the same signature as torch's
        self, *, tensor_contents: Any = None
    ) -> str:
        return (
            f"{type(self).__name__}({self._describe()}, dtype={self.dtype}, device={self.device})"
        )

    def _describe(self) -> str:
        return ""

    def _pieces(self) -> tuple[CheckpointableShardedTensor, ...]:
        """The shards this value stands for: itself, or a container's."""
        return (self,)  # type: ignore[return-value]  # a container overrides this

    def __create_write_items__(
        self, fqn: str, value: _Wrapper, index: int | None = None
    ) -> list[WriteItem]:
        """One ``SHARD`` write item at each shard's offset where this rank holds the main
        replica, none for the other replicas. ``value`` is the value itself. The item's lookup
        hint is ``index`` for a lone shard, the shard's position in a container."""
        lone = isinstance(self, CheckpointableShardedTensor)
        return [
            WriteItem(
                index=MetadataIndex(fqn, shard._chunk.offsets, index if lone else i),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=shard.chunk,
                    properties=TensorProperties.create_from_tensor(shard._data),
                    size=torch.Size(shard._sh_ten.global_shape),
                ),
            )
            for i, shard in enumerate(self._pieces())
            if is_main_replica(shard._sh_ten.replica_id)
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """The boxes this rank wants loaded, in shard order, on every replica (all of them
        load; DCP's read items carry a box's position as their hint)."""
        return [shard.chunk for shard in self._pieces()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        """The tensor DCP reads bytes from or copies bytes into: a view of the data of the
        shard at ``index.offset``, found by the offset alone (DCP's global plan may have
        rewritten the hint ``index.index``); a lone shard answers for no offset too."""
        shards = self._pieces()
        if index.offset is None:
            if isinstance(self, CheckpointableShardedTensor):
                return self._dcp_view()
            raise ValueError(
                f"{index.fqn!r} is held as several shards on this rank; DCP must name the "
                "shard by its offset"
            )
        wanted = torch.Size(index.offset)
        for shard in shards:
            if shard._chunk.offsets == wanted:
                return shard._dcp_view()
        held = ", ".join(str(tuple(s._chunk.offsets)) for s in shards)
        raise ValueError(
            f"{index.fqn!r}: no shard on this rank at offset {tuple(wanted)}, the offset DCP "
            f"asked for; this rank holds {'the one' if len(shards) == 1 else 'shards'} at {held}"
        )


class CheckpointableShardedTensor(_Wrapper):
    """One rank's shard of a global tensor, in a form DCP saves and loads.

    It has the global shape and its data's dtype and device; the values stay in ``local_data``
    (shared, not copied), so loading writes into that tensor. Only the main replica writes;
    every replica loads. Prepended axes are absent from the data: DCP sees a size-1 axis for
    each, on a view of the data. Of tensor ops, only ``detach``/``alias``/``clone`` (a new
    wrapper over the op's result on the data) and ``copy_`` into the wrapper (from a wrapper of
    the same box, or a tensor of the global shape) are supported.
    """

    _data: torch.Tensor
    _sh_ten: ShardedTensor
    _chunk: ChunkStorageMetadata

    @staticmethod
    def __new__(cls, data: torch.Tensor, sh_ten: ShardedTensor) -> CheckpointableShardedTensor:
        """Wraps ``data`` described by ``sh_ten`` (``ValueError`` where they disagree: ``data``
        may have been passed separately, or swapped in since ``sh_ten`` was built)."""
        if not isinstance(data, torch.Tensor):
            raise ValueError(
                f"ShardedTensor {sh_ten.key!r} has no data tensor (got {type(data).__name__}); "
                "DCP needs the local shard's values to save and a tensor to load into"
            )
        dataclasses.replace(sh_ten, data=data)  # a description of ``data``: it validates itself
        offsets, sizes = sh_ten.global_region()
        self = torch.Tensor._make_wrapper_subclass(
            cls,
            torch.Size(sh_ten.global_shape),
            dtype=data.dtype,
            device=data.device,
            requires_grad=False,
        )
        self._data = data
        self._sh_ten = sh_ten
        self._chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        return self

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
    def chunk(self) -> ChunkStorageMetadata:  # type: ignore[override]  # shadows Tensor.chunk
        """The global box of this shard: offsets and sizes in the global tensor's axes."""
        return ChunkStorageMetadata(offsets=self._chunk.offsets, sizes=self._chunk.sizes)

    def _dcp_view(self) -> torch.Tensor:
        """The data with a size-1 axis per prepended axis: the chunk's shape, sharing storage."""
        return self._data[(None,) * self._sh_ten.prepend_axis_num]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch's stub binds func as self
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
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
        """Copies ``src`` (a wrapper of the same box, or a full global tensor) into the data (a
        LocalShardsContainer refuses to be narrowed to the box)."""
        if isinstance(src, CheckpointableShardedTensor):
            if src._chunk != self._chunk:
                raise ValueError(
                    f"cannot copy shard {src._sh_ten.key!r} at {tuple(src._chunk.offsets)} (sizes "
                    f"{tuple(src._chunk.sizes)}) into shard {self._sh_ten.key!r} at "
                    f"{tuple(self._chunk.offsets)} (sizes {tuple(self._chunk.sizes)})"
                )
            self._data.copy_(src._data, non_blocking=non_blocking)
            return
        if src.shape != self.shape:
            raise ValueError(
                f"copy_ into shard {self._sh_ten.key!r} needs a tensor of the global shape "
                f"{tuple(self.shape)}, got {tuple(src.shape)}"
            )
        self._dcp_view().copy_(src[self._sh_ten.global_slice()], non_blocking=non_blocking)

    def _describe(self) -> str:
        return (
            f"key={self._sh_ten.key!r}, global_shape={tuple(self.shape)}, "
            f"offsets={tuple(self._chunk.offsets)}, sizes={tuple(self._chunk.sizes)}, "
            f"replica_id={self._sh_ten.replica_id!r}"
        )


class LocalShardsContainer(_Wrapper):
    """Several shards of ONE global tensor held by this rank, as one DCP value (DCP takes one
    value per key per rank): it answers DCP by asking each shard. No tensor op is supported.
    """

    _shards: tuple[CheckpointableShardedTensor, ...]

    @staticmethod
    def __new__(cls, local_shards: Sequence[torch.Tensor]) -> LocalShardsContainer:
        """Holds ``local_shards`` in the order given. ``ValueError``: none, one that is not a
        CheckpointableShardedTensor, pieces of different tensors, or two at one offset."""
        if not local_shards:
            raise ValueError("a LocalShardsContainer needs at least one shard")
        shards: list[CheckpointableShardedTensor] = []
        seen: dict[torch.Size, int] = {}
        for i, shard in enumerate(local_shards):
            if not isinstance(shard, CheckpointableShardedTensor):
                raise ValueError(
                    "LocalShardsContainer holds CheckpointableShardedTensors, got "
                    f"{type(shard).__name__}; wrap ShardedTensors with "
                    "CheckpointableShardedTensor.from_sh_ten"
                )
            shards.append(shard)
            first = shards[0]
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
        self._shards = tuple(shards)
        return self

    @property
    def local_shards(self) -> tuple[CheckpointableShardedTensor, ...]:
        """The shards, in the order given."""
        return self._shards

    def _pieces(self) -> tuple[CheckpointableShardedTensor, ...]:
        return self._shards

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch's stub binds func as self
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        raise NotImplementedError(
            f"{cls.__name__} does not support {func}: it only groups this rank's shards for DCP; "
            "operate on .local_shards[i].local_data instead"
        )

    def _describe(self) -> str:
        shards = ", ".join(
            f"(offsets={tuple(s._chunk.offsets)}, sizes={tuple(s._chunk.sizes)})"
            for s in self._shards
        )
        key = self._shards[0]._sh_ten.key
        return f"key={key!r}, global_shape={tuple(self.shape)}, shards=[{shards}]"


def to_dcp_state_dict(sharded_state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A flat state dict for ``torch.distributed.checkpoint.save`` / ``load``.

    Each :class:`ShardedTensor` goes under its ``key`` (a :class:`CheckpointableShardedTensor`,
    or a :class:`LocalShardsContainer` for several shards of a key), sharing its data, so
    ``dcp.load`` loads in place. Other leaves go under their dotted path (``"a.b.0"``, DCP's
    own name for nested values); :class:`LocalNonpersistentObject` leaves are left out.
    ``ValueError``: two leaves would share a key, shards disagree, or a leaf is a
    ShardedObject or ShardedTensorFactory (run ``apply_factories`` first).
    """
    shards: dict[str, list[CheckpointableShardedTensor]] = {}
    others: dict[str, Any] = {}
    for names, leaf in _leaves(dict(sharded_state_dict)):
        path = ".".join(map(str, names))
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
