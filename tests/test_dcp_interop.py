"""ShardedTensors through torch.distributed.checkpoint (DCP): the _Checkpointable hooks' answers,
and save/load round trips on 2 gloo ranks (resharding, several shards per rank, prepended axes)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import WriteItemType

from snapshot.sharding.checkpointable import (
    CheckpointableShardedTensor,
    LocalShardsContainer,
    to_dcp_state_dict,
)
from snapshot.sharding.mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor
from tests.multirank import run_ranks


def global_tensor(*shape: int, seed: int = 0) -> torch.Tensor:
    """Random float32 values (every bit pattern counts in a bitwise comparison), the same on
    every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def chunk(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


def row_block(full: torch.Tensor, block: int, n_blocks: int, key: str = "w") -> ShardedTensor:
    """Row block ``block`` of ``n_blocks`` of ``full`` (a copy), as a ShardedTensor."""
    rows = full.shape[0] // n_blocks
    data = full[block * rows : (block + 1) * rows].clone()
    return ShardedTensor.from_rank_offsets(key, data, (0, block, n_blocks))


def read_metadata(path: str) -> dict[str, TensorStorageMetadata]:
    md = dcp.FileSystemReader(path).read_metadata()
    return md.state_dict_metadata  # type: ignore[return-value]


# -- the hooks' answers (one process) ------------------------------------------------------


def test_wrapper_has_global_shape_and_shares_local_data():
    # DCP compares the value's size() with the stored global size before loading: it must be
    # the global shape, not the shard's.
    data = torch.zeros(4, 6, dtype=torch.float64)
    wrapped = CheckpointableShardedTensor.from_sh_ten(
        ShardedTensor.from_rank_offsets("w", data, (0, 1, 2))
    )
    assert wrapped.shape == (8, 6)
    assert wrapped.dtype == torch.float64 and wrapped.device == data.device
    assert wrapped.local_data is data
    assert wrapped.chunk == chunk((4, 0), (4, 6))


def test_write_items_place_the_shard_in_the_global_tensor():
    sh = ShardedTensor.from_rank_offsets("w", torch.zeros(4, 3), (0, 1, 2), (1, 1, 2))
    wrapped = CheckpointableShardedTensor.from_sh_ten(sh)
    (item,) = wrapped.__create_write_items__("fqn", wrapped, index=5)
    assert item.type == WriteItemType.SHARD
    assert item.index == MetadataIndex("fqn", (4, 3)) and item.index.index == 5
    assert item.tensor_data is not None
    assert item.tensor_data.chunk == chunk((4, 3), (4, 3))
    assert item.tensor_data.size == torch.Size([8, 6])
    assert item.tensor_data.properties.dtype == torch.float32
    assert wrapped.__create_chunk_list__() == [chunk((4, 3), (4, 3))]


@pytest.mark.parametrize("replica_id", [1, (0, 1), (2, 0)])
def test_only_the_main_replica_writes_but_every_replica_loads(replica_id):
    sh = ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6), (0, 0, 2), replica_id=replica_id)
    wrapped = CheckpointableShardedTensor.from_sh_ten(sh)
    assert wrapped.__create_write_items__("w", wrapped) == []
    assert wrapped.__create_chunk_list__() == [chunk((0, 0), (4, 6))]


def test_tensor_shard_is_the_data_and_loading_writes_into_it():
    data = torch.zeros(4, 6)
    wrapped = CheckpointableShardedTensor.from_sh_ten(
        ShardedTensor.from_rank_offsets("w", data, (0, 1, 2))
    )
    shard = wrapped.__get_tensor_shard__(MetadataIndex("w", (4, 0)))
    assert type(shard) is torch.Tensor and shard.shape == (4, 6)
    shard.narrow(0, 1, 2).copy_(torch.ones(2, 6))  # what DCP's reader does with a read item
    assert data.sum() == 12 and torch.equal(data[1:3], torch.ones(2, 6))
    with pytest.raises(ValueError, match=r"offset \(0, 0\).*holds the one at \(4, 0\)"):
        wrapped.__get_tensor_shard__(MetadataIndex("w", (0, 0)))


def test_prepended_axes_appear_as_size_one_axes():
    data = torch.zeros(3, 5)
    sh = ShardedTensor.from_rank_offsets("stack", data, (0, 2, 4), prepend_axis_num=1)
    wrapped = CheckpointableShardedTensor.from_sh_ten(sh)
    assert wrapped.shape == (4, 3, 5)
    (item,) = wrapped.__create_write_items__("stack", wrapped)
    assert item.tensor_data is not None and item.tensor_data.chunk == chunk((2, 0, 0), (1, 3, 5))
    assert item.tensor_data.size == torch.Size([4, 3, 5])
    assert wrapped.__create_chunk_list__() == [chunk((2, 0, 0), (1, 3, 5))]
    view = wrapped.__get_tensor_shard__(MetadataIndex("stack", (2, 0, 0)))
    assert view.shape == (1, 3, 5)
    view.fill_(7.0)
    assert torch.equal(data, torch.full((3, 5), 7.0))


def test_wrapper_rejects_data_that_does_not_fit():
    sh = ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6), (0, 0, 2))
    with pytest.raises(ValueError, match=r"'w'.*shape \(6, 4\).*local_shape is \(4, 6\)"):
        CheckpointableShardedTensor(torch.zeros(6, 4), sh)
    with pytest.raises(ValueError, match=r"'w'.*dtype torch.float16"):
        CheckpointableShardedTensor(torch.zeros(4, 6, dtype=torch.float16), sh)
    with pytest.raises(ValueError, match="'w' has no data tensor"):
        CheckpointableShardedTensor.from_sh_ten(sh.without_data())


def test_wrapper_ops_detach_and_copy_reach_the_data_and_others_are_refused():
    data = torch.zeros(4, 6)
    wrapped = CheckpointableShardedTensor.from_sh_ten(
        ShardedTensor.from_rank_offsets("w", data, (0, 1, 2))
    )
    detached = wrapped.detach()
    assert isinstance(detached, CheckpointableShardedTensor)
    assert detached.local_data.data_ptr() == data.data_ptr()
    assert detached.chunk == wrapped.chunk

    full = global_tensor(8, 6)
    wrapped.copy_(full)  # a full global tensor: this shard's box of it is copied
    assert torch.equal(data, full[4:])

    other = torch.full((4, 6), 3.0)
    wrapped.copy_(
        CheckpointableShardedTensor.from_sh_ten(
            ShardedTensor.from_rank_offsets("w", other, (0, 1, 2))
        )
    )
    assert torch.equal(data, other)

    elsewhere = CheckpointableShardedTensor.from_sh_ten(
        ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6), (0, 0, 2))
    )
    with pytest.raises(ValueError, match=r"at \(0, 0\).*into shard 'w' at \(4, 0\)"):
        wrapped.copy_(elsewhere)
    with pytest.raises(ValueError, match=r"global shape \(8, 6\), got \(4, 6\)"):
        wrapped.copy_(torch.zeros(4, 6))
    with pytest.raises(NotImplementedError, match="into a plain tensor"):
        torch.zeros(8, 6).copy_(wrapped)
    with pytest.raises(NotImplementedError, match=r"does not support aten\.add.*local_data"):
        wrapped + 1
    with pytest.raises(NotImplementedError, match=r"aten\.sum"):
        wrapped.sum()
    assert torch.equal(data, other)  # the refused ops changed nothing


def test_repr_describes_the_shard_without_reading_values():
    wrapped = CheckpointableShardedTensor.from_sh_ten(
        ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6), (0, 1, 2), replica_id=1)
    )
    text = repr(wrapped)
    assert "key='w'" in text and "global_shape=(8, 6)" in text
    assert "offsets=(4, 0)" in text and "sizes=(4, 6)" in text and "replica_id=1" in text
    container = LocalShardsContainer([wrapped])
    assert "shards=[(offsets=(4, 0), sizes=(4, 6))]" in repr(container)


# -- the container (one process) -------------------------------------------------------------


def three_blocks(replica_ids: tuple[int, ...] = (0, 0, 0)) -> LocalShardsContainer:
    """Row blocks 0, 2 and 3 (of 4) of a 8x6 tensor, each block filled with its number."""
    return LocalShardsContainer(
        [
            CheckpointableShardedTensor.from_sh_ten(
                ShardedTensor.from_rank_offsets(
                    "w", torch.full((2, 6), float(b)), (0, b, 4), replica_id=r
                )
            )
            for b, r in zip((0, 2, 3), replica_ids, strict=True)
        ]
    )


def test_container_delegates_chunks_and_write_items_in_shard_order():
    container = three_blocks(replica_ids=(0, 1, 0))
    assert container.shape == (8, 6)
    assert container.__create_chunk_list__() == [
        chunk((0, 0), (2, 6)),
        chunk((4, 0), (2, 6)),
        chunk((6, 0), (2, 6)),
    ]
    items = container.__create_write_items__("w", container)
    # Block 2 is not the main replica here; the hints are the shards' positions.
    assert [(tuple(i.index.offset), i.index.index) for i in items] == [((0, 0), 0), ((6, 0), 2)]


@pytest.mark.parametrize(
    "hint",
    [None, 1, 0, 7, -1],
    ids=["no-hint", "right-hint", "wrong-hint", "hint-out-of-range", "negative-hint"],
)
def test_container_finds_the_shard_by_offset_whatever_the_hint(hint):
    container = three_blocks()
    shard = container.__get_tensor_shard__(MetadataIndex("w", (4, 0), hint))
    assert torch.equal(shard, torch.full((2, 6), 2.0))
    assert shard.data_ptr() == container.local_shards[1].local_data.data_ptr()


def test_container_lookup_errors_name_the_offsets_held():
    container = three_blocks()
    with pytest.raises(ValueError, match=r"no shard on this rank at offset \(2, 0\).*\(4, 0\)"):
        container.__get_tensor_shard__(MetadataIndex("w", (2, 0), 1))
    with pytest.raises(ValueError, match="must name the shard by its offset"):
        container.__get_tensor_shard__(MetadataIndex("w"))
    with pytest.raises(NotImplementedError, match=r"LocalShardsContainer does not support"):
        container.detach()


def test_container_refuses_shards_of_different_tensors_or_the_same_box():
    def wrap(key: str, data: torch.Tensor, *rank_offsets: tuple[int, int, int]):
        return CheckpointableShardedTensor.from_sh_ten(
            ShardedTensor.from_rank_offsets(key, data, *rank_offsets)
        )

    a = wrap("w", torch.zeros(4, 6), (0, 0, 2))
    with pytest.raises(ValueError, match="at least one shard"):
        LocalShardsContainer([])
    with pytest.raises(ValueError, match="got Tensor"):
        LocalShardsContainer([a, torch.zeros(4, 6)])
    with pytest.raises(ValueError, match="pieces of one global tensor"):
        LocalShardsContainer([a, wrap("v", torch.zeros(4, 6), (0, 1, 2))])
    with pytest.raises(ValueError, match="pieces of one global tensor"):
        LocalShardsContainer([a, wrap("w", torch.zeros(4, 6), (0, 1, 3))])
    with pytest.raises(ValueError, match=r"both at offset \(0, 0\)"):
        LocalShardsContainer([a, wrap("w", torch.ones(4, 6), (0, 0, 2))])


# -- to_dcp_state_dict (one process) ---------------------------------------------------------


def test_to_dcp_state_dict_flattens_and_groups_shards_by_key():
    full = global_tensor(8, 6)
    b0, b2 = row_block(full, 0, 4), row_block(full, 2, 4)
    bias = ShardedTensor.from_rank_offsets("bias", torch.zeros(6))
    out = to_dcp_state_dict(
        {
            "model": {"w": [b0, b2], "bias": bias, "step": 3},
            "extra": [torch.ones(2), "text"],
            "local": LocalNonpersistentObject(object()),
        }
    )
    assert sorted(out) == ["bias", "extra.0", "extra.1", "model.step", "w"]
    assert isinstance(out["w"], LocalShardsContainer)
    assert [s.sharded_tensor for s in out["w"].local_shards] == [b0, b2]
    assert isinstance(out["bias"], CheckpointableShardedTensor)
    assert out["bias"].local_data is bias.data
    assert out["model.step"] == 3 and out["extra.1"] == "text"


def test_to_dcp_state_dict_refuses_clashes_and_other_sharded_leaves():
    sh = ShardedTensor.from_rank_offsets("a.b", torch.zeros(2))
    with pytest.raises(ValueError, match=r"\['a.b'\] name both"):
        to_dcp_state_dict({"t": sh, "a": {"b": 1}})
    obj = ShardedObject("obj", {"x": 1}, (2,), (0,))
    with pytest.raises(ValueError, match="'o' is a ShardedObject"):
        to_dcp_state_dict({"o": obj})


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_prepended_axis_stack_round_trips_and_reads_as_a_plain_tensor(tmp_path):
    # One process: four per-layer 3x5 tensors saved as layers of one 4x3x5 tensor.
    layers = global_tensor(4, 3, 5, seed=3)
    stack = [
        ShardedTensor.from_rank_offsets("stack", layers[i].clone(), (0, i, 4), prepend_axis_num=1)
        for i in range(4)
    ]
    path = str(tmp_path / "ckpt")
    dcp.save(to_dcp_state_dict({"layers": stack}), checkpoint_id=path, no_dist=True)
    md = read_metadata(path)["stack"]
    assert md.size == torch.Size([4, 3, 5])
    assert sorted(tuple(c.offsets) for c in md.chunks) == [(i, 0, 0) for i in range(4)]

    fresh = [
        ShardedTensor.from_rank_offsets("stack", torch.zeros(3, 5), (0, i, 4), prepend_axis_num=1)
        for i in range(4)
    ]
    dcp.load(to_dcp_state_dict({"layers": fresh}), checkpoint_id=path, no_dist=True)
    for i, sh in enumerate(fresh):
        assert torch.equal(sh.data, layers[i])

    # The stored tensor is an ordinary 4x3x5 tensor to DCP: a plain tensor loads it whole.
    plain = {"stack": torch.zeros(4, 3, 5)}
    dcp.load(plain, checkpoint_id=path, no_dist=True)
    assert torch.equal(plain["stack"], layers)


# -- 2 ranks ---------------------------------------------------------------------------------


def _sharded_and_replicated(rank: int, world: int, path: str) -> None:
    full, shared = global_tensor(8, 6, seed=1), global_tensor(3, 2, seed=2)
    state = {
        "model": {
            "w": row_block(full, rank, world),
            "rep": ShardedTensor.from_rank_offsets("rep", shared.clone(), replica_id=rank),
        }
    }
    dcp.save(to_dcp_state_dict(state), checkpoint_id=path)

    # The same sharding, into zeros.
    same = {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6), (0, rank, world)),
        "rep": ShardedTensor.from_rank_offsets("rep", torch.zeros(3, 2), replica_id=rank),
    }
    dcp.load(to_dcp_state_dict(same), checkpoint_id=path)
    assert torch.equal(same["w"].data, full[4 * rank : 4 * rank + 4])
    assert torch.equal(same["rep"].data, shared)  # every replica loads, not only the main one

    # Another sharding: columns instead of rows. DCP intersects our chunks with the stored ones.
    cols = ShardedTensor.from_rank_offsets("w", torch.zeros(8, 3), (1, rank, world))
    dcp.load(to_dcp_state_dict({"w": cols}), checkpoint_id=path)
    assert torch.equal(cols.data, full[:, 3 * rank : 3 * rank + 3])


@pytest.mark.slow
def test_two_ranks_save_shards_and_a_replica_and_load_them_resharded(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(2, _sharded_and_replicated, path)
    md = dcp.FileSystemReader(path).read_metadata()
    w, rep = md.state_dict_metadata["w"], md.state_dict_metadata["rep"]
    assert isinstance(w, TensorStorageMetadata) and isinstance(rep, TensorStorageMetadata)
    assert w.size == torch.Size([8, 6]) and w.properties.dtype == torch.float32
    assert sorted(tuple(c.offsets) for c in w.chunks) == [(0, 0), (4, 0)]
    assert all(tuple(c.sizes) == (4, 6) for c in w.chunks)
    # The replicated tensor was written once, by the main replica: rank 0 (files "__0_*").
    # (DCP would deduplicate identical items from both ranks too, but into whichever rank's
    # plan was smaller, here rank 1's: the file tells that rank 1 wrote nothing for it.)
    assert rep.size == torch.Size([3, 2]) and rep.chunks == [chunk((0, 0), (3, 2))]
    stored = [info for index, info in md.storage_data.items() if index.fqn == "rep"]
    assert len(stored) == 1 and stored[0].relative_path.startswith("__0_")
    writers = {os.path.basename(info.relative_path)[:4] for info in md.storage_data.values()}
    assert writers == {"__0_", "__1_"}  # both ranks wrote their own block of "w"


def _non_contiguous_blocks(rank: int, world: int, path: str) -> None:
    full = global_tensor(8, 6, seed=4)
    mine = (rank, rank + 2)  # rank 0: row blocks 0 and 2; rank 1: blocks 1 and 3
    state = to_dcp_state_dict({"w": [row_block(full, b, 4) for b in mine]})
    assert isinstance(state["w"], LocalShardsContainer)
    dcp.save(state, checkpoint_id=path)

    fresh = [ShardedTensor.from_rank_offsets("w", torch.zeros(2, 6), (0, b, 4)) for b in mine]
    # The shards in the other order: the lookup goes by offset, not by position.
    dcp.load(to_dcp_state_dict({"w": fresh[::-1]}), checkpoint_id=path)
    for b, sh in zip(mine, fresh, strict=True):
        assert torch.equal(sh.data, full[2 * b : 2 * b + 2])


@pytest.mark.slow
def test_two_ranks_round_trip_several_local_shards_each(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(2, _non_contiguous_blocks, path)
    w = read_metadata(path)["w"]
    assert w.size == torch.Size([8, 6])
    assert sorted(tuple(c.offsets) for c in w.chunks) == [(0, 0), (2, 0), (4, 0), (6, 0)]
