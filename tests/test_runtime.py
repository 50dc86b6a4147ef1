"""The process's runtime: one object holding the library's process-wide state, its one shutdown
path, and the check of who wrote a snapshot's parts (``snapshot._engine.format.serialization``)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from snapshot import IncompatibleSnapshotError, Snapshot, StateDict
from snapshot._engine import runtime
from snapshot._engine.format import serialization as writers
from snapshot._engine.io.async_queue import AsyncRequest
from snapshot._engine.io.staging import process_pool
from snapshot._engine.runtime import io_loop, run
from snapshot.options import Options
from storage_plugins.base import DaemonThreadPool
from storage_plugins.fs import FSStoragePlugin
from storage_plugins.memory import MemoryStoragePlugin

ROOT = Path(__file__).resolve().parent.parent
OPTS = Options().resolved()
_T = TypeVar("_T")


class ClosingPlugin(MemoryStoragePlugin):
    closed = 0

    async def close(self) -> None:
        ClosingPlugin.closed += 1
        await super().close()


def test_one_runtime_per_process_with_parts_made_once():
    rt = runtime.get()
    assert runtime.get() is rt
    assert rt.queue() is rt.queue()
    assert process_pool(OPTS) is process_pool(OPTS.replace(memory_budget_bytes=1)) is rt.pool
    assert rt.digest_pool(2) is rt.digest_pool(2)
    assert io_loop() is rt.loop()


def test_shutdown_waits_for_pending_work_ends_tasks_closes_plugins_then_stops_the_loop():
    gate = threading.Event()
    seen: list[str] = []
    with runtime.use() as rt:
        queue = rt.queue()

        def work() -> None:
            assert gate.wait(10)
            seen.append("work")

        queue.schedule_async_request(
            AsyncRequest(work, finalize_fns=(lambda: seen.append("finalized"),))
        )
        forever = asyncio.run_coroutine_threadsafe(asyncio.sleep(3600), rt.loop())
        plugin = ClosingPlugin("memory://runtime-kept")
        before = ClosingPlugin.closed
        key = ("memory://runtime-kept", "{}")
        asyncio.run_coroutine_threadsafe(rt.kept.keep(key, plugin, 3600), rt.loop()).result(5)
        loop = rt.loop()
        threading.Timer(0.2, gate.set).start()
    # Out of the block: the runtime was shut down.
    assert seen == ["work", "finalized"]  # the pending work was waited for and finalized
    assert forever.cancelled()  # the task left on the loop was ended
    assert ClosingPlugin.closed == before + 1 and len(rt.kept) == 0  # the kept plugin closed
    assert not loop.is_running()  # the loop stopped
    assert runtime.get() is not rt  # the process's own runtime is back


class GatedPlugin(MemoryStoragePlugin):
    """Writes once ``gate`` is set."""

    gate = threading.Event()

    async def write(self, path: str, buffers: Any) -> None:
        await asyncio.get_running_loop().run_in_executor(None, GatedPlugin.gate.wait, 10)
        await super().write(path, buffers)


def test_a_snapshot_pending_when_a_used_runtime_ends_is_committed_on_its_loop(caplog):
    """``runtime.use`` drains the pending snapshots while its runtime is still the process's:
    their last steps run on its I/O loop, not on the previous runtime's."""
    from storage_plugins import register_storage_plugin, unregister_storage_plugin

    register_storage_plugin("gated", GatedPlugin)
    GatedPlugin.gate.clear()
    state = {"s": StateDict(t=torch.arange(10_000))}
    try:
        with runtime.use() as rt:
            # The second waits in the queue for the first, whose writes wait for the gate.
            pendings = [Snapshot.async_take(f"gated://pending-{i}", state) for i in range(2)]
            threading.Timer(0.2, GatedPlugin.gate.set).start()
        assert runtime.get() is not rt
        assert all(p.done() for p in pendings)
        assert not [r for r in caplog.records if "could not" in r.getMessage()]
        for i, pending in enumerate(pendings):
            snap = pending.wait(timeout=5)  # committed, no error
            assert snap.path == f"gated://pending-{i}"
            assert torch.equal(Snapshot(snap.path).read_object("0/s/t"), torch.arange(10_000))
    finally:
        GatedPlugin.gate.set()
        unregister_storage_plugin("gated")


def test_io_after_shutdown_starts_a_new_loop_and_keeps_no_plugin():
    """An exit hook of the application's, run after the library's, can still use it."""
    with runtime.use() as rt:
        first = rt.loop()
    assert not first.is_running()
    with runtime.use(rt):  # the same runtime, shut down already, made current again
        assert run(asyncio.sleep(0, "done")) == "done"
        assert rt.loop() is not first and not rt.keeps_plugins


@pytest.mark.slow
def test_the_exit_hook_waits_for_pending_snapshots_and_closes_kept_plugins_first(tmp_path):
    """One ``atexit`` hook, run before the handlers registered before the library's first use:
    the pending snapshot is committed, and the kept plugin closed, by the time they run."""
    path = tmp_path / "s"
    script = textwrap.dedent(
        f"""
        import atexit
        import torch
        from snapshot import Snapshot, StateDict
        from snapshot._engine import runtime
        from tests.test_runtime import ClosingPlugin
        from storage_plugins import register_storage_plugin
        ClosingPlugin.keep_open = True
        register_storage_plugin("closing", ClosingPlugin)
        atexit.register(lambda: print("at exit", ClosingPlugin.closed, len(runtime.get().kept)))
        Snapshot.take("closing://kept", {{"s": StateDict(t=torch.ones(3))}})
        Snapshot("closing://kept")
        print("kept", len(runtime.get().kept))
        Snapshot.async_take({str(path)!r}, {{"s": StateDict(t=torch.arange(100_000))}})
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "kept 1"
    assert lines[1].startswith("at exit") and lines[1].endswith(" 0")  # none kept any more
    assert int(lines[1].split()[2]) >= 2  # the take's plugin, and the kept one
    assert torch.equal(Snapshot(str(path)).read_object("0/s/t"), torch.arange(100_000))
    assert "Task was destroyed" not in done.stderr


def test_a_daemon_thread_pool_starts_no_more_threads_than_jobs_at_once():
    """Jobs submitted one after the other, each as soon as the last one's result is known (as
    a plugin's calls from the I/O loop), run on one thread: a thread counts itself free before
    its job's caller hears back, so the next job is not given a new thread (with a buffer of
    its own, in the local plugin). Here the next job is submitted by the last one's done
    callback, which runs on the pool's thread the moment the result is set."""
    pool = DaemonThreadPool(8, thread_name_prefix="one-at-a-time")
    left = [20]
    done = threading.Event()

    def next_job(_: object = None) -> None:
        if left[0] == 0:
            done.set()
            return
        left[0] -= 1
        pool.submit(time.sleep, 0).add_done_callback(next_job)

    try:
        next_job()
        assert done.wait(10)
        assert len(pool._daemons.threads) == 1
    finally:
        pool.shutdown()


def test_a_daemon_thread_pool_is_a_thread_pool_executor():
    pool = DaemonThreadPool(2, thread_name_prefix="t")
    assert isinstance(pool, ThreadPoolExecutor)
    gate = threading.Event()
    names = [pool.submit(lambda: (gate.wait(5), threading.current_thread())) for _ in range(3)]
    gate.set()
    threads = {f.result(5)[1] for f in names}
    assert len(threads) <= 2 and all(t.daemon and t.name.startswith("t_") for t in threads)
    assert list(pool.map(lambda x: x * 2, range(5))) == [0, 2, 4, 6, 8]
    with pytest.raises(ZeroDivisionError):
        pool.submit(lambda: 1 / 0).result(5)
    gate.clear()
    busy = pool.submit(gate.wait, 5)
    while not busy.running():
        time.sleep(0.01)
    queued = [pool.submit(gate.wait, 5) for _ in range(3)]
    pool.shutdown(wait=False, cancel_futures=True)
    assert all(f.cancelled() for f in queued[1:])  # the one left waiting for a thread, at least
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(print)
    gate.set()
    assert busy.result(5) is True
    pool.shutdown()
    assert not any(t.is_alive() for t in threads)


class LateFS(FSStoragePlugin):
    """Local storage whose every blocking call comes late, once the interpreter is exiting, and
    goes through the loop's default executor and ``getaddrinfo`` first."""

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        await asyncio.sleep(0.05)
        await asyncio.to_thread(lambda: None)
        await asyncio.get_running_loop().getaddrinfo("localhost", 80)
        return await super()._run(fn, *args)


@pytest.mark.slow
def test_a_snapshot_pending_at_exit_still_gets_threads_for_its_io(tmp_path):
    """The exit hook runs after ``concurrent.futures`` has shut its thread pools down: the I/O
    that a pending snapshot starts then still runs (the plugin's pool, the default executor)."""
    script = textwrap.dedent(
        f"""
        import torch
        from snapshot import Snapshot, StateDict
        from storage_plugins import register_storage_plugin
        from tests.test_runtime import LateFS
        register_storage_plugin("late", lambda url, options=None: LateFS(url[7:], options))
        Snapshot.async_take("late://" + {str(tmp_path / "s")!r}, {{"s": StateDict(t=torch.ones(9))}})
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert "Error" not in done.stderr, done.stderr
    assert torch.equal(Snapshot(str(tmp_path / "s")).read_object("0/s/t"), torch.ones(9))


def test_writers_recorded_and_checked(tmp_path):
    assert writers.recorded() == {"sharded": ["statesnap", 1], "common": ["statesnap", 1]}
    writers.check_readable({}, "old")  # written before writers were recorded: statesnap v1
    writers.check_readable({"strategies": writers.recorded()}, "s")
    with pytest.raises(IncompatibleSnapshotError, match="does not say which backend"):
        writers.check_readable({"strategies": {"common": ["statesnap", "1"]}}, "s")


def test_without_the_strategy_layer_only_the_library_format_is_read(monkeypatch):
    monkeypatch.setattr(writers, "_check", writers._builtin_check)
    with pytest.raises(
        IncompatibleSnapshotError, match=r"s, sharded part: .*registered: statesnap"
    ):
        writers.check_readable(
            {"strategies": {"common": ["statesnap", 1], "sharded": ["other", 2]}}, "s"
        )


@pytest.mark.slow
def test_the_facade_does_not_load_the_strategy_layer():
    code = (
        "import sys, torch, tempfile\n"
        "from snapshot import Snapshot, StateDict\n"
        "d = tempfile.mkdtemp()\n"
        "Snapshot.take(d + '/s', {'m': StateDict(w=torch.ones(3))})\n"
        "Snapshot(d + '/s').restore({'m': StateDict(w=torch.zeros(3))})\n"
        "Snapshot.async_take(d + '/a', {'m': StateDict(w=torch.ones(3))}).wait()\n"
        "print(sorted(m for m in sys.modules if m.startswith('snapshot.strategies')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"


def test_a_forked_child_gets_a_runtime_of_its_own(tmp_path):
    import os

    parent = runtime.get()
    parent.loop()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one take, then gone without running the parent's hooks
        try:
            child = runtime.get()
            Snapshot.take(str(tmp_path / "c"), {"s": StateDict(t=torch.ones(2))})
            ok = child is not parent and child.pid == os.getpid()
            os.write(write, b"ok" if ok else b"shared")
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 16) == b"ok"
    assert runtime.get() is parent
