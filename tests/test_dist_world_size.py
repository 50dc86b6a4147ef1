"""Values equal on every rank are one value: stored once, restorable at another world size.

Real processes joined by gloo on the CPU (tests/multirank.py); each test spawns as few as it
can (the machine has 2 cores).
"""

from __future__ import annotations

import copy
import io
import os
import zlib
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import manifest as mf
from snapshot import (
    PathNotEmptyError,
    RankFailedError,
    Snapshot,
    SnapshotError,
    StateDict,
    StateMismatchError,
)
from snapshot._engine.dist.replication import (
    Desc,
    crc_of,
    decide,
    joined,
    strong_of,
)
from snapshot._engine.format.serialization import tensor_memoryview as tensor_bytes
from snapshot._engine.tools.inspection import disk_usage, list_entries
from tests.helpers import assert_same, raw_bytes
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow  # real processes (gloo); -m 'not slow' skips them

# -- DDP + Adam: taken on 2 ranks, restored on 1 and 3 with the defaults --------------------


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batch(scale: float) -> torch.Tensor:
    return torch.linspace(-1, 1, 8 * 16).view(8, 16) * scale


def _train(ddp: DDP, optim: torch.optim.Optimizer, x: torch.Tensor) -> None:
    optim.zero_grad()
    ddp(x).square().sum().backward()  # DDP averages the ranks' gradients
    optim.step()


def _pack(value: Any) -> bytes:
    """A rank's result as bytes: tensors put on the result queue as they are would travel
    through shared memory that the rank's exit frees."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _state(ddp: DDP, optim: torch.optim.Optimizer) -> tuple[dict, dict]:
    return copy.deepcopy(ddp.module.state_dict()), copy.deepcopy(optim.state_dict())


def _take_ddp_adam(rank: int, world: int, path: str) -> tuple[tuple[dict, dict], dict]:
    ddp = DDP(_mlp(0))
    optim = torch.optim.Adam(ddp.parameters(), lr=0.01)
    for step in range(2):
        _train(ddp, optim, _batch(rank + 1 + step))  # each rank its own data
    own = StateDict(rank=rank, seen=torch.full((3,), float(rank)))  # differs per rank
    Snapshot.take(path, {"model": ddp, "optim": optim, "own": own})
    taken = _state(ddp, optim)
    # Training goes on with the same batch on every rank: with 2 ranks DDP's average of two
    # equal gradients is exact, so the step is the one a single process takes.
    _train(ddp, optim, _batch(-0.5))
    return _pack((taken, copy.deepcopy(ddp.module.state_dict())))


def _restore_ddp_adam(rank: int, world: int, path: str) -> tuple[Any, Any, str | None]:
    ddp = DDP(_mlp(5))
    optim = torch.optim.Adam(ddp.parameters(), lr=0.01)
    Snapshot(path).restore({"model": ddp, "optim": optim})  # the defaults: no replicated=
    restored = _state(ddp, optim)
    _train(ddp, optim, _batch(-0.5))
    error = None
    try:
        Snapshot(path).restore({"own": StateDict()})
    except RankFailedError as e:
        error = str(e)
    return _pack((restored, copy.deepcopy(ddp.module.state_dict()), error))


@pytest.mark.parametrize("world", [1, 3])
def test_ddp_and_adam_taken_on_2_ranks_restore_on_1_and_3(tmp_path, world):
    path = str(tmp_path / "snap")
    taken = [_unpack(r) for r in run_ranks(2, _take_ddp_adam, path)]
    (model0, optim0), after0 = taken[0]
    assert_same(taken[1][0], (model0, optim0))  # DDP kept the ranks equal

    # Everything the ranks held in common is listed once, under rank 0, and read by any rank.
    snap = Snapshot(path)
    manifest = snap.get_manifest()
    assert snap._manifest.format_version == mf.REPLICATED_ONCE_VERSION
    for p in ("model/module.0.weight", "optim/state/0/exp_avg", "optim/state/0/step",
              "optim/param_groups/0/lr", "optim/param_groups/0/betas/0"):  # fmt: skip
        assert manifest[f"0/{p}"].replicated, p
        assert f"1/{p}" not in manifest, p
        assert_same(snap.read_object(f"1/{p}"), snap.read_object(f"0/{p}"))
    assert not manifest["1/optim/param_groups/0/betas"].replicated  # containers: each rank's
    assert not manifest["1/own/rank"].replicated and manifest["1/own/rank"].value == 1
    # Written once: the blobs hold the model and the Adam state once, not twice.
    tensors = [*model0.values(), *(t for s in optim0["state"].values() for t in s.values())]
    assert list_entries(snap._manifest).stored_bytes < sum(t.nbytes for t in tensors) + 1024

    results = [_unpack(r) for r in run_ranks(world, _restore_ddp_adam, path)]
    for restored, after, error in results:
        assert_same(restored, (model0, optim0))  # bitwise, on every rank, new ones too
        if world == 1:
            assert_same(after, after0)  # training goes on exactly as it would have
            assert error is None
        else:
            assert_same(after, results[0][1])  # the ranks stay equal
            for k, v in after.items():
                torch.testing.assert_close(v, after0[k], rtol=1e-5, atol=1e-6)
            # Rank 2 has no per-rank state of its own: every rank hears it, clearly.
            assert error is not None and "failed on rank(s) [2]" in error, error
            assert "app_state['own'] cannot be restored on rank 2" in error
            assert "taken on 2 ranks and is restored on 3" in error
            assert "Restore on 2 ranks" in error and "replicated=" in error
            assert "read_object('<rank>/own/" in error


# -- counters and 0-d tensors: taken on 2, restored on 4 ------------------------------------


def _progress(step: int) -> StateDict:
    return StateDict(
        step=step,
        loss_scale=torch.tensor(65536.0),
        epoch=torch.tensor(3),
        lrs=[0.1, 0.01],
        best=float("nan"),
        zero=-0.0,
    )


def _take_progress(rank: int, world: int, path: str) -> None:
    Snapshot.take(path, {"progress": _progress(1234)})


def _restore_progress(rank: int, world: int, path: str) -> bytes:
    state = StateDict(loss_scale=torch.tensor(0.0), epoch=torch.tensor(0))
    Snapshot(path).restore({"progress": state})
    return _pack(dict(state))


def test_a_progress_counter_and_0d_tensors_taken_on_2_restore_on_4(tmp_path):
    path = str(tmp_path / "snap")
    run_ranks(2, _take_progress, path)
    manifest = Snapshot(path).get_manifest()
    assert all(e.replicated for e in manifest.values() if not mf.is_container(e))
    assert sorted(p for p in manifest if p.startswith("1/")) == ["1/progress", "1/progress/lrs"]
    expected = dict(_progress(1234))
    for state in map(_unpack, run_ranks(4, _restore_progress, path)):
        assert_same({k: state[k] for k in expected}, expected)


# -- replicated= globs: the intersection of the ranks' --------------------------------------


def _different_globs(rank: int, world: int, path: str) -> bytes:
    torch.manual_seed(rank)  # "b" and "c" differ between the ranks
    state = StateDict(
        a=torch.arange(6.0),  # the same everywhere, marked by every rank
        b=torch.randn(6),  # marked by rank 0 only: not replicated, each rank keeps its own
        c=torch.randn(6),  # marked by rank 1 only
    )
    globs = ["s/a", "s/b"] if rank == 0 else ["s/a", "s/c"]
    snap = Snapshot.take(path, {"s": state}, replicated=globs)  # not an error
    out = StateDict(a=torch.zeros(6), b=torch.zeros(6), c=torch.zeros(6))
    snap.restore({"s": out})
    return _pack((dict(state), dict(out)))


def test_replicated_globs_are_the_intersection_of_the_ranks_globs(tmp_path):
    path = str(tmp_path / "snap")
    results = [_unpack(r) for r in run_ranks(2, _different_globs, path)]
    for state, out in results:
        assert_same(out, state)  # b and c: each rank's own value, not rank 0's
    manifest = Snapshot(path).get_manifest()
    assert manifest["0/s/a"].replicated and "1/s/a" not in manifest
    for r in range(2):
        assert not manifest[f"{r}/s/b"].replicated and not manifest[f"{r}/s/c"].replicated


# -- what must not be taken for one value ---------------------------------------------------

BIG = 3 * (1 << 20)  # float32 elements: 12 MiB, three digest pieces


def crc_twin(data: bytes) -> bytes:
    """Other bytes of the same length and the same CRC-32: the first byte flipped, and 4 bytes
    at the end solved for so that the CRC does not change (for a given length the CRC is
    affine over GF(2), so the change to cancel is linear in the flipped bits)."""
    n = len(data)

    def change(diff: bytes) -> int:  # what XOR-ing ``diff`` into any message does to its CRC
        return zlib.crc32(diff) ^ zlib.crc32(bytes(n))

    diff = bytearray(n)
    diff[0] = 0xFF
    basis: list[tuple[int, int]] = []  # (vector, which of the 32 end bits make it)
    for bit in range(32):
        one = bytearray(n)
        one[n - 4 + bit // 8] = 1 << (bit % 8)
        v, m = change(bytes(one)), 1 << bit
        for bv, bm in basis:
            if v ^ bv < v:
                v, m = v ^ bv, m ^ bm
        if v:
            basis = sorted([*basis, (v, m)], reverse=True)
    v, m = change(bytes(diff)), 0
    for bv, bm in basis:
        if v ^ bv < v:
            v, m = v ^ bv, m ^ bm
    assert v == 0
    diff[n - 4 :] = m.to_bytes(4, "little")
    twin = bytes(a ^ b for a, b in zip(data, diff, strict=True))
    assert twin != data and zlib.crc32(twin) == zlib.crc32(data)
    return twin


TWIN = bytes(range(64))  # rank 1 holds crc_twin(TWIN): the same CRC-32, other bytes


def _near_twins(rank: int) -> StateDict:
    """Values equal in kind, dtype and shape on both ranks; the ``same_*`` ones equal in bytes
    too, the ``diff_*`` ones not (rank 1's differ by as little as one bit)."""
    base = torch.linspace(-1, 1, 1000)
    flipped = base.clone()
    if rank == 1:
        flipped.view(torch.int32)[500] ^= 1  # the lowest bit of one element
    big = torch.zeros(BIG)
    if rank == 1:
        big[-1] = 1.0  # in the last piece only
    grid = torch.arange(64.0).view(8, 8)
    odd = grid.clone()
    if rank == 1:
        odd[7, 6] = -1.0
    return StateDict(
        same_t=base.clone(),
        diff_bit=flipped,
        diff_sign=torch.tensor(-0.0 if rank else 0.0),
        same_big=torch.ones(BIG),
        diff_big=big,
        same_strided=grid.t(),  # not contiguous: digested by gathering
        diff_strided=odd.t(),
        diff_crc_twin=torch.frombuffer(
            bytearray(crc_twin(TWIN) if rank else TWIN), dtype=torch.uint8
        ),
        same_nan=float("nan"),
        diff_zero=-0.0 if rank else 0.0,
        diff_type=True if rank else 1,
        same_obj={1, 2, 3},
        diff_obj={1, 2, 3 + rank},
        same_text="x" * 5000,  # a blob of its own
        diff_text="x" * 4999 + str(rank),
    )


def _take_twins(rank: int, world: int, path: str) -> bytes:
    state = _near_twins(rank)
    Snapshot.take(path, {"s": state})
    out = StateDict({k: torch.zeros_like(v) if torch.is_tensor(v) else 0 for k, v in state.items()})
    Snapshot(path).restore({"s": out})
    assert_same(dict(out), dict(_near_twins(rank)))  # each rank gets its own back
    return _pack({k: Snapshot(path).read_object(f"{rank}/s/{k}") for k in state})


def test_values_that_differ_in_their_bytes_stay_each_ranks_own(tmp_path):
    path = str(tmp_path / "snap")
    read = [_unpack(r) for r in run_ranks(2, _take_twins, path)]
    manifest = Snapshot(path).get_manifest()
    for key in _near_twins(0):
        if key.startswith("same_"):
            assert manifest[f"0/s/{key}"].replicated and f"1/s/{key}" not in manifest, key
        else:
            assert not manifest[f"0/s/{key}"].replicated, key
            assert not manifest[f"1/s/{key}"].replicated, key
    for rank, values in enumerate(read):
        assert_same(values, dict(_near_twins(rank)))


def test_digests_depend_on_the_bytes_only():
    t = torch.randn(3 * (1 << 20) + 5)  # 12 MiB: several pieces, the last one short
    data = raw_bytes(t)
    memory = tensor_bytes(t)
    crc, strong = crc_of(memory), strong_of(memory)
    assert crc == zlib.crc32(data) and len(strong) == 8
    strided = torch.empty(t.numel(), 2)[:, 1]  # the same elements, not contiguous
    strided.copy_(t)
    negated = torch._neg_view(-t)  # the same values through a negated view
    for src in [t, strided, negated, memoryview(data)]:
        assert (crc_of(src), strong_of(src)) == (crc, strong), type(src)
    # One piece: the same digest however the bytes are held.
    assert strong_of(strided[:1000]) == strong_of(memoryview(data[:4000]))
    assert strong_of(memoryview(data[:4000])) != strong_of(memoryview(data[:4001]))
    changed = t.clone()
    changed.view(torch.int32)[-1] ^= 1 << 31  # the sign of the last element
    other = tensor_bytes(changed)
    assert crc_of(other) != crc and strong_of(other) != strong
    paths = {"a": memory, "b": tensor_bytes(t)[:4000], "c": memoryview(data[:4000])}
    sent = joined(paths, ["a", "b", "c"])
    assert sent == strong + 2 * strong_of(memoryview(data[:4000]))


def test_a_crc_goes_to_the_threads_only_for_many_pieces(monkeypatch):
    """A CRC runs at memory speed: a value of a few pieces is taken on the caller's thread
    (handing pieces over cost more than it saved), a large one on the digest threads; the CRC
    is the same either way."""
    from snapshot._engine import runtime
    from snapshot._engine.dist import replication

    monkeypatch.setattr(replication, "_PIECE", 4096)
    pooled: list[int] = []
    real = runtime.Runtime.digest_pool
    monkeypatch.setattr(
        runtime.Runtime, "digest_pool", lambda self, n: pooled.append(n) or real(self, n)
    )
    few = os.urandom(4096 * (replication._CRC_POOL_PIECES - 2) + 5)  # one short of it
    assert crc_of(memoryview(few)) == zlib.crc32(few) and pooled == []
    many = os.urandom(4096 * replication._CRC_POOL_PIECES)
    assert crc_of(memoryview(many)) == zlib.crc32(many) and pooled
    pooled.clear()
    assert strong_of(memoryview(few)) and pooled  # BLAKE2b is slower: threads from 2 pieces


def test_decide_keeps_ties_alike_and_confirms_matching_crcs():
    def info(marked: dict, prints: dict, own: int = 100) -> dict:
        return {"marked": marked, "prints": prints, "own_bytes": own}

    t = Desc("float32[4]", (16,), None)
    tied = Desc("float32[4]", (16,), "m/w")
    one = (Desc("primitive", (), None), ("int", "1"))
    ranks = [
        info({"g": t}, {"m/w": (t, 7), "m/tied": (tied, None), "m/x": (t, 1), "m/y": (t, 5)}),
        info({"g": t, "h": t}, {"m/w": (t, 7), "m/tied": (t, 7), "m/x": (t, 2), "m/y": (t, 5)}),
    ]
    for r in ranks:
        r["prints"]["p"] = one
    pending = decide("snap", ranks)
    # g: marked by both (h: by one only); m/tied: tied on rank 0 only; m/x: other CRCs; p: a
    # primitive, final. m/w and m/y: their CRCs matched, BLAKE2b must confirm.
    assert list(pending.replicated) == ["g", "m/w", "m/y", "p"]
    assert pending.to_confirm == ["m/w", "m/y"]
    # m/y's CRCs matched but its BLAKE2b digests do not: not one value.
    decision = pending.confirm([b"A" * 8 + b"B" * 8, b"A" * 8 + b"C" * 8])
    assert list(decision.replicated) == ["g", "m/w", "p"]
    assert decision.signature == [("g", 0, 16, "float32[4]"), ("m/w", 0, 16, "float32[4]")]
    # Rank 0 keeps m/tied (a copy, its tie split) and loses m/w; rank 1 loses m/w, gains h.
    assert decision.local_bytes == [100 - 16 + 16, 100 - 16 + 16]
    ranks[1]["marked"]["g"] = Desc("float32[5]", (20,), None)
    with pytest.raises(SnapshotError, match="g is float32.4. .16 bytes. on rank 0 but g is"):
        decide("snap", ranks)


# -- manifests of earlier versions: replicated entries under every rank ---------------------


def _take_mixed(rank: int, world: int, path: str) -> None:
    own = StateDict(rank=rank, t=torch.full((4,), float(rank)))
    Snapshot.take(path, {"model": _mlp(0), "own": own})


def _restore_mixed(rank: int, world: int, path: str) -> None:
    fresh, own = _mlp(9), StateDict(t=torch.zeros(4))
    Snapshot(path).restore({"model": fresh, "own": own})
    assert_same(fresh.state_dict(), _mlp(0).state_dict())
    assert own["rank"] == rank and torch.equal(own["t"], torch.full((4,), float(rank)))


def _as_written_before(manifest: mf.Manifest) -> mf.Manifest:
    """The manifest a version-2 writer made of the same snapshot: every replicated leaf under
    every rank (each rank's entry pointing at the one copy), format version 1."""
    entries: dict[str, mf.Entry] = {}
    for rank in range(manifest.world_size):
        prefix = f"{rank}/"
        for p, e in manifest.view(rank).items():
            if p.startswith(prefix):
                entries[p] = e
    return mf.Manifest(
        format_version=1, world_size=manifest.world_size, entries=entries, metadata={}
    )


def test_manifests_that_repeat_replicated_entries_still_restore(tmp_path):
    path = str(tmp_path / "snap")
    run_ranks(2, _take_mixed, path)
    new = Snapshot(path)._manifest
    old = _as_written_before(new)
    assert "1/model/0.weight" in old.entries and "1/model/0.weight" not in new.entries
    usage_new, usage_old = disk_usage(new), disk_usage(old)
    assert usage_new == usage_old  # du: the same, however the manifest lists them
    assert usage_new.rows[0].replicated_bytes > 0
    with open(os.path.join(path, "manifest.yaml"), "wb") as f:
        f.write(mf.dumps(old))
    snap = Snapshot(path)
    assert snap._manifest.format_version == 1 and "1/model/0.weight" in snap.get_manifest()
    listing = list_entries(snap._manifest)
    rows = [r.replicated for r in listing.rows if r.path.endswith("/model/0.weight")]
    assert rows == [True, True]
    run_ranks(2, _restore_mixed, path)
    assert torch.equal(snap.read_object("1/own/t"), torch.full((4,), 1.0))


# -- taking into a directory that holds other files -----------------------------------------


def test_a_take_into_a_directory_of_other_files_is_refused(tmp_path):
    state = {"s": StateDict(t=torch.ones(3))}
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(PathNotEmptyError, match=r"mine is not empty: it holds 'notes.txt'"):
        Snapshot.take(str(foreign), state)
    assert sorted(os.listdir(foreign)) == ["notes.txt"]  # nothing written there

    empty = tmp_path / "empty"
    empty.mkdir()
    Snapshot.take(str(empty), state)  # an empty directory is fine

    debris = tmp_path / "debris"  # what an interrupted take leaves: marker, rank directories
    (debris / "0").mkdir(parents=True)
    (debris / "0" / "s0").write_bytes(b"old")
    (debris / "1").mkdir()
    (debris / ".statesnap-pending").write_text("pid 1")
    (debris / ".manifest.yaml.0123456789ab.tmp").write_text("")
    Snapshot.take(str(debris), state)
    assert torch.equal(Snapshot(str(debris)).read_object("0/s/t"), torch.ones(3))


def test_a_take_into_a_memory_prefix_of_other_blobs_is_refused():
    from storage_plugins import memory

    memory._STORE["shared/notes"] = b"keep me"
    with pytest.raises(PathNotEmptyError, match="memory://shared is not empty"):
        Snapshot.take("memory://shared", {"s": StateDict(x=1)})
    Snapshot.take("memory://shared/snap", {"s": StateDict(x=1)})  # a new prefix below it


def test_a_take_into_an_s3_prefix_of_other_objects_is_refused(s3_bucket):
    import boto3

    from tests.s3server import KEY_ID, REGION, SECRET

    server = s3_bucket.server
    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint_url,
        aws_access_key_id=KEY_ID,
        aws_secret_access_key=SECRET,
        region_name=REGION,
    )
    client.put_object(Bucket=s3_bucket.name, Key="data/train.csv", Body=b"a,b\n")
    client.close()
    options = s3_bucket.storage_options
    with pytest.raises(PathNotEmptyError, match="holds 'train.csv'"):
        Snapshot.take(s3_bucket.url("data"), {"s": StateDict(x=1)}, storage_options=options)
    Snapshot.take(s3_bucket.url("data/snap"), {"s": StateDict(x=1)}, storage_options=options)


def test_state_that_differs_per_rank_names_the_key_on_a_larger_world(tmp_path):
    """The error of a rank the snapshot did not have, in one process: a manifest of 2 ranks
    restored as rank 2 of 3 (the coordinator stands in for the group)."""
    from snapshot._engine.dist.dist import Coordinator
    from snapshot._engine.restore import restore
    from snapshot.options import Options

    class Rank2(Coordinator):
        rank, world_size = 2, 3

    entries = {f"{r}/own": mf.DictEntry(keys=("rank",)) for r in range(2)} | {
        f"{r}/own/rank": mf.PrimitiveEntry(value=r) for r in range(2)
    }
    manifest = mf.Manifest(world_size=2, entries=entries)
    # The ranks agree on the checks before anything is read (the others may be in a
    # collective of the application's state_dict() meanwhile): the error reaches every rank as
    # a RankFailedError, caused by this rank's own.
    with pytest.raises(RankFailedError) as e:
        restore.restore(
            manifest,
            {"own": StateDict()},
            path="the/snap",
            coordinator=Rank2(),
            storage_options=None,
            options=Options.from_env(),
        )
    assert isinstance(e.value.__cause__, StateMismatchError)
    message = str(e.value.__cause__)
    assert message.startswith("snapshot the/snap: app_state['own'] cannot be restored on rank 2")
    assert "'own/rank' differed between ranks" in message
    assert "Snapshot.read_object('<rank>/own/rank')" in message


def test_ls_shows_sharded_entries_as_not_replicated():
    """Manifests before format 3 marked a merged sharded entry replicated; it never was one
    value listed once: each rank keeps its own entry (and ``Manifest.view`` adds none)."""
    loc = mf.Location(blob="0/0", offset=0, nbytes=32, crc32=1)
    shard = mf.Shard(offsets=(0,), sizes=(8,), chunks=(loc,))
    entries: dict[str, mf.Entry] = {}
    for r in range(2):
        entries[f"{r}/m"] = mf.DictEntry(keys=("w",))
    entries["0/m/w"] = mf.ShardedTensorEntry(
        key="w", dtype="float32", shape=(8,), shards=(shard,), replicated=True
    )
    manifest = mf.Manifest(world_size=2, entries=entries)
    assert [r.replicated for r in list_entries(manifest).rows] == [False, False, False]
    assert "1/m/w" not in manifest.view(1)
    assert disk_usage(manifest).replicated_bytes == 0
