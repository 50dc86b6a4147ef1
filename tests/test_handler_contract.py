"""A new kind of value registered from outside the library, through the public contract alone
(``snapshot.Kind``, ``snapshot.register_kind``): a tensor subclass carrying a ``scale`` of its
own is taken, restored bitwise with its scale, read by ``read_object``, verified and exported."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import snapshot
from manifest import Location, ObjectEntry
from snapshot import Kind, Snapshot, StateDict, TensorLayout, register_kind
from snapshot.cli import main
from snapshot.export import export


class ScaledTensor(torch.Tensor):
    """A tensor with a ``scale`` that belongs with its values."""

    scale: float

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: float) -> ScaledTensor:
        t = torch.Tensor._make_subclass(cls, data)
        t.scale = scale
        return t


_PREFIX = "ScaledTensor:"
_SCALE = struct.Struct("<d")  # after the values, in the same bytes


def _layout(obj_type: str) -> tuple[torch.dtype, tuple[int, ...]]:
    """The dtype and shape an entry's ``obj_type`` (``ScaledTensor:float32:4,3``) names."""
    _, dtype, shape = obj_type.split(":")
    return getattr(torch, dtype), tuple(int(n) for n in shape.split(",") if n)


class ScaledKind(Kind):
    """Stored as an object entry of its own type: the values' bytes, then the scale."""

    name = "scaled_tensor"
    value_types = (ScaledTensor,)
    entry_types = (ObjectEntry,)

    def owns(self, entry: Any) -> bool:
        return entry.obj_type.startswith(_PREFIX)

    def take(self, sink: Any, path: str, logical: str, value: Any, replicated: bool) -> Any:
        values = value.as_subclass(torch.Tensor).detach().contiguous().cpu()
        data = values.reshape(-1).view(torch.uint8).numpy().tobytes() + _SCALE.pack(value.scale)
        dtype = str(values.dtype).removeprefix("torch.")
        obj_type = f"{_PREFIX}{dtype}:{','.join(map(str, values.shape))}"
        return self.write_bytes(sink, path, logical, data, replicated, obj_type=obj_type)

    def restore(self, reader: Any, path: str, entry: Any, target: Any) -> None:
        dtype, shape = _layout(entry.obj_type)

        def decode(data: bytes) -> ScaledTensor:
            values = torch.frombuffer(bytearray(data[: -_SCALE.size]), dtype=dtype).reshape(shape)
            (scale,) = _SCALE.unpack(data[-_SCALE.size :])
            if isinstance(target, ScaledTensor):  # filled in place
                with torch.no_grad():
                    target.as_subclass(torch.Tensor).copy_(values)
                target.scale = scale
                return target
            return ScaledTensor(values, scale)

        self.read_bytes(reader, path, entry.location, decode)

    def tensor_layout(self, path: str, entry: Any) -> TensorLayout:
        dtype, shape = _layout(entry.obj_type)
        loc = entry.location
        values = Location(blob=loc.blob, offset=loc.offset, nbytes=loc.nbytes - _SCALE.size)
        return TensorLayout(dtype, shape, [((0,) * len(shape), shape, (values,))])


@pytest.fixture(autouse=True)
def scaled_kind() -> Iterator[None]:
    undo = register_kind(ScaledKind())
    yield
    undo()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(torch.Tensor).reshape(-1).view(torch.uint8)


def test_a_registered_kind_takes_restores_reads_verifies_and_exports(tmp_path, capsys):
    weight = ScaledTensor(torch.randn(4, 3, dtype=torch.float32), 0.125)
    codes = ScaledTensor(torch.arange(6, dtype=torch.int8).reshape(2, 3), 3.5)
    state = StateDict(weight=weight, codes=codes, plain=torch.ones(2), note="x" * 200)
    path = str(tmp_path / "snap")
    snap = Snapshot.take(path, {"model": state})

    # Restored into new objects of the same kind...
    fresh = StateDict(weight=None, codes=None, plain=torch.zeros(2), note=None)
    snap.restore({"model": fresh})
    for name, original in (("weight", weight), ("codes", codes)):
        got = fresh[name]
        assert type(got) is ScaledTensor and got.scale == original.scale
        assert got.dtype == original.dtype and got.shape == original.shape
        assert torch.equal(_bits(got), _bits(original))
    assert torch.equal(fresh["plain"], torch.ones(2)) and fresh["note"] == "x" * 200

    # ... and in place, into the caller's own.
    target = ScaledTensor(torch.zeros(4, 3), 1.0)
    into = StateDict(weight=target, codes=None, plain=torch.zeros(2), note=None)
    Snapshot(path).restore({"model": into})
    assert into["weight"] is target and target.scale == 0.125
    assert torch.equal(_bits(target), _bits(weight))

    # read_object, with and without a target.
    got = Snapshot(path).read_object("0/model/codes")
    assert type(got) is ScaledTensor and got.scale == 3.5 and torch.equal(_bits(got), _bits(codes))
    out = ScaledTensor(torch.zeros(4, 3), 0.0)
    assert Snapshot(path).read_object("0/model/weight", obj_out=out) is out
    assert out.scale == 0.125 and torch.equal(_bits(out), _bits(weight))

    # verify: the kind's bytes are checked with every other range.
    assert main(["verify", path]) == 0
    capsys.readouterr()

    # export: the kind gives its values as one tensor.
    files = export(path, str(tmp_path / "out"), key="model")
    exported = load_file(files[0])
    assert torch.equal(_bits(exported["weight"]), _bits(weight))
    assert torch.equal(_bits(exported["codes"]), _bits(codes))
    assert torch.equal(exported["plain"], torch.ones(2))


def test_verify_finds_damage_in_a_registered_kind(tmp_path, capsys):
    path = str(tmp_path / "snap")
    Snapshot.take(path, {"model": StateDict(w=ScaledTensor(torch.randn(64), 2.0))})
    entry = Snapshot(path).get_manifest()["0/model/w"]
    assert isinstance(entry, ObjectEntry) and entry.obj_type.startswith(_PREFIX)
    blob = tmp_path / "snap" / entry.location.blob
    data = bytearray(blob.read_bytes())
    data[entry.location.offset] ^= 0xFF
    blob.write_bytes(bytes(data))
    assert main(["verify", path]) != 0
    capsys.readouterr()
    with pytest.raises(snapshot.ChecksumError):
        Snapshot(path).read_object("0/model/w")
