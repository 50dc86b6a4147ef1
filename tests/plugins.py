"""Storage plugins that tests wrap around real ones: recording reads and writes, holding
writes until a gate opens."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from storage_plugins import (
    Buffer,
    StoragePlugin,
    register_storage_plugin,
    unregister_storage_plugin,
    url_to_storage_plugin,
)
from storage_plugins.fs import FSStoragePlugin


@dataclass
class IOLog:
    """What went through a RecordingPlugin: (blob, offset, nbytes) per read, blob per write."""

    reads: list[tuple[str, int, int]] = field(default_factory=list)
    writes: list[tuple[str, int]] = field(default_factory=list)

    @property
    def bytes_read(self) -> int:
        return sum(n for _, _, n in self.reads)

    def clear(self) -> None:
        self.reads.clear()
        self.writes.clear()


LOGS: dict[str, IOLog] = {}


class RecordingPlugin(StoragePlugin):
    """``recording://<inner url>``: forwards to the inner plugin and logs every data access."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        inner_url = url.removeprefix("recording://")
        self.inner = url_to_storage_plugin(inner_url, storage_options)
        self.log = LOGS.setdefault(inner_url, IOLog())

    def describe(self, path: str) -> str:
        return self.inner.describe(path)

    async def write(self, path: str, buffers: Sequence[Buffer]) -> None:
        self.log.writes.append((path, sum(len(memoryview(b).cast("B")) for b in buffers)))
        await self.inner.write(path, buffers)

    async def read(self, path: str) -> bytes:
        data = await self.inner.read(path)
        self.log.reads.append((path, 0, len(data)))
        return data

    async def read_into(self, path: str, offset: int, out: memoryview) -> None:
        self.log.reads.append((path, offset, len(out)))
        await self.inner.read_into(path, offset, out)

    async def exists(self, path: str) -> bool:
        return await self.inner.exists(path)

    async def delete(self, path: str) -> None:
        await self.inner.delete(path)

    async def sync(self) -> None:
        await self.inner.sync()

    async def close(self) -> None:
        await self.inner.close()


# inner url -> fault(verb, path) returning an exception to raise, or None to go ahead; ``path``
# as ``plain_blob`` gives it.
FAULTS: dict[str, Any] = {}

_TAKE_ID = re.compile(r"^([0-9]+)/[0-9a-f]{8}-")


def plain_blob(path: str) -> str:
    """A blob's name without its take's id: ``0/1f2e3d4c-s0`` -> ``0/s0`` (the name tests
    refer to: each take names its blobs apart from any other's)."""
    return _TAKE_ID.sub(r"\1/", path)


def fail_writes(inner: str, error_number: int, message: str, where: Callable[[str], bool]) -> None:
    """Makes ``faulty://<inner>`` fail every write of a blob ``where(path)`` selects with
    ``OSError(error_number, message)``."""
    FAULTS[inner] = lambda verb, path: (
        OSError(error_number, message) if verb == "write" and where(path) else None
    )


class FaultyPlugin(RecordingPlugin):
    """``faulty://<inner url>``: like RecordingPlugin, but raises what ``FAULTS[inner]`` says."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(url.replace("faulty://", "recording://", 1), storage_options)
        self.fault = FAULTS.get(url.removeprefix("faulty://"), lambda verb, path: None)

    def _check(self, verb: str, path: str) -> None:
        error = self.fault(verb, plain_blob(path))
        if error is not None:
            raise error

    async def write(self, path: str, buffers: Sequence[Buffer]) -> None:
        self._check("write", path)
        await super().write(path, buffers)

    async def read(self, path: str) -> bytes:
        self._check("read", path)
        return await super().read(path)

    async def read_into(self, path: str, offset: int, out: memoryview) -> None:
        self._check("read", path)
        await super().read_into(path, offset, out)


# Blob writes held until a test opens the gate (the pending marker's write passes), registered
# under ``gated://`` by ``gated_storage``.
GATE = threading.Event()


class GatedPlugin(FSStoragePlugin):
    """``gated://<path>``: a local-disk plugin whose blob writes wait until GATE is set."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(url.removeprefix("gated://"), storage_options)

    async def write(self, path: str, buffers: Sequence[Buffer]) -> None:
        if path != ".statesnap-pending":
            while not GATE.is_set():
                await asyncio.sleep(0.005)
        await super().write(path, buffers)


@contextlib.contextmanager
def gated_storage() -> Iterator[None]:
    """Registers ``gated://`` with GATE closed; opens it and unregisters on the way out."""
    GATE.clear()
    register_storage_plugin("gated", GatedPlugin)
    try:
        yield
    finally:
        GATE.set()
        unregister_storage_plugin("gated")
