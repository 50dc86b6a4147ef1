"""Snapshots written by torchsnapshot 0.1.0, opened read-only through the translator
(``snapshot/torchsnapshot_format.py``); DCP checkpoints and torch.save files refused clearly.

The fixture (``tests/data/torchsnapshot-0.1.0``, made by ``tests/data/make_torchsnapshot_fixture.py``
with torchsnapshot itself) holds a one-process snapshot (``single``), a two-rank one
(``two_ranks``: a replicated model, per-rank values, a ShardedTensor) and the values they hold
(``expected.pt``), which every restored value must equal bit for bit. Tests that damage or add to
a snapshot work on a copy in ``tmp_path``.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import io
import json
import os
import shutil
import struct
from typing import Any

import pytest
import torch

import manifest as mf
from manifest import (
    DictEntry,
    ListEntry,
    ObjectEntry,
    PickledTensorEntry,
    PrimitiveEntry,
    ShardedTensorEntry,
    TensorEntry,
)
from snapshot import RNGState, Snapshot, StateDict
from snapshot.cli import main
from snapshot.errors import (
    CorruptSnapshotError,
    IncompatibleSnapshotError,
    SnapshotExistsError,
    SnapshotNotFoundError,
    StateMismatchError,
    UnsafeObjectError,
)
from tests.helpers import assert_same, seal_manifest
from tests.multirank import run_ranks

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "torchsnapshot-0.1.0")
SINGLE = os.path.join(DATA, "single")
TWO_RANKS = os.path.join(DATA, "two_ranks")
METADATA = ".snapshot_metadata"


def _expected() -> dict[str, Any]:
    return torch.load(os.path.join(DATA, "expected.pt"), weights_only=True)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def _raw(path: str) -> dict[str, Any]:
    """The entries of a torchsnapshot manifest, as it wrote them."""
    with open(os.path.join(path, METADATA)) as f:
        return json.load(f)["manifest"]


def _copy(tmp_path, src: str = SINGLE) -> str:
    dst = str(tmp_path / os.path.basename(src))
    shutil.copytree(src, dst)
    return dst


def _tree(root: str) -> dict[str, str]:
    """Every file under ``root`` (relative path -> SHA-256 of its bytes)."""
    found = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                found[os.path.relpath(full, root)] = hashlib.sha256(f.read()).hexdigest()
    return found


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------------------------------------
# Restore and read_object


def test_restore_into_fresh_objects_is_bitwise_equal():
    expected = _expected()["single"]
    model = _model(seed=5)  # other values than the snapshot's
    optim = torch.optim.Adam(model.parameters(), lr=0.5)  # no state yet, another lr
    extra = StateDict()
    Snapshot(SINGLE).restore({"model": model, "optim": optim, "extra": extra})
    assert_same(model.state_dict(), expected["model"])
    assert_same(optim.state_dict(), expected["optim"])  # tensors, tuples, None, bools, floats
    assert_same(dict(extra), expected["extra"])  # nan, -0.0, bytes, a set, an OrderedDict...
    # The optimizer works from the restored state.
    model(torch.randn(2, 4)).sum().backward()
    optim.step()


def test_restore_fills_tensors_in_place_and_casts():
    expected = _expected()["single"]["extra"]
    embedding = torch.zeros(64, 48)  # chunked, raw bytes
    z_big = torch.zeros(640, dtype=torch.complex64)  # chunked, pickled
    z = torch.zeros(2, dtype=torch.complex128)  # pickled, cast on the way in
    extra = StateDict(embedding=embedding, z_big=z_big, z=z)
    Snapshot(SINGLE).restore({"extra": extra})
    assert extra["embedding"] is embedding and extra["z_big"] is z_big and extra["z"] is z
    assert_same(embedding, expected["embedding"])
    assert_same(z_big, expected["z_big"])
    assert torch.equal(z, expected["z"].to(torch.complex128))


def test_read_object_of_chunked_batched_primitive_and_object_entries():
    expected = _expected()["single"]
    snap = Snapshot(SINGLE)
    extra = expected["extra"]
    for key in ("embedding", "small", "mask", "half", "scalar", "z", "z_big"):
        assert_same(snap.read_object(f"0/extra/{key}"), extra[key])
    # Within a small memory budget the chunked tensor is read in tiles, into the given tensor.
    out = torch.empty(64, 48)
    assert snap.read_object("0/extra/embedding", obj_out=out, memory_budget_bytes=1000) is out
    assert_same(out, extra["embedding"])
    for key in ("step", "big_int", "ratio", "nan", "neg_zero", "inf", "name", "flag", "blob"):
        assert_same(snap.read_object(f"0/extra/{key}"), extra[key])
    assert_same(snap.read_object("0/extra/a%2Fb"), 5)
    assert_same(snap.read_object("0/extra/tags"), {1, 2, 3})
    assert_same(snap.read_object("0/extra/pair"), extra["pair"])
    assert_same(snap.read_object("0/extra/nothing"), None)
    assert_same(snap.read_object("0/extra/by_id"), extra["by_id"])  # int keys
    assert_same(snap.read_object("0/extra/ordered"), extra["ordered"])  # an OrderedDict
    assert_same(snap.read_object("0/optim/param_groups"), expected["optim"]["param_groups"])
    assert_same(snap.read_object("0/model/0.weight"), expected["model"]["0.weight"])


def test_get_manifest_lists_the_translated_entries():
    entries = Snapshot(SINGLE).get_manifest()
    raw = _raw(SINGLE)
    assert list(entries) == list(raw)  # one entry per torchsnapshot entry, in its order
    embedding = entries["0/extra/embedding"]
    assert isinstance(embedding, TensorEntry) and embedding.shape == (64, 48)
    # Three row blocks, in order: two files of their own and a range of a batched file.
    blobs = [c.blob for c in embedding.chunks]
    assert blobs[:2] == ["0/extra/embedding_0_0", "0/extra/embedding_22_0"]
    assert blobs[2].startswith("batched/") and embedding.nbytes == 64 * 48 * 4
    assert all(c.crc32 is None for c in embedding.chunks)  # torchsnapshot records none
    small, mask = entries["0/extra/small"], entries["0/extra/mask"]
    assert small.chunks[0].blob == mask.chunks[0].blob  # batched into one file
    assert small.chunks[0].offset + small.nbytes == mask.chunks[0].offset
    assert isinstance(entries["0/extra/half"], TensorEntry)
    assert entries["0/extra/half"].dtype == "bfloat16"
    z, z_big = entries["0/extra/z"], entries["0/extra/z_big"]
    assert isinstance(z, PickledTensorEntry) and len(z.pieces) == 1
    assert isinstance(z_big, PickledTensorEntry) and [p.offsets for p in z_big.pieces] == [
        (0,),
        (320,),
    ]
    tags = entries["0/extra/tags"]
    assert isinstance(tags, ObjectEntry) and (tags.serializer, tags.obj_type) == (
        "torch_save",
        "set",
    )
    assert tags.nbytes == os.path.getsize(os.path.join(SINGLE, "0/extra/tags"))
    assert entries["0/extra/ratio"] == PrimitiveEntry(value=0.1)
    assert entries["0/extra/names"] == ListEntry(length=3)
    assert entries["0/model"] == DictEntry(
        keys=("0.weight", "0.bias", "2.weight", "2.bias"), ordered=True
    )
    assert entries["0/optim/state"] == DictEntry(keys=(0, 1, 2, 3))


def test_two_ranks_replicated_entries_are_under_every_rank_and_shards_merged():
    snap = Snapshot(TWO_RANKS)
    entries = snap.get_manifest()
    raw = _raw(TWO_RANKS)
    assert "1/model/0.weight" not in raw  # torchsnapshot stores replicated entries once
    for key in ("0.weight", "0.bias", "2.weight", "2.bias"):
        zero, one = entries[f"0/model/{key}"], entries[f"1/model/{key}"]
        assert one is zero and one.replicated  # the same bytes, found under rank 1 too
    weight = entries["1/sharded/weight"]
    assert isinstance(weight, ShardedTensorEntry) and weight.shape == (6, 5)
    assert [s.offsets for s in weight.shards] == [(0, 0), (3, 0)]  # both ranks' shards
    assert entries["0/sharded/weight"] is weight
    expected = _expected()["two_ranks"]
    for rank in (0, 1):
        assert_same(snap.read_object(f"{rank}/model/0.weight"), expected[rank]["model"]["0.weight"])
        assert_same(snap.read_object(f"{rank}/local"), expected[rank]["local"])
        assert_same(snap.read_object(f"{rank}/sharded/weight"), expected[rank]["sharded"]["weight"])


def _restore_rank(rank: int, world_size: int, data: str) -> None:
    expected = torch.load(os.path.join(data, "expected.pt"), weights_only=True)["two_ranks"][rank]
    model = _model(seed=99)
    local = StateDict()
    sharded = StateDict(weight=torch.zeros(6, 5))  # the whole global tensor, in place
    Snapshot(os.path.join(data, "two_ranks")).restore(
        {"model": model, "local": local, "sharded": sharded}
    )
    assert_same(model.state_dict(), expected["model"])
    assert_same(dict(local), expected["local"])
    assert_same(sharded["weight"], expected["sharded"]["weight"])


def test_each_rank_of_the_original_world_restores_its_own_state():
    # Rank 1's model is stored once, under rank 0: the translation lets rank 1 find it.
    run_ranks(2, _restore_rank, DATA)


# ---------------------------------------------------------------------------------------------
# The command line


def test_cli_ls(capsys):
    code, out, err = cli(capsys, "ls", SINGLE)
    assert code == 0 and err == ""
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:-1]}
    assert rows["0/extra/embedding"][1:] == ["tensor", "float32", "[64,", "48]", "12.0", "KiB"]
    assert rows["0/extra/half"][1:3] == ["tensor", "bfloat16"]
    assert rows["0/extra/z_big"][1:4] == ["pickled_tensor", "complex64", "[640]"]
    assert rows["0/extra/tags"][1:3] == ["object", "set"]
    assert rows["0/extra/ratio"][1:3] == ["primitive", "float"]
    assert rows["0/extra/names"][1] == "list"
    assert out.splitlines()[-1].startswith("total: 72 entries, 24 tensors, ")
    code, out, _ = cli(capsys, "ls", TWO_RANKS)
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:-1]}
    assert rows["1/model/0.weight"][-1] == "yes" and rows["0/model/0.weight"][-1] == "yes"
    assert rows["1/sharded/weight"][1:4] == ["sharded_tensor", "float32", "[6,"]
    assert "stored (shared and replicated ranges counted once)" in out.splitlines()[-1]


def test_cli_show(capsys):
    code, out, _ = cli(capsys, "show", SINGLE, "0/extra/embedding")
    assert code == 0 and out.splitlines()[:3] == [
        "0/extra/embedding: tensor",
        "  dtype   float32",
        "  shape   [64, 48]",
    ]
    code, out, _ = cli(capsys, "show", SINGLE, "0/extra/z")
    assert code == 0 and "  values  [(1+2j), (3-4j)]" in out.splitlines()
    code, out, _ = cli(capsys, "show", SINGLE, "0/extra/tags")
    assert code == 0 and out.splitlines()[1] == "{1, 2, 3}"
    code, out, _ = cli(capsys, "show", SINGLE, "0/extra/blob")
    assert (code, out) == (0, "0/extra/blob: primitive (bytes, length 7)\nb'\\x00\\xffbytes'\n")


def test_cli_verify_checks_sizes_and_decodes_pickles(capsys, tmp_path):
    code, out, _ = cli(capsys, "verify", SINGLE)
    assert code == 0
    assert (
        "note: checksums were not recorded for 33 of 33 byte ranges (torchsnapshot 0.1.0 records "
        "none): those were checked for size and readability only (and the 8 pickled values "
        "among them by decoding)"
    ) in out.splitlines()
    assert out.splitlines()[-1].startswith("verify: OK: 72 entries, 13 blobs")
    assert cli(capsys, "verify", TWO_RANKS)[0] == 0
    # Damage that sizes alone cannot show: a pickle's bytes changed, its length kept.
    path = _copy(tmp_path)
    with open(os.path.join(path, "0/extra/pair"), "r+b") as f:
        f.seek(0)
        f.write(b"XXXX")  # the zip archive's magic
    # A batched file cut short, and a pickle's file gone.
    batched = Snapshot(path).get_manifest()["0/model/0.weight"].chunks[0].blob
    with open(os.path.join(path, batched), "r+b") as f:
        f.truncate(10)
    os.remove(os.path.join(path, "0/extra/tags"))
    code, out, _ = cli(capsys, "verify", path)
    assert code == 1
    lines = out.splitlines()
    assert any(
        line.startswith("0/extra/pair: blob 0/extra/pair") and "cannot be decoded" in line
        for line in lines
    )
    assert "0/extra/tags: blob 0/extra/tags, bytes [0, 0): the blob is missing" in lines
    assert any(line.startswith(f"blob {batched}") and "cut short" in line for line in lines)


# ---------------------------------------------------------------------------------------------
# Safety: no code from the pickles, nothing written


def _touch(path: str) -> None:  # what a hostile pickle would call, if it were allowed to
    with open(path, "w") as f:
        f.write("ran")


class _Hostile:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (_touch, (self.marker,))


def test_a_pickle_naming_a_disallowed_global_is_refused_and_runs_nothing(capsys, tmp_path):
    path = _copy(tmp_path)
    marker = str(tmp_path / "ran")
    buf = io.BytesIO()
    torch.save(_Hostile(marker), buf)
    with open(os.path.join(path, "0/extra/tags"), "wb") as f:
        f.write(buf.getvalue())  # another length: torchsnapshot records none, the store's is used
    snap = Snapshot(path)
    with pytest.raises(UnsafeObjectError, match=r"0/extra/tags.*_touch.*add_safe_globals"):
        snap.read_object("0/extra/tags")
    with pytest.raises(UnsafeObjectError, match="0/extra/tags"):
        snap.restore({"extra": StateDict()})
    code, out, err = cli(capsys, "show", path, "0/extra/tags")
    assert code == 2 and "refused to load this object" in err
    code, out, _ = cli(capsys, "verify", path)
    assert code == 0 and "note: not decoded, so not checked: 0/extra/tags" in out
    assert not os.path.exists(marker)


def test_a_take_at_a_torchsnapshot_path_is_refused_and_changes_nothing(tmp_path):
    path = _copy(tmp_path)
    before = _tree(path)
    with pytest.raises(SnapshotExistsError, match=r"torchsnapshot snapshot \(.snapshot_metadata\)"):
        Snapshot.take(path, {"x": StateDict(a=torch.ones(3))})
    with pytest.raises(SnapshotExistsError, match="never writes into"):
        Snapshot.async_take(path, {"x": StateDict(a=torch.ones(3))})
    assert _tree(path) == before
    Snapshot(SINGLE).restore({"extra": StateDict()})
    Snapshot(SINGLE).read_object("0/extra/z_big")
    assert _tree(SINGLE) == _tree(path)  # reading wrote nothing either


# ---------------------------------------------------------------------------------------------
# Other formats at a snapshot's path


def test_a_dcp_checkpoint_opens_read_only(capsys, tmp_path):
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "dcp")
    with pytest.warns(UserWarning):  # DCP says it assumes a single process
        dcp.save({"w": torch.ones(3)}, checkpoint_id=path, no_dist=True)
    assert torch.equal(Snapshot(path).read_object("0/w"), torch.ones(3))
    code, out, _ = cli(capsys, "ls", path)
    assert code == 0 and "w" in out
    before = _tree(path)
    with pytest.raises(SnapshotExistsError, match="DCP"):
        Snapshot.take(path, {"x": StateDict(a=1)})
    assert _tree(path) == before


@pytest.mark.parametrize("legacy", [False, True])
def test_a_torch_save_file_is_refused_with_what_to_use(capsys, tmp_path, legacy):
    path = str(tmp_path / "model.pt")
    torch.save({"w": torch.ones(3)}, path, _use_new_zipfile_serialization=not legacy)
    with pytest.raises(IncompatibleSnapshotError) as info:
        Snapshot(path)
    text = str(info.value)
    kind = "legacy format" if legacy else "zip format"
    assert f"{path} is a torch.save file ({kind})" in text
    assert f"torch.load({path!r}, weights_only=True)" in text
    code, _, err = cli(capsys, "verify", path)
    assert code == 2 and "weights_only=True" in err
    # Anything else that is not a snapshot is still simply not one.
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    with pytest.raises(SnapshotNotFoundError, match="no snapshot at"):
        Snapshot(str(other))


# ---------------------------------------------------------------------------------------------
# The translator on damaged or hostile manifests


def _with_manifest(tmp_path, edit) -> str:
    """A copy of the one-process snapshot whose manifest ``edit(doc)`` changed."""
    path = _copy(tmp_path)
    meta = os.path.join(path, METADATA)
    with open(meta) as f:
        doc = json.load(f)
    edit(doc)
    with open(meta, "w") as f:
        json.dump(doc, f)
    return path


def _set(path: str, **fields: Any):
    def edit(doc: dict[str, Any]) -> None:
        doc["manifest"][path].update(fields)

    return edit


@pytest.mark.parametrize(
    ("edit", "error", "message"),
    [
        (_set("0/extra/tags", location="../../outside"), CorruptSnapshotError, "unsafe blob path"),
        (_set("0/extra/tags", location="/etc/passwd"), CorruptSnapshotError, "unsafe blob path"),
        (_set("0/extra/small", byte_range=[0, 5]), CorruptSnapshotError, "needs 12"),
        (_set("0/extra/small", shape=[2, -3]), CorruptSnapshotError, "sizes >= 0"),
        (_set("0/extra/small", dtype="torch.uint16"), IncompatibleSnapshotError, "dtype"),
        (_set("0/extra/small", serializer="pickle"), IncompatibleSnapshotError, "serializer"),
        (_set("0/extra/step", type="complex"), IncompatibleSnapshotError, "unknown entry type"),
        (_set("0/extra/step", serialized_value="7e3"), CorruptSnapshotError, "not an integer"),
        (_set("0/extra/ratio", serialized_value="AAAA"), CorruptSnapshotError, "8 bytes"),
        (_set("0/extra/step", extra=1), CorruptSnapshotError, "unknown ['extra']"),
        (_set("0/extra", keys=["a", "a"]), CorruptSnapshotError, "same child"),
        (lambda d: d.update(world_size=0), CorruptSnapshotError, "world_size"),
        (lambda d: d["manifest"].update({"3/x": {"type": "list"}}), CorruptSnapshotError, "rank 3"),
        (
            lambda d: d["manifest"].update({"0/extra/names/5": d["manifest"]["0/extra/names/0"]}),
            CorruptSnapshotError,
            "numbered 0 to 3",
        ),
    ],
)
def test_damaged_manifests_are_refused_naming_the_snapshot_and_entry(
    tmp_path, edit, error, message
):
    path = _with_manifest(tmp_path, edit)
    with pytest.raises(error) as info:
        Snapshot(path)
    assert path in str(info.value) and message in str(info.value)


def test_a_replicated_entry_under_a_huge_world_is_copied_under_listed_ranks_only(tmp_path):
    def edit(doc: dict[str, Any]) -> None:
        doc["world_size"] = 1 << 40
        doc["manifest"]["0/extra/step"]["replicated"] = True

    snap = Snapshot(_with_manifest(tmp_path, edit))
    entries = snap.get_manifest()
    assert len(entries) == len(_raw(SINGLE)) and all(p.startswith("0/") for p in entries)
    assert snap.read_object("0/extra/step") == _expected()["single"]["extra"]["step"]


def test_a_pickle_of_another_shape_than_recorded_is_refused(tmp_path):
    path = _with_manifest(tmp_path, _set("0/extra/z", shape=[3]))
    with pytest.raises(CorruptSnapshotError, match=r"holds a complex64\[2\] tensor"):
        Snapshot(path).read_object("0/extra/z")


@pytest.mark.filterwarnings("ignore::UserWarning")  # quantized tensors are deprecated in torch
def test_a_quantized_tensor_it_pickled_reads_back_and_refuses_a_float_target(tmp_path):
    """torchsnapshot pickles a quantized tensor (its dtype ``torch.qint8``): ``read_object``
    gives it back; a restore into a float tensor is refused before anything is read, as
    torchsnapshot refuses it."""
    path = _with_manifest(tmp_path, _set("0/extra/z", dtype="torch.qint8"))
    want = torch.quantize_per_tensor(torch.tensor([0.5, -1.0]), 0.25, 2, torch.qint8)
    with open(os.path.join(path, "0/extra/z"), "wb") as f:
        torch.save(want, f)
    got = Snapshot(path).read_object("0/extra/z")
    assert got.dtype == torch.qint8 and torch.equal(got.dequantize(), want.dequantize())
    target = torch.zeros(2)
    with pytest.raises(StateMismatchError, match=r"0/extra/z: the snapshot holds a quantized "):
        Snapshot(path).read_object("0/extra/z", obj_out=target)
    assert torch.equal(target, torch.zeros(2))


def test_floats_and_bytes_decode_exactly():
    entries = Snapshot(SINGLE).get_manifest()
    raw = _raw(SINGLE)
    for key in ("ratio", "nan", "neg_zero", "inf"):
        packed = base64.b64decode(raw[f"0/extra/{key}"]["serialized_value"])
        assert struct.pack("d", entries[f"0/extra/{key}"].value) == packed


def test_primitive_entries_read_as_torchsnapshot_wrote_them(tmp_path):
    """Code written against torchsnapshot's manifest reads our primitive entries: each one's
    ``type``, ``serialized_value``, ``readable`` and ``get_value()`` are what torchsnapshot's
    entry for that value holds (``type`` the value's type name, also ``value_type``). So for the entries translated from its snapshot, and for a snapshot we take of
    the same values."""
    raw = {
        p: e
        for p, e in _raw(SINGLE).items()
        if e["type"] in ("int", "float", "str", "bool", "bytes")
    }
    assert {e["type"] for e in raw.values()} == {"int", "float", "str", "bool", "bytes"}
    extra = _expected()["single"]["extra"]
    ours = Snapshot.take(str(tmp_path / "ours"), {"extra": StateDict(extra)})
    for snap in (Snapshot(SINGLE), ours):
        entries = snap.metadata.manifest
        for path, theirs in raw.items():
            if path not in entries and snap is ours:
                continue  # (the optimizer's entries are in theirs only)
            entry = entries[path]
            assert isinstance(entry, PrimitiveEntry) and entry.tag == "primitive", path
            assert entry.type == entry.value_type == theirs["type"], path
            assert entry.serialized_value == theirs["serialized_value"], path
            assert entry.readable == theirs["readable"], path
            assert entry.replicated == theirs["replicated"], path
            value, stored = entry.get_value(), _value_at(path)
            assert type(value) is type(stored) and repr(value) == repr(stored), path
    assert [p for p in raw if p.startswith("0/extra/") and p in ours.metadata.manifest] == [
        p for p in raw if p.startswith("0/extra/")
    ]


def _value_at(path: str) -> Any:
    """The value the fixture stored at ``path`` (``expected.pt``'s)."""
    value: Any = _expected()["single"]
    for part in path.split("/")[1:]:
        part = part.replace("%2F", "/")
        if isinstance(value, list):
            value = value[int(part)]
        else:
            value = value[part] if part in value else value[int(part)]
    return value


def test_our_manifest_codec_still_refuses_pickled_tensor_entries():
    body = (
        b"format: statesnap\nformat_version: 1\nworld_size: 1\nmetadata: {}\nentries:\n"
        b'  "0/x": {"type": "pickled_tensor", "dtype": "complex64", "shape": [2], "pieces": []}\n'
    )
    with pytest.raises(mf.ManifestDecodeError, match="unknown entry type 'pickled_tensor'"):
        mf.loads(seal_manifest(body))


def test_the_fixture_script_says_how_to_run_it():
    script = os.path.join(os.path.dirname(DATA), "make_torchsnapshot_fixture.py")
    with open(script) as f:
        doc = ast.get_docstring(ast.parse(f.read()))
    assert doc is not None and "torchsnapshot==0.1.0" in doc and "torch==2.13.0" in doc


def test_a_torchsnapshot_rng_state_restores_into_ours():
    expected = _expected()["rng"]
    torch.manual_seed(0)
    Snapshot(os.path.join(DATA, "rng")).restore({"rng": RNGState()})
    assert torch.equal(torch.get_rng_state(), expected)
    draws = torch.rand(4)
    torch.set_rng_state(expected)
    assert torch.equal(draws, torch.rand(4))
