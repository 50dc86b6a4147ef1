"""Async take's staging of device tensors, on CPU: the ordering rules (checksums after copies
land, one staging stream per device waiting on that device's current stream, ``ready`` waiting
for every stream, a failed stage waiting before it releases), pinned memory (power-of-two
classes, the host cache emptied on trim, lazy pinning, the fallback when pinning fails) and the
process-wide staging budget. Device copies run through ``tests/cuda_double.py``, which holds
every non-blocking copy until its stream is synchronized, as CUDA does.

Each ordering test fails when its rule is taken out of the library (checked by running it
against copies of the code with the rule removed; see each test's docstring)."""

from __future__ import annotations

import functools
import logging
import threading
import time

import pytest
import torch

from snapshot import Snapshot, SnapshotError, StateDict
from snapshot._engine import runtime
from snapshot._engine.handlers.table import Layout
from snapshot._engine.io.staging import StagingPool, process_pool
from snapshot._engine.take.plan import collect, place
from snapshot._engine.tools.verify import verify
from snapshot.options import Options
from snapshot.strategies.tensor_aware import BasicTensorAwareStateDict
from storage_plugins import register_storage_plugin, unregister_storage_plugin
from storage_plugins.fs import FSStoragePlugin
from tests.cuda_double import CudaDouble
from tests.plugins import GATE, gated_storage


@pytest.fixture
def pool():
    """A new process pool for the test: the test runs in a runtime of its own (the process's
    own is put back after it)."""
    with runtime.use():
        yield process_pool(Options().resolved())


# A budget of 1 MiB, and a blob (and a lease) per tensor.
BLOBS_IN_1_MIB = Options(memory_budget_bytes=1 << 20, slab_threshold_bytes=0)


def _values(seed: int, n: int, numel: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(numel, generator=g) for i in range(n)}


def _check_snapshot(path: str, expected: dict[str, torch.Tensor], key: str = "s") -> None:
    """Every byte range's CRC matches (``verify``), and each tensor reads back bitwise."""
    report = verify(path, None)
    assert report.ok, report.problems
    assert report.checksums_checked > 0
    snap = Snapshot(path)
    for name, want in expected.items():
        got = snap.read_object(f"0/{key}/{name}")
        assert torch.equal(got, want), name


def test_checksums_are_taken_once_device_copies_have_landed(tmp_path, monkeypatch, pool):
    """Slab members copied from a device: the CRC is computed after ``lease.ready()``.

    Fails with the CRC taken right after issuing each member's copy (the code before: in the
    same loop, before ``ready``): the double holds the copy until the stream is synchronized,
    so the CRC covers bytes not yet written and ``verify`` reports a checksum mismatch."""
    cuda = CudaDouble(monkeypatch, devices=1)
    host = _values(0, 20, 100)  # 400 bytes each: slab members
    state = StateDict({k: cuda.tensor(v) for k, v in host.items()})
    Snapshot.async_take(str(tmp_path / "s"), {"s": state}).wait(timeout=60)
    assert ("copy", 0, "cuda:0/s0", "queued") in cuda.events  # asynchronous, on the side stream
    _check_snapshot(str(tmp_path / "s"), host)
    out = StateDict({k: torch.zeros(100) for k in host})
    Snapshot(str(tmp_path / "s")).restore({"s": out})  # checks every CRC on the way
    assert all(torch.equal(out[k], v) for k, v in host.items())


def test_each_devices_staging_stream_waits_for_that_devices_current_stream(
    tmp_path, monkeypatch, pool
):
    """The tensors' final values come from kernels still queued on each device's current
    stream when async_take is called: every staging copy must come after them.

    Fails without the wait (old values are copied), and with one staging stream on one device
    waiting on that device's current stream only (the code before: a copy from cuda:1 then
    runs on cuda:1's current stream, which nothing waits for: the CRC and the bytes are the
    old values', or not there at all)."""
    cuda = CudaDouble(monkeypatch, devices=2)
    final = _values(1, 8, 64) | {"big": torch.randn(300_000)}  # slab members and a blob
    state = StateDict()
    for i, (k, v) in enumerate(final.items()):
        t = cuda.tensor(torch.zeros_like(v), device=i % 2)
        cuda.launch(lambda t=t, v=v: t.copy_(v), device=i % 2)  # the kernel computing it
        state[k] = t
    pending = Snapshot.async_take(str(tmp_path / "s"), {"s": state})
    # Training goes on: in-place kernels queued at once must not reach the snapshot.
    for i, t in enumerate(state.values()):
        cuda.launch(lambda t=t: t.add_(100.0), device=i % 2)
    pending.wait(timeout=60)
    _check_snapshot(str(tmp_path / "s"), final)
    assert cuda.streams_made() == {0: 1, 1: 1}  # one staging stream per device
    waits = set(cuda.calls("wait"))
    assert ("wait", "cuda:1/s0", "cuda:1/default") in waits
    assert ("wait", "cuda:0/s0", "cuda:0/default") in waits
    cuda.synchronize()
    assert torch.equal(cuda.values(state["big"]), final["big"] + 100.0)


def test_ready_waits_for_every_stream_the_lease_used(monkeypatch):
    """One slab with members from two devices: both staging streams are synchronized before
    the slab's bytes are handed to the writer, which checksums them.

    Fails when ``Lease.ready`` synchronizes only one stream (the code before: only the
    pool's one stream): the other device's copies have not landed."""
    cuda = CudaDouble(monkeypatch, devices=2)
    layout = Layout(chunk_bytes=1 << 20, slab_threshold_bytes=4096, slab_bytes=1 << 20)
    pool = StagingPool(keep_bytes=1 << 20)
    host = _values(2, 6, 50)
    state = {k: cuda.tensor(v, device=i % 2) for i, (k, v) in enumerate(host.items())}
    out = collect(
        [("s", state)],
        rank=0,
        prepare=None,
        replicated=(),
        inline_max_bytes=64,
        chunk_bytes=1 << 20,
    )
    plan = place(out, rank=0, layout=layout, writer_of={}, stager=pool)
    (slab,) = plan.writes
    buffers, lease = slab.stage()
    lease.ready()  # what the pipeline does before it hands a write over
    data = bytes(buffers[0])
    for k, v in host.items():
        (p,) = out.entries[f"0/s/{k}"].payloads
        assert data[p.pos : p.pos + p.nbytes] == v.numpy().tobytes(), k
        assert (p.pos, p.nbytes) in slab.checksum_ranges, k  # checksummed as it is written
    assert lease.pinned and cuda.pending() == 0
    assert {e[1] for e in cuda.calls("sync")} == {"cuda:0/s0", "cuda:1/s0"}
    lease.release()


def test_a_failed_stage_waits_for_issued_copies_before_releasing(tmp_path, monkeypatch, pool):
    """A slab whose second member fails to stage (its prepare function raises) after the
    first member's copy was issued: the block goes back to the pool only once that copy has
    landed, so it cannot be lent again while a copy may still write into it.

    Fails when the lease is released without waiting (the code before): at the give-back
    the double still holds the first member's copy."""
    cuda = CudaDouble(monkeypatch, devices=1)
    at_give_back: list[int] = []
    original = StagingPool._give_back

    def give_back(self, block, pinned):
        at_give_back.append(cuda.pending())
        original(self, block, pinned)

    monkeypatch.setattr(StagingPool, "_give_back", give_back)

    def prepare(path, t, tracing):
        if path.endswith("/b") and not tracing:
            raise ValueError("no")
        return t

    state = StateDict(a=cuda.tensor(torch.randn(100)), b=cuda.tensor(torch.randn(100)))
    with pytest.raises(SnapshotError, match="s/b: _custom_tensor_prepare_func raised"):
        Snapshot.async_take(str(tmp_path / "s"), {"s": state}, _custom_tensor_prepare_func=prepare)
    assert ("copy", 0, "cuda:0/s0", "queued") in cuda.events
    assert at_give_back == [0]
    assert pool.free_bytes == pool.allocated_bytes  # the block is back, and reusable


def test_a_failed_stage_gives_back_the_budget_of_what_it_staged(tmp_path, pool):
    """Writes staged before a failure (held, not yet written) give their part of the shared
    budget back: a leftover would shrink every later async take's budget for good."""

    def prepare(path, t, tracing):
        if path.endswith("/c") and not tracing:
            raise ValueError("no")
        return t

    state = StateDict(_blocks(2, 40) | {"c": torch.randn(10)})
    with pytest.raises(SnapshotError, match="s/c: _custom_tensor_prepare_func raised"):
        Snapshot.async_take(
            str(tmp_path / "s"),
            {"s": state},
            _custom_tensor_prepare_func=prepare,
            options=BLOBS_IN_1_MIB,
        )
    _assert_budget_given_back(pool, tmp_path)


def _assert_budget_given_back(pool: StagingPool, tmp_path) -> None:
    """After a failed async take (with ``BLOBS_IN_1_MIB``): nothing of the budget is held, and
    a take of exactly the budget goes through."""
    assert pool.budget.used == 0 and pool.leased_bytes == 0
    whole = {"w": torch.randn(256 * 1024)}  # exactly the budget
    Snapshot.async_take(str(tmp_path / "b"), {"s": StateDict(whole)}, options=BLOBS_IN_1_MIB).wait(
        timeout=60
    )
    _check_snapshot(str(tmp_path / "b"), whole)


def test_pinned_blocks_come_in_powers_of_two(monkeypatch):
    cuda = CudaDouble(monkeypatch)
    assert [StagingPool.size_class(n, pinned=True) for n in (1, 65537, 100_000, 3 << 20)] == [
        65536,
        131072,
        131072,
        4 << 20,
    ]
    assert StagingPool.size_class(65537) == 98304  # pageable memory keeps the 1.5x classes
    pool = StagingPool(keep_bytes=1 << 20)
    lease = pool.acquire(70_000, from_device=True)
    assert lease.pinned and cuda.is_pinned(lease.tensor)
    assert pool.allocated_bytes == pool.pinned_bytes == 131072
    assert pool.block_bytes(70_000, from_device=True) == 131072  # what the budget is charged
    assert pool.block_bytes(70_000, from_device=False) == 98304
    lease.release()
    host = pool.acquire(70_000)  # a write from host memory gets pageable memory
    assert not host.pinned and not cuda.is_pinned(host.tensor)
    host.release()


def test_the_host_cache_is_emptied_when_the_pool_trims_pinned_blocks(monkeypatch):
    cuda = CudaDouble(monkeypatch)
    pool = StagingPool(keep_bytes=128 << 10)
    kept, dropped = pool.acquire(100_000, True), pool.acquire(100_000, True)
    kept.release()
    dropped.release()  # beyond keep_bytes: dropped, still locked in torch's host cache
    assert pool.free_bytes == 128 << 10 and cuda.host_cache_emptied == 0
    pool.trim()
    assert cuda.host_cache_emptied == 1
    pool.trim()  # nothing pinned dropped since: no call
    assert cuda.host_cache_emptied == 1
    pool.keep_bytes = 0
    pool.trim()  # the kept block goes too
    assert pool.free_bytes == 0 and cuda.host_cache_emptied == 2
    host = StagingPool(keep_bytes=0)
    host.acquire(100_000).release()
    host.trim()
    assert cuda.host_cache_emptied == 2  # pageable blocks need no such call


def test_async_take_trims_the_pool_when_its_writes_are_done(tmp_path, monkeypatch, pool):
    cuda = CudaDouble(monkeypatch)
    options = Options(memory_budget_bytes=512 << 10, slab_threshold_bytes=0)
    # Blocks of 256, 256 and 128 KiB: more than the pool keeps (512 KiB).
    state = StateDict(
        a=cuda.tensor(torch.randn(60_000)), b=cuda.tensor(torch.randn(60_000)),
        c=cuda.tensor(torch.randn(30_000)),
    )  # fmt: skip
    Snapshot.async_take(str(tmp_path / "s"), {"s": state}, options=options).wait(timeout=60)
    assert pool.free_bytes <= 512 << 10
    assert pool.pinned_bytes == pool.allocated_bytes > pool.free_bytes  # some were dropped
    assert cuda.host_cache_emptied == 1


def test_a_host_only_state_never_touches_cuda(tmp_path, monkeypatch, pool):
    """No pinning, no stream, no CUDA call of any kind for host tensors (contiguous or not,
    prepared or not), so an all-CPU state on a GPU machine gets neither locked memory nor a
    CUDA context."""
    cuda = CudaDouble(monkeypatch)
    state = StateDict(
        a=torch.randn(100), t=torch.randn(30, 40).t(), big=torch.randn(400_000), o={"x": 1}
    )
    Snapshot.async_take(str(tmp_path / "s"), {"s": state}).wait(timeout=60)
    Snapshot.async_take(
        str(tmp_path / "p"), {"s": state}, _custom_tensor_prepare_func=lambda p, t, tr: t
    ).wait(timeout=60)
    assert cuda.events == [] and pool.pinned_bytes == 0


def test_pinning_and_streams_start_with_the_first_device_tensor(tmp_path, monkeypatch, pool):
    cuda = CudaDouble(monkeypatch, devices=2)
    options = Options(slab_threshold_bytes=0)
    state = StateDict(h=torch.randn(50_000), d=cuda.tensor(torch.randn(50_000), device=1))
    for i in range(2):
        Snapshot.async_take(str(tmp_path / f"s{i}"), {"s": state}, options=options).wait(timeout=60)
    assert cuda.streams_made() == {1: 1}  # made once, for the one device used
    assert 0 < pool.pinned_bytes < pool.allocated_bytes  # the host tensor's block is pageable
    assert len(cuda.calls("pin")) == 1  # the second take reused the pinned block


def test_a_failed_pin_falls_back_to_pageable_memory_with_one_warning(
    tmp_path, monkeypatch, pool, caplog
):
    cuda = CudaDouble(monkeypatch)
    cuda.fail_pinning = True
    host = _values(3, 5, 1000) | {"big": torch.randn(100_000)}
    state = StateDict({k: cuda.tensor(v) for k, v in host.items()})
    with caplog.at_level(logging.WARNING, logger="snapshot._engine.io.staging"):
        for i in range(2):
            Snapshot.async_take(str(tmp_path / f"s{i}"), {"s": state}).wait(timeout=60)
    warnings = [r for r in caplog.records if "cannot pin" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert pool.pinned_bytes == 0
    # Into pageable memory the copies are synchronous: none was queued.
    assert cuda.calls("copy") and all(e[3] == "now" for e in cuda.calls("copy"))
    for i in range(2):
        _check_snapshot(str(tmp_path / f"s{i}"), host)


def test_tensor_aware_copies_are_queued_on_each_devices_current_stream(monkeypatch):
    """``copy_tensors_to_cpu(non_blocking=True)``: each copy lands once its own device's
    stream is synchronized; synchronizing one device does not cover the other's."""
    cuda = CudaDouble(monkeypatch, devices=2)
    a, b = torch.randn(10), torch.randn(20)
    state = BasicTensorAwareStateDict({"a": cuda.tensor(a, 0), "b": cuda.tensor(b, 1)})
    state.copy_tensors_to_cpu(non_blocking=True)
    staged = state.state_dict
    assert all(cuda.is_pinned(staged[k]) and staged[k].is_cpu for k in ("a", "b"))
    copies = cuda.calls("copy")
    assert copies == [
        ("copy", 0, "cuda:0/default", "queued"),
        ("copy", 1, "cuda:1/default", "queued"),
    ]
    cuda.synchronize(0)
    assert torch.equal(staged["a"], a) and not torch.equal(staged["b"], b)
    cuda.synchronize(1)
    assert torch.equal(staged["b"], b)


# -------------------------------------------------------------------------------------------
# The process's staging budget, shared by pending snapshots.


@pytest.fixture
def gated(tmp_path):
    """Locations whose writes wait for ``GATE``; the tests take to them with ``BLOBS_IN_1_MIB``."""
    with gated_storage():
        yield lambda name: f"gated://{tmp_path / name}"


def _in_thread(fn):
    result: dict[str, object] = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as e:  # reported by the test
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def _blocks(n: int, seed: int) -> dict[str, torch.Tensor]:
    return _values(seed, n, 64 * 1024)  # 256 KiB each: a 256 KiB block each


def test_a_second_async_take_waits_for_the_first_ones_blocks(gated, pool, tmp_path):
    """The first snapshot holds the whole budget while its writes are held up; a second one
    does not stage a budget of its own: its call waits until the first one's writes give
    blocks back.

    Fails with a budget per snapshot (the code before): the second call returns at once,
    with a second budget of blocks lent out."""
    first_values, second_values = _blocks(4, 10), _blocks(2, 11)  # 1 MiB, 512 KiB
    first = Snapshot.async_take(gated("a"), {"s": StateDict(first_values)}, options=BLOBS_IN_1_MIB)
    assert pool.leased_bytes == 1 << 20
    thread, result = _in_thread(
        lambda: Snapshot.async_take(
            gated("b"), {"s": StateDict(second_values)}, options=BLOBS_IN_1_MIB
        )
    )
    thread.join(0.5)
    assert thread.is_alive()  # waiting for blocks
    assert pool.leased_bytes <= 1 << 20
    GATE.set()
    thread.join(60)
    assert not thread.is_alive() and "error" not in result, result
    first.wait(timeout=60)
    result["value"].wait(timeout=60)
    assert pool.budget.peak <= 1 << 20
    _check_snapshot(str(tmp_path / "a"), first_values)
    _check_snapshot(str(tmp_path / "b"), second_values)


def test_a_write_larger_than_what_is_free_waits_without_deadlock(gated, pool, tmp_path):
    """A snapshot whose single write is larger than the whole budget, while another holds part
    of it: it waits until nothing is held, then runs alone. One that needs more than is free in
    many writes stages what fits, starts those writes, and goes on as they finish."""
    first_values = _blocks(2, 20)  # half the budget, held by gated writes
    huge = {"huge": torch.randn(600_000)}  # 2.4 MiB: one write, more than the budget
    many = _blocks(6, 21)  # 1.5 MiB in six writes
    take = functools.partial(Snapshot.async_take, options=BLOBS_IN_1_MIB)
    first = take(gated("a"), {"s": StateDict(first_values)})
    t_huge, r_huge = _in_thread(lambda: take(gated("b"), {"s": StateDict(huge)}))
    t_many, r_many = _in_thread(lambda: take(gated("c"), {"s": StateDict(many)}))
    time.sleep(0.3)
    assert t_huge.is_alive() and t_many.is_alive()
    GATE.set()
    for t in (t_huge, t_many):
        t.join(60)
        assert not t.is_alive()
    assert "error" not in r_huge and "error" not in r_many, (r_huge, r_many)
    for pending in (first, r_huge["value"], r_many["value"]):
        pending.wait(timeout=60)
    assert pool.leased_bytes == 0 and pool.budget.used == 0  # every byte given back
    _check_snapshot(str(tmp_path / "a"), first_values)
    _check_snapshot(str(tmp_path / "b"), huge)
    _check_snapshot(str(tmp_path / "c"), many)


def test_a_failed_write_gives_its_budget_back(tmp_path, pool):
    """A take whose writes fail must not keep any of the shared budget: the next take could
    otherwise never stage a write as large as the budget."""

    class Failing(FSStoragePlugin):
        def __init__(self, url, storage_options=None):
            super().__init__(url.removeprefix("failstage://"), storage_options)

        async def write(self, path, buffers):
            if path != ".statesnap-pending":
                raise OSError(5, "I/O error")
            await super().write(path, buffers)

    register_storage_plugin("failstage", Failing)
    try:
        pending = Snapshot.async_take(
            f"failstage://{tmp_path / 'a'}",
            {"s": StateDict(_blocks(3, 30))},
            options=BLOBS_IN_1_MIB,
        )
        with pytest.raises(SnapshotError):
            pending.wait(timeout=60)
    finally:
        unregister_storage_plugin("failstage")
    _assert_budget_given_back(pool, tmp_path)


def test_tensor_aware_copies_fall_back_to_pageable_memory(monkeypatch):
    cuda = CudaDouble(monkeypatch)
    cuda.fail_pinning = True
    a = torch.randn(10)
    state = BasicTensorAwareStateDict({"a": cuda.tensor(a)})
    state.copy_tensors_to_cpu(non_blocking=True)
    assert cuda.calls("copy") == [("copy", 0, "cuda:0/default", "now")]  # synchronous
    assert torch.equal(state.state_dict["a"], a) and not cuda.is_pinned(state.state_dict["a"])


def test_the_runtime_shutdown_releases_the_staging_memory(tmp_path, monkeypatch):
    """The pool keeps its blocks between snapshots, and gives them back (the pinned ones to the
    system too) when the runtime shuts down."""
    cuda = CudaDouble(monkeypatch)
    state = StateDict(d=cuda.tensor(torch.randn(60_000)), h=torch.randn(30_000))
    with runtime.use() as rt:
        pending = Snapshot.async_take(str(tmp_path / "s"), {"s": state}, options=BLOBS_IN_1_MIB)
        pending.wait(timeout=60)
        pool = rt.pool
        assert pool is not None and pool.pinned_bytes > 0
        assert pool.free_bytes == pool.allocated_bytes  # kept for the next snapshot
        assert cuda.host_cache_emptied == 0
    assert pool.free_bytes == pool.leased_bytes == 0
    assert cuda.host_cache_emptied == 1
    _check_snapshot(str(tmp_path / "s"), {"h": state["h"]})
