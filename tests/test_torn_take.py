"""A take while another thread changes the tensors in place (an EMA updater, a data-parallel
hook): the values written may be torn, a mix of old and new, as ``torch.save``'s would be, but
the snapshot must restore exactly the bytes that reached storage. Every recorded CRC-32 is of
those bytes, on every write path and store; a take either commits a snapshot that restores and
verifies, or fails with a ``SnapshotError``, never commits one that raises ``ChecksumError``.

The mutator loops over all tensors, adding in place, for as long as the take runs; with many
tensors and blobs, each take meets many writes whose memory changes under them."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from snapshot import Options, Snapshot, StateDict
from snapshot._engine.tools.verify import verify
from snapshot.errors import ChecksumError, SnapshotError
from tests.s3server import S3Bucket

MIB = 1 << 20
ROUNDS = 3


@contextmanager
def mutated(tensors: list[torch.Tensor]) -> Iterator[list[int]]:
    """A thread that adds 1 in place to every tensor, over and over, until the block ends;
    yields a one-item list counting its passes over the tensors."""
    stop = threading.Event()
    passes = [0]

    def run() -> None:
        while not stop.is_set():
            for t in tensors:
                t.add_(1)
            passes[0] += 1

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield passes
    finally:
        stop.set()
        thread.join()


def small_state(count: int = 600) -> dict[str, torch.Tensor]:
    """Many small tensors (4-64 KiB): slabs."""
    g = torch.Generator().manual_seed(0)
    return {
        f"s{i}": torch.randint(0, 1 << 20, (1024 * (1 + i % 16),), generator=g, dtype=torch.int32)
        for i in range(count)
    }


def large_state(count: int = 8, mib: int = 6) -> dict[str, torch.Tensor]:
    """Tensors of several MiB, each followed by one of 4 KiB: slabs whose large members are
    written from their own memory and the small ones from a copy (``ALONE``: a blob each)."""
    g = torch.Generator().manual_seed(1)
    state = {}
    for i in range(count):
        state[f"w{i}"] = torch.randint(
            0, 1 << 20, (mib * MIB // 4,), generator=g, dtype=torch.int32
        )
        state[f"w{i}b"] = torch.randint(0, 1 << 20, (1024,), generator=g, dtype=torch.int32)
    return state


# Large tensors in blobs of their own.
ALONE = Options(slab_threshold_bytes=MIB)


def take_mutated(
    path: str,
    state: dict[str, torch.Tensor],
    storage_options: dict[str, Any] | None,
    options: Options | None,
    asynchronous: bool = False,
) -> bool:
    """Takes ``state`` at ``path`` while a thread changes its tensors; True when the take
    committed, False when it failed with a ``SnapshotError`` (never any other error)."""
    tensors = list(state.values())
    with mutated(tensors) as passes:
        try:
            if asynchronous:
                pending = Snapshot.async_take(
                    path, {"m": StateDict(state)}, storage_options=storage_options, options=options
                )
                pending.wait()
            else:
                Snapshot.take(
                    path, {"m": StateDict(state)}, storage_options=storage_options, options=options
                )
        except SnapshotError:
            return False
    assert passes[0] > 0, "the mutator never ran during the take"
    return True


def check_restores(
    path: str, state: dict[str, torch.Tensor], storage_options: dict[str, Any] | None
) -> None:
    """The committed snapshot at ``path`` restores (every CRC checked against the bytes read)
    and verifies; every tensor comes back with a value it could have had while written."""
    report = verify(path, storage_options)
    assert report.ok, [p.what for p in report.problems]
    assert report.checksums_checked > 0
    targets = {k: torch.full_like(v, -1) for k, v in state.items()}
    snap = Snapshot(path, storage_options=storage_options)
    try:
        snap.restore({"m": StateDict(targets)})
    except ChecksumError as e:  # the bug: a committed snapshot that never restores
        pytest.fail(f"a committed snapshot does not restore: {e}")
    for k, t in targets.items():
        # Every element was written at some moment of the take: at least its first value,
        # at most its value when the take ended (the mutator only adds).
        assert bool((t >= 0).all()), k
        assert bool((t <= state[k]).all()), k


def run_rounds(
    url: Callable[[int], str],
    make_state: Callable[[], dict[str, torch.Tensor]],
    storage_options: dict[str, Any] | None = None,
    options: Options | None = None,
    asynchronous: bool = False,
) -> None:
    committed = 0
    for r in range(ROUNDS):
        state = make_state()
        path = url(r)
        if take_mutated(path, state, storage_options, options, asynchronous):
            committed += 1
            check_restores(path, state, storage_options)
    assert committed > 0, "no take committed: nothing was checked"


def _direct_io_works(directory: str) -> bool:
    if not hasattr(os, "O_DIRECT"):
        return False
    import mmap

    probe = os.path.join(directory, ".direct-probe")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    try:
        os.write(fd, mmap.mmap(-1, 4096))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(probe)


# ---------------------------------------------------------------------------------------------
# Local files.

_FS_MODES = {
    "page-cache": {"fsync": False, "direct_io": False},
    "page-cache-fsync": {"fsync": True, "direct_io": False},
    "direct": {"fsync": False, "direct_io": True},
}


@pytest.mark.parametrize("mode", list(_FS_MODES))
@pytest.mark.parametrize("sizes", ["small", "large", "alone"])
def test_fs_take_mutated_meanwhile_restores(tmp_path, mode: str, sizes: str) -> None:
    if mode == "direct" and not _direct_io_works(str(tmp_path)):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT writes")
    make = small_state if sizes == "small" else large_state
    options = ALONE if sizes == "alone" else None
    run_rounds(lambda r: str(tmp_path / f"snap{r}"), make, _FS_MODES[mode], options)


def test_fs_slabs_written_directly_restore(tmp_path) -> None:
    """Slabs of 1 MiB and more written with direct I/O (with fsync on, as by default)."""
    if not _direct_io_works(str(tmp_path)):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT writes")
    options = {"fsync": True, "direct_io": True}
    run_rounds(lambda r: str(tmp_path / f"snap{r}"), lambda: small_state(1200), options)


def test_fs_objects_and_unchunked_blobs_restore(tmp_path) -> None:
    """Without slabs every small tensor is a blob of its own, checksummed as written."""
    options = Options(slab_threshold_bytes=0)
    run_rounds(
        lambda r: str(tmp_path / f"snap{r}"),
        lambda: small_state(300),
        {"fsync": False, "direct_io": False},
        options,
    )


# ---------------------------------------------------------------------------------------------
# Other stores.


@pytest.mark.parametrize("sizes", ["small", "large", "alone", "blobs"])
def test_memory_take_mutated_meanwhile_restores(sizes: str) -> None:
    root = uuid.uuid4().hex
    options = {"blobs": Options(slab_threshold_bytes=0), "alone": ALONE}.get(sizes)
    make = {"blobs": lambda: small_state(300), "small": small_state}.get(sizes, large_state)
    run_rounds(lambda r: f"memory://{root}/snap{r}", make, None, options)


@pytest.mark.slow
@pytest.mark.parametrize("sizes", ["small", "large", "alone"])
def test_s3_take_mutated_meanwhile_restores(s3_bucket: S3Bucket, sizes: str) -> None:
    # 5 MiB parts: the slabs and the large tensors (6 MiB) go up as multipart uploads.
    storage_options = {**s3_bucket.storage_options, "part_bytes": 5 * MIB}
    make = small_state if sizes == "small" else (lambda: large_state(count=4))
    options = ALONE if sizes == "alone" else None
    run_rounds(lambda r: s3_bucket.url(f"snap{r}"), make, storage_options, options)


def _local_fsspec(root: str, storage_options: dict[str, Any] | None = None) -> Any:
    """fsspec's local file system (``file://``) under the test protocol ``fsspecfile://``."""
    from storage_plugins.fsspec_plugin import FSSpecStoragePlugin

    return FSSpecStoragePlugin("file://" + root.partition("://")[2], storage_options)


@pytest.mark.parametrize("sizes", ["small", "large"])
def test_fsspec_take_mutated_meanwhile_restores(tmp_path, sizes: str) -> None:
    from storage_plugins import register_storage_plugin, unregister_storage_plugin

    register_storage_plugin("fsspecfile", _local_fsspec)
    try:
        make = small_state if sizes == "small" else large_state
        run_rounds(lambda r: f"fsspecfile://{tmp_path}/snap{r}", make)
    finally:
        unregister_storage_plugin("fsspecfile")


# ---------------------------------------------------------------------------------------------
# async_take: every payload is copied into a pooled buffer before anything reads it; the CRCs
# and the writes are of that copy.


@pytest.mark.slow
@pytest.mark.parametrize("sizes", ["small", "large"])
@pytest.mark.parametrize("store", ["fs", "memory"])
def test_async_take_mutated_meanwhile_restores(tmp_path, store: str, sizes: str) -> None:
    make = small_state if sizes == "small" else large_state
    if store == "fs":
        url: Callable[[int], str] = lambda r: str(tmp_path / f"snap{r}")  # noqa: E731
        storage_options: dict[str, Any] | None = {"fsync": False, "direct_io": False}
    else:
        root = uuid.uuid4().hex
        url = lambda r: f"memory://{root}/snap{r}"  # noqa: E731
        storage_options = None
    run_rounds(url, make, storage_options, asynchronous=True)


def test_s3_observed_upload_sends_the_bytes_it_observed() -> None:
    """An observed upload observes a private copy of the caller's buffers and sends that copy:
    memory changed after it was observed never reaches the body, however often botocore reads
    it (hashing it first, or re-sending it)."""
    import asyncio

    pytest.importorskip("s3fs")
    from storage_plugins.s3 import S3StoragePlugin

    sent: list = []

    async def call(method: str, path: str, **kwargs):
        sent.append(kwargs["Body"])
        return {}

    plugin = S3StoragePlugin.__new__(S3StoragePlugin)  # no client: the request is caught
    plugin._sizes, plugin._part_bytes, plugin._call = {}, 1 << 20, call
    data = bytearray(os.urandom(1000))
    seen: list[bytes] = []

    def observe(view: memoryview) -> None:
        if not seen:
            data[500] ^= 1  # the application writes its tensor right after
        seen.append(bytes(view))

    asyncio.run(
        plugin.write_observed("b", [memoryview(data)[:300], memoryview(data)[300:]], observe)
    )
    (body,) = sent
    first = body.read(400) + body.read(-1)
    body.seek(0)
    assert first == body.read(-1) == b"".join(seen) != bytes(data)
