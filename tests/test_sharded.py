"""Sharded tensors and objects: stored once as pieces of one global value, restored into any
sharding (real processes, gloo on CPU), and the strategy layer that writes and reads them."""

from __future__ import annotations

import pytest
import torch

from manifest import ShardedObjectEntry, ShardedTensorEntry
from snapshot import IncompatibleSnapshotError, Options, Snapshot, SnapshotError, StateDict
from snapshot._engine.dist.replication import Desc, crc_of, decide, joined
from snapshot._engine.handlers import sharded
from snapshot._engine.handlers.geometry import runs
from snapshot._engine.take.commit import MANIFEST_NAME
from snapshot.sharding import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from snapshot.strategies import base
from snapshot.strategies.base import StrategyAction, get_default_strategy
from snapshot.strategies.default import (
    SnapshotLoadStrategy,
    SnapshotSaveCommonStrategy,
    SnapshotSaveStrategy,
)
from storage_plugins import register_storage_plugin
from tests.multirank import run_ranks
from tests.plugins import LOGS, RecordingPlugin

ROWS, COLS = 16, 12
G = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
R = torch.linspace(-1, 1, 40).reshape(8, 5)  # replicated on every rank


def _by_rows(rank: int, world: int, data: torch.Tensor | None = None) -> ShardedTensor:
    n = ROWS // world
    piece = G[rank * n : (rank + 1) * n].clone() if data is None else data
    return ShardedTensor.from_rank_offsets("w", piece, (0, rank, world))


def _by_cols(rank: int, world: int) -> ShardedTensor:
    n = COLS // world
    return ShardedTensor.from_rank_offsets("w", torch.zeros(ROWS, n), (1, rank, world))


def _take(rank: int, world: int, path: str) -> None:
    replicated = ShardedTensor.from_rank_offsets("r", R.clone(), replica_id=rank)
    state = StateDict(w=_by_rows(rank, world), r=replicated, step=7)
    # step is the same on every rank: restorable on ranks the snapshot did not have.
    # Several chunks per shard: runs cross them.
    Snapshot.take(path, {"m": state}, replicated=["m/step"], options=Options(chunk_bytes=64))


def _restore(rank: int, world: int, path: str, layout: str) -> int:
    """Restores into ``layout`` ("rows" or "cols"); returns the data bytes this rank read."""
    register_storage_plugin("recording", RecordingPlugin)
    target = (
        _by_cols(rank, world)
        if layout == "cols"
        else _by_rows(rank, world, torch.zeros(ROWS // world, COLS))
    )
    replicated = ShardedTensor.from_rank_offsets("r", torch.zeros(8, 5), replica_id=rank)
    state = StateDict(w=target, r=replicated, step=0)
    # Ask for exactly the overlapping bytes.
    Snapshot(f"recording://{path}").restore({"m": state}, options=Options(read_gap_bytes=0))
    region = target.global_slice()
    assert torch.equal(state["w"], G[region]), f"rank {rank}: {state['w']} != {G[region]}"
    assert torch.equal(state["r"], R) and state["step"] == 7
    log = LOGS[path]
    return sum(n for blob, _, n in log.reads if blob != "manifest.yaml")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("saved", "restored", "layout"),
    [(4, 2, "rows"), (4, 4, "cols"), (2, 4, "rows"), (2, 2, "cols")],
    ids=["4to2-dim0", "dim0-to-dim1", "2to4-dim0", "2-dim0-to-dim1"],
)
def test_resharding_matrix(tmp_path, saved, restored, layout):
    path = str(tmp_path / "snap")
    run_ranks(saved, _take, path)
    entry = Snapshot(path).get_manifest()["0/m/w"]
    assert isinstance(entry, ShardedTensorEntry) and entry.shape == (ROWS, COLS)
    assert [s.offsets for s in entry.shards] == [(i * ROWS // saved, 0) for i in range(saved)]
    read = run_ranks(restored, _restore, path, layout)
    # Each rank read its region's bytes, and the replicated tensor (stored once), nothing more.
    region_bytes = G.numel() * 4 // restored
    assert read == [region_bytes + R.numel() * 4] * restored


@pytest.mark.slow
def test_one_full_tensor_from_four_shards(tmp_path):
    path = str(tmp_path / "snap")
    run_ranks(4, _take, path)
    snap = Snapshot(path)
    assert torch.equal(snap.read_object("0/m/w"), G)
    out = torch.full((ROWS, COLS), -1.0, dtype=torch.float64)  # another dtype: cast on the way
    assert snap.read_object("3/m/w", obj_out=out) is out
    assert torch.equal(out, G.double())
    strided = torch.zeros(COLS, ROWS).t()  # not contiguous: read through a scratch tensor
    snap.read_object("1/m/w", obj_out=strided)
    assert torch.equal(strided, G)
    with pytest.raises(SnapshotError, match="global shape"):
        snap.restore({"m": StateDict(w=ShardedTensor.from_rank_offsets("w", torch.zeros(3, 3)))})


def test_runs_of_an_overlap():
    # A 4x6 box stored at (0, 0); the wanted box is columns 2..5 of rows 1..3.
    assert list(runs(((0, 0), (4, 6)), ((1, 2), (2, 3)))) == [(8, 0, 3), (14, 3, 3)]
    # Whole rows in both: one run.
    assert list(runs(((0, 0), (4, 6)), ((2, 0), (2, 6)))) == [(12, 0, 12)]
    assert list(runs(((0, 0), (4, 6)), ((4, 0), (2, 6)))) == []
    assert list(runs(((), ()), ((), ()))) == [(0, 0, 1)]


def _bad_cover(rank: int, world: int, path: str, how: str) -> str:
    if how == "overlap":  # both ranks claim the first half as main replicas
        st = ShardedTensor.from_rank_offsets("w", G[: ROWS // 2].clone(), (0, 0, 2))
    else:  # two thirds of the rows only
        n = ROWS // 4
        st = ShardedTensor.from_rank_offsets(
            "w", G[rank * n : (rank + 1) * n].clone(), (0, rank, 4)
        )
    with pytest.raises(SnapshotError) as caught:
        Snapshot.take(path, {"m": StateDict(w=st)})
    return str(caught.value)


@pytest.mark.parametrize("how", ["overlap", "gap"])
def test_main_replicas_must_cover_each_tensor_once(tmp_path, how):
    path = str(tmp_path / "snap")
    messages = run_ranks(2, _bad_cover, path, how)
    assert messages[0] == messages[1]
    assert "sharded tensor 'w'" in messages[0]
    expected = (
        "the main replicas of ranks 0 and 1 overlap"
        if how == "overlap"
        else "the main replicas held by ranks [0, 1] cover 96 of its 192 elements"
    )
    assert expected in messages[0]
    with pytest.raises(SnapshotError):
        Snapshot(path)  # nothing was committed


def _dtensors(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    Snapshot.take(
        path,
        {
            "m": StateDict(
                w=distribute_tensor(G, mesh, [Shard(0)]),
                r=distribute_tensor(R, mesh, [Replicate()]),
            )
        },
    )
    w = distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(1)])
    r = distribute_tensor(torch.zeros(8, 5), mesh, [Replicate()])
    state = StateDict(w=w, r=r)
    Snapshot(path).restore({"m": state})
    assert state["w"] is w and torch.equal(w.full_tensor(), G)
    assert torch.equal(w.to_local(), G[:, rank * 3 : (rank + 1) * 3])
    assert torch.equal(r.to_local(), R)


@pytest.mark.slow
def test_dtensor_round_trip_into_another_placement(tmp_path):
    path = str(tmp_path / "snap")
    run_ranks(4, _dtensors, path)
    manifest = Snapshot(path).get_manifest()
    entry = manifest["2/m/w"]
    assert isinstance(entry, ShardedTensorEntry) and entry.key == "m/w"
    assert len(entry.shards) == 4
    assert len(manifest["0/m/r"].shards) == 1  # replicated: written by one rank only
    assert torch.equal(Snapshot(path).read_object("0/m/w"), G)


def _stages(rank: int, world: int, path: str) -> str:
    """Two pipeline stages on a ("pp", "dp") mesh of 2x1: each rank's DTensors are on its own
    "dp" submesh; "own" is another tensor on each stage, "shared" the same one on both (a copy
    of one piece, as a head sharded on mesh["dp"] alone is on each tp rank). Then the take's
    messages for copies of "shared" that differ (in one element's sign: the CRCs differ) and
    for a Partial DTensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
    sub = mesh["dp"]
    own = distribute_tensor(torch.full((4, 3), float(rank + 1)), sub, [Shard(0)])
    shared = distribute_tensor(R, sub, [Shard(0)])
    Snapshot.take(path, {"m": StateDict(**{f"stage{rank}": own, "shared": shared})})
    own = distribute_tensor(torch.zeros(4, 3), sub, [Shard(0)])
    shared = distribute_tensor(torch.zeros(8, 5), sub, [Shard(0)])
    Snapshot(path).restore({"m": StateDict(**{f"stage{rank}": own, "shared": shared})})
    assert torch.equal(own.to_local(), torch.full((4, 3), float(rank + 1)))
    assert torch.equal(shared.to_local(), R)
    unequal = R.clone()
    if rank:
        unequal[-1, -1] *= -1
    shared = distribute_tensor(unequal, sub, [Shard(0)])
    with pytest.raises(SnapshotError) as differ:
        Snapshot.take(f"{path}-differ", {"m": StateDict(shared=shared, other=own)})
    partial = DTensor.from_local(torch.ones(3), init_device_mesh("cpu", (world,)), [Partial()])
    with pytest.raises(SnapshotError) as refused:
        Snapshot.take(f"{path}-partial", {"m": StateDict(p=partial)})
    return str(differ.value), str(refused.value)


@pytest.mark.slow
def test_dtensors_on_submeshes_are_stored_once_per_piece(tmp_path):
    # A piece held by several ranks on submeshes is written by the lowest of them; the stages'
    # own tensors (on the submeshes of the other pp coordinate too) by their rank.
    path = str(tmp_path / "snap")
    messages = run_ranks(2, _stages, path)
    manifest = Snapshot(path).get_manifest()
    shared = manifest["0/m/shared"]
    assert isinstance(shared, ShardedTensorEntry) and manifest["1/m/shared"] == shared
    assert [c.blob.split("/")[0] for s in shared.shards for c in s.chunks] == ["0"]
    assert sum(c.nbytes for s in shared.shards for c in s.chunks) == R.numel() * 4
    assert torch.equal(Snapshot(path).read_object("1/m/stage1"), torch.full((4, 3), 2.0))
    for rank, (differ, message) in enumerate(messages):
        assert differ == messages[0][0]
        assert (
            "the copies of DTensor 'm/shared' at [0, 0] size [8, 5] differ: rank 0's is " in differ
        )
        assert (
            "not equal to that of ranks [1]; the copies of a DTensor's piece (on the ranks "
            in differ
        )
        assert "outside its submesh, or along its Replicate mesh dimensions) must be" in differ
        assert f"{rank}/m/p: a DTensor with placement P(sum)" in message
        assert "cannot be stored; reduce it first, e.g. value.redistribute(" in message
    with pytest.raises(SnapshotError):
        Snapshot(f"{path}-differ")  # nothing was committed
    assert not (tmp_path / "snap-differ" / MANIFEST_NAME).exists()


def test_copies_on_submeshes_are_confirmed_by_their_crcs():
    # Copies are written once, and their CRC-32s compared after writing; the replicated leaves'
    # BLAKE2b ("m/r", on both ranks) are confirmed before, on their own. A piece no other rank
    # holds ("m/own") is not read.
    def info(rank: int) -> dict:
        copied = ("m/w", "float32", (4,), (0,), (4,), True, f"{rank}/m/w", True)
        own = ("m/own", "float32", (2,), (rank,), (1,), True, f"{rank}/m/own", True)
        t = Desc("float32[4]", (16,), None)
        return {"marked": {}, "prints": {"m/r": (t, 3)}, "own_bytes": 16,
                "pieces": [copied, own]}  # fmt: skip

    pending = decide("snap", [info(0), info(1)])
    assert pending.to_confirm == ["m/r"]
    w, r = torch.arange(4.0), torch.ones(4)
    assert pending.digests({"m/r": r, "m/w": w}) == joined({"m/r": r}, ["m/r"])
    sent = pending.copy_crcs({"m/r": r, "m/w": w}, 0)
    assert sent == crc_of(w).to_bytes(8, "big")
    assert pending.copy_crcs({"m/r": r, "m/w": w}, 1) == sent  # ("m/own" is not asked for)
    decision = pending.confirm([b"R" * 8, b"R" * 8])
    assert decision.copies == {"1/m/w"} and list(decision.replicated) == ["m/r"]
    pending.check_copies([b"W" * 8, b"W" * 8])
    with pytest.raises(SnapshotError, match=r"'m/w' at \[0\] size \[4\] differ: rank 0's is not"):
        pending.check_copies([b"W" * 8, b"X" * 8])


def test_copies_are_written_by_the_holder_with_the_fewest_bytes_so_far():
    # Rank 0 holds 40 bytes of its own; the copied boxes (held by both) go largest first to the
    # rank with the fewest bytes so far, ties to the lower rank.
    def piece(key: str, n: int, rank: int, copied: bool = True) -> tuple:
        return (key, "float32", (n,), (0,), (n,), True, f"{rank}/{key}", copied)

    pieces = [
        [piece("own", 10, 0, copied=False), piece("a", 8, 0), piece("b", 4, 0), piece("c", 4, 0)],
        [piece("a", 8, 1), piece("b", 4, 1), piece("c", 4, 1)],
    ]
    found = sharded.copies(pieces)
    writers = {box[0]: holders[0][0] for box, holders in found.items()}
    assert writers == {"a": 1, "b": 1, "c": 0}  # loads 40/0 -> 40/32 -> 40/48 -> 56/48
    assert [sorted(h) for h in found.values()] == [[(0, "0/a"), (1, "1/a")]] + [
        [(0, f"0/{k}"), (1, f"1/{k}")] for k in "bc"
    ]


def test_small_values_are_compared_by_their_bytes():
    # A value of at most 64 bytes (an optimizer's step count) is described by its bytes, final:
    # nothing left to confirm, so the take makes no agreement for it.
    from snapshot._engine.dist.replication import describe
    from snapshot._engine.take.plan import collect

    def facts(step: float, big: torch.Tensor):
        state = {"step": torch.tensor(step), "big": big}
        c = collect([("o", state)], rank=0, prepare=None, replicated=[], inline_max_bytes=0,
                    chunk_bytes=1 << 20, reuse=None)  # fmt: skip
        f = describe(c, "0/")
        return {"marked": f.marked, "prints": f.prints, "own_bytes": 0}

    big = torch.arange(100.0)
    pending = decide("snap", [facts(3.0, big), facts(3.0, big.clone())])
    assert set(pending.replicated) == {"o/step", "o/big"} and pending.to_confirm == ["o/big"]
    pending = decide("snap", [facts(3.0, big), facts(-3.0, big)])
    assert "o/step" not in pending.replicated
    # -0.0 and 0.0 are equal numbers but different bytes: not one value.
    assert "o/step" not in decide("snap", [facts(0.0, big), facts(-0.0, big)]).replicated


def test_strided_layouts_are_stored_when_their_pieces_are_boxes():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from snapshot._engine.handlers.sharded import _layout_problem

    # FSDP2 over TP (rows split by tp, then by dp within each tp piece): boxes, even uneven.
    for tp in (2, 4):
        fsdp_tp = (_StridedShard(0, split_factor=tp), Shard(0))
        assert _layout_problem((10, 6), (2, tp), fsdp_tp) is None
    # Rows {0, 2}, {1, 3}, {4, 6}, {5, 7}: not boxes.
    problem = _layout_problem((8, 3), (2, 2), (Shard(0), _StridedShard(0, split_factor=2)))
    assert problem is not None and "not one box" in problem


def _objects(rank: int, world: int, path: str) -> None:
    own = ShardedObject("cfg", {"rank": rank}, (world,), (rank,))
    shared = ShardedObject("vocab", ["a", "b"], (1,), (0,), replica_id=rank)
    Snapshot.take(path, {"m": StateDict(own=own, shared=shared)})
    state = StateDict(
        own=ShardedObject("cfg", None, (world,), (rank,)),
        shared=ShardedObject("vocab", None, (1,), (0,), replica_id=rank),
    )
    Snapshot(path).restore({"m": state})
    assert state["own"] == {"rank": rank} and state["shared"] == ["a", "b"]


def test_sharded_objects_are_written_once_and_found_by_every_replica(tmp_path):
    path = str(tmp_path / "snap")
    run_ranks(2, _objects, path)
    manifest = Snapshot(path).get_manifest()
    shared = {manifest[f"{r}/m/shared"] for r in range(2)}
    assert len(shared) == 1 and isinstance(next(iter(shared)), ShardedObjectEntry)
    assert manifest["1/m/own"].key == "cfg/shard_1_2"


def test_factories_and_nonpersistent_values(tmp_path):
    def build(key, data, replica_id, flattened_range):
        half = data.shape[0] // 2
        return {
            "lo": ShardedTensor.from_rank_offsets(f"{key}.lo", data[:half]),
            "hi": ShardedTensor.from_rank_offsets(f"{key}.hi", data[half:]),
        }

    def merge(parts):
        return torch.cat([parts["lo"], parts["hi"]])

    data = torch.arange(10.0)
    state = StateDict(
        f=ShardedTensorFactory("split", data, build, merge),
        tmp=LocalNonpersistentObject("taken"),
    )
    path = str(tmp_path / "snap")
    Snapshot.take(path, {"m": state})
    manifest = Snapshot(path).get_manifest()
    assert manifest["0/m/f/lo"].key == "split.lo" and manifest["0/m/tmp"].value is None
    target = StateDict(
        f=ShardedTensorFactory("split", torch.zeros(10), build, merge),
        tmp=LocalNonpersistentObject("mine"),
    )
    Snapshot(path).restore({"m": target})
    assert torch.equal(target["f"], data) and target["tmp"] == "mine"


# ---------------------------------------------------------------------------------------------
# The strategy layer.


def test_snapshots_record_and_check_their_strategies(tmp_path, monkeypatch):
    path = str(tmp_path / "snap")
    Snapshot.take(path, {"m": StateDict(w=ShardedTensor.from_rank_offsets("w", G.clone()))})
    snap = Snapshot(path)
    assert snap.metadata.info["strategies"] == {
        "sharded": ["statesnap", 1],
        "common": ["statesnap", 1],
    }
    loaders = base.default_strategies[StrategyAction.LOAD_SHARDED.value]
    # A library whose loader reads version 2 only, registered for what this snapshot records.
    monkeypatch.setitem(loaders, ("statesnap", 1), SnapshotLoadStrategy(versions=(2,)))
    with pytest.raises(IncompatibleSnapshotError, match="cannot load version 1"):
        snap.restore({"m": StateDict(w=torch.zeros(ROWS, COLS))})
    # ... or none registered for it at all.
    monkeypatch.delitem(loaders, ("statesnap", 1))
    monkeypatch.setitem(loaders, ("statesnap", 2), SnapshotLoadStrategy(versions=(2,)))
    with pytest.raises(IncompatibleSnapshotError, match="registered: statesnap v2"):
        snap.restore({"m": StateDict(w=torch.zeros(ROWS, COLS))})


def test_registry(monkeypatch):
    get_default_strategy(StrategyAction.SAVE_SHARDED, "statesnap", 1)  # built-ins registered
    monkeypatch.setattr(base, "default_strategies", base.defaultdict(dict))
    saver = SnapshotSaveStrategy("mine", 3)
    base.register_default_strategy(StrategyAction.SAVE_SHARDED, "mine", 3, saver)
    assert get_default_strategy(StrategyAction.SAVE_SHARDED, "mine", 3) is saver
    assert str(saver) == "SnapshotSaveStrategy(mine, 3)" and saver.can_handle_sharded_objects
    with pytest.raises(IncompatibleSnapshotError, match="registered: mine v3"):
        get_default_strategy(StrategyAction.SAVE_SHARDED, "mine", 4)
    with pytest.raises(TypeError, match="LoadStrategyBase"):
        base.register_default_strategy(StrategyAction.LOAD_SHARDED, "mine", 3, saver)
    with pytest.raises(TypeError, match="StrategyAction"):
        base.register_default_strategy("save_sharded", "mine", 3, saver)  # type: ignore[arg-type]
    assert [a.value for a in StrategyAction] == [
        "load_common",
        "load_sharded",
        "save_common",
        "save_sharded",
    ]


def test_the_strategy_api(tmp_path):
    loader = SnapshotLoadStrategy()
    sd = {"w": ShardedTensor.from_rank_offsets("w", G.clone()), "step": 3}
    request = SnapshotSaveStrategy().async_save(sd, tmp_path / "a")
    sd["w"].data.zero_()  # captured at the call: the snapshot holds G
    request.execute_sync()
    SnapshotSaveStrategy().save({"x": torch.ones(2)}, tmp_path / "b")
    loaded = loader.load(
        {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(ROWS, COLS)), "step": 0},
        tmp_path / "a",
    )
    assert torch.equal(loaded["w"], G) and loaded["step"] == 3
    meta = loader.load_tensors_metadata(tmp_path / "a")
    assert list(meta) == ["w"] and meta["w"].global_shape == (ROWS, COLS)
    assert meta["w"].data is None and meta["w"].dtype == torch.float32
    assert loader.load_sharded_metadata(tmp_path / "b") == {}
    with pytest.raises(SnapshotError, match="never changed in place"):
        loader.remove_sharded_tensors(tmp_path / "a", "w")
    loader.check_backend_compatibility("statesnap")
    with pytest.raises(IncompatibleSnapshotError):
        loader.check_backend_compatibility("torch_dist")

    common = SnapshotSaveCommonStrategy()
    common.save_common({"lr": 0.1, "names": ["a"]}, tmp_path / "c")
    assert loader.load_common(tmp_path / "c") == {"lr": 0.1, "names": ["a"]}
    common.save_sharded_objects({"o": ShardedObject("o", [1, 2], (1,), (0,))}, tmp_path / "c")
    objects = loader.load_sharded_objects(
        {"o": ShardedObject("o", None, (1,), (0,))}, tmp_path / "c"
    )
    assert objects == {"o": [1, 2]}
    meta = loader.load_sharded_metadata(tmp_path / "c" / "sharded_objects")
    assert list(meta) == ["o/shard_0_1"]


@pytest.mark.slow
def test_a_take_without_dtensors_does_not_import_their_module(tmp_path):
    # Importing torch.distributed.tensor costs about half a second: only states holding
    # DTensors (which imported it already) may pay for it.
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from snapshot import Snapshot, StateDict\n"
        f"Snapshot.take({str(tmp_path / 'snap')!r}, {{'m': StateDict(w=torch.ones(3), o={{1}})}})\n"
        "print('torch.distributed.tensor' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _two_mains(rank: int, world: int, path: str) -> str:
    shared = ShardedObject("vocab", ["a"], (1,), (0,), replica_id=0)  # main on both ranks
    with pytest.raises(SnapshotError) as caught:
        Snapshot.take(path, {"m": StateDict(shared=shared)})
    return str(caught.value)


def test_a_sharded_object_needs_exactly_one_main_replica(tmp_path):
    messages = run_ranks(2, _two_mains, str(tmp_path / "snap"))
    assert messages[0] == messages[1]
    assert "sharded object 'vocab/shard_0_1' has 2 main replicas (on ranks [0, 1])" in messages[0]


def test_stored_shards_that_do_not_cover_their_tensor_are_corrupt(tmp_path):
    from tests.helpers import seal_manifest

    path = tmp_path / "snap"
    halves = StateDict(
        a=ShardedTensor.from_rank_offsets("w", G[:8].clone(), (0, 0, 2)),
        b=ShardedTensor.from_rank_offsets("w", G[8:].clone(), (0, 1, 2)),
    )
    Snapshot.take(str(path), {"m": halves})
    manifest = path / "manifest.yaml"
    lines = manifest.read_bytes().splitlines(keepends=True)[:-1]  # without the checksum line
    body = b"".join(lines)
    # Both entries list both shards; make the second shard of each start one row lower.
    damaged = body.replace(b'"offsets": [8, 0]', b'"offsets": [7, 0]')
    assert damaged != body
    manifest.write_bytes(seal_manifest(damaged))
    with pytest.raises(SnapshotError, match="do not cover its shape"):
        Snapshot(str(path)).read_object("0/m/a")


def test_a_piece_of_another_tensor_is_refused(tmp_path):
    path = str(tmp_path / "snap")
    Snapshot.take(path, {"m": StateDict(w=ShardedTensor.from_rank_offsets("w", G.clone()))})
    other = ShardedTensor.from_rank_offsets("v", torch.zeros(ROWS, COLS))
    with pytest.raises(SnapshotError, match="holds sharded tensor 'w' here; .* piece of 'v'"):
        Snapshot(path).restore({"m": StateDict(w=other)})


@pytest.mark.parametrize("gap", [0, 65536], ids=["runs", "boxes"])
def test_column_blocks_of_row_shards_in_one_process(tmp_path, gap):
    # Stored as two row blocks, read back as column blocks: with a gap allowance the reads go
    # through the gaps into scratch boxes (one strided copy each); without, run by run. 3-D too.
    g3 = torch.arange(4 * 6 * 8, dtype=torch.float32).reshape(4, 6, 8)
    stored = StateDict(
        a=ShardedTensor.from_rank_offsets("w", G[:8].clone(), (0, 0, 2)),
        b=ShardedTensor.from_rank_offsets("w", G[8:].clone(), (0, 1, 2)),
        c=ShardedTensor.from_rank_offsets("v", g3[:2].clone(), (0, 0, 2)),
        d=ShardedTensor.from_rank_offsets("v", g3[2:].clone(), (0, 1, 2)),
    )
    path = str(tmp_path / "snap")
    Snapshot.take(path, {"m": stored})
    strided = torch.zeros(COLS // 2, ROWS).t()  # not contiguous
    target = StateDict(
        a=ShardedTensor.from_rank_offsets("w", torch.zeros(ROWS, COLS // 2), (1, 0, 2)),
        b=ShardedTensor.from_rank_offsets("w", strided, (1, 1, 2)),
        c=ShardedTensor.from_rank_offsets(
            "v", torch.zeros(4, 6, 4, dtype=torch.float64), (2, 0, 2)
        ),
        d=ShardedTensor.from_rank_offsets("v", torch.zeros(4, 6, 4), (2, 1, 2)),
    )
    # dtype of a ShardedTensor is its data's: c asks for float64, cast on the way
    Snapshot(path).restore({"m": target}, options=Options(read_gap_bytes=gap))
    assert torch.equal(target["a"], G[:, : COLS // 2])
    assert torch.equal(target["b"], G[:, COLS // 2 :]) and target["b"] is strided
    assert torch.equal(target["c"], g3[:, :, :4].double())
    assert torch.equal(target["d"], g3[:, :, 4:])


def test_plan_region_reads_boxes_through_small_gaps():
    from manifest import Location, Shard
    from snapshot._engine.handlers.geometry import plan_region

    def shard(offsets, sizes, blob):
        n = sizes[0] * sizes[1] * 4
        return Shard(
            offsets=offsets, sizes=sizes, chunks=(Location(blob=blob, offset=0, nbytes=n),)
        )

    entry = ShardedTensorEntry(
        key="w",
        dtype="float32",
        shape=(8, 1024),
        shards=(shard((0, 0), (4, 1024), "0/0"), shard((4, 0), (4, 1024), "1/0")),
    )
    region = ((0, 256), (8, 256))  # columns 256..511 of every row: 1 KiB of each 4 KiB row
    direct, boxes = plan_region(entry, region, 4, 1 << 20, gap_bytes=0, box_bytes=1 << 20)
    assert not boxes and len(direct) == 8 and sum(p.nbytes for p in direct) == 8 * 1024
    direct, boxes = plan_region(entry, region, 4, 1 << 20, gap_bytes=4096, box_bytes=1 << 20)
    assert not direct and len(boxes) == 2
    # Each box spans from its first wanted byte to its last: 3 gaps of 3 KiB read through.
    assert [sum(p.nbytes for p in b.pieces) for b in boxes] == [4 * 1024 + 3 * 3072] * 2
    assert boxes[1].at == (4, 0) and boxes[1].sizes == (4, 256)
    # A small box budget cuts a box along its first axis.
    direct, boxes = plan_region(entry, region, 4, 1 << 20, gap_bytes=4096, box_bytes=8192)
    assert [b.sizes for b in boxes] == [(2, 256)] * 4


def test_a_piece_cannot_be_restored_from_a_whole_tensor(tmp_path):
    path = str(tmp_path / "snap")
    Snapshot.take(path, {"m": StateDict(w=G.clone())})
    piece = ShardedTensor.from_rank_offsets("w", torch.zeros(ROWS // 2, COLS), (0, 0, 2))
    with pytest.raises(SnapshotError, match=r"0/m/w: the snapshot holds a whole tensor here"):
        Snapshot(path).restore({"m": StateDict(w=piece)})
    assert torch.equal(piece.data, torch.zeros(ROWS // 2, COLS))  # nothing was read into it


# ---------------------------------------------------------------------------------------------
# torch's own ShardedTensor (torch.distributed._shard: FSDP1's SHARDED_STATE_DICT, torchrec).

U = torch.arange(6 * 4, dtype=torch.float64).reshape(6, 4)


def _torch_sharded(
    rank: int, boxes: dict[int, list[tuple[int, int]]], full: torch.Tensor, dim: int
):
    """A torch ShardedTensor of ``full`` whose shards on ``rank`` are the blocks ``(start,
    stop)`` along ``dim`` listed under it (several, or none)."""
    import warnings

    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards

    warnings.filterwarnings("ignore", "Please use DTensor", FutureWarning)
    local = []
    for start, stop in boxes.get(rank, []):
        offsets, sizes = [0] * full.dim(), list(full.shape)
        offsets[dim], sizes[dim] = start, stop - start
        block = full.narrow(dim, start, stop - start).clone()
        local.append(Shard(block, ShardMetadata(offsets, sizes, f"rank:{rank}/cpu")))
    return init_from_local_shards(local, *full.shape)


def _torch_sharded_take(rank: int, world: int, path: str) -> None:
    # w: rows in two halves, one per rank; u: three row blocks, two of them on rank 0.
    w = _torch_sharded(rank, {0: [(0, 8)], 1: [(8, 16)]}, G, 0)
    u = _torch_sharded(rank, {0: [(0, 2), (4, 6)], 1: [(2, 4)]}, U, 0)
    Snapshot.take(path, {"m": StateDict(w=w, u=u)})


def _torch_sharded_restore(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    # w into column blocks: two on rank 0, one on rank 1, none on rank 2; u into a DTensor.
    w = _torch_sharded(rank, {0: [(0, 4), (8, 12)], 1: [(4, 8)]}, torch.zeros(ROWS, COLS), 1)
    locals_before = [(s.tensor, s.tensor.data_ptr()) for s in w.local_shards()]
    mesh = init_device_mesh("cpu", (world,))
    u = distribute_tensor(torch.zeros(6, 4, dtype=torch.float64), mesh, [Shard(0)])
    state = StateDict(w=w, u=u)
    Snapshot(path).restore({"m": state})
    assert state["w"] is w and state["u"] is u
    for (tensor, address), shard in zip(locals_before, w.local_shards(), strict=True):
        assert shard.tensor is tensor and tensor.data_ptr() == address  # filled in place
        start = shard.metadata.shard_offsets[1]
        assert torch.equal(tensor, G[:, start : start + 4])
    assert torch.equal(u.full_tensor(), U)
    plain = StateDict(w=torch.zeros(ROWS, COLS, dtype=torch.float64), u=None)
    Snapshot(path).restore({"m": plain})
    assert torch.equal(plain["w"], G.double()) and torch.equal(plain["u"], U)


@pytest.mark.slow
def test_torch_sharded_tensors_are_stored_as_pieces_and_restored_into_any_sharding(tmp_path):
    path = str(tmp_path / "snap")
    run_ranks(2, _torch_sharded_take, path)
    snap = Snapshot(path)
    manifest = snap.get_manifest()
    for rank in range(2):
        entry = manifest[f"{rank}/m/u"]
        assert isinstance(entry, ShardedTensorEntry) and entry.key == "m/u"
        assert [s.offsets for s in entry.shards] == [(0, 0), (2, 0), (4, 0)]
    assert torch.equal(snap.read_object("0/m/w"), G) and torch.equal(snap.read_object("1/m/u"), U)
    # On 3 ranks (one the snapshot did not have) into other shardings and kinds.
    run_ranks(3, _torch_sharded_restore, path)


def _torch_sharded_refusals(rank: int, world: int, path: str) -> list[str]:
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor as TorchSharded
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    messages = []
    w = _torch_sharded(rank, {0: [(0, 8)], 1: [(8, 16)]}, G, 0)
    mesh = init_device_mesh("cpu", (world,))
    d = distribute_tensor(G, mesh, [Shard(0)])
    # Inside a value stored whole (a dict with a tuple key is pickled), a sharded tensor's
    # pickle would need this job's process group at restore: refused at take, even with its
    # types allowed, which is what the safe loader would otherwise ask for.
    for held in (w, d):
        with (
            torch.serialization.safe_globals([TorchSharded]),
            pytest.raises(SnapshotError) as caught,
        ):
            Snapshot.take(path, {"m": StateDict(o={(1, 2): held})})
        messages.append(str(caught.value))
    # Two ranks holding the same box (as two HSDP replica groups do: each its own
    # ShardedTensor, on a group of its own): no replicas to tell which copy is written.
    import torch.distributed as dist
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard as TorchShard
    from torch.distributed._shard.sharded_tensor import init_from_local_shards

    groups = [dist.new_group([r]) for r in range(world)]
    box = ShardMetadata([0, 0], [ROWS, COLS], f"rank:{rank}/cpu")
    same = init_from_local_shards(
        [TorchShard(G.clone(), box)], ROWS, COLS, process_group=groups[rank]
    )
    with pytest.raises(SnapshotError) as caught:
        Snapshot.take(path, {"m": StateDict(w=same)})
    messages.append(str(caught.value))
    return messages


@pytest.mark.slow
def test_a_torch_sharded_tensor_never_makes_an_unrestorable_snapshot(tmp_path):
    path = str(tmp_path / "snap")
    messages = run_ranks(2, _torch_sharded_refusals, path)
    assert messages[0] == messages[1]
    whole_st, whole_dtensor, overlap = messages[0]
    assert "0/m/o: this dict is stored whole (pickled) and holds" in whole_st
    assert "torch.distributed._shard.sharded_tensor.api.ShardedTensor" in whole_st
    assert "Put sharded tensors at a leaf of the state dict" in whole_st
    assert "torch.distributed.tensor.DTensor" in whole_dtensor
    assert "the main replicas of ranks 0 and 1 overlap" in overlap
    assert "torch's ShardedTensor has no replicas" in overlap
    with pytest.raises(SnapshotError):
        Snapshot(path)  # nothing was committed
