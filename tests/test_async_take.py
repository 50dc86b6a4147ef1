"""async_take: the content is fixed when the call returns; writes and the commit go on after."""

from __future__ import annotations

import asyncio
import errno
import threading
import time

import pytest
import torch

from snapshot import (
    NotStatefulError,
    Options,
    PendingSnapshot,
    Snapshot,
    SnapshotNotFoundError,
    StateDict,
    StorageError,
)
from snapshot._engine import runtime
from snapshot._engine.io.staging import process_pool
from snapshot._engine.take.take import TakeJob
from storage_plugins import register_storage_plugin, unregister_storage_plugin
from storage_plugins.fs import FSStoragePlugin
from tests.plugins import GATE, fail_writes, gated_storage

MARKER_GATE = threading.Event()


class SlowMarkerPlugin(FSStoragePlugin):
    """``slowmarker://<path>``: the pending marker's write waits until MARKER_GATE opens."""

    def __init__(self, url, storage_options=None):
        super().__init__(url.removeprefix("slowmarker://"), storage_options)

    async def write(self, path, buffers):
        if path == ".statesnap-pending":
            while not MARKER_GATE.is_set():
                await asyncio.sleep(0.005)
        await super().write(path, buffers)


def test_the_call_does_not_wait_for_the_pending_marker(tmp_path):
    """An fsync'd marker write can wait on the file system's journal: the call must not."""
    MARKER_GATE.clear()
    register_storage_plugin("slowmarker", SlowMarkerPlugin)
    try:
        pending = Snapshot.async_take(
            f"slowmarker://{tmp_path / 's'}", {"s": StateDict(t=torch.ones(100))}
        )
        time.sleep(0.2)
        assert not pending.done()  # blobs may be written, but the commit waits for the marker
        assert not (tmp_path / "s" / "manifest.yaml").exists()
        MARKER_GATE.set()
        pending.wait(timeout=60)
    finally:
        MARKER_GATE.set()
        unregister_storage_plugin("slowmarker")
    assert torch.equal(Snapshot(str(tmp_path / "s")).read_object("0/s/t"), torch.ones(100))
    assert not (tmp_path / "s" / ".statesnap-pending").exists()


@pytest.fixture
def gated(tmp_path):
    with gated_storage():
        yield f"gated://{tmp_path / 'snap'}", str(tmp_path / "snap")


def test_content_is_fixed_when_the_call_returns(gated):
    url, path = gated
    model = torch.nn.Linear(32, 16)
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    optim.step()
    extra = StateDict(t=torch.arange(10.0), nested={"v": torch.ones(3, 3).t()}, n=[1, 2])
    expected = {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "exp_avg": optim.state_dict()["state"][0]["exp_avg"].clone(),
    }
    pending = Snapshot.async_take(url, {"model": model, "optim": optim, "extra": extra})
    assert isinstance(pending, PendingSnapshot) and not pending.done()
    # Training goes on: every tensor changes in place, and Python values change too.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(100.0)
    for state in optim.state.values():
        for v in state.values():
            v.add_(7)
    extra["t"].mul_(-1)
    extra["nested"]["v"].zero_()
    extra["n"].append(3)
    GATE.set()
    snap = pending.wait(timeout=60)
    assert pending.done()
    for k, v in expected["model"].items():
        assert torch.equal(snap.read_object(f"0/model/{k}"), v), k
    assert torch.equal(snap.read_object("0/optim/state/0/exp_avg"), expected["exp_avg"])
    assert torch.equal(snap.read_object("0/extra/t"), torch.arange(10.0))
    assert torch.equal(snap.read_object("0/extra/nested/v"), torch.ones(3, 3))
    assert snap.read_object("0/extra/n") == [1, 2]
    assert Snapshot(path).get_manifest() == snap.get_manifest()


def test_done_never_blocks_and_wait_times_out(gated):
    url, path = gated
    pending = Snapshot.async_take(url, {"s": StateDict(t=torch.ones(100))})
    assert pending.done() is False
    with pytest.raises(TimeoutError, match="still pending"):
        pending.wait(timeout=0.05)
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(path)  # nothing is visible before the commit
    GATE.set()
    assert torch.equal(pending.wait().read_object("0/s/t"), torch.ones(100))


def test_background_failure_is_raised_by_wait_and_nothing_is_committed(faulty):
    url, inner = faulty
    fail_writes(inner, errno.EIO, "I/O error", lambda path: path.startswith("0/"))
    queued = runtime.get().queue().get_num_unfinalized_calls()
    pending = Snapshot.async_take(url, {"s": StateDict(a=torch.ones(4), b=torch.zeros(4))})
    with pytest.raises(
        StorageError, match=r"0/s/a and 1 more \(slab 0/(?:[0-9a-f]{8}-)?s0\).*I/O error"
    ) as info:
        pending.wait(timeout=60)
    assert isinstance(info.value.__cause__, OSError)
    assert pending.done()
    # Raised to its owner, the failure is forgotten by the queue (not reported again at exit).
    assert runtime.get().queue().get_num_unfinalized_calls() == queued
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(inner)


def test_capture_errors_are_raised_by_the_call(tmp_path):
    with pytest.raises(NotStatefulError, match="'x'"):
        Snapshot.async_take(str(tmp_path / "s"), {"x": 3})


def test_state_larger_than_the_budget(tmp_path):
    state = StateDict({f"t{i}": torch.full((64, 1024), float(i)) for i in range(8)})  # 2 MiB
    options = Options(memory_budget_bytes=256 * 1024)
    pending = Snapshot.async_take(str(tmp_path / "s"), {"s": state}, options=options)
    for t in state.values():
        t.fill_(-1)
    snap = pending.wait(timeout=60)
    for i in range(8):
        assert torch.equal(snap.read_object(f"0/s/t{i}"), torch.full((64, 1024), float(i)))


class TimedPlugin(FSStoragePlugin):
    """``timed://<path>``: records when each blob write starts."""

    starts: list[tuple[str, float]] = []

    def __init__(self, url, storage_options=None):
        super().__init__(url.removeprefix("timed://"), storage_options)

    async def write(self, path, buffers):
        TimedPlugin.starts.append((path, time.monotonic()))
        await super().write(path, buffers)


@pytest.mark.parametrize("budget", [None, 3 * 1024 * 1024])
def test_writes_start_once_everything_is_staged_unless_the_budget_is_full(
    tmp_path, monkeypatch, budget
):
    """Writes held back while the caller copies (they would compete with its copies); with a
    budget smaller than the state, the first writes start during the call to free it."""
    # A take's batches, a blob per tensor; no budget: the default.
    options = Options(
        write_batch_bytes=1024 * 1024, memory_budget_bytes=budget, slab_threshold_bytes=1 << 20
    )
    staged: list[float] = []
    original = TakeJob.start

    def start(job):
        original(job)
        staged.append(time.monotonic())

    monkeypatch.setattr(TakeJob, "start", start)
    TimedPlugin.starts = []
    register_storage_plugin("timed", TimedPlugin)
    try:
        state = StateDict({f"t{i}": torch.full((512, 1024), float(i)) for i in range(8)})  # 16 MiB
        pending = Snapshot.async_take(f"timed://{tmp_path / 's'}", {"s": state}, options=options)
        snap = pending.wait(timeout=60)
    finally:
        unregister_storage_plugin("timed")
    blobs = [(path, t) for path, t in TimedPlugin.starts if path.startswith("0/")]
    assert len(blobs) == 8 and len(staged) == 1
    during_call = [path for path, t in blobs if t < staged[0]]
    if budget is None:
        assert during_call == []
    else:
        assert 0 < len(during_call) < 8
    assert snap.get_manifest() == Snapshot(str(tmp_path / "s")).get_manifest()
    t7 = Snapshot(str(tmp_path / "s")).read_object("0/s/t7")
    assert torch.equal(t7, torch.full((512, 1024), 7.0))


def test_async_staging_handles_every_kind_of_tensor(tmp_path):
    from tests.helpers import assert_same, random_tensor

    value = {
        "odd": b"abc" * 500,  # an object payload that leaves the next member misaligned...
        "f64": torch.arange(10, dtype=torch.float64),  # ...so slab members are aligned
        "transposed": torch.arange(30.0).reshape(5, 6).t(),
        "conj": torch.randn(4, 3, dtype=torch.complex64).conj(),
        "uint4": random_tensor(torch.uint4, (7,)),
        "bool": torch.tensor([True, False, True]),
        "big": torch.randn(300, 300),  # a blob of its own
    }
    expected = {
        k: (v.clone() if isinstance(v, torch.Tensor) and k != "uint4" else v)
        for k, v in value.items()
    }
    expected["uint4"] = value["uint4"]
    pending = Snapshot.async_take(
        str(tmp_path / "s"),
        {"s": StateDict(value), "m": torch.nn.Linear(8, 8)},
        _custom_tensor_prepare_func=lambda p, t, tracing: (
            t.to(torch.float16) if p == "m/weight" else t
        ),
    )
    snap = pending.wait(timeout=60)
    out = StateDict()
    snap.restore({"s": out})
    assert_same({k: out[k] for k in expected}, expected)
    assert snap.read_object("0/m/weight").dtype == torch.float16
    offsets = [snap.get_manifest()[f"0/s/{k}"].locations[0].offset for k in ("f64", "bool")]
    assert all(o % 16 == 0 for o in offsets)


def _slow_copies(monkeypatch, fail: int | None = None):
    """Makes each copy of a large tensor into a staging buffer wait 0.1 s first (a write
    that started before the copy landed would write what the buffer held before), and with
    ``fail``, raises in the copy of a tensor of that many bytes."""
    from snapshot._engine.io import staging

    original = staging.copy_payload

    def copy(p, buf, pos):
        if p.nbytes >= 4 << 20:
            time.sleep(0.1)
            if p.nbytes == fail:
                raise RuntimeError("copy failed")
        original(p, buf, pos)

    monkeypatch.setattr(staging, "copy_payload", copy)


@pytest.mark.parametrize("budget", [None, 20 * 1024 * 1024])
def test_large_tensors_are_whole_when_the_call_returns(tmp_path, monkeypatch, budget):
    """The call returns only once large tensors are copied, and no write starts before its
    copy landed (with a budget below the state, writes start during the call)."""
    _slow_copies(monkeypatch)
    # 12 MiB each, random: a pooled buffer never holds these bytes from an earlier take.
    big = {f"big{i}": torch.randn(3 << 20) for i in range(4)}
    small = {f"small{i}": torch.full((100,), float(i)) for i in range(50)}
    state = StateDict({**big, **small})
    expected = {k: v.clone() for k, v in state.items()}
    options = Options(memory_budget_bytes=budget)
    pending = Snapshot.async_take(str(tmp_path / "s"), {"s": state}, options=options)
    for t in state.values():
        t.fill_(-1)
    snap = pending.wait(timeout=60)
    out = StateDict()
    snap.restore({"s": out})
    for k, v in expected.items():
        assert torch.equal(out[k], v), k


def test_a_failed_copy_fails_the_call_and_frees_its_buffers(tmp_path, monkeypatch):
    _slow_copies(monkeypatch, fail=12 << 20)
    state = StateDict(a=torch.ones(1 << 20), b=torch.ones(3 << 20), c=torch.ones(10))
    pool = process_pool(Options())
    leased = pool.leased_bytes
    with pytest.raises(RuntimeError, match="copy failed"):
        Snapshot.async_take(str(tmp_path / "s"), {"s": state})
    assert pool.leased_bytes == leased  # every buffer it staged is back in the pool
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(str(tmp_path / "s"))
    monkeypatch.undo()
    snap = Snapshot.async_take(str(tmp_path / "s"), {"s": state}).wait(timeout=60)
    assert torch.equal(snap.read_object("0/s/b"), torch.ones(3 << 20))


def test_without_the_copier_thread_the_call_copies_and_hands_over_itself(tmp_path, monkeypatch):
    """When the thread that hands writes over takes no work (shut down), the call hands its
    writes over on its own thread."""
    from concurrent.futures import ThreadPoolExecutor

    closed = ThreadPoolExecutor(1)
    closed.shutdown()
    monkeypatch.setattr(runtime.Runtime, "copier", lambda self: closed)
    state = StateDict(big=torch.randn(3 << 20), small=torch.arange(10.0))
    expected = {k: v.clone() for k, v in state.items()}
    pending = Snapshot.async_take(str(tmp_path / "s"), {"s": state})
    for t in state.values():
        t.fill_(-1)
    snap = pending.wait(timeout=60)
    for k, v in expected.items():
        assert torch.equal(snap.read_object(f"0/s/{k}"), v), k


def test_large_tensors_in_a_slab_are_copied_on_the_copier_thread(tmp_path, monkeypatch):
    """An async take's slab members of 4 MiB or more are copied on the copier thread, as a
    large tensor in a blob of its own is, and the small ones by the call; the plugin checksums
    each member as it writes it. The snapshot holds the call's values and verifies."""
    from snapshot._engine.io import staging
    from snapshot._engine.tools.verify import verify

    handed: list[int] = []
    real = staging._on_copier

    def spy(lease, copy):
        handed.append(copy.args[0].nbytes)
        real(lease, copy)

    monkeypatch.setattr(staging, "_on_copier", spy)
    medium = {f"m{i}": torch.randn(1 << 20) for i in range(3)}  # 4 MiB each: one slab
    state = StateDict({**medium, "tiny": torch.arange(5.0)})
    expected = {k: v.clone() for k, v in state.items()}
    pending = Snapshot.async_take(str(tmp_path / "s"), {"s": state})
    for t in state.values():
        t.fill_(-1)
    snap = pending.wait(timeout=60)
    assert handed == [4 << 20] * 3
    blobs = {loc.blob for i in range(3) for loc in snap.get_manifest()[f"0/s/m{i}"].locations}
    assert len(blobs) == 1  # one slab
    for k, v in expected.items():
        assert torch.equal(snap.read_object(f"0/s/{k}"), v), k
    report = verify(str(tmp_path / "s"), None)
    assert report.ok and report.ranges >= 4, report.problems  # every member's CRC-32


def test_a_failed_copy_still_waits_for_the_other_copies_into_its_buffer():
    """A buffer with several copies on the copier thread: one fails, and ``ready`` raises its
    error only once the others have ended, so the buffer is never given back while a copy
    still writes into it."""
    from snapshot._engine.io import staging

    pool = staging.StagingPool(keep_bytes=1 << 20, pin=False)
    lease = pool.acquire(4096)
    ended = threading.Event()

    def slow() -> None:
        time.sleep(0.2)
        ended.set()

    def fail() -> None:
        raise RuntimeError("copy failed")

    staging._on_copier(lease, slow)
    staging._on_copier(lease, fail)
    with pytest.raises(RuntimeError, match="copy failed"):
        lease.ready()
    assert ended.is_set()
    assert lease.copies == []
    lease.release()
    assert pool.leased_bytes == 0


def test_copies_the_copier_thread_has_not_started_are_made_by_the_call(tmp_path):
    """The call does not wait for a busy copier thread: the large tensors' copies it has not
    started are made on the caller's thread, and the snapshot holds the call's values."""
    busy, release = threading.Event(), threading.Event()

    def hold() -> None:
        busy.set()
        release.wait(60)

    held = runtime.get().copier().submit(hold)
    try:
        assert busy.wait(10)
        state = StateDict({f"big{i}": torch.randn(3 << 20) for i in range(3)})
        expected = {k: v.clone() for k, v in state.items()}
        pending = Snapshot.async_take(str(tmp_path / "s"), {"s": state})
        assert not held.done()  # returned while the copier thread was still held
        for t in state.values():
            t.fill_(-1)
    finally:
        release.set()
    snap = pending.wait(timeout=60)
    for k, v in expected.items():
        assert torch.equal(snap.read_object(f"0/s/{k}"), v), k


def test_async_take_writes_its_staged_copies_without_the_plugins_copy(tmp_path, monkeypatch):
    """An async take's staged buffers (private copies, page-aligned) are checksummed and
    written as they are: the local plugin's direct writes of a large tensor come from them, not
    from its own buffer; a plain take, whose tensors the application may change meanwhile, is
    still copied into that buffer first. Both read back the same, checksums verified."""
    from storage_plugins import fs

    used = []
    real = fs._bounce_buffer
    monkeypatch.setattr(fs, "_bounce_buffer", lambda: used.append(1) or real())
    # 4 MiB and 4 KiB: one slab, a whole number of pages.
    state = {"s": StateDict(w=torch.randn(1 << 20), b=torch.randn(1024))}
    Snapshot.async_take(str(tmp_path / "async"), state).wait()
    assert used == []
    Snapshot.take(str(tmp_path / "plain"), state)
    assert used
    from snapshot._engine.tools.verify import verify

    for name in ("async", "plain"):
        report = verify(str(tmp_path / name), None)
        assert report.ok and report.ranges >= 2, report.problems  # every CRC-32 checked
        snap = Snapshot(str(tmp_path / name))
        assert torch.equal(snap.read_object("0/s/w"), state["s"]["w"])
