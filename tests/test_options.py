"""Options: the tunables of one call, built once from the environment and overridable per call."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from snapshot import ChecksumError, InvalidArgumentError, Options, Snapshot, StateDict
from snapshot.knobs import override_max_chunk_size_bytes, override_slab_size_threshold_bytes
from snapshot.options import resolve


def test_options_are_frozen_and_checked():
    opts = Options(chunk_bytes=4096)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.chunk_bytes = 1  # type: ignore[misc]
    assert opts.replace(chunk_bytes=8192).chunk_bytes == 8192 and opts.chunk_bytes == 4096
    for bad in (
        {"chunk_bytes": 0},
        {"max_concurrent_io": 0},
        {"slab_threshold_bytes": -1},
        {"checksums": 1},
        {"io_retries": 1.5},
        {"inline_max_bytes": "big"},
        {"memory_budget_bytes": 0},
    ):
        with pytest.raises(InvalidArgumentError, match=next(iter(bad))):
            Options(**bad)
    Options(io_timeout_secs=0.5 + 1, keep_open_secs=0)  # seconds may be floats
    with pytest.raises(InvalidArgumentError, match="snapshot.Options"):
        resolve({"chunk_bytes": 4096})  # type: ignore[arg-type]


def test_none_fields_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("STATESNAP_CHUNK_BYTES", "65536")
    monkeypatch.setenv("STATESNAP_CHECKSUMS", "0")
    monkeypatch.setenv("STATESNAP_IO_TIMEOUT_SECS", "7")
    opts = resolve(None)
    assert opts.chunk_bytes == 65536 and opts.checksums is False and opts.io_timeout_secs == 7.0
    # A field given in the call wins over the environment; the rest still come from it.
    given = resolve(Options(checksums=True))
    assert given.checksums is True and given.chunk_bytes == 65536
    # Unset, the moment-dependent ones stay None and are worked out where they are used.
    monkeypatch.delenv("STATESNAP_CHUNK_BYTES")
    opts = resolve(None)
    assert (
        opts.chunk_bytes is None and opts.chunk() == 128 << 20 and opts.chunk(32 << 20) == 32 << 20
    )
    assert opts.memory_budget_bytes is None and 64 << 20 <= opts.budget() <= 4096 << 20
    assert Options(memory_budget_bytes=12345).budget(1 << 30) == 12345


def test_a_bad_environment_value_is_named(monkeypatch):
    monkeypatch.setenv("STATESNAP_MAX_CONCURRENT_IO", "many")
    with pytest.raises(InvalidArgumentError, match="STATESNAP_MAX_CONCURRENT_IO"):
        resolve(None)
    # Given in the call, the field is not read from the environment at all.
    assert resolve(Options(max_concurrent_io=3)).max_concurrent_io == 3


def test_torchsnapshot_override_blocks_feed_the_options():
    with override_max_chunk_size_bytes(5000), override_slab_size_threshold_bytes(0):
        opts = Options.from_env()
        assert opts.chunk_bytes == 5000 and opts.slab_threshold_bytes == 0
        assert opts.slab_bytes == 1
    assert Options.from_env().slab_threshold_bytes is None  # the take's kind decides


def test_take_and_async_take_pack_payloads_up_to_16_mib_into_slabs(tmp_path):
    """Both kinds of take pack payloads of up to 16 MiB (at most a slab's size) into slabs: a
    take writes the members over 1 MiB from the tensors' own memory, an async take copies every
    payload anyway; an explicit threshold holds for both."""
    from snapshot._engine.tools.verify import verify

    mib = 1 << 20
    assert Options().slab_threshold(32 * mib) == 16 * mib
    assert Options().slab_threshold(8 * mib) == 8 * mib  # a small budget's slabs
    assert Options(slab_threshold_bytes=4096).slab_threshold(32 * mib) == 4096
    with override_slab_size_threshold_bytes(0):
        assert Options.from_env().slab_threshold(32 * mib) == 0
    # 3 MiB tensors (viewed in a take) between small ones (copied), and a 20 MiB one alone.
    values = {f"t{i}": torch.full((3 * mib // 4,), float(i)) for i in range(4)}
    values |= {f"small{i}": torch.full((100,), float(i)) for i in range(3)}
    values["big"] = torch.arange(5 * mib, dtype=torch.float32)
    state = {"s": StateDict(values)}
    plain = Snapshot.take(str(tmp_path / "plain"), state)
    pending = Snapshot.async_take(str(tmp_path / "async"), state)
    copied = pending.wait()
    apart = Snapshot.take(str(tmp_path / "apart"), state, options=Options(slab_threshold_bytes=0))
    for snap in (plain, copied):
        assert len({_blobs(snap, f"0/s/{k}")[0] for k in values if k != "big"}) == 1
        assert _blobs(snap, "0/s/big")[0] not in _blobs(snap, "0/s/t0")
    assert len({_blobs(apart, f"0/s/{k}")[0] for k in values}) == len(values)
    for snap in (plain, copied, apart):
        report = verify(snap.path, None)
        assert report.ok and report.ranges == len(values), report.problems
        for k, v in values.items():
            assert torch.equal(snap.read_object(f"0/s/{k}"), v)


def test_a_slab_of_odd_sized_members_restores(tmp_path):
    """Members of odd sizes over and under 1 MiB in one slab, two large ones in a row: the
    padding that aligns each member is written between views and copied runs alike."""
    from snapshot._engine.tools.verify import verify

    g = torch.Generator().manual_seed(5)
    sizes = [(1 << 20) + 3, 5, (1 << 20) + 7, (2 << 20) + 1, 9, 1000]
    values = {
        f"t{i}": torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
        for i, n in enumerate(sizes)
    }
    snap = Snapshot.take(str(tmp_path / "s"), {"s": StateDict(values)})
    assert len({_blobs(snap, f"0/s/{k}")[0] for k in values}) == 1
    report = verify(snap.path, None)
    assert report.ok and report.ranges == len(values), report.problems
    target = {"s": StateDict({k: torch.zeros_like(v) for k, v in values.items()})}
    snap.restore(target)
    for k, v in values.items():
        assert torch.equal(target["s"][k], v), k


def _blobs(snap: Snapshot, path: str) -> list[str]:
    return [loc.blob for loc in snap.get_manifest()[path].locations]


def test_a_take_uses_the_options_of_its_call(tmp_path, monkeypatch):
    monkeypatch.setenv("STATESNAP_CHUNK_BYTES", str(1 << 20))  # the call's options win
    big = torch.arange(10_000, dtype=torch.float32)  # 40,000 bytes
    state = {"s": StateDict(big=big, small=torch.ones(10))}
    opts = Options(chunk_bytes=8192, slab_threshold_bytes=0, checksums=False)
    snap = Snapshot.take(str(tmp_path / "a"), state, options=opts)
    assert len(set(_blobs(snap, "0/s/big"))) == 5  # 40,000 bytes in chunks of 8 KiB
    assert all(
        loc.crc32 is None
        for p in ("0/s/big", "0/s/small")
        for loc in snap.get_manifest()[p].locations
    )
    # Without options, the same state goes by the environment: one chunk, with checksums.
    plain = Snapshot.take(str(tmp_path / "b"), state)
    assert len(_blobs(plain, "0/s/big")) == 1
    assert all(loc.crc32 is not None for loc in plain.get_manifest()["0/s/big"].locations)
    out = StateDict(big=torch.zeros(10_000), small=torch.zeros(10))
    snap.restore({"s": out}, options=Options(max_concurrent_io=1, read_request_bytes=4096))
    assert torch.equal(out["big"], big) and torch.equal(out["small"], torch.ones(10))


def test_async_take_uses_the_options_of_its_call(tmp_path):
    big = torch.arange(10_000, dtype=torch.float32)
    pending = Snapshot.async_take(
        str(tmp_path / "s"),
        {"s": StateDict(big=big)},
        options=Options(chunk_bytes=16384, slab_threshold_bytes=0),
    )
    snap = pending.wait()
    assert len(set(_blobs(snap, "0/s/big"))) == 3


def test_a_restore_verifies_by_the_options_of_its_call(tmp_path):
    path = tmp_path / "s"
    big = torch.arange(1000, dtype=torch.float32)
    snap = Snapshot.take(str(path), {"s": StateDict(big=big)})
    (blob,) = _blobs(snap, "0/s/big")
    with open(os.path.join(path, blob), "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ChecksumError):
        Snapshot(str(path)).restore({"s": StateDict(big=torch.zeros(1000))})
    out = StateDict(big=torch.zeros(1000))
    Snapshot(str(path)).restore({"s": out}, options=Options(checksums=False))
    assert not torch.equal(out["big"], big)  # the damaged bytes, read unchecked as asked
    assert torch.equal(out["big"][:25], big[:25])
    value = Snapshot(str(path)).read_object("0/s/big", options=Options(checksums=False))
    assert torch.equal(value, out["big"])
    with pytest.raises(ChecksumError):
        Snapshot(str(path)).read_object("0/s/big")


def test_options_must_be_options(tmp_path):
    with pytest.raises(InvalidArgumentError, match="snapshot.Options"):
        Snapshot.take(str(tmp_path / "s"), {"s": StateDict(x=1)}, options={"checksums": False})
