"""read_object, get_manifest, and restoring a subset: only the bytes asked for are read."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from manifest import DictEntry, ListEntry, ObjectEntry, PrimitiveEntry, TensorEntry
from snapshot import Snapshot, StateDict


@pytest.fixture
def state():
    torch.manual_seed(0)
    return {
        "model": torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 8)),
        "extra": StateDict(
            step=7, names=["a", "b"], big=torch.randn(256, 64), obj={3, 4}, text="t" * 4000
        ),
    }


def test_manifest_paths_are_what_read_object_accepts(snapshot_url, state):
    snap = Snapshot.take(snapshot_url, state)
    manifest = snap.get_manifest()
    assert list(manifest)[:3] == ["0/model", "0/model/0.weight", "0/model/0.bias"]
    assert isinstance(manifest["0/model"], DictEntry) and manifest["0/model"].ordered
    w = manifest["0/model/0.weight"]
    assert isinstance(w, TensorEntry)
    assert (w.dtype, w.shape, w.nbytes) == ("float32", (128, 64), 128 * 64 * 4)
    assert w.chunks[0].blob.startswith("0/") and w.chunks[0].nbytes == w.nbytes
    assert isinstance(manifest["0/extra/step"], PrimitiveEntry)
    assert manifest["0/extra/step"].value == 7
    assert isinstance(manifest["0/extra/names"], ListEntry)
    assert isinstance(manifest["0/extra/obj"], ObjectEntry)
    values = {path: snap.read_object(path) for path in manifest}  # every path is readable
    assert torch.equal(values["0/model/0.weight"], state["model"][0].weight)
    assert values["0/extra/obj"] == {3, 4}
    assert snap.read_object("0/extra/names/1") == "b"
    assert snap.read_object("0/extra/text") == "t" * 4000
    whole = snap.read_object("0/model")
    assert type(whole) is OrderedDict and list(whole) == list(state["model"].state_dict())
    # Another reference to the same snapshot sees the same manifest.
    assert Snapshot(snapshot_url).get_manifest() == manifest


def test_read_object_into_obj_out_in_place(snapshot_url, state):
    snap = Snapshot.take(snapshot_url, state)
    out = torch.empty(256, 64)
    result = snap.read_object("0/extra/big", obj_out=out)
    assert result is out and torch.equal(out, state["extra"]["big"])
    out64 = torch.empty(256, 64, dtype=torch.float64)
    assert snap.read_object("0/extra/big", obj_out=out64) is out64
    assert torch.equal(out64, state["extra"]["big"].double())
    # obj_out of a type that cannot be loaded in place is ignored.
    assert snap.read_object("0/extra/step", obj_out=torch.empty(1)) == 7


@pytest.mark.parametrize("target", ["contiguous", "transposed"])
def test_memory_budget_tiles_reads(recorded, target):
    url, log = recorded
    big = torch.randn(64, 1024)  # 256 KiB
    snap = Snapshot.take(url, {"s": StateDict(big=big)})
    out = torch.zeros(64, 1024, dtype=torch.float64)  # a cast: needs scratch memory
    if target == "transposed":
        out = torch.zeros(1024, 64, dtype=torch.float64).t()
    log.clear()
    snap.read_object("0/s/big", obj_out=out, memory_budget_bytes=32 * 1024)
    assert torch.equal(out, big.double())
    sizes = [n for _, _, n in log.reads]
    assert sum(sizes) == big.nbytes and len(sizes) == 8
    assert max(sizes) <= 32 * 1024


def test_read_object_of_one_small_tensor_reads_only_its_bytes(recorded, state):
    url, log = recorded
    snap = Snapshot.take(url, state)
    log.clear()
    bias = snap.read_object("0/model/1.bias")
    assert torch.equal(bias, state["model"][1].bias)
    assert log.bytes_read == 8 * 4


def test_restoring_one_key_reads_only_that_keys_bytes(recorded, state):
    url, log = recorded
    snap = Snapshot.take(url, state)
    log.clear()
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 8))
    snap.restore({"model": model})
    model_bytes = sum(t.nbytes for t in state["model"].state_dict().values())
    assert log.bytes_read == model_bytes
    blobs = {
        c.blob
        for p, e in snap.get_manifest().items()
        if p.startswith("0/model/")
        for c in e.locations
    }
    assert {blob for blob, _, _ in log.reads} == blobs
    for a, b in zip(model.parameters(), state["model"].parameters(), strict=True):
        assert torch.equal(a, b)


def test_restore_loads_into_the_targets_memory(snapshot_url, state):
    Snapshot.take(snapshot_url, state)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 8))
    pointers = [p.data_ptr() for p in model.parameters()]
    extra = StateDict(big=torch.empty(256, 64))
    big_ptr = extra["big"].data_ptr()
    Snapshot(snapshot_url).restore({"model": model, "extra": extra})
    assert [p.data_ptr() for p in model.parameters()] == pointers
    assert extra["big"].data_ptr() == big_ptr
    assert torch.equal(extra["big"], state["extra"]["big"])


def test_restore_fills_tensors_the_target_lacks(snapshot_url):
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optim.step()
    Snapshot.take(snapshot_url, {"optim": optim})
    fresh = torch.optim.SGD(torch.nn.Linear(3, 2).parameters(), lr=0.5, momentum=0.9)
    assert fresh.state_dict()["state"] == {}
    Snapshot(snapshot_url).restore({"optim": fresh})
    restored = fresh.state_dict()
    assert restored["param_groups"][0]["lr"] == 0.1
    assert torch.equal(
        restored["state"][0]["momentum_buffer"], optim.state_dict()["state"][0]["momentum_buffer"]
    )
