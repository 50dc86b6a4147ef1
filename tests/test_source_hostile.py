"""Hostile DCP metadata and safetensors headers: refused with SnapshotErrors when the path is
opened, at a cost bounded by their bytes, and nothing in them is run."""

from __future__ import annotations

import json
import os
import pickle
import struct
import warnings
from typing import Any

import pytest
import torch

from snapshot import Options, Snapshot
from snapshot.errors import (
    CorruptSnapshotError,
    IncompatibleSnapshotError,
    SnapshotError,
    UnsafeSnapshotError,
)


def _dcp(tmp_path: Any) -> str:
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "dcp")
    state = {"app": {"w": torch.arange(12.0).reshape(3, 4), "lr": 0.5}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path)
    return path


def _metadata(path: str) -> Any:
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)


def _rewrite(path: str, meta: Any) -> None:
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(meta, f)


class _Run:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.mkdir, (self.marker,))


def test_dcp_plain_checkpoint_opens(tmp_path: Any) -> None:
    path = _dcp(tmp_path)
    snap = Snapshot(path)
    assert torch.equal(snap.read_object("0/app/w"), torch.arange(12.0).reshape(3, 4))
    assert snap.read_object("0/app/lr") == 0.5


def test_dcp_disallowed_global_is_refused_and_not_run(tmp_path: Any) -> None:
    path = _dcp(tmp_path)
    marker = str(tmp_path / "ran")
    meta = _metadata(path)
    meta.planner_data = {"app.w": _Run(marker)}
    _rewrite(path, meta)
    with pytest.raises(UnsafeSnapshotError, match=r"posix\.mkdir|os\.mkdir"):
        Snapshot(path)
    assert not os.path.exists(marker)


def test_dcp_truncated_and_huge_metadata_are_refused(tmp_path: Any) -> None:
    path = _dcp(tmp_path)
    meta = os.path.join(path, ".metadata")
    with open(meta, "rb") as f:
        data = f.read()
    with open(meta, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(CorruptSnapshotError, match="not a readable pickle"):
        Snapshot(path)
    with open(meta, "wb") as f:
        f.write(data + b"\0" * 5000)
    with pytest.raises(UnsafeSnapshotError, match="over the limit"):
        Snapshot(path, options=Options(max_manifest_bytes=len(data) + 100))


def test_dcp_chunk_outside_its_file_is_refused(tmp_path: Any) -> None:
    path = _dcp(tmp_path)
    meta = _metadata(path)
    for index, info in meta.storage_data.items():
        if index.fqn == "app.w":
            info.offset += 1 << 20
    _rewrite(path, meta)
    with pytest.raises(CorruptSnapshotError, match="which holds"):
        Snapshot(path)


def test_dcp_chunks_listed_twice_are_refused(tmp_path: Any) -> None:
    """A pickle can list one chunk many times by reference, for many tensors: each storage
    record serves one chunk, so the work stays within the file's bytes."""
    path = _dcp(tmp_path)
    meta = _metadata(path)
    item = meta.state_dict_metadata["app.w"]
    item.chunks = item.chunks * 100_000
    _rewrite(path, meta)
    with pytest.raises(CorruptSnapshotError, match="used twice"):
        Snapshot(path)


@pytest.mark.parametrize(
    "paths, match",
    [
        ({"app.w": ("app", "w"), "app.lr": ("app", "w")}, "named twice"),
        ({"app.w": ("app",), "app.lr": ("app", "lr")}, "inside another value|named twice"),
        ({"app.w": ("app", 0), "app.lr": ("app", "lr")}, "mixed keys"),
        ({"app.w": ("app", object), "app.lr": ("app", "lr")}, "global"),
    ],
)
def test_dcp_key_paths_that_collide_are_refused(tmp_path: Any, paths: Any, match: str) -> None:
    path = _dcp(tmp_path)
    meta = _metadata(path)
    meta.planner_data = paths
    _rewrite(path, meta)
    with pytest.raises(SnapshotError, match=match):
        Snapshot(path)


def test_dcp_chunk_that_is_not_its_archive_is_refused(tmp_path: Any) -> None:
    path = _dcp(tmp_path)
    meta = _metadata(path)
    for index, info in meta.storage_data.items():
        if index.fqn == "app.w":
            info.offset, info.length = info.offset + 7, info.length - 7
    _rewrite(path, meta)
    with pytest.raises(CorruptSnapshotError, match="torch.save archive"):
        Snapshot(path)


def test_dcp_file_outside_the_directory_is_refused(tmp_path: Any) -> None:
    path = _dcp(tmp_path)
    meta = _metadata(path)
    for info in meta.storage_data.values():
        info.relative_path = "../../etc/passwd"
    _rewrite(path, meta)
    with pytest.raises(UnsafeSnapshotError):
        Snapshot(path)


def test_dcp_compressed_chunks_are_refused_naming_the_extension(tmp_path: Any) -> None:
    path = _dcp(tmp_path)
    meta = _metadata(path)
    for info in meta.storage_data.values():
        info.transform_descriptors = ["zstd"]
    _rewrite(path, meta)
    with pytest.raises(IncompatibleSnapshotError, match="zstd"):
        Snapshot(path)


def _safetensors(tmp_path: Any, header: Any, data: bytes = b"", length: int | None = None) -> str:
    folder = tmp_path / "st"
    folder.mkdir(exist_ok=True)
    text = json.dumps(header).encode() if not isinstance(header, bytes) else header
    n = len(text) if length is None else length
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", n) + text + data)
    return str(folder)


def test_safetensors_plain_file_opens(tmp_path: Any) -> None:
    values = torch.arange(6, dtype=torch.float32)
    header = {"x": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}
    folder = _safetensors(tmp_path, header, values.numpy().tobytes())
    assert torch.equal(Snapshot(folder).read_object("0/model/x"), values.reshape(2, 3))


@pytest.mark.parametrize(
    "header, data, length, error, match",
    [
        ({}, b"", 1 << 60, CorruptSnapshotError, "header of"),
        (b"{not json", b"", None, CorruptSnapshotError, "not JSON"),
        (b"[" * 100_000, b"", None, CorruptSnapshotError, "not JSON"),
        (
            {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
            b"\0" * 4,
            None,
            CorruptSnapshotError,
            "outside",
        ),
        (
            {
                "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
            None,
            CorruptSnapshotError,
            "overlaps",
        ),
        (
            {"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
            b"\0" * 8,
            None,
            CorruptSnapshotError,
            "needs 12",
        ),
        (
            {"x": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}},
            b"\0" * 8,
            None,
            IncompatibleSnapshotError,
            "unknown dtype",
        ),
        ({"x": [1, 2]}, b"", None, CorruptSnapshotError, "expected dtype"),
    ],
)
def test_safetensors_hostile_headers_are_refused(
    tmp_path: Any,
    header: Any,
    data: bytes,
    length: int | None,
    error: type[SnapshotError],
    match: str,
) -> None:
    folder = _safetensors(tmp_path, header, data, length)
    with pytest.raises(error, match=match):
        Snapshot(folder)
