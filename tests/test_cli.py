"""The command line: ``statesnap ls / show / verify / du / diff`` (and ``--storage-option``).

Most tests call ``snapshot.cli.main`` in process and read what it printed; one runs
``python -m snapshot`` and one the installed ``statesnap`` script. Damaged snapshots are made the
way ``test_checksums`` makes them: a byte flipped inside one entry's range, a blob cut short,
grown, or removed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Sequence
from typing import Any

import pytest
import torch

import manifest as mf
from manifest import DictEntry, Location, Manifest, TensorEntry
from snapshot import Options, Snapshot, StateDict
from snapshot._engine.tools.inspection import PIECE_BYTES, summarize_tensor
from snapshot._engine.tools.output import human_bytes
from snapshot._engine.tools.verify import verify
from snapshot.cli import _storage_option, main, storage_options_from
from storage_plugins import register_storage_plugin, unregister_storage_plugin
from storage_plugins.fs import FSStoragePlugin

MANIFEST = "manifest.yaml"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state(**overrides: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    tensors = {
        "w": torch.arange(12.0).reshape(3, 4),
        "ids": torch.arange(100_000, dtype=torch.int64),  # 800,000 bytes: several chunks
        "mask": torch.tensor([True, False, True]),
        "half": torch.full((5,), 1.5, dtype=torch.bfloat16),
        "z": torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64),
        "odd": torch.tensor([1.0, float("nan"), -2.0, float("inf")]),
    }
    extra = {
        "step": 7,
        "ratio": 0.5,
        "name": "run",
        "nothing": None,
        "names": ["a", "b"],
        "nested": {"k": (1, [2, 3])},
        "tags": {3, 4},  # an object (torch.save)
        "text": "t" * 5000,  # a long str: a blob of its own
    }
    tensors.update({k: v for k, v in overrides.items() if isinstance(v, torch.Tensor)})
    extra.update({k: v for k, v in overrides.items() if not isinstance(v, torch.Tensor)})
    return {
        "model": torch.nn.Linear(4, 2),
        "s": StateDict(**tensors),
        "extra": StateDict(**extra),
    }


# Small chunks and slabs, so that a snapshot has many blobs: chunks of ``ids`` of their own, the
# small tensors together in a slab.
LAYOUT = Options(chunk_bytes=131072, slab_threshold_bytes=4096)


def _take(path: str, *, options: Options = LAYOUT, **overrides: Any) -> str:
    Snapshot.take(path, _state(**overrides), options=options)
    return path


@pytest.fixture
def snap(tmp_path) -> str:
    return _take(str(tmp_path / "snap"))


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """``statesnap argv...`` in process: (exit code, stdout, stderr)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _manifest(path: str) -> Manifest:
    from snapshot._engine.format.manifest_io import load_manifest

    return load_manifest(path, None)


def _location(path: str, logical: str, index: int = 0) -> Location:
    return _manifest(path).entries[logical].locations[index]


def _flip(path: str, loc: Location, at: int = 1) -> None:
    """Flips the bits of one byte, ``at`` bytes into ``loc``."""
    with open(os.path.join(path, loc.blob), "r+b") as f:
        f.seek(loc.offset + at)
        byte = f.read(1)
        f.seek(loc.offset + at)
        f.write(bytes([byte[0] ^ 0xFF]))


def _problem_lines(out: str) -> list[str]:
    return [
        line
        for line in out.splitlines()
        if not line.startswith(("note:", "verify:")) and line.strip()
    ]


def _named(lines: Sequence[str]) -> set[str]:
    """The logical paths that problem lines start with."""
    return {line.split(": blob ")[0] for line in lines if ": blob " in line}


# ---------------------------------------------------------------------------------------------
# ls


def test_ls_shows_every_entry_with_kind_dtype_shape_and_size(capsys, snap):
    code, out, err = run(capsys, "ls", snap)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["PATH", "KIND", "DTYPE", "SHAPE", "SIZE"]
    rows = {line.split()[0]: line for line in lines[1:-1]}
    entries = _manifest(snap).entries
    assert list(rows) == list(entries)  # one row per entry, in manifest order
    assert rows["0/s/w"].split() == ["0/s/w", "tensor", "float32", "[3,", "4]", "48", "B"]
    assert rows["0/s/ids"].split()[1:] == ["tensor", "int64", "[100000]", "781.2", "KiB"]
    assert rows["0/s/half"].split()[1:3] == ["tensor", "bfloat16"]
    assert rows["0/s/mask"].split()[1:3] == ["tensor", "bool"]
    assert rows["0/extra/tags"].split()[1:3] == ["object", "set"]
    assert rows["0/extra/text"].split()[1:3] == ["object", "str"]
    assert rows["0/extra/step"].split()[1:3] == ["primitive", "int"]
    assert rows["0/extra/nothing"].split()[1:3] == ["primitive", "None"]
    assert rows["0/extra/nested"].split()[1] == "dict"
    assert rows["0/extra/nested/k"].split()[1] == "tuple"
    assert rows["0/extra/nested/k/1"].split()[1] == "list"
    total_bytes = sum(e.nbytes for e in entries.values())
    tensors = sum(isinstance(e, TensorEntry) for e in entries.values())
    assert lines[-1] == (
        f"total: {len(entries)} entries, {tensors} tensors, {human_bytes(total_bytes)} "
        f"({total_bytes:,} bytes)"
    )


def test_ls_prefix_and_exact_bytes(capsys, snap):
    code, out, _ = run(capsys, "ls", snap, "--prefix", "0/s", "--bytes")
    assert code == 0
    paths = [line.split()[0] for line in out.splitlines()[1:-1]]
    assert paths[0] == "0/s" and all(p.startswith("0/s/") for p in paths[1:])
    assert len(paths) == 7
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:-1]}
    assert rows["0/s/ids"] == ["0/s/ids", "tensor", "int64", "[100000]", "800000"]
    total = sum(e.nbytes for p, e in _manifest(snap).entries.items() if p.startswith("0/s"))
    assert out.splitlines()[-1] == f"total: 7 entries, 6 tensors, {total}"
    code, out, err = run(capsys, "ls", snap, "--prefix", "s")
    assert (code, out) == (2, "")
    assert err == "statesnap: error: no entry at or below 's'; close matches: 0/s\n"


def test_human_bytes():
    assert [human_bytes(n) for n in (0, 1023, 1024, 10 * 1024, 3 << 30, 5 << 50)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "10.0 KiB",
        "3.0 GiB",
        "5.0 PiB",
    ]


def _two_rank_manifest() -> Manifest:
    """A manifest as two ranks take it: each rank's own optimizer state, and a model marked
    replicated whose bytes (written once, by rank 1) both ranks' entries point at."""
    entries: dict[str, mf.Entry] = {}
    for rank in (0, 1):
        entries[f"{rank}/model"] = DictEntry(keys=("w",), replicated=True)
        entries[f"{rank}/model/w"] = TensorEntry(
            dtype="float32",
            shape=(256, 4),
            chunks=(Location(blob="1/r0", offset=0, nbytes=4096, crc32=123),),
            replicated=True,
        )
        entries[f"{rank}/optim"] = DictEntry(keys=("m",))
        entries[f"{rank}/optim/m"] = TensorEntry(
            dtype="float16",
            shape=(100 * (rank + 1),),
            chunks=(Location(blob=f"{rank}/0", offset=0, nbytes=200 * (rank + 1), crc32=1),),
        )
    return Manifest(world_size=2, entries=entries, metadata={})


def test_ls_and_du_of_a_two_rank_manifest_read_no_blob(capsys, tmp_path):
    # Only the manifest exists: ls and du answer from it alone.
    path = tmp_path / "two"
    path.mkdir()
    (path / MANIFEST).write_bytes(mf.dumps(_two_rank_manifest()))
    code, out, err = run(capsys, "ls", str(path))
    assert code == 0 and err == ""
    assert out.splitlines()[0].split() == ["PATH", "KIND", "DTYPE", "SHAPE", "SIZE", "REPLICATED"]
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:-1]}
    assert rows["1/model/w"] == [
        "1/model/w",
        "tensor",
        "float32",
        "[256,",
        "4]",
        "4.0",
        "KiB",
        "yes",
    ]
    assert rows["1/optim/m"] == ["1/optim/m", "tensor", "float16", "[200]", "400", "B"]
    assert out.splitlines()[-1] == (
        "total: 8 entries, 4 tensors, 8.6 KiB (8,792 bytes); 4.6 KiB stored "
        "(shared and replicated ranges counted once)"
    )
    code, out, _ = run(capsys, "du", str(path), "--bytes")
    assert code == 0
    rows = [line.split() for line in out.splitlines()[1:3]]
    assert rows == [
        ["0", "model", "2", "4096", "4096", "46.6%"],
        ["1", "model", "2", "4096", "4096", "46.6%"],
    ]
    assert "per rank: rank 0 4296, rank 1 4496" in out
    assert out.splitlines()[-1] == (
        "total: 8 entries, 8792; 4696 stored (replicated entries and shared tensors counted once)"
    )


# ---------------------------------------------------------------------------------------------
# du


def test_du_rows_add_up_to_the_entries_bytes(capsys, snap):
    code, out, err = run(capsys, "du", snap, "--bytes")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["RANK", "KEY", "ENTRIES", "SIZE", "REPLICATED", "SHARE"]
    rows = [line.split() for line in lines[1:-1]]
    entries = _manifest(snap).entries
    expected = {
        key: sum(e.nbytes for p, e in entries.items() if p.split("/")[1] == key)
        for key in ("model", "s", "extra")
    }
    assert {r[1]: int(r[3]) for r in rows} == expected
    sizes = [int(r[3]) for r in rows]
    assert sizes == sorted(sizes, reverse=True)  # largest first
    assert sum(int(r[2]) for r in rows) == len(entries)
    total = sum(e.nbytes for e in entries.values())
    assert lines[-1] == f"total: {len(entries)} entries, {total}"


# ---------------------------------------------------------------------------------------------
# show


def _fields(out: str) -> dict[str, str]:
    return {
        line.split(None, 1)[0]: line.split(None, 1)[1]
        for line in out.splitlines()[1:]
        if len(line.split(None, 1)) == 2
    }


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        (
            "0/s/w",
            {
                "dtype": "float32",
                "shape": "[3, 4]",
                "numel": "12",
                "min": "0.0",
                "max": "11.0",
                "mean": "5.5",
                "values": "[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, ... (4 more)]",
            },
        ),
        (
            "0/s/ids",
            {"dtype": "int64", "numel": "100,000", "min": "0", "max": "99999", "mean": "49999.5"},
        ),
        (
            "0/s/mask",
            {"dtype": "bool", "min": "False", "max": "True", "mean": "n/a"},
        ),
        (
            "0/s/half",
            {"dtype": "bfloat16", "min": "1.5", "max": "1.5", "mean": "1.5"},
        ),
        (
            "0/s/z",
            {"dtype": "complex64", "min": "n/a", "max": "n/a", "mean": "(2-1j)"},
        ),
        (
            "0/s/odd",
            {"min": "-2.0", "max": "1.0", "mean": "-0.5", "nan/inf": "2 (min, max and mean "},
        ),
    ],
)
def test_show_tensor_summary(capsys, snap, key, expected):
    code, out, err = run(capsys, "show", snap, key)
    assert code == 0 and err == ""
    assert out.splitlines()[0] == f"{key}: tensor"
    fields = _fields(out)
    for name, value in expected.items():
        assert fields[name].startswith(value), (name, fields[name])


def test_summaries_of_every_dtype_never_raise():
    from snapshot._engine.format.serialization import DTYPES
    from tests.helpers import random_tensor

    for name, dtype in DTYPES.items():
        if name.startswith(("qint", "quint")):
            continue  # from random bytes they are not valid quantized tensors
        try:
            t = random_tensor(dtype, (6,))
        except Exception:  # dtypes without storage of their own (bits8, int4...)
            continue
        s = summarize_tensor(t)
        assert (s.dtype, s.shape, s.numel) == (name, (6,), 6)
        if dtype == torch.uint64:  # no min/max kernel; int64 would wrap: better nothing
            assert s.min is None and s.values == t.tolist()
    s = summarize_tensor(torch.empty(0, 3))
    assert (s.numel, s.min, s.mean, s.values) == (0, None, None, [])
    s = summarize_tensor(torch.tensor([float("nan"), float("inf")]))
    assert (s.min, s.mean, s.nonfinite) == (None, None, 2)


def test_show_other_values(capsys, snap):
    code, out, _ = run(capsys, "show", snap, "0/extra/tags")
    assert code == 0
    assert out.splitlines() == [
        "0/extra/tags: object (set, length 2, " + _stored(snap) + ")",
        "{3, 4}",
    ]
    code, out, _ = run(capsys, "show", snap, "0/extra/step")
    assert (code, out) == (0, "0/extra/step: primitive (int)\n7\n")
    code, out, _ = run(capsys, "show", snap, "0/extra/nested")
    assert (code, out) == (0, "0/extra/nested: dict (length 1)\n{'k': (1, [2, 3])}\n")
    code, out, _ = run(capsys, "show", snap, "0/extra/names")
    assert (code, out) == (0, "0/extra/names: list (length 2)\n['a', 'b']\n")
    # A long repr is cut, and says by how much.
    code, out, _ = run(capsys, "show", snap, "0/extra/text", "--max-chars", "20")
    assert code == 0
    assert out.splitlines()[1] == "'" + "t" * 19 + f"... ({5002 - 20:,} more characters)"


def _stored(path: str) -> str:
    return f"{human_bytes(_manifest(path).entries['0/extra/tags'].nbytes)} stored"


def test_show_of_a_missing_key_lists_close_matches(capsys, snap):
    code, out, err = run(capsys, "show", snap, "0/s/ww")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("statesnap: error: ") and "has no entry '0/s/ww'" in err
    assert "close matches: 0/s/w" in err
    # Without the rank: the rank-0 path is the first suggestion.
    code, _, err = run(capsys, "show", snap, "s/ids")
    assert code == 2 and "close matches: 0/s/ids" in err


# ---------------------------------------------------------------------------------------------
# verify


def test_verify_an_intact_snapshot(capsys, snap):
    code, out, err = run(capsys, "verify", snap)
    assert code == 0
    assert err == ""  # not a terminal: no progress
    manifest = _manifest(snap)
    blobs = len(manifest.blob_sizes)
    assert blobs >= 8  # chunks of ids, the slab, the text
    ranges = len({(c.blob, c.offset) for e in manifest.entries.values() for c in e.locations})
    assert out.splitlines() == [
        f"verify: OK: {len(manifest.entries)} entries, {blobs} blobs, "
        f"{human_bytes(sum(manifest.blob_sizes.values()))} read, {ranges} checksums checked"
    ]


@pytest.mark.parametrize(
    ("logical", "chunk"), [("0/s/w", 0), ("0/s/ids", 3), ("0/extra/tags", 0), ("0/extra/text", 0)]
)
def test_verify_names_the_entry_with_a_flipped_byte_and_only_it(capsys, snap, logical, chunk):
    loc = _location(snap, logical, chunk)
    _flip(snap, loc, at=loc.nbytes // 2)
    code, out, err = run(capsys, "verify", snap)
    assert code == 1 and err == ""
    problems = _problem_lines(out)
    assert problems == [
        f"{logical}: blob {loc.blob}, bytes [{loc.offset}, {loc.offset + loc.nbytes}): "
        f"checksum mismatch: the manifest records crc32 {loc.crc32:#010x}, the bytes read have "
        + problems[0].rsplit(" ", 1)[1]
    ]
    assert out.splitlines()[-1].startswith("verify: FAILED: 1 problem in 1 blob, 1 entry affected")


def test_verify_a_truncated_blob(capsys, snap):
    loc = _location(snap, "0/s/ids", 2)
    with open(os.path.join(snap, loc.blob), "r+b") as f:
        f.truncate(loc.offset + 1000)
    code, out, _ = run(capsys, "verify", snap)
    assert code == 1
    problems = _problem_lines(out)
    assert _named(problems) == {"0/s/ids"}
    assert any("fewer than the manifest records" in p and "cut short" in p for p in problems)
    assert (
        f"0/s/ids: blob {loc.blob}, bytes [{loc.offset}, {loc.offset + loc.nbytes}): cut off" in out
    )


def test_verify_a_grown_blob(capsys, snap):
    loc = _location(snap, "0/extra/text")
    with open(os.path.join(snap, loc.blob), "ab") as f:
        f.write(b"more")
    code, out, _ = run(capsys, "verify", snap)
    assert code == 1
    end = loc.offset + loc.nbytes
    assert _problem_lines(out) == [
        f"blob {loc.blob}, bytes [{end}, {end + 4}): the blob is {end + 4:,} bytes, 4 more than "
        f"the manifest records ({end:,}): bytes were added after the take, or the blob was "
        "replaced"
    ]


def test_verify_a_deleted_blob_and_keeps_going(capsys, snap):
    gone = _location(snap, "0/s/ids", 1)
    os.remove(os.path.join(snap, gone.blob))
    flipped = _location(snap, "0/s/w")
    _flip(snap, flipped)
    code, out, _ = run(capsys, "verify", snap)
    assert code == 1
    problems = _problem_lines(out)
    assert f"0/s/ids: blob {gone.blob}, bytes [0, {gone.nbytes}): the blob is missing" in problems
    assert any(
        p.startswith(f"0/s/w: blob {flipped.blob}") and "checksum mismatch" in p for p in problems
    )
    assert len(problems) == 2


def test_verify_without_recorded_checksums_checks_sizes(capsys, tmp_path):
    path = _take(str(tmp_path / "snap"), options=LAYOUT.replace(checksums=False))
    code, out, _ = run(capsys, "verify", path)
    assert code == 0
    assert "note: checksums were not recorded for" in out and "size and readability only" in out
    assert out.splitlines()[-1].endswith("0 checksums checked")
    # A flipped byte cannot be seen without checksums; a short blob still is.
    _flip(path, _location(path, "0/s/w"))
    assert run(capsys, "verify", path)[0] == 0
    loc = _location(path, "0/s/ids", 0)
    with open(os.path.join(path, loc.blob), "r+b") as f:
        f.truncate(10)
    code, out, _ = run(capsys, "verify", path)
    assert code == 1 and _named(_problem_lines(out)) == {"0/s/ids"}


class _Reads(FSStoragePlugin):
    """Local storage that logs each read (blob, offset, length), and may hide blob sizes."""

    log: list[tuple[str, int, int]] = []
    hide_sizes = False

    async def read_into(self, path, offset, out):
        self.log.append((path, offset, len(out)))
        await super().read_into(path, offset, out)

    async def readv_observed(self, path, offset, outs, observe):
        self.log.append((path, offset, sum(len(o) for o in outs)))
        await super().readv_observed(path, offset, outs, observe)

    async def size(self, path):
        return None if self.hide_sizes else await super().size(path)


@pytest.fixture
def reads(tmp_path):
    def factory(url: str, options: dict[str, Any] | None) -> _Reads:
        return _Reads(url.removeprefix("reads://"), options)

    register_storage_plugin("reads", factory)
    _Reads.log = []
    _Reads.hide_sizes = False
    try:
        yield f"reads://{tmp_path / 'snap'}"
    finally:
        unregister_storage_plugin("reads")


def test_verify_reads_every_blob_once_in_bounded_pieces(reads):
    local = reads.removeprefix("reads://")
    _take(local)
    assert PIECE_BYTES == 16 << 20
    sizes = _manifest(local).blob_sizes
    _Reads.log.clear()
    report = verify(reads, None, jobs=3, piece_bytes=10_000)
    assert report.ok and report.bytes_read == sum(sizes.values())
    assert max(n for _, _, n in _Reads.log) <= 10_000
    for blob, size in sizes.items():
        pieces = sorted((o, n) for b, o, n in _Reads.log if b == blob)
        assert [o for o, _ in pieces] == list(range(0, size, 10_000))  # each byte once
        assert sum(n for _, n in pieces) == size
    # A range read in many pieces: their CRCs combine into the range's.
    loc = _location(local, "0/s/ids", 0)
    assert loc.nbytes > 5 * 10_000
    _flip(local, loc, at=loc.nbytes - 3)
    report = verify(reads, None, jobs=3, piece_bytes=10_000)
    assert [(p.paths, p.blob, p.start) for p in report.problems] == [
        (("0/s/ids",), loc.blob, loc.offset)
    ]


def test_verify_lets_an_error_of_its_own_checks_surface(tmp_path, monkeypatch):
    """A bug in verify's checks is raised, not reported as a blob that cannot be read."""
    from snapshot._engine.tools import verify as verify_module

    path = _take(str(tmp_path / "snap"))

    def broken(data: Any, value: int = 0) -> int:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(verify_module, "crc32", broken)
    with pytest.raises(ZeroDivisionError, match="a bug"):
        verify(path, None)


def test_verify_when_the_store_cannot_tell_sizes(capsys, reads):
    local = reads.removeprefix("reads://")
    _take(local)
    _Reads.hide_sizes = True
    loc = _location(local, "0/extra/text")
    with open(os.path.join(local, loc.blob), "ab") as f:
        f.write(b"grown")  # unnoticed without sizes
    code, out, _ = run(capsys, "verify", reads)
    assert code == 0
    assert "note: size not checked for" in out and "the store cannot tell their size" in out
    # Cut short: the read finds it.
    with open(os.path.join(local, loc.blob), "r+b") as f:
        f.truncate(loc.offset + 10)
    code, out, _ = run(capsys, "verify", reads)
    assert code == 1 and _named(_problem_lines(out)) == {"0/extra/text"}
    assert "the blob ends before this range does" in out


def test_a_damaged_manifest_is_exit_1_without_traceback(capsys, snap):
    manifest = os.path.join(snap, MANIFEST)
    with open(manifest, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0x01
        f.seek(0)
        f.write(data)
    for command in ("verify", "ls", "du"):
        code, out, err = run(capsys, command, snap)
        assert code == 1 and out == ""
        assert err.startswith("statesnap: error: ") and "is damaged" in err
        assert err.count("\n") == 1


def test_no_snapshot_is_exit_2_and_verbose_shows_the_traceback(capsys, tmp_path):
    here = str(tmp_path)
    for argv in (["ls", here], ["verify", here], ["show", here, "0/x"], ["diff", here, here]):
        code, out, err = run(capsys, *argv)
        assert (code, out) == (2, "")
        assert err == f"statesnap: error: no snapshot at {tmp_path} (no {MANIFEST} there)\n"
    code, _, err = run(capsys, "-v", "ls", str(tmp_path))
    assert code == 2 and "Traceback" in err and "SnapshotNotFoundError" in err


def test_usage_errors_are_exit_2(capsys):
    assert run(capsys, "ls")[0] == 2
    assert run(capsys, "verify", "x", "--jobs", "0")[0] == 2
    code, out, _ = run(capsys, "--help")
    assert code == 0 and all(c in out for c in ("demo", "ls", "show", "verify", "du", "diff"))
    code, out, _ = run(capsys, "demo", "--help")
    assert code == 0 and "--steps" in out and "--path" in out


def test_memory_urls_work_like_local_paths(capsys):
    url = f"memory://{uuid.uuid4().hex}/snap"
    _take(url)
    assert run(capsys, "verify", url)[0] == 0
    code, out, _ = run(capsys, "ls", url)
    assert code == 0 and "0/s/ids" in out


# ---------------------------------------------------------------------------------------------
# Progress


def test_progress_goes_to_a_terminal_only(capsys, snap, monkeypatch):
    assert run(capsys, "verify", snap)[2] == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, out, err = run(capsys, "verify", snap)
    assert code == 0
    blobs = len(_manifest(snap).blob_sizes)
    # A tqdm bar over the bytes, the blobs counted after it; the last count always shows.
    assert "\rverify: 100%|" in err and f"{blobs}/{blobs} blobs]" in err
    last = err.rsplit("\r", 2)
    assert last[-1] == "" and last[-2].strip() == ""  # and the line is cleared before the report
    assert "verify: OK" in out and "\r" not in out
    # --json: no bar, even on a terminal.
    code, out, err = run(capsys, "verify", snap, "--json")
    assert (code, err) == (0, "") and out.startswith("{")


def test_diff_progress_when_it_reads(capsys, tmp_path, monkeypatch):
    unchecked = LAYOUT.replace(checksums=False)
    a, b = (
        _take(str(tmp_path / "a"), options=unchecked),
        _take(str(tmp_path / "b"), options=unchecked),
    )
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, _, err = run(capsys, "diff", a, b)
    assert code == 0 and "\rdiff: " in err and " entries]" in err


# ---------------------------------------------------------------------------------------------
# diff


def _diff_lines(out: str) -> list[list[str]]:
    """The difference lines, each split into its words."""
    return [line.split(None, 2) for line in out.splitlines()[2:-1]]


def test_diff_of_identical_snapshots(capsys, tmp_path):
    a, b = _take(str(tmp_path / "a")), _take(str(tmp_path / "b"))
    code, out, err = run(capsys, "diff", a, b)
    assert code == 0 and err == ""
    assert out.splitlines() == [
        f"A: {a}",
        f"B: {b}",
        f"identical: {len(_manifest(a).entries)} entries",
    ]


def test_diff_names_a_changed_tensor_value(capsys, tmp_path):
    a = _take(str(tmp_path / "a"))
    w = torch.arange(12.0).reshape(3, 4)
    w[2, 1] = -1
    b = _take(str(tmp_path / "b"), w=w)
    code, out, _ = run(capsys, "diff", a, b)
    assert code == 1
    assert _diff_lines(out) == [["bytes", "0/s/w:", _diff_lines(out)[0][2]]]
    assert "contents differ (crc32 0x" in out
    assert out.splitlines()[-1].startswith("1 difference (A: ")


def test_diff_names_an_added_key(capsys, tmp_path):
    a = _take(str(tmp_path / "a"))
    b = _take(str(tmp_path / "b"), extra_t=torch.ones(2))
    code, out, _ = run(capsys, "diff", a, b)
    assert code == 1
    assert [line[0] for line in _diff_lines(out)] == ["keys", "only"]
    assert "0/s: removed [], added ['extra_t']" in out
    assert re.search(r"^only in B  0/s/extra_t$", out, re.M)


def test_diff_names_a_changed_dtype_and_value(capsys, tmp_path):
    a = _take(str(tmp_path / "a"))
    b = _take(str(tmp_path / "b"), w=torch.arange(12.0, dtype=torch.float64).reshape(3, 4), step=8)
    code, out, _ = run(capsys, "diff", a, b)
    assert code == 1
    assert re.search(r"^dtype +0/s/w: float32 -> float64$", out, re.M)
    assert re.search(r"^value +0/extra/step: 7 -> 8$", out, re.M)
    assert len(_diff_lines(out)) == 2


def test_diff_without_checksums_reads_and_compares_bytes(capsys, tmp_path):
    unchecked = LAYOUT.replace(checksums=False)
    a = _take(str(tmp_path / "a"), options=unchecked)
    other_chunks = unchecked.replace(chunk_bytes=100000)  # other chunk boundaries in B
    b = _take(str(tmp_path / "b"), options=other_chunks)
    ids = torch.arange(100_000, dtype=torch.int64)
    ids[70_000] = -1
    c = _take(str(tmp_path / "c"), options=other_chunks, ids=ids)
    code, out, _ = run(capsys, "diff", a, b)
    assert code == 0 and "identical" in out and "compared by reading their bytes" in out
    code, out, _ = run(capsys, "diff", a, c)
    assert code == 1
    assert _diff_lines(out) == [["bytes", "0/s/ids:", f"contents differ from byte {70_000 * 8:,}"]]


# ---------------------------------------------------------------------------------------------
# --storage-option


def test_storage_option_values_and_dotted_keys():
    pairs = [
        _storage_option(t)
        for t in (
            "anon=true",
            "retries=3",
            "ratio=0.5",
            "endpoint_url=http://localhost:9000",
            "client_kwargs.region_name=us-east-1",
            "client_kwargs.verify=false",
            'config_kwargs={"connect_timeout": 5}',
            'quoted="3"',
            "empty=",
        )
    ]
    assert storage_options_from(pairs) == {
        "anon": True,
        "retries": 3,
        "ratio": 0.5,
        "endpoint_url": "http://localhost:9000",
        "client_kwargs": {"region_name": "us-east-1", "verify": False},
        "config_kwargs": {"connect_timeout": 5},
        "quoted": "3",
        "empty": "",
    }
    assert storage_options_from([]) is None


class _Options(FSStoragePlugin):
    seen: list[dict[str, Any] | None] = []

    def __init__(self, url: str, options: dict[str, Any] | None = None) -> None:
        self.seen.append(options)
        super().__init__(url.removeprefix("opts://"), None)


def test_storage_options_reach_every_command(capsys, tmp_path):
    register_storage_plugin("opts", _Options)
    try:
        url = f"opts://{tmp_path / 'snap'}"
        _take(url)
        expected = {"client_kwargs": {"region_name": "us-east-1"}, "anon": False}
        for argv in (
            ["ls", url],
            ["du", url],
            ["show", url, "0/s/w"],
            ["verify", url],
            ["diff", url, url],
        ):
            _Options.seen = []
            code, _, err = run(
                capsys,
                "--storage-option",
                "client_kwargs.region_name=us-east-1",
                *argv,
                "--storage-option",
                "anon=false",
            )
            assert (code, err) == (0, ""), argv
            assert _Options.seen and all(s == expected for s in _Options.seen), argv
    finally:
        unregister_storage_plugin("opts")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["novalue"], "expected KEY=VALUE"),
        (["=1"], "expected KEY=VALUE"),
        (["a..b=1"], "expected KEY=VALUE"),
        (["a=1", "a.b=2"], "given a value and also the sub-key a.b"),
        (["a.b=2", "a=1"], "given a value and also sub-keys"),
    ],
)
def test_bad_storage_options_are_usage_errors(capsys, tmp_path, options, message):
    argv = [a for o in options for a in ("--storage-option", o)]
    code, out, err = run(capsys, *argv, "ls", str(tmp_path))
    assert (code, out) == (2, "")
    assert message in err


def test_a_storage_option_the_plugin_refuses_is_exit_2(capsys, snap):
    code, _, err = run(capsys, "--storage-option", "bogus=1", "ls", snap)
    assert code == 2
    assert err.startswith("statesnap: error: cannot open storage") and "bogus" in err


# ---------------------------------------------------------------------------------------------
# As a program


@pytest.mark.slow
def test_python_m_snapshot_ls(snap):
    result = subprocess.run(
        [sys.executable, "-m", "snapshot", "ls", snap],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert "0/s/ids" in result.stdout and result.stdout.splitlines()[-1].startswith("total: ")


@pytest.mark.slow
def test_the_statesnap_console_script(snap):
    script = os.path.join(os.path.dirname(sys.executable), "statesnap")
    if not os.path.exists(script):
        pytest.skip(f"no statesnap script next to {sys.executable} (package not installed)")
    _flip(snap, _location(snap, "0/s/half"))
    result = subprocess.run([script, "verify", snap], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert result.stdout.startswith("0/s/half: blob ")
    assert result.stderr == ""


def test_s3_snapshots_through_storage_option_flags(capsys, s3_bucket):
    """Every command against a snapshot on S3 (moto's server on loopback), the endpoint and
    credentials given as ``--storage-option`` flags, as a user reaching a private store would."""
    url = s3_bucket.url()
    Snapshot.take(url, _state(), storage_options=s3_bucket.storage_options)
    flags = [
        f"--storage-option={k}={v}"
        for k, v in s3_bucket.storage_options.items()
        if k != "client_kwargs"
    ]
    flags.append(
        f"--storage-option=client_kwargs.region_name={s3_bucket.storage_options['client_kwargs']['region_name']}"
    )
    code, out, _ = run(capsys, *flags, "ls", url)
    assert code == 0 and "0/s/w" in out and "float32" in out
    code, out, _ = run(capsys, *flags, "show", url, "0/s/w")
    assert code == 0 and "[3, 4]" in out
    assert run(capsys, *flags, "verify", url)[0] == 0
    assert run(capsys, *flags, "diff", url, url)[0] == 0

    # One byte of the tensor 0/s/w changed in place on the server: verify names it.
    import boto3

    loc = Snapshot(url, storage_options=s3_bucket.storage_options).get_manifest()["0/s/w"].chunks[0]
    opts = s3_bucket.storage_options
    client = boto3.client(
        "s3",
        endpoint_url=opts["endpoint_url"],
        aws_access_key_id=opts["key"],
        aws_secret_access_key=opts["secret"],
        region_name=opts["client_kwargs"]["region_name"],
    )
    key = f"snap/{loc.blob}"
    data = bytearray(client.get_object(Bucket=s3_bucket.name, Key=key)["Body"].read())
    data[loc.offset + 5] ^= 0xFF
    client.put_object(Bucket=s3_bucket.name, Key=key, Body=bytes(data))
    code, out, _ = run(capsys, *flags, "verify", url)
    assert code == 1
    assert [line.split(":")[0] for line in _problem_lines(out)] == ["0/s/w"]


def test_sharded_entries_in_ls_show_verify_and_diff(capsys, tmp_path):
    from snapshot.sharding import ShardedTensor

    g = torch.arange(24.0).reshape(6, 4)
    halves = StateDict(
        a=ShardedTensor.from_rank_offsets("w", g[:3].clone(), (0, 0, 2)),
        b=ShardedTensor.from_rank_offsets("w", g[3:].clone(), (0, 1, 2)),
    )
    whole = StateDict(a=ShardedTensor.from_rank_offsets("w", g.clone()), b=3)
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    Snapshot.take(two, {"m": halves})
    Snapshot.take(one, {"m": whole})
    code, out, _ = run(capsys, "ls", two)
    row = next(line for line in out.splitlines() if line.startswith("0/m/a"))
    assert code == 0 and "sharded_tensor" in row and "float32" in row and "[6, 4]" in row
    code, out, _ = run(capsys, "show", two, "0/m/b")
    assert code == 0 and "[6, 4]" in out and "23" in out  # the whole global tensor
    assert run(capsys, "verify", two)[0] == 0
    code, out, _ = run(capsys, "diff", two, one)
    assert code == 1
    assert "0/m/a" in out and "2 shards -> 1 shards" in out
    assert "0/m/b" in out  # a sharded tensor in one, a primitive in the other
