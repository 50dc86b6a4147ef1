"""Storage plugins kept open between operations, for plugin classes that ask for it.

A plugin whose class sets ``keep_open`` (S3's: its client and connection pool are expensive to
make) is not closed at the end of a successful operation: it is kept for a while, and handed to
the next operation on the same URL with the same storage options (``Snapshot(path)`` then its
``restore`` and ``read_object`` calls share one). A timer closes it when nobody took it in time.

The table belongs to the process's ``Runtime`` and is touched on the I/O loop only.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from storage_plugins import StoragePlugin

logger = logging.getLogger(__name__)

# (url, storage options as canonical JSON)
Key = tuple[str, str]


def key_of(url: str, storage_options: dict[str, Any] | None) -> Key | None:
    """The table key of a plugin for ``url`` and ``storage_options``; None for options that are
    objects (a session, a callback): those are not compared, so their plugins are not kept."""
    try:
        options = json.dumps(storage_options or {}, sort_keys=True)
    except (TypeError, ValueError):
        return None
    return (url, options)


async def close_quietly(plugin: StoragePlugin) -> None:
    """Closes ``plugin``, logging (not raising) an error: nothing depends on it any more."""
    try:
        await plugin.close()
    except Exception as e:
        logger.warning("closing storage plugin %r failed: %s: %s", plugin, type(e).__name__, e)


class KeptPlugins:
    """The plugins kept open, by key, each with the timer that closes it."""

    def __init__(self) -> None:
        self._kept: dict[Key, tuple[StoragePlugin, asyncio.TimerHandle]] = {}

    def __len__(self) -> int:
        return len(self._kept)

    async def reclaim(self, key: Key) -> StoragePlugin | None:
        """The plugin kept under ``key``, taken out of the table (it forgets what it learned
        about the store: the next operation may find it changed); None when there is none."""
        kept = self._kept.pop(key, None)
        if kept is None:
            return None
        plugin, timer = kept
        timer.cancel()
        plugin.forget()
        return plugin

    async def keep(self, key: Key, plugin: StoragePlugin, secs: float) -> None:
        """Keeps ``plugin`` under ``key`` for ``secs`` seconds, then closes it."""
        previous = self._kept.pop(key, None)
        if previous is not None:  # two operations on one path at once: keep the later one
            previous[1].cancel()
            await close_quietly(previous[0])
        loop = asyncio.get_running_loop()
        timer = loop.call_later(secs, lambda: loop.create_task(self._expire(key, plugin)))
        self._kept[key] = (plugin, timer)

    async def _expire(self, key: Key, plugin: StoragePlugin) -> None:
        kept = self._kept.get(key)
        if kept is not None and kept[0] is plugin:
            del self._kept[key]
            await close_quietly(plugin)

    async def close_all(self) -> None:
        """Closes every plugin kept open (at exit, or to release them now)."""
        while self._kept:
            _, (plugin, timer) = self._kept.popitem()
            timer.cancel()
            await close_quietly(plugin)
