"""A forged manifest costs no more than its bytes, and every way it fails is a SnapshotError.

The manifest codec reads only what the writer emits: YAML anchors, aliases, tags, merge keys and
nesting past ``MAX_DEPTH`` are refused (``UnsafeSnapshotError``) when the parser meets them,
before anything is built from them, on the JSON fast path and the YAML path alike. Sizes the
manifest claims are checked against the blobs before memory of that size is taken. Checks over
the whole manifest (shard coverage, "did you mean") take time linear in its size. Each forgery
starts from a real snapshot and has its checksum line recomputed, so that what is tested is the
decoder and the reads, not the trailer.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import manifest as mf
from snapshot import (
    CorruptSnapshotError,
    EntryNotFoundError,
    Options,
    Snapshot,
    StateDict,
    UnsafeSnapshotError,
)
from snapshot._engine.handlers import geometry
from snapshot._engine.restore import checks as claims
from snapshot.cli import EXIT_PROBLEM, main
from snapshot.sharding.mapping import ShardedTensor
from tests.helpers import open_decoded, seal_manifest

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = "manifest.yaml"


def _take(path: Path, state: dict[str, StateDict] | None = None) -> str:
    """A snapshot of a tensor, a small tensor, an int and a set, each in a blob of its own
    (the slab threshold lowered): returns its path."""
    if state is None:
        state = {
            "model": StateDict(w=torch.arange(64, dtype=torch.float32), b=torch.ones(3)),
            "extra": StateDict(step=7, obj={1, 2, 3}),
        }
    Snapshot.take(str(path), state, options=Options(slab_threshold_bytes=4))
    return str(path)


def _body(path: str) -> str:
    text = Path(path, MANIFEST).read_text()
    return text[: text.rindex("# crc32")]


def _forge(path: str, body: str) -> int:
    """Writes ``body`` as the manifest, its checksum line recomputed; returns its size."""
    data = seal_manifest(body.encode())
    Path(path, MANIFEST).write_bytes(data)
    return len(data)


def _line(body: str, key: str) -> str:
    return next(line for line in body.splitlines() if line.startswith(f'  "{key}":'))


def _replace_entry(path: str, key: str, new_line: str) -> None:
    body = _body(path)
    _forge(path, body.replace(_line(body, key), new_line))


@pytest.fixture
def snap(tmp_path) -> str:
    return _take(tmp_path / "snap")


# ---------------------------------------------------------------------------------------------
# YAML the writer never emits.


def _aliased(body: str, anchored: int, aliases: int) -> str:
    """``body`` with the tensor 0/model/w's chunks an anchored list of ``anchored`` copies of
    its location, and ``aliases`` more entries whose chunks are that list: expanded, that is
    ``anchored * aliases`` locations."""
    line = _line(body, "0/model/w")
    found = re.search(r'"chunks": \[(\[[^\]]*\])\]\}', line)
    assert found is not None
    listed = ", ".join([found.group(1)] * anchored)
    new = line.replace(found.group(0), f'"chunks": &c [{listed}]}}')
    new += "".join(
        f'\n  "0/model/a{i}": {{"type": "tensor", "dtype": "float32", "shape": [64], "chunks": *c}}'
        for i in range(aliases)
    )
    return body.replace(line, new)


def test_aliases_are_refused_before_they_expand(snap):
    """2,500 locations named by 2,500 aliases: 6.25 million locations expanded (once 13 s and
    432 MiB), from a file of about a third of a megabyte."""
    size = _forge(snap, _aliased(_body(snap), 2500, 2500))
    assert size < 350_000
    tracemalloc.start()
    try:
        with pytest.raises(UnsafeSnapshotError) as caught:
            open_decoded(snap)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(caught.value)
    assert snap in message and "0/model/w" in message and "YAML anchor &c" in message
    # Refused at the anchor: no more than a few copies of the file's own text were made.
    assert peak < 12 * size, f"peak {peak:,} bytes for a file of {size:,}"
    with pytest.raises(mf.UnsafeManifestError):
        mf.loads(Path(snap, MANIFEST).read_bytes())


@pytest.mark.parametrize(
    ("where", "old", "new", "named"),
    [
        # An alias without its anchor on the line, in the header.
        ("header", 'metadata: {"library"', 'metadata: {"alias": *a, "library"', "YAML alias *a"),
        ("anchor", '"type": "primitive"', '"type": &t "primitive"', "YAML anchor &t"),
        ("python tag", '{"type": "primitive", "value_type": "int", "value": 7}',
         '!!python/object/apply:os.system ["echo pwned"]', "YAML tag"),
        ("binary tag", '"value": 7', '"value": !!binary "AAAA"', "YAML tag"),
        ("set tag", '"value": 7', '"value": !!set {a: null}', "YAML tag"),
        ("local tag", '"value": 7', '"value": !mine 7', "YAML tag !mine"),
        ("str tag", '"value": 7', '"value": !!str 7', "YAML tag"),
        ("merge key", '"value": 7', '"value": 7, <<: {"replicated": true}', "merge key"),
        ("timestamp", 'metadata: {"library"', 'metadata: {"when": 2024-01-01, "library"',
         "timestamp"),
        ("complex key", '"value": 7', '"value": 7, ? [a, b] : 1', "a collection as a mapping key"),
    ],
)  # fmt: skip
def test_yaml_features_the_writer_never_emits_are_refused(snap, where, old, new, named):
    body = _body(snap)
    forged = body.replace(old, new, 1)
    assert forged != body
    _forge(snap, forged)
    with pytest.raises(UnsafeSnapshotError) as caught:
        open_decoded(snap)
    message = str(caught.value)
    assert snap in message and named in message
    if where != "header" and where != "timestamp":
        assert "0/extra/step" in message  # the entry it stands in


def test_a_repeated_key_is_corrupt(snap):
    body = _body(snap)
    line = _line(body, "0/extra/step")
    _forge(snap, body.replace(line, line + "\n" + line))
    with pytest.raises(CorruptSnapshotError, match="'0/extra/step' appears twice") as caught:
        open_decoded(snap)
    assert type(caught.value) is CorruptSnapshotError


@pytest.mark.parametrize("scalar", ["0b_", "0x_", "-0b_"])
def test_a_plain_scalar_that_is_no_number_is_corrupt(snap, scalar):
    """YAML's resolver takes these for integers that ``int()`` then refuses: a ValueError from
    any YAML loader, a CorruptSnapshotError here."""
    _forge(
        snap, _body(snap).replace('metadata: {"library"', f'metadata: {{"n": {scalar}, "library"')
    )
    with pytest.raises(CorruptSnapshotError, match="reads as a number but is none") as caught:
        open_decoded(snap)
    assert type(caught.value) is CorruptSnapshotError


def test_the_torchsnapshot_reader_refuses_the_same_yaml():
    """A torchsnapshot manifest is JSON read as YAML: its YAML reader refuses what this one
    does, and deep JSON does not reach the JSON decoder's recursion."""
    from snapshot._engine.format.torchsnapshot_format import _parse

    aliased = b'{version: &v "0.1.0", world_size: 1, manifest: {"0/a": *v}}'
    with pytest.raises(UnsafeSnapshotError, match="YAML anchor &v"):
        _parse(aliased, "src/.snapshot_metadata")
    deep = b'{"version": "0.1.0", "world_size": 1, "manifest": ' + _deep(DEPTH).encode() + b"}"
    with pytest.raises(UnsafeSnapshotError, match="nesting deeper than 32 levels"):
        _parse(deep, "src/.snapshot_metadata")
    assert (
        _parse(b'{"version": "0.1.0", "world_size": 1, "manifest": {}}', "src")["world_size"] == 1
    )


DEPTH = 100_000


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(
    "layout",
    ["json line", "yaml flow", "yaml block", "header", "blob path"],
)
def test_nesting_past_the_limit_is_refused_without_recursion(snap, layout):
    """100,000 levels once raised a bare RecursionError (and ``statesnap ls`` exited 2)."""
    body = _body(snap)
    step = _line(body, "0/extra/step")
    if layout == "json line":  # the fast path: entry lines in the writer's layout
        forged = body.replace(step, step.replace('"value": 7', f'"value": {_deep(DEPTH)}'))
    elif layout == "yaml flow":  # a comment line sends the file to the YAML reader
        forged = body.replace(step, "  # edited\n" + step.replace("7}", f"{_deep(DEPTH)}}}"))
    elif layout == "yaml block":  # indentation grows with depth: fewer levels, same refusal
        levels = "".join("  " * (i + 2) + "- \n" for i in range(200))
        forged = body.replace(step + "\n", '  "0/extra/step":\n' + levels)
    elif layout == "header":
        forged = body.replace('metadata: {"library"', f'metadata: {{"x": {_deep(DEPTH)}, "library"')
    else:  # in a location, where the blob's name goes
        w = _line(body, "0/model/w")
        forged = body.replace(w, re.sub(r'\["0/[^"]+"', "[" + _deep(DEPTH), w))
    assert forged != body
    _forge(snap, forged)
    with pytest.raises(UnsafeSnapshotError, match="nesting deeper than 32 levels") as caught:
        open_decoded(snap)
    assert snap in str(caught.value)
    code = main(["ls", snap])
    assert code == EXIT_PROBLEM


def _nested_list(levels: int) -> str:
    return "[" * levels + "1" + "]" * levels


@pytest.mark.parametrize("path", ["fast", "yaml"])
def test_the_depth_limit_is_exact(snap, path):
    """The document's mapping is level 1, ``metadata`` or ``entries`` level 2, an entry 3: a
    value may open ``MAX_DEPTH`` levels in all, and one more is refused."""
    body = _body(snap)
    step = _line(body, "0/extra/step")
    comment = "  # edited\n" if path == "yaml" else ""
    for extra, expected in ((0, CorruptSnapshotError), (1, UnsafeSnapshotError)):
        # An entry at level 3 whose value opens the rest: the field check refuses the list.
        value = _nested_list(mf.MAX_DEPTH - 3 + extra)
        _forge(snap, body.replace(step, comment + step.replace('"value": 7', f'"value": {value}')))
        with pytest.raises(expected) as caught:
            open_decoded(snap)
        assert type(caught.value) is expected, caught.value
        # Metadata at level 2, read as it is when within the limit.
        nested = _nested_list(mf.MAX_DEPTH - 2 + extra)
        _forge(snap, body.replace('metadata: {"library"', f'metadata: {{"x": {nested}, "library"'))
        if extra:
            with pytest.raises(UnsafeSnapshotError):
                open_decoded(snap)
        else:
            assert Snapshot(snap).metadata.info["x"] == json.loads(nested)


def test_unsafe_blob_paths_are_unsafe(snap):
    body = _body(snap)
    w = _line(body, "0/model/w")
    _forge(snap, body.replace(w, re.sub(r'\["0/[^"]+"', '["../../etc/passwd"', w)))
    with pytest.raises(UnsafeSnapshotError, match="0/model/w: unsafe blob path"):
        open_decoded(snap)


# ---------------------------------------------------------------------------------------------
# Sizes the manifest claims.

_CHILD = textwrap.dedent(
    """
    import json, re, resource, sys
    import torch
    from snapshot import Snapshot, StateDict
    path, warm = sys.argv[1], sys.argv[2]
    Snapshot(warm).read_object("0/model/w")  # pays for what any first read allocates
    Snapshot(warm).restore({"model": StateDict(), "extra": StateDict()})
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    outcomes = {}
    snap = Snapshot(path)
    for name, op in [
        ("object", lambda: snap.read_object("0/extra/obj")),
        ("tensor", lambda: snap.read_object("0/model/w")),
        ("restore", lambda: snap.restore({"model": StateDict(), "extra": StateDict()})),
    ]:
        try:
            op()
            outcomes[name] = ["ok", ""]
        except Exception as e:
            outcomes[name] = [type(e).__name__, str(e)]
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    print(json.dumps({"outcomes": outcomes, "grew_kib": grew}))
    """
)


@pytest.mark.slow
def test_a_claim_beyond_the_blob_allocates_nothing(tmp_path):
    """An object that claims 2 GiB over its short blob (once zeroed 2 GiB before the read found
    the blob short), and a tensor of 2**29 float32 elements over a 256-byte blob: refused,
    naming the snapshot, the key and the blob, before memory of that size is taken (peak
    resident memory measured in a fresh process)."""
    warm = _take(tmp_path / "warm")
    path = _take(tmp_path / "snap")
    body = _body(path)
    obj, w = _line(body, "0/extra/obj"), _line(body, "0/model/w")
    obj_blob = re.search(r'"location": \["([^"]+)"', obj).group(1)  # type: ignore[union-attr]
    w_blob = re.search(r'"chunks": \[\["([^"]+)"', w).group(1)  # type: ignore[union-attr]
    forged = body.replace(obj, re.sub(r"(\[\"[^\"]+\", \d+), \d+, \d+\]", r"\1, 2147483648]", obj))
    forged = forged.replace(
        w,
        f'  "0/model/w": {{"type": "tensor", "dtype": "float32", "shape": [536870912], '
        f'"chunks": [["{w_blob}", 0, 2147483648]]}}',
    )
    _forge(path, forged)
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, path, warm],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    for name, blob in (("object", obj_blob), ("tensor", w_blob), ("restore", None)):
        kind, message = report["outcomes"][name]
        assert kind == "CorruptSnapshotError", (name, kind, message)
        assert "shorter than the manifest says" in message and path in message
        assert "2,147,483,648" in message
        if blob is not None:
            assert blob in message
            assert ("0/extra/obj" if name == "object" else "0/model/w") in message
    assert report["grew_kib"] < 100 * 1024, f"peak grew {report['grew_kib'] >> 10} MiB"


class _Calls:
    """The order of the local plugin's size queries and reads, by blob."""

    def __init__(self, monkeypatch) -> None:
        from storage_plugins.fs import FSStoragePlugin

        self.events: list[tuple[str, str]] = []
        size, readv = FSStoragePlugin.size, FSStoragePlugin._readv_sync

        async def logged_size(plugin, path):
            self.events.append(("size", path))
            return await size(plugin, path)

        def logged_readv(plugin, path, *args, **kwargs):
            self.events.append(("read", path))
            return readv(plugin, path, *args, **kwargs)

        monkeypatch.setattr(FSStoragePlugin, "size", logged_size)
        monkeypatch.setattr(FSStoragePlugin, "_readv_sync", logged_readv)

    def first(self, kind: str) -> int:
        return next(i for i, (k, _) in enumerate(self.events) if k == kind)


def test_sizes_are_asked_before_reads_that_allocate_only(snap, monkeypatch):
    """Reads into the caller's tensors take no memory sized by the manifest (the targets are
    the caller's; a short blob fails its read and the size check after the reads): no size is
    asked before them. Reads into new memory ask first, once per blob, once their claims add up
    to more than ``UNCHECKED_BYTES``; below that, they ask nothing more than before."""
    calls = _Calls(monkeypatch)
    Snapshot(snap).restore({"model": StateDict(w=torch.zeros(64), b=torch.zeros(3))})
    assert calls.events and calls.first("read") < calls.first("size")
    calls.events.clear()
    Snapshot(snap).restore({"model": StateDict(), "extra": StateDict()})  # a few hundred bytes
    assert calls.first("read") < calls.first("size")
    calls.events.clear()
    monkeypatch.setattr(claims, "UNCHECKED_BYTES", 0)
    out = {"model": StateDict(), "extra": StateDict()}
    Snapshot(snap).restore(out)
    assert torch.equal(out["model"]["w"], torch.arange(64, dtype=torch.float32))
    before = calls.events[: calls.first("read")]
    blobs = {loc.blob for e in Snapshot(snap).get_manifest().values() for loc in e.locations}
    assert sorted(b for _, b in before) == sorted(blobs)  # each once, all before any read


def test_repeated_ranges_cannot_claim_more_than_a_blob_holds(snap):
    """A tensor of 64,000 elements whose 1,000 chunks all name the same 256 bytes: read into
    new memory, it would take a thousand times what is stored."""
    body = _body(snap)
    w = _line(body, "0/model/w")
    blob = re.search(r'"chunks": \[\["([^"]+)"', w).group(1)  # type: ignore[union-attr]
    chunks = ", ".join([f'["{blob}", 0, 256]'] * 1000)
    forged = '  "0/model/w": {"type": "tensor", "dtype": "float32", "shape": [64000], '
    _forge(snap, body.replace(w, forged + f'"chunks": [{chunks}]}}'))
    with pytest.raises(CorruptSnapshotError, match="0/model/w: two of its stored ranges"):
        Snapshot(snap).read_object("0/model/w")
    # Into a tensor of the caller's, nothing is allocated: the bytes are read as recorded.
    out = torch.zeros(64000)
    Snapshot(snap).read_object("0/model/w", obj_out=out)
    assert torch.equal(out, torch.arange(64.0).repeat(1000))


# ---------------------------------------------------------------------------------------------
# Checks over the whole manifest.


def _with_empty_shards(tmp_path: Path, n: int) -> str:
    path = _take(
        tmp_path / f"sharded-{n}",
        {"m": StateDict(w=ShardedTensor.from_rank_offsets("w", torch.arange(16.0).reshape(4, 4)))},
    )
    empty = "".join(
        f', {{"offsets": [{i % 4}, 0], "sizes": [0, 4], "chunks": []}}' for i in range(n)
    )
    body, count = re.subn(
        r'("chunks": \[\[[^\]]*\]\]\})\]', lambda m: m.group(1) + empty + "]", _body(path)
    )
    assert count == 1
    _forge(path, body)
    return path


@pytest.mark.parametrize("n", [2_500, 25_000])
def test_many_empty_shards_are_checked_in_linear_time(tmp_path, monkeypatch, n):
    """2,500 empty shards took 11 s to read, every pair of shards compared; the coverage check
    now compares none, and reading compares each shard with the region once."""
    path = _with_empty_shards(tmp_path, n)
    calls = [0]
    overlap = geometry._overlap

    def counted(a, b):
        calls[0] += 1
        return overlap(a, b)

    monkeypatch.setattr(geometry, "_overlap", counted)
    value = Snapshot(path).read_object("0/m/w")
    assert torch.equal(value, torch.arange(16.0).reshape(4, 4))
    assert calls[0] <= 2 * (n + 1)  # every pair: n * (n + 1) / 2


def _covers_exactly(shape, boxes) -> bool:
    """By counting, element by element."""
    counts: dict[tuple[int, ...], int] = {}
    for offsets, sizes in boxes:
        if any(o < 0 or n < 0 or o + n > g for o, n, g in zip(offsets, sizes, shape, strict=True)):
            return False
        ranges = (range(o, o + n) for o, n in zip(offsets, sizes, strict=True))
        for index in itertools.product(*ranges):
            counts[index] = counts.get(index, 0) + 1
    every = itertools.product(*(range(g) for g in shape))
    return all(counts.pop(i, 0) == 1 for i in every) and not counts


def _put(values: tuple[int, ...], axis: int, value: int) -> tuple[int, ...]:
    return (*values[:axis], value, *values[axis + 1 :])


@st.composite
def _boxes(draw):
    """A shape of up to 4 axes cut into boxes (a cut box split in two, repeatedly), then
    perhaps damaged: a box moved, resized, repeated, or an empty one added."""
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=4)))
    boxes = [((0,) * len(shape), shape)]
    for _ in range(draw(st.integers(0, 8))):
        i = draw(st.integers(0, len(boxes) - 1))
        offsets, sizes = boxes[i]
        axes = [d for d, n in enumerate(sizes) if n >= 2]
        if not axes:
            continue
        d = draw(st.sampled_from(axes))
        cut = draw(st.integers(1, sizes[d] - 1))
        low = (offsets, _put(sizes, d, cut))
        high = (_put(offsets, d, offsets[d] + cut), _put(sizes, d, sizes[d] - cut))
        boxes[i : i + 1] = [low, high]
    how = draw(st.sampled_from(["none", "move", "resize", "repeat", "empty"]))
    if how in ("move", "resize") and shape:
        i = draw(st.integers(0, len(boxes) - 1))
        d = draw(st.integers(0, len(shape) - 1))
        offsets, sizes = boxes[i]
        step = draw(st.sampled_from([-1, 1]))
        if how == "move":
            offsets = _put(offsets, d, max(0, offsets[d] + step))
        else:
            sizes = _put(sizes, d, max(0, sizes[d] + step))
        boxes[i] = (offsets, sizes)
    elif how == "repeat":
        boxes.append(draw(st.sampled_from(boxes)))
    elif how == "empty" and shape:
        boxes.append(((0,) * len(shape), (0,) * len(shape)))
    return shape, draw(st.permutations(boxes))


@settings(max_examples=400, deadline=None)
@given(case=_boxes(), split_axes=st.sampled_from([geometry._MAX_SPLIT_AXES, 0, 1]))
def test_the_cover_check_agrees_with_counting(case, split_axes):
    """By corners (any split axes up to the limit) and pair by pair (past it): both agree
    with counting every element."""
    shape, boxes = case
    saved = geometry._MAX_SPLIT_AXES
    geometry._MAX_SPLIT_AXES = split_axes  # 0 and 1: small boxes go pair by pair
    try:
        assert (geometry.cover_problem(shape, boxes) is None) == _covers_exactly(shape, boxes)
    finally:
        geometry._MAX_SPLIT_AXES = saved


def test_a_tensor_split_along_too_many_axes_into_many_boxes_is_refused():
    """Past the split axes the corners handle, a few boxes are compared pair by pair; more are
    refused."""
    shape = (2,) * 7
    units = [(corner, (1,) * 7) for corner in itertools.product((0, 1), repeat=7)]
    problem = geometry.cover_problem(shape, units)
    assert problem is not None and "split along 7 axes into 128 boxes" in problem
    # A quarter in units, the rest in two boxes: 34 boxes, checked pair by pair.
    few = [*units[:32], ((1,) + (0,) * 6, (1,) + (2,) * 6), ((0, 1) + (0,) * 5, (1, 1) + (2,) * 5)]
    assert geometry.cover_problem(shape, few) is None
    few[0] = ((0, 1) + (0,) * 5, (1,) * 7)  # the same volume, one unit twice and one missing
    assert geometry.cover_problem(shape, few) == "two of the boxes overlap"


def test_did_you_mean_is_bounded(snap, monkeypatch):
    """A manifest of long, alike keys: difflib computes its full ratio (quadratic in the keys'
    lengths) for a few candidates only, on their first characters."""
    import difflib

    body = _body(snap)
    step = _line(body, "0/extra/step")
    alphabet = [chr(0x4E00 + i) for i in range(150)]
    rng = random.Random(0)
    keys = ["".join(rng.choice(alphabet) for _ in range(2000)) for _ in range(300)]
    lines = "".join(
        f'\n  "0/extra/{k}": {{"type": "primitive", "value_type": "int", "value": 1}}' for k in keys
    )
    _forge(snap, body.replace(step, step + lines))
    ratios = [0]
    ratio = difflib.SequenceMatcher.ratio

    def counted(self):
        ratios[0] += 1
        assert len(self.a) <= 200 and len(self.b) <= 200
        return ratio(self)

    monkeypatch.setattr(difflib.SequenceMatcher, "ratio", counted)
    with pytest.raises(EntryNotFoundError, match="has no entry") as caught:
        Snapshot(snap).read_object("0/extra/" + keys[3][:-1] + "x")
    assert "did you mean ['0/extra/" + keys[3] in str(caught.value)
    assert ratios[0] <= 50


def test_du_walks_the_ranks_listed_not_the_world_size_claimed(snap):
    """``du`` counts a leaf listed once under rank 0 again under every other rank: over the
    ranks the manifest lists, not every number below the world size it claims (a trillion
    would never end)."""
    from snapshot._engine.format.manifest_io import load_manifest
    from snapshot._engine.tools.inspection import disk_usage

    body = _body(snap).replace("world_size: 1", "world_size: 1000000000000")
    body = body.replace("format_version: 1", "format_version: 3")
    w = _line(body, "0/model/w")
    body = body.replace(w, w[:-1] + ', "replicated": true}')
    b = _line(body, "0/model/b")  # rank 7 lists a key of its own: only it gets rank 0's copy
    _forge(snap, body.replace(b, b + "\n" + b.replace('"0/model/b"', '"7/model"', 1)))
    manifest = load_manifest(snap, None)
    assert manifest.world_size == 10**12
    usage = disk_usage(manifest)
    assert {(r.rank, r.key) for r in usage.rows} == {("0", "model"), ("0", "extra"), ("7", "model")}
    (seven,) = [r for r in usage.rows if r.rank == "7"]
    assert seven.replicated_bytes == 64 * 4


def test_the_pickled_pieces_check_is_linear():
    """torchsnapshot's pickled tensors are checked by the same corners."""
    from manifest import Location, PickledTensorEntry, Shard
    from snapshot._engine.handlers.objects import _check_pieces

    loc = (Location(blob="0/0", offset=0, nbytes=16),)
    pieces = tuple(Shard(offsets=(i, 0), sizes=(1, 4), chunks=loc) for i in range(20_000)) + tuple(
        Shard(offsets=(0, 0), sizes=(0, 4), chunks=loc) for _ in range(20_000)
    )
    entry = PickledTensorEntry(dtype="float32", shape=(20_000, 4), pieces=pieces)
    _check_pieces("0/t", entry, torch.float32)  # 40,000 pieces: quadratic took minutes
    twice = PickledTensorEntry(dtype="float32", shape=(20_000, 4), pieces=pieces[1:] + pieces[2:3])
    with pytest.raises(CorruptSnapshotError, match="do not cover it exactly once"):
        _check_pieces("0/t", twice, torch.float32)


# ---------------------------------------------------------------------------------------------
# Growth: every amplifying input costs about ten times as much at ten times the size.


@pytest.mark.slow
def test_each_amplifying_input_grows_linearly():
    """``benchmarks/hostile_growth.py`` in a process of its own: entries, shards, YAML aliases
    (refused), nesting depth (refused) and chunk locations, each at n and 10 n. Linear growth
    is about tenfold, quadratic a hundredfold; the bound leaves room for noise. Time is CPU
    time, which a busy machine does not stretch as it does wall-clock time; the call count and
    the peak of allocations do not depend on the machine at all."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.hostile_growth", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    rows = {row["input"]: row for row in json.loads(done.stdout)}
    assert set(rows) == {"entries", "shards", "aliases", "depth", "chunks"}
    for name, row in rows.items():
        assert row["time_ratio"] < 30, (name, row)
        assert row["calls_ratio"] < 30, (name, row)
        assert row["memory_ratio"] < 30, (name, row)
    assert rows["aliases"]["outcome_10n"] == rows["depth"]["outcome_10n"] == "UnsafeSnapshotError"
