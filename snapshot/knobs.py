"""The environment's side of the tunables: ``STATESNAP_*`` variables, read by
:meth:`snapshot.Options.from_env` when a call starts, and torchsnapshot's ``override_*`` context
managers (below), which set the same values within a ``with`` block. The engine itself reads
no tunable here: it is given an :class:`~snapshot.Options`."""

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


def default_memory_budget(reclaimable_bytes: int = 0) -> int:
    """A quarter of the memory available now (plus ``reclaimable_bytes``), within
    [64 MiB, 4 GiB]: the staging budget when none is set."""
    available = _available_memory_bytes()
    default = 1024 * _MIB if available is None else (available + reclaimable_bytes) // 4
    return max(64 * _MIB, min(default, 4096 * _MIB))


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
    chunks of about that size: sets ``Options.chunk_bytes`` (STATESNAP_CHUNK_BYTES), which also
    cuts the pieces of sharded tensors (see :func:`override_max_shard_size_bytes`)."""
    value = _checked("max_chunk_size_bytes", max_chunk_size_bytes, 1)
    return _override({"CHUNK_BYTES": value})


def override_max_shard_size_bytes(max_shard_size_bytes: int) -> AbstractContextManager[None]:
    """Within the ``with`` block, each rank's piece of a sharded tensor is written in parts of
    at most about ``max_shard_size_bytes``. This library cuts such a piece as it cuts any
    tensor, by ``Options.chunk_bytes`` (STATESNAP_CHUNK_BYTES), so this sets that knob, for dense
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
    library's: ``Options.slab_threshold_bytes`` (STATESNAP_SLAB_THRESHOLD_BYTES) and
    ``Options.slab_bytes`` (STATESNAP_SLAB_BYTES). 0 turns slabs off."""
    value = _checked("slab_size_threshold_bytes", slab_size_threshold_bytes, 0)
    # slab_bytes must stay positive; with a threshold of 0 no slab is made anyway.
    return _override({"SLAB_THRESHOLD_BYTES": value, "SLAB_BYTES": max(value, 1)})


def override_max_per_rank_io_concurrency(
    max_per_rank_io_concurrency: int,
) -> AbstractContextManager[None]:
    """Within the ``with`` block, each process keeps at most ``max_per_rank_io_concurrency``
    blob reads or writes in flight: sets ``Options.max_concurrent_io``
    (STATESNAP_MAX_CONCURRENT_IO)."""
    value = _checked("max_per_rank_io_concurrency", max_per_rank_io_concurrency, 1)
    return _override({"MAX_CONCURRENT_IO": value})
