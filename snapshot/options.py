"""The tunables of one take, restore or read, as one frozen value.

An :class:`Options` is built once per call and passed down to every part of the engine that
needs a tunable; nothing below the facade reads the environment. A field left ``None`` takes
the value of its ``STATESNAP_*`` environment variable (or of a torchsnapshot ``override_*``
block open now, see :mod:`snapshot.knobs`), else its default, when the call starts::

    from snapshot import Options, Snapshot

    Snapshot.take(path, app_state, options=Options(checksums=False, chunk_bytes=64 << 20))

Two fields have defaults that depend on the moment: ``memory_budget_bytes`` (a quarter of the
memory available when a take or restore starts, see :meth:`Options.budget`) and
``chunk_bytes`` (smaller where the storage asks for it, see :meth:`Options.chunk`); left
``None`` they stay ``None`` and are worked out where they are used.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

from snapshot import knobs
from snapshot.errors import InvalidArgumentError

# Field -> (environment variable without STATESNAP_, default, minimum). The two fields whose
# default depends on the moment are not listed: ``budget`` and ``chunk`` resolve them.
_FROM_ENV: dict[str, tuple[str, int, int]] = {
    "max_concurrent_io": ("MAX_CONCURRENT_IO", 16, 1),
    "inline_max_bytes": ("INLINE_MAX_BYTES", 1024, 0),
    "write_batch_bytes": ("WRITE_BATCH_BYTES", 1 << 20, 1),
    "slab_threshold_bytes": ("SLAB_THRESHOLD_BYTES", 1 << 20, 0),
    "slab_bytes": ("SLAB_BYTES", 32 << 20, 1),
    "read_gap_bytes": ("READ_GAP_BYTES", 64 << 10, 0),
    "read_request_bytes": ("READ_REQUEST_BYTES", 32 << 20, 1),
    "collective_timeout_secs": ("COLLECTIVE_TIMEOUT_SECS", 600, 1),
    "rank_timeout_secs": ("RANK_TIMEOUT_SECS", 60, 1),
    "io_retries": ("IO_RETRIES", 4, 0),
    "io_timeout_secs": ("IO_TIMEOUT_SECS", 900, 1),
    "keep_open_secs": ("KEEP_OPEN_SECS", 10, 0),
    "max_manifest_bytes": ("MAX_MANIFEST_BYTES", 1 << 30, 1),
}
# Fields that may be given as a float (seconds).
_SECONDS = frozenset({"io_timeout_secs", "keep_open_secs", "rank_timeout_secs"})


@dataclass(frozen=True)
class Options:
    """Tunables of one call; each ``None`` field is filled in from the environment
    (``STATESNAP_<FIELD NAME IN CAPITALS>``) when the call starts. See the README's table for
    what each does."""

    #: Record a CRC-32 of every stored range at take; verify them at restore / read.
    checksums: bool | None = None
    #: Record a digest (XXH3, 128 bits) of each CPU tensor's bytes at take, so that the snapshot
    #: can be the ``base`` of an incremental take. A take on a base records them whatever this
    #: says (its own later increments compare with them).
    digests: bool | None = None
    #: Restore each replicated tensor by one rank's read and a broadcast to the others (True),
    #: or by every rank reading it (False); None: once where the ranks read from anything but
    #: a local directory or span several hosts.
    read_replicated_once: bool | None = None
    #: Blob reads/writes in flight at once, per process.
    max_concurrent_io: int | None = None
    #: Staging / scratch memory one take or restore may hold at once, per process
    #: (None: a quarter of the memory available, within [64 MiB, 4 GiB]).
    memory_budget_bytes: int | None = None
    #: Longest str/bytes value kept in the manifest itself.
    inline_max_bytes: int | None = None
    #: Staged bytes handed from the caller's thread to the I/O thread at a time (take).
    write_batch_bytes: int | None = None
    #: Tensors larger than this are split into chunks (None: 128 MiB, or less where the
    #: storage plugin hints so).
    chunk_bytes: int | None = None
    #: Payloads up to this size are packed into shared slabs (0: no slabs).
    slab_threshold_bytes: int | None = None
    #: Size a slab is filled to.
    slab_bytes: int | None = None
    #: Unwanted bytes read through rather than splitting a read.
    read_gap_bytes: int | None = None
    #: Largest single read.
    read_request_bytes: int | None = None
    #: How long a rank waits in the library's collectives for a rank that is alive (its
    #: heartbeat moves) but has not arrived.
    collective_timeout_secs: int | None = None
    #: How long a rank waits in the library's collectives for a rank that fell silent (no
    #: heartbeat: its process frozen, or its host unreachable) before it raises
    #: RankFailedError naming it; a rank whose process ended is found at once.
    rank_timeout_secs: float | None = None
    #: Retries of a storage call that failed with a transient error.
    io_retries: int | None = None
    #: Longest one storage call may take, its retries included.
    io_timeout_secs: float | None = None
    #: How long an expensive storage plugin (S3's) stays open after a read operation.
    keep_open_secs: float | None = None
    #: Largest manifest a snapshot is opened with: a larger one is refused before it is read,
    #: or as soon as a read passes the limit (a store's reported length may be wrong).
    # The manifest is the one file whose length nothing records, so its reads are bounded by
    # this alone. An entry takes one line of a few hundred bytes at most, so the default
    # (1 GiB) admits millions of entries while still ending a read of an endless or enormous
    # file long before it exhausts a machine's memory.
    max_manifest_bytes: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name in ("checksums", "digests", "read_replicated_once"):
                if type(value) is not bool:
                    raise InvalidArgumentError(f"Options.{f.name} must be a bool, got {value!r}")
                continue
            minimum = (
                1 if f.name in ("memory_budget_bytes", "chunk_bytes") else _FROM_ENV[f.name][2]
            )
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
        """These options with each ``None`` field filled in from the environment, except the
        two whose default depends on the moment (``budget``, ``chunk``) unless the environment
        sets them."""
        values: dict[str, object] = {}
        if self.checksums is None:
            values["checksums"] = knobs.env_int("CHECKSUMS", 1, 0) != 0
        if self.digests is None:
            values["digests"] = knobs.env_int("DIGESTS", 0, 0) != 0
        if self.read_replicated_once is None:
            once = knobs.env_int("READ_REPLICATED_ONCE", None, 0)
            if once is not None:
                values["read_replicated_once"] = once != 0
        for name, (env, default, minimum) in _FROM_ENV.items():
            if getattr(self, name) is None:
                value = knobs.env_int(env, default, minimum)
                values[name] = float(value) if name in _SECONDS else value
        if self.memory_budget_bytes is None:
            values["memory_budget_bytes"] = knobs.env_int("MEMORY_BUDGET_BYTES", None, 1)
        if self.chunk_bytes is None:
            values["chunk_bytes"] = knobs.env_int("CHUNK_BYTES", None, 1)
        return dataclasses.replace(self, **values) if values else self

    def replace(self, **changes: object) -> Options:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def budget(self, reclaimable_bytes: int = 0) -> int:
        """Bytes of staging / scratch memory one take or restore may hold: the field, else a
        quarter of the memory available now (counting ``reclaimable_bytes`` the caller holds
        and may reuse, such as the staging pool's free blocks), within [64 MiB, 4 GiB]."""
        if self.memory_budget_bytes is not None:
            return self.memory_budget_bytes
        return knobs.default_memory_budget(reclaimable_bytes)

    def chunk(self, store_hint: int | None = None) -> int:
        """Chunk size: the field, else 128 MiB, or the storage plugin's hint when smaller."""
        if self.chunk_bytes is not None:
            return self.chunk_bytes
        return 128 << 20 if store_hint is None else min(128 << 20, store_hint)


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
