"""Integrity: every stored range carries a CRC-32, verified on restore and read_object.

A byte flipped anywhere in any blob raises ``ChecksumError`` naming the logical path and the
blob, whichever way the bytes are read (in place, in pieces, through scratch tiles, as an
object, in budget-sized tiles); a blob longer or shorter than recorded is an error; the manifest
carries a checksum of its own; ``Options(checksums=False)`` (or ``STATESNAP_CHECKSUMS=0``) turns
all of it off.
"""

from __future__ import annotations

import functools
import itertools
import os
import random
import re
import zlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from manifest import ObjectEntry, TensorEntry
from snapshot import ChecksumError, CorruptSnapshotError, Options, Snapshot, StateDict
from snapshot._engine.format.serialization import (
    LocationCheck,
    RangeDigest,
    WholeCheck,
    combine,
    crc32,
)
from tests.helpers import assert_same
from tests.plugins import plain_blob

# ---------------------------------------------------------------------------------------------
# The arithmetic.


def test_crc32_is_zlibs():
    # The standard check value of CRC-32: the CRC of the ASCII digits 1 to 9; zlib agrees.
    assert crc32(b"123456789") == 0xCBF43926
    data = random.Random(0).randbytes(1 << 20)
    assert crc32(memoryview(data)) == zlib.crc32(data)
    assert crc32(data[500:], crc32(data[:500])) == zlib.crc32(data)


@given(a=st.binary(max_size=300), b=st.binary(max_size=300))
def test_combine_is_the_crc_of_the_concatenation(a, b):
    assert combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


@given(
    data=st.binary(min_size=1, max_size=400),
    cuts=st.lists(st.integers(0, 400), max_size=6),
    picks=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 400)), max_size=5),
)
def test_range_digest_over_any_pieces(data, cuts, picks):
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    buffers = [data[x:y] for x, y in itertools.pairwise(bounds)]
    # Non-overlapping ascending ranges, from the picks.
    ranges, pos = [], 0
    for gap, n in picks:
        start = pos + gap % 50
        n = min(n % 120, len(data) - start) if start <= len(data) else -1
        if n < 0:
            break
        ranges.append((start, n))
        pos = start + n
    expected = [zlib.crc32(data[o : o + n]) for o, n in ranges]
    digest = RangeDigest(ranges)
    for b in buffers:
        digest(memoryview(b))
    assert digest.values == expected
    digest = RangeDigest(ranges)  # in bulk: pieces not aligned with the ranges
    for piece in [memoryview(b) for b in buffers[:2]]:
        digest(piece)
    for piece in [memoryview(b) for b in buffers[2:]]:
        digest(piece)
    assert digest.values == expected


@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    chosen=st.lists(st.booleans(), min_size=12, max_size=12),
)
def test_range_digest_when_pieces_are_the_ranges(sizes, chosen):
    """A slab's stream: each member is one piece and one range, with padding pieces (not
    ranges) between some of them; also empty ranges."""
    data = random.Random(len(sizes)).randbytes(sum(sizes))
    bounds = list(itertools.accumulate(sizes, initial=0))
    pieces = [(x, y - x) for x, y in itertools.pairwise(bounds)]
    ranges = [r for r, keep in zip(pieces, chosen, strict=False) if keep]
    expected = [zlib.crc32(data[o : o + n]) for o, n in ranges]
    views = [memoryview(data[o : o + n]) for o, n in pieces if n]  # writes skip empty buffers
    digest = RangeDigest(ranges)
    for view in views:
        digest(view)
    assert digest.values == expected
    # In bulk, in any grouping of the pieces into calls.
    for group in (1, 2, 5, len(views) or 1):
        digest = RangeDigest(ranges)
        for at in range(0, len(views), group):
            for piece in views[at : at + group]:
                digest(piece)
        assert digest.values == expected, group


@given(
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    chosen=st.lists(st.booleans(), min_size=12, max_size=12),
    cuts=st.lists(st.integers(0, 400), max_size=4),
    group=st.integers(1, 12),
)
def test_range_digest_in_bulk_over_any_cut(sizes, chosen, cuts, group):
    """The buffers of a read (its segments, some of them ranges) shown in bulk, in any grouping,
    and the same stream cut at other places (a short read, an empty buffer skipped): the same
    CRCs."""
    data = random.Random(len(sizes)).randbytes(sum(sizes))
    bounds = list(itertools.accumulate(sizes, initial=0))
    segments = [(x, y - x) for x, y in itertools.pairwise(bounds)]
    mask = [keep for _, keep in zip(segments, chosen, strict=False)]
    ranges = [r for r, keep in zip(segments, mask, strict=True) if keep]
    expected = [zlib.crc32(data[o : o + n]) for o, n in ranges]
    views = [memoryview(data[o : o + n]) for o, n in segments if n]  # reads skip empty ones
    points = sorted({*bounds, *(c % (len(data) + 1) for c in cuts)})
    cut = [memoryview(data[x:y]) for x, y in itertools.pairwise(points) if y > x]
    for pieces in (views, cut):
        digest = RangeDigest(ranges)
        for at in range(0, len(pieces), group):
            for piece in pieces[at : at + group]:
                digest(piece)
        assert digest.values == expected


def test_range_digest_of_slab_members_with_padding():
    """A read of a slab's members with padding between them, in calls of many buffers."""
    rng = random.Random(3)
    members = [rng.randbytes(100) for _ in range(50)]
    pieces = []
    for m in members:
        pieces += [memoryview(m), memoryview(bytes(12))]
    ranges = [(112 * i, 100) for i in range(50)]
    digest = RangeDigest(ranges)
    for piece in pieces[:40]:
        digest(piece)
    for piece in pieces[40:]:
        digest(piece)
    assert digest.values == [zlib.crc32(m) for m in members]


def test_location_check_accepts_pieces_in_any_order():
    from manifest import Location

    data = random.Random(1).randbytes(1000)
    loc = Location(blob="0/0", offset=0, nbytes=1000, crc32=zlib.crc32(data))
    pieces = [(0, 300), (300, 300), (600, 400)]
    for order in ([2, 0, 1], [1, 2, 0], [0, 1, 2]):
        check = LocationCheck("0/x", loc, 3)
        for i in order:
            lo, n = pieces[i]
            check.add(lo, n, zlib.crc32(data[lo : lo + n]))
    bad = LocationCheck("0/x", loc, 3)
    bad.add(0, 300, zlib.crc32(data[:300]))
    bad.add(600, 400, zlib.crc32(data[600:]))
    with pytest.raises(
        ChecksumError, match=r"0/x: checksum mismatch in blob 0/0, bytes \[0, 1000\)"
    ):
        bad.add(300, 300, zlib.crc32(b"\0" + data[301:600]))


def test_whole_check_is_a_location_check_of_one_piece():
    from manifest import Location

    data = random.Random(2).randbytes(1000)
    loc = Location(blob="0/s0", offset=4096, nbytes=1000, crc32=zlib.crc32(data))
    WholeCheck("0/x", loc)(zlib.crc32(data))
    flipped = zlib.crc32(data[:-1] + bytes([data[-1] ^ 1]))
    for check in (
        WholeCheck("0/x", loc),
        functools.partial(LocationCheck("0/x", loc, 1).add, 0, 1000),
    ):
        with pytest.raises(
            ChecksumError,
            match=r"0/x: checksum mismatch in blob 0/s0, bytes \[4096, 5096\): the manifest "
            rf"records crc32 {loc.crc32:#010x}, the bytes read have {flipped:#010x}",
        ):
            check(flipped)


# ---------------------------------------------------------------------------------------------
# A real snapshot: chunks, slab members, objects.


def _state() -> dict[str, StateDict]:
    return {
        "m": StateDict(
            big=torch.arange(40_000, dtype=torch.float32),  # chunked (CHUNK_BYTES below)
            bias=torch.arange(10, dtype=torch.float64),  # slab member
            half=torch.linspace(0, 1, 300, dtype=torch.bfloat16),  # slab member
            obj={"a", "b"},  # object, serialized (small: a slab member too)
            text="x" * 5000,  # long string: an object blob of its own
        )
    }


def _targets() -> dict[str, StateDict]:
    return {
        "m": StateDict(
            big=torch.zeros(40_000),
            bias=torch.zeros(10, dtype=torch.float64),
            half=torch.zeros(300, dtype=torch.bfloat16),
        )
    }


# big: 3 chunks; the small values in a slab.
LAYOUT = Options(chunk_bytes=65536, slab_threshold_bytes=4096)


def _take(path: str, options: Options = LAYOUT) -> Snapshot:
    return Snapshot.take(path, _state(), options=options)


def _blob_bytes(path: str, blob: str) -> bytes:
    with open(os.path.join(path, blob), "rb") as f:
        return f.read()


def _flip(path: str, blob: str, offset: int) -> None:
    with open(os.path.join(path, blob), "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def test_every_location_records_the_crc_of_its_bytes(tmp_path):
    path = str(tmp_path / "s")
    manifest = _take(path).get_manifest()
    locations = [(p, loc) for p, e in manifest.items() for loc in e.locations]
    # 3 chunks; bias, half and obj in a slab; the long text in a blob of its own.
    assert len(locations) == 3 + 3 + 1
    for logical, loc in locations:
        data = _blob_bytes(path, loc.blob)[loc.offset : loc.offset + loc.nbytes]
        assert loc.crc32 == zlib.crc32(data), logical


def _locations(path: str) -> list[tuple[str, str, int, int]]:
    manifest = Snapshot(path).get_manifest()
    return [
        (p, loc.blob, loc.offset, loc.nbytes)
        for p, e in manifest.items()
        if isinstance(e, (TensorEntry, ObjectEntry))
        for loc in e.locations
    ]


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_flipped_byte_in_any_location_is_a_checksum_error(tmp_path, where):
    """Every location, read every way: restore in place (in pieces: ``read_request_bytes`` is
    smaller than a chunk), restore through a dtype cast (scratch tiles), read_object, and
    read_object in tiles of a small memory budget."""
    options = LAYOUT.replace(read_request_bytes=20000)
    path = str(tmp_path / "s")
    _take(path, options)
    for logical, blob, offset, nbytes in _locations(path):
        at = {"first": offset, "middle": offset + nbytes // 2, "last": offset + nbytes - 1}[where]
        _flip(path, blob, at)
        name = re.escape(logical)
        pattern = rf"{re.escape(path)}.*{name}: checksum mismatch in blob {re.escape(blob)}"
        snap = Snapshot(path)
        with pytest.raises(ChecksumError, match=pattern):
            snap.read_object(logical, options=options)
        with pytest.raises(ChecksumError, match=pattern):
            snap.read_object(logical, memory_budget_bytes=4096, options=options)
        if logical != "0/m/obj" and logical != "0/m/text":
            with pytest.raises(ChecksumError, match=pattern):
                snap.restore(_targets(), options=options)
            cast = _targets()
            cast["m"]["big"] = torch.zeros(40_000, dtype=torch.float64)
            cast["m"]["half"] = torch.zeros(300, dtype=torch.float32)
            with pytest.raises(ChecksumError, match=pattern):
                snap.restore(cast, options=options)
        else:
            with pytest.raises(ChecksumError, match=pattern):
                snap.restore({"m": StateDict()}, options=options)
        _flip(path, blob, at)  # back as it was
    out = _targets()
    Snapshot(path).restore(out, options=options)
    assert_same(out["m"]["big"], _state()["m"]["big"])


def test_a_flipped_member_of_a_large_slab_is_named(tmp_path):
    """A slab of hundreds of members read into their targets: a damaged member is the one
    named, whichever it is."""
    path = str(tmp_path / "s")
    state = {f"t{i}": torch.full((50 + i % 7,), float(i)) for i in range(300)}
    Snapshot.take(path, {"m": StateDict(state)})
    out = {f"t{i}": torch.zeros_like(t) for i, t in enumerate(state.values())}
    Snapshot(path).restore({"m": StateDict(out)})
    assert all(torch.equal(out[k], state[k]) for k in state)
    locs = {p: e.locations[0] for p, e in Snapshot(path).get_manifest().items() if "/t" in p}
    for name in ("t0", "t151", "t299"):
        loc = locs[f"0/m/{name}"]
        _flip(path, loc.blob, loc.offset + loc.nbytes // 2)
        target = {k: torch.zeros_like(t) for k, t in state.items()}
        with pytest.raises(ChecksumError, match=rf"0/m/{name}: checksum mismatch"):
            Snapshot(path).restore({"m": StateDict(target)})
        _flip(path, loc.blob, loc.offset + loc.nbytes // 2)


def test_a_blob_longer_than_recorded_is_an_error(tmp_path):
    path = str(tmp_path / "s")
    _take(path)
    for logical, blob, _, _ in _locations(path):
        with open(os.path.join(path, blob), "ab") as f:
            f.write(b"extra")
        with pytest.raises(CorruptSnapshotError, match=rf"blob .*{blob} is longer than"):
            Snapshot(path).read_object(logical)
        with pytest.raises(CorruptSnapshotError, match=rf"blob .*{blob} is longer than"):
            Snapshot(path).restore({"m": StateDict()})
        with open(os.path.join(path, blob), "r+b") as f:
            f.truncate(os.path.getsize(os.path.join(path, blob)) - 5)
    Snapshot(path).restore({"m": StateDict()})


def test_a_grown_blob_read_in_several_requests_names_all_it_serves(tmp_path):
    """The size check names the entries of every read of the blob, however the reads were cut:
    a slab of 40 members read in requests of at most two members each."""
    path = str(tmp_path / "s")
    state = {f"b{i:02d}": torch.full((256,), float(i)) for i in range(40)}  # 1 KiB each
    Snapshot.take(path, {"m": StateDict(state)})
    (slab,) = {e.chunks[0].blob for e in Snapshot(path).get_manifest().values()
               if isinstance(e, TensorEntry)}  # fmt: skip
    with open(os.path.join(path, slab), "ab") as f:
        f.write(b"extra")
    for request_bytes in (2048, 32 << 20):  # many requests, then one
        options = Options(read_request_bytes=request_bytes)
        with pytest.raises(
            CorruptSnapshotError, match=rf"0/m/b00 and 39 more: blob .*{slab} is longer than"
        ):
            Snapshot(path).restore(
                {"m": StateDict({k: torch.empty(256) for k in state})}, options=options
            )


def test_a_blob_cut_after_the_bytes_read_is_still_an_error(tmp_path):
    """read_object of the first member of a slab whose end was cut: the read itself succeeds,
    the size check does not."""
    path = str(tmp_path / "s")
    _take(path)
    manifest = Snapshot(path).get_manifest()
    members = sorted(
        (e.chunks[0].offset, p, e.chunks[0].blob)
        for p, e in manifest.items()
        if isinstance(e, TensorEntry)
        and e.chunks
        and plain_blob(e.chunks[0].blob).startswith("0/s")
    )
    _, first, slab = members[0]
    full = os.path.join(path, slab)
    with open(full, "r+b") as f:
        f.truncate(os.path.getsize(full) - 1)
    with pytest.raises(CorruptSnapshotError, match=rf"{first}.*blob .*{slab} is shorter than"):
        Snapshot(path).read_object(first)


def test_manifest_damage_is_a_checksum_error(tmp_path):
    path = str(tmp_path / "s")
    _take(path)
    file = os.path.join(path, "manifest.yaml")
    with open(file, "rb") as f:
        original = f.read()
    # A number changed that still decodes: a shape with the same number of bytes.
    edited = original.replace(b'"shape": [40000]', b'"shape": [20000, 2]')
    assert edited != original
    for damaged in [edited, original[: original.rindex(b"\n", 0, -1) + 1], original[:-2]]:
        with open(file, "wb") as f:
            f.write(damaged)
        with pytest.raises(ChecksumError, match=rf"{re.escape(file)}.*STATESNAP_CHECKSUMS=0"):
            Snapshot(path)


def test_checksums_off(tmp_path):
    """``checksums=False``: a take records none; reads verify none, so a flipped byte is read
    as it is (this is what the checksums protect against)."""
    off = Options(checksums=False)
    path = str(tmp_path / "s")
    manifest = _take(path, LAYOUT.replace(checksums=False)).get_manifest()
    assert all(loc.crc32 is None for e in manifest.values() for loc in e.locations)
    checked = str(tmp_path / "checked")
    _take(checked, LAYOUT.replace(checksums=True))
    _flip(checked, Snapshot(checked).get_manifest()["0/m/bias"].chunks[0].blob, 0)
    with pytest.raises(ChecksumError):
        Snapshot(checked).read_object("0/m/bias", options=Options(checksums=True))
    damaged = Snapshot(checked, options=off).read_object("0/m/bias", options=off)
    assert not torch.equal(damaged, _state()["m"]["bias"])
    with open(os.path.join(checked, "manifest.yaml"), "ab") as f:
        f.write(b"# an edit by hand\n")
    # The manifest is not checked either.
    Snapshot(checked, options=off).read_object("0/m/big", options=off)


def test_async_take_records_checksums(tmp_path):
    path = str(tmp_path / "s")
    Snapshot.async_take(path, _state(), options=LAYOUT).wait()
    for logical, loc in (
        (p, loc) for p, e in Snapshot(path).get_manifest().items() for loc in e.locations
    ):
        data = _blob_bytes(path, loc.blob)[loc.offset : loc.offset + loc.nbytes]
        assert loc.crc32 == zlib.crc32(data), logical


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("checksums", [True, False])
def test_slab_members_are_checksummed_when_staged(pooled, checksums):
    """A slab's staging gives the CRC-32 of each member (views of tensors, a non-contiguous
    tensor gathered, an object's bytes), so its write asks the plugin for none; copied into a
    pooled buffer for async take, the write asks the plugin for each member's, as a blob of its
    own leaves its CRC to the plugin."""
    from snapshot._engine.handlers.table import Layout
    from snapshot._engine.io.staging import StagingPool
    from snapshot._engine.take.plan import collect, place

    layout = Layout(
        chunk_bytes=1 << 20, slab_threshold_bytes=4096, slab_bytes=1 << 20, checksums=checksums
    )
    pool = StagingPool(keep_bytes=1 << 20, pin=False) if pooled else None
    state = {
        "a": torch.randn(7),
        "odd": torch.arange(30.0).view(5, 6).t(),  # non-contiguous: gathered when staged
        "text": "x" * 3000,  # an object's bytes
        "b": torch.arange(100, dtype=torch.int16),
        "big": torch.randn(2000),  # 8,000 bytes: a blob of its own
    }
    out = collect(
        [("s", state)],
        rank=0,
        prepare=None,
        replicated=(),
        inline_max_bytes=64,
        chunk_bytes=1 << 20,
    )
    plan = place(out, rank=0, layout=layout, writer_of={}, stager=pool)
    assert [w.blob for w in plan.writes] == ["0/1", "0/s0"]  # "big" first: slabs close last
    single, slab = plan.writes
    drafts = [out.entries[f"0/s/{k}"] for k in ("a", "odd", "b", "text")]
    # A tensor viewed whole is its own payload; the gathered one and the object hold theirs.
    members = [drafts[0], drafts[1].payloads[0], drafts[2], drafts[3].payload]
    assert all(m.crc32 is None for m in members)  # nothing staged yet
    buffers, keepalive = slab.stage()
    data = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)
    assert len(data) == slab.nbytes
    for m in members:
        assert m.blob == "0/s0"
    if pooled and checksums:  # a pooled copy nothing changes: the plugin checksums each member
        assert slab.checksum_ranges == tuple(sorted((m.pos, m.nbytes) for m in members))
        assert all(m.crc32 is None for m in members)
    else:  # staged from the application's memory: checksummed from the slab's copy
        assert not slab.checksum_ranges
        for m in members:
            want = zlib.crc32(data[m.pos : m.pos + m.nbytes]) if checksums else None
            assert m.crc32 == want, m.label
    assert single.checksum_ranges == (((0, 8000),) if checksums else ())
    if pooled:
        keepalive.release()
