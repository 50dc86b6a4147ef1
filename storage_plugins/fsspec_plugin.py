"""Any fsspec file system (gcs://, az://, hdfs://, ...) as a storage plugin."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import fsspec  # type: ignore[import-untyped]
from fsspec.asyn import AsyncFileSystem  # type: ignore[import-untyped]

from storage_plugins.base import BlobTooLargeError, Buffer, StoragePlugin, short_read
from storage_plugins.registry import check_below_root


class FSSpecStoragePlugin(StoragePlugin):
    """Blobs are files of an fsspec file system.

    Asynchronous file systems (s3fs, gcsfs, ...) are created in asynchronous mode on the library's
    event loop and awaited directly; synchronous ones run on the loop's default thread pool.

    Args:
        root: ``protocol://location`` of the snapshot.
        storage_options: passed unchanged to the file system's constructor.
    """

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        protocol, _, location = root.partition("://")
        if not location:
            raise ValueError(f"expected protocol://location, got {root!r}")
        self.protocol = protocol
        self.root = location.rstrip("/")
        cls = fsspec.get_filesystem_class(protocol)
        options = dict(storage_options or {})
        self._async = issubclass(cls, AsyncFileSystem)
        if self._async:
            options.setdefault("asynchronous", True)
            options.setdefault("loop", asyncio.get_running_loop())
            # A cached instance could belong to another loop; ours must belong to this one.
            options.setdefault("skip_instance_cache", True)
        self.fs = cls(**options)

    def _full(self, path: str) -> str:
        return f"{self.root}/{check_below_root(path, self.describe(path))}"

    def describe(self, path: str) -> str:
        return f"{self.protocol}://{self.root}/{path}"

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if self._async:
            return await getattr(self.fs, f"_{name}")(*args, **kwargs)
        return await asyncio.to_thread(getattr(self.fs, name), *args, **kwargs)

    async def write(self, path: str, buffers: Sequence[Buffer]) -> None:
        full = self._full(path)
        parent = full.rpartition("/")[0]
        if not self._async and parent:
            await self._call("makedirs", parent, exist_ok=True)
        await self._call("pipe_file", full, b"".join(buffers))

    async def read(self, path: str) -> bytes:
        return await self._call("cat_file", self._full(path))

    async def read_limited(self, path: str, limit: int) -> bytes:
        # The length the store reports is checked first (a blob too large is then never
        # fetched); the read asks for one byte past ``limit`` in any case, should it be wrong.
        size = await self.size(path)
        if size is not None and size > limit:
            raise BlobTooLargeError(self.describe(path), limit, size)
        if size == 0:
            return b""  # (a ranged read of an empty object is an error on some stores)
        data = await self._call("cat_file", self._full(path), start=0, end=limit + 1)
        if len(data) > limit:
            raise BlobTooLargeError(self.describe(path), limit)
        return bytes(data)

    async def read_into(self, path: str, offset: int, out: memoryview) -> None:
        if len(out) == 0:
            await self.size(path)  # FileNotFoundError when there is none
            return
        data = await self._call("cat_file", self._full(path), start=offset, end=offset + len(out))
        if len(data) != len(out):
            raise short_read(self.describe(path), offset + len(data), offset + len(out))
        out[:] = data

    async def size(self, path: str) -> int | None:
        size = await self._call("size", self._full(path))
        return None if size is None else int(size)  # None: a store that does not know

    async def exists(self, path: str) -> bool:
        return bool(await self._call("exists", self._full(path)))

    async def delete(self, path: str) -> None:
        await self.size(path)  # FileNotFoundError when there is none
        await self._call("rm_file", self._full(path))

    async def delete_all(self) -> None:
        if await self._call("exists", self.root):
            await self._call("rm", self.root, recursive=True)

    async def close(self) -> None:
        if self._async:
            session = getattr(self.fs, "_session", None)
            close = getattr(session, "close", None)
            if close is not None:
                result = close()
                if asyncio.iscoroutine(result):
                    await result
