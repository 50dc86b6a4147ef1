"""Export keeps the library's promises: an export never mixes with an earlier one in its folder
(it is put in place whole, or refused, and a failure leaves the earlier export loadable), names
the safetensors format reserves are refused before writing, and a forged manifest is refused
by restore's own checks before anything is allocated or written."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import snapshot.export as engine
from snapshot import (
    CorruptSnapshotError,
    IncompatibleSnapshotError,
    InvalidArgumentError,
    Snapshot,
    StateDict,
    StorageError,
    UnsupportedValueError,
)
from snapshot.export import export
from snapshot.sharding import ShardedTensor
from tests.helpers import seal_manifest

MANIFEST = "manifest.yaml"


def load_export(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors export in ``folder``, as a loader finds it: through the
    index when there is one (each file it names loaded whole), else ``model.safetensors``."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        tensors: dict[str, torch.Tensor] = {}
        for name in sorted(set(weight_map.values())):
            part = load_file(str(folder / name))
            assert {k for k, v in weight_map.items() if v == name} == set(part), name
            tensors.update(part)
        return tensors
    return load_file(str(folder / "model.safetensors"))


def model_files(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith("model"))


def take(path: Path, seed: int, n: int = 4) -> dict[str, torch.Tensor]:
    """A snapshot of ``n`` tensors of 4 KiB each under the key ``m``; returns them."""
    g = torch.Generator().manual_seed(seed)
    tensors = {f"layer{i}": torch.randn(32, 32, generator=g) for i in range(n)}
    Snapshot.take(str(path), {"m": StateDict(**tensors)})
    return tensors


def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


# ---------------------------------------------------------------------------------------------
# An export never mixes with the one before it.


@pytest.fixture
def two(tmp_path):
    """Two snapshots of different tensors: ``a`` (4 tensors) and ``b`` (2)."""
    return (
        (str(tmp_path / "a"), take(tmp_path / "a", 1, 4)),
        (str(tmp_path / "b"), take(tmp_path / "b", 2, 2)),
    )


def test_an_export_into_a_folder_holding_one_is_refused_naming_the_option(tmp_path, two):
    (a, want_a), (b, _) = two
    out = tmp_path / "out"
    export(a, out, key="m", max_shard_size=5000)
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    with pytest.raises(InvalidArgumentError) as caught:
        export(b, out, key="m")
    message = str(caught.value)
    assert str(out) in message and "overwrite" in message
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
    assert same(load_export(out), want_a)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (5000, 5000),  # 4 files, then 2 files: fewer shards than before
        (5000, "5GB"),  # sharded, then one file
        ("5GB", 5000),  # one file, then sharded
    ],
)
def test_overwrite_replaces_the_earlier_export_whole(tmp_path, two, first, second):
    (a, want_a), (b, want_b) = two
    out = tmp_path / "out"
    (out / "config.json").parent.mkdir()
    (out / "config.json").write_text("{}")  # the user's own file, beside the export
    export(a, out, key="m", max_shard_size=first)
    assert same(load_export(out), want_a)
    files = export(b, out, key="m", max_shard_size=second, overwrite=True)
    assert sorted(os.path.basename(f) for f in files) == model_files(out)
    assert same(load_export(out), want_b)
    assert (out / "config.json").read_text() == "{}"
    assert not [n for n in os.listdir(out) if n.startswith(".statesnap-export-")]
    # And back.
    export(a, out, key="m", max_shard_size=first, overwrite=True)
    assert same(load_export(out), want_a)
    assert sorted(os.listdir(out)) == sorted(
        ["config.json", ".statesnap-export.json", *model_files(out)]
    )


def test_a_failure_on_the_nth_file_leaves_the_earlier_export_whole(tmp_path, two, monkeypatch):
    (a, _), (b, want_b) = two
    out = tmp_path / "out"
    export(b, out, key="m", max_shard_size=5000)  # 2 files and the index
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    real = engine.stream_tensor
    calls = []

    def failing(plugin, source, *args, **kwargs):
        calls.append(source.name)
        if len(calls) == 3:  # the third file of four
            raise OSError(28, "No space left on device")
        return real(plugin, source, *args, **kwargs)

    monkeypatch.setattr(engine, "stream_tensor", failing)
    with pytest.raises(StorageError, match="No space left") as caught:
        export(a, out, key="m", max_shard_size=5000, overwrite=True)
    assert str(out) in str(caught.value)
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
    assert same(load_export(out), want_b)


def test_a_damaged_snapshot_leaves_the_earlier_export_whole(tmp_path, two):
    """The new export's second tensor unreadable (a flipped byte): a ChecksumError, and the
    folder as it was."""
    (a, _), (b, want_b) = two
    out = tmp_path / "out"
    export(b, out, key="m")
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    blob = next(p for p in sorted((Path(a) / "0").iterdir()))
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 1
    blob.write_bytes(bytes(data))
    with pytest.raises(CorruptSnapshotError):
        export(a, out, key="m", max_shard_size=5000, overwrite=True)
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
    assert same(load_export(out), want_b)


def test_a_failure_while_putting_the_files_in_place_is_undone(tmp_path, two, monkeypatch):
    """A rename that fails after some of the new files are in place: every move is undone."""
    (a, _), (b, want_b) = two
    out = tmp_path / "out"
    export(b, out, key="m", max_shard_size=5000)
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    real = os.rename
    moved = []

    def rename(src, dst, *args, **kwargs):
        moved.append(dst)
        if len(moved) == 6:
            raise OSError(5, "Input/output error")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(engine.os, "rename", rename)
    with pytest.raises(StorageError, match="Input/output"):
        export(a, out, key="m", max_shard_size=5000, overwrite=True)
    monkeypatch.undo()
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
    assert same(load_export(out), want_b)


def test_overwrite_replaces_only_files_an_export_recorded_writing(tmp_path, two):
    """Files named like an export's that no export recorded (a save_pretrained's, an older
    export's), or that are links, are never replaced: the export is refused, naming them."""
    (a, _), (b, _) = two
    out = tmp_path / "out"
    out.mkdir()
    (out / "pytorch_model.bin").write_bytes(b"the user's")
    with pytest.raises(InvalidArgumentError, match="pytorch_model.bin") as caught:
        export(a, out, key="m", overwrite=True)
    assert str(out) in str(caught.value)
    assert (out / "pytorch_model.bin").read_bytes() == b"the user's"
    (out / "pytorch_model.bin").unlink()
    export(a, out, key="m")
    # A forged record naming the user's file: only export names are ever taken from it.
    (out / "notes.txt").write_text("mine")
    record = json.loads((out / ".statesnap-export.json").read_text())
    record["files"].append("notes.txt")
    (out / ".statesnap-export.json").write_text(json.dumps(record))
    export(b, out, key="m", overwrite=True)
    assert (out / "notes.txt").read_text() == "mine"
    # A recorded name that is now a link: refused, the link and its target left alone.
    target = tmp_path / "elsewhere.safetensors"
    target.write_bytes(b"not ours")
    (out / "model.safetensors").unlink()
    (out / "model.safetensors").symlink_to(target)
    with pytest.raises(InvalidArgumentError, match="model.safetensors"):
        export(a, out, key="m", overwrite=True)
    assert (out / "model.safetensors").is_symlink() and target.read_bytes() == b"not ours"
    # A record that is a link: refused, even into a folder with no export files.
    other = tmp_path / "other"
    other.mkdir()
    (other / ".statesnap-export.json").symlink_to(target)
    with pytest.raises(InvalidArgumentError, match="statesnap-export.json"):
        export(a, other, key="m")
    assert os.listdir(other) == [".statesnap-export.json"] and target.read_bytes() == b"not ours"


def test_a_failed_export_into_a_new_folder_leaves_nothing(tmp_path, two, monkeypatch):
    (a, _), _ = two
    monkeypatch.setattr(engine, "stream_tensor", _interrupt)
    with pytest.raises(KeyboardInterrupt):
        export(a, tmp_path / "new" / "out", key="m")
    assert not (tmp_path / "new").exists()  # nor the parent the export made


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def test_torch_format_is_replaced_whole_too(tmp_path, two):
    (a, _), (b, want_b) = two
    out = tmp_path / "out"
    export(a, out, key="m", format="torch", max_shard_size=5000)
    export(b, out, key="m", format="torch", overwrite=True)
    assert sorted(n for n in os.listdir(out) if not n.startswith(".")) == ["pytorch_model.bin"]
    assert same(torch.load(out / "pytorch_model.bin", weights_only=True), want_b)


# ---------------------------------------------------------------------------------------------
# Names the format reserves.


def test_a_tensor_named_metadata_is_refused_before_writing(tmp_path):
    Snapshot.take(
        str(tmp_path / "s"), {"m": StateDict(__metadata__=torch.ones(2), w=torch.zeros(3))}
    )
    with pytest.raises(UnsupportedValueError, match="__metadata__") as caught:
        export(str(tmp_path / "s"), tmp_path / "out", key="m")
    assert "0/m/__metadata__" in str(caught.value)
    assert not (tmp_path / "out").exists()
    # The torch format has no such reserved name.
    got = torch.load(
        export(str(tmp_path / "s"), tmp_path / "t", key="m", format="torch")[0], weights_only=True
    )
    assert torch.equal(got["__metadata__"], torch.ones(2))


def test_a_name_that_becomes_metadata_after_renaming_is_refused(tmp_path):
    Snapshot.take(
        str(tmp_path / "s"),
        {"m": StateDict(**{"module.__metadata__": torch.ones(2), "module.w": torch.zeros(3)})},
    )
    with pytest.raises(UnsupportedValueError, match="__metadata__"):
        export(str(tmp_path / "s"), tmp_path / "out", key="m", strip_prefix="module.")
    assert not (tmp_path / "out").exists()
    # Two entries that become one name: refused too, naming both.
    Snapshot.take(
        str(tmp_path / "d"), {"m": StateDict(**{"module.w": torch.zeros(3), "w": torch.ones(3)})}
    )
    with pytest.raises(InvalidArgumentError, match="0/m/module.w and 0/m/w"):
        export(str(tmp_path / "d"), tmp_path / "out", key="m", strip_prefix="module.")
    assert not (tmp_path / "out").exists()


def test_a_header_past_the_safetensors_limit_is_refused(tmp_path, monkeypatch):
    """safetensors refuses headers over 100,000,000 bytes: such a file is never written."""
    take(tmp_path / "s", 0)
    monkeypatch.setattr(engine, "MAX_HEADER_BYTES", 200)
    with pytest.raises(UnsupportedValueError, match="max_shard_size"):
        export(str(tmp_path / "s"), tmp_path / "out", key="m")
    assert not (tmp_path / "out").exists()
    files = export(str(tmp_path / "s"), tmp_path / "out", key="m", max_shard_size=4096)
    assert len(files) == 5  # a file per tensor: each header within the limit


def test_a_name_that_is_not_utf8_is_refused(tmp_path):
    take(tmp_path / "s", 0, 1)
    body = (tmp_path / "s" / MANIFEST).read_text()
    body = body[: body.rindex("# crc32")].replace('"0/m/layer0"', '"0/m/bad\\ud800"')
    (tmp_path / "s" / MANIFEST).write_bytes(seal_manifest(body.encode()))
    with pytest.raises(UnsupportedValueError, match="not valid UTF-8") as caught:
        export(str(tmp_path / "s"), tmp_path / "out", key="m")
    assert "0/m/bad\\ud800" in str(caught.value)  # shown escaped: the message prints
    str(caught.value).encode("utf-8")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# A forged manifest: restore's checks, before anything is allocated or written.


def _hostile_base(path: Path) -> None:
    """A dense 16x16 float32 ``0/m/w`` and a sharded ``0/m/s`` of two 8-row shards."""
    full = torch.arange(256.0).reshape(16, 16)
    Snapshot.take(
        str(path),
        {
            "m": StateDict(
                w=full.clone(),
                s=ShardedTensor.from_rank_offsets("s", full[:8].clone(), (0, 0, 2)),
                t=ShardedTensor.from_rank_offsets("s", full[8:].clone(), (0, 1, 2)),
            )
        },
    )


def _entry(body: str, key: str) -> str:
    return next(line for line in body.splitlines() if line.startswith(f'  "{key}":'))


def _dense(shape: str, chunks: str, dtype: str = "float32") -> str:
    return (
        f'  "0/m/w": {{"type": "tensor", "dtype": "{dtype}", "shape": {shape}, "chunks": {chunks}}}'
    )


def _forge(body: str, case: str) -> str:
    w = _entry(body, "0/m/w")
    blob = re.search(r'"chunks": \[\["([^"]+)", (\d+)', w)
    assert blob is not None
    name, off = blob.group(1), int(blob.group(2))
    s = _entry(body, "0/m/s")
    if case == "chunks short of the shape":
        new = _dense("[32, 16]", f'[["{name}", {off}, 1024]]')
    elif case == "chunks past the shape":
        new = _dense("[8, 16]", f'[["{name}", {off}, 1024]]')
    elif case == "a chunk of part elements":
        new = _dense("[16, 16]", f'[["{name}", {off}, 2], ["{name}", {off + 2}, 1022]]')
    elif case == "a 1 TiB claim over a short blob":
        new = _dense("[274877906944]", f'[["{name}", {off}, 1099511627776]]')
    elif case == "one row of 1 TiB":
        new = _dense("[1, 274877906944]", f'[["{name}", {off}, 1099511627776]]')
    elif case == "2**31 rows of a short blob":
        new = _dense("[2147483648, 1]", f'[["{name}", {off}, 8589934592]]')
    elif case == "an offset past the blob":
        new = _dense("[16, 16]", f'[["{name}", {off + 10**9}, 1024]]')
    elif case == "ranges repeated":
        new = _dense("[1024, 16]", "[" + ", ".join([f'["{name}", {off}, 1024]'] * 64) + "]")
    elif case == "an unknown dtype":
        new = _dense("[16, 16]", f'[["{name}", {off}, 1024]]', dtype="float99")
    elif case == "a negative size":
        new = _dense("[-16, -16]", f'[["{name}", {off}, 1024]]')
    elif case == "shards that overlap and leave a gap":
        new = s.replace('"offsets": [8, 0]', '"offsets": [0, 0]')
    elif case == "a shard missing":
        new = re.sub(r', \{"offsets": \[8, 0\][^}]*\}', "", s)
    elif case == "a shard short of its bytes":
        new = re.sub(r"(\"sizes\": \[8, 16\], \"chunks\": \[\[\"[^\"]+\", \d+), 512", r"\1, 256", s)
    elif case == "a shape the shards do not fill":
        new = s.replace('"shape": [16, 16]', '"shape": [17, 16]')
    else:
        raise AssertionError(case)
    assert new != (s if "shard" in case else w), case
    return body.replace(s if "shard" in case else w, new)


HOSTILE = {
    "chunks short of the shape": CorruptSnapshotError,
    "chunks past the shape": CorruptSnapshotError,
    "a chunk of part elements": CorruptSnapshotError,
    "a 1 TiB claim over a short blob": CorruptSnapshotError,
    "one row of 1 TiB": CorruptSnapshotError,
    "2**31 rows of a short blob": CorruptSnapshotError,
    "an offset past the blob": CorruptSnapshotError,
    "ranges repeated": CorruptSnapshotError,
    "an unknown dtype": IncompatibleSnapshotError,
    "a negative size": CorruptSnapshotError,
    "shards that overlap and leave a gap": CorruptSnapshotError,
    "a shard missing": CorruptSnapshotError,
    "a shard short of its bytes": CorruptSnapshotError,
    "a shape the shards do not fill": CorruptSnapshotError,
}


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_forged_manifest_is_refused_before_anything_is_allocated(tmp_path, case, fmt):
    path = tmp_path / "s"
    _hostile_base(path)
    body = (path / MANIFEST).read_text()
    (path / MANIFEST).write_bytes(
        seal_manifest(_forge(body[: body.rindex("# crc32")], case).encode())
    )
    out = tmp_path / "out"
    with pytest.raises(HOSTILE[case]) as caught:
        export(str(path), out, key="m", format=fmt)
    assert type(caught.value) is HOSTILE[case], caught.value
    assert str(path) in str(caught.value)
    assert not out.exists()  # refused before the folder was made


def test_the_unforged_base_exports(tmp_path):
    _hostile_base(tmp_path / "s")
    got = load_file(export(str(tmp_path / "s"), tmp_path / "out", key="m")[0])
    full = torch.arange(256.0).reshape(16, 16)
    assert torch.equal(got["w"], full) and torch.equal(got["s"], full)


def test_the_command_refuses_a_folder_holding_an_export_unless_overwrite(tmp_path, two, capsys):
    from snapshot.cli import EXIT_ERROR, EXIT_OK, main

    (a, want_a), (b, want_b) = two
    out = str(tmp_path / "out")
    assert main(["export", a, out, "--key", "m"]) == EXIT_OK
    assert main(["export", b, out, "--key", "m"]) == EXIT_ERROR
    assert "--overwrite" in capsys.readouterr().err
    assert same(load_export(Path(out)), want_a)
    assert main(["export", b, out, "--key", "m", "--overwrite"]) == EXIT_OK
    assert same(load_export(Path(out)), want_b)
