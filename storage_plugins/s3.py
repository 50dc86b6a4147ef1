"""Amazon S3 (and S3-compatible stores) through s3fs: ``s3://bucket/prefix`` paths."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import errno
import itertools
import os
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import aiohttp
import s3fs  # type: ignore[import-untyped]
from botocore.config import Config  # type: ignore[import-untyped]
from botocore.exceptions import HTTPClientError, ResponseStreamingError  # type: ignore[import-untyped]

from storage_plugins import base
from storage_plugins.base import BlobTooLargeError, Buffer, StoragePlugin
from storage_plugins.registry import check_below_root

_MIB = 1 << 20
# S3's smallest part (all but the last) and most parts of one multipart upload.
_MIN_PART_BYTES = 5 * _MIB
_MAX_PARTS = 10_000

# Error codes S3 documents as worth retrying (besides every 5xx status).
_TRANSIENT_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestThrottled",
        "RequestLimitExceeded",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "BandwidthLimitExceeded",
    }
)
_NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
# Dropped, refused or timed-out connections and cut-off responses, as botocore and aiohttp
# report them.
_CONNECTION_ERRORS = (
    HTTPClientError,
    ResponseStreamingError,
    asyncio.TimeoutError,
    aiohttp.ClientConnectionError,
    aiohttp.ClientPayloadError,
)


class BucketNotFoundError(OSError):
    """The bucket of an ``s3://`` path does not exist. Not a ``FileNotFoundError``: callers
    that treat a missing object as "nothing there" must not take a missing bucket for an empty
    one."""


class S3StoragePlugin(StoragePlugin):
    """Blobs are objects of one bucket, under a key prefix.

    One asynchronous ``s3fs.S3FileSystem`` per plugin, created on the library's event loop; its
    HTTP session is closed by ``close()``. Every option s3fs takes goes through
    ``storage_options`` unchanged (``endpoint_url``, ``key``/``secret``/``token``, ``profile``,
    ``client_kwargs``, ``config_kwargs``, ...), and so do the AWS_* environment variables that
    botocore reads. The plugin's own options:

    Args:
        root: ``s3://bucket[/prefix]``.
        storage_options: s3fs's options plus
            ``max_concurrent_requests`` (int, default 8): requests in flight at once through
            this plugin (uploads, parts of multipart uploads, ranged reads, and the small ones);
            ``part_bytes`` (int, default 32 MiB): blobs larger than this are uploaded as a
            multipart upload in parts of this size, uploaded concurrently.
            A body is read from the staged buffers as it is sent (in 256 KiB copies); an
            observed (checksummed) body is copied first, and the copy observed and sent.

    Retries: the library's alone (errors ``is_transient`` accepts: 5xx, throttling, dropped
    connections, timeouts; with backoff, within ``STATESNAP_IO_TIMEOUT_SECS``); s3fs's loop and
    botocore's (unless ``config_kwargs`` sets ``retries``) are set to one attempt.

    Writes are atomic as S3 makes them: a ``PutObject`` or a completed multipart upload
    replaces the whole object at once; a failed multipart upload is aborted.

    Tensors are chunked into objects of at most 32 MiB (``chunk_bytes_hint``): one ``PutObject``
    and one ranged GET each.
    """

    chunk_bytes_hint = 32 * _MIB
    keep_open = True  # a new client loads the SDK's service model and opens new connections

    def __init__(self, root: str, storage_options: dict[str, Any] | None = None) -> None:
        protocol, sep, location = root.partition("://")
        bucket, _, prefix = location.partition("/")
        if not sep or protocol not in ("s3", "s3a") or not bucket:
            raise ValueError(f"expected s3://bucket[/prefix], got {root!r}")
        options = dict(storage_options or {})
        self._concurrency = int(options.pop("max_concurrent_requests", 8))
        self._part_bytes = int(options.pop("part_bytes", 32 * _MIB))
        if self._concurrency < 1:
            raise ValueError(f"max_concurrent_requests must be >= 1, got {self._concurrency}")
        if self._part_bytes < _MIN_PART_BYTES:
            raise ValueError(
                f"part_bytes must be >= 5 MiB (S3's smallest part), got {self._part_bytes}"
            )
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        config = dict(options.pop("config_kwargs", None) or {})
        config.setdefault("retries", {"total_max_attempts": 1})
        # The library checks every byte against its own CRC-32: the SDK's per-request
        # checksums and payload signing would hash every byte again. (botocore before 1.36 has
        # neither option, and refuses options it does not know.)
        for option in ("request_checksum_calculation", "response_checksum_validation"):
            if option in getattr(Config, "OPTION_DEFAULTS", ()):
                config.setdefault(option, "when_required")
        config["s3"] = {"payload_signing_enabled": False, **(config.get("s3") or {})}
        self._endpoint = options.get("endpoint_url")
        options.setdefault("skip_instance_cache", True)  # a cached instance may be another loop's
        self.fs = s3fs.S3FileSystem(
            asynchronous=True, loop=asyncio.get_running_loop(), config_kwargs=config, **options
        )
        self.fs.retries = 1  # one attempt per call in s3fs: the library retries, with a deadline
        self._slots = asyncio.Semaphore(self._concurrency)
        self._sizes: dict[str, int] = {}  # object lengths seen in ranged reads' answers
        self._closed = False

    # -- naming ----------------------------------------------------------------------------------

    def _key(self, path: str) -> str:
        check_below_root(path, self.describe(path))
        return f"{self.prefix}/{path}" if self.prefix else path

    def describe(self, path: str) -> str:
        key = f"{self.prefix}/{path}" if self.prefix else path
        return f"s3://{self.bucket}/{key}"

    # -- one request ---------------------------------------------------------------------------

    async def _call(self, method: str, path: str | None, **kwargs: Any) -> Any:
        """One S3 API call on the object ``path`` (None: on the bucket) with a request slot held
        while it runs, its error made one a caller knows."""
        async with self._slots:
            return await self._call_in_slot(method, path, **kwargs)

    async def _call_in_slot(self, method: str, path: str | None, **kwargs: Any) -> Any:
        """``_call``, for a caller that holds a request slot already (to read a response's
        body within it)."""
        if path is not None:
            kwargs["Key"] = self._key(path)
        if self._closed:
            # A call still under way when an operation failed (a check beside the listing
            # that found no bucket) must not open a new session that nothing would close.
            raise OSError(f"s3://{self.bucket}: storage closed")
        try:
            return await self.fs._call_s3(method, Bucket=self.bucket, **kwargs)
        except Exception as e:
            translated = self._translate(e, path or "")
            if translated is e:
                raise  # keeps the chain (s3fs's OSError caused by botocore's ClientError)
            if isinstance(translated, BucketNotFoundError):
                raise translated from None  # botocore's error says no more than this one
            raise translated from e

    def _translate(self, error: Exception, path: str) -> Exception:
        status, code = _status_and_code(error)
        where = self.describe(path)
        if code == "NoSuchBucket":
            at = f" at {self._endpoint}" if self._endpoint else ""
            return BucketNotFoundError(
                f"S3 bucket {self.bucket!r} does not exist{at} (NoSuchBucket): create it "
                "first, or check the bucket's name"
            )
        if code in _NOT_FOUND_CODES or status == 404:
            return FileNotFoundError(errno.ENOENT, f"no object {where} ({code or status})")
        if code == "InvalidRange" or status == 416:
            return EOFError(f"{where}: the requested range starts beyond the object's end")
        if isinstance(error, OSError) and code is not None:
            # s3fs's error says what kind of failure it is; add what S3 answered.
            return type(error)(error.errno, f"{code} (HTTP {status}): {error.strerror or error}")
        return error

    def is_transient(self, error: BaseException) -> bool:
        if self._closed:
            return False  # a request cut off by close(): nothing to retry it on
        for e in _chain(error):
            status, code = _status_and_code(e)
            if (status is not None and status >= 500) or code in _TRANSIENT_CODES:
                return True
            if isinstance(e, _CONNECTION_ERRORS) or super().is_transient(e):
                return True
        return False

    # -- writes ----------------------------------------------------------------------------------

    async def write(self, path: str, buffers: Sequence[Buffer]) -> None:
        await self.write_observed(path, buffers, None)

    async def write_observed(
        self, path: str, buffers: Sequence[Buffer], observe: Callable[[memoryview], None] | None
    ) -> None:
        # What is observed is what is sent: a copy (a part's, in a multipart upload), never
        # ``buffers``, which another thread may change meanwhile.
        self._sizes.pop(path, None)
        views = [memoryview(b).cast("B") for b in buffers if len(b)]
        total = sum(len(v) for v in views)
        if total > self._part_bytes:
            await self._multipart(path, views, total, observe)
            return
        if observe is not None:
            views = [memoryview(await base.off_loop(total, base.observed_copy, views, observe))]
        await self._call("put_object", path, Body=Body(views))

    async def write_if_absent(self, path: str, buffers: Sequence[Buffer]) -> None:
        """A conditional put (``If-None-Match: *``): stored only where no object has the key,
        in one step; 412 otherwise."""
        self._sizes.pop(path, None)
        body = Body([memoryview(b).cast("B") for b in buffers if len(b)])
        try:
            await self._call("put_object", path, Body=body, IfNoneMatch="*")
        except Exception as e:
            if _status_and_code(e)[0] in (409, 412):
                raise FileExistsError(f"{self.describe(path)} exists") from e
            raise

    async def _multipart(
        self,
        path: str,
        views: list[memoryview],
        total: int,
        observe: Callable[[memoryview], None] | None,
    ) -> None:
        """A multipart upload of ``views``, at most ``max_concurrent_requests`` parts held at
        once (sent concurrently). With ``observe``, each part is first copied, in order, and
        the copy observed and sent; an upload that failed stops the copying."""
        part_bytes = max(self._part_bytes, -(-total // _MAX_PARTS))
        created = await self._call("create_multipart_upload", path)
        upload_id = created["UploadId"]
        held = asyncio.Semaphore(self._concurrency)

        async def upload(number: int, pieces: list[memoryview]) -> dict[str, Any]:
            try:
                done = await self._call(
                    "upload_part", path, UploadId=upload_id, PartNumber=number, Body=Body(pieces)
                )
            finally:
                held.release()
            return {"PartNumber": number, "ETag": done["ETag"]}

        tasks: list[asyncio.Future[dict[str, Any]]] = []
        try:
            for number, pieces in enumerate(split_parts(views, part_bytes), start=1):
                await held.acquire()
                try:
                    if failed := [e for t in tasks if t.done() and (e := t.exception())]:
                        raise failed[0]
                    if observe is not None:
                        data = await asyncio.to_thread(base.observed_copy, pieces, observe)
                        pieces = [memoryview(data)]
                except BaseException:
                    held.release()
                    raise
                tasks.append(asyncio.ensure_future(upload(number, pieces)))
            parts = await asyncio.gather(*tasks)
            await self._call(
                "complete_multipart_upload",
                path,
                UploadId=upload_id,
                MultipartUpload={"Parts": list(parts)},
            )
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # Best effort, and shielded: an upload left behind costs storage, not correctness.
            with contextlib.suppress(Exception):
                await asyncio.shield(self._call("abort_multipart_upload", path, UploadId=upload_id))
            raise

    # -- reads -----------------------------------------------------------------------------------

    async def read(self, path: str) -> bytes:
        return await self.read_limited(path, sys.maxsize)

    async def read_limited(self, path: str, limit: int) -> bytes:
        # One GET: its Content-Length is checked before any of the body is read, and the body
        # is read only to one byte past ``limit`` in any case, should the header be wrong.
        async with self._slots:
            response = await self._call_in_slot("get_object", path)
            length = response.get("ContentLength")
            async with response["Body"] as body:
                if length is not None and int(length) > limit:
                    raise BlobTooLargeError(self.describe(path), limit, int(length))
                pieces: list[bytes] = []
                got = 0
                while got <= limit:
                    piece = await body.read(limit + 1 - got)
                    if not piece:
                        break
                    pieces.append(piece)
                    got += len(piece)
        if got > limit:
            raise BlobTooLargeError(self.describe(path), limit)
        return b"".join(pieces)

    async def read_into(self, path: str, offset: int, out: memoryview) -> None:
        await self.readv_observed(path, offset, [out], None)

    async def readv(self, path: str, offset: int, outs: Sequence[memoryview]) -> None:
        await self.readv_observed(path, offset, outs, None)

    async def readv_observed(
        self,
        path: str,
        offset: int,
        outs: Sequence[memoryview],
        observe: Callable[[memoryview], None] | None,
    ) -> None:
        # Each piece is observed as it lands, while it is in the CPU's cache.
        total = sum(len(o) for o in outs)
        if total == 0:
            await self._call("head_object", path)  # FileNotFoundError when there is none
            return
        async with self._slots:
            response = await self._call_in_slot(
                "get_object", path, Range=f"bytes={offset}-{offset + total - 1}"
            )
            # "bytes 0-99/1000": a ranged GET tells the object's length for free.
            length = (response.get("ContentRange") or "").rpartition("/")[2]
            if length.isdigit():
                self._sizes[path] = int(length)
            async with response["Body"] as body:
                got = await _scatter(body, outs, observe)
        if got < total:
            raise base.short_read(self.describe(path), offset + got, offset + total)

    # -- metadata --------------------------------------------------------------------------------

    async def size(self, path: str) -> int | None:
        """The object's length: as a ranged read of it reported it (no request), else from a
        HEAD request."""
        if path in self._sizes:
            return self._sizes[path]
        head = await self._call("head_object", path)
        return int(head["ContentLength"])

    async def exists(self, path: str) -> bool:
        try:
            await self._call("head_object", path)
        except FileNotFoundError:
            return False
        return True

    async def list_names(self, limit: int) -> list[str] | None:
        """``ListObjectsV2`` pages (1,000 keys and common prefixes) until ``limit`` names or the
        end; None when listing is not allowed (``PutObject`` granted without ``ListBucket``)."""
        prefix = f"{self.prefix}/" if self.prefix else ""
        names: list[str] = []
        page: dict[str, Any] = {}
        while len(names) < limit:
            try:
                found = await self._call(
                    "list_objects_v2", None, Prefix=prefix, Delimiter="/",
                    MaxKeys=max(1, min(limit - len(names), 1000)), **page,
                )  # fmt: skip
            except PermissionError:
                return None
            names += [
                p["Prefix"][len(prefix) :].rstrip("/") for p in found.get("CommonPrefixes", [])
            ]
            names += [o["Key"][len(prefix) :] for o in found.get("Contents", [])]
            if not found.get("IsTruncated"):
                break
            page = {"ContinuationToken": found["NextContinuationToken"]}
        return names[:limit]

    async def delete(self, path: str) -> None:
        # S3 deletes a missing key without complaint; the contract asks for FileNotFoundError.
        self._sizes.pop(path, None)
        await self._call("head_object", path)
        await self._call("delete_object", path)

    async def delete_all(self) -> None:
        """Every key under the root's prefix, listed and deleted 1,000 at a time."""
        if not self.prefix:
            raise PermissionError(f"refusing to delete the whole bucket {self.bucket}")
        self._sizes.clear()
        while True:
            found = await self._call("list_objects_v2", None, Prefix=f"{self.prefix}/")
            keys = [{"Key": o["Key"]} for o in found.get("Contents", [])]
            if not keys:
                return
            done = await self._call("delete_objects", None, Delete={"Objects": keys})
            # Keys refused one by one come back in the answer (listed again, they would be
            # tried for ever).
            if errors := done.get("Errors"):
                key, message = errors[0].get("Key"), errors[0].get("Message")
                raise OSError(f"cannot delete s3://{self.bucket}/{key}: {message}")

    def forget(self) -> None:
        self._sizes.clear()

    async def close(self) -> None:
        self._closed = True
        creator = getattr(self.fs, "_s3creator", None)
        if creator is None:
            return
        self.fs._s3 = None
        self.fs._s3creator = None
        if hasattr(creator, "__aexit__"):
            await creator.__aexit__(None, None, None)
        elif hasattr(creator, "clear"):  # s3fs's per-region client cache
            await creator.clear()


async def _scatter(
    body: Any, outs: Sequence[memoryview], observe: Callable[[memoryview], None] | None
) -> int:
    """Copies a response body into ``outs`` in order, as its pieces arrive; returns how many
    bytes landed (fewer than asked when the body ends early).

    aiohttp hands out what the socket delivered (``readany``: pieces of up to a few hundred
    KiB); asking for a whole buffer's length instead (``read(n)``) makes it join the pieces
    into one new object of that size first, a copy more.
    """
    views = [o if o.format == "B" else o.cast("B") for o in outs if len(o)]
    content = getattr(body, "content", None)
    readany = getattr(content, "readany", None)
    i = pos = got = 0
    while i < len(views):
        data = await (readany() if readany is not None else body.read(1 << 20))
        if not data:
            break
        piece = memoryview(data)
        while piece and i < len(views):
            out = views[i]
            n = min(len(piece), len(out) - pos)
            out[pos : pos + n] = piece[:n]
            if observe is not None:
                observe(out[pos : pos + n])
            pos += n
            got += n
            piece = piece[n:]
            if pos == len(out):
                i += 1
                pos = 0
    return got


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and the errors it was raised from, outermost first."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _status_and_code(error: BaseException) -> tuple[int | None, str | None]:
    """The HTTP status and S3 error code of a botocore ``ClientError`` in ``error``'s chain."""
    for e in _chain(error):
        response = getattr(e, "response", None)
        if isinstance(response, dict) and "Error" in response:
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return status, response["Error"].get("Code")
    return None, None


# A piece of a request body: a 32 MiB body is 128 socket writes of pieces small enough to be
# reused from the allocator's heap.
_PIECE_BYTES = 256 << 10


class Body:
    """One request's body, read from the caller's buffers in pieces as it is sent: never copied
    whole. A file-like object (``read``, ``seek``, ``tell``, ``len``: what botocore needs) that
    aiohttp streams as an async iterable of ``bytes`` copies of at most ``_PIECE_BYTES`` (copies,
    not views: the transport may keep what it could not send after the request was given up,
    and the caller reuses its buffers once ``write`` returns)."""

    def __init__(self, views: list[memoryview]) -> None:
        self._views = views
        self._ends = list(itertools.accumulate(len(v) for v in views))  # each view's, in the body
        self._size = self._ends[-1] if views else 0
        self._pos = 0

    def __len__(self) -> int:
        return self._size

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def read(self, n: int | None = -1) -> bytes:
        end = self._size if n is None or n < 0 else min(self._size, self._pos + n)
        pieces = []
        i = bisect.bisect_right(self._ends, self._pos)  # the view holding ``_pos``
        while self._pos < end:
            start = self._ends[i] - len(self._views[i])
            pieces.append(self._views[i][self._pos - start : end - start])
            self._pos += len(pieces[-1])
            i += 1
        return b"".join(pieces)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while piece := self.read(_PIECE_BYTES):
            yield piece

    def close(self) -> None:
        self._views, self._ends, self._size = [], [], 0


def split_parts(views: list[memoryview], part_bytes: int) -> Iterator[list[memoryview]]:
    """Cuts the concatenation of ``views`` into consecutive parts of ``part_bytes`` (the last
    one shorter), each a list of slices of the views: nothing is copied."""
    part: list[memoryview] = []
    room = part_bytes
    for v in views:
        while len(v):
            take = v[:room]
            part.append(take)
            v = v[len(take) :]
            room -= len(take)
            if room == 0:
                yield part
                part, room = [], part_bytes
    if part:
        yield part
