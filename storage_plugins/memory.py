"""In-process storage (``memory://name``): blobs live in a dict shared by the whole process."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from storage_plugins.base import Buffer, StoragePlugin, short_read
from storage_plugins.registry import check_below_root

# One store per process, so that a snapshot taken to memory://x can be opened again by path.
_STORE: dict[str, bytes] = {}
_LOCK = threading.Lock()


def clear(root: str | None = None) -> None:
    """Forgets every in-memory blob, or those under ``root`` (``memory://`` prefix optional)."""
    with _LOCK:
        if root is None:
            _STORE.clear()
            return
        prefix = _key(root.removeprefix("memory://"), "")
        for key in [k for k in _STORE if k.startswith(prefix)]:
            del _STORE[key]


def _key(root: str, path: str) -> str:
    return f"{root.strip('/')}/{check_below_root(path, f'memory://{root}/{path}')}"


class MemoryStoragePlugin(StoragePlugin):
    """Keeps blobs as immutable ``bytes`` in the process's memory; for tests and scratch state.

    storage_options: none.
    """

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        if storage_options:
            raise TypeError(
                f"memory storage takes no storage_options, got {sorted(storage_options)}"
            )
        self.root = root.removeprefix("memory://").strip("/")

    def describe(self, path: str) -> str:
        return f"memory://{self.root}/{path}"

    async def write(self, path: str, buffers: Sequence[Buffer]) -> None:
        data = b"".join(buffers)
        with _LOCK:
            _STORE[_key(self.root, path)] = data

    def _get(self, path: str) -> bytes:
        with _LOCK:
            try:
                return _STORE[_key(self.root, path)]
            except KeyError:
                raise FileNotFoundError(f"no blob {self.describe(path)}") from None

    async def read(self, path: str) -> bytes:
        return self._get(path)

    async def read_into(self, path: str, offset: int, out: memoryview) -> None:
        await self.readv(path, offset, (out,))

    async def readv(self, path: str, offset: int, outs: Sequence[memoryview]) -> None:
        data = memoryview(self._get(path))
        end = offset + sum(len(o) for o in outs)
        if end > len(data):
            raise short_read(self.describe(path), len(data), end)
        for out in outs:
            out[:] = data[offset : offset + len(out)]
            offset += len(out)

    async def size(self, path: str) -> int:
        return len(self._get(path))

    async def list_names(self, limit: int) -> list[str]:
        prefix = _key(self.root, "")
        with _LOCK:
            names = {k[len(prefix) :].split("/", 1)[0] for k in _STORE if k.startswith(prefix)}
        return sorted(names)[:limit]

    async def write_if_absent(self, path: str, buffers: Sequence[Buffer]) -> None:
        data = b"".join(buffers)
        with _LOCK:
            key = _key(self.root, path)
            if key in _STORE:
                raise FileExistsError(f"{self.describe(path)} exists")
            _STORE[key] = data

    async def delete_all(self) -> None:
        clear(self.root)

    async def exists(self, path: str) -> bool:
        with _LOCK:
            return _key(self.root, path) in _STORE

    async def delete(self, path: str) -> None:
        with _LOCK:
            if _STORE.pop(_key(self.root, path), None) is None:
                raise FileNotFoundError(f"no blob {self.describe(path)}")
