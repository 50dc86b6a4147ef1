"""What the CheckpointManager, ``statesnap prune`` and the Lightning plugin may delete, and what
they never touch: steps they cannot read, folders they did not make, links named like steps;
the folder found is the one opened; saves of a step already committed; a dropped manager's
thread; background failures (docs/reliability.md, "Checkpoint manager and deletions")."""

from __future__ import annotations

import errno
import gc
import logging
import os
import shutil
import threading
import time

import pytest
import torch

from snapshot import CheckpointManager, Snapshot, SnapshotError, StateDict
from snapshot._engine.manager.steps import delete_snapshot
from snapshot._engine.take.commit import MANIFEST_NAME, PENDING_NAME
from snapshot.cli import main as cli_main
from snapshot.errors import SnapshotExistsError
from snapshot.options import resolve
from storage_plugins import register_storage_plugin, unregister_storage_plugin
from storage_plugins.fs import FSStoragePlugin
from tests.helpers import seal_manifest

TORCHSNAPSHOT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "data", "torchsnapshot-0.1.0", "single"
)


def state(value: float = 0.0) -> dict:
    return {"model": StateDict(w=torch.full((8,), value), frozen=torch.arange(64.0))}


def value_of(target: dict) -> float:
    return float(target["model"]["w"][0])


def name(step: int) -> str:
    return f"step_{step:010d}"


def tree(root: str) -> dict[str, bytes | str]:
    """Every path under ``root`` (links not followed): a file's bytes, a link's target."""
    out: dict[str, bytes | str] = {}
    for top, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(top, n)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = "-> " + os.readlink(p)
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    out[rel] = f.read()
    return out


def saved(root: str, *steps: int, incremental: bool = False) -> None:
    """Commits ``steps`` under ``root`` through a manager (no retention)."""
    with CheckpointManager(root, async_=False, incremental=incremental) as m:
        for s in steps:
            m.save(s, state(float(s)))


def newer_format(path: str) -> None:
    """Rewrites the manifest of the snapshot at ``path`` as a newer statesnap would write it."""
    file = os.path.join(path, MANIFEST_NAME)
    with open(file, "rb") as f:
        data = f.read()
    body = data[: data.rindex(b"# crc32")]
    body = body.replace(b"format_version: ", b"format_version: 9", 1)
    with open(file, "wb") as f:
        f.write(seal_manifest(body))


def damage(path: str) -> None:
    """Flips one byte in the middle of the manifest of the snapshot at ``path``."""
    file = os.path.join(path, MANIFEST_NAME)
    with open(file, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0x01
        f.seek(0)
        f.write(data)


# -- 1. committed steps that cannot be read ------------------------------------------------------


@pytest.mark.parametrize("how", ["newer", "damaged"])
def test_a_committed_step_that_cannot_be_read_is_kept_and_never_latest(tmp_path, caplog, how):
    root = str(tmp_path / "ckpt")
    saved(root, 1, 2, 3)
    (newer_format if how == "newer" else damage)(f"{root}/{name(3)}")
    before = tree(f"{root}/{name(3)}")
    with caplog.at_level(logging.WARNING, logger="snapshot"), CheckpointManager(root) as m:
        assert m.steps() == [1, 2]
        target = state(-1)
        assert m.restore(target) == 2 and value_of(target) == 2.0
        m.save(4, state(4))
        m.wait()
        assert m.steps() == [1, 2, 4]
    assert tree(f"{root}/{name(3)}") == before
    assert name(3) in caplog.text
    assert ("upgrade" if how == "newer" else "damaged") in caplog.text


def test_an_unreadable_step_keeps_every_base_it_may_need(tmp_path):
    root = str(tmp_path / "ckpt")
    saved(root, 1, 2, incremental=True)  # 2 points at 1's frozen tensor
    assert Snapshot(f"{root}/{name(2)}").metadata.bases == (name(1),)
    newer_format(f"{root}/{name(2)}")
    with CheckpointManager(root, keep_last=1, async_=False) as m:
        m.save(3, state(3))
        m.save(4, state(4))
        m.wait()
    # 2 cannot be read, so which steps it needs is unknown: 1 stays, and 3 with it.
    assert sorted(os.listdir(root)) == [name(1), name(2), name(3), name(4)]


class Refusing(FSStoragePlugin):
    """Local storage (``refusing:///abs/path``) that refuses to read step 2's manifest, as a
    store does on a permission error or a server error past its retries."""

    def __init__(self, root: str, storage_options=None) -> None:
        super().__init__(root.split("://", 1)[1], storage_options)

    async def read(self, path: str) -> bytes:
        if name(2) in self.root and path == MANIFEST_NAME:
            raise PermissionError(errno.EACCES, "Access Denied")
        return await super().read(path)

    async def read_limited(self, path: str, limit: int) -> bytes:
        if name(2) in self.root and path == MANIFEST_NAME:
            raise PermissionError(errno.EACCES, "Access Denied")
        return await super().read_limited(path, limit)


def test_a_storage_error_reading_a_manifest_deletes_nothing(tmp_path, caplog):
    root = str(tmp_path / "ckpt")
    saved(root, 1, 2)
    register_storage_plugin("refusing", Refusing)
    try:
        with (
            caplog.at_level(logging.WARNING, logger="snapshot"),
            CheckpointManager(f"refusing://{root}", keep_last=1, async_=False) as m,
        ):
            assert m.steps() == [1]
            m.save(3, state(3))
            m.wait()
    finally:
        unregister_storage_plugin("refusing")
    assert sorted(os.listdir(root)) == [name(1), name(2), name(3)]
    assert "Access Denied" in caplog.text


# -- 2. folders the manager did not make ----------------------------------------------------------


def test_folders_the_manager_did_not_make_are_left_alone(tmp_path, caplog):
    root = str(tmp_path / "ckpt")
    saved(root, 1)
    os.makedirs(f"{root}/step_7")
    with open(f"{root}/step_7/notes.txt", "w") as f:
        f.write("mine")
    shutil.copytree(TORCHSNAPSHOT, f"{root}/{name(8)}")  # statesnap reads it; never deletes it
    os.makedirs(f"{root}/{name(9)}")  # empty
    os.makedirs(f"{root}/{name(10)}/0")  # a pending marker beside a file no take writes
    for rel in (PENDING_NAME, "0/notes.txt"):
        with open(f"{root}/{name(10)}/{rel}", "w") as f:
            f.write("x")
    os.makedirs(f"{root}/{name(11)}/0")  # blobs without a marker: not provably a take's
    with open(f"{root}/{name(11)}/0/1a2b3c4d-s0", "wb") as f:
        f.write(b"partial")
    os.makedirs(f"{root}/{name(12)}/0/sub")  # a marker, blob names, and a folder no take makes
    with open(f"{root}/{name(12)}/{PENDING_NAME}", "w") as f:
        f.write("x")
    kept = tree(root)
    os.makedirs(f"{root}/{name(13)}/0")  # a take cut short: marker and blobs only
    for rel in (PENDING_NAME, "0/1a2b3c4d-s0", "0/1a2b3c4d-1", f"0/.1a2b3c4d-2.{'0' * 12}.tmp"):
        with open(f"{root}/{name(13)}/{rel}", "wb") as f:
            f.write(b"partial")
    with (
        caplog.at_level(logging.WARNING, logger="snapshot"),
        CheckpointManager(root, keep_last=1) as m,
    ):
        assert m.restore(state(-1)) == 1
        m.save(14, state(14))
        m.wait()
    after = tree(root)
    assert not any(p.startswith(name(13)) for p in after)  # the take's debris went
    assert not any(p.startswith(name(1)) for p in after)  # dropped by keep_last
    assert {p: v for p, v in after.items() if not p.startswith(name(14))} == {
        p: v for p, v in kept.items() if not p.startswith(name(1))
    }
    for n in ("step_7", name(8), name(9), name(10), name(11), name(12)):
        assert n in caplog.text


# -- 3. links named like a step -------------------------------------------------------------------


def test_a_link_named_like_a_step_is_ignored_never_followed(tmp_path, caplog):
    root = str(tmp_path / "ckpt")
    saved(root, 1, 2)
    elsewhere = str(tmp_path / "elsewhere")
    Snapshot.take(elsewhere, state(5.0))
    os.symlink(elsewhere, f"{root}/{name(5)}")
    os.symlink(str(tmp_path / "nothing"), f"{root}/step_6")  # dangling
    os.symlink(elsewhere, f"{root}/step_2")  # beside the folder of step 2: that one is used
    outside = tree(elsewhere)
    with (
        caplog.at_level(logging.WARNING, logger="snapshot"),
        CheckpointManager(root, keep_last=1) as m,
    ):
        assert m.steps() == [1, 2]
        target = state(-1)
        assert m.restore(target) == 2 and value_of(target) == 2.0
        m.save(3, state(3))
        m.wait()
        assert m.steps() == [3]
    for n in (name(5), "step_6", "step_2"):
        assert os.path.islink(f"{root}/{n}")
    assert tree(elsewhere) == outside
    assert "symbolic link" in caplog.text and name(5) in caplog.text


# -- 4. the folder found is the one opened -------------------------------------------------------


def test_the_folder_found_is_the_one_restored_based_on_and_deleted(tmp_path):
    root = str(tmp_path / "ckpt")
    Snapshot.take(
        f"{root}/step_5",
        state(5.0),
        user_metadata={"step": 5, "metrics": {}},
        options=resolve(None).replace(digests=True),
    )
    with CheckpointManager(root, incremental=True, async_=False) as m:
        assert m.steps() == [5]
        target = state(-1)
        assert m.restore(target) == 5 and value_of(target) == 5.0
        m.save(6, state(6))
    assert Snapshot(f"{root}/{name(6)}").metadata.bases == ("step_5",)
    with CheckpointManager(root, keep_last=1, incremental=True, async_=False) as m:
        m.save(7, state(7))
    # 7 needs step_5 (its frozen tensor): it stays, 6 goes; nothing was made at
    # step_0000000005.
    assert sorted(os.listdir(root)) == [name(7), "step_5"]
    with CheckpointManager(root, keep_last=1, async_=False) as m:
        m.save(8, state(8))
    assert sorted(os.listdir(root)) == [name(8)]  # step_5 deleted under the name found


def test_two_folders_of_one_step_are_refused_and_nothing_is_deleted(tmp_path, caplog):
    root = str(tmp_path / "ckpt")
    saved(root, 4, 5)
    shutil.copytree(f"{root}/{name(4)}", f"{root}/step_4")
    before = tree(root)
    with CheckpointManager(root, keep_last=1, async_=False) as m:
        with pytest.raises(SnapshotError, match="step_4.*step_0000000004|step_0000000004.*step_4"):
            m.steps()
        m._last_saved = 5  # as if restored: the save goes ahead, its retention is refused
        with caplog.at_level(logging.WARNING, logger="snapshot"):
            m.save(6, state(6))
            m.wait()
    assert {p: v for p, v in tree(root).items() if not p.startswith(name(6))} == before
    assert "step_4" in caplog.text


# -- 5. a step already committed -----------------------------------------------------------------


@pytest.mark.parametrize("async_", [True, False])
def test_saving_a_step_already_committed_is_refused_up_front(tmp_path, async_):
    root = str(tmp_path / "ckpt")
    saved(root, 8, 9, 10)
    before = tree(root)
    with CheckpointManager(root, async_=async_) as m:
        assert m.restore(state(-1), step=8) == 8
        with pytest.raises(SnapshotExistsError, match=r"step 9 is already committed under .*ckpt"):
            m.save(9, state(9))
        assert tree(root) == before
        m.save(11, state(11))
        m.wait()
        assert m.steps() == [8, 9, 10, 11]


# -- 6. a manager dropped without close() ---------------------------------------------------------


def test_a_dropped_manager_ends_its_thread(tmp_path):
    root = str(tmp_path / "ckpt")
    m = CheckpointManager(root, keep_last=1, async_=False)
    m.save(1, state(1))
    m.save(2, state(2))
    m.wait()
    workers = [
        t for t in threading.enumerate() if t.name.startswith("statesnap-checkpoint-manager")
    ]
    assert workers
    del m
    gc.collect()
    deadline = time.monotonic() + 10
    while any(t.is_alive() for t in workers) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.is_alive() for t in workers)
    assert os.listdir(root) == [name(2)]


class CutShort(FSStoragePlugin):
    """Local storage (``cutshort:///abs/path``) whose whole-folder deletes of a rank's blobs fail,
    as a process killed in the middle of a deletion stops it."""

    def __init__(self, root: str, storage_options=None) -> None:
        super().__init__(root.split("://", 1)[1], storage_options)

    async def delete_all(self) -> None:
        if os.path.basename(self.root).isdigit():
            raise OSError(errno.EIO, "cut short")
        await super().delete_all()


def test_a_deletion_cut_short_leaves_marked_debris_that_is_cleaned_later(tmp_path):
    root = str(tmp_path / "ckpt")
    saved(root, 1, 2)
    register_storage_plugin("cutshort", CutShort)
    try:
        with CheckpointManager(f"cutshort://{root}", keep_last=1, async_=False) as m:
            m.save(3, state(3))
            m.wait()
    finally:
        unregister_storage_plugin("cutshort")
    # Steps 1 and 2 were being deleted: no manifest, the marker, and blobs only.
    for n in (name(1), name(2)):
        left = os.listdir(f"{root}/{n}")
        assert MANIFEST_NAME not in left and PENDING_NAME in left, left
    with CheckpointManager(root, keep_last=1, async_=False) as m:
        m.save(4, state(4))
    assert sorted(os.listdir(root)) == [name(4)]


# -- 7. deletions through links ------------------------------------------------------------------


def test_delete_snapshot_refuses_a_link_before_deleting_anything(tmp_path):
    target = str(tmp_path / "real")
    Snapshot.take(target, state(1))
    link = str(tmp_path / "link")
    os.symlink(target, link)
    before = tree(target)
    with pytest.raises(SnapshotError, match="symbolic link"):
        delete_snapshot(link, None, resolve(None))
    assert tree(target) == before and os.path.islink(link)


def test_prune_never_deletes_through_a_link_nor_what_no_take_wrote(tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    saved(root, 1, 2, 3)
    elsewhere = str(tmp_path / "elsewhere")
    Snapshot.take(elsewhere, state(0))
    os.symlink(elsewhere, f"{root}/{name(0)}")
    with open(f"{root}/{name(2)}/notes.txt", "w") as f:
        f.write("mine")
    os.makedirs(f"{root}/{name(9)}")  # no marker: not a take's
    outside = tree(elsewhere)
    assert cli_main(["prune", root, "--keep-last", "1", "--incomplete"]) == 0
    assert tree(elsewhere) == outside and os.path.islink(f"{root}/{name(0)}")
    # 1 goes; 2 holds a file no take writes: kept, with the reason printed
    assert sorted(os.listdir(root)) == [name(0), name(2), name(3), name(9)]
    assert "notes.txt" in capsys.readouterr().out


def test_lightning_remove_checkpoint_refuses_a_link_before_deleting(tmp_path):
    lightning = pytest.importorskip(
        "snapshot.integrations.lightning", reason="Lightning cannot be imported"
    )
    StatesnapCheckpointIO, list_versions = lightning.StatesnapCheckpointIO, lightning.list_versions

    real = str(tmp_path / "real.ckpt")
    io = StatesnapCheckpointIO()
    io.save_checkpoint({"epoch": 1, "state_dict": {"w": torch.ones(3)}}, real)
    link = str(tmp_path / "last.ckpt")
    os.symlink(real, link)
    before = tree(real)
    with pytest.raises(SnapshotError, match="symbolic link"):
        io.remove_checkpoint(link)
    assert tree(real) == before
    assert [v.committed for v in list_versions(real, None, resolve(None))] == [True]
    with open(f"{real}/notes.txt", "w") as f:
        f.write("mine")
    with pytest.raises(SnapshotError, match="notes.txt"):
        io.remove_checkpoint(real)
    assert [v.committed for v in list_versions(real, None, resolve(None))] == [True]


# -- 8. a failed background save -----------------------------------------------------------------


class FullDisk(FSStoragePlugin):
    """Local storage (``fulldisk2:///abs/path``) out of space for the blobs of step 2."""

    def __init__(self, root: str, storage_options=None) -> None:
        super().__init__(root.split("://", 1)[1], storage_options)

    async def write(self, path, buffers):
        if name(2) in self.root and path != PENDING_NAME:
            raise OSError(errno.ENOSPC, "No space left on device")
        await super().write(path, buffers)


@pytest.fixture
def fulldisk(tmp_path):
    register_storage_plugin("fulldisk2", FullDisk)
    yield f"fulldisk2://{tmp_path}/ckpt", str(tmp_path / "ckpt")
    unregister_storage_plugin("fulldisk2")


def test_a_failed_background_save_does_not_stop_training(fulldisk, caplog):
    url, root = fulldisk
    with caplog.at_level(logging.ERROR, logger="snapshot"):
        m = CheckpointManager(url, keep_last=1)
        m.save(1, state(1))
        m.save(2, state(2))  # fails while writing, after save returned
        m._wait_for_saves(0)  # every save ended, its error kept for close()
        assert m.steps() == [1]  # the previous good step stays
        m.save(3, state(3))  # training goes on
        with pytest.raises(SnapshotError, match="No space left"):
            m.close()  # the documented point where it is raised
    assert sorted(os.listdir(root)) == [name(3)]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert any("step 2" in r.getMessage() and root in r.getMessage() for r in errors)


def test_a_failed_background_save_is_raised_by_wait(fulldisk):
    url, root = fulldisk
    with CheckpointManager(url) as m:
        m.save(1, state(1))
        m.save(2, state(2))
        with pytest.raises(SnapshotError, match="No space left"):
            m.wait()
        assert m.steps() == [1]
        assert sorted(os.listdir(root)) == [name(1)]  # the failed save's folder went


def test_raise_on_next_save(fulldisk):
    url, root = fulldisk
    with CheckpointManager(url, raise_on_next_save=True) as m:
        m.save(1, state(1))
        m.save(2, state(2))
        with pytest.raises(SnapshotError, match="No space left"):
            m.save(3, state(3))
        m.save(3, state(3))
    assert sorted(os.listdir(root)) == [name(1), name(3)]


class LeavesBlobs(FSStoragePlugin):
    """Local storage (``leaves:///abs/path``) out of space for step 2's blobs, and unable to
    delete them one by one: the failed take's cleanup leaves them (its marker goes)."""

    def __init__(self, root: str, storage_options=None) -> None:
        super().__init__(root.split("://", 1)[1], storage_options)

    async def write(self, path, buffers):
        if name(2) in self.root and path != PENDING_NAME and path.endswith("-1"):
            raise OSError(errno.ENOSPC, "No space left on device")
        await super().write(path, buffers)

    async def delete(self, path: str) -> None:
        if name(2) in self.root and path.startswith("0/"):
            raise OSError(errno.EIO, "cannot delete")
        await super().delete(path)


def test_what_a_failed_save_left_is_deleted_and_the_previous_step_kept(tmp_path):
    root = str(tmp_path / "ckpt")
    register_storage_plugin("leaves", LeavesBlobs)
    # 20 MiB each: a blob each, past the slabs of the manager's async takes.
    big = {"model": StateDict(a=torch.zeros(5 << 20), b=torch.ones(5 << 20))}
    try:
        with CheckpointManager(f"leaves://{root}", keep_last=1) as m:
            m.save(1, big)
            m.save(2, big)
            with pytest.raises(SnapshotError, match="No space left"):
                m.wait()
            assert m.steps() == [1]
            m.save(3, big)
            m.wait()
    finally:
        unregister_storage_plugin("leaves")
    assert sorted(os.listdir(root)) == [name(3)]


class ListingFails(FSStoragePlugin):
    """Local storage (``listfails:///abs/path``) whose listing of the root fails once armed."""

    armed = False

    def __init__(self, root: str, storage_options=None) -> None:
        super().__init__(root.split("://", 1)[1], storage_options)

    async def list_names(self, limit: int):
        if ListingFails.armed and not os.path.basename(self.root).startswith("step_"):
            raise OSError(errno.EIO, "server error")
        return await super().list_names(limit)


def test_a_listing_that_fails_deletes_nothing(tmp_path, caplog):
    root = str(tmp_path / "ckpt")
    saved(root, 1, 2)
    register_storage_plugin("listfails", ListingFails)
    try:
        with CheckpointManager(f"listfails://{root}", keep_last=1, async_=False) as m:
            assert m.restore(state(-1)) == 2
            ListingFails.armed = True
            with caplog.at_level(logging.WARNING, logger="snapshot"):
                m.save(3, state(3))
                m.wait()
    finally:
        ListingFails.armed = False
        unregister_storage_plugin("listfails")
    assert sorted(os.listdir(root)) == [name(1), name(2), name(3)]
    assert "deleted nothing this round" in caplog.text


@pytest.mark.slow
def test_on_s3_a_manifest_refused_or_a_listing_failing_deletes_nothing(s3_bucket, caplog):
    """S3 answering 500 for one step's manifest (past the retries), then for the listing of the
    root: the step is kept and not restored as the latest; the round deletes nothing."""
    from urllib.parse import parse_qs

    from snapshot.options import Options

    opts = s3_bucket.storage_options
    root = s3_bucket.url("run")
    options = Options(io_retries=1)
    with CheckpointManager(root, storage_options=opts, async_=False, options=options) as m:
        m.save(1, state(1))
        m.save(2, state(2))
    s3_bucket.fail(
        lambda r: r.method == "GET" and r.key.endswith(f"{name(2)}/{MANIFEST_NAME}"),
        status=500,
        code="InternalError",
        times=None,
    )
    with (
        caplog.at_level(logging.WARNING, logger="snapshot"),
        CheckpointManager(
            root, keep_last=1, storage_options=opts, async_=False, options=options
        ) as m,
    ):
        target = state(-1)
        assert m.restore(target) == 1 and value_of(target) == 1.0
        m.save(3, state(3))
        m.wait()
        s3_bucket.fail(
            lambda r: r.method == "GET" and parse_qs(r.query).get("prefix") == ["run/"],
            status=500,
            code="InternalError",
            times=None,
        )
        m.save(4, state(4))
        m.wait()
    s3_bucket.server.clear_faults()
    with CheckpointManager(root, storage_options=opts) as m:
        assert m.steps() == [1, 2, 3, 4]
    assert "InternalError" in caplog.text and name(2) in caplog.text
    assert "deleted nothing this round" in caplog.text
