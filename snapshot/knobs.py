"""torchsnapshot's ``override_*`` context managers (``torchsnapshot.knobs``): within a ``with``
block they set the same tunables as the ``STATESNAP_*`` environment variables, which
:class:`~snapshot.Options` reads when a call starts.

Process-wide, like the environment they stand in for (a take reads some tunables on the I/O
thread). Blocks nest and may overlap across threads: the block entered last that is still open
wins, and leaving one removes its own values only.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager

from snapshot.errors import InvalidArgumentError
from snapshot.options import OVERRIDES

_lock = threading.Lock()


@contextlib.contextmanager
def _override(values: dict[str, int]) -> Iterator[None]:
    with _lock:
        OVERRIDES.append(values)
    try:
        yield
    finally:
        with _lock:  # this block's own dict, wherever it is now
            del OVERRIDES[next(i for i, block in enumerate(OVERRIDES) if block is values)]


def _checked(what: str, value: int, minimum: int) -> int:
    if type(value) is not int or value < minimum:
        raise InvalidArgumentError(f"{what} must be an int >= {minimum}, got {value!r}")
    return value


def override_max_chunk_size_bytes(max_chunk_size_bytes: int) -> AbstractContextManager[None]:
    """Tensors larger than ``max_chunk_size_bytes`` are split into chunks of about that size
    (``Options.chunk_bytes``, which also cuts the pieces of sharded tensors)."""
    return _override({"CHUNK_BYTES": _checked("max_chunk_size_bytes", max_chunk_size_bytes, 1)})


def override_max_shard_size_bytes(max_shard_size_bytes: int) -> AbstractContextManager[None]:
    """Each rank's piece of a sharded tensor is written in parts of at most about
    ``max_shard_size_bytes``. Such a piece is cut as any tensor is, so this sets the same knob
    as :func:`override_max_chunk_size_bytes` (with both open, the block entered last wins)."""
    return _override({"CHUNK_BYTES": _checked("max_shard_size_bytes", max_shard_size_bytes, 1)})


def override_slab_size_threshold_bytes(
    slab_size_threshold_bytes: int,
) -> AbstractContextManager[None]:
    """Tensors of up to about ``slab_size_threshold_bytes`` are packed into slabs of about that
    size. torchsnapshot's one knob is both a member's limit and a slab's size, so this sets
    ``Options.slab_threshold_bytes`` and ``Options.slab_bytes``. 0 turns slabs off."""
    value = _checked("slab_size_threshold_bytes", slab_size_threshold_bytes, 0)
    # slab_bytes must stay positive; with a threshold of 0 no slab is made anyway.
    return _override({"SLAB_THRESHOLD_BYTES": value, "SLAB_BYTES": max(value, 1)})


def override_max_per_rank_io_concurrency(
    max_per_rank_io_concurrency: int,
) -> AbstractContextManager[None]:
    """Each process keeps at most ``max_per_rank_io_concurrency`` blob reads or writes in
    flight (``Options.max_concurrent_io``)."""
    value = _checked("max_per_rank_io_concurrency", max_per_rank_io_concurrency, 1)
    return _override({"MAX_CONCURRENT_IO": value})
