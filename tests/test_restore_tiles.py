"""Restores through scratch tiles: a sharded or converted restore (a target of another dtype
than stored, a non-contiguous one, one on a device) holds at most the memory budget of scratch
at once, and device copies are ordered against the caller's streams."""

from __future__ import annotations

import logging
import weakref

import pytest
import torch

from benchmarks.common import PeakRSS
from snapshot import Options, Snapshot, StateDict
from snapshot.sharding import ShardedTensor
from tests.cuda_double import CudaDouble
from tests.multirank import run_ranks

_MIB = 1 << 20
# 4 global tensors of 32 MiB (float32, 2048 x 4096), each stored as two row shards of 16 MiB.
_KEYS = 4
_ROWS, _COLS = 2048, 4096
_BUDGET = 8 * _MIB


def _global(i: int) -> torch.Tensor:
    return (torch.arange(_ROWS * _COLS, dtype=torch.float32) + i).reshape(_ROWS, _COLS)


def _take_shards(path: str) -> None:
    pieces = {}
    half = _ROWS // 2
    for i in range(_KEYS):
        g = _global(i)
        pieces[f"a{i}"] = ShardedTensor.from_rank_offsets(f"w{i}", g[:half].clone(), (0, 0, 2))
        pieces[f"b{i}"] = ShardedTensor.from_rank_offsets(f"w{i}", g[half:].clone(), (0, 1, 2))
        del g
    Snapshot.take(path, {"m": StateDict(pieces)})


def _targets(kind: str) -> dict[str, tuple[ShardedTensor, tuple[slice, slice]]]:
    """Targets for the pieces ``a<i>`` and ``b<i>`` of each global tensor, with the slice of it
    each should end up holding. ``float64``: the stored row halves, cast on the way in;
    ``strided``: the row halves in float32, but transposed (not contiguous); ``columns``: the
    column halves in float64, each spanning both stored shards (a run per row of each);
    ``direct``: the row halves in float32, contiguous, read straight in."""
    half_r, half_c = _ROWS // 2, _COLS // 2
    out = {}
    for i in range(_KEYS):
        for j, name in enumerate((f"a{i}", f"b{i}")):
            if kind in ("columns", "columns-direct"):
                dtype = torch.float64 if kind == "columns" else torch.float32
                data = torch.zeros(_ROWS, half_c, dtype=dtype)
                st = ShardedTensor.from_rank_offsets(f"w{i}", data, (1, j, 2))
                out[name] = (st, (slice(None), slice(j * half_c, (j + 1) * half_c)))
                continue
            if kind == "float64":
                data = torch.zeros(half_r, _COLS, dtype=torch.float64)
            elif kind == "strided":
                data = torch.zeros(_COLS, half_r).t()
            else:
                data = torch.zeros(half_r, _COLS)
            st = ShardedTensor.from_rank_offsets(f"w{i}", data, (0, j, 2))
            out[name] = (st, (slice(j * half_r, (j + 1) * half_r), slice(None)))
    return out


def _restore_growth(rank: int, world: int, path: str, kind: str) -> int:
    """In a fresh process: restores into ``kind`` targets within an 8 MiB budget; returns how
    far resident memory rose above what it was before the restore (the targets allocated and
    touched)."""
    options = Options(
        memory_budget_bytes=_BUDGET,
        # Columns: run by run, not through the gaps in boxes.
        read_gap_bytes=0 if kind.startswith("columns") else None,
    )
    targets = _targets(kind)
    state = StateDict({name: st for name, (st, _) in targets.items()})
    Snapshot(path)  # the manifest read, and the library's threads, before the baseline
    with PeakRSS() as peak:  # the kernel's high-water mark, reset at entry (or sampled)
        Snapshot(path).restore({"m": state}, options=options)
    growth = peak.above_baseline
    for name, (_, where) in targets.items():
        got = state[name]
        assert torch.equal(got, _global(int(name[1:]))[where].to(got.dtype)), name
    return growth


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiles") / "snap")
    _take_shards(path)
    return path


@pytest.mark.slow
def test_a_direct_restore_needs_no_scratch(shards):
    """The control: float32 contiguous targets take the bytes straight in; what memory the
    restore adds is the library's own (threads, manifest, requests)."""
    (growth,) = run_ranks(1, _restore_growth, shards, "direct")
    assert growth < 4 * _MIB, f"{growth / _MIB:.1f} MiB"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["float64", "strided"])
def test_converted_sharded_restores_stay_within_the_memory_budget(shards, kind):
    """4 x 32 MiB sharded tensors restored into targets that cannot take raw bytes, with
    a memory budget of 8 MiB: scratch is taken tile by tile as reads run, charged to
    the budget and given back after its copy, so resident memory rises by less than the budget
    and a few MiB, not by the 128 MiB of the regions (which a scratch tensor per region, taken
    when the read was planned, held before this: 128.5 MiB here)."""
    (growth,) = run_ranks(1, _restore_growth, shards, kind)
    assert growth < _BUDGET + 4 * _MIB, f"{growth / _MIB:.1f} MiB"


@pytest.mark.slow
def test_column_runs_through_tiles_stay_within_the_memory_budget(shards):
    """Column halves of row-sharded tensors, run by run (a run of 8 KiB per row, 16,384 in all)
    into float64 targets: what the restore adds beside the same restore read straight into
    float32 targets (its needs' records, about 11 MiB) is within the budget."""
    (control,) = run_ranks(1, _restore_growth, shards, "columns-direct")
    (growth,) = run_ranks(1, _restore_growth, shards, "columns")
    assert growth - control < _BUDGET, f"{growth / _MIB:.1f} - {control / _MIB:.1f} MiB"


# ---------------------------------------------------------------------------------------------
# Device targets, through tests/cuda_double.py: it holds each non-blocking copy (and each
# kernel a test launches) until its stream runs, as CUDA does, so the order the restore puts
# its copies in is what the targets end up holding.


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A device tensor's memory as it is now, without running anything still queued."""
    with torch._C.DisableTorchFunctionSubclass():
        return t.detach().clone().as_subclass(torch.Tensor)


def _small_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 48, generator=g),  # a slab member (see _take_small)...
        "b": torch.randn(48, generator=g),  # ...with this one
        "big": torch.randn(300_000, generator=g),  # 1.2 MiB: many tiles under a small budget
    }


def _take_small(path: str, values: dict[str, torch.Tensor], options: Options | None = None) -> None:
    # A slab threshold of 1 MiB, whatever the environment says: ``big`` in a blob of its own.
    options = (options or Options()).replace(slab_threshold_bytes=1 << 20)
    state = StateDict({k: v.clone() for k, v in values.items()})
    Snapshot.take(path, {"s": state}, options=options)


def test_device_copies_wait_for_the_callers_current_stream_of_each_device(tmp_path, monkeypatch):
    """Kernels the caller queued before the restore that write the targets (on cuda:0's
    default stream, and on a stream of its own made current on cuda:1) run before the
    restored bytes land: each device's copy stream waits on the caller's current stream there.

    Fails without the wait (the fill lands after the restored bytes when the caller's streams
    run), with the wait on the device's default stream instead of the caller's current one
    (cuda:1's fill is on another stream), and with the copies on the I/O thread's own current
    stream (the code before: each copy at once, the fills after)."""
    from snapshot._engine.io import device as seam

    cuda = CudaDouble(monkeypatch, devices=2)
    values = _small_state(0)
    path = str(tmp_path / "s")
    _take_small(path, values)
    targets = {
        "w": cuda.tensor(torch.zeros(64, 48), device=0),
        "b": cuda.tensor(torch.zeros(48), device=1),
        "big": cuda.tensor(torch.zeros(300_000), device=1),
    }
    mine = seam.new_stream(1)  # the caller's own stream on cuda:1 ("cuda:1/s0")
    with seam.use_stream(mine):
        for t in targets.values():  # kernels writing the targets, still queued
            cuda.launch(lambda t=t: t.fill_(7.0), device=cuda.cuda_index(t))
        Snapshot(path).restore({"s": StateDict(targets)})
    waits = set(cuda.calls("wait"))
    assert ("wait", "cuda:0/s0", "cuda:0/default") in waits
    assert ("wait", "cuda:1/s1", "cuda:1/s0") in waits
    cuda.synchronize()  # whatever is still queued anywhere runs now
    for k, t in targets.items():
        assert torch.equal(cuda.values(t), values[k]), k


def test_a_restore_returns_with_its_device_copies_landed(tmp_path, monkeypatch):
    """The copies are queued non-blocking from pinned tiles on a stream of the restore's own,
    never on the device's default stream, and the restore synchronizes that stream before it
    returns: the targets hold the restored bytes with nothing left queued, and work the caller
    queues afterwards applies on top of them.

    Fails without the final synchronization (``Landing.finish``): the copies are still queued
    when the restore returns."""
    cuda = CudaDouble(monkeypatch, devices=1)
    values = _small_state(1)
    path = str(tmp_path / "s")
    _take_small(path, values)
    targets = {k: cuda.tensor(torch.zeros_like(v)) for k, v in values.items()}
    Snapshot(path).restore({"s": StateDict(targets)})
    copies = cuda.calls("copy")
    assert copies and all(c == ("copy", 0, "cuda:0/s0", "queued") for c in copies)
    assert cuda.pending() == 0 and cuda.calls("sync")[-1] == ("sync", "cuda:0/s0")
    for k, t in targets.items():
        assert torch.equal(_raw(t), values[k]), k
        cuda.launch(lambda t=t: t.add_(1.0))
    cuda.synchronize()
    for k, t in targets.items():
        assert torch.equal(cuda.values(t), values[k] + 1.0), k


def test_pinned_tiles_are_reused_only_once_their_copies_have_landed(tmp_path, monkeypatch):
    """A 1.2 MiB tensor restored to a device within a 64 KiB budget and 4 workers: 8 KiB
    tiles, copied non-blocking. Pinned tiles are reused (far fewer pinned than copied), never while a copy
    that reads them is queued (the double would then copy the next tile's bytes: the values
    would be wrong), and the tiles kept plus those in flight stay within the budget left beside
    the reads' own tiles (the copy stream is synchronized during the reads to keep them so).

    Fails when a tile goes back to the pool as soon as its copy is issued."""
    from snapshot._engine.restore import reads as landing

    options = Options(memory_budget_bytes=64 * 1024, max_concurrent_io=4)
    cuda = CudaDouble(monkeypatch, devices=1)
    held: list[tuple[int, int]] = []
    settle = landing.Landing._settle

    def watched(self: landing.Landing) -> None:
        settle(self)
        held.append((self._free_total + self._in_flight_total, self.spare_bytes))

    monkeypatch.setattr(landing.Landing, "_settle", watched)
    values = _small_state(2)
    path = str(tmp_path / "s")
    _take_small(path, values, options)
    big = cuda.tensor(torch.zeros(300_000))
    # The budget's tiles, no explicit one.
    Snapshot(path).read_object("0/s/big", obj_out=big, options=options)
    assert torch.equal(_raw(big), values["big"])
    copies, pins = cuda.calls("copy"), cuda.calls("pin")
    assert len(copies) == 300_000 * 4 // (8 * 1024) + 1  # tiles of 64 KiB / (2 x 4 workers)
    assert len(pins) <= 8, len(pins)  # 64 KiB of 8 KiB tiles: the budget, at most
    assert len(cuda.calls("sync")) > 10  # during the reads, not only at their end
    assert held and all(h <= spare for h, spare in held)


def test_device_targets_of_another_dtype_are_cast_on_the_host(tmp_path, monkeypatch):
    """float32 stored, float64 and bfloat16 device targets: the bytes land in a pageable tile,
    are cast on the host into a pinned tile of the target's dtype, and that one is copied
    non-blocking (torch's host-to-device copy with a cast would go through pageable memory,
    synchronously)."""
    cuda = CudaDouble(monkeypatch, devices=1)
    values = _small_state(3)
    path = str(tmp_path / "s")
    _take_small(path, values)
    targets = {
        "w": cuda.tensor(torch.zeros(64, 48, dtype=torch.float64)),
        "b": cuda.tensor(torch.zeros(48, dtype=torch.bfloat16)),
        "big": cuda.tensor(torch.zeros(300_000, dtype=torch.float64)),
    }
    Snapshot(path).restore({"s": StateDict(targets)})
    for k, t in targets.items():
        assert torch.equal(_raw(t), values[k].to(t.dtype)), k
    assert all(c[3] == "queued" for c in cuda.calls("copy"))
    # Pinned: the cast tiles only (of the targets' dtypes), never the float32 tiles read into.
    assert sorted(e[1] for e in cuda.calls("pin")) == sorted([64 * 48 * 8, 48 * 2, 2_400_000])


def _sharded_pieces(values: torch.Tensor, rows: int, key: str = "g") -> dict[str, ShardedTensor]:
    half = rows // 2
    return {
        "a": ShardedTensor.from_rank_offsets(key, values[:half].clone(), (0, 0, 2)),
        "b": ShardedTensor.from_rank_offsets(key, values[half:].clone(), (0, 1, 2)),
    }


@pytest.mark.parametrize("gap", [0, 65536], ids=["tiles", "boxes"])
def test_sharded_device_targets_land_on_the_copy_stream(tmp_path, monkeypatch, gap):
    """Row-sharded, restored into column halves on two devices (each region spans both stored
    shards): run by run through pinned tiles (non-blocking), or through the gaps in boxes
    (pageable scratch reused by the next box: a synchronous copy), both on the read's copy
    stream of the target's device, after the caller's work there, and landed on return."""
    options = Options(read_gap_bytes=gap)
    cuda = CudaDouble(monkeypatch, devices=2)
    g = torch.randn(64, 256)
    path = str(tmp_path / "s")
    Snapshot.take(path, {"m": StateDict(_sharded_pieces(g, 64))})
    left = cuda.tensor(torch.zeros(64, 128), device=0)
    right = cuda.tensor(torch.zeros(128, 64, dtype=torch.float64), device=1).t()  # strided
    for t in (left, right):
        cuda.launch(lambda t=t: t.fill_(7.0), device=cuda.cuda_index(t))
    target = StateDict(
        a=ShardedTensor.from_rank_offsets("g", left, (1, 0, 2)),
        b=ShardedTensor.from_rank_offsets("g", right, (1, 1, 2)),
    )
    Snapshot(path).restore({"m": target}, options=options)
    assert cuda.pending() == 0
    assert torch.equal(_raw(left), g[:, :128])
    assert torch.equal(_raw(right), g[:, 128:].double())
    copies = cuda.calls("copy")
    assert {c[2] for c in copies} == {"cuda:0/s0", "cuda:1/s0"}
    assert {c[3] for c in copies} == ({"queued"} if gap == 0 else {"now"})


def test_device_restores_hold_pinned_tiles_within_the_budget(tmp_path, monkeypatch):
    """Four sharded tensors of 256 KiB restored into device targets (FSDP2's case: every
    region through scratch) within a 64 KiB budget: the pinned host memory alive at once
    stays within it (before, each region had a scratch tensor of its own, taken when planned:
    1 MiB of host memory at once)."""
    from snapshot._engine.io import device as seam

    options = Options(memory_budget_bytes=64 * 1024)
    cuda = CudaDouble(monkeypatch, devices=1)
    alive = [0, 0]  # bytes, peak
    pinned_empty = seam.pinned_empty

    def counted(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = pinned_empty(shape, dtype)
        n = t.numel() * t.element_size()
        alive[0] += n
        alive[1] = max(alive[1], alive[0])
        weakref.finalize(t, lambda: alive.__setitem__(0, alive[0] - n))
        return t

    monkeypatch.setattr(seam, "pinned_empty", counted)
    gs = {f"g{i}": torch.randn(256, 256) for i in range(4)}
    path = str(tmp_path / "s")
    state = {}
    for name, g in gs.items():
        state.update({f"{name}{k}": v for k, v in _sharded_pieces(g, 256, name).items()})
    Snapshot.take(path, {"m": StateDict(state)}, options=options)
    targets = {}
    for name in gs:
        for j, k in enumerate("ab"):
            t = cuda.tensor(torch.zeros(128, 256))
            targets[f"{name}{k}"] = ShardedTensor.from_rank_offsets(name, t, (0, j, 2))
    Snapshot(path).restore({"m": StateDict(targets)}, options=options)
    for name, g in gs.items():
        assert torch.equal(_raw(targets[f"{name}a"].data), g[:128])
        assert torch.equal(_raw(targets[f"{name}b"].data), g[128:])
    assert 0 < alive[1] <= 64 * 1024


def test_a_failed_pin_copies_from_pageable_memory_synchronously(tmp_path, monkeypatch, caplog):
    cuda = CudaDouble(monkeypatch, devices=1)
    cuda.fail_pinning = True
    values = _small_state(4)
    path = str(tmp_path / "s")
    _take_small(path, values)
    targets = {k: cuda.tensor(torch.zeros_like(v)) for k, v in values.items()}
    with caplog.at_level(logging.WARNING, logger="snapshot"):
        Snapshot(path).restore({"s": StateDict(targets)})
    for k, t in targets.items():
        assert torch.equal(_raw(t), values[k]), k
    assert {c[2:] for c in cuda.calls("copy")} == {("cuda:0/s0", "now")}
    assert caplog.text.count("cannot pin host memory") <= 1


def test_a_host_only_restore_never_touches_cuda(tmp_path, monkeypatch):
    """Converted and sharded restores into host targets make no stream, pin nothing, copy
    nothing through the device seam."""
    cuda = CudaDouble(monkeypatch, devices=1)
    values = _small_state(5)
    path = str(tmp_path / "s")
    _take_small(path, values)
    targets = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in values.items()}
    Snapshot(path).restore({"s": StateDict(targets)})
    assert all(torch.equal(targets[k], v.double()) for k, v in values.items())
    assert cuda.events == []


def test_pickled_pieces_of_a_torchsnapshot_snapshot_land_on_the_copy_stream(monkeypatch):
    """torchsnapshot's pickled tensors (decoded, then copied) into device targets: each piece
    is copied synchronously on the read's copy stream, after the caller's work there."""
    from tests.test_torchsnapshot_format import SINGLE, _expected

    cuda = CudaDouble(monkeypatch, devices=1)
    expected = _expected()["single"]["extra"]
    z_big = cuda.tensor(torch.zeros(640, dtype=torch.complex64))  # chunked: several pieces
    z = cuda.tensor(torch.zeros(2, dtype=torch.complex128))  # cast on the way in
    for t in (z_big, z):
        cuda.launch(lambda t=t: t.fill_(7.0))
    Snapshot(SINGLE).restore({"extra": StateDict(z_big=z_big, z=z)})
    assert cuda.pending() == 0
    assert torch.equal(_raw(z_big), expected["z_big"])
    assert torch.equal(_raw(z), expected["z"].to(torch.complex128))
    copies = cuda.calls("copy")
    assert copies and {c[2:] for c in copies} == {("cuda:0/s0", "now")}


@pytest.mark.parametrize("gap", [0, 65536], ids=["tiles", "boxes"])
def test_device_targets_of_dtypes_without_a_copy_kernel_land_as_bytes(tmp_path, monkeypatch, gap):
    """torch has no copy kernel for the sub-byte integer dtypes (int1..int7, uint1..uint7:
    one byte per element in memory), on the host or on a GPU. Their bytes land in device
    targets through uint8 views of the same shape and strides: dense targets (contiguous and
    transposed, through pinned tiles), ``read_object`` into one, and sharded ones through
    boxes.

    Found by benchmarks/gpu_check.py on an H100: the restore raised ``"copy_" not implemented
    for 'Int1'`` from the tiles' device copies."""
    from snapshot._engine.format.serialization import BYTE_VIEW_DTYPES

    options = Options(read_gap_bytes=gap)
    cuda = CudaDouble(monkeypatch, devices=1)
    g = torch.Generator().manual_seed(9)
    dtypes = sorted(BYTE_VIEW_DTYPES, key=str)
    assert dtypes, "this torch has no sub-byte dtypes"
    values = {
        str(d): torch.randint(0, 256, (40, 30), dtype=torch.uint8, generator=g).view(d)
        for d in dtypes
    }
    path = str(tmp_path / "s")
    rows = torch.randint(0, 256, (64, 256), dtype=torch.uint8, generator=g)
    pieces = {
        k: ShardedTensor.from_rank_offsets("g", v.view(dtypes[0]), (0, i, 2))
        for i, (k, v) in enumerate(zip("ab", rows.clone().chunk(2), strict=True))
    }
    Snapshot.take(path, {"s": StateDict(values), "m": StateDict(pieces)}, options=options)

    targets = {}
    for i, (k, v) in enumerate(values.items()):
        flat = torch.zeros(v.shape[::-1] if i % 2 else v.shape, dtype=torch.uint8).view(v.dtype)
        targets[k] = cuda.tensor(flat).t() if i % 2 else cuda.tensor(flat)
    left = cuda.tensor(torch.zeros(64, 128, dtype=torch.uint8).view(dtypes[0]))
    right = cuda.tensor(torch.zeros(128, 64, dtype=torch.uint8).view(dtypes[0])).t()
    sharded = StateDict(
        a=ShardedTensor.from_rank_offsets("g", left, (1, 0, 2)),
        b=ShardedTensor.from_rank_offsets("g", right, (1, 1, 2)),
    )
    Snapshot(path).restore({"s": StateDict(targets), "m": sharded}, options=options)
    assert cuda.pending() == 0
    for k, t in targets.items():
        assert torch.equal(_raw(t.view(torch.uint8)), values[k].view(torch.uint8)), k
    assert torch.equal(_raw(left.view(torch.uint8)), rows[:, :128])
    assert torch.equal(_raw(right.view(torch.uint8)), rows[:, 128:])

    out = cuda.tensor(torch.zeros(40, 30, dtype=torch.uint8).view(dtypes[-1]))
    Snapshot(path).read_object(f"0/s/{dtypes[-1]}", obj_out=out, options=options)
    assert torch.equal(_raw(out.view(torch.uint8)), values[str(dtypes[-1])].view(torch.uint8))


@pytest.mark.parametrize("keeps_up", [True, False], ids=["device-keeps-up", "device-lags"])
def test_device_tiles_are_short_and_reused_once_their_copies_are_done(
    tmp_path, monkeypatch, keeps_up
):
    """A 96 MiB tensor restored to a device with a budget whose tiles would be 32 MiB: the
    bytes go through tiles of at most ``DEVICE_TILE_BYTES`` (a read's pinned memory is fresh
    memory locked at the host's page-locking speed, which a process's first restore pays in
    full). A tile is free again once the event after its copies has passed, asked without
    waiting: with a device that keeps up, the restore pins about one tile per worker and never
    synchronizes the copy stream before its end. With one that lags, tiles are still reused,
    by waiting for the stream once the tiles in flight reach the budget's spare bytes.

    Fails when every tile is as long as the budget allows, or when a tile comes back only at
    a synchronization of the stream (12 tiles pinned for 4 workers)."""
    from snapshot._engine.restore.reads import DEVICE_TILE_BYTES

    workers = 4
    options = Options(memory_budget_bytes=256 * _MIB, max_concurrent_io=workers)
    cuda = CudaDouble(monkeypatch, devices=1)
    cuda.copies_done_when_asked = keeps_up
    values = {"big": torch.randn(24 * _MIB, generator=torch.Generator().manual_seed(4))}
    path = str(tmp_path / "s")
    _take_small(path, values)
    target = cuda.tensor(torch.zeros(24 * _MIB))
    Snapshot(path).restore({"s": StateDict(big=target)}, options=options)
    assert cuda.pending() == 0
    assert torch.equal(_raw(target), values["big"])
    pins = [e[1] for e in cuda.calls("pin")]
    assert len(cuda.calls("copy")) == 96 * _MIB // DEVICE_TILE_BYTES
    assert pins and max(pins) == DEVICE_TILE_BYTES
    if keeps_up:
        assert len(pins) <= workers + 1, pins
        assert cuda.calls("sync") == [("sync", "cuda:0/s0")]  # the restore's end alone
    else:
        # Spare bytes: 256 MiB less 4 workers' 32 MiB tiles = 128 MiB, 16 tiles of 8 MiB, of
        # which the reads hold up to 4.
        assert len(pins) <= 128 * _MIB // DEVICE_TILE_BYTES + workers, pins
        assert len(cuda.calls("sync")) >= 1
