"""References that would leave a snapshot, and reads whose cost the bytes present do not bound
(docs/reliability.md, "References and decoding").

An incremental snapshot's ``../<name>/<blob>`` is resolved only to a sibling in the same store
and parent, never through a link; a torchsnapshot manifest holds no references at all; an
object's ``torch.save`` archive must store its members uncompressed, so decoding it cannot
expand past its bytes; and a torchsnapshot manifest's ``world_size`` builds nothing for ranks
it does not list.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import shutil
import time
import uuid
import zipfile
import zlib
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

import manifest as mf
from snapshot import Options, Snapshot, StateDict
from snapshot._engine.take.commit import MANIFEST_NAME
from snapshot._engine.tools.verify import verify
from snapshot.errors import CorruptSnapshotError, UnsafeSnapshotError
from storage_plugins import memory
from tests.s3server import S3Bucket

DATA = Path(__file__).resolve().parent / "data" / "torchsnapshot-0.1.0"
SINGLE = DATA / "single"
METADATA = ".snapshot_metadata"


def _state(value: float) -> dict[str, StateDict]:
    return {"m": StateDict(w=torch.full((256,), value), o={1, 2, 3})}


def _with_blobs(m: mf.Manifest, blob_of: Any, crc: bool = True) -> mf.Manifest:
    """``m`` with every tensor chunk's blob replaced by ``blob_of(blob)`` (without CRC-32s when
    ``crc`` is false), said to be format 5 (the one that may hold references)."""

    def change(e: mf.Entry) -> mf.Entry:
        if not isinstance(e, mf.TensorEntry):
            return e
        chunks = tuple(
            mf.new_location(blob_of(c.blob), c.offset, c.nbytes, c.crc32 if crc else None)
            for c in e.chunks
        )
        return dataclasses.replace(e, chunks=chunks)

    entries = {p: change(e) for p, e in m.entries.items()}
    return dataclasses.replace(m, entries=entries, format_version=mf.INCREMENTAL_VERSION)


def _rewrite_local(path: Path, blob_of: Any, crc: bool = True) -> None:
    file = path / MANIFEST_NAME
    file.write_bytes(mf.dumps(_with_blobs(mf.loads(file.read_bytes()), blob_of, crc)))


# ---------------------------------------------------------------------------------------------
# 1a. A base folder that is a link.


def test_a_base_folder_that_is_a_link_is_refused(tmp_path):
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    own = Options(digests=True, slab_threshold_bytes=16)  # the tensor in a blob of its own
    Snapshot.take(str(run / "s1"), _state(1.0), options=own)
    Snapshot.take(str(run / "s2"), _state(1.0), base=str(run / "s1"), options=own)
    assert Snapshot(str(run / "s2")).metadata.bases == ("s1",)
    # Another snapshot of the same layout whose tensor holds other bytes, and the base's folder
    # replaced by a link to it (what a tarball can carry); the forger drops the CRC-32s.
    shutil.copytree(run / "s1", elsewhere / "s1")
    blob = next(p for p in (elsewhere / "s1" / "0").iterdir() if p.stat().st_size == 1024)
    blob.write_bytes(torch.full((256,), 7.0).numpy().tobytes())
    shutil.rmtree(run / "s1")
    (run / "s1").symlink_to(elsewhere / "s1", target_is_directory=True)
    _rewrite_local(run / "s2", lambda b: b, crc=False)
    snap = Snapshot(str(run / "s2"))
    with pytest.raises(UnsafeSnapshotError, match="s1.*link"):
        snap.read_object("0/m/w")
    out = {"m": StateDict(w=torch.zeros(256), o=None)}
    with pytest.raises(UnsafeSnapshotError, match="link"):
        snap.restore(out)
    assert not out["m"]["w"].eq(7.0).any()
    with pytest.raises(UnsafeSnapshotError, match="link"):
        verify(str(run / "s2"), None)


def test_a_base_that_is_a_file_is_refused(tmp_path):
    Snapshot.take(str(tmp_path / "s1"), _state(1.0), options=Options(digests=True))
    Snapshot.take(str(tmp_path / "s2"), _state(1.0), base=str(tmp_path / "s1"))
    shutil.rmtree(tmp_path / "s1")
    (tmp_path / "s1").write_bytes(b"x" * 1024)
    with pytest.raises(UnsafeSnapshotError, match="not a directory"):
        Snapshot(str(tmp_path / "s2")).read_object("0/m/w")


def test_a_sibling_base_that_is_a_real_folder_still_reads(tmp_path):
    Snapshot.take(str(tmp_path / "s1"), _state(1.0), options=Options(digests=True))
    Snapshot.take(str(tmp_path / "s2"), _state(1.0), base=str(tmp_path / "s1"))
    # The snapshot's own path may be a link the user chose: its siblings are those of the link.
    (tmp_path / "alias").symlink_to(tmp_path, target_is_directory=True)
    for root in (tmp_path, tmp_path / "alias"):
        assert torch.equal(Snapshot(str(root / "s2")).read_object("0/m/w"), torch.ones(256))


# ---------------------------------------------------------------------------------------------
# 1b. A snapshot at the root of its store names a sibling.


def test_a_memory_snapshot_without_a_parent_refuses_a_reference():
    name = f"r{uuid.uuid4().hex}"
    url = f"memory://{name}"
    Snapshot.take(url, _state(1.0))
    key = f"{name}/{MANIFEST_NAME}"
    m = mf.loads(memory._STORE[key])
    memory._STORE[key] = mf.dumps(_with_blobs(m, lambda b: f"../etc/{b}"))
    try:
        with pytest.raises(UnsafeSnapshotError, match="root of its store"):
            Snapshot(url).read_object("0/m/w")
        with pytest.raises(UnsafeSnapshotError, match="root of its store"):
            Snapshot(url).restore({"m": StateDict(w=torch.zeros(256), o=None)})
    finally:
        memory.clear(url)


def test_a_memory_snapshot_reads_its_sibling_in_the_same_parent():
    parent = f"memory://r{uuid.uuid4().hex}"
    try:
        Snapshot.take(f"{parent}/s1", _state(2.0), options=Options(digests=True))
        Snapshot.take(f"{parent}/s2", _state(2.0), base=f"{parent}/s1")
        got = Snapshot(f"{parent}/s2").read_object("0/m/w")
        assert torch.equal(got, torch.full((256,), 2.0))
    finally:
        memory.clear(parent)


def test_a_snapshot_at_a_bucket_root_refuses_a_reference(s3_bucket: S3Bucket):
    opts = s3_bucket.storage_options
    url = f"s3://{s3_bucket.name}"
    Snapshot.take(url, _state(1.0), storage_options=opts)
    fs = fsspec.filesystem("s3", **opts)
    key = f"{s3_bucket.name}/{MANIFEST_NAME}"
    m = mf.loads(fs.cat_file(key))
    fs.pipe_file(key, mf.dumps(_with_blobs(m, lambda b: f"../tmp/{b}")))
    with pytest.raises(UnsafeSnapshotError, match="root of its store"):
        Snapshot(url, storage_options=opts).read_object("0/m/w")


def test_a_prefix_at_a_bucket_root_reads_its_sibling_in_the_same_bucket(s3_bucket: S3Bucket):
    opts = s3_bucket.storage_options
    s1, s2 = s3_bucket.url("s1"), s3_bucket.url("s2")
    Snapshot.take(s1, _state(3.0), storage_options=opts, options=Options(digests=True))
    Snapshot.take(s2, _state(3.0), storage_options=opts, base=s1)
    got = Snapshot(s2, storage_options=opts).read_object("0/m/w")
    assert torch.equal(got, torch.full((256,), 3.0))


# ---------------------------------------------------------------------------------------------
# 1c. A torchsnapshot manifest naming a sibling.


def _torchsnapshot_copy(tmp_path: Path, name: str = "single") -> Path:
    dst = tmp_path / name
    shutil.copytree(SINGLE, dst)
    return dst


def _edit_metadata(path: Path, edit: Any) -> None:
    doc = json.loads((path / METADATA).read_text())
    edit(doc)
    (path / METADATA).write_text(json.dumps(doc))


@pytest.mark.parametrize("entry", ["0/extra/tags", "0/extra/z", "0/model/0.weight"])
def test_a_torchsnapshot_location_naming_a_sibling_is_unsafe(tmp_path, entry):
    path = _torchsnapshot_copy(tmp_path)
    sibling = _torchsnapshot_copy(tmp_path, "sibling")
    location = json.loads((path / METADATA).read_text())["manifest"][entry]["location"]

    def edit(doc: dict[str, Any]) -> None:
        doc["manifest"][entry]["location"] = f"../sibling/{location}"

    _edit_metadata(path, edit)
    assert (sibling / location).exists()
    with pytest.raises(UnsafeSnapshotError, match=f"{entry}.*holds no references"):
        Snapshot(str(path))


# ---------------------------------------------------------------------------------------------
# 2a. An object whose archive inflates.


def _deflated(data: bytes) -> bytes:
    """The ``torch.save`` archive ``data`` rewritten with every member deflate-compressed."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info), compress_type=zipfile.ZIP_DEFLATED)
    return out.getvalue()


def _big_zeros_archive() -> bytes:
    buf = io.BytesIO()
    torch.save(torch.zeros(8 << 20, dtype=torch.uint8), buf)  # 8 MiB of zeros
    return _deflated(buf.getvalue())


def test_deflated_archives_load_in_torch():
    """The premise: torch.load inflates a compressed member (so the check must come first)."""
    data = _big_zeros_archive()
    assert len(data) < 100_000
    assert torch.load(io.BytesIO(data), weights_only=True).numel() == 8 << 20


def test_an_object_whose_archive_is_compressed_is_refused(tmp_path):
    path = tmp_path / "s"
    Snapshot.take(str(path), _state(1.0), options=Options(slab_threshold_bytes=16))
    data = _big_zeros_archive()
    file = path / MANIFEST_NAME
    m = mf.loads(file.read_bytes())
    entry = m.entries["0/m/o"]
    assert isinstance(entry, mf.ObjectEntry)
    (path / entry.location.blob).write_bytes(data)
    loc = mf.new_location(entry.location.blob, 0, len(data), zlib.crc32(data))
    m.entries["0/m/o"] = dataclasses.replace(entry, location=loc)
    file.write_bytes(mf.dumps(m))
    snap = Snapshot(str(path))
    with pytest.raises(UnsafeSnapshotError, match=r"0/m/o.*compressed"):
        snap.read_object("0/m/o")
    with pytest.raises(UnsafeSnapshotError, match="compressed"):
        snap.restore({"m": StateDict(w=torch.zeros(256), o=None)})
    # Its CRC-32 matches (a forger recomputes it): verify reads the archive's directory.
    report = verify(str(path), None)
    assert [(p.paths, p.blob) for p in report.problems] == [(("0/m/o",), entry.location.blob)]
    assert "compressed" in report.problems[0].what


def test_an_archive_claiming_more_than_its_bytes_is_refused():
    from snapshot._engine.handlers.objects import check_archive

    buf = io.BytesIO()
    torch.save({"a": torch.arange(10)}, buf)
    data = bytearray(buf.getvalue())
    check_archive(bytes(data), "0/x")  # torch.save's own archive passes
    # Raise the last member's declared uncompressed size in the central directory (the
    # field at byte 24 of its header), the method staying "stored".
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as z:
        info = z.infolist()[-1]
    cd = bytes(data).rindex(b"PK\x01\x02")
    data[cd + 24 : cd + 28] = (info.file_size + 10**9).to_bytes(4, "little")
    with pytest.raises(CorruptSnapshotError, match="0/x"):
        check_archive(bytes(data), "0/x")


@pytest.mark.parametrize("entry", ["0/extra/tags", "0/extra/z"])
def test_a_torchsnapshot_pickle_that_is_compressed_is_refused(tmp_path, entry):
    path = _torchsnapshot_copy(tmp_path)
    location = json.loads((path / METADATA).read_text())["manifest"][entry]["location"]
    blob = path / location
    blob.write_bytes(_deflated(blob.read_bytes()))
    snap = Snapshot(str(path))
    with pytest.raises(UnsafeSnapshotError, match="compressed"):
        snap.read_object(entry)
    report = verify(str(path), None)
    assert any("compressed" in p.what for p in report.problems)


def test_a_pickled_torchsnapshot_tensor_cannot_claim_more_than_its_bytes(tmp_path):
    """A pickled tensor in two pieces of tiny files, claiming 2**34 float32 elements: refused
    before the whole tensor is allocated."""
    path = _torchsnapshot_copy(tmp_path)
    z = json.loads((path / METADATA).read_text())["manifest"]["0/extra/z"]
    half = 1 << 33

    shutil.copy(path / z["location"], path / "0" / "extra" / "z2")

    def chunk(offset: int) -> dict[str, Any]:
        location = z["location"] if offset == 0 else "0/extra/z2"
        tensor = dict(z, dtype="torch.float32", shape=[half], location=location)
        return {"offsets": [offset], "sizes": [half], "tensor": tensor}

    def edit(doc: dict[str, Any]) -> None:
        doc["manifest"]["0/extra/z"] = {
            "type": "ChunkedTensor",
            "dtype": "torch.float32",
            "shape": [2 * half],
            "chunks": [chunk(0), chunk(half)],
            "replicated": False,
        }

    _edit_metadata(path, edit)
    with pytest.raises(CorruptSnapshotError, match="0/extra/z: the piece at .* claims"):
        Snapshot(str(path)).read_object("0/extra/z")


# ---------------------------------------------------------------------------------------------
# 2b. A torchsnapshot world_size the entries do not justify.


def test_a_huge_world_size_builds_entries_for_listed_ranks_only(tmp_path):
    path = tmp_path / "tiny"
    path.mkdir()
    doc = {
        "version": "0.1.0",
        "world_size": 3_000_000,
        "manifest": {
            "0/s": {"type": "dict", "keys": ["x"]},
            "0/s/x": {"type": "int", "serialized_value": "5", "replicated": True},
        },
    }
    (path / METADATA).write_text(json.dumps(doc))
    assert len((path / METADATA).read_bytes()) < 200
    t = time.perf_counter()
    snap = Snapshot(str(path))
    entries = snap.get_manifest()
    assert len(entries) == 2
    assert time.perf_counter() - t < 5  # (the eager copies took tens of seconds)
    assert snap.read_object("0/s/x") == 5


def test_replicated_entries_are_copied_under_each_listed_rank(tmp_path):
    path = tmp_path / "three"
    path.mkdir()
    doc = {
        "version": "0.1.0",
        "world_size": 3,
        "manifest": {
            **{f"{r}/s": {"type": "dict", "keys": ["x"]} for r in (0, 2)},
            "0/s/x": {"type": "int", "serialized_value": "5", "replicated": True},
        },
    }
    (path / METADATA).write_text(json.dumps(doc))
    entries = Snapshot(str(path)).get_manifest()
    assert sorted(entries) == ["0/s", "0/s/x", "2/s", "2/s/x"]


# ---------------------------------------------------------------------------------------------
# Every store keeps a blob path below its root (a reference is never handed to a plugin).


@pytest.mark.parametrize("blob", ["../x/0/0", "0/../../x", "./0", "0/./x"])
def test_object_store_plugins_refuse_dot_parts(s3_bucket: S3Bucket, blob):
    from storage_plugins import UnsafeBlobError
    from storage_plugins.fsspec_plugin import FSSpecStoragePlugin
    from storage_plugins.memory import MemoryStoragePlugin
    from storage_plugins.s3 import S3StoragePlugin

    async def attempt() -> list[str]:
        refused = []
        plugins = [
            MemoryStoragePlugin(f"memory://r{uuid.uuid4().hex}/s"),
            FSSpecStoragePlugin(f"memory://r{uuid.uuid4().hex}/s"),
            S3StoragePlugin(s3_bucket.url("run/s"), s3_bucket.storage_options),
        ]
        for plugin in plugins:
            try:
                for call in (plugin.read(blob), plugin.exists(blob), plugin.size(blob)):
                    with pytest.raises(UnsafeBlobError, match="not a path below the root"):
                        await call
                with pytest.raises(UnsafeBlobError):
                    await plugin.write(blob, [b"x"])
                refused.append(type(plugin).__name__)
            finally:
                await plugin.close()
        return refused

    assert len(asyncio.run(attempt())) == 3
