"""A restore rebuilds the values of the keys whose leaves wait for no read while the reads run
(``Loader.inflate_ready``, run as ``Loader.execute``'s ``meanwhile`` on the caller's thread),
and the other keys' values after the reads, as before; what it finds wrong is reported after
the reads, as before."""

from __future__ import annotations

import pytest
import torch

from snapshot import CorruptSnapshotError, Snapshot, StateDict
from snapshot._engine.restore import loader as loader_module
from snapshot._engine.restore.loader import PENDING, Loader

# Longer than the longest value kept in the manifest itself: stored in a blob, and read (and
# decoded) by the restore's reads.
LONG_TEXT = "statesnap " * 300


def _source() -> dict[str, StateDict]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": StateDict({"w": torch.randn(64, 32, generator=g), "b": torch.randn(32)}),
        "extra": StateDict({"note": LONG_TEXT, "step": 7, "t": torch.arange(5.0)}),
    }


def _targets() -> dict[str, StateDict]:
    return {
        "model": StateDict({"w": torch.zeros(64, 32), "b": torch.zeros(32)}),
        "extra": StateDict({"note": "", "step": 0, "t": torch.zeros(5)}),
    }


def _key(root: str) -> str:
    return root.rsplit("/", 1)[-1]


def test_keys_of_tensors_are_rebuilt_while_the_reads_run(tmp_path, monkeypatch):
    src = _source()
    Snapshot.take(str(tmp_path / "s"), src)
    during: dict[str, bool] = {}  # key -> rebuilt while the reads ran
    after: list[str] = []  # keys rebuilt after the reads
    ready, inflate = Loader.inflate_ready, Loader.inflate

    def spy_ready(self: Loader, root: str) -> object:
        value = ready(self, root)
        during[_key(root)] = value is not PENDING
        return value

    def spy_inflate(self: Loader, root: str) -> object:
        after.append(_key(root))
        return inflate(self, root)

    monkeypatch.setattr(Loader, "inflate_ready", spy_ready)
    monkeypatch.setattr(Loader, "inflate", spy_inflate)
    dst = _targets()
    w = dst["model"]["w"]
    Snapshot(str(tmp_path / "s")).restore(dst)

    # The model's leaves are its own tensors, known once planned; the text waits for its read.
    assert during == {"model": True, "extra": False}
    assert after == ["extra"]
    assert dst["model"]["w"] is w  # read in place, and handed back as the same tensor
    assert torch.equal(dst["model"]["w"], src["model"]["w"])
    assert torch.equal(dst["model"]["b"], src["model"]["b"])
    assert dst["extra"]["note"] == LONG_TEXT and dst["extra"]["step"] == 7
    assert torch.equal(dst["extra"]["t"], torch.arange(5.0))


def test_a_value_that_cannot_be_rebuilt_is_reported_after_the_reads(tmp_path, monkeypatch):
    Snapshot.take(str(tmp_path / "s"), _source())
    real = loader_module.inflate
    calls: list[str] = []

    def deep(entries, root, leaf, known=None):  # type: ignore[no-untyped-def]
        calls.append(root)
        if _key(root) == "model":
            raise RecursionError("too deep")
        return real(entries, root, leaf, known)

    monkeypatch.setattr(loader_module, "inflate", deep)
    dst = _targets()
    with pytest.raises(CorruptSnapshotError, match="nested too deeply"):
        Snapshot(str(tmp_path / "s")).restore(dst)
    # Tried while the reads ran (and left), then again after them, where it was reported.
    assert [_key(r) for r in calls].count("model") == 2


def test_an_interrupt_while_the_reads_run_stops_the_restore(tmp_path, monkeypatch):
    src = _source()
    Snapshot.take(str(tmp_path / "s"), src)

    def interrupted(self: Loader, root: str) -> object:
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(Loader, "inflate_ready", interrupted)
        with pytest.raises(KeyboardInterrupt):
            Snapshot(str(tmp_path / "s")).restore(_targets())
    # The library is left usable: the next restore in the process runs whole.
    dst = _targets()
    Snapshot(str(tmp_path / "s")).restore(dst)
    assert torch.equal(dst["model"]["w"], src["model"]["w"])
    assert dst["extra"]["note"] == LONG_TEXT


def test_the_restore_overlap_benchmark_runs_both_ways(capsys, tmp_path):
    """``benchmarks/restore_overlap.py`` at a small size: both ways at each delay, and the
    library left as it was (its patches of the loader and the local plugin undone)."""
    from benchmarks import restore_overlap
    from storage_plugins.fs import FSStoragePlugin

    ready, read = Loader.inflate_ready, FSStoragePlugin._readv_sync
    restore_overlap.main(
        ["--count", "200", "--pairs", "2", "--late-ms", "0,1", "--dir", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert "reads 0 ms late: during the reads" in out
    assert "reads 1 ms late: during the reads" in out
    assert out.count("during faster in") == 2
    assert Loader.inflate_ready is ready and FSStoragePlugin._readv_sync is read
