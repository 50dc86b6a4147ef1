"""Where bytes go: chunked large tensors, slabs of small ones, and merged reads."""

from __future__ import annotations

import os
import random

import pytest
import torch

from snapshot import Options, Snapshot, StateDict
from snapshot._engine.restore.reads import Need, coalesce
from tests.helpers import assert_same
from tests.plugins import plain_blob

# Small chunks and slabs, so that small tensors show the layout.
SMALL_LAYOUT = Options(chunk_bytes=64 * 1024, slab_threshold_bytes=4096, slab_bytes=32 * 1024)


def blobs_of(snap: Snapshot, path: str) -> list[str]:
    return [c.blob for c in snap.get_manifest()[path].locations]


def test_large_tensors_are_chunked(snapshot_url):
    big = torch.randn(100, 700)  # 280,000 bytes -> 5 chunks of at most 64 KiB
    odd = torch.randn(3, 50_000, dtype=torch.float64).t()  # non-contiguous, chunked too
    snap = Snapshot.take(snapshot_url, {"s": StateDict(big=big, odd=odd)}, options=SMALL_LAYOUT)
    chunks = snap.get_manifest()["0/s/big"].chunks
    assert len(chunks) == 5 and len(set(blobs_of(snap, "0/s/big"))) == 5
    assert all(c.nbytes <= 64 * 1024 and c.nbytes % 4 == 0 for c in chunks)
    assert sum(c.nbytes for c in chunks) == big.nbytes
    out = StateDict(big=torch.empty(100, 700), odd=torch.empty(50_000, 3, dtype=torch.float64))
    Snapshot(snapshot_url).restore({"s": out})
    assert torch.equal(out["big"], big) and torch.equal(out["odd"], odd)
    # A chunked tensor restores into another dtype and layout through tiles.
    target = torch.empty(700, 100, dtype=torch.float64).t()
    Snapshot(snapshot_url).read_object("0/s/big", obj_out=target, memory_budget_bytes=10_000)
    assert torch.equal(target, big.double())


def test_small_payloads_share_slabs(tmp_path):
    path = tmp_path / "s"
    state = StateDict({f"b{i}": torch.full((100,), i, dtype=torch.int32) for i in range(200)})
    state["text"] = "x" * 3000  # an object payload rides in a slab too
    snap = Snapshot.take(str(path), {"s": state}, options=SMALL_LAYOUT)
    blobs = {b for p in snap.get_manifest() if p.startswith("0/s/") for b in blobs_of(snap, p)}
    assert len(blobs) == 3  # 80,000 + 3,000 bytes in slabs of at most 32 KiB
    files = [f for _, _, fs in os.walk(path / "0") for f in fs]
    assert sorted(files) == sorted(b.split("/")[1] for b in blobs)
    out = StateDict()
    snap.restore({"s": out})
    assert_same(dict(out), dict(state))


def test_reading_slab_members_merges_ranges(recorded):
    url, log = recorded
    state = StateDict({f"b{i:03d}": torch.full((256,), i, dtype=torch.int32) for i in range(64)})
    Snapshot.take(url, {"s": state}, options=SMALL_LAYOUT)
    snap = Snapshot(url)
    target = StateDict({k: torch.empty_like(v) for k, v in state.items()})
    log.clear()
    snap.restore({"s": target})
    assert_same(dict(target), dict(state))
    slabs = {b for p in snap.get_manifest() if p.startswith("0/s/") for b in blobs_of(snap, p)}
    assert len(log.reads) == len(slabs) == 2  # one scatter read per slab, not one per tensor


def test_read_object_of_a_slab_member_reads_only_its_bytes(recorded):
    url, log = recorded
    state = StateDict({f"t{i}": torch.randn(1024) for i in range(100)})  # one 400 KiB slab
    snap = Snapshot.take(url, {"s": state})
    log.clear()
    assert torch.equal(snap.read_object("0/s/t42"), state["t42"])
    assert log.reads == [(snap.get_manifest()["0/s/t42"].chunks[0].blob, 42 * 4096, 4096)]


def _need(blob: str, offset: int, nbytes: int, scratch: int = 0) -> Need:
    return Need(
        blob=blob,
        offset=offset,
        nbytes=nbytes,
        dest=lambda: memoryview(bytearray()),
        done=None,
        scratch_bytes=scratch,
        label=f"{blob}@{offset}",
    )


def test_coalesce_rules():
    needs = [
        _need("a", 0, 10),
        _need("a", 10, 10),
        _need("a", 25, 5),
        _need("a", 100, 5),
        _need("b", 0, 4),
        _need("a", 25, 5),
    ]
    requests = coalesce(needs, max_gap_bytes=8, max_request_bytes=1000, max_scratch_bytes=1000)
    shape = sorted(
        (r.blob, r.offset, [(s.nbytes, not isinstance(s, Need)) for s in r.segments])
        for r in requests
    )
    assert shape == [
        ("a", 0, [(10, False), (10, False), (5, True), (5, False)]),  # a 5-byte gap read through
        ("a", 25, [(5, False)]),  # the same range wanted twice: a second pass
        ("a", 100, [(5, False)]),  # too far
        ("b", 0, [(4, False)]),
    ]
    capped = coalesce(
        [_need("a", i * 10, 10, scratch=10) for i in range(10)],
        max_gap_bytes=0,
        max_request_bytes=1000,
        max_scratch_bytes=30,
    )
    assert [r.nbytes for r in capped] == [30, 30, 30, 10]
    sized = coalesce(
        [_need("a", i * 10, 10) for i in range(10)],
        max_gap_bytes=0,
        max_request_bytes=25,
        max_scratch_bytes=0,
    )
    assert [r.nbytes for r in sized] == [20, 20, 20, 20, 20]


def _coalesce_one_by_one(needs, max_gap, max_request, max_scratch):
    """The rules of ``coalesce``, need by need: what its passes over a blob's needs must give."""
    out = []
    by_blob = {}
    for need in needs:
        by_blob.setdefault(need.blob, []).append(need)
    for blob, group in by_blob.items():
        group.sort(key=lambda n: n.offset)
        current, end, size, scratch = [], 0, 0, 0
        for need in group:
            gap = need.offset - end
            if (
                current
                and 0 <= gap <= max_gap
                and size + gap + need.nbytes <= max_request
                and scratch + need.scratch_bytes <= max_scratch
            ):
                current.append(need)
                size, scratch = size + gap + need.nbytes, scratch + need.scratch_bytes
            else:
                if current:
                    out.append((blob, [n.label for n in current]))
                current, size, scratch = [need], need.nbytes, need.scratch_bytes
            end = need.offset + need.nbytes
        if current:
            out.append((blob, [n.label for n in current]))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_coalesce_cuts_reads_as_the_rules_say_and_drops_gaps_into_scratch(seed):
    rng = random.Random(seed)
    needs = []
    for blob in rng.sample(["s0", "s1", "s2"], rng.randint(1, 3)):
        # Half the blobs are slab-like (no scratch, no overlap, small gaps: the passes in C),
        # the others mix tiles, overlaps and far gaps (need by need).
        slab = rng.random() < 0.5
        pos = 0
        for i in range(rng.randint(1, 60)):
            pos += rng.choice([0, 4, 12] if slab else [0, 4, 50, 300])
            pos -= 10 if not slab and rng.random() < 0.05 else 0
            nbytes = rng.choice([1, 16, 100, 700])
            scratch = nbytes if not slab and rng.random() < 0.1 else 0
            need = _need(blob, max(pos, 0), nbytes, scratch)
            need.label = f"{blob}#{i}"
            needs.append(need)
            pos = max(pos, 0) + nbytes
    rng.shuffle(needs)
    limits = (rng.choice([0, 12, 64]), rng.choice([700, 1000, 5000]), rng.choice([0, 700, 10**6]))
    requests = coalesce(
        needs, max_gap_bytes=limits[0], max_request_bytes=limits[1], max_scratch_bytes=limits[2]
    )
    got = [(r.blob, [s.label for s in r.segments if isinstance(s, Need)]) for r in requests]
    assert got == _coalesce_one_by_one(needs, *limits)
    for r in requests:
        pos = r.offset
        for s in r.segments:
            if isinstance(s, Need):
                assert s.offset == pos  # each need where the bytes before it end
            else:
                assert 0 < s.nbytes <= limits[0] and len(s.dest()) == s.nbytes  # a gap's scratch
            pos += s.nbytes
        assert r.nbytes == pos - r.offset


@pytest.mark.parametrize("checksums", [True, False])
@pytest.mark.parametrize("slabs_only", [False, True])
def test_a_take_writes_the_manifest_its_entries_make(snapshot_url, checksums, slabs_only):
    """A take formats the lines of tensors stored in one range without building their
    entries: the file must be the one the entries themselves would make (the decoder reads it
    back into them), for slab members, blobs of their own, chunked and empty tensors, tied
    weights, a replicated tensor, and paths and dtypes the fast form cannot write verbatim.
    The snapshot a take returns decodes what it wrote when first asked.

    Entries that need no CRC from a write are made while the writes finish, the others after;
    with ``slabs_only`` that is all of them, and the manifest is made then too."""
    import manifest as mf

    options = SMALL_LAYOUT.replace(checksums=checksums)
    w = torch.randn(8, 8)
    state = StateDict(
        {
            "w": w,
            "tied": w,
            "big": torch.randn(100, 700),  # chunked
            "own": torch.randn(2000),  # 8,000 bytes: above the slab threshold, a blob of its own
            "empty": torch.empty(0, 3),
            'quote"d': torch.arange(5),
            "ünï": torch.ones(3, dtype=torch.bfloat16),
            "back\\slash": torch.zeros(2, dtype=torch.complex64),
        }
    )
    if slabs_only:
        del state["big"], state["own"]
    snap = Snapshot.take(snapshot_url, {"s": state, "r": StateDict(x=torch.ones(4))},
                         replicated=["r/**"], options=options)  # fmt: skip
    data = snap._decoded
    assert isinstance(data, bytes)  # nothing decoded yet
    entries = snap.get_manifest()
    loaded = Snapshot(snapshot_url, options=options)
    assert loaded.get_manifest() == entries
    assert entries["0/r/x"].replicated and not entries["0/s/w"].replicated
    assert entries["0/s/tied"].chunks == entries["0/s/w"].chunks
    assert entries["0/s/empty"].chunks == ()
    if not slabs_only:
        assert len(entries["0/s/big"].chunks) == 5
    assert all(c.crc32 is not None for c in entries["0/s/w"].chunks) == checksums
    rebuilt = mf.Manifest(
        format_version=loaded._manifest.format_version,
        world_size=1,
        entries=entries,
        metadata=loaded.metadata.info,
    )
    assert mf.dumps(rebuilt) == data
    out = StateDict({k: torch.empty_like(v) for k, v in state.items()})
    loaded.restore({"s": out}, options=options)
    assert_same(dict(out), dict(state))


class _SeesTheWrites:
    """A value whose serialization (while the take plans) records whether a slab's write has
    begun."""

    begun = None  # a threading.Event, set by the test's storage
    seen: bool | None = None

    def __reduce__(self):
        type(self).seen = type(self).begun.is_set()
        return (dict, ())


def test_a_take_writes_nothing_while_it_plans(tmp_path, monkeypatch):
    """Planning is pure: with the default hand-off (a staged slab goes to the I/O loop at
    once), no slab's write begins before the take has planned every value, those after the
    slabs' tensors included."""
    import threading

    from storage_plugins import fs

    # The default hand-off, whatever the environment running the tests sets.
    monkeypatch.delenv("STATESNAP_WRITE_BATCH_BYTES", raising=False)
    options = Options(slab_bytes=1 << 20)  # 4 tensors of 256 KiB a slab
    begun = threading.Event()
    monkeypatch.setattr(_SeesTheWrites, "begun", begun)
    monkeypatch.setattr(_SeesTheWrites, "seen", None)
    real = fs.FSStoragePlugin._write_sync

    def write_sync(self, path, buffers, observe=None, exclusive=False):
        if plain_blob(path).startswith("0/s"):  # a slab (not the pending marker)
            begun.set()
        return real(self, path, buffers, observe, exclusive)

    monkeypatch.setattr(fs.FSStoragePlugin, "_write_sync", write_sync)
    tensors = {f"t{i:02d}": torch.full((65536,), float(i)) for i in range(16)}
    state = StateDict(tensors=tensors, after=_SeesTheWrites())
    # What the value pickles as (a call of dict) is allowed on request only: without it the
    # take would refuse the value, since a restore would.
    with torch.serialization.safe_globals([dict]):
        Snapshot.take(
            str(tmp_path / "snap"), {"m": state}, storage_options={"fsync": False}, options=options
        )
    assert _SeesTheWrites.seen is False
    assert begun.is_set()  # the slabs were written after
    out = StateDict(tensors={k: torch.empty(65536) for k in tensors}, after=None)
    with torch.serialization.safe_globals([dict]):  # what the value pickles as
        Snapshot(str(tmp_path / "snap")).restore({"m": out})
    assert_same(out["tensors"], tensors)
    assert out["after"] == {}
