"""The tunables of one take, restore or read, as one frozen value.

An :class:`Options` is built once per call and passed down to every part of the engine that
needs a tunable; nothing below the facade reads the environment. A field left ``None`` takes
the value of its ``STATESNAP_*`` environment variable (or of a torchsnapshot ``override_*``
block open now, :mod:`snapshot.knobs`), else its default::

    Snapshot.take(path, app_state, options=Options(checksums=False, chunk_bytes=64 << 20))

``memory_budget_bytes`` and ``chunk_bytes`` have defaults that depend on the moment (the memory
available, the storage's hint): left ``None`` they stay ``None`` and :meth:`Options.budget` /
:meth:`Options.chunk` work them out where they are used.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import Field, dataclass, field, fields
from typing import Any

from snapshot.errors import InvalidArgumentError

_MIB = 1 << 20

# The ``override_*`` blocks open now, oldest first, each variable name (without STATESNAP_) ->
# value: the last block setting a name wins. Written by :mod:`snapshot.knobs`.
OVERRIDES: list[dict[str, int]] = []


def _tunable(default: int | None, minimum: int, maximum: int | None = None) -> Any:
    """A field whose ``None`` is filled in from ``STATESNAP_<FIELD IN CAPITALS>``, else from
    ``default`` (None: it depends on the moment, ``budget`` / ``chunk``); ``minimum`` (and
    ``maximum``, if any) bound both. A ``bool`` field's variable is 0 or 1; a ``float``
    field's, whole seconds."""
    return field(
        default=None, metadata={"default": default, "minimum": minimum, "maximum": maximum}
    )


@dataclass(frozen=True)
class Options:
    """Tunables of one call; each ``None`` field is filled in from the environment
    (``STATESNAP_<FIELD NAME IN CAPITALS>``) when the call starts. docs/storage.md lists
    the variables."""

    checksums: bool | None = _tunable(1, 0)
    """Record a CRC-32 of every stored range at take; verify them at restore / read."""
    digests: bool | None = _tunable(0, 0)
    """Record a 128-bit digest of each CPU tensor, so the snapshot can be an incremental base."""
    read_replicated_once: bool | None = _tunable(None, 0)
    """Restore each replicated tensor by one rank's read and a broadcast (True), or by every
    rank reading it (False); None: once unless the ranks read a local directory on one host."""
    max_concurrent_io: int | None = _tunable(16, 1)
    """Blob reads/writes in flight at once, per process."""
    memory_budget_bytes: int | None = _tunable(None, 1)
    """Staging / scratch memory per take or restore (None: a quarter of the available memory,
    within [64 MiB, 4 GiB])."""
    inline_max_bytes: int | None = _tunable(1024, 0)
    """Longest str/bytes value kept in the manifest itself."""
    write_batch_bytes: int | None = _tunable(_MIB, 1)
    """Staged bytes handed from the caller's thread to the I/O thread at a time (take)."""
    chunk_bytes: int | None = _tunable(None, 1)
    """Tensors larger than this are split into chunks (None: 128 MiB, or the store's hint)."""
    slab_threshold_bytes: int | None = _tunable(None, 0)
    """Payloads up to this size are packed into shared slabs (0: no slabs; None: 16 MiB, at
    most ``slab_bytes``, see ``slab_threshold``)."""
    slab_bytes: int | None = _tunable(32 * _MIB, 1)
    """Size a slab is filled to."""
    read_gap_bytes: int | None = _tunable(64 << 10, 0)
    """Unwanted bytes read through rather than splitting a read."""
    read_request_bytes: int | None = _tunable(32 * _MIB, 1)
    """Largest single read."""
    collective_timeout_secs: int | None = _tunable(600, 1)
    """How long a collective waits for a rank that is alive but has not arrived."""
    rank_timeout_secs: float | None = _tunable(60, 1)
    """How long a collective waits for a silent rank (no heartbeat) before RankFailedError."""
    io_retries: int | None = _tunable(4, 0)
    """Retries of a storage call that failed with a transient error."""
    io_timeout_secs: float | None = _tunable(900, 1)
    """Longest one storage call may take, its retries included."""
    keep_open_secs: float | None = _tunable(10, 0)
    """How long an expensive storage plugin (S3's) stays open after a read operation."""
    max_manifest_bytes: int | None = _tunable(1 << 30, 1)
    """Largest manifest a snapshot is opened with: nothing records the manifest's length, so
    this bounds its reads (1 GiB admits millions of entries)."""
    zstd_level: int | None = _tunable(0, 0, 22)
    """Compress each stored range with zstd at this level, 1 (fastest) to 22 (smallest; 3 is
    zstd's default); 0: store bytes as they are. Needs the ``zstandard`` package (the ``zstd``
    extra) to take, and to read what it took."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value, kind, minimum = getattr(self, f.name), _kind(f), f.metadata["minimum"]
            if value is None:
                continue
            maximum = f.metadata["maximum"]
            if kind == "bool":
                ok, what = type(value) is bool, "a bool"
            else:
                numeric = (int, float) if kind == "float" else (int,)
                ok = type(value) in numeric and minimum <= value <= (maximum or value)
                what = f"{'a number' if kind == 'float' else 'an int'} >= {minimum}"
                what += f" and <= {maximum}" if maximum is not None else ""
            if not ok:
                raise InvalidArgumentError(f"Options.{f.name} must be {what}, got {value!r}")

    @classmethod
    def from_env(cls) -> Options:
        """Every field as the environment (and any ``override_*`` block open now) sets it."""
        return cls().resolved()

    def resolved(self) -> Options:
        """These options with each ``None`` field filled in from ``STATESNAP_<NAME>`` (or the
        innermost override block setting it), else its default (the two moment-dependent ones
        only where the environment sets them)."""
        values: dict[str, bool | int | float] = {}
        for f in fields(self):
            if getattr(self, f.name) is not None:
                continue
            name, minimum = f.name.upper(), f.metadata["minimum"]
            overridden = [block[name] for block in OVERRIDES[:] if name in block]
            raw = os.environ.get(f"STATESNAP_{name}", "")
            if overridden:
                value = overridden[-1]
            elif raw == "":
                value = f.metadata["default"]
            else:
                try:
                    value = int(raw)
                except ValueError:
                    raise InvalidArgumentError(
                        f"STATESNAP_{name} must be an integer, got {raw!r}"
                    ) from None
                maximum = f.metadata["maximum"]
                if value < minimum or (maximum is not None and value > maximum):
                    most = f" and <= {maximum}" if maximum is not None else ""
                    raise InvalidArgumentError(
                        f"STATESNAP_{name} must be >= {minimum}{most}, got {value}"
                    )
            if value is not None:
                kind = _kind(f)
                values[f.name] = (
                    value != 0 if kind == "bool" else float(value) if kind == "float" else value
                )
        return dataclasses.replace(self, **values) if values else self  # type: ignore[arg-type]

    def replace(self, **changes: bool | int | float | None) -> Options:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def budget(self, reclaimable_bytes: int = 0) -> int:
        """Bytes of staging / scratch memory one take or restore may hold: the field, else a
        quarter of the memory available now (plus ``reclaimable_bytes`` the caller holds and
        may reuse), within [64 MiB, 4 GiB]."""
        if self.memory_budget_bytes is not None:
            return self.memory_budget_bytes
        available = _available_memory_bytes()
        default = 1024 * _MIB if available is None else (available + reclaimable_bytes) // 4
        return max(64 * _MIB, min(default, 4096 * _MIB))

    def slab_threshold(self, slab_bytes: int) -> int:
        """Largest payload packed into a slab: the field, else 16 MiB, at most ``slab_bytes``.
        Every blob costs a take a file (or object) and a sync, and an async take's background
        writes also hand-overs between threads, CPU time that the training loop competes with
        for the cores; so payloads up to 16 MiB share blobs. A slab costs no extra copy: a
        synchronous take writes its members over 1 MiB from their own memory, and an async take
        copies every payload into staging buffers anyway."""
        if self.slab_threshold_bytes is not None:
            return self.slab_threshold_bytes
        return min(16 * _MIB, slab_bytes)

    def chunk(self, store_hint: int | None = None) -> int:
        """Chunk size: the field, else 128 MiB, or ``store_hint`` (the storage plugin's
        ``chunk_bytes_hint``) when smaller; compressed (``zstd_level``), at most 32 MiB, the
        default ``read_request_bytes``: a restore then reads each compressed chunk whole, in
        one request, and decompresses it once."""
        if self.chunk_bytes is not None:
            return self.chunk_bytes
        most = 32 * _MIB if self.zstd_level else 128 * _MIB
        return most if store_hint is None else min(most, store_hint)


@dataclass(frozen=True)
class MemoryTier:
    """A checkpoint manager's memory tier (``CheckpointManager(root, memory_tier=...)``,
    docs/tiers.md): every save goes to a folder on this node, each rank's part is copied to
    peer ranks on other hosts, and every ``durable_every``-th save also goes to the durable
    ``root``. A restore takes the newest step complete across the tiers, each rank's part from
    its node, else a peer's replica, else durable storage, each checked by its CRC-32s first.
    A part holds each sharded value (DTensor, torch's or statesnap's ShardedTensor) as this
    rank's local pieces, so it restores only into the same layout at the same world size;
    another layout restores from ``root``.
    """

    dir: str = "/dev/shm/statesnap"
    """The node-local folder (shared memory by default; a local NVMe path works too). The
    tier lives in a folder of its own under it, named after the durable root, so another
    job's tier there is never read."""
    durable_every: int = 1
    """Every N-th save of the manager also goes to the durable root (1: every save)."""
    replicas: int = 1
    """Peer ranks on other hosts that each keep a copy of a rank's part (0: none)."""
    keep: int = 1
    """Complete steps each node keeps in the tier (the newest)."""
    budget_bytes: int | None = None
    """Bytes the tier may hold on a node: beyond it the oldest steps are dropped, never the
    newest complete one (a warning says when that one alone is over). None: no bound."""
    host: str | None = None
    """The name of this rank's host (None: ``socket.gethostname()``); ranks with the same
    name share the node-local folder and replicate to ranks with another."""

    def __post_init__(self) -> None:
        for name, least in (("durable_every", 1), ("replicas", 0), ("keep", 1)):
            value = getattr(self, name)
            if type(value) is not int or value < least:
                raise InvalidArgumentError(
                    f"MemoryTier.{name} must be an int >= {least}, got {value!r}"
                )
        if self.budget_bytes is not None and (
            type(self.budget_bytes) is not int or self.budget_bytes < 1
        ):
            raise InvalidArgumentError(
                f"MemoryTier.budget_bytes must be an int >= 1 or None, got {self.budget_bytes!r}"
            )
        if not isinstance(self.dir, str | os.PathLike) or not os.fspath(self.dir):
            raise InvalidArgumentError(f"MemoryTier.dir must be a local folder, got {self.dir!r}")
        if self.host is not None and (not isinstance(self.host, str) or not self.host):
            raise InvalidArgumentError(f"MemoryTier.host must be a name or None, got {self.host!r}")


@dataclass(frozen=True, slots=True)
class Progress:
    """Where one take or restore stands on this rank: what a ``progress`` callable given to
    :meth:`Snapshot.take <snapshot.Snapshot.take>`, ``async_take`` or ``restore`` is called
    with, once before the first byte (nothing done, the totals known) and again each time an
    item's bytes complete. ``done_bytes`` and ``done_items`` only grow; the last record of an
    operation that succeeds has them equal to the totals.

    Each rank counts its own bytes: an item is a blob this rank writes (take), or one read of
    a range of a blob (restore: it may hold several entries, and the bytes between them);
    bytes another rank reads for this one and broadcasts are not counted.
    """

    #: ``"take"`` or ``"restore"``.
    operation: str
    #: The snapshot's location, as messages name it.
    path: str
    #: This process's rank in the operation's process group (0 for a process alone).
    rank: int
    #: Bytes this rank has written (take) or read (restore) so far.
    done_bytes: int
    #: Bytes this rank writes or reads in all.
    total_bytes: int
    #: Items (blobs written, or reads) complete so far.
    done_items: int
    #: Items in all.
    total_items: int


def _kind(f: Field[Any]) -> str:
    """A field's type: ``"bool"``, ``"int"`` or ``"float"`` (its annotation, ``"int | None"``)."""
    return str(f.type).split(" ")[0]


def _available_memory_bytes() -> int | None:
    """Linux's MemAvailable (free memory plus the page cache it can drop: a snapshot just
    written sits there and must not shrink the next one's budget), else the free pages."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        pages, page_size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return pages * page_size if pages > 0 and page_size > 0 else None


def resolve(options: Options | None) -> Options:
    """The options a call runs with: ``options`` (or none given) filled in from the
    environment. Raises :class:`InvalidArgumentError` for anything else than an Options."""
    if not isinstance(options, Options | None):
        raise InvalidArgumentError(
            f"options must be a snapshot.Options, got {type(options).__name__}"
        )
    return (options or Options()).resolved()
