"""Reads straight into the caller's tensors, kept as columns (``direct_reads``): cut into the
reads ``coalesce`` makes of the same needs, and restored right, gaps, damage, shared ranges
and the check before writing included."""

from __future__ import annotations

import os
import random

import pytest
import torch

from manifest import Location
from snapshot import Options, Snapshot, StateDict
from snapshot._engine.format.serialization import WholeCheck, raw_memoryviews
from snapshot._engine.restore.direct_reads import DirectReads
from snapshot._engine.restore.reads import Need, coalesce, direct_need
from snapshot.errors import ChecksumError

SMALL_SLABS = Options(slab_threshold_bytes=4096, slab_bytes=64 * 1024)


def _rows(seed: int) -> tuple[DirectReads, list[Need], torch.Tensor]:
    """Random rows over a few blobs (each blob's rows ascending, never overlapping, with gaps
    of every kind), planned in shuffled runs, and the needs ``direct_need`` makes of them;
    the addresses are in one buffer, returned to keep it alive."""
    rng = random.Random(seed)
    memory = torch.empty(1 << 20, dtype=torch.uint8)
    base = memory.data_ptr()
    rows: list[tuple[str, Location, int, str | None]] = []
    for blob in rng.sample(["s0", "s1", "s2"], rng.randint(1, 3)):
        pos = rng.choice([0, 7])
        for i in range(rng.randint(1, 80)):
            pos += rng.choice([0, 0, 4, 12, 50, 300, 5000])
            nbytes = rng.choice([1, 16, 100, 700, 2000])
            loc = Location(blob=blob, offset=pos, nbytes=nbytes, crc32=rng.getrandbits(32))
            rows.append((f"{blob}#{i}", loc, base + rng.randrange(0, (1 << 20) - nbytes), "k"))
            pos += nbytes
    # Shuffled in runs: a blob's rows may come in several runs, and out of order.
    runs = [rows[i : i + rng.randint(1, 20)] for i in range(0, len(rows), 20)]
    rng.shuffle(runs)
    reads = DirectReads()
    needs = []
    for run in runs:
        if rng.random() < 0.3:
            run = run[::-1]
        for path, loc, address, owner in run:
            reads.add(path, loc, address, owner)
            need = direct_need(path, loc, 0, loc.nbytes, address)
            need.owner = owner
            needs.append(need)
    return reads, needs, memory


@pytest.mark.parametrize("seed", range(30))
def test_rows_are_cut_into_the_reads_coalesce_makes_of_their_needs(seed):
    reads, needs, _memory = _rows(seed)
    rng = random.Random(seed)
    gap, size = rng.choice([0, 12, 64]), rng.choice([700, 2000, 5000, 10**6])
    got, leftovers = reads.requests(verify=True, max_gap_bytes=gap, max_request_bytes=size)
    assert leftovers == [] and len(reads) == 0  # no overlap; the columns are handed over
    want = coalesce(needs, max_gap_bytes=gap, max_request_bytes=size, max_scratch_bytes=0)
    assert sorted((r.blob, r.offset, r.paths) for r in got) == sorted(
        (r.blob, r.offset, [s.label for s in r.segments if isinstance(s, Need)]) for r in want
    )
    for r in got:
        sizes, members = r.layout()
        outs = r.destinations()
        assert list(map(len, outs)) == sizes and sum(sizes) == r.nbytes
        assert sum(members) == len(r.paths) and r.owners == ("k",)
        assert r.expected == [c.crc32 for c in r.chunks]
        pos = r.offset
        picked = iter(zip(r.chunks, r.addresses, strict=True))
        for out, member in zip(outs, members, strict=True):
            if member:
                chunk, address = next(picked)
                assert chunk.offset == pos and len(out) == chunk.nbytes
                assert torch.frombuffer(out, dtype=torch.uint8).data_ptr() == address
            else:
                assert 0 < len(out) <= gap  # a gap, into the shared scratch
            pos += len(out)


def test_rows_over_one_range_go_to_coalesce_as_needs():
    """Two targets restored from one stored range (tied weights untied by the caller): each
    read must be one sequential pass, so that blob's rows become needs, with their owner and
    their check; other blobs' rows are still cut."""
    memory = torch.zeros(64, dtype=torch.uint8)
    at = memory.data_ptr()
    tied = Location(blob="a", offset=0, nbytes=8, crc32=1)
    reads = DirectReads()
    reads.add("x/w", tied, at, "x")
    reads.add("x/b", Location(blob="b", offset=0, nbytes=8, crc32=2), at + 8, "x")
    reads.add("y/w", tied, at + 16, None)
    requests, leftovers = reads.requests(verify=True, max_gap_bytes=64, max_request_bytes=1 << 20)
    assert [(r.blob, r.paths) for r in requests] == [("b", ["x/b"])]
    assert [(n.label, n.offset, n.nbytes, n.owner) for n in leftovers] == [
        ("x/w", 0, 8, "x"),
        ("y/w", 0, 8, None),
    ]
    assert all(type(n.verify) is WholeCheck for n in leftovers)
    assert len(coalesce(leftovers, max_gap_bytes=64, max_request_bytes=1 << 20,
                        max_scratch_bytes=0)) == 2  # fmt: skip


def test_needs_of_the_rows_are_direct_needs():
    memory = torch.zeros(16, dtype=torch.uint8)
    reads = DirectReads()
    loc = Location(blob="a", offset=4, nbytes=16, crc32=None)
    reads.add("p", loc, memory.data_ptr(), "k")
    (need,) = reads.needs(verify=False)
    assert (need.blob, need.offset, need.nbytes, need.owner, need.verify) == ("a", 4, 16, "k", None)
    assert need.dest is not None and len(need.dest()) == 16 and len(reads) == 0


def _slab_state(n: int = 60) -> StateDict:
    return StateDict({f"t{i:02d}": torch.arange(i, i + 250, dtype=torch.float32) for i in range(n)})


def test_members_between_other_reads_are_read_through_gaps(recorded):
    """Every third member goes into a float64 target (a tile read, not a direct one): the
    direct reads of the others skip its bytes as gaps, and every target gets its values."""
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

    # One read of the direct members through the others' bytes, one of the tiles through the
    # direct members' bytes.
    assert sorted(log.reads) == [span(chunks[0], chunks[57]), span(chunks[1], chunks[59])]


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


def test_raw_memoryviews_are_each_raw_memoryview():
    """The views of a read's members, made in C-level passes, are ``raw_memoryview``'s; an
    empty size or a bad address goes through its checks."""
    t = torch.arange(64, dtype=torch.uint8)
    at = t.data_ptr()
    got = raw_memoryviews([at, at + 10, at + 63], [5, 3, 1])
    assert [bytes(v) for v in got] == [bytes(range(5)), bytes(range(10, 13)), bytes([63])]
    assert not got[0].readonly
    assert [len(v) for v in raw_memoryviews([at, at], [0, 2])] == [0, 2]
    assert raw_memoryviews([], []) == []
    with pytest.raises(ValueError, match="no memory at address 0"):
        raw_memoryviews([0], [3])
