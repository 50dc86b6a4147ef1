"""AsyncRequest, AsyncCallsQueue and the staging pool under async take."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch

from snapshot import Snapshot, SnapshotError, StateDict
from snapshot._engine.io.async_queue import AsyncCallsQueue, AsyncRequest
from snapshot._engine.io.staging import StagingPool, process_pool
from snapshot.options import Options
from tests.plugins import gated_storage


def test_requests_run_in_order_and_finalize_in_order():
    queue = AsyncCallsQueue()
    log: list[str] = []
    gate = threading.Event()

    def work(name: str, wait: bool) -> None:
        if wait:
            assert gate.wait(10)
        log.append(f"run {name}")

    first = queue.schedule_async_request(
        AsyncRequest(work, ("a", True), finalize_fns=(lambda: log.append("fin a"),))
    )
    second = queue.schedule_async_request(
        AsyncRequest(work, ("b", False)).add_finalize_fn(lambda: log.append("fin b"))
    )
    assert (first, second) == (0, 1)
    assert queue.maybe_finalize_async_calls(blocking=False) == []  # "a" is still running
    assert log == [] and queue.get_num_unfinalized_calls() == 2
    gate.set()
    assert queue.maybe_finalize_async_calls(blocking=True, up_to=0) == [0]
    assert queue.maybe_finalize_async_calls(blocking=True) == [1]
    assert log == ["run a", "run b", "fin a", "fin b"]  # one at a time, in order
    queue.close()


def test_a_failed_call_raises_once_and_skips_its_finalizers():
    queue = AsyncCallsQueue()
    ran = []

    def boom() -> None:
        raise OSError("disk gone")

    queue.schedule_async_request(AsyncRequest(boom, finalize_fns=(lambda: ran.append("no"),)))
    queue.schedule_async_request(AsyncRequest(None, finalize_fns=(lambda: ran.append("yes"),)))
    with pytest.raises(SnapshotError, match="async call 0 failed: OSError: disk gone") as info:
        queue.maybe_finalize_async_calls(blocking=True)
    assert isinstance(info.value.__cause__, OSError)
    assert queue.maybe_finalize_async_calls(blocking=True) == [1]
    assert ran == ["yes"]
    queue.close()


def test_requests_are_frozen_once_scheduled_and_can_run_synchronously():
    calls = []
    request = AsyncRequest(lambda x: calls.append(x), (1,), (lambda: calls.append("fin"),))
    assert request.execute_sync() is None and calls == [1, "fin"]
    frozen = request.freeze()
    with pytest.raises(SnapshotError, match="already scheduled"):
        frozen.add_finalize_fn(lambda: None)


def test_pool_size_classes_and_reuse():
    pool = StagingPool(keep_bytes=1 << 20, pin=False)
    assert [StagingPool.size_class(n) for n in (1, 65536, 65537, 100_000, 3 << 20)] == [
        65536,
        65536,
        98304,
        131072,
        3 << 20,
    ]
    lease = pool.acquire(70_000)
    assert lease.tensor.numel() == 70_000 and len(lease.view) == 70_000
    block = lease.tensor.data_ptr()
    lease.release()
    lease.release()  # twice is harmless
    again = pool.acquire(90_000)  # same size class: the same memory comes back
    assert again.tensor.data_ptr() == block and pool.allocated_bytes == 98304
    again.release()
    big = pool.acquire(2 << 20)  # more than the pool keeps: the free block makes room first
    assert pool.free_bytes == 0
    big.release()  # and it is handed back to the allocator
    assert pool.free_bytes == 0 and pool.leased_bytes == 0


def test_a_pool_smaller_than_the_state_stays_within_its_budget():
    """Blocks leased and free together stay within the budget: a block of a size the free
    list lacks first drops free blocks of other sizes (the memory bound is the budget, not
    twice it), and one of a size it holds is reused."""
    pool = StagingPool(keep_bytes=6 << 20, pin=False)
    for _ in range(3):  # the same sizes in the same order, as snapshots of one state ask
        for sizes in ((2 << 20, 4 << 20), (2 << 20, 2 << 20), (4 << 20,), (1 << 20, 3 << 20)):
            leases = [pool.acquire(n) for n in sizes]
            assert pool.leased_bytes + pool.free_bytes <= 6 << 20
            for lease in leases:
                lease.release()
            assert pool.free_bytes <= 6 << 20
    again = pool.allocated_bytes
    lease = pool.acquire(3 << 20)  # the last size given back: reused
    assert pool.allocated_bytes == again
    lease.release()


def _resident_pages(block: torch.Tensor) -> int:
    """Pages of ``block``'s memory in RAM, from mincore(2) (Linux); touches none."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    pages = -(-block.numel() // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(block.data_ptr(), block.numel(), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore(2) as on Linux")
def test_reused_blocks_stay_resident_only_as_far_as_their_leases_write():
    """Three buffers of one size class, asked for in the same order snapshot after snapshot and
    given back in another order each time (as writes end): each goes back to the block it
    filled before, so the blocks hold the pages of the three sizes, not three times the
    largest. Lent last-in-first-out, the 31-page lease took the block of 25 pages and faulted
    in 6 more."""
    page = mmap.PAGESIZE
    sizes = (31 * page, 28 * page, 25 * page)  # one size class: 32 pages
    assert len({StagingPool.size_class(n) for n in sizes}) == 1
    pool = StagingPool(keep_bytes=1 << 20, pin=False)
    blocks: dict[int, torch.Tensor] = {}
    for order in ((0, 1, 2), (2, 1, 0), (1, 0, 2), (0, 2, 1), (2, 0, 1)):
        leases = [pool.acquire(n) for n in sizes]
        for lease in leases:
            lease.tensor.fill_(7)  # what a copy into it does
            blocks[lease.tensor.data_ptr()] = lease._block
        for i in order:
            leases[i].release()
        assert len(blocks) == 3  # the same three blocks every time
        assert sum(_resident_pages(b) for b in blocks.values()) == (31 + 28 + 25)


def test_pool_blocks_start_on_a_page_boundary():
    """So that the local plugin writes them with direct I/O as they are, without a copy."""
    pool = StagingPool(keep_bytes=64 << 20, pin=False)
    leases = [pool.acquire(n) for n in (1, 70_000, 1 << 20, (3 << 20) + 5)]
    assert all(lease.tensor.data_ptr() % 4096 == 0 for lease in leases)
    assert pool.allocated_bytes == sum(pool.block_bytes(len(x.view), False) for x in leases)
    for lease in leases:
        lease.release()


def _state(seed: int) -> StateDict:
    g = torch.Generator().manual_seed(seed)
    return StateDict(
        {f"w{i}": torch.randn(256, 256, generator=g) for i in range(4)}
        | {f"b{i}": torch.randn(64, generator=g) for i in range(50)}
    )


def test_later_async_snapshots_reuse_the_staging_buffers(tmp_path):
    pool = process_pool(Options().resolved())  # the one async_take uses
    pool.keep_bytes = 0  # no free block left over (each take sets it again)
    pool.trim()
    state = _state(0)
    before = pool.allocated_bytes  # (what earlier takes of the process allocated)
    allocated = []
    for i in range(50):
        for t in state.values():
            t.add_(1)
        Snapshot.async_take(str(tmp_path / f"s{i}"), {"s": state}).wait()
        allocated.append(pool.allocated_bytes)
    assert allocated[0] > 0 and allocated[-1] == allocated[0]  # nothing new after the first
    # Every block back and kept, none more.
    assert pool.free_bytes == allocated[0] - before and pool.leased_bytes == 0
    out = Snapshot(str(tmp_path / "s49")).read_object("0/s/w3")
    assert torch.equal(out, state["w3"])


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_a_budget_smaller_than_the_state_does_not_grow_the_process(tmp_path):
    """With a staging budget of a quarter of the state, blocks of some sizes are dropped and
    made again snapshot after snapshot; each is a mapping of its own, handed back to the
    system when dropped, so the process's memory does not grow with the snapshots (from the
    heap, freed blocks stayed: +6 to +32 MiB from the 5th to the 20th here)."""
    g = torch.Generator().manual_seed(3)
    sizes = (1 << 20, 3 << 19, 1 << 21, 3 << 20)  # 4, 6, 8 and 12 MiB of float32
    state = StateDict({f"w{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)})
    options = Options(memory_budget_bytes=sum(t.nbytes for t in state.values()) // 4)
    rss = []
    for i in range(20):
        Snapshot.async_take(str(tmp_path / f"s{i}"), {"s": state}, options=options).wait()
        shutil.rmtree(tmp_path / f"s{i}")
        rss.append(_rss())
    assert rss[-1] - rss[4] < 4 << 20, [(r - rss[0]) >> 20 for r in rss]  # (was +6 to +32)


def test_pending_snapshots_commit_in_order(tmp_path, monkeypatch):
    with gated_storage():
        slow = Snapshot.async_take(f"gated://{tmp_path / 'first'}", {"s": _state(1)})
        fast = Snapshot.async_take(str(tmp_path / "second"), {"s": _state(2)})
        deadline = time.monotonic() + 30
        while not list((tmp_path / "second").glob("0/*")) and time.monotonic() < deadline:
            time.sleep(0.01)  # the second snapshot's blobs are written meanwhile...
        assert list((tmp_path / "second").glob("0/*"))
        time.sleep(0.2)
        assert not (tmp_path / "second" / "manifest.yaml").exists()  # ...but it commits second
        assert not fast.done() and not slow.done()
    slow.wait(timeout=60)
    fast.wait(timeout=60)
    first_commit = (tmp_path / "first" / "manifest.yaml").stat().st_mtime_ns
    assert first_commit <= (tmp_path / "second" / "manifest.yaml").stat().st_mtime_ns


def test_dropping_an_unfinished_handle_warns(tmp_path, caplog):
    with gated_storage():
        pending = Snapshot.async_take(f"gated://{tmp_path / 's'}", {"s": _state(3)})
        with caplog.at_level(logging.WARNING, logger="snapshot.pending"):
            del pending
        assert "garbage-collected before it finished" in caplog.text
    deadline = time.monotonic() + 30
    while not (tmp_path / "s" / "manifest.yaml").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert Snapshot(str(tmp_path / "s")).get_manifest()  # committed all the same


@pytest.mark.slow
def test_process_exit_waits_for_a_pending_snapshot(tmp_path):
    path = tmp_path / "s"
    script = f"""
import torch
from snapshot import Snapshot, StateDict
Snapshot.async_take({str(path)!r}, {{"s": StateDict(t=torch.arange(1_000_000))}})
print("returned")
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "returned"
    assert torch.equal(Snapshot(str(path)).read_object("0/s/t"), torch.arange(1_000_000))
