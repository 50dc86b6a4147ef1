"""Sharded-state descriptions: ShardedTensor geometry checked against real global tensors, every
validation error naming the key, ShardedObject unique keys, factories built and merged back."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import snapshot.sharding as sharding
from snapshot.sharding import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    is_main_replica,
)
from snapshot.sharding.mapping import (
    ShardedBase,
    ShardedStateDict,
    StateDict,
    apply_factories,
    apply_factory_merges,
)


def block_of(global_tensor: torch.Tensor, st: ShardedTensor) -> torch.Tensor:
    """The block ``st`` describes, cut out of ``global_tensor`` with its global slice."""
    return global_tensor[st.global_slice()].reshape(st.local_shape)


# is_main_replica


@pytest.mark.parametrize(
    ("replica_id", "main"),
    [(0, True), (1, False), ((0, 0, 0), True), ((0, 1, 0), False), ((), True), ((2,), False)],
)
def test_is_main_replica(replica_id, main):
    assert is_main_replica(replica_id) is main


# ShardedTensor.from_rank_offsets


def test_from_rank_offsets_1d_matches_torch_chunk():
    global_tensor = torch.arange(12.0)
    chunks = torch.chunk(global_tensor, 4)
    for rank, chunk in enumerate(chunks):
        st = ShardedTensor.from_rank_offsets("w", chunk.clone(), (0, rank, 4))
        assert st.global_shape == (12,)
        assert st.global_offset == (3 * rank,)
        assert st.axis_fragmentations == (4,)
        assert st.global_region() == ((3 * rank,), (3,))
        assert st.global_slice() == (slice(3 * rank, 3 * rank + 3),)
        assert torch.equal(block_of(global_tensor, st), chunk)
        assert st.local_chunk_offset_in_global() == (rank,)
        assert st.max_allowed_chunks() == (4,)
        assert st.dtype == torch.float32 and st.local_shape == (3,)


def test_from_rank_offsets_2d_matches_torch_chunk():
    global_tensor = torch.arange(6 * 8).reshape(6, 8)
    for i, rows in enumerate(torch.chunk(global_tensor, 3, dim=0)):
        for j, block in enumerate(torch.chunk(rows, 2, dim=1)):
            st = ShardedTensor.from_rank_offsets(
                "layer.w", block.clone(), (0, i, 3), (1, j, 2), replica_id=(0, 1)
            )
            assert st.global_shape == (6, 8)
            assert st.global_offset == (2 * i, 4 * j)
            assert st.global_region() == ((2 * i, 4 * j), (2, 4))
            assert torch.equal(block_of(global_tensor, st), block)
            assert st.local_chunk_offset_in_global() == (i, j)
            assert st.max_allowed_chunks() == (3, 2)
            assert st.replica_id == (0, 1)


def test_from_rank_offsets_unnamed_axis_is_whole():
    global_tensor = torch.arange(4 * 6).reshape(4, 6)
    block = torch.chunk(global_tensor, 3, dim=1)[2]
    st = ShardedTensor.from_rank_offsets("w", block.clone(), (1, 2, 3))
    assert st.global_shape == (4, 6)
    assert st.global_offset == (0, 4)
    assert st.axis_fragmentations == (1, 3)
    assert st.global_slice() == (slice(0, 4), slice(4, 6))
    assert torch.equal(block_of(global_tensor, st), block)


def test_from_rank_offsets_no_offsets_is_the_whole_tensor():
    data = torch.ones(2, 3)
    st = ShardedTensor.from_rank_offsets("w", data)
    assert st.global_shape == (2, 3) and st.global_offset == (0, 0)
    assert st.axis_fragmentations == (1, 1)
    assert st.data is data


def test_from_rank_offsets_prepended_axes():
    # A stack of 5 layers, each a (4, 6) weight split in 2 along its columns: this rank holds
    # layer 3, column half 1. Axis 0 is prepended, axis 2 is the local axis 1.
    global_tensor = torch.arange(5 * 4 * 6).reshape(5, 4, 6)
    layer = torch.chunk(global_tensor, 5, dim=0)[3]
    block = torch.chunk(layer, 2, dim=2)[1].reshape(4, 3)
    st = ShardedTensor.from_rank_offsets(
        "stack.w", block.clone(), (0, 3, 5), (2, 1, 2), prepend_axis_num=1
    )
    assert st.prepend_axis_num == 1
    assert st.local_shape == (4, 3)
    assert st.global_shape == (5, 4, 6)
    assert st.global_offset == (3, 0, 3)
    assert st.global_region() == ((3, 0, 3), (1, 4, 3))
    assert st.global_slice() == (slice(3, 4), slice(0, 4), slice(3, 6))
    assert torch.equal(block_of(global_tensor, st), block)
    assert st.local_chunk_offset_in_global() == (3, 0, 1)
    assert st.max_allowed_chunks() == (5, 1, 2)


def test_from_rank_offsets_unnamed_prepended_axis_has_size_one():
    st = ShardedTensor.from_rank_offsets("w", torch.zeros(3), prepend_axis_num=2)
    assert st.global_shape == (1, 1, 3)
    assert st.global_region() == ((0, 0, 0), (1, 1, 3))


def test_from_rank_offsets_passes_init_kwargs():
    st = ShardedTensor.from_rank_offsets("w", torch.zeros(2), (0, 1, 2), allow_shape_mismatch=True)
    assert st.allow_shape_mismatch is True


@pytest.mark.parametrize(
    ("rank_offsets", "prepend", "message"),
    [
        (((0, 0, 2), (0, 1, 2)), 0, "axis 0 is given more than once"),
        (((2, 0, 2),), 0, "axis 2 is out of range"),
        (((-1, 0, 2),), 0, "axis -1 is out of range"),
        (((3, 0, 2),), 1, "axis 3 is out of range"),
        (((1, 2, 2),), 0, "rank offset 2 on axis 1"),
        (((0, 4, 3),), 1, "rank offset 4 on axis 0"),
        (((0, -1, 3),), 0, "rank offset -1 on axis 0"),
        (((0, 0, 0),), 0, "0 fragmentations"),
    ],
)
def test_from_rank_offsets_errors(rank_offsets, prepend, message):
    with pytest.raises(ValueError, match=message) as info:
        ShardedTensor.from_rank_offsets(
            "bad.key", torch.zeros(2, 2), *rank_offsets, prepend_axis_num=prepend
        )
    assert "'bad.key'" in str(info.value)


# ShardedTensor validation


def make(**overrides) -> ShardedTensor:
    fields = {
        "key": "my.key",
        "data": torch.zeros(2, 3),
        "dtype": torch.float32,
        "local_shape": (2, 3),
        "global_shape": (4, 3),
        "global_offset": (2, 0),
        "axis_fragmentations": (2, 1),
    }
    fields.update(overrides)
    return ShardedTensor(**fields)


def test_valid_description_is_accepted_and_normalized():
    st = make(local_shape=torch.Size([2, 3]), global_shape=[4, 3], global_offset=[2, 0])
    assert st.local_shape == (2, 3) and type(st.local_shape) is tuple
    assert st.global_shape == (4, 3) and type(st.global_shape) is tuple
    assert st.global_offset == (2, 0) and type(st.global_offset) is tuple
    assert st.replica_id == 0 and st.prepend_axis_num == 0
    assert st.allow_shape_mismatch is False and st.flattened_range is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"data": torch.zeros(3, 2)}, r"data has shape \(3, 2\), but local_shape is \(2, 3\)"),
        ({"data": torch.zeros(2, 3, dtype=torch.int64)}, "data has dtype torch.int64"),
        ({"global_offset": (2, 0, 0)}, "different numbers of axes"),
        ({"global_shape": (4, 3, 1), "global_offset": (2, 0, 0)}, "prepended axes"),
        ({"prepend_axis_num": 1}, "prepended axes"),
        ({"global_offset": (3, 0)}, r"exceeds global_shape \(4, 3\) on axis 0"),
        ({"global_offset": (2, 1)}, r"exceeds global_shape \(4, 3\) on axis 1"),
        ({"global_offset": (-2, 0)}, "negative on axis 0"),
        ({"axis_fragmentations": (2,)}, "one entry per axis"),
        ({"flattened_range": slice(0, 3)}, "flattened ranges are not supported by statesnap"),
        ({"prepend_axis_num": -1}, "prepend_axis_num must be >= 0"),
    ],
)
def test_validation_errors_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message) as info:
        make(**overrides)
    assert "'my.key'" in str(info.value)


def test_prepended_axis_extent_is_one_in_validation():
    # Offset 4 on a prepended axis of size 5 fits (extent 1); offset 5 does not.
    make(
        data=torch.zeros(3),
        local_shape=(3,),
        global_shape=(5, 3),
        global_offset=(4, 0),
        axis_fragmentations=None,
        prepend_axis_num=1,
    )
    with pytest.raises(ValueError, match="'my.key'.*exceeds global_shape"):
        make(
            data=torch.zeros(3),
            local_shape=(3,),
            global_shape=(5, 3),
            global_offset=(5, 0),
            axis_fragmentations=None,
            prepend_axis_num=1,
        )


def test_validate_metadata_integrity_rechecks_after_mutation():
    st = make()
    st.global_offset = (3, 0)
    with pytest.raises(ValueError, match="'my.key'.*exceeds"):
        st.validate_metadata_integrity()


def test_data_may_be_none():
    st = make(data=None, dtype=torch.bfloat16)
    assert st.data is None and st.dtype == torch.bfloat16


def test_max_allowed_chunks_computed_without_fragmentations():
    st = make(axis_fragmentations=None)
    assert st.max_allowed_chunks() == (2, 1)


def test_uneven_sharding_errors():
    st = make(
        data=torch.zeros(3, 3),
        local_shape=(3, 3),
        global_shape=(7, 3),
        global_offset=(4, 0),
        axis_fragmentations=None,
    )
    assert st.global_region() == ((4, 0), (3, 3))
    with pytest.raises(ValueError, match="'my.key'.*offset 4 on axis 0 is not a multiple"):
        st.local_chunk_offset_in_global()
    with pytest.raises(ValueError, match="'my.key'.*global size 7 on axis 0"):
        st.max_allowed_chunks()


def test_empty_shard():
    st = ShardedTensor.from_rank_offsets("e", torch.zeros(0, 2), (1, 1, 2))
    assert st.global_shape == (0, 4)
    assert st.local_chunk_offset_in_global() == (0, 1)
    assert st.max_allowed_chunks() == (1, 2)


def test_without_data_and_repr():
    data = torch.arange(6.0).reshape(2, 3) + 12345.0
    st = make(data=data, replica_id=(1, 0))
    bare = st.without_data()
    assert bare.data is None and st.data is data
    assert bare == dataclasses.replace(st, data=None)
    assert (bare.key, bare.global_shape, bare.global_offset, bare.replica_id) == (
        "my.key",
        (4, 3),
        (2, 0),
        (1, 0),
    )
    text = repr(st)
    assert "my.key" in text and "(2, 3)" in text and "(4, 3)" in text and "(2, 0)" in text
    assert "replica_id=(1, 0)" in text
    assert "12345" not in text and "tensor" not in text


def test_sharded_types_are_sharded_base():
    assert isinstance(make(), ShardedBase)
    assert isinstance(ShardedObject("o", 1, (1,), (0,)), ShardedBase)
    factory = ShardedTensorFactory("f", torch.zeros(1), lambda *a: None, lambda x: x)
    assert isinstance(factory, ShardedBase)
    assert not isinstance(LocalNonpersistentObject(1), ShardedBase)
    with pytest.raises(TypeError):
        ShardedBase()  # type: ignore[abstract]


# ShardedObject


def test_sharded_object_unique_key_round_trip():
    so = ShardedObject("optimizer/state.rng", {"x": 1}, (2, 4), (1, 3), replica_id=2)
    assert so.unique_key == "optimizer/state.rng/shard_1.3_2.4"
    back = ShardedObject.empty_from_unique_key(so.unique_key, replica_id=5)
    assert back.key == "optimizer/state.rng"
    assert back.global_shape == (2, 4) and back.global_offset == (1, 3)
    assert back.data is None and back.replica_id == 5
    assert back.unique_key == so.unique_key
    assert back == ShardedObject(so.key, None, (2, 4), (1, 3), replica_id=5)


def test_sharded_object_scalar_grid_round_trip():
    so = ShardedObject("k", "v", (), ())
    assert so.unique_key == "k/shard__"
    back = ShardedObject.empty_from_unique_key("k/shard__")
    assert back.global_shape == () and back.global_offset == ()


@pytest.mark.parametrize(
    "unique_key", ["no_slash", "k/shard_1_2_3", "k/piece_1_2", "k/shard_a_2", "k/shard_1.2"]
)
def test_empty_from_unique_key_rejects_malformed(unique_key):
    with pytest.raises(ValueError, match="not a ShardedObject unique key") as info:
        ShardedObject.empty_from_unique_key(unique_key)
    assert repr(unique_key) in str(info.value)


@pytest.mark.parametrize(
    ("shape", "offset", "message"),
    [
        ((2, 2), (0,), "different numbers of axes"),
        ((2, 2), (0, 2), "outside global_shape"),
        ((3,), (-1,), "outside global_shape"),
    ],
)
def test_sharded_object_validation(shape, offset, message):
    with pytest.raises(ValueError, match=message) as info:
        ShardedObject("obj.key", None, shape, offset)
    assert "'obj.key'" in str(info.value)


def test_sharded_object_without_data():
    payload = object()
    so = ShardedObject("o", payload, (4,), (3,), replica_id=1)
    bare = so.without_data()
    assert bare.data is None and so.data is payload
    assert (bare.key, bare.global_shape, bare.global_offset, bare.replica_id) == (
        "o",
        (4,),
        (3,),
        1,
    )


# Factories


def split_in_two(key, data, replica_id, flattened_range):
    """A factory build: the tensor saved as two halves under their own keys."""
    top, bottom = torch.chunk(data, 2)
    return {
        "top": ShardedTensor.from_rank_offsets(f"{key}.top", top, replica_id=replica_id),
        "bottom": [ShardedTensor.from_rank_offsets(f"{key}.bottom", bottom, replica_id=replica_id)],
    }


def join_halves(loaded):
    return torch.cat([loaded["top"], loaded["bottom"][0]])


def test_factory_build_calls_build_fn_with_its_fields():
    calls = []

    def build_fn(*args):
        calls.append(args)
        return "built"

    data = torch.ones(2)
    factory = ShardedTensorFactory("f", data, build_fn, lambda x: x, replica_id=(0, 3))
    assert factory.build() == "built"
    assert calls == [("f", data, (0, 3), None)]
    factory.validate_metadata_integrity()  # nothing to check: does not raise
    bare = factory.without_data()
    assert bare.data is None and bare.build_fn is build_fn and factory.data is data


def test_apply_factories_and_merges_round_trip():
    weight = torch.arange(8.0).reshape(4, 2)
    factory = ShardedTensorFactory("layer.w", weight, split_in_two, join_halves)
    plain = ShardedTensor.from_rank_offsets("layer.b", torch.zeros(2))
    sd = {"model": {"w": factory, "b": plain, "n": 3}, "list": [factory, "x"]}
    original = {"model": dict(sd["model"]), "list": list(sd["list"])}

    apply_factories(sd)
    built = sd["model"]["w"]
    assert set(built) == {"top", "bottom"}
    assert built["top"].key == "layer.w.top" and built["bottom"][0].key == "layer.w.bottom"
    assert torch.equal(built["top"].data, weight[:2])
    assert sd["model"]["b"] is plain and sd["model"]["n"] == 3
    assert isinstance(sd["list"][0], dict) and sd["list"][1] == "x"

    # What a restore would load for the built state: tensors where the descriptions were.
    loaded = {
        "model": {"w": {"top": weight[:2] * 10, "bottom": [weight[2:] * 10]}, "b": "B", "n": 3},
        "list": [{"top": weight[:2], "bottom": [weight[2:]]}, "x"],
        "extra": 1,
    }
    merged = apply_factory_merges(loaded, original)
    assert merged is loaded
    assert torch.equal(merged["model"]["w"], weight * 10)
    assert torch.equal(merged["list"][0], weight)
    assert merged["model"]["b"] == "B" and merged["list"][1] == "x" and merged["extra"] == 1


def test_apply_factory_merges_at_the_root():
    factory = ShardedTensorFactory("f", torch.zeros(1), split_in_two, lambda x: ("merged", x))
    assert apply_factory_merges(7, factory) == ("merged", 7)


def test_apply_factories_leaves_non_factories():
    sd = {"a": [1, (2, 3)], "b": {"c": "d"}}
    apply_factories(sd)
    assert sd == {"a": [1, (2, 3)], "b": {"c": "d"}}


def factory(key: str) -> ShardedTensorFactory:
    return ShardedTensorFactory(key, torch.zeros(2), split_in_two, join_halves)


@pytest.mark.parametrize(
    ("loaded", "factories", "message"),
    [
        ({"m": {}}, {"m": {"w": factory("fac.w")}}, "key 'm/w'.*'fac.w'.*missing"),
        ({"m": 5}, {"m": {"w": factory("fac.w")}}, "expected a dict at 'm'.*'fac.w'.*got int"),
        ({"l": [1]}, {"l": [2, factory("fac.l")]}, "list of 2 at 'l'.*'fac.l'.*got a list of 1"),
        ({"l": "s"}, {"l": [factory("fac.l")]}, "list of 1 at 'l'.*'fac.l'.*got str"),
        ([], [factory("fac.r")], "list of 1 at '<root>'.*'fac.r'"),
    ],
)
def test_apply_factory_merges_structure_mismatch(loaded, factories, message):
    with pytest.raises(ValueError, match=message):
        apply_factory_merges(loaded, factories)


def test_apply_factory_merges_ignores_missing_parts_without_factories():
    loaded = {"a": 1}
    assert apply_factory_merges(loaded, {"a": 2, "b": {"c": 3}, "d": [4]}) == {"a": 1}


# LocalNonpersistentObject


def test_local_nonpersistent_object_unwraps():
    value = {"step": 3}
    wrapped = LocalNonpersistentObject(value)
    assert wrapped.unwrap() is value and wrapped.obj is value


def test_package_exports():
    for name in sharding.__all__:
        assert hasattr(sharding, name), name
    assert sharding.ReplicaId == int | tuple[int, ...]
    assert ShardedStateDict.__origin__ is dict
    assert StateDict.__origin__ is dict
