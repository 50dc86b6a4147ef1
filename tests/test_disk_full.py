"""A take onto a file system that fills up, or that is read-only: nothing is committed, what the
take wrote is removed, an earlier snapshot on the same file system is intact, and a later take
at the path works. The file system is a small tmpfs the test mounts (root only)."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from snapshot import Snapshot, SnapshotNotFoundError, StateDict, StorageError

MIB = 1 << 20


@pytest.fixture
def small_fs(tmp_path) -> Iterator[Path]:
    """A 24 MiB tmpfs mounted for the test."""
    where = tmp_path / f"fs-{uuid.uuid4().hex[:6]}"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def state(mib: int, value: float) -> dict:
    return {"m": StateDict(w=torch.full((mib * MIB // 4,), value), note=f"{mib} MiB")}


def files_under(path: Path) -> list[str]:
    if not path.exists():
        return []
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


def test_disk_full_commits_nothing_and_keeps_the_earlier_snapshot(small_fs):
    earlier = state(4, 1.0)
    Snapshot.take(str(small_fs / "earlier"), earlier)
    with pytest.raises(StorageError, match="No space left on device"):
        Snapshot.take(str(small_fs / "big"), state(32, 2.0))
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(str(small_fs / "big"))
    assert files_under(small_fs / "big") == []  # every blob it wrote, removed
    back = Snapshot(str(small_fs / "earlier")).read_object("0/m/w")
    assert torch.equal(back, earlier["m"]["w"])
    # The space is back: a take that fits, at the same path, works.
    Snapshot.take(str(small_fs / "big"), state(8, 3.0))
    assert torch.equal(
        Snapshot(str(small_fs / "big")).read_object("0/m/w"), state(8, 3.0)["m"]["w"]
    )


def test_a_read_only_file_system_commits_nothing(small_fs):
    earlier = state(2, 1.0)
    Snapshot.take(str(small_fs / "earlier"), earlier)
    os.makedirs(small_fs / "later")
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    try:
        with pytest.raises(StorageError, match="Read-only file system"):
            Snapshot.take(str(small_fs / "later"), state(2, 2.0))
        assert torch.equal(
            Snapshot(str(small_fs / "earlier")).read_object("0/m/w"), earlier["m"]["w"]
        )
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=True)
    assert files_under(small_fs / "later") == []
    Snapshot.take(str(small_fs / "later"), state(2, 2.0))
    assert Snapshot(str(small_fs / "later")).read_object("0/m/note") == "2 MiB"
