"""Reads straight into the caller's tensors: restored right, gaps, damage, shared ranges and
the check before writing included."""

from __future__ import annotations

import os

import pytest
import torch

from manifest import Location
from snapshot import Options, Snapshot, StateDict
from snapshot.errors import ChecksumError

SMALL_SLABS = Options(slab_threshold_bytes=4096, slab_bytes=64 * 1024)


def _slab_state(n: int = 60) -> StateDict:
    return StateDict({f"t{i:02d}": torch.arange(i, i + 250, dtype=torch.float32) for i in range(n)})


def test_members_between_other_reads_are_read_through_gaps(recorded):
    """Every third member goes into a float64 target (a tile read, not a direct one): the
    direct reads and the tile reads of one slab merge into one read, and every target gets
    its values."""
    url, log = recorded
    state = _slab_state()
    snap = Snapshot.take(url, {"s": state}, options=SMALL_SLABS)
    target = StateDict(
        {
            k: torch.empty(250, dtype=torch.float64 if i % 3 == 0 else torch.float32)
            for i, k in enumerate(state)
        }
    )
    log.clear()
    snap.restore({"s": target})
    for k, v in state.items():
        assert torch.equal(target[k], v.to(target[k].dtype)), k
    chunks = [snap.get_manifest()[f"0/s/{k}"].chunks[0] for k in state]
    (blob,) = {c.blob for c in chunks}

    def span(first: Location, last: Location) -> tuple[str, int, int]:
        return (blob, first.offset, last.offset + last.nbytes - first.offset)

    # One read of every member, direct or through a tile.
    assert sorted(log.reads) == [span(chunks[0], chunks[59])]


def test_a_damaged_member_names_its_entry_and_the_key_it_modified(tmp_path):
    path = str(tmp_path / "snap")
    state = _slab_state()
    snap = Snapshot.take(path, {"s": state}, options=SMALL_SLABS)
    loc = snap.get_manifest()["0/s/t17"].chunks[0]
    blob = os.path.join(path, loc.blob)
    with open(blob, "r+b") as f:
        f.seek(loc.offset + 100)
        byte = f.read(1)
        f.seek(loc.offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    target = StateDict({k: torch.zeros(250) for k in state})
    with pytest.raises(ChecksumError, match="0/s/t17: checksum mismatch") as e:
        Snapshot(path).restore({"s": target})
    assert e.value.modified == {"s": "partially"}
    # Checked before writing, the same damage leaves the targets as they were.
    target = StateDict({k: torch.zeros(250) for k in state})
    with pytest.raises(ChecksumError, match="0/s/t17"):
        Snapshot(path).restore({"s": target}, verify_first=True)
    assert all(not v.any() for v in target.values())


def test_tied_weights_restore_into_untied_targets(tmp_path):
    shared = torch.randn(300)
    snap = Snapshot.take(str(tmp_path / "snap"), {"m": StateDict(a=shared, b=shared, c=shared * 2)})
    entries = snap.get_manifest()
    assert entries["0/m/a"].chunks == entries["0/m/b"].chunks  # written once
    out = StateDict(a=torch.zeros(300), b=torch.zeros(300), c=torch.zeros(300))
    Snapshot(str(tmp_path / "snap")).restore({"m": out})
    assert torch.equal(out["a"], shared) and torch.equal(out["b"], shared)
    assert torch.equal(out["c"], shared * 2)
