"""Damaged snapshots raise the library's errors and nothing else (hypothesis).

A real snapshot (tensors of several dtypes, chunks, slabs, containers, primitives, an object) has
its manifest damaged at random: bytes flipped, cut short, a run deleted or repeated, a number
changed, lines swapped. Opening it, reading every entry and restoring it must then either work or
raise a ``SnapshotError`` subclass: never another exception, a crash or a hang. Blobs cut short
or removed must raise ``CorruptSnapshotError``.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snapshot import CorruptSnapshotError, Snapshot, SnapshotError, StateDict

MANIFEST = "manifest.yaml"


def _state() -> dict[str, StateDict]:
    return {
        "model": StateDict(
            w=torch.arange(12.0).reshape(3, 4),
            b=torch.ones(5, dtype=torch.bfloat16),
            big=torch.arange(100_000, dtype=torch.int32),  # chunked below
        ),
        "extra": StateDict(
            step=7, name="run", ratio=0.5, flags=[True, None], nested={"k": (1, 2)}, obj={1, 2}
        ),
    }


def _targets() -> dict[str, StateDict]:
    return {
        "model": StateDict(
            w=torch.zeros(3, 4),
            b=torch.zeros(5, dtype=torch.bfloat16),
            big=torch.zeros(100_000, dtype=torch.int32),
        ),
        "extra": StateDict(),
    }


@pytest.fixture(scope="module")
def snapshot_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "snap"
    mp = pytest.MonkeyPatch()
    mp.setenv("STATESNAP_CHUNK_BYTES", "65536")  # the big tensor in several chunks...
    mp.setenv("STATESNAP_SLAB_THRESHOLD_BYTES", "1024")  # ...of their own; the rest in a slab
    try:
        Snapshot.take(str(path), _state())
    finally:
        mp.undo()
    with open(path / MANIFEST, "rb") as f:
        original = f.read()
    assert len(_blobs(str(path))) >= 8  # 7 chunks, a slab, an object
    yield str(path), original


def _exercise(path: str) -> None:
    """Everything a user does with a snapshot; SnapshotError is an acceptable outcome."""
    try:
        snap = Snapshot(path)
        for logical in list(snap.get_manifest()):
            snap.read_object(logical)
        snap.restore(_targets())
    except SnapshotError:
        pass


@st.composite
def damaged(draw, original: bytes) -> bytes:
    data = bytearray(original)
    kind = draw(st.sampled_from(["flip", "cut", "delete", "repeat", "number", "swap"]))
    if kind == "flip":
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
    elif kind == "cut":
        del data[draw(st.integers(0, len(data) - 1)) :]
    elif kind in ("delete", "repeat"):
        i = draw(st.integers(0, len(data) - 1))
        j = draw(st.integers(i, min(len(data), i + 64)))
        data[i:j] = b"" if kind == "delete" else data[i:j] * 2
    elif kind == "number":
        numbers = list(re.finditer(rb"-?\d+", bytes(data)))
        m = draw(st.sampled_from(numbers))
        new = draw(
            st.sampled_from([b"0", b"-1", b"1", b"3", b"65536", b"4294967296", b"99999999999999"])
        )
        data[m.start() : m.end()] = new
    else:
        lines = bytes(data).split(b"\n")
        i = draw(st.integers(0, len(lines) - 1))
        j = draw(st.integers(0, len(lines) - 1))
        lines[i], lines[j] = lines[j], lines[i]
        data = bytearray(b"\n".join(lines))
    return bytes(data)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_a_damaged_manifest_raises_only_snapshot_errors(snapshot_dir, data):
    path, original = snapshot_dir
    bad = data.draw(damaged(original))
    with open(os.path.join(path, MANIFEST), "wb") as f:
        f.write(bad)
    try:
        _exercise(path)
    finally:
        with open(os.path.join(path, MANIFEST), "wb") as f:
            f.write(original)


def test_the_undamaged_snapshot_restores(snapshot_dir):
    path, _ = snapshot_dir
    out = _targets()
    Snapshot(path).restore(out)
    assert torch.equal(out["model"]["big"], torch.arange(100_000, dtype=torch.int32))
    assert out["extra"]["obj"] == {1, 2} and out["extra"]["nested"] == {"k": (1, 2)}


def _blobs(path: str) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), path)
        for d, _, fs in os.walk(path)
        for f in fs
        if f != MANIFEST
    )


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_a_blob_cut_short_or_missing_is_corrupt(snapshot_dir, data):
    path, _ = snapshot_dir
    blob = data.draw(st.sampled_from(_blobs(path)))
    full = os.path.join(path, blob)
    with open(full, "rb") as f:
        content = f.read()
    cut = data.draw(st.one_of(st.none(), st.integers(0, max(0, len(content) - 1))))
    try:
        if cut is None:
            os.remove(full)
        else:
            with open(full, "wb") as f:
                f.write(content[:cut])
        with pytest.raises(CorruptSnapshotError, match="missing|shorter"):
            snap = Snapshot(path)
            for logical in snap.get_manifest():
                snap.read_object(logical)
    finally:
        with open(full, "wb") as f:
            f.write(content)


@pytest.mark.parametrize(
    ("pattern", "replacement", "error"),
    [
        # An object's size: reading it must not try to allocate what the manifest claims.
        (
            rb'("obj_type": "set", "location": \["[^"]+", 0, )\d+',
            rb"\g<1>99999999999999",
            "allocate",
        ),
        # A tuple's length: never build or walk that many child paths.
        (
            rb'("0/extra/nested/k": \{"type": "tuple", "length": )\d+',
            rb"\g<1>99999999999999",
            "holds only",
        ),
    ],
)
def test_sizes_claimed_by_a_damaged_manifest_are_not_trusted(
    snapshot_dir, pattern, replacement, error
):
    """Found by the fuzz test above: each once exhausted memory."""
    path, original = snapshot_dir
    bad, n = re.subn(pattern, replacement, original)
    assert n == 1
    with open(os.path.join(path, MANIFEST), "wb") as f:
        f.write(bad)
    try:
        snap = Snapshot(path)
        where = re.escape(path)
        key = "0/extra/nested/k" if error == "holds only" else "0/extra/obj"
        with pytest.raises(CorruptSnapshotError, match=f"{where}.*{key}.*{error}"):
            snap.read_object(key)
        with pytest.raises(CorruptSnapshotError, match=f"{where}.*{key}.*{error}"):
            snap.restore(_targets())
    finally:
        with open(os.path.join(path, MANIFEST), "wb") as f:
            f.write(original)
