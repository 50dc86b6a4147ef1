"""The local plugin's read-ahead hint brings a blob's bytes into the page cache without
following a link."""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
import sys
import time

import pytest

from benchmarks.common.system import drop_page_cache
from storage_plugins.base import UnsafeBlobError
from storage_plugins.fs import FSStoragePlugin


def _resident_fraction(path: str) -> float:
    """The share of the file's pages in the page cache (``mincore``)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        # Private and writable only so that ctypes takes its address; nothing writes to it.
        m = mmap.mmap(
            f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    try:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        first = ctypes.c_char.from_buffer(m)
        addr = ctypes.addressof(first)  # the mapping's address
        del first  # (the mapping closes only once nothing views it)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
        if libc.mincore(addr, size, vec) != 0:
            pytest.skip(f"mincore failed: errno {ctypes.get_errno()}")
        return sum(v & 1 for v in vec) / pages
    finally:
        m.close()


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise on this platform")
@pytest.mark.skipif(sys.platform != "linux", reason="mincore through libc: Linux")
def test_the_local_plugins_hint_reads_into_the_page_cache_without_following_links(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    blob = root / "blob"
    blob.write_bytes(os.urandom(8 << 20))
    drop_page_cache(str(blob))
    if _resident_fraction(str(blob)) > 0.5:
        pytest.skip("this file system keeps the file in memory (tmpfs): nothing to read ahead")
    plugin = FSStoragePlugin(str(root))
    asyncio.run(plugin.read_ahead("blob", 0, 4 << 20))
    deadline = time.monotonic() + 10
    while _resident_fraction(str(blob)) < 0.45 and time.monotonic() < deadline:
        time.sleep(0.01)  # the kernel's reads complete in the background
    assert 0.45 <= _resident_fraction(str(blob)) <= 0.75  # the first half, and little more
    # The same hint given at once, from the caller's thread (as the restore's hint thread does).
    assert plugin.read_ahead_now("blob", 4 << 20, 4 << 20)
    while _resident_fraction(str(blob)) < 0.95 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _resident_fraction(str(blob)) >= 0.95
    outside = tmp_path / "outside"
    outside.write_bytes(b"x" * 4096)
    (root / "link").symlink_to(outside)
    with pytest.raises(UnsafeBlobError):
        asyncio.run(plugin.read_ahead("link", 0, 4096))
    with pytest.raises(UnsafeBlobError):
        plugin.read_ahead_now("link", 0, 4096)
