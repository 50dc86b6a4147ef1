"""Every way a call can go wrong raises a SnapshotError subclass naming the path and the key."""

from __future__ import annotations

import errno
import os
import re
import traceback

import pytest
import torch
import yaml

from snapshot import (
    ChecksumError,
    CorruptSnapshotError,
    EntryNotFoundError,
    IncompatibleSnapshotError,
    IncompleteSnapshotError,
    NotStatefulError,
    Options,
    PathNotEmptyError,
    ShapeMismatchError,
    Snapshot,
    SnapshotError,
    SnapshotExistsError,
    SnapshotNotFoundError,
    StateDict,
    StatefulError,
    StateMismatchError,
    StorageError,
    UnsupportedValueError,
)
from tests.helpers import open_decoded, seal_manifest
from tests.plugins import FAULTS, fail_writes, plain_blob


class Broken:
    def __init__(self, fail_save: bool = False, fail_load: bool = False) -> None:
        self.fail_save, self.fail_load = fail_save, fail_load

    def state_dict(self):
        if self.fail_save:
            raise RuntimeError("cannot save me")
        return {"x": torch.ones(3)}

    def load_state_dict(self, sd):
        if self.fail_load:
            raise ValueError("cannot load me")


def files_under(path) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs
    )


def test_non_stateful_value_names_its_key(tmp_path):
    with pytest.raises(NotStatefulError, match=r"s: app_state\['weights'\].*Tensor.*StateDict"):
        Snapshot.take(str(tmp_path / "s"), {"ok": StateDict(), "weights": torch.ones(2)})
    with pytest.raises(NotStatefulError, match="dict of name"):
        Snapshot.take(str(tmp_path / "s"), [StateDict()])
    assert not (tmp_path / "s").exists()  # nothing was written


def test_a_non_stateful_value_is_named_with_its_article_and_what_to_do(tmp_path):
    for value, named in ((3, "an int"), (object(), "an object"), ("x", "a str")):
        with pytest.raises(NotStatefulError) as caught:
            Snapshot.take(str(tmp_path / "s"), {"lr": value})
        message = str(caught.value)
        assert f"app_state['lr'] is {named}," in message, message
        assert "state_dict() and load_state_dict()" in message
        assert "StateDict" in message
    assert not (tmp_path / "s").exists()


def test_a_or_an_follows_the_first_letter():
    from snapshot.errors import a_or_an

    assert [a_or_an(n) for n in ("int", "str", "OrderedDict", "Tensor", "")] == [
        "an int",
        "a str",
        "an OrderedDict",
        "a Tensor",
        "a ",
    ]


def _refusal(call, path) -> tuple[SnapshotExistsError, int]:
    """The error ``call`` raises at ``path`` and how many frames its traceback holds."""
    with pytest.raises(SnapshotExistsError) as caught:
        call(path, {"a": StateDict(x=torch.ones(3))})
    return caught.value, len(traceback.extract_tb(caught.value.__traceback__))


def test_async_take_refuses_a_taken_or_non_empty_path_from_the_call(tmp_path):
    """The error is raised by async_take itself, with take's message, through a traceback of
    the caller's frames and the facade's, not the engine's that found it."""
    taken, crowded = str(tmp_path / "taken"), tmp_path / "crowded"
    Snapshot.take(taken, {"a": StateDict(x=1)})
    crowded.mkdir()
    (crowded / "notes.txt").write_text("mine")
    for path, kind in ((taken, SnapshotExistsError), (str(crowded), PathNotEmptyError)):
        took, took_frames = _refusal(Snapshot.take, path)
        pending, pending_frames = _refusal(Snapshot.async_take, path)
        assert type(took) is type(pending) is kind
        assert str(pending) == str(took) and path in str(pending)
        assert pending.__cause__ is None and pending.__suppress_context__
        assert pending_frames <= 4 and took_frames <= 4, (pending_frames, took_frames)
    assert Snapshot(taken).read_object("0/a/x") == 1
    assert sorted(os.listdir(crowded)) == ["notes.txt"]


def test_take_refuses_an_existing_snapshot(snapshot_url):
    Snapshot.take(snapshot_url, {"a": StateDict(x=1)})
    with pytest.raises(SnapshotExistsError, match=re.escape(snapshot_url.split("://")[-1])):
        Snapshot.take(snapshot_url, {"a": StateDict(x=2)})
    assert Snapshot(snapshot_url).read_object("0/a/x") == 1  # untouched


def test_missing_snapshot(snapshot_url):
    with pytest.raises(SnapshotNotFoundError, match="no snapshot at .*snap"):
        Snapshot(snapshot_url)


def test_interrupted_take_is_incomplete_and_can_be_retaken(faulty):
    url, inner = faulty
    fail_writes(inner, errno.EIO, "disk on fire", lambda path: path == "manifest.yaml")
    with pytest.raises(StorageError, match="manifest.yaml.*disk on fire"):
        Snapshot.take(url, {"a": StateDict(t=torch.arange(10))})
    assert files_under(inner) == []  # the failed take removed its blobs and its marker

    # A take killed outright leaves its marker and blobs: that is an incomplete snapshot.
    FAULTS.pop(inner)  # the disk works again
    Snapshot.take(inner, {"a": StateDict(t=torch.arange(10))})
    os.remove(os.path.join(inner, "manifest.yaml"))
    with open(os.path.join(inner, ".statesnap-pending"), "w") as f:
        f.write("pid 1\n")
    with pytest.raises(IncompleteSnapshotError, match="incomplete snapshot.*replaces them"):
        Snapshot(inner)
    Snapshot.take(inner, {"a": StateDict(t=torch.arange(5))})
    assert torch.equal(Snapshot(inner).read_object("0/a/t"), torch.arange(5))
    assert ".statesnap-pending" not in files_under(inner)


def test_failed_pending_marker_write_fails_the_take(faulty):
    url, inner = faulty
    fail_writes(inner, errno.EROFS, "read-only file system", lambda p: p == ".statesnap-pending")
    with pytest.raises(StorageError, match=r"\.statesnap-pending.*read-only file system"):
        Snapshot.take(url, {"a": StateDict(t=torch.arange(10))})
    pending = Snapshot.async_take(url, {"a": StateDict(t=torch.arange(10))})
    with pytest.raises(StorageError, match=r"\.statesnap-pending.*read-only file system"):
        pending.wait(timeout=60)
    assert files_under(inner) == []  # both removed their blobs; nothing committed


def test_shape_mismatch_names_the_path_and_reads_nothing(recorded):
    url, log = recorded
    Snapshot.take(url, {"m": torch.nn.Linear(4, 3)})
    target = torch.nn.Linear(4, 5)
    before = target.weight.detach().clone()
    snap = Snapshot(url)
    log.clear()
    with pytest.raises(ShapeMismatchError, match=r"0/m/weight.*\[3, 4\].*\[5, 4\]"):
        snap.restore({"m": target})
    assert log.reads == [] and torch.equal(target.weight, before)
    with pytest.raises(ShapeMismatchError, match="0/m/bias"):
        snap.read_object("0/m/bias", obj_out=torch.empty(7))


def test_a_dtype_torch_cannot_cast_into_is_refused_before_reading(recorded):
    """Another dtype is cast into, as load_state_dict does; one copy_ refuses is an error."""
    url, log = recorded
    Snapshot.take(url, {"s": StateDict(t=torch.arange(6.0), q=torch.ones(3))})
    snap = Snapshot(url)
    cast = StateDict(t=torch.zeros(6, dtype=torch.float16), q=torch.zeros(3))
    snap.restore({"s": cast})
    assert torch.equal(cast["t"], torch.arange(6.0).half())
    target = StateDict(t=torch.zeros(6, dtype=torch.bits8), q=torch.zeros(3))
    log.clear()
    with pytest.raises(StateMismatchError, match=r"0/s/t: the snapshot holds float32.*bits8"):
        snap.restore({"s": target})
    assert log.reads == [] and torch.equal(target["q"], torch.zeros(3))


def test_key_absent_from_snapshot(snapshot_url):
    Snapshot.take(snapshot_url, {"model": StateDict(a=1), "optim": StateDict(b=2)})
    with pytest.raises(StateMismatchError, match=r"no app_state key\(s\) \['sched'\].*model"):
        Snapshot(snapshot_url).restore({"model": StateDict(), "sched": StateDict()})


def test_read_object_of_a_missing_path_suggests_close_ones(snapshot_url):
    Snapshot.take(snapshot_url, {"model": StateDict(weight=torch.ones(1))})
    with pytest.raises(EntryNotFoundError, match=r"'0/model/wieght'.*0/model/weight"):
        Snapshot(snapshot_url).read_object("0/model/wieght")
    with pytest.raises(EntryNotFoundError, match="get_manifest"):
        Snapshot(snapshot_url).read_object("nothing-like-it")


def test_state_dict_that_raises_commits_nothing(tmp_path):
    path = tmp_path / "s"
    with pytest.raises(StatefulError, match=r"app_state\['bad'\]\.state_dict\(\).*cannot save me"):
        Snapshot.take(str(path), {"good": StateDict(x=1), "bad": Broken(fail_save=True)})
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(str(path))


def test_load_state_dict_that_raises(snapshot_url):
    Snapshot.take(snapshot_url, {"obj": Broken()})
    with pytest.raises(StatefulError, match=r"app_state\['obj'\]\.load_state_dict\(\).*load me"):
        Snapshot(snapshot_url).restore({"obj": Broken(fail_load=True)})


def test_structure_that_contains_itself(snapshot_url):
    loop = [1]
    loop.append(loop)
    with pytest.raises(
        UnsupportedValueError, match=r"snapshot .*snap: 0/s/x/1: the structure contains itself"
    ):
        Snapshot.take(snapshot_url, {"s": StateDict(x=loop)})


class _Opaque:
    """A user class: its pickle names it, which the safe loader refuses unless allowed."""

    def __init__(self, n: int) -> None:
        self.n = n


def test_a_value_restore_would_refuse_fails_the_take(snapshot_url):
    # The take fails, naming the snapshot, the key, the type and what to call; nothing is
    # committed. async_take refuses it at the call (its capture runs there).
    state = {"s": StateDict(ok=torch.ones(3), cfg=_Opaque(1))}
    expected = (
        r"snapshot .*snap: 0/s/cfg: a restore would refuse this tests\.test_errors\._Opaque: "
        r".*add_safe_globals\(\[tests\.test_errors\._Opaque\]\) before take and restore"
    )
    with pytest.raises(UnsupportedValueError, match=expected):
        Snapshot.take(snapshot_url, state)
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(snapshot_url)
    with pytest.raises(UnsupportedValueError, match=expected):
        Snapshot.async_take(snapshot_url, state)
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(snapshot_url)


def test_tensor_without_data(snapshot_url):
    with pytest.raises(UnsupportedValueError, match=r"snapshot .*snap: 0/s/w.*meta device"):
        Snapshot.take(snapshot_url, {"s": StateDict(w=torch.empty(3, device="meta"))})
    with pytest.raises(UnsupportedValueError, match=r"snapshot .*snap: 0/s/w.*meta device"):
        Snapshot.async_take(snapshot_url, {"s": StateDict(w=torch.empty(3, device="meta"))})
    Snapshot.take(snapshot_url, {"s": StateDict(w=torch.ones(3))})
    with pytest.raises(UnsupportedValueError, match=r"snapshot .*snap: 0/s/w.*meta"):
        Snapshot(snapshot_url).restore({"s": StateDict(w=torch.empty(3, device="meta"))})


def test_prepare_func_errors_name_the_path(snapshot_url):
    def bad(path, t, tracing):
        raise ValueError("nope")

    with pytest.raises(
        SnapshotError, match=r"snapshot .*snap: 0/s/w.*_custom_tensor_prepare_func raised.*nope"
    ):
        Snapshot.take(
            snapshot_url, {"s": StateDict(w=torch.ones(3))}, _custom_tensor_prepare_func=bad
        )

    def inconsistent(path, t, tracing):
        return t if tracing else t.double()

    with pytest.raises(UnsupportedValueError, match="0/s/w.*both calls must agree"):
        Snapshot.take(
            snapshot_url,
            {"s": StateDict(w=torch.ones(3))},
            _custom_tensor_prepare_func=inconsistent,
        )


def test_storage_errors_on_open(tmp_path):
    with pytest.raises(StorageError, match=r"no storage plugin for nosuch://"):
        Snapshot.take("nosuch://bucket/x", {"s": StateDict()})
    with pytest.raises(StorageError, match="unknown storage_options.*colour"):
        Snapshot.take(str(tmp_path / "s"), {"s": StateDict()}, storage_options={"colour": 1})
    (tmp_path / "file").write_text("a file, not a directory")
    # The marker and the blobs are written at once: whichever fails first is reported.
    with pytest.raises(StorageError, match="failed to write .*file.*(File exists|Not a dir)"):
        Snapshot.take(str(tmp_path / "file"), {"s": StateDict(t=torch.ones(2))})


def test_write_failure_commits_nothing_and_cleans_up(faulty, tmp_path):
    url, inner = faulty
    earlier = str(tmp_path / "earlier")  # on the same disk, taken before the disk "fills up"
    Snapshot.take(earlier, {"s": StateDict(t=torch.arange(7))})
    fail_writes(inner, errno.ENOSPC, "No space left on device", lambda path: path == "0/s0")
    state = StateDict({f"t{i}": torch.full((100,), i) for i in range(8)})
    with pytest.raises(
        StorageError,
        match=r"0/s/t0 and 7 more \(slab 0/(?:[0-9a-f]{8}-)?s0\).*0/(?:[0-9a-f]{8}-)?s0.*No space left",
    ):
        Snapshot.take(url, {"s": state})
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(inner)
    assert files_under(inner) == []
    assert torch.equal(Snapshot(earlier).read_object("0/s/t"), torch.arange(7))


# ---------------------------------------------------------------------------------------------
# Damaged snapshots.


def _take_simple(path: str) -> None:
    Snapshot.take(path, {"s": StateDict(t=torch.arange(8.0), o={1, 2}, n=3)})


def _edit_manifest(path: str, edit) -> None:
    """Edits the manifest as a document and writes it back with a matching checksum line (as a
    forger would), so that the decoder's checks are what is tested."""
    file = os.path.join(path, "manifest.yaml")
    with open(file) as f:
        doc = yaml.safe_load(f)
    edit(doc)
    with open(file, "wb") as f:
        f.write(seal_manifest(yaml.safe_dump(doc).encode()))


@pytest.mark.parametrize(
    "damage, error, pattern",
    [
        (lambda d: d.update(format_version=99), IncompatibleSnapshotError, "version 99.*upgrade"),
        (
            lambda d: d["entries"]["0/s/t"].update(type="hologram"),
            CorruptSnapshotError,
            "0/s/t: unknown entry type 'hologram'",
        ),
        (
            lambda d: d["entries"]["0/s/t"].update(shape="big"),
            CorruptSnapshotError,
            "0/s/t: shape must be a list",
        ),
        (
            lambda d: d["entries"]["0/s/t"].pop("dtype"),
            CorruptSnapshotError,
            r"0/s/t: tensor entry: missing fields \['dtype'\]",
        ),
        (
            lambda d: d["entries"]["0/s/t"].update(chunks=[["../../etc/passwd", 0, 32]]),
            CorruptSnapshotError,
            "0/s/t: unsafe blob path '../../etc/passwd'",
        ),
        (
            lambda d: d["entries"]["0/s/t"].update(chunks=[["/etc/passwd", 0, 32]]),
            CorruptSnapshotError,
            "unsafe blob path",
        ),
        (
            lambda d: d["entries"]["0/s/n"].update(value="three"),
            CorruptSnapshotError,
            "0/s/n: value 'three' is not of type int",
        ),
        (lambda d: d.pop("entries"), CorruptSnapshotError, "entries missing"),
        (
            lambda d: d["entries"].pop("0/s/t"),
            CorruptSnapshotError,
            "0/s/t: listed by its parent but missing",
        ),
    ],
    ids=[
        "future-version",
        "unknown-type",
        "bad-shape",
        "missing-field",
        "path-escape",
        "absolute-path",
        "bad-primitive",
        "no-entries",
        "missing-child",
    ],
)
def test_damaged_manifest(tmp_path, damage, error, pattern):
    path = str(tmp_path / "s")
    _take_simple(path)
    _edit_manifest(path, damage)
    with pytest.raises(error, match=pattern):
        Snapshot(path).restore({"s": StateDict()})


def test_opening_checks_what_needs_no_decoding_and_the_entries_are_decoded_on_first_use(tmp_path):
    """A manifest's checksum line and header are checked when the snapshot is opened; a forged
    manifest (its checksum matching) whose entries are damaged opens, and every use of them
    raises."""
    path = str(tmp_path / "s")
    _take_simple(path)
    file = os.path.join(path, "manifest.yaml")
    with open(file, "rb") as f:
        original = f.read()
    with open(file, "wb") as f:
        f.write(original[:-20] + b"X" + original[-19:])  # the checksum no longer matches
    with pytest.raises(ChecksumError):
        Snapshot(path)
    body = original[: original.rindex(b"# crc32")]
    with open(file, "wb") as f:
        f.write(seal_manifest(body.replace(b"format_version: 1", b"format_version: 99")))
    with pytest.raises(IncompatibleSnapshotError, match="format version 99"):
        Snapshot(path)
    with open(file, "wb") as f:
        f.write(original)
    _edit_manifest(path, lambda d: d["entries"]["0/s/t"].update(shape="wide"))
    snap = Snapshot(path)
    for use in (
        lambda: snap.restore({"s": StateDict()}),
        snap.get_manifest,
        lambda: snap.read_object("0/s/n"),
        lambda: snap.metadata,
    ):
        with pytest.raises(CorruptSnapshotError, match="0/s/t.*shape"):
            use()


@pytest.mark.parametrize(
    "content, pattern",
    [
        (b"\x00\xff garbage {[", "not valid YAML"),
        (b"", "not a statesnap manifest"),
        (
            b"format: statesnap\nformat_version: 1\nworld_size: 1\nentries:\n  0/s: {type: di",
            "not valid YAML",
        ),
    ],
    ids=["garbage", "empty", "truncated"],
)
def test_garbled_manifest(tmp_path, content, pattern):
    path = str(tmp_path / "s")
    _take_simple(path)
    with open(os.path.join(path, "manifest.yaml"), "wb") as f:
        f.write(seal_manifest(content))
    with pytest.raises(CorruptSnapshotError, match=f"manifest.yaml.*{pattern}"):
        open_decoded(path)


def test_unknown_dtype_and_inconsistent_sizes(tmp_path):
    path = str(tmp_path / "s")
    _take_simple(path)
    _edit_manifest(path, lambda d: d["entries"]["0/s/t"].update(dtype="float128"))
    with pytest.raises(IncompatibleSnapshotError, match="0/s/t: dtype 'float128' is unknown"):
        Snapshot(path).read_object("0/s/t")
    _edit_manifest(path, lambda d: d["entries"]["0/s/t"].update(dtype="float64"))
    with pytest.raises(CorruptSnapshotError, match=r"0/s/t: manifest records 32 bytes.*needs 64"):
        Snapshot(path).read_object("0/s/t")


def test_missing_and_short_blobs(tmp_path):
    path = str(tmp_path / "s")
    _take_simple(path)
    entry = Snapshot(path).get_manifest()["0/s/t"]
    blob = os.path.join(path, entry.chunks[0].blob)
    with open(blob, "r+b") as f:
        f.truncate(10)
    with pytest.raises(
        CorruptSnapshotError, match=r"0/s/o and 1 more: blob .*0/(?:[0-9a-f]{8}-)?s0 is shorter"
    ):
        Snapshot(path).restore({"s": StateDict()})
    os.remove(blob)
    with pytest.raises(
        CorruptSnapshotError, match=r"0/s/t: blob .*0/(?:[0-9a-f]{8}-)?s0 is missing"
    ):
        Snapshot(path).read_object("0/s/t")
    obj = Snapshot(path).get_manifest()["0/s/o"]
    with open(os.path.join(path, obj.location.blob), "wb") as f:
        f.write(b"x" * (obj.location.offset + obj.nbytes))
    with pytest.raises(ChecksumError, match="0/s/o: checksum mismatch"):
        Snapshot(path).read_object("0/s/o")
    # Unchecked, the decoder itself refuses the bytes.
    with pytest.raises(CorruptSnapshotError, match="0/s/o: object bytes cannot be decoded"):
        Snapshot(path).read_object("0/s/o", options=Options(checksums=False))


@pytest.mark.parametrize("pooled", [False, True])
def test_a_take_whose_entries_fail_removes_what_it_wrote(recorded, monkeypatch, pooled):
    """Entries are made once the writes are done: an error there fails the take (no write is
    left running), and everything they wrote is removed."""
    from snapshot._engine.take.plan import TakePlan

    url, log = recorded
    root = url.removeprefix("recording://")

    def broken(self, checksums):
        raise RuntimeError("cannot format the entries")

    monkeypatch.setattr(TakePlan, "entries", broken)
    state = StateDict({f"b{i}": torch.full((1024,), float(i)) for i in range(10)})
    # Async take reports it, as every error of its background part, as a SnapshotError.
    with pytest.raises(SnapshotError if pooled else RuntimeError, match="cannot format the"):
        if pooled:
            Snapshot.async_take(url, {"s": state}).wait()
        else:
            Snapshot.take(url, {"s": state})
    assert any(
        "/s" in plain_blob(blob) for blob, _ in log.writes
    )  # the slab was written, then removed
    assert [f for _, _, files in os.walk(root) for f in files] == []


@pytest.mark.parametrize("pooled", [False, True])
def test_a_take_that_fails_while_planning_writes_nothing(recorded, pooled):
    """Planning starts no I/O: a value that fails while the state is planned fails the take
    before any blob is written (the slabs planned before it included), and the pending marker
    is removed (no manifest, no marker, nothing left)."""
    url, log = recorded
    root = url.removeprefix("recording://")

    def slab_written() -> bool:
        return any("/s" in plain_blob(blob) for blob, _ in log.writes)

    def prepare(path, t, tracing):
        if path.endswith("zz") and tracing:
            raise ValueError(f"cannot prepare zz; a slab written: {slab_written()}")
        return t

    state = StateDict({f"b{i:02d}": torch.full((4096,), float(i)) for i in range(40)})
    state["zz"] = torch.ones(3)  # planned last
    take = Snapshot.async_take if pooled else Snapshot.take
    options = Options(slab_bytes=64 * 1024, write_batch_bytes=1)
    with pytest.raises(SnapshotError, match="cannot prepare zz; a slab written: False"):
        take(url, {"s": state}, _custom_tensor_prepare_func=prepare, options=options)
    assert [f for _, _, files in os.walk(root) for f in files] == []


def test_a_store_that_lists_answers_the_path_checks_with_one_listing(
    tmp_path, monkeypatch, recorded
):
    """Local disk lists its folder: the take asks for no marker file one by one, and still
    refuses a DCP checkpoint's folder. A store that cannot list (``recording://`` forwards no
    listing) is asked for each marker, and refuses the same folder."""
    from storage_plugins.fs import FSStoragePlugin

    asked: list[str] = []
    exists = FSStoragePlugin.exists

    async def counted(self, path):
        asked.append(path)
        return await exists(self, path)

    monkeypatch.setattr(FSStoragePlugin, "exists", counted)
    Snapshot.take(str(tmp_path / "new"), {"a": StateDict(x=1)})
    markers = {"manifest.yaml", ".metadata", ".snapshot_metadata"}
    assert not markers & set(asked)
    dcp = tmp_path / "snap"  # (where ``recorded`` records)
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"x")
    for url in (str(dcp), recorded[0]):
        asked.clear()
        with pytest.raises(SnapshotExistsError, match=r"torch.distributed.checkpoint"):
            Snapshot.take(url, {"a": StateDict(x=1)})
        assert (set(asked) == markers) == url.startswith("recording://"), asked
    assert os.listdir(dcp) == [".metadata"]
