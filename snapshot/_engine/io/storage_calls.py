"""Calls to storage: opening a plugin (and keeping one open between operations), and each
plugin call with its retries, backoff and deadline, its errors made the library's; every
tunable comes from the operation's ``Options``.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from snapshot._engine import runtime
from snapshot._engine.format.serialization import RangeDigest
from snapshot._engine.runtime import run
from snapshot.errors import (
    CorruptSnapshotError,
    SnapshotError,
    StorageError,
    UnsafeSnapshotError,
)
from storage_plugins import (
    BlobTooLargeError,
    RefusedBlobError,
    StoragePlugin,
    UnsafeBlobError,
    url_to_storage_plugin,
)

if TYPE_CHECKING:
    from snapshot.options import Options

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


async def make_plugin(url: str, storage_options: dict[str, Any] | None) -> StoragePlugin:
    """The storage plugin for ``url``, built on the I/O loop; the caller closes it."""
    try:
        return url_to_storage_plugin(url, storage_options)
    except (ValueError, TypeError, ImportError) as e:
        raise StorageError(f"cannot open storage for {url!r}: {e}") from e


def open_plugin(url: str, storage_options: dict[str, Any] | None) -> StoragePlugin:
    """``make_plugin``, from a thread other than the I/O loop's."""
    return run(make_plugin(url, storage_options))


@contextmanager
def open_storage(
    url: str, storage_options: dict[str, Any] | None, options: Options
) -> Iterator[StoragePlugin]:
    """A storage plugin for ``url``, closed on exit; or, for a plugin class that asks for it
    (``keep_open``), kept open ``options.keep_open_secs`` after a successful exit for the next
    ``open_storage`` of the same ``url`` and storage options."""
    keep_secs = options.keep_open_secs
    assert keep_secs is not None, "resolved options"
    table = runtime.get().kept
    key = runtime.key_of(url, storage_options)
    plugin = run(table.reclaim(key)) if key is not None else None
    if plugin is None:
        plugin = open_plugin(url, storage_options)
    try:
        yield plugin
    except BaseException:
        run(plugin.close())
        raise
    if key is not None and type(plugin).keep_open and keep_secs > 0 and runtime.get().keeps_plugins:
        run(table.keep(key, plugin, keep_secs))
    else:
        run(plugin.close())


def _storage_error(
    plugin: StoragePlugin, verb: str, blob: str, label: str, e: Exception, attempts: int
) -> Exception:
    """The library's error for a failed plugin call (raised from ``e``)."""
    if isinstance(e, SnapshotError):
        return e
    where = plugin.describe(blob)
    if isinstance(e, UnsafeBlobError):
        return UnsafeSnapshotError(f"{label}: blob {blob}: {e}")  # ``e`` names the full path
    if verb == "read" and isinstance(e, FileNotFoundError):
        return CorruptSnapshotError(f"{label}: blob {where} is missing")
    if verb == "read" and isinstance(e, EOFError):
        return CorruptSnapshotError(
            f"{label}: blob {where} is shorter than the manifest says ({e})"
        )
    tries = f" ({attempts} attempts)" if attempts > 1 else ""
    return StorageError(f"{label}: failed to {verb} blob {where}{tries}: {type(e).__name__}: {e}")


_FIRST_BACKOFF_SECS = 0.05
_MAX_BACKOFF_SECS = 2.0


async def call(
    plugin: StoragePlugin,
    verb: str,
    blob: str,
    label: str,
    op: Callable[[], Awaitable[_T]],
    *,
    options: Options,
    convert: bool = True,
) -> _T:
    """Awaits ``op()``, one plugin call, its errors made the library's (with ``convert=False``,
    the plugin's own error is raised once retries are spent).

    A transient error (``plugin.is_transient``) makes the whole call again, up to
    ``options.io_retries`` times, after a jittered backoff that doubles; each retry is logged.
    The call, retries included, must end within ``options.io_timeout_secs``, or it fails naming
    the blob (an attempt running on a worker thread is abandoned).
    """
    loop = asyncio.get_running_loop()
    timeout, retries = options.io_timeout_secs, options.io_retries
    assert timeout is not None and retries is not None, "resolved options"
    deadline = loop.time() + timeout
    delay = _FIRST_BACKOFF_SECS
    attempt = 1
    while True:
        try:
            try:
                return await asyncio.wait_for(op(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                if loop.time() < deadline:
                    raise  # the plugin's own timeout, not the deadline
                raise TimeoutError(
                    f"no answer within {timeout} s (Options.io_timeout_secs, "
                    f"STATESNAP_IO_TIMEOUT_SECS) after {attempt} attempt(s)"
                ) from None
        except Exception as e:
            # A refused blob is refused again on every attempt, whatever the plugin says.
            if (
                loop.time() >= deadline
                or attempt > retries
                or isinstance(e, RefusedBlobError)
                or not plugin.is_transient(e)
            ):
                if not convert:
                    raise
                raise _storage_error(plugin, verb, blob, label, e, attempt) from e
            pause = delay * random.uniform(0.5, 1.0)
            logger.warning(
                "%s: %s of blob %s failed (%s: %s); retrying in %.2f s (retry %d of %d)",
                label, verb, plugin.describe(blob), type(e).__name__, e, pause, attempt, retries,
            )  # fmt: skip
            await asyncio.sleep(min(pause, max(deadline - loop.time(), 0)))
            delay = min(delay * 2, _MAX_BACKOFF_SECS)
            attempt += 1


async def read_unrecorded(plugin: StoragePlugin, blob: str, where: str, options: Options) -> bytes:
    """The whole of ``blob`` of the snapshot ``where`` whose length nothing records (a
    manifest), bounded by ``options.max_manifest_bytes``.

    Raises:
        UnsafeSnapshotError: over the limit, or the plugin refused what is at its path.
        FileNotFoundError, NotADirectoryError, ...: the plugin's own errors, as they are.
    """
    limit = options.max_manifest_bytes
    assert limit is not None, "resolved options"
    read = lambda: plugin.read_limited(blob, limit)  # noqa: E731
    try:
        return await call(plugin, "read", blob, where, read, options=options, convert=False)
    except BlobTooLargeError as e:
        held = f"{e.size} bytes" if e.size is not None else "more bytes"
        raise UnsafeSnapshotError(
            f"snapshot {where}: {plugin.describe(blob)} holds {held}, over the limit of {limit} "
            "bytes (STATESNAP_MAX_MANIFEST_BYTES): refused. To open a snapshot whose manifest "
            "is really that large, set the environment variable STATESNAP_MAX_MANIFEST_BYTES "
            "(or Options.max_manifest_bytes) to a larger number of bytes"
        ) from e
    except UnsafeBlobError as e:
        raise refused(where, e) from e


def refused(where: str, error: UnsafeBlobError) -> UnsafeSnapshotError:
    """The library's error for what a plugin refused to open in the snapshot ``where``."""
    return UnsafeSnapshotError(f"snapshot {where}: {error}")


async def call_digesting(
    plugin: StoragePlugin,
    verb: str,
    blob: str,
    label: str,
    ranges: Sequence[tuple[int, int]],
    op: Callable[[RangeDigest], Awaitable[None]],
    *,
    options: Options,
) -> list[int]:
    """``call`` of an operation that shows its bytes to a digest of ``ranges`` (a new one for
    each attempt); the ranges' CRC-32s."""
    digests: list[RangeDigest] = []

    def attempt() -> Awaitable[None]:
        digests.append(RangeDigest(ranges))
        return op(digests[-1])

    await call(plugin, verb, blob, label, attempt, options=options)
    return digests[-1].values
