"""Replicated tensors read once per restore across ranks (snapshot/_engine/dist/shared_reads.py):
one rank reads each, the others receive it over the library's gloo group. Real processes
(tests/multirank.py); the bytes each rank read are counted at the storage plugin."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from snapshot import Options, RankFailedError, Snapshot, StateDict
from snapshot._engine.dist import shared_reads
from tests.multirank import run_ranks

pytestmark = pytest.mark.slow  # real processes (gloo)


def _model(fill: float | None = None) -> StateDict:
    """Six large tensors (two above the pack size) and 300 small ones, the same on every rank."""
    gen = torch.Generator().manual_seed(3)
    sizes = [5 << 20, 3 << 20, 1 << 20, 1 << 20, 256 << 10, 64 << 10] + [1 << 10] * 300
    tensors = {f"t{i}": torch.randn(n, generator=gen) for i, n in enumerate(sizes)}
    tensors["bf16"] = torch.randn(4096, generator=gen).to(torch.bfloat16)
    if fill is not None:
        tensors = {k: torch.full_like(v, fill) for k, v in tensors.items()}
    return StateDict(**tensors)


def _count_reads() -> list[int]:
    """Adds every byte this process reads from a local snapshot to the returned counter."""
    from storage_plugins.fs import FSStoragePlugin

    counter = [0]
    inner = FSStoragePlugin._readv_sync

    def counted(self, path, offset, outs, observe=None):
        counter[0] += sum(len(o) for o in outs)
        return inner(self, path, offset, outs, observe)

    FSStoragePlugin._readv_sync = counted
    return counter


def _restore(rank: int, world: int, path: str, once: bool | None, extra_on: int | None):
    """Takes the replicated model (and, on rank ``extra_on``, a key of its own), then restores
    it into zeros with ``read_replicated_once=once``: the bytes this rank read, and whether
    every tensor came back bitwise."""
    state = {"model": _model(), "own": StateDict(x=torch.full((1000,), float(rank)))}
    if rank == extra_on:
        state["mine"] = StateDict(y=torch.arange(4096.0))
    Snapshot.take(path, state, replicated=["model/**"])
    counter = _count_reads()
    targets = {"model": _model(fill=0.0), "own": StateDict(x=torch.zeros(1000))}
    if rank == extra_on:
        targets["mine"] = StateDict(y=torch.zeros(4096))
    Snapshot(path).restore(targets, options=Options(read_replicated_once=once))
    expected = _model()
    same = all(torch.equal(targets["model"][k], v) for k, v in expected.items())
    same = same and torch.equal(targets["own"]["x"], torch.full((1000,), float(rank)))
    if rank == extra_on:
        same = same and torch.equal(targets["mine"]["y"], torch.arange(4096.0))
    dist.barrier()
    return counter[0], same


MODEL_BYTES = sum(t.nbytes for t in _model().values())


@pytest.mark.parametrize("world", [2, 4])
def test_replicated_tensors_are_read_once_across_ranks(tmp_path, world):
    results = run_ranks(world, _restore, str(tmp_path / "snap"), True, 1)
    assert all(same for _, same in results), results
    total = sum(n for n, _ in results)
    # Every byte of the model once, plus each rank's own values and the manifest's reads.
    assert MODEL_BYTES <= total < MODEL_BYTES + (1 << 20), (total, MODEL_BYTES)
    # Spread over the ranks: the largest tensor (20 MiB) bounds the busiest one.
    assert max(n for n, _ in results) < MODEL_BYTES * 0.9, results


def test_every_rank_reads_on_one_host_from_a_local_directory(tmp_path):
    """The library's own choice there: the ranks share the page cache."""
    results = run_ranks(2, _restore, str(tmp_path / "snap"), None, None)
    assert all(same for _, same in results), results
    assert all(n >= MODEL_BYTES for n, _ in results), results


def _listings(rank: int, world: int, path: str, once: bool | None) -> tuple[int, bool]:
    """How often this rank listed its candidates for reading once (walking its planned reads),
    and whether the restore came back bitwise."""
    calls = [0]
    inner = shared_reads.candidates

    def counted(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)

    shared_reads.candidates = counted
    _, same = _restore(rank, world, path, once, None)
    return calls[0], same


def test_ranks_list_their_reads_only_where_they_share_them(tmp_path):
    """The choice is agreed first: ranks on one host restoring from a local directory (every
    rank reads) never walk their planned reads for candidates nor send the list; asked to read
    once, each lists them once.

    Fails when the candidates are gathered with the choice (the agreement before this)."""
    every = run_ranks(2, _listings, str(tmp_path / "a"), None)
    once = run_ranks(2, _listings, str(tmp_path / "b"), True)
    assert every == [(0, True), (0, True)], every
    assert once == [(1, True), (1, True)], once


def _restore_s3(rank: int, world: int, url: str, storage: dict, once: bool | None) -> bool:
    state = {"model": _model(), "own": StateDict(x=torch.full((1000,), float(rank)))}
    Snapshot.take(url, state, replicated=["model/**"], storage_options=storage)
    dist.barrier()
    targets = {"model": _model(fill=0.0), "own": StateDict(x=torch.zeros(1000))}
    Snapshot(url, storage_options=storage).restore(
        targets, options=Options(read_replicated_once=once)
    )
    same = all(torch.equal(targets["model"][k], v) for k, v in _model().items())
    return same and torch.equal(targets["own"]["x"], torch.full((1000,), float(rank)))


def _bytes_read(bucket, prefix: str) -> int:
    return sum(r.bytes_out for r in bucket.log() if r.method == "GET" and r.key.startswith(prefix))


def test_from_s3_the_library_reads_each_replicated_byte_once(s3_bucket):
    """The library's choice for an object store: once (the default, no option given)."""
    world = 2
    for name, once in (("auto", None), ("every", False)):
        results = run_ranks(
            world, _restore_s3, s3_bucket.url(name), s3_bucket.storage_options, once
        )
        assert all(results), results
    auto, every = _bytes_read(s3_bucket, "auto/"), _bytes_read(s3_bucket, "every/")
    assert MODEL_BYTES <= auto < MODEL_BYTES + (1 << 20), (auto, MODEL_BYTES)
    assert every >= world * MODEL_BYTES, (every, MODEL_BYTES)


def test_the_choice():
    assert not shared_reads.decide(None, "/ckpt/step-1", ["a", "a"])
    assert shared_reads.decide(None, "/ckpt/step-1", ["a", "b"])  # a shared file system
    assert shared_reads.decide(None, "s3://bucket/step-1", ["a", "a"])
    assert not shared_reads.decide(None, "file:///ckpt", ["a", "a"])
    assert not shared_reads.decide(None, "fs:///ckpt", ["a", "a"])
    assert shared_reads.decide(True, "/ckpt/step-1", ["a", "a"])
    assert not shared_reads.decide(False, "s3://b/x", ["a", "b"])


def _mixed_options(rank: int, world: int, path: str) -> bool:
    """Ranks passing different settings: rank 0's decides for all (no rank waits for a
    broadcast the others skip)."""
    return _restore(rank, world, path, rank == 0, None)[1]


def test_rank_0s_setting_decides(tmp_path):
    assert run_ranks(2, _mixed_options, str(tmp_path / "snap")) == [True, True]


def test_the_environment_sets_it(monkeypatch):
    monkeypatch.setenv("STATESNAP_READ_REPLICATED_ONCE", "1")
    assert Options.from_env().read_replicated_once is True
    monkeypatch.delenv("STATESNAP_READ_REPLICATED_ONCE")
    assert Options.from_env().read_replicated_once is None


def _agreements(rank: int, world: int, path: str) -> dict[str, tuple]:
    """Takes a small replicated model, then restores it three ways and once failing on rank 1;
    for each, how many object all-gathers and flag all-reduces the restore made on this rank
    and the names of the agreements (and the failure's message and untouched keys)."""
    from snapshot._engine.dist.dist import GroupCoordinator

    state = {"model": StateDict(w=torch.arange(64.0)), "own": StateDict(x=torch.full((8,), 1.0))}
    Snapshot.take(path, state, replicated=["model/**"])
    calls, names = [0, 0], []
    gather, reduce = dist.all_gather_object, dist.all_reduce
    agree, outcome = GroupCoordinator.agree, GroupCoordinator.agree_outcome

    def counted(*args, **kwargs):
        calls[0] += 1
        return gather(*args, **kwargs)

    def reduced(*args, **kwargs):
        calls[1] += 1
        return reduce(*args, **kwargs)

    def named(self, what, value=None, error=None):
        names.append(what)
        return agree(self, what, value, error)

    def named_outcome(self, what, error):
        names.append(what)
        return outcome(self, what, error)

    dist.all_gather_object, dist.all_reduce = counted, reduced
    GroupCoordinator.agree = named  # type: ignore[method-assign]
    GroupCoordinator.agree_outcome = named_outcome  # type: ignore[method-assign]
    out = {}
    for case, once, verify_first in (
        ("plain", None, False),
        ("once", True, False),
        ("verify", None, True),
    ):
        calls[:], names[:] = [0, 0], []
        targets = {"model": StateDict(w=torch.zeros(64)), "own": StateDict(x=torch.zeros(8))}
        Snapshot(path).restore(
            targets, options=Options(read_replicated_once=once), verify_first=verify_first
        )
        assert torch.equal(targets["model"]["w"], torch.arange(64.0)), case
        out[case] = (*calls, list(names))
    # Rank 1's target cannot take the stored tensor: its planning fails, and every rank raises
    # at the checks, before any rank read a byte.
    calls[:], names[:] = [0, 0], []
    targets = {"model": StateDict(w=torch.zeros(64 + rank)), "own": StateDict(x=torch.zeros(8))}
    try:
        Snapshot(path).restore(targets, options=Options(read_replicated_once=True))
    except RankFailedError as e:
        out["failed"] = (*calls, list(names), str(e), e.untouched)
    return out


def test_a_restore_across_ranks_gathers_objects_once(tmp_path):
    """The checks carry what decides whether replicated tensors are read once: a restore on
    one host from a local directory makes three agreements, one object all-gather (the checks)
    and two that carry no value, each one flag all-reduce; reading once adds the all-gather
    that lists the shared tensors, verify_first a flag after its checks. A rank whose planning
    fails makes every rank raise at the checks, before any rank read a byte."""
    results = run_ranks(2, _agreements, str(tmp_path / "snap"))
    for out in results:
        assert out["plain"] == (1, 2, ["restore: checks", "restore: reading", "restore"]), out
        once = ["restore: checks", "restore: shared tensors", "restore: reading", "restore"]
        assert out["once"] == (2, 2, once), out
        verify = ["restore: checks", "restore: verifying", "restore: reading", "restore"]
        assert out["verify"] == (1, 3, verify), out
        gathers, reductions, names, message, untouched = out["failed"]
        assert (gathers, reductions, names) == (1, 0, ["restore: checks"]), out
        assert message.startswith("restore: checks failed on rank(s) [1] of 2: rank 1: "), out
        assert (
            "ShapeMismatchError" in message
            and "model/w" in message
            and untouched == ("model", "own")
        ), out
