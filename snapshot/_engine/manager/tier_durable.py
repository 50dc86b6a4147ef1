"""The memory tier and durable storage: a durable step written from the tier's copy of each
rank's part, and one rank's part of a durable step restored alone (docs/tiers.md).

Writing. A durable step is an ordinary group take at the root, run on the tier's worker
thread, of a state read back from the rank's part in its node's tier (``held``): each
app_state value replaced by one whose ``state_dict()`` is what the part holds under its key,
read into new CPU tensors (every range checked against the CRC-32 the part recorded). The
take sees the same tree of containers and leaves the live ``state_dict()`` gave at the memory
save, so the snapshot it commits is the one a take of the live state would have committed
(entries, replicated leaves found across ranks by their bytes, blob layout), with the take's
own commit protocol: pending marker first, the manifest last, written only once every rank's
writes are durable, nothing of an earlier step touched. Copying the parts' blobs and merging
their manifests would be the other way; it would have to redo what the take's planner and
agreements decide (which leaves are one value for all ranks, who writes them, the entries'
layout), so the take is reused instead. A part holds sharded values as local pieces
(``tier_parts``): what puts each back around its piece read back (a DTensor's mesh,
placements, global shape and stride; our ShardedTensor's description) is taken at the memory
save, on the caller's thread, and kept in memory, so the take sees the DTensors the live
``state_dict()`` gave. A take of a DTensor reads only its local piece and its layout (no
collective on its mesh's groups, which are the training's); torch's ShardedTensor is put back
from its shards' and its global metadata. A part holding a ``ShardedTensorFactory``'s values,
or a torch ShardedTensor placed off the CPU, is not rebuilt: such a durable step is taken from
the live state.

Restoring. ``restore_rank`` restores one rank's view of a committed group snapshot (its own
entries, the replicated ones, any region of a sharded one) as a process alone, through the
usual restore: the tier's fallback for a part that no memory holds valid.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from snapshot._engine.dist.dist import Coordinator
from snapshot._engine.format import serialization as writers
from snapshot._engine.format.manifest_io import decode_manifest, read_manifest
from snapshot._engine.manager import tier_parts
from snapshot._engine.restore.restore import restore as restore_app_state
from snapshot.errors import SnapshotError
from snapshot.options import Options
from snapshot.stateful import RNGState


class Held:
    """An app_state value as its tier part holds it: its ``state_dict()`` is the part's."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        raise SnapshotError("a state read back from a memory tier part is never restored into")


class HeldRNG(RNGState):
    """An ``RNGState`` as the part holds it: an RNGState still, so a take orders it last."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state_dict: Any) -> None:
        Held.load_state_dict(self, state_dict)  # type: ignore[arg-type]


def kinds(app_state: Mapping[str, Any]) -> dict[str, bool]:
    """Each app_state key and whether its value is an ``RNGState`` (taken at the save, on the
    caller's thread: the worker reads the part later)."""
    return {k: isinstance(v, RNGState) for k, v in app_state.items()}


def held(
    keys: Mapping[str, bool], read: Callable[[str], Any], sharded: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The app_state of ``keys`` (``kinds``) read back from a part: ``read(key)`` gives the
    state dict the part holds under ``key``, its sharded values put back around their local
    pieces by ``sharded[key]`` (``tier_parts.rebuilders``, taken at the save)."""
    sharded = sharded or {}

    def state(k: str) -> Any:
        return tier_parts.rebuilt(read(k), sharded[k]) if k in sharded else read(k)

    return {k: (HeldRNG if rng else Held)(state(k)) for k, rng in keys.items()}


def writer(
    facade: Any, path: str, app_state: Mapping[str, Any], options: Options, take: dict[str, Any]
) -> Callable[[str, Any, Any], None]:
    """The durable write of a step at ``path`` from a part (``Tier.write_durable``'s
    ``write``): the part read back and taken with ``facade.take`` (``Snapshot``'s) and the
    keyword arguments ``take``, on the group it is given, its sharded values rebuilt by
    ``sharded`` (``held``)."""
    keys = kinds(app_state)

    def write(part: str, pg: Any, sharded: Mapping[str, Any] | None = None) -> None:
        read = facade(part, options=options).get_state_dict_for_key
        facade.take(path, held(keys, read, sharded), **{**take, "pg": pg})

    return write


class AsRank(Coordinator):
    """Rank ``rank`` of a group snapshot restoring alone: its view of the entries, and
    collectives that return its own value."""

    def __init__(self, rank: int) -> None:
        self.rank = rank


def restore_rank(
    path: str,
    app_state: dict[str, Any],
    rank: int,
    storage_options: dict[str, Any] | None,
    options: Options,
) -> None:
    """Restores ``app_state`` from what rank ``rank`` restores of the committed snapshot at
    ``path`` (a restore on the snapshot's ranks), this process alone; every range checked."""
    found, where = read_manifest(path, storage_options, options)
    manifest = decode_manifest(found, where, verify=False) if isinstance(found, bytes) else found
    writers.check_readable(manifest.metadata, path)
    restore_app_state(
        manifest,
        app_state,
        path=path,
        coordinator=AsRank(rank),
        storage_options=storage_options,
        options=options,
    )
