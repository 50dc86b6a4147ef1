"""The scheduler: byte budgets, the stage->write pipeline, reads, and their errors."""

from __future__ import annotations

import asyncio
import re
import threading
import time
import uuid
import weakref

import pytest
import torch

from snapshot import CorruptSnapshotError, Snapshot, StateDict, StorageError
from snapshot._engine.io.pipeline import ReadRequest, Segment, WritePipeline, WriteRequest, read_all
from snapshot._engine.io.staging import StagingPool
from snapshot._engine.runtime import ByteBudget, io_loop, run
from snapshot.options import Options
from storage_plugins.memory import MemoryStoragePlugin

OPTS = Options().resolved()  # each storage call's retries and deadline


def test_budget_admits_an_oversized_request_alone():
    budget = ByteBudget(100)
    assert budget.try_acquire(60)
    assert not budget.try_acquire(500)  # does not fit beside the 60 held
    budget.release(60)
    assert budget.try_acquire(500)  # alone, it runs rather than never
    assert not budget.try_acquire(1)
    budget.release(500)
    assert budget.peak == 500


def test_budget_blocks_a_thread_until_release():
    budget = ByteBudget(100)
    budget.acquire(80)
    acquired = threading.Event()
    t = threading.Thread(target=lambda: (budget.acquire(50), acquired.set()))
    t.start()
    assert not acquired.wait(0.2)
    budget.release(80)
    assert acquired.wait(5)
    t.join()


def test_budget_async_waiters_and_abort():
    budget = ByteBudget(10)

    async def scenario():
        budget.acquire(10)
        waiter = asyncio.ensure_future(budget.acquire_async(5))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        threading.Thread(target=budget.release, args=(10,)).start()  # released from elsewhere
        await asyncio.wait_for(waiter, 5)
        second = asyncio.ensure_future(budget.acquire_async(10))
        await asyncio.sleep(0.05)
        budget.abort(RuntimeError("stop"))
        with pytest.raises(RuntimeError, match="stop"):
            await asyncio.wait_for(second, 5)

    asyncio.run(scenario())
    with pytest.raises(RuntimeError, match="stop"):
        budget.acquire(1)


def _plugin() -> MemoryStoragePlugin:
    async def make():
        return MemoryStoragePlugin(f"memory://{uuid.uuid4().hex}")

    return run(make())


def _finish(pipeline: WritePipeline):
    """Hands over what is staged and waits for every write."""
    pipeline.flush()
    return run(pipeline.wait())


def test_pipeline_keeps_staged_bytes_within_budget():
    plugin = _plugin()
    staged_now = [0]
    high_water = [0]
    lock = threading.Lock()

    class SlowPlugin(MemoryStoragePlugin):
        async def write(self, path, buffers):
            await asyncio.sleep(0.002)
            await super().write(path, buffers)
            with lock:
                staged_now[0] -= len(buffers[0])

    slow = SlowPlugin(plugin.root)

    def stager(n: int):
        def stage():
            with lock:
                staged_now[0] += n
                high_water[0] = max(high_water[0], staged_now[0])
            return [bytes(n)], None

        return stage

    pipeline = WritePipeline(
        slow, budget_bytes=10_000, max_concurrency=8, batch_bytes=1, options=OPTS
    )
    for i in range(100):
        pipeline.submit(
            WriteRequest(
                blob=f"b{i}", nbytes=3000, staging_bytes=3000, stage=stager(3000), label=f"t{i}"
            )
        )
    stats = _finish(pipeline)
    assert stats.blobs == 100 and stats.nbytes == 300_000
    assert stats.peak_budget_bytes <= 10_000 and high_water[0] <= 10_000
    assert run(slow.read("b99")) == bytes(3000)


def test_an_idle_pipeline_holds_no_written_buffer():
    """Once written, a staged buffer is released and dropped, while the workers still wait for
    more: memory beyond the budget must not stay alive in idle workers."""
    plugin = _plugin()

    class Keepalive:
        released = 0

        def release(self):
            Keepalive.released += 1

    refs: list[weakref.ref] = []

    def stage():
        keep = Keepalive()
        refs.append(weakref.ref(keep))
        return [bytearray(1000)], keep

    pipeline = WritePipeline(
        plugin, budget_bytes=100_000, max_concurrency=4, batch_bytes=None, options=OPTS
    )
    for i in range(10):
        pipeline.submit(
            WriteRequest(blob=f"b{i}", nbytes=1000, staging_bytes=1000, stage=stage, label=f"t{i}")
        )
    pipeline.flush()
    deadline = time.monotonic() + 10
    while Keepalive.released < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert Keepalive.released == 10
    assert [r for r in refs if r() is not None] == []  # the 4 idle workers hold none of them
    assert _finish(pipeline).blobs == 10


def test_a_released_lease_holds_no_memory():
    pool = StagingPool(keep_bytes=0)  # keeps nothing: a released block goes back to torch
    lease = pool.acquire(1 << 20)
    block = weakref.ref(lease._block)
    lease.view[:3] = b"abc"
    lease.release()
    assert lease.tensor is None and lease.view is None and block() is None
    lease.release()  # a second release is harmless
    assert pool.free_bytes == 0


def test_a_released_block_is_lent_again_as_it_is():
    pool = StagingPool(keep_bytes=1 << 30)
    lease = pool.acquire(1 << 20)
    lease.view[:4] = b"\x01\x02\x03\x04"
    lease.release()
    again = pool.acquire(1 << 20)  # the same size class: the kept block, not a new one
    assert pool.allocated_bytes == StagingPool.size_class(1 << 20)
    assert bytes(again.view[:4]) == b"\x01\x02\x03\x04"
    again.release()


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return re.search(r"\[(\w+)\]", f.read()).group(1)
    except (OSError, AttributeError):
        return None


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address`` (Linux's smaps)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                inside = int(m.group(1), 16) <= address < int(m.group(2), 16)
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    return []


@pytest.mark.skipif(
    _thp_mode() != "madvise",
    reason="needs Linux with transparent huge pages in 'madvise' mode (where only an advice "
    "gives them)",
)
def test_fresh_blocks_are_not_advised_to_use_huge_pages():
    # Advised huge pages made the first fill of a fresh block several times slower on a VM
    # that hands freed memory back to its host (benchmarks/results, 2026-11-26 2f607f5).
    pool = StagingPool(keep_bytes=0, pin=False)
    lease = pool.acquire(16 << 20)
    middle = lease.tensor.data_ptr() + (8 << 20)
    assert _vm_flags(middle), "the block's mapping was not found in /proc/self/smaps"
    assert "hg" not in _vm_flags(middle)
    lease.release()


def test_pipeline_error_stops_the_caller_and_names_the_path():
    class Failing(MemoryStoragePlugin):
        async def write(self, path, buffers):
            if path == "b3":
                raise OSError(28, "No space left on device")
            await asyncio.sleep(0.001)
            await super().write(path, buffers)

    failing = Failing(f"memory://{uuid.uuid4().hex}")
    pipeline = WritePipeline(
        failing, budget_bytes=1000, max_concurrency=2, batch_bytes=1, options=OPTS
    )
    with pytest.raises(StorageError, match="0/x/t3: failed to write blob .*b3.*No space"):
        for i in range(1000):  # the budget forces the caller to wait; the error wakes it
            pipeline.submit(
                WriteRequest(
                    blob=f"b{i}",
                    nbytes=600,
                    staging_bytes=600,
                    stage=lambda: ([bytes(600)], None),
                    label=f"0/x/t{i}",
                )
            )
        _finish(pipeline)
    pipeline.abort(RuntimeError("cleanup"))


def test_reads_respect_the_budget_and_report_the_first_error():
    plugin = _plugin()
    run(plugin.write("data", [bytes(range(256)) * 64]))
    in_use = [0, 0]

    def request(i: int) -> ReadRequest:
        buf = bytearray(1024)

        def into():
            in_use[0] += 1024
            in_use[1] = max(in_use[1], in_use[0])
            return memoryview(buf)

        def done():
            in_use[0] -= 1024

        return ReadRequest(
            blob="data",
            offset=i * 1024,
            segments=[Segment(nbytes=1024, dest=into)],
            scratch_bytes=1024,
            done=done,
            label=f"r{i}",
        )

    stats = run(
        read_all(
            plugin,
            [request(i) for i in range(16)],
            budget_bytes=4096,
            max_concurrency=8,
            options=OPTS,
        )
    )
    assert stats.nbytes == 16 * 1024 and in_use[1] <= 4096
    bad = ReadRequest(
        blob="absent",
        offset=0,
        segments=[Segment(nbytes=1, dest=lambda: memoryview(bytearray(1)))],
        scratch_bytes=0,
        done=None,
        label="0/k/missing",
    )
    with pytest.raises(CorruptSnapshotError, match="0/k/missing: blob .*absent is missing"):
        run(
            read_all(
                plugin,
                [request(0), bad, request(1)],
                budget_bytes=4096,
                max_concurrency=2,
                options=OPTS,
            )
        )


def test_calls_from_inside_a_running_loop_work():
    """A notebook runs its own event loop; the library's I/O loop is separate."""

    async def inside():
        url = f"memory://{uuid.uuid4().hex}"
        Snapshot.take(url, {"s": StateDict(x=torch.ones(3))})
        return Snapshot(url).read_object("0/s/x")

    assert torch.equal(asyncio.run(inside()), torch.ones(3))


def test_run_refuses_to_deadlock_on_the_io_loop():
    async def nested():
        coro = asyncio.sleep(0)
        return run(coro)

    future = asyncio.run_coroutine_threadsafe(nested(), io_loop())
    with pytest.raises(RuntimeError, match="deadlock"):
        future.result(5)


def test_take_stages_within_the_memory_budget(tmp_path, caplog):
    state = StateDict({f"t{i}": torch.randn(512, 256).t() for i in range(8)})  # 512 KiB each
    caplog.set_level("DEBUG", logger="snapshot")
    Snapshot.take(str(tmp_path / "s"), {"s": state}, options=Options(memory_budget_bytes=1 << 20))
    peaks = [int(m) for m in re.findall(r"peak staged (\d+) B", caplog.text)]
    assert len(peaks) == 1 and 512 * 1024 <= peaks[0] <= 1 << 20  # two 512 KiB copies at most
    out = Snapshot(str(tmp_path / "s")).read_object("0/s/t5")
    assert torch.equal(out, state["t5"])


def test_take_restore_and_manifest_reads_log_their_phases(tmp_path, caplog):
    """Debug logs carry each phase's time: the take's, the manifest read's, the restore's."""
    path = str(tmp_path / "s")
    state = StateDict({f"t{i}": torch.full((64,), float(i)) for i in range(5)})
    caplog.set_level("DEBUG", logger="snapshot")
    Snapshot.take(path, {"s": state})
    Snapshot(path).restore({"s": StateDict({k: torch.empty(64) for k in state})})
    text = caplog.text
    assert re.search(r"take .* phases: state_dict\+plan [0-9.]+ s", text)
    # Read when opened, decoded (the dict and its five tensors) when the restore needs it.
    assert re.search(r"manifest of .*: \d+ bytes read in [0-9.]+ s", text)
    assert re.search(r"manifest of .*: 6 entries decoded in [0-9.]+ s", text)
    assert re.search(r"restore .* phases: state_dict\+plan [0-9.]+ s, read [0-9.]+ s", text)


def test_collector_pause_nests_across_threads():
    import gc

    from snapshot._engine.runtime import gc_paused

    assert gc.isenabled()
    inner_done = threading.Event()
    release = threading.Event()

    def other_phase():
        with gc_paused():
            inner_done.set()
            release.wait(5)

    with gc_paused():
        assert not gc.isenabled()
        t = threading.Thread(target=other_phase)
        t.start()
        assert inner_done.wait(5)
    assert not gc.isenabled()  # the other thread's phase is still running
    release.set()
    t.join()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a collector the application turned off stays off
    finally:
        gc.enable()


def test_a_take_of_many_tensors_sets_off_one_young_collection_at_most(tmp_path):
    """The collector stays paused through a whole take (a take's per-tensor records would set
    off collections that walk them between its phases: dozens for 5,000 tensors), and is
    running again when the take returns: at most one collection, when it resumes. That one is
    of the young generation, or of an older one when the collector's counts make it due (every
    tenth young collection also collects the next generation): 5 takes in 60 in one process
    here, so which it is depends on what the process did before."""
    import gc

    state = {"m": StateDict({f"t{i}": torch.full((4,), float(i)) for i in range(5000)})}
    started: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(info["generation"])

    gc.callbacks.append(count)
    try:
        Snapshot.take(str(tmp_path / "s"), state)
        during = list(started)
        assert gc.isenabled()
    finally:
        gc.callbacks.remove(count)
    assert len(during) <= 1, during
    snap = Snapshot(str(tmp_path / "s"))
    assert torch.equal(snap.read_object("0/m/t4321"), torch.full((4,), 4321.0))


def test_a_bad_keep_open_setting_fails_before_any_read(tmp_path, monkeypatch):
    Snapshot.take(str(tmp_path / "s"), {"m": StateDict(x=torch.arange(3))})
    # Through the environment: what is checked is how a bad variable is refused.
    monkeypatch.setenv("STATESNAP_KEEP_OPEN_SECS", "soon")
    with pytest.raises(ValueError, match="STATESNAP_KEEP_OPEN_SECS must be an integer"):
        Snapshot(str(tmp_path / "s"))
    monkeypatch.delenv("STATESNAP_KEEP_OPEN_SECS")
    assert torch.equal(Snapshot(str(tmp_path / "s")).read_object("0/m/x"), torch.arange(3))
