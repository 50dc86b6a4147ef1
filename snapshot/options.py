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
from dataclasses import dataclass, fields

from snapshot.errors import InvalidArgumentError

_MIB = 1 << 20

# Field -> (default, minimum); the environment variable is STATESNAP_<FIELD IN CAPITALS>.
# None: the default depends on the moment (``budget``, ``chunk``) or on the store.
_FIELDS: dict[str, tuple[int | None, int]] = {
    "checksums": (1, 0),
    "digests": (0, 0),
    "read_replicated_once": (None, 0),
    "max_concurrent_io": (16, 1),
    "memory_budget_bytes": (None, 1),
    "inline_max_bytes": (1024, 0),
    "write_batch_bytes": (_MIB, 1),
    "chunk_bytes": (None, 1),
    "slab_threshold_bytes": (_MIB, 0),
    "slab_bytes": (32 * _MIB, 1),
    "read_gap_bytes": (64 << 10, 0),
    "read_request_bytes": (32 * _MIB, 1),
    "collective_timeout_secs": (600, 1),
    "rank_timeout_secs": (60, 1),
    "io_retries": (4, 0),
    "io_timeout_secs": (900, 1),
    "keep_open_secs": (10, 0),
    "max_manifest_bytes": (1 << 30, 1),
}
_FLAGS = frozenset({"checksums", "digests", "read_replicated_once"})
_SECONDS = frozenset({"io_timeout_secs", "keep_open_secs", "rank_timeout_secs"})

# Variable name (without STATESNAP_) -> the values of the ``override_*`` blocks open now, each
# with its block's token, oldest first: the last one wins. Written by :mod:`snapshot.knobs`.
OVERRIDES: dict[str, tuple[tuple[object, int], ...]] = {}


def env_int(name: str, default: int | None, minimum: int) -> int | None:
    """``STATESNAP_<name>`` (or the innermost override block setting it), else ``default``."""
    overridden = OVERRIDES.get(name)
    if overridden:
        return overridden[-1][1]
    raw = os.environ.get(f"STATESNAP_{name}", "")
    if raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidArgumentError(f"STATESNAP_{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise InvalidArgumentError(f"STATESNAP_{name} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class Options:
    """Tunables of one call; each ``None`` field is filled in from the environment
    (``STATESNAP_<FIELD NAME IN CAPITALS>``) when the call starts. See the README's table for
    what each does."""

    #: Record a CRC-32 of every stored range at take; verify them at restore / read.
    checksums: bool | None = None
    #: Record a 128-bit digest of each CPU tensor, so the snapshot can be an incremental base.
    digests: bool | None = None
    #: Restore each replicated tensor by one rank's read and a broadcast (True), or by every
    #: rank reading it (False); None: once unless the ranks read a local directory on one host.
    read_replicated_once: bool | None = None
    #: Blob reads/writes in flight at once, per process.
    max_concurrent_io: int | None = None
    #: Staging / scratch memory per take or restore (None: a quarter of the available memory,
    #: within [64 MiB, 4 GiB]).
    memory_budget_bytes: int | None = None
    #: Longest str/bytes value kept in the manifest itself.
    inline_max_bytes: int | None = None
    #: Staged bytes handed from the caller's thread to the I/O thread at a time (take).
    write_batch_bytes: int | None = None
    #: Tensors larger than this are split into chunks (None: 128 MiB, or the store's hint).
    chunk_bytes: int | None = None
    #: Payloads up to this size are packed into shared slabs (0: no slabs).
    slab_threshold_bytes: int | None = None
    #: Size a slab is filled to.
    slab_bytes: int | None = None
    #: Unwanted bytes read through rather than splitting a read.
    read_gap_bytes: int | None = None
    #: Largest single read.
    read_request_bytes: int | None = None
    #: How long a collective waits for a rank that is alive but has not arrived.
    collective_timeout_secs: int | None = None
    #: How long a collective waits for a silent rank (no heartbeat) before RankFailedError.
    rank_timeout_secs: float | None = None
    #: Retries of a storage call that failed with a transient error.
    io_retries: int | None = None
    #: Longest one storage call may take, its retries included.
    io_timeout_secs: float | None = None
    #: How long an expensive storage plugin (S3's) stays open after a read operation.
    keep_open_secs: float | None = None
    #: Largest manifest a snapshot is opened with: nothing records the manifest's length, so
    #: this bounds its reads (1 GiB admits millions of entries).
    max_manifest_bytes: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name in _FLAGS:
                if type(value) is not bool:
                    raise InvalidArgumentError(f"Options.{f.name} must be a bool, got {value!r}")
                continue
            minimum = _FIELDS[f.name][1]
            numeric = (int, float) if f.name in _SECONDS else (int,)
            if type(value) not in numeric or value < minimum:
                kind = "a number" if f.name in _SECONDS else "an int"
                raise InvalidArgumentError(
                    f"Options.{f.name} must be {kind} >= {minimum}, got {value!r}"
                )

    @classmethod
    def from_env(cls) -> Options:
        """Every field as the environment (and any ``override_*`` block open now) sets it."""
        return cls().resolved()

    def resolved(self) -> Options:
        """These options with each ``None`` field filled in from the environment (the two
        moment-dependent ones only where the environment sets them)."""
        values: dict[str, bool | int | float | None] = {}
        for name, (default, minimum) in _FIELDS.items():
            if getattr(self, name) is not None:
                continue
            value = env_int(name.upper(), default, minimum)
            if value is not None and name in _FLAGS:
                values[name] = value != 0
            elif value is not None and name in _SECONDS:
                values[name] = float(value)
            else:
                values[name] = value
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

    def chunk(self, store_hint: int | None = None) -> int:
        """Chunk size: the field, else 128 MiB, or the storage plugin's hint when smaller."""
        if self.chunk_bytes is not None:
            return self.chunk_bytes
        return 128 * _MIB if store_hint is None else min(128 * _MIB, store_hint)


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
    if options is None:
        return Options.from_env()
    if not isinstance(options, Options):
        raise InvalidArgumentError(
            f"options must be a snapshot.Options, got {type(options).__name__}"
        )
    return options.resolved()
