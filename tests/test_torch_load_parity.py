"""Values read into no target come back as ``torch.load`` gives them: tied tensors as one
storage, views as views of it, ``nn.Parameter`` and ``requires_grad`` as they were; and a
manifest that forges those records is refused."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import yaml

import manifest as mf
from snapshot import CorruptSnapshotError, Snapshot, StateDict
from snapshot._engine.tools.inspection import disk_usage, list_entries
from snapshot._engine.tools.verify import diff, verify
from tests.helpers import raw_bytes, seal_manifest
from tests.multirank import run_ranks

# -- the states ------------------------------------------------------------------------------


class _Tied(torch.nn.Module):
    """An embedding whose output layer is the same Parameter (tied weights)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def _tied_dict() -> dict[str, Any]:
    w = torch.randn(4, 3)
    return {"emb": w, "head": w}


def _tied_module() -> dict[str, Any]:
    return dict(_Tied().state_dict())  # detached: two objects over one storage


def _tied_module_vars() -> dict[str, Any]:
    return dict(_Tied().state_dict(keep_vars=True))  # the same Parameter under both keys


def _parameters() -> dict[str, Any]:
    return {
        "on": torch.nn.Parameter(torch.randn(3)),
        "off": torch.nn.Parameter(torch.randn(3), requires_grad=False),
        "ints": torch.nn.Parameter(torch.arange(4), requires_grad=False),
    }


def _requires_grad() -> dict[str, Any]:
    leaf = torch.randn(5, requires_grad=True)
    return {"leaf": leaf, "plain": torch.randn(5), "detached": leaf.detach()}


def _views() -> dict[str, Any]:
    w = torch.randn(4, 6)
    # Views before and after their base, a transpose, a strided column, a reshape.
    return {"row": w[1], "w": w, "t": w.t(), "col": w[:, 2], "flat": w.view(-1), "tail": w[2:]}


def _reshape() -> dict[str, Any]:
    w = torch.randn(4, 6)
    return {"w": w, "flat": w.view(-1), "cube": w.view(2, 2, 6)}  # every one the whole storage


def _transpose() -> dict[str, Any]:
    w = torch.randn(4, 6)
    return {"t": w.t(), "w": w}


def _list_and_dict() -> dict[str, Any]:
    w = torch.randn(3, 3)
    return {"lst": [w, w[0]], "d": {"x": w, "y": [w]}, "w": w}


def _mixed() -> dict[str, Any]:
    p = torch.nn.Parameter(torch.randn(2, 3))
    return {"p": p, "same": p, "data": p.detach(), "row": p.detach()[1], "n": torch.arange(3)}


STATES: dict[str, Callable[[], dict[str, Any]]] = {
    "tied_dict": _tied_dict,
    "tied_module": _tied_module,
    "tied_module_vars": _tied_module_vars,
    "parameters": _parameters,
    "requires_grad": _requires_grad,
    "views": _views,
    "reshape": _reshape,
    "transpose": _transpose,
    "list_and_dict": _list_and_dict,
    "mixed": _mixed,
}


def _torch_load(state: Any) -> Any:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _tensors(value: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _tensors(v, f"{path}/{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensors(v, f"{path}/{i}")


def _numbering(keys: list[Any]) -> list[int]:
    """Each key replaced by the order of its first appearance: equal lists mean the same
    partition into equal keys."""
    seen: dict[Any, int] = {}
    return [seen.setdefault(k, len(seen)) for k in keys]


def assert_loads_like_torch(ours: Any, theirs: Any) -> None:
    """Same structure, and tensors of the same type, requires_grad, dtype, shape, strides and
    bytes; the same storages shared (in the same places), and every pair of tensors that is one
    object in ``theirs`` one object in ``ours``."""
    mine, ref = list(_tensors(ours)), list(_tensors(theirs))
    assert [p for p, _ in mine] == [p for p, _ in ref]
    for (path, a), (_, b) in zip(mine, ref, strict=True):
        assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
        assert a.requires_grad == b.requires_grad, path
        assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), path
        assert a.storage_offset() == b.storage_offset(), path
        assert raw_bytes(a) == raw_bytes(b), f"{path}: bytes differ"
    assert _numbering([t.untyped_storage().data_ptr() for _, t in mine]) == _numbering(
        [t.untyped_storage().data_ptr() for _, t in ref]
    )
    ours_ids = _numbering([id(t) for _, t in mine])
    for i, (_, b) in enumerate(ref):
        for j in range(i):
            if ref[j][1] is b:
                assert ours_ids[i] == ours_ids[j], f"{ref[i][0]} is {ref[j][0]} in torch.load"


@pytest.mark.parametrize("name", list(STATES))
def test_read_object_and_restore_match_torch_load(snapshot_url, name):
    state = STATES[name]()
    snap = Snapshot.take(snapshot_url, {"s": StateDict(state)})
    expected = _torch_load(state)
    assert_loads_like_torch(snap.read_object("0/s"), expected)
    assert_loads_like_torch(Snapshot(snapshot_url).get_state_dict_for_key("s"), expected)
    into = StateDict()
    Snapshot(snapshot_url).restore({"s": into})
    assert_loads_like_torch(dict(into), expected)


def test_async_take_records_the_same(tmp_path):
    state = _mixed()
    pending = Snapshot.async_take(str(tmp_path / "snap"), {"s": StateDict(state)})
    snap = pending.wait()
    assert_loads_like_torch(snap.read_object("0/s"), _torch_load(state))


def test_tied_weights_are_written_once_and_the_manifest_is_as_before(tmp_path):
    """Tied plain tensors need no new field: their entries record the same range (the bytes
    written once), and a reader makes one tensor of them. The manifest stays format 1."""
    state = _tied_module()
    snap = Snapshot.take(str(tmp_path / "snap"), {"s": StateDict(state)})
    text = (tmp_path / "snap" / "manifest.yaml").read_text()
    assert "format_version: 1\n" in text
    assert '"view"' not in text and '"parameter"' not in text and "requires_grad" not in text
    emb, head = snap.get_manifest()["0/s/emb.weight"], snap.get_manifest()["0/s/head.weight"]
    assert isinstance(emb, mf.TensorEntry) and emb.chunks == head.chunks
    usage = disk_usage(snap._manifest)
    assert usage.stored_bytes == 10 * 4 * 4  # one copy, though both entries count it


def test_new_fields_make_format_4_and_inspection_reads_them(tmp_path):
    url = str(tmp_path / "snap")
    state = {"w": torch.randn(4, 6), "p": torch.nn.Parameter(torch.randn(3))}
    state["row"] = state["w"][1]
    snap = Snapshot.take(url, {"s": StateDict(state)})
    manifest = snap.get_manifest()
    assert snap.metadata.format_version == mf.TENSOR_ATTRS_VERSION == 4
    assert manifest["0/s/p"].parameter and manifest["0/s/p"].requires_grad
    row = manifest["0/s/row"]
    assert row.view == mf.TensorView(base="s/w", offset=6, stride=(1,))
    # A view keeps its own bytes: readers that ignore the field read them.
    assert row.nbytes == 6 * 4 and row.chunks[0] != manifest["0/s/w"].chunks[0]
    listing = list_entries(snap._manifest)
    assert [r.path for r in listing.rows] == list(manifest)
    assert verify(url, None).ok
    other = str(tmp_path / "plain")
    Snapshot.take(other, {"s": StateDict({k: v.detach() for k, v in state.items()})})
    report = diff(url, other, None)
    assert [(d.path, d.what) for d in report.differences] == [("0/s/p", "type")]
    assert "Parameter" in report.differences[0].detail


def test_a_view_read_alone_reads_only_its_own_bytes(recorded):
    url, log = recorded
    w = torch.randn(64, 64)
    snap = Snapshot.take(url, {"s": StateDict(w=w, row=w[3])})
    log.clear()
    row = snap.read_object("0/s/row")
    assert torch.equal(row, w[3]) and row.untyped_storage().nbytes() == 64 * 4
    assert sum(n for _, _, n in log.reads) == 64 * 4


def test_restore_into_existing_targets_keeps_their_own_types():
    """The target's type, flag and ties win, as load_state_dict's: values only are restored."""
    model = _Tied()
    Snapshot.take("memory://parity/model", {"m": model})
    other = _Tied()
    with torch.no_grad():
        other.emb.weight.zero_()
    other.emb.weight.requires_grad_(False)
    Snapshot("memory://parity/model").restore({"m": other})
    assert other.head.weight is other.emb.weight
    assert not other.emb.weight.requires_grad
    assert torch.equal(other.emb.weight, model.emb.weight)

    params = _parameters()
    Snapshot.take("memory://parity/params", {"s": StateDict(params)})
    on = torch.zeros(3)
    target = StateDict(on=on, off=torch.zeros(3), ints=torch.zeros(4, dtype=torch.int64))
    Snapshot("memory://parity/params").restore({"s": target})
    assert target["on"] is on and not on.requires_grad
    assert torch.equal(on, params["on"].detach())


def test_views_of_a_storage_not_stored_are_separate_tensors(tmp_path):
    """Leaves that only share a storage no leaf holds whole (parameters carved out of one flat
    buffer) are written as their own bytes, and read back as separate tensors: torch.save
    would write the whole buffer once and load them as views of it."""
    flat = torch.randn(20)
    state = {"a": flat[:6].view(2, 3), "b": flat[6:10]}
    snap = Snapshot.take(str(tmp_path / "snap"), {"s": StateDict(state)})
    assert all(e.view is None for e in snap.get_manifest().values() if hasattr(e, "view"))
    assert disk_usage(snap._manifest).stored_bytes == 10 * 4
    out = snap.read_object("0/s")
    assert torch.equal(out["a"], state["a"]) and torch.equal(out["b"], state["b"])
    assert out["a"].untyped_storage().data_ptr() != out["b"].untyped_storage().data_ptr()


def test_a_prepare_function_records_no_view_or_flag(tmp_path):
    """The bytes a prepare function returns are its own: nothing ties them to the state's."""
    w = torch.nn.Parameter(torch.randn(4, 4))
    snap = Snapshot.take(
        str(tmp_path / "snap"),
        {"s": StateDict(w=w, row=w[1])},
        _custom_tensor_prepare_func=lambda path, t, tracing: t.detach().half(),
    )
    text = (tmp_path / "snap" / "manifest.yaml").read_text()
    assert '"view"' not in text and '"parameter"' not in text
    out = snap.read_object("0/s")
    assert type(out["w"]) is torch.Tensor and out["w"].dtype == torch.float16


def test_codec_round_trips_the_new_fields_through_both_readers():
    """The JSON lines the writer lays out, and the same document re-dumped as block YAML (read
    by the YAML path), decode to the same entries; an entry without the fields has none."""
    loc = mf.new_location("0/s0", 64, 12, 7)
    entries = {
        "0/s/row": mf.TensorEntry(
            dtype="float32",
            shape=(3,),
            chunks=(loc,),
            parameter=True,
            requires_grad=True,
            view=mf.TensorView(base="s/w", offset=3, stride=(1,)),
        ),
        "0/s/w": mf.new_tensor_entry("float32", (4, 3), (mf.new_location("0/s0", 0, 48, 9),)),
    }
    manifest = mf.Manifest(format_version=4, entries=entries)
    data = mf.dumps(manifest)
    assert mf.loads(data).entries == entries
    assert b'"view": {"base": "s/w", "offset": 3, "stride": [1]}' in data
    assert data.count(b"parameter") == 1  # written only where set
    doc = yaml.safe_load(data.decode())
    block = seal_manifest(yaml.safe_dump(doc, sort_keys=False).encode())
    assert mf.loads(block).entries == entries
    assert not entries["0/s/w"].has_attrs


# -- forged records --------------------------------------------------------------------------


def _forge(root: str, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrites the manifest at ``root`` with ``edit`` applied to its entries (path -> the
    entry's JSON mapping), sealed with a valid checksum line."""
    path = os.path.join(root, "manifest.yaml")
    with open(path, "rb") as f:
        lines = f.read().decode().splitlines()
    head = lines[: lines.index("entries:") + 1]
    entries: dict[str, Any] = {}
    for line in lines[len(head) :]:
        if line.startswith("  "):
            entries.update(json.loads("{" + line.strip() + "}"))
    edit(entries)
    body = [line.replace("format_version: 1", "format_version: 4") for line in head]
    body += ["  " + json.dumps({k: v})[1:-1] for k, v in entries.items()]
    with open(path, "wb") as f:
        f.write(seal_manifest("\n".join(body).encode()))


def _view(base: str, offset: int, stride: list[int]) -> dict[str, Any]:
    return {"base": base, "offset": offset, "stride": stride}


FORGERIES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "missing base": (
        lambda e: e["0/s/row"].update(view=_view("s/nowhere", 0, [1])),
        r"0/s/row: a view of '0/s/nowhere', which is missing from the manifest",
    ),
    "base not a tensor": (
        lambda e: e["0/s/row"].update(view=_view("s/n", 0, [1])),
        r"0/s/row: a view of '0/s/n', which is a primitive entry, not a tensor",
    ),
    "base a container": (
        lambda e: e["0/s/row"].update(view=_view("s", 0, [1])),
        r"a view of '0/s', which is a dict entry",
    ),
    "self": (
        lambda e: e["0/s/row"].update(view=_view("s/row", 0, [1])),
        r"0/s/row: a view of '0/s/row', which is itself a view",
    ),
    "cycle": (
        lambda e: (
            e["0/s/row"].update(view=_view("s/w", 0, [1])),
            e["0/s/w"].update(view=_view("s/row", 0, [6, 1])),
        ),
        r"which is itself a view",
    ),
    "offset past the end": (
        lambda e: e["0/s/row"].update(view=_view("s/w", 19, [1])),
        r"0/s/row: a view of '0/s/w', reaching its element 24, beyond its 24 elements",
    ),
    "stride past the end": (
        lambda e: e["0/s/row"].update(view=_view("s/w", 0, [5])),
        r"reaching its element 25, beyond its 24 elements",
    ),
    "huge stride": (
        lambda e: e["0/s/row"].update(view=_view("s/w", 0, [2**62])),
        r"beyond its 24 elements",
    ),
    "other dtype": (
        lambda e: e["0/s/w"].update(dtype="int32"),
        r"a view of '0/s/w', which holds int32, not float32",
    ),
    "grad on ints": (
        lambda e: e["0/s/n_t"].update(requires_grad=True),
        r"0/s/n_t: the manifest says this int64 tensor requires grad",
    ),
    "stride of another rank": (
        lambda e: e["0/s/row"].update(view=_view("s/w", 0, [1, 1])),
        r"0/s/row: a view of a 1-d tensor has stride \[1, 1\]",
    ),
    "negative offset": (
        lambda e: e["0/s/row"].update(view=_view("s/w", -1, [1])),
        r"0/s/row: expected an integer >= 0, got -1",
    ),
    "view not a mapping": (
        lambda e: e["0/s/row"].update(view=["s/w", 0, [1]]),
        r"0/s/row: expected a view \{base, offset, stride\}",
    ),
    "flag not a bool": (
        lambda e: e["0/s/w"].update(parameter=1),
        r"0/s/w: expected true or false, got 1",
    ),
}


@pytest.mark.parametrize("name", list(FORGERIES))
def test_forged_views_and_flags_are_refused(tmp_path, name):
    root = str(tmp_path / "snap")
    w = torch.randn(4, 6)
    Snapshot.take(root, {"s": StateDict(w=w, row=w[1], n=3, n_t=torch.arange(3))})
    edit, message = FORGERIES[name]
    _forge(root, edit)
    with pytest.raises(CorruptSnapshotError, match=message) as info:
        Snapshot(root).read_object("0/s")
    assert root in str(info.value)
    with pytest.raises(CorruptSnapshotError, match=message):
        Snapshot(root).restore({"s": StateDict()})


def test_verify_reports_a_forged_view(tmp_path):
    root = str(tmp_path / "snap")
    w = torch.randn(4, 6)
    Snapshot.take(root, {"s": StateDict(w=w, row=w[1])})
    assert verify(root, None).ok
    _forge(root, FORGERIES["missing base"][0])
    report = verify(root, None)
    assert [p.paths for p in report.problems] == [("0/s/row",)]
    assert "a view of '0/s/nowhere', which is missing" in report.problems[0].what


def test_view_checks_are_linear_in_the_manifest(tmp_path):
    """Every view of a long list names one base: each is checked in constant work."""
    root = str(tmp_path / "snap")
    w = torch.randn(2000)
    views = [w[i : i + 1] for i in range(2000)]
    Snapshot.take(root, {"s": StateDict(w=w, views=views)})
    manifest = Snapshot(root).get_manifest()
    assert sum(1 for e in manifest.values() if getattr(e, "view", None) is not None) == 2000
    out = Snapshot(root).read_object("0/s")
    ptr = out["w"].untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == ptr for v in out["views"])
    assert [float(v) for v in out["views"]] == w.tolist()


# -- across ranks ----------------------------------------------------------------------------


def _replicated_state(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    shared = torch.randn(4, 6)  # the same on every rank: stored once
    torch.manual_seed(1 + rank)
    own = torch.randn(4, 6)  # each rank's own...
    own[1] = shared[1]  # ...but for one row, the same everywhere
    return {
        "shared": shared,
        "s_row": shared[2],
        "s_t": shared.t(),
        "own": own,
        "o_row": own[1],
        "p": torch.nn.Parameter(shared[0].clone()),
    }


def _take_replicated_views(rank: int, world: int, root: str) -> None:
    state = _replicated_state(rank)
    Snapshot.take(root, {"s": StateDict(state)})
    expected = _torch_load(state)
    snap = Snapshot(root)
    manifest = snap.get_manifest()
    assert snap.metadata.format_version == mf.TENSOR_ATTRS_VERSION
    # Views of a leaf stored once keep their record; a view stored once whose base is each
    # rank's own loses it (its base under another rank's prefix is that rank's leaf).
    assert manifest["0/s/s_row"].replicated and manifest["0/s/s_row"].view is not None
    assert manifest["0/s/o_row"].replicated and manifest["0/s/o_row"].view is None
    assert not manifest[f"{rank}/s/own"].replicated and "1/s/o_row" not in manifest
    assert manifest["0/s/p"].parameter
    for read in (
        snap.read_object(f"{rank}/s"),
        snap.get_state_dict_for_key("s"),
    ):
        mine = dict(_tensors(read))
        for path, tensor in _tensors(expected):
            assert raw_bytes(mine[path]) == raw_bytes(tensor), path
            assert type(mine[path]) is type(tensor), path
        base = mine["/shared"].untyped_storage().data_ptr()
        assert mine["/s_row"].untyped_storage().data_ptr() == base
        assert mine["/s_t"].untyped_storage().data_ptr() == base
        assert (
            mine["/o_row"].untyped_storage().data_ptr() != mine["/own"].untyped_storage().data_ptr()
        )


@pytest.mark.slow
def test_views_and_flags_of_replicated_leaves(tmp_path):
    """Across ranks (gloo, 2 processes): equal leaves are stored once, under rank 0; a view
    among them resolves under every rank's prefix, and every rank reads its own values."""
    run_ranks(2, _take_replicated_views, str(tmp_path / "snap"))
