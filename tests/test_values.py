"""What a snapshot stores: every dtype, odd tensor layouts, primitives, containers, objects."""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import re
from collections import OrderedDict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from manifest import ObjectEntry, PrimitiveEntry, TensorEntry
from snapshot import (
    Snapshot,
    SnapshotNotFoundError,
    StateDict,
    UnsafeObjectError,
    UnsupportedValueError,
)
from snapshot._engine.format.serialization import encode_object, raw_memoryview, tensor_memoryview
from snapshot._engine.handlers import objects
from snapshot._engine.take.restorable import check_object
from tests.helpers import assert_same, random_tensor, raw_bytes

ALL_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
RAW_DTYPES = [d for d in ALL_DTYPES if d not in QUANTIZED]
# Sub-byte integer dtypes (int1..int7, uint1..uint7): torch has no copy kernel for them, so the
# library moves their bytes as uint8; their views (transposed, sliced) are stored like any other.
SUB_BYTE_DTYPES = [d for d in RAW_DTYPES if re.fullmatch(r"torch\.u?int[1-7]", str(d))]


def roundtrip(url: str, value: dict, target: dict | None = None) -> StateDict:
    Snapshot.take(url, {"s": StateDict(value)})
    out = StateDict(target if target is not None else {})
    Snapshot(url).restore({"s": out})
    return out


def test_every_dtype_restores_bitwise(snapshot_url):
    value = {str(d): random_tensor(d, (3, 5), seed=i) for i, d in enumerate(RAW_DTYPES)}
    assert len(value) >= 40  # float8 variants, complex, uint1..uint64, int1..int64, bits*, bool
    out = roundtrip(snapshot_url, value)
    assert_same(dict(out), value)
    manifest = Snapshot(snapshot_url).get_manifest()
    for d in RAW_DTYPES:
        entry = manifest[f"0/s/{d}"]
        assert isinstance(entry, TensorEntry)
        assert entry.dtype == str(d).removeprefix("torch.") and entry.nbytes == 15 * d.itemsize


def test_every_dtype_restores_in_place(snapshot_url):
    value = {str(d): random_tensor(d, (4,), seed=i) for i, d in enumerate(RAW_DTYPES)}
    target = {k: torch.empty_like(v) for k, v in value.items()}
    pointers = {k: v.data_ptr() for k, v in target.items()}
    out = roundtrip(snapshot_url, value, target)
    for k, v in value.items():
        assert out[k].data_ptr() == pointers[k], k
        assert raw_bytes(out[k]) == raw_bytes(v), k


def test_quantized_and_sparse_tensors_round_trip(snapshot_url):
    q = torch.quantize_per_tensor(torch.linspace(-1, 1, 12), 0.01, 3, torch.qint8)
    sparse = torch.eye(5).to_sparse()
    out = roundtrip(snapshot_url, {"q": q, "sparse": sparse})
    assert torch.equal(out["q"].int_repr(), q.int_repr()) and out["q"].q_scale() == q.q_scale()
    assert torch.equal(out["sparse"].to_dense(), sparse.to_dense())


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.tensor(3.5),  # 0-d
        lambda: torch.empty(0, 7),  # empty
        lambda: torch.empty(3, 0, dtype=torch.int64),
        lambda: torch.arange(24.0).reshape(4, 6).t(),  # transposed
        lambda: torch.arange(48, dtype=torch.int16).reshape(6, 8)[::2, 1::3],  # strided
        lambda: torch.arange(5.0).expand(3, 5),  # stride 0
        lambda: torch.randn(3, 4, dtype=torch.complex64).conj(),  # lazy conjugate
        lambda: torch.randn(6).neg().as_strided((2, 2), (1, 3)),
        lambda: torch.nn.Parameter(torch.randn(2, 3)),
    ],
    ids=[
        "0d",
        "empty",
        "empty2",
        "transposed",
        "strided",
        "expanded",
        "conj",
        "as_strided",
        "parameter",
    ],
)
def test_tensor_layouts(snapshot_url, make):
    t = make()
    out = roundtrip(snapshot_url, {"t": t})
    assert out["t"].shape == t.shape and out["t"].dtype == t.dtype
    assert raw_bytes(out["t"]) == raw_bytes(t)


def test_views_sharing_storage(snapshot_url):
    base = torch.arange(12.0)
    value = {"base": base, "head": base[:4], "tail": base[6:].view(2, 3), "same": base}
    out = roundtrip(snapshot_url, value)
    for k, v in value.items():
        assert torch.equal(out[k], v), k
    manifest = Snapshot(snapshot_url).get_manifest()
    # The very same tensor under two names (tied weights) is stored once.
    assert manifest["0/s/base"].chunks == manifest["0/s/same"].chunks
    assert manifest["0/s/head"].chunks != manifest["0/s/base"].chunks


def test_lazy_views_of_the_same_memory_are_different_values(snapshot_url):
    """A conjugate or negated view shares its base's memory (same address, dtype, shape and
    strides) but not its values: it must not be stored as the base."""
    z = torch.randn(4, 3, dtype=torch.complex64)
    x = torch.randn(5)
    value = {"z": z, "z_conj": z.conj(), "x": x, "x_neg": torch._neg_view(x)}
    out = roundtrip(snapshot_url, value)
    for k, v in value.items():
        assert raw_bytes(out[k]) == raw_bytes(v), k
    assert not torch.equal(out["z_conj"], z)


def test_restore_into_noncontiguous_and_casting_targets(snapshot_url):
    value = {"a": torch.arange(20.0).reshape(4, 5), "b": torch.arange(6, dtype=torch.int32)}
    a_target = torch.zeros(5, 4, dtype=torch.float64).t()  # non-contiguous, other dtype
    b_target = torch.zeros(6, dtype=torch.float32)  # contiguous, other dtype
    out = roundtrip(snapshot_url, value, {"a": a_target, "b": b_target})
    assert out["a"] is a_target and torch.equal(a_target, value["a"].double())
    assert out["b"] is b_target and torch.equal(b_target, value["b"].float())


@pytest.mark.parametrize("dtype", SUB_BYTE_DTYPES, ids=str)
def test_sub_byte_views_round_trip(snapshot_url, dtype):
    assert len(SUB_BYTE_DTYPES) == 14
    base = random_tensor(dtype, (5, 6), seed=3)
    value = {"t": base.t(), "cols": base[:, 1::2], "whole": base}
    # Targets that are views too: the bytes land through their strides.
    targets = {
        "t": random_tensor(dtype, (5, 6), seed=4).t(),
        "cols": random_tensor(dtype, (5, 6), seed=5)[:, ::2],
        "whole": random_tensor(dtype, (5, 6), seed=6),
    }
    out = roundtrip(snapshot_url, value, targets)
    for k, v in value.items():
        assert out[k] is targets[k]
        assert torch.equal(out[k].view(torch.uint8), v.view(torch.uint8)), k
    # Staged copies (async take) and read_object into a view take the same path.
    url = snapshot_url + "-async"
    Snapshot.async_take(url, {"s": StateDict(value)}).wait()
    into = random_tensor(dtype, (6, 5), seed=7).t()
    got = Snapshot(url).read_object("0/s/cols", obj_out=torch.empty(5, 6, dtype=dtype)[:, :3])
    assert torch.equal(got.view(torch.uint8), value["cols"].view(torch.uint8))
    got = Snapshot(url).read_object("0/s/t", obj_out=into.t())
    assert torch.equal(got.view(torch.uint8), value["t"].view(torch.uint8))


def test_numpy_arrays_and_scalars_round_trip(snapshot_url):
    np = pytest.importorskip("numpy", reason="NumPy values need NumPy")
    value = {
        "best": np.float64(0.125),
        "count": np.int64(-3),
        "flag": np.bool_(True),
        "array": np.arange(12, dtype=np.int16).reshape(3, 4),
        "names": np.array(["ab", "c"]),
        "mixed": np.array([{"x": 1}, None], dtype=object),
        "dtype": np.dtype("float32"),
    }
    out = roundtrip(snapshot_url, value)
    for k, v in value.items():
        assert type(out[k]) is type(v), k
    for k in ("best", "count", "flag", "array", "names"):
        assert out[k].dtype == value[k].dtype and np.array_equal(out[k], value[k]), k
    assert list(out["mixed"]) == [{"x": 1}, None] and out["dtype"] == np.dtype("float32")


def test_restore_into_lazy_conjugate_and_negated_targets(snapshot_url):
    """A target whose memory holds the conjugate or the negation of its values (a lazy view)
    is filled with the stored values, not the stored bytes."""
    z = torch.randn(4, 3, dtype=torch.complex64)
    x = torch.randn(5)
    z_target = torch.zeros(4, 3, dtype=torch.complex64).conj()
    x_target = torch._neg_view(torch.zeros(5))
    out = roundtrip(snapshot_url, {"z": z, "x": x}, {"z": z_target, "x": x_target})
    assert out["z"] is z_target and torch.equal(z_target, z)
    assert out["x"] is x_target and torch.equal(x_target, x)


def test_primitives_live_in_the_manifest(snapshot_url):
    value = {
        "int": -(2**70),
        "float": 0.1,
        "nan": float("nan"),
        "inf": float("-inf"),
        "negzero": -0.0,
        "str": "héllo / wörld\n\u2028\x85",
        "empty": "",
        "true": True,
        "none": None,
        "bytes": b"\x00\xff",
        "numeric_str": "1e5",
        "yaml_words": ["null", "true", "~", "- x", "{a: 1}"],
    }
    out = roundtrip(snapshot_url, value)
    assert_same(dict(out), value)
    manifest = Snapshot(snapshot_url).get_manifest()
    assert isinstance(manifest["0/s/int"], PrimitiveEntry) and manifest["0/s/int"].value == -(2**70)
    assert manifest["0/s/bytes"].nbytes == 0


def test_long_strings_and_bytes_get_blobs(snapshot_url):
    value = {"text": "ü" * 5000, "data": os.urandom(10_000), "surrogate": "bad\ud800"}
    out = roundtrip(snapshot_url, value)
    assert_same(dict(out), value)
    manifest = Snapshot(snapshot_url).get_manifest()
    assert manifest["0/s/text"].serializer == "utf8" and manifest["0/s/text"].nbytes == 10_000
    assert manifest["0/s/data"].serializer == "bytes"
    assert manifest["0/s/surrogate"].serializer == "torch_save"


def test_containers_keep_types_and_order(snapshot_url):
    value = {
        "od": OrderedDict([("z", 1), ("a", 2)]),
        "d": {3: "three", 1: "one", "1x": [], -1: {}},
        "nested": [(1, [2, (3,)]), {"k": ({"deep": torch.ones(2)},)}],
        "empty": ((), [], {}, OrderedDict()),
        "odd_keys": {None: "none", True: "yes", "": "empty"},
    }
    out = roundtrip(snapshot_url, value)
    assert_same(dict(out), value)


def test_keys_with_slashes_and_percents(snapshot_url):
    value = {"a/b": 1, "a%2Fb": 2, "%": {"x/y/": torch.arange(3)}, "": "empty key"}
    out = roundtrip(snapshot_url, value)
    assert_same(dict(out), value)
    snap = Snapshot(snapshot_url)
    assert snap.read_object("0/s/a%2Fb") == 1
    assert snap.read_object("0/s/a%252Fb") == 2
    assert torch.equal(snap.read_object("0/s/%25/x%2Fy%2F"), torch.arange(3))


def test_dicts_with_colliding_or_exotic_keys_are_stored_whole(snapshot_url):
    value = {"collide": {1: "int", "1": "str"}, "tuple_keys": {(1, 2): "t"}, "floats": {0.5: 1}}
    out = roundtrip(snapshot_url, value)
    assert_same(dict(out), value)
    manifest = Snapshot(snapshot_url).get_manifest()
    assert isinstance(manifest["0/s/collide"], ObjectEntry)


def test_objects_allowed_by_the_safe_loader_round_trip(snapshot_url):
    value = {"set": {1, 2}, "size": torch.Size([2, 3]), "dtype": torch.bfloat16, "complex": 1 + 2j}
    out = roundtrip(snapshot_url, value)
    assert out["set"] == {1, 2} and out["size"] == torch.Size([2, 3])
    assert out["dtype"] is torch.bfloat16 and out["complex"] == 1 + 2j


@dataclasses.dataclass
class Settings:
    depth: int
    name: str


def test_user_classes_need_an_explicit_opt_in(snapshot_url):
    # Without the opt-in a restore would refuse the value: the take refuses it, naming the key,
    # the type and what to call, and commits nothing.
    with pytest.raises(
        UnsupportedValueError,
        match=r"0/s/cfg: a restore would refuse this tests\.test_values\.Settings: .*"
        r"add_safe_globals\(\[tests\.test_values\.Settings\]\) before take and restore",
    ):
        Snapshot.take(snapshot_url, {"s": StateDict(cfg=Settings(3, "x"))})
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(snapshot_url)
    with torch.serialization.safe_globals([Settings]):
        Snapshot.take(snapshot_url, {"s": StateDict(cfg=Settings(3, "x"))})
    # The restore still needs the opt-in of its own process.
    with pytest.raises(UnsafeObjectError, match=r"0/s/cfg.*add_safe_globals"):
        Snapshot(snapshot_url).read_object("0/s/cfg")
    with torch.serialization.safe_globals([Settings]):
        assert Snapshot(snapshot_url).read_object("0/s/cfg") == Settings(3, "x")


def test_every_type_the_safe_loader_needs_is_named(snapshot_url):
    value = {(1, 2): [Settings(1, "a"), slice(0, 2)]}  # a tuple key: the dict is stored whole
    with pytest.raises(UnsupportedValueError) as caught:
        Snapshot.take(snapshot_url, {"s": StateDict(d=value)})
    assert "add_safe_globals([slice, tests.test_values.Settings])" in str(caught.value)
    assert "0/s/d" in str(caught.value)


class _MyTensor(torch.Tensor):
    pass


def test_a_tensor_subclass_is_refused_at_take(snapshot_url):
    # Only plain tensors are stored as raw bytes; a subclass is pickled, and the safe loader
    # would refuse it at restore.
    t = torch.arange(3.0).as_subclass(_MyTensor)
    with pytest.raises(
        UnsupportedValueError,
        match=r"0/s/t: .*_MyTensor.*before take and restore.*t\.as_subclass\(torch\.Tensor\)",
    ):
        Snapshot.take(snapshot_url, {"s": StateDict(t=t)})
    with torch.serialization.safe_globals([_MyTensor]):
        Snapshot.take(snapshot_url, {"s": StateDict(t=t)})
        out = Snapshot(snapshot_url).read_object("0/s/t")
    assert type(out) is _MyTensor and torch.equal(out, t)


class _Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_runs_code_is_refused(snapshot_url, tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    # The take refuses it (its decode check runs nothing the safe loader does not allow).
    with pytest.raises(UnsupportedValueError, match=r"0/s/x: .*needs (posix|os)\.system"):
        Snapshot.take(snapshot_url, {"s": StateDict(x=_Exploit(str(marker)))})
    assert not marker.exists()
    # A snapshot holding one anyway (written by a tool without the take-time check): the
    # restore refuses it too, without running it.
    monkeypatch.setattr(objects, "check_object", lambda *args, **kwargs: None)
    Snapshot.take(snapshot_url, {"s": StateDict(x=_Exploit(str(marker)))})
    with pytest.raises(UnsafeObjectError, match="0/s/x"):
        Snapshot(snapshot_url).restore({"s": StateDict()})
    assert not marker.exists()


def test_prepare_func_writes_what_it_returns(snapshot_url):
    calls = []

    def to_bf16(path: str, t: torch.Tensor, tracing: bool) -> torch.Tensor:
        calls.append((path, tracing))
        return t.to(torch.bfloat16) if t.is_floating_point() else t

    model = torch.nn.Linear(64, 32)
    snap = Snapshot.take(
        snapshot_url,
        {"m": model, "s": StateDict(i=torch.arange(4))},
        _custom_tensor_prepare_func=to_bf16,
    )
    assert ("m/weight", True) in calls and ("m/weight", False) in calls
    entry = snap.get_manifest()["0/m/weight"]
    assert entry.dtype == "bfloat16" and entry.nbytes == 64 * 32 * 2
    assert snap.get_manifest()["0/s/i"].dtype == "int64"
    # Restoring into an fp32 model casts, as load_state_dict would.
    fresh = torch.nn.Linear(64, 32)
    snap.restore({"m": fresh})
    assert fresh.weight.dtype == torch.float32
    assert torch.equal(fresh.weight, model.weight.detach().to(torch.bfloat16).float())
    assert snap.read_object("0/m/bias").dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------
# Property tests: arbitrary nesting of primitives and tensors of every dtype and small shape.

_keys = st.one_of(st.text(max_size=6), st.integers(-5, 5))
_floats = st.floats(allow_nan=True, allow_infinity=True)
_primitives = st.one_of(
    st.none(), st.booleans(), st.integers(), _floats, st.text(max_size=20), st.binary(max_size=20)
)


@st.composite
def _tensors(draw):
    dtype = draw(st.sampled_from(RAW_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    t = random_tensor(dtype, shape, seed=draw(st.integers(0, 1000)))
    if len(shape) == 2 and draw(st.booleans()):
        t = t.t()  # a non-contiguous view
    return t


_values = st.recursive(
    st.one_of(_primitives, _tensors()),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        # Keys whose paths differ: a dict whose keys collide as paths (0 and "0") is pickled
        # whole, and torch.save cannot pickle every tensor (sub-byte dtypes); such dicts have
        # tests of their own.
        st.dictionaries(_keys, children, max_size=4).filter(
            lambda d: len({str(k) for k in d}) == len(d)
        ),
        st.dictionaries(st.text(max_size=4), children, max_size=4).map(OrderedDict),
    ),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=st.dictionaries(st.text(max_size=8), _values, max_size=5))
def test_property_any_nesting_round_trips(value):
    import uuid

    out = roundtrip(f"memory://{uuid.uuid4().hex}", value)
    assert_same(dict(out), value)


def test_nan_payload_floats_keep_their_bits(snapshot_url):
    value = {"f": math.nan, "t": torch.tensor([float("nan"), -0.0])}
    out = roundtrip(snapshot_url, value)
    assert math.isnan(out["f"]) and raw_bytes(out["t"]) == raw_bytes(value["t"])


Point = collections.namedtuple("Point", "x y")


def test_defaultdict_and_namedtuple_are_objects(snapshot_url):
    value = {"pt": Point(1, 2)}
    # Its pickle needs a type the safe loader allows only on request: the take refuses it
    # unless it is allowed, naming what to allow.
    with pytest.raises(UnsupportedValueError, match=r"0/s/pt: .*\[tests\.test_values\.Point\]"):
        Snapshot.take(snapshot_url, {"s": StateDict(value)})
    with torch.serialization.safe_globals([Point]):
        Snapshot.take(snapshot_url, {"s": StateDict(value)})
        out = StateDict()
        Snapshot(snapshot_url).restore({"s": out})
    assert out["pt"] == Point(1, 2) and type(out["pt"]) is Point
    manifest = Snapshot(snapshot_url).get_manifest()
    assert manifest["0/s/pt"].obj_type.endswith("Point")
    assert isinstance(manifest["0/s/pt"], ObjectEntry)


def test_a_defaultdict_cannot_be_restored_so_it_is_not_taken(snapshot_url):
    # Even with its types allowed, the safe loader cannot rebuild a defaultdict (its pickle
    # fills it by SETITEM, which the loader does on plain dicts only): refused at take, the
    # reason given.
    value = {"dd": collections.defaultdict(int, a=1)}
    with (
        torch.serialization.safe_globals([collections.defaultdict, int]),
        pytest.raises(
            UnsupportedValueError,
            match=r"0/s/dd: a restore would refuse this collections\.defaultdict: .*cannot "
            r"rebuild it \(Can only SETITEM for dict.*a dict in place of a defaultdict",
        ),
    ):
        Snapshot.take(snapshot_url, {"s": StateDict(value)})


def test_raw_views_address_exactly_the_memory_asked_for():
    # Views cut from one view of the whole address space (serialization.raw_memoryview): each
    # must start at its address and hold exactly its length, writable, of plain bytes.
    t = torch.arange(64, dtype=torch.uint8)
    v = raw_memoryview(t.data_ptr() + 10, 6)
    assert (len(v), v.format, v.readonly, v.contiguous) == (6, "B", False, True)
    assert bytes(v) == bytes(range(10, 16))
    v[:] = b"abcdef"
    assert bytes(t[10:16].numpy()) == b"abcdef" and t[9].item() == 9 and t[16].item() == 16
    assert bytes(tensor_memoryview(t)) == bytes(t.numpy())
    assert len(raw_memoryview(0, 0)) == 0  # an empty tensor's address may be NULL
    with pytest.raises(ValueError, match="no memory at address 0"):
        raw_memoryview(0, 1)


def test_an_empty_bytes_inside_a_pickled_value_is_taken_and_restored(snapshot_url):
    # Protocol 2 writes an empty bytes as a call of bytes(), which the safe loader refuses (and
    # must: bytes(10**12) would exhaust memory); encode_object writes it as a non-empty one,
    # _codecs.encode('', 'latin1'). Values without one keep torch.save's very bytes.
    import io

    def plain(v):
        buf = io.BytesIO()
        torch.save(v, buf)
        return buf.getvalue()

    for v in [
        {"a": [1, 2.5, None, "x"], 0: (b"y", True)},
        OrderedDict(t=torch.arange(4), u=b"\xff" * 3),
        [{1, 2}, frozenset("ab"), 2**70, complex(1, 2)],
    ]:
        assert encode_object(v) == plain(v)
    for v in [{"": {0: None, "0": b""}}, [b"", (b"", b"z"), {"k": b""}, torch.arange(2)]]:
        data = encode_object(v)
        check_object("p", type(v).__name__, data)  # raises if a restore would refuse it
        assert_same(torch.load(io.BytesIO(data), weights_only=True), v)
    value = {"": {0: None, "0": b""}}  # a dict whose keys collide as paths: pickled whole
    assert dict(roundtrip(snapshot_url, value)) == value
    assert isinstance(Snapshot(snapshot_url).get_manifest()["0/s/"], ObjectEntry)
