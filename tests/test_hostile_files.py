"""Files on the store as hostile input: nothing outside a snapshot's root is read (or written, or
deleted), no file costs more than its bytes, and nothing blocks.

A snapshot's directory can come from a tarball or an upload: a blob, a folder or the manifest may
be a symbolic link to anything on the machine, a FIFO, a socket, or a file far larger than any
manifest. Every operation must refuse them with ``UnsafeSnapshotError`` naming the path, never
return an outside file's bytes as a value, and end within a few seconds. A take that fails leaves
the path as it found it, and never follows a link out of the root while writing or cleaning up.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import socket
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snapshot import (
    Options,
    Snapshot,
    SnapshotError,
    StateDict,
    StorageError,
    UnsafeSnapshotError,
)
from snapshot._engine.format.manifest_io import load_manifest
from snapshot._engine.take.commit import MANIFEST_NAME
from snapshot._engine.tools.verify import verify
from snapshot.cli import EXIT_OK, EXIT_PROBLEM, main
from storage_plugins import (
    BlobTooLargeError,
    UnsafeBlobError,
    register_storage_plugin,
    unregister_storage_plugin,
)
from storage_plugins import fs as fs_plugin
from storage_plugins.s3 import S3StoragePlugin
from tests.helpers import assert_same, raw_bytes
from tests.s3server import S3Bucket

# Distinctive bytes that fill every file outside a snapshot's root: they must never come back.
SECRET = b"OUTSIDE-THE-ROOT!"
# Longest any single operation may take here: each one is a few milliseconds when it works, and
# a FIFO opened for reading without O_NONBLOCK would wait forever.
BOUND_SECS = 20.0
KNOB = "STATESNAP_MAX_MANIFEST_BYTES"


def _state() -> dict[str, StateDict]:
    return {"m": StateDict(w=torch.arange(1024, dtype=torch.float32), o={1, 2, 3}, n=7)}


def _targets() -> dict[str, StateDict]:
    return {"m": StateDict(w=torch.zeros(1024), o=None, n=None)}


# The tensor and the object in blobs of their own (no slab), so each can be replaced.
LAYOUT = Options(slab_threshold_bytes=16)


@pytest.fixture
def snap(tmp_path) -> str:
    path = str(tmp_path / "snap")
    Snapshot.take(path, _state(), options=LAYOUT)
    return path


@pytest.fixture
def outside(tmp_path) -> Path:
    """A folder beside the snapshot, holding files of nothing but SECRET."""
    folder = tmp_path / "outside"
    folder.mkdir()
    return folder


def _blob_of(path: str, logical: str) -> str:
    return load_manifest(path, None).entries[logical].locations[0].blob


def _secret_file(folder: Path, name: str, nbytes: int) -> Path:
    """A file of exactly ``nbytes`` of SECRET repeated: the length is all an attacker needs to
    pass the size checks of an entry recorded without a checksum."""
    data = (SECRET * (nbytes // len(SECRET) + 1))[:nbytes]
    file = folder / name
    file.write_bytes(data)
    return file


def _bounded(fn: Callable[[], Any], seconds: float = BOUND_SECS) -> Any:
    """``fn()`` on a thread of its own, failing the test when it has not ended in ``seconds``
    (a hang, instead of a test run that never ends); returns its value or raises its error."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:  # handed to the caller's thread
            result["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s: it hangs"
    if "error" in result:
        raise result["error"]
    return result["value"]


def _assert_no_secret(value: Any) -> None:
    """No tensor's bytes, and no other value's text, hold SECRET."""
    if isinstance(value, torch.Tensor):
        assert SECRET[:8] not in raw_bytes(value)
    elif isinstance(value, dict):
        for v in value.values():
            _assert_no_secret(v)
    elif isinstance(value, (list, tuple, set)):
        for v in value:
            _assert_no_secret(v)
    else:
        assert SECRET.decode()[:8] not in repr(value)


def _refused(fn: Callable[[], Any], *patterns: str) -> UnsafeSnapshotError:
    """``fn()`` raises exactly UnsafeSnapshotError, within the bound, whose message holds every
    pattern and no SECRET."""
    with pytest.raises(UnsafeSnapshotError) as caught:
        _bounded(fn)
    assert type(caught.value) is UnsafeSnapshotError
    message = str(caught.value)
    for pattern in patterns:
        assert pattern in message, message
    assert SECRET.decode() not in message
    return caught.value


def _cli(capsys, *argv: str) -> tuple[int, str]:
    code = _bounded(lambda: main(list(argv)))
    out, err = capsys.readouterr()
    text = out + err
    assert SECRET.decode()[:8] not in text
    return code, text


def _restore(path: str) -> dict[str, StateDict]:
    targets = _targets()
    Snapshot(path).restore(targets)
    return targets


# ---------------------------------------------------------------------------------------------
# Blobs and folders that are links, FIFOs, sockets.


@pytest.mark.parametrize("logical", ["0/m/w", "0/m/o"])
def test_a_blob_linked_outside_is_refused_everywhere(capsys, snap, outside, logical):
    blob = _blob_of(snap, logical)
    file = Path(snap, blob)
    secret = _secret_file(outside, "secret", file.stat().st_size)
    file.unlink()
    file.symlink_to(secret)
    where = str(Path(snap, blob))
    _refused(lambda: Snapshot(snap).read_object(logical), logical, where, "symbolic link")
    _refused(lambda: _restore(snap), logical, where, "symbolic link")
    code, text = _cli(capsys, "show", snap, logical)
    assert code == EXIT_PROBLEM and "symbolic link" in text
    code, text = _cli(capsys, "verify", snap)
    assert code == EXIT_PROBLEM and "symbolic link" in text and "FAILED" in text
    # The entry that does not live there still reads.
    other = "0/m/o" if logical == "0/m/w" else "0/m/w"
    _assert_no_secret(Snapshot(snap).read_object(other))
    assert secret.read_bytes().startswith(SECRET)  # untouched


def test_a_folder_linked_outside_is_refused_everywhere(capsys, snap, outside):
    # The rank's folder moved out of the root, a link left in its place: every file in it is
    # what the manifest records, but none of them is inside the snapshot any more.
    moved = outside / "0"
    shutil.move(os.path.join(snap, "0"), moved)
    for file in moved.iterdir():
        _secret_file(moved, file.name, file.stat().st_size)
    os.symlink(moved, os.path.join(snap, "0"))
    link = os.path.join(snap, "0")
    _refused(lambda: Snapshot(snap).read_object("0/m/w"), "0/m/w", link, "symbolic link")
    _refused(lambda: _restore(snap), link, "symbolic link")
    code, text = _cli(capsys, "verify", snap)
    assert code == EXIT_PROBLEM and "symbolic link" in text
    code, text = _cli(capsys, "show", snap, "0/m/o")
    assert code == EXIT_PROBLEM and "symbolic link" in text
    assert Snapshot(snap).read_object("0/m/n") == 7  # kept in the manifest: still readable


@pytest.mark.parametrize("kind", ["fifo", "socket", "directory"])
def test_a_blob_that_is_not_a_regular_file_is_refused_without_blocking(capsys, snap, kind):
    blob = _blob_of(snap, "0/m/w")
    file = os.path.join(snap, blob)
    os.unlink(file)
    holder = None
    if kind == "fifo":
        os.mkfifo(file)
        expected = "a FIFO"
    elif kind == "socket":
        if len(file) > 100:
            pytest.skip("the path is too long for a Unix socket's address")
        holder = socket.socket(socket.AF_UNIX)
        holder.bind(file)
        expected = "a socket"
    else:
        os.mkdir(file)
        expected = "a directory"
    try:
        _refused(lambda: Snapshot(snap).read_object("0/m/w"), "0/m/w", file, expected)
        _refused(lambda: _restore(snap), file, expected)
        code, text = _cli(capsys, "verify", snap)
        assert code == EXIT_PROBLEM and expected in text
    finally:
        if holder is not None:
            holder.close()


# ---------------------------------------------------------------------------------------------
# The manifest.


def _manifest_cases(snap: str, outside: Path) -> Iterator[tuple[str, str]]:
    """Replaces the manifest, in turn, by each hostile thing; yields (case, expected text)."""
    manifest = Path(snap, MANIFEST_NAME)
    original = manifest.read_bytes()
    # A link to a real manifest outside the root (a copy of the snapshot's own).
    copy = outside / MANIFEST_NAME
    copy.write_bytes(original)
    manifest.unlink()
    manifest.symlink_to(copy)
    yield "link", "symbolic link"
    manifest.unlink()
    # A link to an endless device: read whole, it would exhaust memory.
    manifest.symlink_to("/dev/zero")
    yield "device link", "symbolic link"
    manifest.unlink()
    # A FIFO: opened for reading, it waits for a writer that never comes.
    os.mkfifo(manifest)
    yield "fifo", "a FIFO"
    manifest.unlink()
    manifest.write_bytes(original)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_hostile_manifest_is_refused_everywhere(capsys, snap, outside):
    for case, expected in _manifest_cases(snap, outside):
        where = os.path.join(snap, MANIFEST_NAME)
        _refused(lambda: Snapshot(snap), where, expected)
        _refused(lambda: Snapshot(snap).read_object("0/m/w"), where, expected)
        _refused(lambda: _restore(snap), where, expected)
        _refused(lambda: Snapshot(snap).get_manifest(), where, expected)
        for argv in (("verify", snap), ("show", snap, "0/m/w"), ("ls", snap)):
            code, text = _cli(capsys, *argv)
            assert code == EXIT_PROBLEM and expected in text, (case, argv, text)
    _assert_no_secret(_restore(snap))  # restored once put back


def test_a_manifest_over_the_limit_is_refused_naming_the_knob(capsys, snap, monkeypatch):
    size = os.path.getsize(os.path.join(snap, MANIFEST_NAME))
    below = Options(max_manifest_bytes=size - 1)
    error = _refused(
        lambda: Snapshot(snap, options=below), KNOB, f"{size} bytes", f"limit of {size - 1}"
    )
    assert MANIFEST_NAME in str(error)
    monkeypatch.setenv(KNOB, str(size - 1))  # the command has no options: the environment's
    code, text = _cli(capsys, "verify", snap)
    assert code == EXIT_PROBLEM and KNOB in text
    exactly = Options(max_manifest_bytes=size)  # exactly the limit: read
    assert_same(
        Snapshot(snap, options=exactly).read_object("0/m/w", options=exactly),
        torch.arange(1024, dtype=torch.float32),
    )


def test_a_manifest_over_the_limit_on_memory_and_s3(s3_bucket: S3Bucket):
    urls = [("memory://hostile/snap", None), (s3_bucket.url(), s3_bucket.storage_options)]
    small = Options(max_manifest_bytes=100)
    for url, options in urls:
        Snapshot.take(url, _state(), storage_options=options, options=LAYOUT)
        _refused(
            lambda u=url, o=options: Snapshot(u, storage_options=o, options=small),
            KNOB,
            MANIFEST_NAME,
        )
        assert Snapshot(url, storage_options=options).read_object("0/m/n") == 7


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_a_file_whose_reported_size_lies_is_still_read_bounded():
    # /proc's files are regular files whose fstat says 0 bytes: a read bounded by the reported
    # size alone would be unbounded for such a file.
    plugin = fs_plugin.FSStoragePlugin("/proc/self", {"fsync": False})
    try:
        assert os.stat("/proc/self/status").st_size == 0
        with pytest.raises(BlobTooLargeError, match="over the limit of 16 bytes"):
            asyncio.run(plugin.read_limited("status", 16))
        assert asyncio.run(plugin.read_limited("status", 1 << 20)).startswith(b"Name:")
    finally:
        asyncio.run(plugin.close())


class _EndlessBody:
    """An S3 response body that never ends, counting what it hands out."""

    def __init__(self) -> None:
        self.given = 0

    async def __aenter__(self) -> _EndlessBody:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def read(self, n: int = -1) -> bytes:
        assert n > 0, "an unbounded read of the body"
        piece = min(n, 4096)
        self.given += piece
        return b"x" * piece


@pytest.mark.parametrize("length", [None, 10])
def test_s3_reads_a_manifest_no_further_than_the_limit(s3_bucket: S3Bucket, length):
    """Without a Content-Length, or with one that lies, the body is read to one byte past the
    limit and no further."""
    body = _EndlessBody()

    async def scenario() -> None:
        plugin = S3StoragePlugin(s3_bucket.url("x"), s3_bucket.storage_options)

        async def get_object(method: str, path: str, **kwargs: Any) -> dict[str, Any]:
            return {"Body": body, **({"ContentLength": length} if length is not None else {})}

        plugin._call_in_slot = get_object  # type: ignore[method-assign]
        try:
            with pytest.raises(BlobTooLargeError):
                await plugin.read_limited(MANIFEST_NAME, 10_000)
        finally:
            await plugin.close()

    asyncio.run(scenario())
    assert body.given == 10_001


# ---------------------------------------------------------------------------------------------
# The local plugin, call by call.


@pytest.mark.parametrize("kind", ["link", "folder link", "fifo", "socket"])
def test_the_local_plugin_refuses_links_and_special_files_in_every_call(tmp_path, outside, kind):
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    secret = _secret_file(outside, "s", 64)
    holder = None
    if kind == "link":
        (root / "d" / "b").symlink_to(secret)
    elif kind == "folder link":
        (root / "d").rmdir()
        (root / "d").symlink_to(outside)
        secret.rename(outside / "b")
        secret = outside / "b"
    elif kind == "fifo":
        os.mkfifo(root / "d" / "b")
    else:
        if len(str(root / "d" / "b")) > 100:
            pytest.skip("the path is too long for a Unix socket's address")
        holder = socket.socket(socket.AF_UNIX)
        holder.bind(str(root / "d" / "b"))
    plugin = fs_plugin.FSStoragePlugin(str(root), {"fsync": False})

    async def calls() -> None:
        out = memoryview(bytearray(8))
        for call in (
            lambda: plugin.read("d/b"),
            lambda: plugin.read_limited("d/b", 1 << 20),
            lambda: plugin.read_into("d/b", 0, out),
            lambda: plugin.readv("d/b", 0, [out[:4], out[4:]]),
            lambda: plugin.readv_observed("d/b", 0, [out], lambda view: None),
            lambda: plugin.size("d/b"),
            lambda: plugin.exists("d/b"),
        ):
            with pytest.raises(UnsafeBlobError, match=f"{root}/d"):
                await call()
        if kind == "folder link":
            # Neither written nor deleted through the link.
            with pytest.raises(UnsafeBlobError):
                await plugin.write("d/new", [b"x"])
            with pytest.raises(UnsafeBlobError):
                await plugin.delete("d/b")
        else:
            await plugin.delete("d/b")  # the link or the FIFO itself, never what it names
            assert not await plugin.exists("d/b")
        assert await plugin.list_names(10) == ["d"]
        await plugin.close()

    try:
        _bounded(lambda: asyncio.run(calls()))
    finally:
        if holder is not None:
            holder.close()
    assert sorted(p.name for p in outside.iterdir()) == [secret.name]
    assert secret.read_bytes().startswith(SECRET)


# ---------------------------------------------------------------------------------------------
# Refusals are final.


class _Eager(fs_plugin.FSStoragePlugin):
    """Local disk whose every error is called transient: only the library's own rule keeps a
    refusal from being retried. Records the blobs it opens."""

    opened: list[str] = []

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        super().__init__(url.removeprefix("eager://"), storage_options)

    def is_transient(self, error: BaseException) -> bool:
        return True

    def _open_blob(self, path: str) -> tuple[int, os.stat_result]:
        type(self).opened.append(path)
        return super()._open_blob(path)


def test_a_refused_blob_is_not_retried(snap, outside, monkeypatch):
    blob = _blob_of(snap, "0/m/w")
    file = Path(snap, blob)
    file.unlink()
    file.symlink_to(_secret_file(outside, "secret", 4096))
    register_storage_plugin("eager", _Eager)
    monkeypatch.setattr(_Eager, "opened", [])
    try:
        _refused(lambda: Snapshot(f"eager://{snap}").read_object("0/m/w"), "symbolic link")
        assert _Eager.opened.count(blob) == 1  # asked once: no retry, so no backoff either
    finally:
        unregister_storage_plugin("eager")


# ---------------------------------------------------------------------------------------------
# Takes: never through a link, and a failed one leaves nothing.


def test_a_take_never_writes_or_deletes_through_a_linked_folder(outside, tmp_path):
    # Debris of an interrupted take, but with its rank folder a link to a folder elsewhere that
    # holds files named like the blobs a take writes.
    target = tmp_path / "debris"
    target.mkdir()
    elsewhere = outside / "elsewhere"
    elsewhere.mkdir()
    for name in ("0", "1", "s0"):
        _secret_file(elsewhere, name, 64)
    (target / "0").symlink_to(elsewhere)
    before = {p.name: p.read_bytes() for p in elsewhere.iterdir()}
    _refused(
        lambda: Snapshot.take(str(target), _state(), options=LAYOUT),
        str(target / "0"),
        "symbolic link",
    )
    assert {p.name: p.read_bytes() for p in elsewhere.iterdir()} == before
    assert sorted(os.listdir(target)) == ["0"]  # the link, left alone; the marker removed
    assert (target / "0").is_symlink()


def test_a_take_at_a_path_that_is_a_link_the_user_chose_works(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    Snapshot.take(str(link), _state(), options=LAYOUT)
    assert (real / MANIFEST_NAME).is_file()
    restored = _restore(str(link))
    assert_same(dict(restored["m"]), dict(_state()["m"]))
    code = main(["verify", str(link)])
    assert code == EXIT_OK


@pytest.mark.parametrize("depth", [0, 2])
def test_a_take_that_fails_on_a_full_disk_leaves_no_folders(tmp_path, monkeypatch, depth):
    real_write = fs_plugin._write_all

    def full_disk(fd: int, views: Any, *args: Any, **kwargs: Any) -> bool:
        if sum(map(len, views)) > 256:  # the blobs; the pending marker goes through
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, views, *args, **kwargs)

    monkeypatch.setattr(fs_plugin, "_write_all", full_disk)
    target = tmp_path.joinpath(*[f"parent{i}" for i in range(depth)], "snap")
    with pytest.raises(StorageError, match="No space left on device"):
        Snapshot.take(str(target), _state(), options=LAYOUT)
    assert list(tmp_path.iterdir()) == []
    # An existing folder is left where it was, emptied of what the take wrote.
    target = tmp_path / "existing"
    target.mkdir()
    with pytest.raises(StorageError, match="No space left on device"):
        Snapshot.take(str(target), _state(), options=LAYOUT)
    assert list(tmp_path.iterdir()) == [target] and list(target.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Random replacements (hypothesis).


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Iterator[tuple[Path, Path]]:
    """A real snapshot of chunks, a slab, an object and a long string, and a folder beside it
    holding SECRET files and a folder of them."""
    base = tmp_path_factory.mktemp("hostile-files")
    options = Options(chunk_bytes=8192, slab_threshold_bytes=1024)
    Snapshot.take(str(base / "template"), _fuzz_state(), options=options)
    outside = base / "outside"
    (outside / "folder").mkdir(parents=True)
    for name in ("file", "folder/0", "folder/s0", "folder/1"):
        _secret_file(outside, name, 1 << 14)
    yield base / "template", outside


def _fuzz_state() -> dict[str, StateDict]:
    return {
        "m": StateDict(
            big=torch.arange(8192, dtype=torch.int32),  # chunks of their own
            small=torch.ones(7),  # in the slab
            obj={1, 2},
            text="x" * 5000,  # a blob of its own
            n=3,
        )
    }


def _fuzz_targets() -> dict[str, StateDict]:
    return {"m": StateDict(big=torch.zeros(8192, dtype=torch.int32), small=torch.zeros(7))}


def _names(root: Path) -> list[str]:
    """Every file and folder under ``root``, relative, sorted."""
    found = []
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            found.append(os.path.relpath(os.path.join(folder, name), root))
    return sorted(found)


REPLACEMENTS = ["link outside", "link outside folder", "link inside", "fifo", "empty folder"]


def _replace(root: Path, outside: Path, name: str, how: str, inside: str) -> None:
    parts = Path(name).parts
    for depth in range(1, len(parts)):
        folder = root.joinpath(*parts[:depth])
        if folder.is_symlink() or not folder.is_dir():
            return  # inside a folder replaced already: never change what a link leads to
    path = root / name
    if not path.is_symlink() and not path.exists():
        return  # its folder was emptied
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
    if how == "link outside":
        path.symlink_to(outside / "file")
    elif how == "link outside folder":
        path.symlink_to(outside / "folder")
    elif how == "link inside":
        path.symlink_to(root / inside)
    elif how == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()


def _exercise(root: str) -> tuple[list[Any], bool]:
    """Opens, reads every entry, restores and verifies: what came back, and whether ``verify``
    found the snapshot intact (False also when it could not open it)."""
    values: list[Any] = []
    try:
        snap = Snapshot(root)
        for logical in snap.get_manifest():
            values.append(snap.read_object(logical))
    except SnapshotError:
        pass
    try:
        targets = _fuzz_targets()
        Snapshot(root).restore(targets)
        values.append(targets)
    except SnapshotError:
        pass
    try:
        intact = verify(root, None).ok
    except SnapshotError:
        intact = False
    return values, intact


@pytest.mark.slow
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_random_files_replaced_raise_only_snapshot_errors(template, tmp_path, data):
    source, outside = template
    names = _names(source)
    chosen = data.draw(st.lists(st.sampled_from(names), max_size=3, unique=True), label="replaced")
    root = tmp_path / "work"
    if root.exists():
        shutil.rmtree(root)  # (removes links and FIFOs themselves, never what a link names)
    shutil.copytree(source, root)
    for name in chosen:
        how = data.draw(st.sampled_from(REPLACEMENTS), label=f"{name} becomes")
        inside = data.draw(st.sampled_from([n for n in names if n != name]), label="link to")
        _replace(root, outside, name, how, inside)
    values, intact = _bounded(lambda: _exercise(str(root)))
    for value in values:
        _assert_no_secret(value)
    # Untouched, everything reads back; anything replaced is never taken for the snapshot.
    assert intact == (not chosen)
    if not chosen:
        *entries, restored = values
        assert len(entries) == len(Snapshot(str(root)).get_manifest())
        assert_same(dict(restored["m"]), dict(_fuzz_state()["m"]))
    for name in ("file", "folder/0", "folder/s0", "folder/1"):  # nothing outside was touched
        assert stat.S_ISREG((outside / name).lstat().st_mode), name
        assert (outside / name).read_bytes().startswith(SECRET)
