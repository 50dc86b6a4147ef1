"""Snapshots across a process group: real processes, gloo on the CPU, world sizes 1, 2 and 4."""

from __future__ import annotations

import errno
import os
import zlib
from typing import Any

import pytest
import torch
import torch.distributed as dist

from snapshot import RankFailedError, Snapshot, SnapshotError, SnapshotNotFoundError, StateDict
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow  # real processes (gloo); -m 'not slow' skips them


def model(seed: int = 0, width: int = 64) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 4))


def files_by_rank(path: str) -> dict[str, int]:
    """Bytes on disk under each top-level directory (one per writing rank)."""
    out: dict[str, int] = {}
    for d, _, fs in os.walk(path):
        top = os.path.relpath(d, path).split(os.sep)[0]
        if top != ".":
            out[top] = out.get(top, 0) + sum(os.path.getsize(os.path.join(d, f)) for f in fs)
    return out


# -- per-rank state ------------------------------------------------------------------------


def _per_rank(rank: int, world: int, path: str) -> list[str]:
    import snapshot.snapshot as facade

    reads: list[str] = []
    real_read = facade.read_manifest
    facade.read_manifest = lambda path, *a: reads.append(path) or real_read(path, *a)
    state = StateDict(rank=rank, t=torch.full((1000,), float(rank)), name=f"rank-{rank}")
    snap = Snapshot.take(path, {"s": state})
    # Rank 0 keeps the manifest it wrote; the others read it on first use, not in the take.
    assert reads == []
    out = StateDict(t=torch.zeros(1000))
    Snapshot(path).restore({"s": out})
    assert out["rank"] == rank and out["name"] == f"rank-{rank}"
    assert torch.equal(out["t"], torch.full((1000,), float(rank)))
    entries = sorted(snap.get_manifest())
    assert len(reads) == (2 if rank else 1)
    return entries


@pytest.mark.parametrize("world", [1, 2, 4])
def test_each_rank_keeps_its_own_state(tmp_path, world):
    path = str(tmp_path / "snap")
    manifests = run_ranks(world, _per_rank, path)
    assert all(m == manifests[0] for m in manifests)  # every rank sees every rank's entries
    assert {p.split("/")[0] for p in manifests[0]} == {str(r) for r in range(world)}
    assert Snapshot(path).get_manifest()["3/s/rank" if world == 4 else "0/s/rank"].value in (0, 3)


# -- replicated ----------------------------------------------------------------------------


def _replicated(rank: int, world: int, path: str) -> None:
    m = model(seed=0)  # the same on every rank
    Snapshot.take(path, {"model": m, "extra": StateDict(rank=rank)}, replicated=["model/**"])
    fresh = model(seed=99)
    Snapshot(path).restore({"model": fresh, "extra": StateDict()})
    for a, b in zip(fresh.parameters(), m.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("world", [2, 4])
def test_replicated_entries_are_written_once(tmp_path, world):
    path = str(tmp_path / "snap")
    run_ranks(world, _replicated, path)
    snap = Snapshot(path)
    manifest = snap.get_manifest()
    assert snap._manifest.format_version == 3  # listed once: older readers must refuse it
    assert manifest["0/model/0.weight"].replicated
    for r in range(world):
        # Listed once, under rank 0; every rank's path reads it.
        assert (f"{r}/model/0.weight" in manifest) == (r == 0)
        assert torch.equal(snap.read_object(f"{r}/model/0.weight"), model()[0].weight)
        assert not manifest[f"{r}/extra/rank"].replicated
        assert not manifest[f"{r}/model"].replicated  # containers: each rank's own
    # Every rank's entries carry the checksums of the bytes one rank wrote.
    for logical, entry in manifest.items():
        for loc in entry.locations:
            with open(os.path.join(path, loc.blob), "rb") as f:
                f.seek(loc.offset)
                assert loc.crc32 == zlib.crc32(f.read(loc.nbytes)), logical
    model_bytes = sum(t.nbytes for t in model().state_dict().values())
    on_disk = sum(files_by_rank(path).values())
    assert model_bytes <= on_disk < model_bytes + 64 * 1024


def _balanced(rank: int, world: int, path: str) -> None:
    torch.manual_seed(0)
    big = StateDict({f"w{i}": torch.randn(1024, 1024) for i in range(16)})  # 64 MiB, same on all
    Snapshot.take(path, {"model": big}, replicated=["**"])


def test_replicated_bytes_are_spread_evenly(tmp_path):
    path = str(tmp_path / "snap")
    run_ranks(4, _balanced, path)
    per_rank = files_by_rank(path)
    assert sorted(per_rank) == ["0", "1", "2", "3"]
    total = sum(per_rank.values())
    assert 64 << 20 <= total < (64 << 20) + 64 * 1024  # once, not four times
    mean = total / 4
    assert max(abs(b - mean) for b in per_rank.values()) <= 0.1 * mean


def _ddp(rank: int, world: int, path: str) -> None:
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(model(seed=0))
    optim = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ddp(torch.randn(8, 64) + rank).sum().backward()  # different data, averaged gradients
    optim.step()
    Snapshot.take(path, {"model": ddp, "optim": optim})
    fresh = torch.nn.parallel.DistributedDataParallel(model(seed=5))
    Snapshot(path).restore({"model": fresh})
    for a, b in zip(fresh.parameters(), ddp.parameters(), strict=True):
        assert torch.equal(a, b)


def test_ddp_modules_are_replicated_without_globs(tmp_path):
    path = str(tmp_path / "snap")
    run_ranks(2, _ddp, path)
    manifest = Snapshot(path).get_manifest()
    assert manifest["0/model/module.0.weight"].replicated
    assert "1/model/module.0.weight" not in manifest  # listed once, under rank 0
    # The optimizer's state is the same on both ranks (DDP averaged the gradients): found
    # equal by its bytes, and stored once too.
    assert manifest["0/optim/param_groups/0/lr"].replicated
    assert "1/optim/param_groups/0/lr" not in manifest and "1/optim" in manifest


# -- world size changes --------------------------------------------------------------------


def _take_for_elastic(rank: int, world: int, path: str) -> None:
    Snapshot.take(
        path, {"model": model(seed=0), "own": StateDict(rank=rank)}, replicated=["model/**"]
    )


def _restore_elastic(rank: int, world: int, path: str) -> None:
    fresh, own = model(seed=3), StateDict()
    Snapshot(path).restore({"model": fresh, "own": own})
    for a, b in zip(fresh.parameters(), model(seed=0).parameters(), strict=True):
        assert torch.equal(a, b)
    assert own["rank"] == rank


def test_restore_on_fewer_ranks_and_without_a_group(tmp_path):
    path = str(tmp_path / "snap")
    run_ranks(4, _take_for_elastic, path)
    run_ranks(2, _restore_elastic, path)
    fresh, own = model(seed=7), StateDict()
    Snapshot(path).restore({"model": fresh, "own": own})  # no process group: rank 0's view
    assert own["rank"] == 0
    assert torch.equal(fresh[0].weight, model(seed=0)[0].weight)


def _restore_on_more(rank: int, world: int, path: str) -> str:
    fresh = model(seed=3)
    Snapshot(path).restore({"model": fresh})  # replicated: every rank, new ones too
    assert torch.equal(fresh[0].weight, model(seed=0)[0].weight)
    try:
        Snapshot(path).restore({"own": StateDict()})
    except RankFailedError as e:
        return str(e)
    return "restored"


def test_restore_on_more_ranks_uses_replicated_entries_only(tmp_path):
    path = str(tmp_path / "snap")
    run_ranks(2, _take_for_elastic, path)
    messages = run_ranks(4, _restore_on_more, path)
    # Ranks 2 and 3 have no per-rank state: every rank hears which ranks failed, and why.
    for message in messages:
        assert "rank(s) [2, 3]" in message
        assert "app_state['own'] cannot be restored on rank 2" in message
        assert "taken on 2 ranks and is restored on 4" in message and "'own/rank'" in message


# -- failures ------------------------------------------------------------------------------


class FailsOnRank:
    def __init__(self, bad_rank: int) -> None:
        self.bad_rank = bad_rank

    def state_dict(self):
        if dist.get_rank() == self.bad_rank:
            raise RuntimeError("this rank's state is broken")
        return {"x": torch.ones(3)}

    def load_state_dict(self, sd):
        pass


def _fails_mid_take(rank: int, world: int, path: str) -> str:
    try:
        Snapshot.take(path, {"good": StateDict(t=torch.ones(10)), "bad": FailsOnRank(1)})
    except RankFailedError as e:
        assert e.failures.keys() == {1}
        return str(e)
    raise AssertionError("take did not fail")


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_that_raises_fails_every_rank(tmp_path, world):
    path = str(tmp_path / "snap")
    messages = run_ranks(world, _fails_mid_take, path)
    for message in messages:
        assert "failed on rank(s) [1]" in message and "this rank's state is broken" in message
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(path)
    assert not os.path.exists(os.path.join(path, ".statesnap-pending"))


def _disagrees(rank: int, world: int, path: str) -> str:
    shape = (4, 4) if rank == 0 else (4, 5)
    try:
        Snapshot.take(path, {"m": StateDict(w=torch.zeros(shape))}, replicated=["m/**"])
    except SnapshotError as e:  # every rank compares the same gathered facts, and refuses
        return str(e)
    raise AssertionError("take did not fail")


def test_replicated_tensors_that_disagree_are_refused(tmp_path):
    messages = run_ranks(2, _disagrees, str(tmp_path / "snap"))
    assert messages[0] == messages[1]
    for message in messages:
        assert "replicated entries differ between rank 0 and rank 1" in message
        assert "m/w is float32[4, 4] (64 bytes) on rank 0 but m/w is float32[4, 5]" in message


def _write_fails_on_one_rank(rank: int, world: int, inner: str, use_async: bool) -> str:
    from storage_plugins import register_storage_plugin
    from tests.plugins import FaultyPlugin, fail_writes

    register_storage_plugin("faulty", FaultyPlugin)
    if rank == 1:
        fail_writes(inner, errno.EIO, "I/O error", lambda p: p.startswith("1/"))
    state = {"s": StateDict(t=torch.full((100,), rank))}
    try:
        if use_async:
            Snapshot.async_take(f"faulty://{inner}", state).wait(timeout=120)
        else:
            Snapshot.take(f"faulty://{inner}", state)
    except RankFailedError as e:
        return str(e)
    raise AssertionError("take did not fail")


def _fsyncs(rank: int, world: int, path: str, use_async: bool) -> list[tuple[str, bool]]:
    """Each fsync of this rank's take: the path synced, and whether the manifest was there."""
    real = os.fsync
    seen: list[tuple[str, bool]] = []
    manifest = os.path.join(path, "manifest.yaml")

    def fsync(fd: int) -> None:
        seen.append((os.readlink(f"/proc/self/fd/{fd}"), os.path.exists(manifest)))
        real(fd)

    os.fsync = fsync
    try:
        state = {"s": StateDict(t=torch.full((300_000,), float(rank)), small=torch.ones(8))}
        if use_async:
            Snapshot.async_take(path, state).wait()
        else:
            Snapshot.take(path, state)
    finally:
        os.fsync = real
    return seen


@pytest.mark.parametrize("use_async", [False, True], ids=["take", "async_take"])
def test_every_rank_makes_what_it_wrote_durable_before_the_commit(tmp_path, use_async):
    """Rank 0 commits only once each rank has fsynced the directories it wrote into and made
    (its own blob directory, the snapshot's, and the folders above it that the take made);
    rank 0 fsyncs the snapshot's directory again once the manifest is in it."""
    top = os.path.realpath(tmp_path)
    path = os.path.join(top, "new", "snap")
    seen = run_ranks(2, _fsyncs, path, use_async)
    for rank, calls in enumerate(seen):
        before = {p for p, committed in calls if not committed}
        assert {os.path.join(path, str(rank)), path} <= before, (rank, calls)
    made = {p for calls in seen for p, committed in calls if not committed}
    assert {top, os.path.dirname(path)} <= made
    assert (path, True) in seen[0]
    assert not any(committed for p, committed in seen[1])


@pytest.mark.parametrize("use_async", [False, True], ids=["take", "async_take"])
def test_a_storage_error_on_one_rank_commits_nothing(tmp_path, use_async):
    inner = str(tmp_path / "snap")
    messages = run_ranks(2, _write_fails_on_one_rank, inner, use_async)
    for message in messages:
        assert "take: writing failed on rank(s) [1]" in message and "I/O error" in message
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(inner)
    assert [f for _, _, fs in os.walk(inner) for f in fs] == []  # every rank removed its blobs


def _manifest_write_fails(rank: int, world: int, inner: str) -> str:
    from storage_plugins import register_storage_plugin
    from tests.plugins import FaultyPlugin, fail_writes

    register_storage_plugin("faulty", FaultyPlugin)
    fail_writes(inner, errno.EIO, "I/O error", lambda p: p == "manifest.yaml")
    try:
        Snapshot.take(f"faulty://{inner}", {"s": StateDict(t=torch.full((100,), rank))})
    except RankFailedError as e:
        return f"{sorted(e.failures)} {e}"
    raise AssertionError("take did not fail")


def test_a_commit_that_fails_on_rank_zero_fails_every_rank_and_leaves_nothing(tmp_path):
    """Rank 0's verdict reaches every rank: its failed manifest write is each rank's error, and
    each removes its blobs, as no manifest of the take landed."""
    inner = str(tmp_path / "snap")
    messages = run_ranks(2, _manifest_write_fails, inner)
    for message in messages:
        assert message.startswith("[0] take: commit failed on rank(s) [0] of 2: rank 0: "), message
        assert "I/O error" in message, message
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(inner)
    assert [f for _, _, fs in os.walk(inner) for f in fs] == []


def _collectives_of_a_take(rank: int, world: int, path: str) -> dict[str, int]:
    """How many object collectives of each kind a take made on this rank."""
    counts = {"all_gather_object": 0, "gather_object": 0, "broadcast_object_list": 0}
    for name in counts:
        real = getattr(dist, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        setattr(dist, name, counted)
    Snapshot.take(path, {"s": StateDict(t=torch.full((100,), rank))})
    return counts


def test_a_take_across_ranks_commits_with_one_gather_and_one_broadcast(tmp_path):
    """The capture's agreement is the take's one object all-gather; after the writes, each
    rank's part goes to rank 0 in one gather and rank 0's verdict comes back in one broadcast."""
    path = str(tmp_path / "snap")
    counts = run_ranks(2, _collectives_of_a_take, path)
    expected = {"all_gather_object": 1, "gather_object": 1, "broadcast_object_list": 1}
    assert counts == [expected, expected]
    assert torch.equal(Snapshot(path).read_object("1/s/t"), torch.full((100,), 1))


def _storage_opens_on_rank_zero_only(rank: int, world: int, inner: str) -> str:
    from storage_plugins import register_storage_plugin
    from storage_plugins.fs import FSStoragePlugin

    class NoStorage(FSStoragePlugin):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise ValueError("no credentials on this rank")

    register_storage_plugin("flaky", FSStoragePlugin if rank == 0 else NoStorage)
    try:
        Snapshot.take(f"flaky://{inner}", {"s": StateDict(t=torch.full((10,), rank))})
    except RankFailedError as e:
        return str(e)
    raise AssertionError("take did not fail")


def test_storage_that_cannot_open_on_one_rank_fails_every_rank(tmp_path):
    """Rank 0 opens the storage first; another rank that cannot open it reports why at the
    next agreement, and every rank raises it (none waits for a collective it will not join)."""
    inner = str(tmp_path / "snap")
    messages = run_ranks(2, _storage_opens_on_rank_zero_only, inner, timeout=120)
    for message in messages:
        assert "rank(s) [1]" in message and "no credentials on this rank" in message, message
    with pytest.raises(SnapshotNotFoundError):
        Snapshot(inner)


def _commit_agreement_lost(rank: int, world: int, path: str) -> str:
    """Rank 1 loses the group right after rank 0 committed: the verdict never reaches it."""
    from snapshot._engine.dist import dist as coordination

    if rank == 1:

        def losing(self, value):
            if self.step == "take: commit":
                raise ConnectionError("the group was lost after the commit")
            raise AssertionError(f"no other broadcast of an object is expected: {self.step}")

        coordination.GroupCoordinator.broadcast_object = losing  # type: ignore[method-assign]
    try:
        Snapshot.take(path, {"s": StateDict(t=torch.arange(1000) * (rank + 1))})
    except Exception as e:
        return type(e).__name__
    return "ok"


def test_a_failure_after_the_commit_leaves_the_snapshot_whole(tmp_path):
    """Once rank 0 has committed the manifest, no rank removes a blob it names: a failure of
    the last agreement raises, and the committed snapshot still restores bitwise."""
    path = str(tmp_path / "snap")
    outcomes = run_ranks(2, _commit_agreement_lost, path, timeout=120)
    assert outcomes[1] == "ConnectionError", outcomes
    assert outcomes[0] in ("ok", "RankFailedError"), outcomes
    snap = Snapshot(path)
    for rank in range(2):
        assert torch.equal(snap.read_object(f"{rank}/s/t"), torch.arange(1000) * (rank + 1))


def _paths_differ(rank: int, world: int, base: str) -> str:
    snap = Snapshot.take(os.path.join(base, f"snap-of-rank-{rank}"), {"s": StateDict(r=rank)})
    return snap.path


def test_rank_zeros_path_wins(tmp_path):
    paths = run_ranks(2, _paths_differ, str(tmp_path))
    assert paths == [str(tmp_path / "snap-of-rank-0")] * 2
    assert sorted(os.listdir(tmp_path)) == ["snap-of-rank-0"]


# -- async take across ranks ------------------------------------------------------------------


def _async_consistent(rank: int, world: int, base: str) -> None:
    m = model(seed=0)
    own = StateDict(t=torch.full((1000,), float(rank)), step=rank)
    expected = {k: v.clone() for k, v in m.state_dict().items()}
    first = Snapshot.async_take(f"{base}/a", {"model": m, "own": own}, replicated=["model/**"])
    # Training goes on at once, collectives on the default group included.
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    own["t"].mul_(-1)
    own["step"] = -1
    x = torch.ones(4)
    dist.all_reduce(x)
    assert torch.equal(x, torch.full((4,), float(world)))
    second = Snapshot.async_take(f"{base}/b", {"model": m, "own": own}, replicated=["model/**"])
    snap_a, snap_b = first.wait(timeout=120), second.wait(timeout=120)
    restored, out = model(seed=7), StateDict()
    snap_a.restore({"model": restored, "own": out})
    for k, v in restored.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert out["step"] == rank and torch.equal(out["t"], torch.full((1000,), float(rank)))
    assert snap_b.read_object(f"{rank}/own/step") == -1  # equal on both ranks: listed once
    assert snap_b.get_manifest()["0/own/step"].replicated


def test_async_take_across_ranks(tmp_path):
    run_ranks(2, _async_consistent, str(tmp_path))
    manifest = Snapshot(str(tmp_path / "a")).get_manifest()
    assert manifest["0/model/0.weight"].replicated and "1/model/0.weight" not in manifest
    assert not manifest["1/own/step"].replicated  # the ranks' steps differ
    first = (tmp_path / "a" / "manifest.yaml").stat().st_mtime_ns
    assert first <= (tmp_path / "b" / "manifest.yaml").stat().st_mtime_ns
