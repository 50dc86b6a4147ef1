"""One suite, every storage plugin: the StoragePlugin contract, checked the same way for each."""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
import pytest_asyncio

from storage_plugins import BlobTooLargeError, StoragePlugin
from storage_plugins.fs import FSStoragePlugin
from storage_plugins.fsspec_plugin import FSSpecStoragePlugin
from storage_plugins.memory import MemoryStoragePlugin
from storage_plugins.s3 import S3StoragePlugin

PluginMaker = Callable[[], StoragePlugin]


def _makers(tmp_path, request: pytest.FixtureRequest) -> dict[str, PluginMaker]:
    def s3(**options: object) -> StoragePlugin:
        bucket = request.getfixturevalue("s3_bucket")  # starts the S3 server on first use
        return S3StoragePlugin(bucket.url("root"), {**bucket.storage_options, **options})

    return {
        # A real S3 endpoint (moto's server on loopback); with 5 MiB parts, the blobs of a few
        # MiB below go through multipart uploads.
        "s3": s3,
        "s3-multipart": lambda: s3(part_bytes=5 << 20),
        "fs": lambda: FSStoragePlugin(str(tmp_path / "fs")),
        # Through the page cache without fsync ("auto" would write directly on a VM that
        # reports free memory to its host, as "fs-direct" does).
        "fs-nofsync": lambda: FSStoragePlugin(
            str(tmp_path / "fs2"), {"fsync": False, "direct_io": False}
        ),
        "fs-direct": lambda: FSStoragePlugin(
            str(tmp_path / "fs3"), {"fsync": False, "direct_io": True}
        ),
        "memory": lambda: MemoryStoragePlugin(f"memory://{uuid.uuid4().hex}"),
        "fsspec-memory": lambda: FSSpecStoragePlugin(f"memory://{uuid.uuid4().hex}/root"),
        "fsspec-file": lambda: FSSpecStoragePlugin(f"file://{tmp_path}/fsspec"),
    }


PLUGINS = [
    "fs",
    "fs-nofsync",
    "fs-direct",
    "memory",
    "fsspec-memory",
    "fsspec-file",
    "s3",
    "s3-multipart",
]


@pytest_asyncio.fixture(params=PLUGINS)
async def plugin(request, tmp_path) -> AsyncIterator[StoragePlugin]:
    p = _makers(tmp_path, request)[request.param]()
    try:
        yield p
    finally:
        await p.close()


async def read_range(p: StoragePlugin, path: str, offset: int, n: int) -> bytes:
    out = bytearray(n)
    await p.read_into(path, offset, memoryview(out))
    return bytes(out)


@pytest.mark.asyncio
async def test_write_then_read(plugin):
    await plugin.write("a", [b"hello ", bytearray(b"big "), memoryview(b"world")])
    assert await plugin.read("a") == b"hello big world"
    assert await plugin.exists("a")
    assert not await plugin.exists("b")


@pytest.mark.asyncio
async def test_empty_blob_and_nested_paths(plugin):
    await plugin.write("x/y/z/empty", [])
    assert await plugin.read("x/y/z/empty") == b""
    assert await plugin.exists("x/y/z/empty")
    await plugin.read_into("x/y/z/empty", 0, memoryview(bytearray()))


@pytest.mark.asyncio
async def test_ranged_reads(plugin):
    data = bytes(range(256)) * 40
    await plugin.write("r", [data])
    assert await read_range(plugin, "r", 0, 10) == data[:10]
    assert await read_range(plugin, "r", 1000, 500) == data[1000:1500]
    assert await read_range(plugin, "r", len(data) - 3, 3) == data[-3:]
    assert await read_range(plugin, "r", 0, len(data)) == data


@pytest.mark.asyncio
async def test_reading_past_the_end_is_eof(plugin):
    await plugin.write("short", [b"12345"])
    with pytest.raises(EOFError):
        await read_range(plugin, "short", 3, 5)
    with pytest.raises(EOFError):
        await read_range(plugin, "short", 10, 1)


@pytest.mark.asyncio
async def test_missing_blob_is_file_not_found(plugin):
    with pytest.raises(FileNotFoundError):
        await plugin.read("nope")
    with pytest.raises(FileNotFoundError):
        await read_range(plugin, "nope", 0, 1)
    with pytest.raises(FileNotFoundError):
        await plugin.delete("nope")


@pytest.mark.asyncio
async def test_read_limited_reads_a_blob_up_to_the_limit_and_refuses_a_longer_one(plugin):
    data = bytes(range(256)) * 4
    await plugin.write("m", [data])
    await plugin.write("d/empty", [])
    assert await plugin.read_limited("m", len(data)) == data
    assert await plugin.read_limited("m", 1 << 30) == data
    assert await plugin.read_limited("d/empty", 0) == b""
    with pytest.raises(BlobTooLargeError, match=f"over the limit of {len(data) - 1} bytes") as e:
        await plugin.read_limited("m", len(data) - 1)
    assert e.value.limit == len(data) - 1
    with pytest.raises(FileNotFoundError):
        await plugin.read_limited("nope", 10)


@pytest.mark.asyncio
async def test_size(plugin):
    await plugin.write("sized", [b"12345", b"678"])
    await plugin.write("d/empty", [])
    # Every built-in plugin knows sizes (None would mean "cannot tell").
    assert await plugin.size("sized") == 8
    assert await plugin.size("d/empty") == 0
    await plugin.write("sized", [b"1"])
    assert await plugin.size("sized") == 1
    with pytest.raises(FileNotFoundError):
        await plugin.size("nope")


@pytest.mark.asyncio
async def test_sizes_learned_by_reads_do_not_outlive_writes_and_deletes(plugin):
    # Some plugins answer ``size`` from what a read saw (S3's ranged GETs): a later write or delete through the plugin must not leave it stale.
    await plugin.write("s", [b"0123456789"])
    assert await read_range(plugin, "s", 2, 3) == b"234"
    assert await plugin.size("s") == 10
    await plugin.write("s", [b"01234567890123"])
    assert await plugin.size("s") == 14
    assert await read_range(plugin, "s", 0, 1) == b"0"
    assert await plugin.size("s") == 14
    await plugin.delete("s")
    with pytest.raises(FileNotFoundError):
        await plugin.size("s")


@pytest.mark.asyncio
async def test_observed_writes_and_reads_see_every_byte_once_in_order(plugin):
    # Large enough to be written and read in several pieces by plugins that slice.
    parts = [bytes(range(256)) * 4096 * 3, b"", b"tail", bytes(3 << 20)]
    data = b"".join(parts)
    seen: list[bytes] = []
    await plugin.write_observed(
        "obs", [memoryview(p) for p in parts], lambda v: seen.append(bytes(v))
    )
    assert b"".join(seen) == data and await plugin.read("obs") == data
    seen.clear()
    outs = [memoryview(bytearray(n)) for n in (5, 1 << 20, len(data) - 15 - (1 << 20))]
    await plugin.readv_observed("obs", 10, outs, lambda v: seen.append(bytes(v)))
    assert b"".join(seen) == data[10:] == b"".join(bytes(o) for o in outs)


@pytest.mark.asyncio
async def test_observed_writes_of_frozen_buffers_see_every_byte_once_in_order(plugin):
    """``FrozenBuffers``: memory that does not change while written; every plugin (those that
    know nothing of it too) observes and stores the same bytes as from any other buffers."""
    from storage_plugins.base import FrozenBuffers

    parts = [bytearray(range(256)) * 4096 * 3, bytearray(), bytearray(b"tail"), bytearray(3 << 20)]
    data = b"".join(parts)
    seen: list[bytes] = []
    frozen = FrozenBuffers(memoryview(p) for p in parts)
    await plugin.write_observed("frozen", frozen, lambda v: seen.append(bytes(v)))
    assert b"".join(seen) == data and await plugin.read("frozen") == data


@pytest.mark.asyncio
async def test_overwrite_replaces(plugin):
    await plugin.write("o", [b"first version, long"])
    await plugin.write("o", [b"second"])
    assert await plugin.read("o") == b"second"


@pytest.mark.asyncio
async def test_delete(plugin):
    await plugin.write("d/1", [b"x"])
    await plugin.delete("d/1")
    assert not await plugin.exists("d/1")
    with pytest.raises(FileNotFoundError):
        await plugin.read("d/1")


@pytest.mark.asyncio
async def test_delete_all_removes_everything_under_the_root(plugin):
    for blob in ("a", "d/1", "d/e/2"):
        await plugin.write(blob, [b"x" * 10])
    await plugin.delete_all()
    for blob in ("a", "d/1", "d/e/2"):
        assert not await plugin.exists(blob)
    assert not await plugin.list_names(10)
    await plugin.delete_all()  # nothing left: nothing to do, no error


@pytest.mark.asyncio
async def test_a_listing_holds_every_top_level_name_hidden_ones_too(plugin):
    """A take's path checks rest on it: a list of fewer than ``limit`` names is whole (the
    marker files are hidden names); None means the store cannot list, and is asked per name."""
    for blob in (".metadata", "manifest.yaml", "d/1", "d/e/2"):
        await plugin.write(blob, [b"x"])
    listed = await plugin.list_names(10)
    if listed is not None:
        assert sorted(listed) == [".metadata", "d", "manifest.yaml"]
        assert len(await plugin.list_names(2)) == 2
    for blob in (".metadata", "manifest.yaml"):
        assert await plugin.exists(blob)


@pytest.mark.asyncio
async def test_delete_all_leaves_siblings_alone(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"k")
    root = tmp_path / "root"
    p = FSStoragePlugin(str(root))
    await p.write("a/b", [b"x"])
    (root / "link").symlink_to(outside)  # a link below the root: removed, not followed
    await p.delete_all()
    assert not root.exists() and (outside / "keep").read_bytes() == b"k"
    sibling = MemoryStoragePlugin("memory://shared/root2")
    mine = MemoryStoragePlugin("memory://shared/root")
    await sibling.write("x", [b"1"])
    await mine.write("x", [b"2"])
    await mine.delete_all()
    assert await sibling.exists("x") and not await mine.exists("x")


@pytest.mark.asyncio
async def test_concurrent_writes_and_reads(plugin):
    blobs = {f"c/{i}": bytes([i]) * (1000 + i) for i in range(64)}
    await asyncio.gather(*(plugin.write(k, [v]) for k, v in blobs.items()))
    got = await asyncio.gather(*(plugin.read(k) for k in blobs))
    assert got == list(blobs.values())


@pytest.mark.asyncio
async def test_buffers_may_be_reused_after_write(plugin):
    buf = bytearray(b"A" * 4096)
    await plugin.write("reuse", [memoryview(buf)])
    buf[:] = b"B" * 4096
    assert await plugin.read("reuse") == b"A" * 4096


@pytest.mark.asyncio
async def test_large_blob_from_many_buffers(plugin):
    parts = [bytes([i % 251]) * (1 << 16) for i in range(128)]  # 8 MiB
    await plugin.write("large", [memoryview(p) for p in parts])
    assert await read_range(plugin, "large", 5 << 16, 1 << 16) == parts[5]
    assert await plugin.read("large") == b"".join(parts)


@pytest.mark.asyncio
async def test_sync_and_describe(plugin):
    await plugin.write("s/1", [b"x"])
    await plugin.sync()
    assert "s/1" in plugin.describe("s/1")


@pytest.mark.asyncio
async def test_scatter_reads(plugin):
    data = bytes(range(256)) * 16
    await plugin.write("v", [data])
    outs = [bytearray(n) for n in (10, 0, 1, 300, 2000)]
    await plugin.readv("v", 7, [memoryview(o) for o in outs])
    pos = 7
    for o in outs:
        assert bytes(o) == data[pos : pos + len(o)]
        pos += len(o)
    many = [bytearray(2) for _ in range(1500)]  # more buffers than one system call takes
    await plugin.readv("v", 0, [memoryview(o) for o in many])
    assert b"".join(many) == data[:3000]
    with pytest.raises(EOFError):
        await plugin.readv("v", len(data) - 4, [memoryview(bytearray(2)), memoryview(bytearray(3))])
    with pytest.raises(FileNotFoundError):
        await plugin.readv("absent", 0, [memoryview(bytearray(1))])


@pytest.mark.asyncio
async def test_fs_sync_makes_new_entries_durable_up_to_the_folders_it_made(tmp_path, monkeypatch):
    """A power loss after ``sync`` keeps every blob under its name: ``sync`` fsyncs each
    directory a blob was renamed into or a directory made in, the folders above the root that
    the plugin made included; with ``fsync=False``, none."""
    synced: list[str] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")))
    top = os.path.realpath(tmp_path)
    root = os.path.join(top, "new", "snap")
    plugin = FSStoragePlugin(root)
    await plugin.write("0/a/blob", [b"x" * 10])
    await plugin.write("marker", [b"y"])
    synced.clear()  # the files' own fsyncs
    await plugin.sync()
    assert sorted(synced) == sorted([top, os.path.dirname(root), root, f"{root}/0", f"{root}/0/a"])
    synced.clear()
    await plugin.sync()  # nothing new since
    assert synced == []
    await plugin.write("0/a/other", [b"z"])
    synced.clear()
    await plugin.sync()
    assert synced == [f"{root}/0/a"]
    await plugin.close()
    monkeypatch.setattr(os, "fsync", real)
    quiet = FSStoragePlugin(str(tmp_path / "quiet"), {"fsync": False})
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append("called"))
    synced.clear()
    await quiet.write("0/blob", [b"x"])
    await quiet.sync()
    assert synced == []
    await quiet.close()


class _Recorder:
    """An observer with the optional bulk method: records every piece shown, either way."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.bulk_calls = 0

    def __call__(self, view: memoryview) -> None:
        self.pieces.append(bytes(view))

    def many(self, views: list[memoryview]) -> None:
        self.bulk_calls += 1
        self.pieces.extend(bytes(v) for v in views)


def test_fs_write_buffers_are_kept_for_the_next_plugin(tmp_path, monkeypatch):
    """A take opens a plugin of its own: the aligned buffers its checksummed writes go through
    are kept for the next one (fresh ones cost each take a page fault per page), one per write
    under way at once."""
    import mmap

    from storage_plugins import fs

    made: list[int] = []
    real = mmap.mmap
    monkeypatch.setattr(fs.mmap, "mmap", lambda fd, n, **kw: made.append(n) or real(fd, n, **kw))
    monkeypatch.setattr(fs, "_free_buffers", [])
    parts = [memoryview(os.urandom(5000)), memoryview(os.urandom(70_000))]
    for n in range(3):
        plugin = fs.FSStoragePlugin(str(tmp_path), {"fsync": False, "direct_io": False})
        rec = _Recorder()
        plugin._write_sync(f"blob{n}", parts, rec)
        asyncio.run(plugin.close())
        assert b"".join(rec.pieces) == b"".join(parts) == (tmp_path / f"blob{n}").read_bytes()
    assert made == [fs._DIRECT_PIECE_BYTES] and len(fs._free_buffers) == 1
    with fs._bounce_buffer() as a, fs._bounce_buffer() as b:  # two writes at once: two
        assert a is not b
    assert len(made) == 2 and len(fs._free_buffers) == 2
    # A forked child that writes through a kept buffer writes to a copy of its own.
    kept = fs._free_buffers[-1]
    kept[:4] = b"mine"
    pid = os.fork()
    if pid == 0:  # the child leaves by os._exit whatever happens: never back into pytest
        code = 1
        try:
            with fs._bounce_buffer() as buf:
                code = 0 if buf is kept else 2  # (the buffer the parent kept, as it was)
                buf[:4] = b"fork"
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0 and bytes(kept[:4]) == b"mine"


@pytest.mark.parametrize("bulk", [False, True])
@pytest.mark.parametrize(
    ("most", "count"), [(1, 30), (7, 300), (4096, 1500), (None, 1500), (50_000, 40), (None, 40)]
)
def test_fs_transfers_survive_short_system_calls(tmp_path, monkeypatch, most, count, bulk):
    """The local plugin resumes after vectored reads and writes that move fewer bytes than
    asked (at most ``most`` per call here), over more buffers than one call takes and buffers
    larger than one call moves, and shows an observer every byte once, in order."""
    import os
    import random

    from storage_plugins import fs

    rng = random.Random(most)
    sizes = {1500: [0, 1, 3, 100, 5000], 40: [0, 1, 100, 150_000]}.get(count, [0, 1, 3, 100])
    parts = [rng.randbytes(rng.choice(sizes)) for _ in range(count)]
    data = b"".join(parts)
    real_writev, real_preadv = os.writev, os.preadv
    calls = [0]

    def cut(batch: list[memoryview]) -> list[memoryview]:
        calls[0] += 1
        if most is None:
            return batch
        n = rng.randint(1, most)
        out = []
        for b in batch:
            out.append(b[:n])
            n -= len(out[-1])
            if n <= 0:
                break
        return out

    monkeypatch.setattr(fs.os, "writev", lambda fd, batch: real_writev(fd, cut(batch)))
    monkeypatch.setattr(fs.os, "preadv", lambda fd, batch, pos: real_preadv(fd, cut(batch), pos))
    # Several calls even unshortened: observed writes go through a buffer this long.
    monkeypatch.setattr(fs, "_DIRECT_PIECE_BYTES", 64 << 10)
    monkeypatch.setattr(fs, "_OBSERVED_READ_BYTES", 64 << 10)
    plugin = fs.FSStoragePlugin(str(tmp_path), {"fsync": False, "direct_io": False})

    def observer():
        rec = _Recorder()
        return rec if bulk else (lambda v: rec(v)), rec

    observe, rec = observer()
    plugin._write_sync("blob", [memoryview(p) for p in parts], observe)
    assert (tmp_path / "blob").read_bytes() == data
    # (observed writes go through a lent buffer, shown a buffer-full at a time)
    assert b"".join(rec.pieces) == data and all(rec.pieces)
    assert calls[0] >= 2  # cut short, or more buffers than one call takes
    outs = [memoryview(bytearray(len(p))) for p in parts]
    observe, rec = observer()
    plugin._readv_sync("blob", 0, outs, observe)
    assert b"".join(bytes(o) for o in outs) == data == b"".join(rec.pieces)
    assert (rec.bulk_calls > 0) == bulk
    outs = [memoryview(bytearray(len(p))) for p in parts[1:]]
    plugin._readv_sync("blob", len(parts[0]), outs, None)
    assert b"".join(bytes(o) for o in outs) == data[len(parts[0]) :]
    with pytest.raises(EOFError, match="ends at byte"):
        plugin._readv_sync("blob", 5, [memoryview(bytearray(len(data)))], None)


def test_fs_write_that_makes_no_progress_fails_rather_than_spins(tmp_path, monkeypatch):
    from storage_plugins import fs

    monkeypatch.setattr(fs.os, "writev", lambda fd, batch: 0)
    plugin = fs.FSStoragePlugin(str(tmp_path), {"fsync": False})
    with pytest.raises(OSError, match="moved no bytes at byte 0 of 6"):
        plugin._write_sync("blob", [b"abc", b"def"])
    assert not list(tmp_path.iterdir())  # the temporary file is gone


# ---------------------------------------------------------------------------------------------
# Direct I/O (O_DIRECT) in the local plugin.


def _accepts_direct_io(directory) -> bool:
    """Whether the file system under ``directory`` takes an aligned O_DIRECT write."""
    import mmap
    import os

    if not hasattr(os, "O_DIRECT"):
        return False
    probe = os.path.join(directory, ".direct-probe")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        if os.path.exists(probe):  # created, then the flag refused
            os.unlink(probe)
        return False
    try:
        os.pwrite(fd, memoryview(mmap.mmap(-1, 4096)), 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(probe)


class _Syscalls:
    """Records the flags of every file the local plugin opens and its direct writes."""

    def __init__(self, monkeypatch, fs) -> None:
        import os

        self.opened: list[tuple[str, int]] = []
        self.pwrites: list[tuple[int, int, int]] = []  # (buffer address % 4096, offset, len)
        real_open, real_pwrite = os.open, os.pwrite

        def open_(path, flags, *rest, **kwargs):
            self.opened.append((str(path), flags))
            return real_open(path, flags, *rest, **kwargs)

        def pwrite(fd, buf, offset):
            import ctypes

            view = memoryview(buf)
            address = ctypes.addressof(ctypes.c_char.from_buffer(view)) if not view.readonly else 0
            self.pwrites.append((address % 4096, offset, len(view)))
            return real_pwrite(fd, buf, offset)

        monkeypatch.setattr(fs.os, "open", open_)
        monkeypatch.setattr(fs.os, "pwrite", pwrite)

    def direct_opens(self) -> int:
        import os

        return sum(1 for _, flags in self.opened if flags & os.O_DIRECT)


_LAYOUTS = {
    # (buffer sizes) with a 16 KiB piece: every way bytes can meet the buffer's edges.
    "one exact piece": [16384],
    "pieces and a byte": [3 * 16384 + 1],
    "small then large": [100, 5 * 16384 + 7, 3],
    "many small": [0, 1, 4095, 4096, 4097, 777] * 40,
    "large views at the edge": [16384 - 1, 16384 + 1, 2 * 16384, 0, 1],
    "views ending at the edges": [8192, 8192, 16384 - 100, 100, 16384, 3],
    "a view over pieces, mid-buffer": [100, 3 * 16384, 50, 16384 - 150, 16384],
    "thousands of slab members": [4096, 12, 10240, 4, 65536, 16, 20000] * 300,
}


@pytest.mark.skipif(not hasattr(__import__("os"), "O_DIRECT"), reason="O_DIRECT is Linux's")
@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
@pytest.mark.parametrize("fsync", [True, False])
def test_fs_direct_writes_every_byte_once_from_aligned_memory(tmp_path, monkeypatch, layout, fsync):
    import random

    from storage_plugins import fs

    if not _accepts_direct_io(tmp_path):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT writes")
    monkeypatch.setattr(fs, "_DIRECT_PIECE_BYTES", 16384)
    monkeypatch.setattr(fs, "_DIRECT_MIN_BYTES", 1)
    rng = random.Random(layout)
    parts = [rng.randbytes(n) for n in _LAYOUTS[layout]]
    data = b"".join(parts)
    calls = _Syscalls(monkeypatch, fs)
    plugin = fs.FSStoragePlugin(str(tmp_path / "d"), {"fsync": fsync, "direct_io": True})
    rec = _Recorder()
    plugin._write_sync("blob", [memoryview(p) for p in parts], rec)
    assert (tmp_path / "d" / "blob").read_bytes() == data
    assert b"".join(rec.pieces) == data and all(rec.pieces)
    assert calls.direct_opens() == 1
    # Every write from page-aligned memory, at aligned offsets, of aligned lengths, in order.
    assert calls.pwrites
    assert all(addr == 0 and off % 4096 == 0 and n % 4096 == 0 for addr, off, n in calls.pwrites)
    assert [off for _, off, _ in calls.pwrites] == list(range(0, len(calls.pwrites) * 16384, 16384))
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["blob"]


@pytest.mark.skipif(not hasattr(__import__("os"), "O_DIRECT"), reason="O_DIRECT is Linux's")
@pytest.mark.parametrize("tail", [0, 1, 4095])
@pytest.mark.parametrize("frozen", [True, False])
def test_fs_writes_frozen_aligned_buffers_as_they_are(tmp_path, monkeypatch, tail, frozen):
    """Observed direct writes of ``FrozenBuffers`` go from their own page-aligned memory (only
    an unaligned tail through a lent buffer), observed as written; other buffers, which
    may change meanwhile, are copied into a lent buffer first, as before."""
    import mmap
    import os

    from storage_plugins import fs
    from storage_plugins.base import FrozenBuffers

    if not _accepts_direct_io(tmp_path):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT writes")
    monkeypatch.setattr(fs, "_DIRECT_PIECE_BYTES", 16384)
    monkeypatch.setattr(fs, "_DIRECT_CALL_BYTES", 32768)
    monkeypatch.setattr(fs, "_DIRECT_MIN_BYTES", 1)
    nbytes = 5 * 16384 + tail
    memory = mmap.mmap(-1, nbytes)
    memory[:] = os.urandom(nbytes)
    view = memoryview(memory)
    buffers = FrozenBuffers((view,)) if frozen else [view]
    calls = _Syscalls(monkeypatch, fs)
    seen: list[bytes] = []
    plugin = fs.FSStoragePlugin(str(tmp_path / "d"), {"fsync": True})
    asyncio.run(plugin.write_observed("blob", buffers, lambda v: seen.append(bytes(v))))
    assert (tmp_path / "d" / "blob").read_bytes() == bytes(memory) == b"".join(seen)
    assert calls.direct_opens() == 1
    assert all(off % 4096 == 0 and n % 4096 == 0 for _, off, n in calls.pwrites)
    assert sum(n for _, _, n in calls.pwrites) == -(-nbytes // 4096) * 4096
    if frozen:  # the aligned part in calls of at most _DIRECT_CALL_BYTES, then the tail
        assert [n for _, _, n in calls.pwrites] == [32768, 32768, 16384] + ([4096] if tail else [])
    else:  # a piece of the thread's buffer at a time
        assert [n for _, _, n in calls.pwrites] == [16384] * 5 + ([4096] if tail else [])
    del view, buffers


class _FakeVirtio:
    """A sysfs tree of virtio devices for ``fs.direct_without_fsync`` to read."""

    def __init__(self, root) -> None:
        self.root = root
        root.mkdir()

    def device(self, name: str, device_id: int | str, feature_bits: set[int]) -> None:
        d = self.root / name
        d.mkdir()
        ident = device_id if isinstance(device_id, str) else f"0x{device_id:04x}"
        (d / "device").write_text(ident + "\n")
        bits = "".join("1" if i in feature_bits else "0" for i in range(64))
        (d / "features").write_text(bits + "\n")


@pytest.fixture
def fake_virtio(tmp_path, monkeypatch):
    from storage_plugins import fs

    monkeypatch.setattr(fs, "_VIRTIO_DEVICES", str(tmp_path / "virtio-devices"))
    fs.direct_without_fsync.cache_clear()  # decided once per process: again from the fake
    yield _FakeVirtio(tmp_path / "virtio-devices")
    fs.direct_without_fsync.cache_clear()  # and again from the machine after the test


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        ([], False),
        ([("virtio0", 5, {5})], True),  # a balloon with free page reporting
        ([("virtio0", 5, {1, 2, 3})], False),  # a balloon without it
        ([("virtio0", 2, {5}), ("virtio1", 1, {5})], False),  # bit 5 of other devices
        ([("virtio0", 2, set()), ("virtio1", 5, {0, 5})], True),
        ([("virtio0", "garbage", {5})], False),
    ],
)
def test_fs_reports_free_memory_reads_the_balloon_device_features(fake_virtio, devices, expected):
    from storage_plugins import fs

    for name, ident, bits in devices:
        fake_virtio.device(name, ident, bits)
    assert fs.direct_without_fsync() is expected


def test_fs_reports_free_memory_is_false_without_virtio(tmp_path, monkeypatch):
    from storage_plugins import fs

    monkeypatch.setattr(fs, "_VIRTIO_DEVICES", str(tmp_path / "missing"))
    fs.direct_without_fsync.cache_clear()
    try:
        assert fs.direct_without_fsync() is False
    finally:
        fs.direct_without_fsync.cache_clear()


def test_fs_auto_direct_without_fsync_is_said_once_per_process(fake_virtio, caplog):
    from storage_plugins import fs

    if not hasattr(os, "O_DIRECT"):
        pytest.skip("O_DIRECT is Linux's")
    fake_virtio.device("virtio0", 5, {5})
    with caplog.at_level(logging.INFO, logger="storage_plugins.fs"):
        for _ in range(3):
            assert fs.FSStoragePlugin(str(fake_virtio.root.parent / "d"), {"fsync": False})._direct
    said = [r for r in caplog.records if "free page reporting" in r.getMessage()]
    assert len(said) == 1


@pytest.mark.parametrize(
    ("options", "reports_free_memory", "expected"),
    [
        ({}, False, True),  # "auto" with fsync on
        ({}, True, True),
        ({"fsync": False}, False, False),
        ({"fsync": False}, True, True),  # "auto" on a VM that hands free memory back
        ({"fsync": False, "direct_io": True}, False, True),
        ({"direct_io": False}, False, False),
        ({"direct_io": False, "fsync": False}, True, False),
        ({"direct_io": "auto", "fsync": True}, False, True),
    ],
)
def test_fs_direct_io_option_decides_which_files_are_written_directly(
    tmp_path, monkeypatch, fake_virtio, options, reports_free_memory, expected
):
    import os

    from storage_plugins import fs

    if not hasattr(os, "O_DIRECT"):
        pytest.skip("O_DIRECT is Linux's")
    if not _accepts_direct_io(tmp_path):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT writes")
    # The machine's answer, as it would be read from sysfs: a balloon device with or without
    # free page reporting.
    fake_virtio.device("virtio0", 5, {5} if reports_free_memory else {1, 2})
    calls = _Syscalls(monkeypatch, fs)
    plugin = fs.FSStoragePlugin(str(tmp_path), options)
    big = os.urandom(fs._DIRECT_MIN_BYTES + 5)
    plugin._write_sync("big", [big])
    plugin._write_sync("small", [b"x" * (fs._DIRECT_MIN_BYTES - 1)])  # always through the cache
    assert calls.direct_opens() == int(expected)
    assert (tmp_path / "big").read_bytes() == big


def test_fs_direct_io_option_is_checked(tmp_path):
    from storage_plugins import fs

    with pytest.raises(ValueError, match='direct_io must be True, False or "auto"'):
        fs.FSStoragePlugin(str(tmp_path), {"direct_io": "yes"})
    with pytest.raises(TypeError, match="known: fsync, direct_io, io_threads"):
        fs.FSStoragePlugin(str(tmp_path), {"direct": True})


@pytest.mark.skipif(not hasattr(__import__("os"), "O_DIRECT"), reason="O_DIRECT is Linux's")
@pytest.mark.parametrize("where", ["open", "first write"])
def test_fs_direct_io_refused_falls_back_to_the_page_cache(tmp_path, monkeypatch, caplog, where):
    """A file system that refuses O_DIRECT (tmpfs at open; others at the first write) gets the
    same bytes through the page cache, observed once, and no more direct attempts."""
    import errno
    import logging
    import os

    from storage_plugins import fs

    real_open = os.open
    attempts = [0]

    def open_(path, flags, *rest, **kwargs):
        if flags & os.O_DIRECT:
            attempts[0] += 1
            if where == "open":
                # As some kernels do: the file is created, then the flag refused.
                os.close(real_open(path, flags & ~os.O_DIRECT, *rest, **kwargs))
                raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *rest, **kwargs)

    def pwrite(fd, buf, offset):
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(fs.os, "open", open_)
    if where == "first write":
        monkeypatch.setattr(fs.os, "pwrite", pwrite)
    plugin = fs.FSStoragePlugin(str(tmp_path), {"fsync": True})
    data = os.urandom(fs._DIRECT_MIN_BYTES * 2 + 3)
    rec = _Recorder()
    with caplog.at_level(logging.INFO, logger="storage_plugins.fs"):
        plugin._write_sync("a", [data[:10], data[10:]], rec)
        plugin._write_sync("b", [data])
    assert (tmp_path / "a").read_bytes() == data == (tmp_path / "b").read_bytes()
    assert b"".join(rec.pieces) == data
    assert attempts[0] == 1
    assert [r.getMessage() for r in caplog.records if "direct I/O refused" in r.getMessage()]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


@pytest.mark.skipif(not hasattr(__import__("os"), "O_DIRECT"), reason="O_DIRECT is Linux's")
def test_fs_direct_write_error_fails_the_write_and_removes_the_temporary_file(
    tmp_path, monkeypatch
):
    import errno
    import os

    from storage_plugins import fs

    if not _accepts_direct_io(tmp_path):
        pytest.skip(f"the file system of {tmp_path} refuses O_DIRECT writes")
    monkeypatch.setattr(fs, "_DIRECT_PIECE_BYTES", 16384)
    real_pwrite = os.pwrite
    calls = [0]

    def pwrite(fd, buf, offset):
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, buf, offset)

    monkeypatch.setattr(fs.os, "pwrite", pwrite)
    plugin = fs.FSStoragePlugin(str(tmp_path), {"fsync": True})
    with pytest.raises(OSError, match="No space left") as e:
        plugin._write_sync("blob", [os.urandom(fs._DIRECT_MIN_BYTES)])
    assert e.value.errno == errno.ENOSPC
    assert plugin._direct  # a full disk is not a refusal of direct I/O
    assert list(tmp_path.iterdir()) == []
