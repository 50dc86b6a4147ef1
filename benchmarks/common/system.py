"""What a worker measures and how the harness prepares the files: peak RSS, ``/proc/self/io``,
bytes on disk, fsync of a tree, the page cache (warm, dropped, how much is resident), the
settling of freed memory on a VM with free page reporting, and reaping killed processes."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import mmap
import os
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from benchmarks.common.states import KIB, MIB

# ---------------------------------------------------------------------------------------------
# Memory.


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * KIB
    raise RuntimeError(f"{field_name} not in /proc/self/status")


def current_rss() -> int:
    return _status_kib("VmRSS")


def peak_rss() -> int:
    return _status_kib("VmHWM")


def thread_schedstat() -> tuple[float, float] | None:
    """The calling thread's seconds on a CPU and seconds runnable but waiting for one, from
    ``/proc/thread-self/schedstat`` (Linux with scheduler statistics); None elsewhere. A
    thread's wall-clock time is these two plus the time it slept (on a lock, on I/O)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            on_cpu, waiting, _ = f.read().split()
    except (OSError, ValueError):
        return None
    return int(on_cpu) / 1e9, int(waiting) / 1e9


def reset_peak_rss() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0); False when that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    # Allow a little slack: RSS may move between the two reads.
    return peak_rss() <= current_rss() + 4 * MIB


class PeakRSS:
    """Peak RSS above the RSS at entry, for the ``with`` block.

    Uses the kernel's high-water mark after resetting it; if the reset fails, samples VmRSS in a
    thread every ``interval`` seconds instead (``method`` says which was used).
    """

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.baseline = 0
        self.peak = 0
        self.method = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRSS:
        gc.collect()
        if reset_peak_rss():
            self.method = "VmHWM after clear_refs"
        else:
            self.method = f"VmRSS sampled every {self.interval * 1000:.0f} ms"
            self._thread = threading.Thread(target=self._sample, daemon=True)
        self.baseline = current_rss()
        self.peak = self.baseline
        if self._thread is not None:
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss())
            time.sleep(self.interval)

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, current_rss())
        else:
            self.peak = peak_rss()

    @property
    def above_baseline(self) -> int:
        return max(0, self.peak - self.baseline)


def trim_heap() -> None:
    """Collects garbage and returns the C heap's free memory to the kernel (glibc's
    ``malloc_trim(0)``), so that RSS measured next counts live memory, not what an earlier,
    untimed step (the async case's check) freed but the allocator kept."""
    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim with
        pass


def proc_io() -> dict[str, int]:
    """``/proc/self/io``: rchar/wchar (bytes through read/write calls, cached or not) and
    read_bytes/write_bytes (bytes the block layer moved for this process)."""
    out: dict[str, int] = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, _, value = line.partition(":")
            out[key.strip()] = int(value)
    return out


def io_delta(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in ("rchar", "wchar", "read_bytes", "write_bytes")}


# ---------------------------------------------------------------------------------------------
# Disk and page cache.


def files_under(path: str) -> Iterator[str]:
    """``path`` itself when it is a file, else every file below it."""
    if os.path.isfile(path):
        yield path
        return
    for root, _dirs, files in os.walk(path):
        for name in files:
            yield os.path.join(root, name)


def tree_size(path: str) -> dict[str, int]:
    """Apparent bytes, allocated bytes (st_blocks) and number of files under ``path``."""
    apparent = allocated = files = 0
    for p in files_under(path):
        st = os.stat(p)
        apparent += st.st_size
        allocated += st.st_blocks * 512
        files += 1
    return {"apparent": apparent, "allocated": allocated, "files": files}


def fsync_tree(path: str) -> None:
    """fsyncs every file under ``path``, then every directory (deepest first) and the parent."""
    dirs: list[str] = []
    if os.path.isdir(path):
        for root, _d, _f in os.walk(path):
            dirs.append(root)
    for p in files_under(path):
        _fsync(p)
    dirs.append(os.path.dirname(os.path.abspath(path)))
    for d in reversed(dirs):
        _fsync(d)


# Free page reporting. A VM guest whose kernel reports free memory to its host (virtio-balloon)
# hands freed pages back a second or two after they are freed; the next allocation of that
# memory then faults on the host. So a write through the page cache runs several times faster
# right after a large file was removed than a few seconds later (methodology.md, "Settled
# memory"): what the previous seconds freed decides the figure. ``settle_memory`` waits until
# the reporting has gone quiet, so that every timed operation starts with its memory in the
# same state (handed back).
_REPORTED_KIB = "/sys/module/page_reporting/parameters/reported_kib"
# The kernel reports in bursts, its reporting work running every 2 s (PAGE_REPORTING_DELAY):
# this long without one means the reporting is done.
SETTLE_QUIET_SECONDS = 3.0


def reported_kib() -> int | None:
    """KiB of free memory the kernel has reported to the host so far (None: not visible)."""
    try:
        with open(_REPORTED_KIB) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def settle_memory(
    quiet: float = SETTLE_QUIET_SECONDS, limit: float = 30.0, poll: float = 0.1
) -> float | None:
    """Waits until the kernel has reported no free memory to the host for ``quiet`` seconds,
    at most ``limit`` seconds; the seconds waited, or None when this machine does not show such
    reporting."""
    last = reported_kib()
    if last is None:
        return None
    start = changed = time.monotonic()
    while True:
        now = time.monotonic()
        if now - changed >= quiet or now - start >= limit:
            return now - start
        time.sleep(poll)
        current = reported_kib()
        if current != last:
            last, changed = current, time.monotonic()


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_page_cache(path: str) -> None:
    """Evicts every file under ``path`` from the page cache: fsync (dirty pages cannot be
    dropped), then ``posix_fadvise(POSIX_FADV_DONTNEED)``. Needs no privileges."""
    for p in files_under(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_page_cache(path: str) -> None:
    """Reads every file under ``path`` once, so that a warm restore finds it in the page cache
    whichever way it was written (statesnap's fsync'd takes write past the page cache)."""
    buf = bytearray(16 << 20)
    for p in files_under(path):
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def set_page_cache(path: str, temp: str) -> None:
    """Puts the files under ``path`` in the page cache ("warm") or out of it ("cold"), or
    leaves them as they are ("as-left": as the take left them, for a restore right after a
    take; a writer's readers after its first find what the first one read)."""
    if temp == "cold":
        drop_page_cache(path)
    elif temp == "warm":
        warm_page_cache(path)
    elif temp != "as-left":
        raise ValueError(f"page-cache state {temp!r}: warm, cold or as-left")


_libc: ctypes.CDLL | None = None


def _libc_calls() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.mmap.restype = ctypes.c_void_p
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc = libc
    return _libc


def _mincore_resident(p: str) -> tuple[int, int]:
    """(resident pages, pages) of one file, from mmap(2) + mincore(2); touches no page."""
    size = os.path.getsize(p)
    if size == 0:
        return 0, 0
    libc = _libc_calls()
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    fd = os.open(p, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), p)
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), p)
            resident = sum(b & 1 for b in vec)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return resident, pages


def resident_fraction(path: str) -> float:
    """Fraction of the pages of the files under ``path`` that are in the page cache."""
    resident = total = 0
    for p in files_under(path):
        r, n = _mincore_resident(p)
        resident += r
        total += n
    return resident / total if total else 0.0


# ---------------------------------------------------------------------------------------------
# Processes.


def reap(proc: subprocess.Popen[Any], timeout: float = 5.0) -> None:
    """Waits for ``proc``, which was killed or told to exit. A signal handler that raises inside
    ``Popen.poll()`` (Ctrl-C, or SIGTERM turned into SystemExit) can leave ``Popen``'s internal
    wait lock held, after which ``proc.wait()`` blocks for ever; so after ``timeout`` seconds
    the process is reaped with ``os.waitpid`` directly."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        try:
            _pid, status = os.waitpid(proc.pid, 0)
        except ChildProcessError:  # reaped meanwhile
            return
        proc.returncode = os.waitstatus_to_exitcode(status)
