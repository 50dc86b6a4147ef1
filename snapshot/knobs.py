"""Tunables, each overridable by an environment variable of the same name prefixed STATESNAP_,
and some, within a ``with`` block, by torchsnapshot's ``override_*`` context managers (below)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager

from snapshot.errors import InvalidArgumentError

_MIB = 1 << 20

# Knob name (without STATESNAP_) -> the values of the override blocks open now, in the order
# they were entered, each with its block's token. The last one is the knob's value. A tuple
# replaced whole under the lock, so readers (``env_int``, on any thread) take no lock.
_overrides: dict[str, tuple[tuple[object, int], ...]] = {}
_overrides_lock = threading.Lock()


def env_int(name: str, default: int | None, minimum: int) -> int | None:
    """The value of ``STATESNAP_<name>`` (or of the innermost ``override_*`` block open now
    that sets it), else ``default``; raises :class:`InvalidArgumentError` for a value that is
    not an integer of at least ``minimum``."""
    overridden = _overrides.get(name)
    if overridden:
        return overridden[-1][1]
    raw = os.environ.get(f"STATESNAP_{name}")
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidArgumentError(f"STATESNAP_{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise InvalidArgumentError(f"STATESNAP_{name} must be >= {minimum}, got {value}")
    return value


def _available_memory_bytes() -> int | None:
    """Memory the system can give without swapping: Linux's MemAvailable (free memory plus
    the page cache it can drop; a snapshot just written sits in the page cache, and must not
    shrink the next one's budget), else the free pages."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        pages = os.sysconf("SC_AVPHYS_PAGES")
        page_size = os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return pages * page_size if pages > 0 and page_size > 0 else None


def checksums() -> bool:
    """Whether take records a CRC-32 of every stored range (and of the manifest), and restore
    and read_object verify what they read against them (STATESNAP_CHECKSUMS, default 1; 0 turns
    both off: a take then records none, and reads check none, not even a snapshot's that has
    them)."""
    return env_int("CHECKSUMS", 1, 0) != 0


def max_concurrent_io() -> int:
    """Blob reads/writes in flight at once (STATESNAP_MAX_CONCURRENT_IO, default 16)."""
    return env_int("MAX_CONCURRENT_IO", 16, 1)


def default_memory_budget(reclaimable_bytes: int = 0) -> int:
    """A quarter of the memory available now (plus ``reclaimable_bytes``), within
    [64 MiB, 4 GiB]: the staging budget when none is set."""
    available = _available_memory_bytes()
    default = 1024 * _MIB if available is None else (available + reclaimable_bytes) // 4
    return max(64 * _MIB, min(default, 4096 * _MIB))


def memory_budget_bytes(reclaimable_bytes: int = 0) -> int:
    """STATESNAP_MEMORY_BUDGET_BYTES, else ``default_memory_budget``."""
    value = env_int("MEMORY_BUDGET_BYTES", None, 1)
    return default_memory_budget(reclaimable_bytes) if value is None else value


def inline_max_bytes() -> int:
    """str/bytes values up to this size live in the manifest; longer ones get a blob of their own
    (STATESNAP_INLINE_MAX_BYTES, default 1024)."""
    return env_int("INLINE_MAX_BYTES", 1024, 0)


def write_batch_bytes() -> int:
    """Staged bytes handed from the caller's thread to the I/O loop at a time
    (STATESNAP_WRITE_BATCH_BYTES, default 1 MiB: each slab or chunk as soon as it is staged,
    smaller writes grouped). Take only: async take holds its writes until its call returns."""
    return env_int("WRITE_BATCH_BYTES", _MIB, 1)


def chunk_bytes(store_hint: int | None = None) -> int:
    """Tensors larger than this are split into chunks of about this size, each its own blob,
    written and read concurrently (STATESNAP_CHUNK_BYTES; default 128 MiB, or the storage
    plugin's ``chunk_bytes_hint`` when that is smaller)."""
    default = 128 * _MIB if store_hint is None else min(128 * _MIB, store_hint)
    return env_int("CHUNK_BYTES", default, 1)


def slab_threshold_bytes() -> int:
    """Payloads up to this size are packed into shared slab blobs
    (STATESNAP_SLAB_THRESHOLD_BYTES, default 1 MiB; 0 turns slabs off)."""
    return env_int("SLAB_THRESHOLD_BYTES", _MIB, 0)


def slab_bytes() -> int:
    """Size a slab is filled to before another is started (STATESNAP_SLAB_BYTES, default 32 MiB)."""
    return env_int("SLAB_BYTES", 32 * _MIB, 1)


def read_gap_bytes() -> int:
    """Unwanted bytes between two wanted ranges of a blob that are read (and dropped) rather than
    asked for separately (STATESNAP_READ_GAP_BYTES, default 64 KiB)."""
    return env_int("READ_GAP_BYTES", 64 * 1024, 0)


def read_request_bytes() -> int:
    """Largest single read: merged ranges and pieces of one large tensor stop growing here
    (STATESNAP_READ_REQUEST_BYTES, default 32 MiB)."""
    return env_int("READ_REQUEST_BYTES", 32 * _MIB, 1)


def collective_timeout_secs() -> int:
    """How long a rank waits in one of the library's own collectives for the others (on the gloo
    group it creates when the caller's group is not gloo) before failing
    (STATESNAP_COLLECTIVE_TIMEOUT_SECS, default 600)."""
    return env_int("COLLECTIVE_TIMEOUT_SECS", 600, 1)


def io_retries() -> int:
    """How many times a storage call that failed with a transient error (a timeout, a dropped
    connection, "busy, try again": see ``StoragePlugin.is_transient``) is made again, with
    exponential backoff from 50 ms up to 2 s, before the operation fails
    (STATESNAP_IO_RETRIES, default 4; 0 disables retries)."""
    return env_int("IO_RETRIES", 4, 0)


def io_timeout_secs() -> float:
    """Longest one storage call may take, its retries included, before the operation fails with
    an error naming the blob: a stalled upload must not hang a training job
    (STATESNAP_IO_TIMEOUT_SECS, default 900)."""
    return float(env_int("IO_TIMEOUT_SECS", 900, 1))


def keep_open_secs() -> float:
    """How long a storage plugin that is expensive to make (``StoragePlugin.keep_open``: S3's)
    stays open after a read operation, for the next one on the same path with the same storage
    options: ``Snapshot(path)`` then ``restore``, or one ``read_object`` after another
    (STATESNAP_KEEP_OPEN_SECS, default 10; 0 closes it at once)."""
    return float(env_int("KEEP_OPEN_SECS", 10, 0))


def max_manifest_bytes() -> int:
    """Largest manifest a snapshot is opened with (STATESNAP_MAX_MANIFEST_BYTES, default
    1 GiB): a larger one is refused before it is read, or as soon as a read passes the limit
    (a store's reported length may be wrong), so that a hostile or damaged snapshot cannot make
    opening it read without end. Raise it to open a snapshot with a larger manifest."""
    # The manifest is the one file whose length nothing records, so its reads are bounded by
    # this alone. An entry takes one line of a few hundred bytes at most, so the default
    # admits millions of entries, far more than any state dict holds, while still ending a
    # read of an endless or enormous file long before it exhausts a machine's memory.
    return env_int("MAX_MANIFEST_BYTES", 1 << 30, 1)


# -- torchsnapshot's overrides ------------------------------------------------------------------


@contextlib.contextmanager
def _override(values: dict[str, int]) -> Iterator[None]:
    """Within the block, each knob of ``values`` (by name, without STATESNAP_) reads its value,
    whatever the environment says.

    Process-wide, like the environment variables they stand in for: a take reads some knobs on
    the library's I/O thread, which a thread-local or context-local value would not reach.
    Blocks nest, and may overlap across threads: the most recently entered block still open
    wins, and leaving one removes its own values only.
    """
    token = object()
    with _overrides_lock:
        for name, value in values.items():
            _overrides[name] = (*_overrides.get(name, ()), (token, value))
    try:
        yield
    finally:
        with _overrides_lock:
            for name in values:
                rest = tuple(o for o in _overrides[name] if o[0] is not token)
                if rest:
                    _overrides[name] = rest
                else:
                    del _overrides[name]


def _checked(what: str, value: int, minimum: int) -> int:
    if type(value) is not int or value < minimum:
        raise InvalidArgumentError(f"{what} must be an int >= {minimum}, got {value!r}")
    return value


def override_max_chunk_size_bytes(max_chunk_size_bytes: int) -> AbstractContextManager[None]:
    """Within the ``with`` block, tensors larger than ``max_chunk_size_bytes`` are split into
    chunks of about that size: sets :func:`chunk_bytes` (STATESNAP_CHUNK_BYTES), which also
    cuts the pieces of sharded tensors (see :func:`override_max_shard_size_bytes`)."""
    value = _checked("max_chunk_size_bytes", max_chunk_size_bytes, 1)
    return _override({"CHUNK_BYTES": value})


def override_max_shard_size_bytes(max_shard_size_bytes: int) -> AbstractContextManager[None]:
    """Within the ``with`` block, each rank's piece of a sharded tensor is written in parts of
    at most about ``max_shard_size_bytes``. This library cuts such a piece as it cuts any
    tensor, by :func:`chunk_bytes` (STATESNAP_CHUNK_BYTES), so this sets that knob, for dense
    tensors too: it is the same knob as :func:`override_max_chunk_size_bytes` sets (with both
    open, the block entered last wins)."""
    value = _checked("max_shard_size_bytes", max_shard_size_bytes, 1)
    return _override({"CHUNK_BYTES": value})


def override_slab_size_threshold_bytes(
    slab_size_threshold_bytes: int,
) -> AbstractContextManager[None]:
    """Within the ``with`` block, tensors of up to about ``slab_size_threshold_bytes`` are
    packed together into slabs of about that size. torchsnapshot's one knob is both the size
    limit of a slab's members and the size a slab is filled to, so this sets two of this
    library's: :func:`slab_threshold_bytes` (STATESNAP_SLAB_THRESHOLD_BYTES) and
    :func:`slab_bytes` (STATESNAP_SLAB_BYTES). 0 turns slabs off."""
    value = _checked("slab_size_threshold_bytes", slab_size_threshold_bytes, 0)
    # slab_bytes must stay positive; with a threshold of 0 no slab is made anyway.
    return _override({"SLAB_THRESHOLD_BYTES": value, "SLAB_BYTES": max(value, 1)})


def override_max_per_rank_io_concurrency(
    max_per_rank_io_concurrency: int,
) -> AbstractContextManager[None]:
    """Within the ``with`` block, each process keeps at most ``max_per_rank_io_concurrency``
    blob reads or writes in flight: sets :func:`max_concurrent_io`
    (STATESNAP_MAX_CONCURRENT_IO)."""
    value = _checked("max_per_rank_io_concurrency", max_per_rank_io_concurrency, 1)
    return _override({"MAX_CONCURRENT_IO": value})
