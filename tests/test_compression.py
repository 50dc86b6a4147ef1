"""Compressed snapshots (Options.zstd_level): every dtype back bitwise through restore,
read_object, export and diff; each range checked before and after decompression; damage found
by restore and verify; the option's checks; the missing package named; async_take, the
manager, incremental takes, signing and sharded tensors across ranks; older readers refuse."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import manifest as mf
from manifest.codec import loads
from snapshot import (
    CheckpointManager,
    ChecksumError,
    CorruptSnapshotError,
    InvalidArgumentError,
    Options,
    Snapshot,
    SnapshotError,
    SnapshotNotFoundError,
    StateDict,
)
from snapshot._engine.tools.verify import diff, verify
from snapshot.cli import main
from snapshot.export import export
from tests.helpers import seal_manifest
from tests.multirank import run_ranks

pytest.importorskip("zstandard")

ZSTD = Options(zstd_level=3)
ROOT = Path(__file__).resolve().parents[1]


def _dtypes() -> list[torch.dtype]:
    dtypes = [
        torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.float16, torch.bfloat16, torch.float32, torch.float64,
        torch.complex64, torch.complex128,
    ]  # fmt: skip
    for name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
                 "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"):  # fmt: skip
        if hasattr(torch, name):
            dtypes.append(getattr(torch, name))
    return dtypes


def _random(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """``n`` elements of ``dtype`` from random bytes (NaNs with payloads, subnormals...), half
    of them zeros so that there is something to compress."""
    g = torch.Generator().manual_seed(seed)
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    raw[: n * size // 2] = 0
    if dtype is torch.bool:
        raw = raw % 2
    return raw.view(dtype)


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and _bytes(a) == _bytes(b)


def _state() -> dict[str, torch.Tensor | object]:
    tensors: dict[str, torch.Tensor | object] = {
        str(d).removeprefix("torch."): _random(d, 3000, i) for i, d in enumerate(_dtypes())
    }
    big = _random(torch.float32, 300_000, 99).reshape(600, 500)
    tensors.update(
        big=big,  # over the chunk size below: several compressed chunks
        transposed=big.t(),  # a non-contiguous view
        column=big[:, 3],
        empty=torch.empty(0, 7, dtype=torch.bfloat16),
        scalar=torch.tensor(2.5, dtype=torch.float64),
        text="long text " * 400,
        blob=bytes(range(256)) * 20,
        obj={"lr": 0.1, "betas": (0.9, 0.999), "note": b"\x00" * 3000},
    )
    return tensors


def _check(restored: dict, expected: dict) -> None:
    assert restored.keys() == expected.keys()
    for k, v in expected.items():
        if isinstance(v, torch.Tensor):
            assert _same(restored[k], v), k
        else:
            assert restored[k] == v, k


def _take(path: Path, state: dict, options: Options = ZSTD) -> Snapshot:
    return Snapshot.take(str(path), {"m": StateDict(state)}, options=options)


@pytest.fixture(scope="module")
def taken(tmp_path_factory):
    path = tmp_path_factory.mktemp("zstd") / "snap"
    state = _state()
    _take(path, state, ZSTD.replace(chunk_bytes=256 << 10))
    return path, state


def test_every_dtype_and_layout_round_trips_bitwise(taken):
    path, state = taken
    snap = Snapshot(str(path))
    assert snap.get_manifest()["0/m/big"].chunks[0].stored is not None
    target = {"m": StateDict({k: v.clone() if isinstance(v, torch.Tensor) else v
                              for k, v in state.items()})}  # fmt: skip
    for v in target["m"].values():
        if isinstance(v, torch.Tensor) and v.numel():
            v.reshape(-1).view(torch.uint8).fill_(7) if v.is_contiguous() else v.zero_()
    snap.restore(target)
    _check(dict(target["m"]), state)
    fresh: dict = {"m": StateDict()}
    snap.restore(fresh)
    _check(dict(fresh["m"]), state)
    for key in ("float32", "bfloat16", "big", "transposed", "obj", "text"):
        got = snap.read_object(f"0/m/{key}")
        _check({key: got}, {key: state[key]})


def test_the_manifest_records_each_range_raw_and_stored(taken):
    path, state = taken
    data = (path / "manifest.yaml").read_bytes()
    manifest = loads(data)
    assert manifest.format_version == mf.COMPRESSED_VERSION == mf.FORMAT_VERSION
    big = manifest.entries["0/m/big"]
    assert len(big.chunks) > 1
    for loc in big.chunks:
        frame = loc.stored
        assert frame is not None and frame.codec == "zstd"
        assert loc.crc32 is not None and frame.crc32 is not None
    assert sum(loc.nbytes for loc in big.chunks) == state["big"].nbytes  # raw bytes
    stored = sum(loc.stored.nbytes for loc in big.chunks)
    assert stored < 0.8 * state["big"].nbytes  # half of its bytes are zeros
    assert sum(f.stat().st_size for f in (path / "0").iterdir()) < sum(
        v.nbytes for v in state.values() if isinstance(v, torch.Tensor)
    )
    # A reader of format 5 or older refuses it, as newer, and would not read a compressed
    # range as a plain one.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("manifest.codec.FORMAT_VERSION", mf.INCREMENTAL_VERSION)
        with pytest.raises(mf.UnsupportedFormatError, match="newer"):
            loads(data)
    with pytest.raises(mf.ManifestDecodeError, match="expected"):
        mf.codec.EntryDecoder(mf.INCREMENTAL_VERSION).location(
            ["0/x", 0, 10, 1, ["zstd", 0, 9, 1]], "0/m/x"
        )


@pytest.mark.parametrize(
    "stored, match",
    [
        (["zstd", 0, 1, None], "claims"),  # more than zstd can make of one byte
        (["gzip", 0, 10, None], "compressed range"),
        (["zstd", -1, 10, None], "compressed range"),
        (["zstd", 0, 10, 1 << 32], "compressed range"),
        ("zstd", "compressed range"),
    ],
)
def test_a_damaged_compressed_range_record_is_refused(stored, match):
    decode = mf.codec.EntryDecoder(mf.COMPRESSED_VERSION)
    with pytest.raises(mf.ManifestDecodeError, match=match):
        decode.location(["0/x", 0, 1 << 20, None, stored], "0/m/x")


def test_a_flipped_byte_in_a_compressed_blob_is_found(tmp_path):
    path = tmp_path / "snap"
    state = {"w": _random(torch.float32, 50_000, 1), "s": _random(torch.int8, 100, 2)}
    _take(path, state)
    manifest = Snapshot(str(path)).get_manifest()
    loc = manifest["0/m/w"].chunks[0]
    blob = path / loc.blob
    data = bytearray(blob.read_bytes())
    data[loc.stored.offset + loc.stored.nbytes // 2] ^= 0x10
    blob.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="compressed bytes"):
        Snapshot(str(path)).restore({"m": StateDict(w=torch.zeros(50_000), s=state["s"])})
    with pytest.raises(ChecksumError):
        Snapshot(str(path)).read_object("0/m/w")
    report = verify(str(path), None)
    assert [p.paths for p in report.problems] == [("0/m/w",)]
    assert "checksum mismatch" in report.problems[0].what
    # Without checksums, the damage is still found: the frame no longer decompresses to the
    # bytes recorded (or at all).
    bare = tmp_path / "bare"
    _take(bare, state, ZSTD.replace(checksums=False))
    loc = Snapshot(str(bare)).get_manifest()["0/m/w"].chunks[0]
    assert loc.crc32 is None and loc.stored.crc32 is None
    blob = bare / loc.blob
    data = bytearray(blob.read_bytes())
    data[loc.stored.offset + 2] ^= 0xFF  # the frame's header
    blob.write_bytes(bytes(data))
    with pytest.raises(CorruptSnapshotError, match="damaged"):
        Snapshot(str(bare)).read_object("0/m/w")
    assert not verify(str(bare), None).ok


def test_decompressed_bytes_are_checked_too(tmp_path):
    # A manifest whose stored CRC-32 matches the frame but whose raw CRC-32 does not (what a
    # frame holding other bytes than those taken would show): restore, read_object and verify
    # each find it once decompressed.
    path = tmp_path / "snap"
    w = _random(torch.float32, 50_000, 3)
    _take(path, {"w": w})
    loc = Snapshot(str(path)).get_manifest()["0/m/w"].chunks[0]
    data = (path / "manifest.yaml").read_bytes()
    body = data[: data.rindex(b"# crc32")]
    old = b'%d, ["zstd"' % loc.crc32
    assert body.count(old) == 1
    (path / "manifest.yaml").write_bytes(
        seal_manifest(body.replace(old, b'%d, ["zstd"' % (loc.crc32 ^ 1)))
    )
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        Snapshot(str(path)).restore({"m": StateDict(w=torch.zeros(50_000))})
    with pytest.raises(ChecksumError):
        Snapshot(str(path)).read_object("0/m/w")
    (problem,) = verify(str(path), None).problems
    assert problem.paths == ("0/m/w",) and "once decompressed" in problem.what


def test_ranges_read_in_pieces_and_tiles(tmp_path):
    # One compressed chunk read in many requests (a small read_request_bytes), cast on landing,
    # and through a small budget: each piece decompressed from where the last one stopped.
    path = tmp_path / "snap"
    w = _random(torch.float32, 400_000, 5)
    _take(path, {"w": w}, ZSTD.replace(chunk_bytes=4 << 20))
    snap = Snapshot(str(path))
    small = Options(read_request_bytes=64 << 10)
    target = torch.zeros(400_000)
    snap.restore({"m": StateDict(w=target)}, options=small)
    assert _same(target, w)
    as64 = torch.zeros(400_000, dtype=torch.float64)
    snap.restore({"m": StateDict(w=as64)}, options=small)
    assert _same(as64, w.double())
    got = snap.read_object("0/m/w", memory_budget_bytes=128 << 10)
    assert _same(got, w)


def test_progress_counts_the_raw_bytes(tmp_path):
    records: list = []
    state = {"w": _random(torch.float32, 100_000, 6), "s": torch.ones(10)}
    snap = Snapshot.take(
        str(tmp_path / "s"), {"m": StateDict(state)}, options=ZSTD, progress=records.append
    )
    snap.restore(
        {"m": StateDict(w=torch.zeros(100_000), s=torch.zeros(10))}, progress=records.append
    )
    for op in ("take", "restore"):
        last = [r for r in records if r.operation == op][-1]
        assert last.done_bytes == last.total_bytes >= state["w"].nbytes


def test_levels_and_invalid_values(tmp_path, monkeypatch):
    w = torch.zeros(100_000)
    sizes = {}
    for level in (1, 19):
        path = tmp_path / f"l{level}"
        _take(path, {"w": w}, Options(zstd_level=level))
        assert torch.equal(Snapshot(str(path)).read_object("0/m/w"), w)
        sizes[level] = Snapshot(str(path)).get_manifest()["0/m/w"].chunks[0].stored.nbytes
    assert sizes[19] <= sizes[1] < 1000
    for bad in (-1, 23, "3", True, 2.5):
        with pytest.raises(InvalidArgumentError, match="zstd_level"):
            Options(zstd_level=bad)
    monkeypatch.setenv("STATESNAP_ZSTD_LEVEL", "30")
    with pytest.raises(InvalidArgumentError, match="STATESNAP_ZSTD_LEVEL must be >= 0 and <= 22"):
        Options().resolved()
    monkeypatch.setenv("STATESNAP_ZSTD_LEVEL", "2")
    path = tmp_path / "env"
    _take(path, {"w": w}, Options())
    assert Snapshot(str(path)).get_manifest()["0/m/w"].chunks[0].stored is not None
    monkeypatch.delenv("STATESNAP_ZSTD_LEVEL")
    plain = tmp_path / "plain"  # the default: nothing compressed, the version as before
    _take(plain, {"w": w}, Options())
    assert loads((plain / "manifest.yaml").read_bytes()).format_version == 1


_NO_ZSTD = """
import sys
sys.modules["zstandard"] = None  # ``import zstandard`` now raises ImportError
import torch
from snapshot import Options, Snapshot, StateDict, SnapshotError
path, compressed = sys.argv[1], sys.argv[2]
state = {"m": StateDict(w=torch.arange(10.0))}
Snapshot.take(path + "/plain", state)
Snapshot(path + "/plain").restore(state)
Snapshot(path + "/plain").read_object("0/m/w")
assert "zstandard" not in sys.modules or sys.modules["zstandard"] is None
for call in (
    lambda: Snapshot.take(path + "/z", state, options=Options(zstd_level=3)),
    lambda: Snapshot(compressed).restore(state),
    lambda: Snapshot(compressed).read_object("0/m/w"),
):
    try:
        call()
    except SnapshotError as e:
        print(type(e).__name__, e)
    else:
        raise SystemExit("no error")
import os
assert not os.path.exists(path + "/z/manifest.yaml")
"""


def test_without_the_package_a_clear_error_names_the_extra(tmp_path):
    compressed = tmp_path / "compressed"
    _take(compressed, {"w": torch.arange(10.0)})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_NO_ZSTD), str(tmp_path), str(compressed)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3
    for line in lines:
        assert line.startswith("IncompatibleSnapshotError")
        assert "pip install zstandard (the zstd extra" in line


def test_plain_calls_do_not_import_the_codec(tmp_path):
    code = (
        "import sys, torch\nfrom snapshot import Snapshot, StateDict\n"
        f"p = {str(tmp_path / 's')!r}\n"
        "s = {'m': StateDict(w=torch.ones(3))}\nSnapshot.take(p, s)\nSnapshot(p).restore(s)\n"
        "print(sorted(m for m in sys.modules if 'zstandard' in m or 'compression' in m"
        " or m == 'manifest.frames'))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert [m for m in eval(out.stdout) if "statesnap" in m or m.startswith(("snapshot",
            "manifest", "zstandard"))] == []  # fmt: skip


def test_async_take_and_the_manager(tmp_path):
    state = {"w": _random(torch.bfloat16, 200_000, 3), "step": 7, "b": _random(torch.int64, 9, 4)}
    for background in (False, True):  # staged on the caller's thread, or in the background
        path = str(tmp_path / f"a{int(background)}")
        pending = Snapshot.async_take(
            path, {"m": StateDict(state)}, options=ZSTD, stage_in_background=background
        )
        snap = pending.wait()
        assert snap.get_manifest()["0/m/w"].chunks[0].stored is not None
        out: dict = {"m": StateDict()}
        snap.restore(out)
        _check(dict(out["m"]), state)
    for async_ in (False, True):
        root = tmp_path / f"runs{int(async_)}"
        with CheckpointManager(str(root), options=ZSTD, async_=async_, keep_last=2) as manager:
            for step in (1, 2):
                manager.save(step, {"m": StateDict(state)})
            manager.wait()
            out = {"m": StateDict()}
            assert manager.restore(out) == 2
        _check(dict(out["m"]), state)
        steps = [p for p in root.iterdir() if (p / "manifest.yaml").exists()]
        assert steps and all(
            loads((p / "manifest.yaml").read_bytes()).format_version == 6 for p in steps
        )


def test_incremental_takes_keep_the_base_s_compressed_ranges(tmp_path):
    a, b = _random(torch.float32, 100_000, 7), _random(torch.float32, 100_000, 8)
    base = tmp_path / "step1"
    _take(base, {"a": a, "b": b}, ZSTD.replace(digests=True))
    b2 = b + 1
    for name, options in (("step2", ZSTD), ("step3", Options())):
        later = tmp_path / name
        Snapshot.take(str(later), {"m": StateDict(a=a, b=b2)}, options=options, base=str(base))
        manifest = Snapshot(str(later)).get_manifest()
        ref = manifest["0/m/a"].chunks[0]
        assert ref.blob.startswith("../step1/") and ref.stored is not None  # reused as stored
        assert (manifest["0/m/b"].chunks[0].stored is not None) == (name == "step2")
        assert loads((later / "manifest.yaml").read_bytes()).format_version == 6
        out: dict = {"m": StateDict()}
        Snapshot(str(later)).restore(out)
        assert _same(out["m"]["a"], a) and _same(out["m"]["b"], b2)
        assert verify(str(later), None).ok


def test_export_diff_verify_du_and_signing(tmp_path, taken, capsys):
    path, state = taken
    assert verify(str(path), None).ok
    assert main(["du", str(path), "--json"]) == 0
    total = json.loads(capsys.readouterr().out)["total"]
    blobs = sum(f.stat().st_size for f in (path / "0").iterdir())
    assert total["stored_bytes"] == blobs < total["nbytes"]  # the bytes stored, compressed
    plain = tmp_path / "plain"
    _take(plain, state, Options(chunk_bytes=1 << 20))
    assert diff(str(path), str(plain), None).identical  # compared by the raw bytes' CRC-32s
    bare = tmp_path / "bare"  # no CRC-32s: diff reads both, one of them decompressed
    _take(bare, state, ZSTD.replace(checksums=False))
    report = diff(str(bare), str(plain), None)
    assert report.identical and report.compared_by_reading
    out = tmp_path / "out"
    files = export(
        str(path), str(out), format="torch", options=Options(memory_budget_bytes=1 << 20)
    )
    loaded = {}
    for file in files:
        loaded.update(torch.load(file, weights_only=True))
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert _same(loaded[f"m.{key}"], value.contiguous()), key
    from snapshot.signing import SigningKey, sign
    from snapshot.signing import verify as verify_signature

    key = SigningKey.hmac(b"k" * 32)
    statement = sign(str(path), key)
    assert verify_signature(str(path), b"k" * 32) == statement


def _sharded_take(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(64 * 12, dtype=torch.float32).reshape(64, 12) % 7
    w = distribute_tensor(full, mesh, [Shard(0)])
    state = StateDict(w=w, r=torch.ones(5), r2=torch.full((9,), 2.0), step=3)
    Snapshot.take(path, {"m": state}, options=ZSTD)
    # Ranks that ask for different levels are refused alike, before anything is written.
    with pytest.raises(SnapshotError, match="compression .*STATESNAP_ZSTD_LEVEL"):
        Snapshot.take(path + "-mixed", {"m": state}, options=Options(zstd_level=rank + 1))


def _sharded_restore(rank: int, world: int, path: str) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(64 * 12, dtype=torch.float32).reshape(64, 12) % 7
    w = distribute_tensor(torch.zeros(64, 12), mesh, [Shard(1)])  # another placement
    r, r2 = torch.zeros(5), torch.zeros(9)
    Snapshot(path).restore({"m": StateDict(w=w, r=r, r2=r2, step=0)})
    return (
        torch.equal(w.full_tensor(), full)
        and torch.equal(r, torch.ones(5))
        and torch.equal(r2, torch.full((9,), 2.0))
    )


@pytest.mark.slow
def test_sharded_tensors_across_ranks(tmp_path):
    path = str(tmp_path / "snap")
    run_ranks(2, _sharded_take, path)
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(path + "-mixed")
    manifest = Snapshot(path).get_manifest()
    shards = manifest["0/m/w"].shards
    assert len(shards) == 2 and all(c.stored is not None for s in shards for c in s.chunks)
    # Each replicated tensor is written by one rank for both: the other learns where it lies.
    replicated = [manifest["0/m/r"], manifest["0/m/r2"]]
    assert {e.chunks[0].blob.split("/")[0] for e in replicated} == {"0", "1"}
    for e in replicated:
        assert e.replicated and e.chunks[0].stored is not None and e.chunks[0].crc32 is not None
    assert run_ranks(2, _sharded_restore, path) == [True, True]
    full = torch.arange(64 * 12, dtype=torch.float32).reshape(64, 12) % 7
    assert torch.equal(Snapshot(path).read_object("0/m/w"), full)
    assert verify(path, None).ok
