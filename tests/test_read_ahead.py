"""Read-ahead while a restore plans: which ranges are hinted, that hints stop once the reads
begin, that a failing hint never fails a restore, and that the local plugin's hint brings the
bytes into the page cache without following a link."""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
import sys
import threading
import time

import pytest
import torch

from benchmarks.common.system import drop_page_cache
from manifest import DictEntry, new_location, new_tensor_entry
from snapshot import Snapshot, StateDict
from snapshot._engine.flatten import subtree
from snapshot._engine.restore import read_ahead
from snapshot._engine.restore.loader import Loader
from storage_plugins import register_storage_plugin, unregister_storage_plugin
from storage_plugins.base import UnsafeBlobError
from storage_plugins.fs import FSStoragePlugin


def _spans(entries, roots, skip_replicated):
    return read_ahead.ranges(entries, [subtree(entries, r) for r in roots], skip_replicated)


def _tensor(blob: str, offset: int, nbytes: int, replicated: bool = False):
    return new_tensor_entry("uint8", (nbytes,), (new_location(blob, offset, nbytes),), replicated)


def test_ranges_merge_close_locations_per_blob_and_keep_to_the_roots():
    gap = read_ahead.GAP_BYTES
    entries = {
        "0/a": DictEntry(keys=["x", "y", "z", "far"]),
        "0/a/x": _tensor("0/s0", 0, 100),
        "0/a/y": _tensor("0/s0", 112, 100),  # aligned after x: one range
        "0/a/z": _tensor("0/s1", 0, 50),  # another blob
        "0/a/far": _tensor("0/s1", 50 + gap + 1, 10),  # too far after z: a range of its own
        "0/b": DictEntry(keys=["w"]),
        "0/b/w": _tensor("0/s2", 0, 10),
    }
    whole = [("0/s0", 0, 212), ("0/s1", 0, 50), ("0/s1", 50 + gap + 1, 10)]
    assert _spans(entries, ["0/a"], False) == whole
    assert _spans(entries, ["0/b", "0/a"], False) == [("0/s2", 0, 10), *whole]


def test_ranges_leave_out_replicated_leaves_in_a_group():
    entries = {
        "0/a": DictEntry(keys=["own", "shared"]),
        "0/a/own": _tensor("0/s0", 0, 100),
        "0/a/shared": _tensor("0/rs0", 0, 100, replicated=True),
    }
    assert [r[0] for r in _spans(entries, ["0/a"], False)] == ["0/s0", "0/rs0"]
    assert [r[0] for r in _spans(entries, ["0/a"], True)] == ["0/s0"]


class HintLog(FSStoragePlugin):
    """``hints://<path>``: records each hint and each read with the time it began; with
    ``fail``, each hint raises; with ``slow``, each takes that many seconds."""

    hints: list[tuple[float, str, int, int]] = []
    reads: list[float] = []
    fail = False
    slow = 0.0

    def __init__(self, url, storage_options=None):
        super().__init__(url.removeprefix("hints://"), storage_options)

    async def read_ahead(self, path, offset, nbytes):
        HintLog.hints.append((time.monotonic(), path, offset, nbytes))
        if HintLog.slow:
            await asyncio.sleep(HintLog.slow)
        if HintLog.fail:
            raise OSError("no read-ahead here")
        await super().read_ahead(path, offset, nbytes)

    async def readv(self, path, offset, outs):
        HintLog.reads.append(time.monotonic())
        await super().readv(path, offset, outs)

    async def readv_observed(self, path, offset, outs, observe):
        HintLog.reads.append(time.monotonic())
        await super().readv_observed(path, offset, outs, observe)


@pytest.fixture
def hints(tmp_path, monkeypatch):
    """The ``hints://`` scheme, and a restore whose planning takes 0.3 s: hints go out only
    while a restore plans, and planning a small state is done before the first would."""
    HintLog.hints, HintLog.reads, HintLog.fail, HintLog.slow = [], [], False, 0.0
    original = Loader.add_subtree

    def slow_planning(self, *args, **kwargs):
        time.sleep(0.3)
        original(self, *args, **kwargs)

    monkeypatch.setattr(Loader, "add_subtree", slow_planning)
    register_storage_plugin("hints", HintLog)
    yield f"hints://{tmp_path / 's'}"
    unregister_storage_plugin("hints")


def _state(n: int, numel: int, seed: int) -> StateDict:
    g = torch.Generator().manual_seed(seed)
    return StateDict({f"t{i}": torch.randn(numel, generator=g) for i in range(n)})


def test_a_restore_hints_the_ranges_of_the_keys_it_restores(hints):
    a, b = _state(40, 1000, 0), _state(3, 1 << 20, 1)  # a: one slab; b: three 4 MiB blobs
    snap = Snapshot.take(hints, {"a": a, "b": b})
    out = StateDict({k: torch.zeros_like(v) for k, v in a.items()})
    HintLog.hints = []
    snap.restore({"a": out})
    assert all(torch.equal(out[k], a[k]) for k in a)
    manifest = snap.get_manifest()
    a_blobs = {manifest[f"0/a/t{i}"].locations[0].blob for i in range(40)}
    assert {blob for _, blob, _, _ in HintLog.hints} == a_blobs  # none of b's blobs
    hinted = sum(n for *_, n in HintLog.hints)
    assert hinted == sum(manifest[f"0/a/t{i}"].locations[0].nbytes for i in range(40)) + sum(
        -(-1000 * 4 // 16) * 16 - 1000 * 4 for _ in range(39)
    )  # the members and the alignment padding between them


def test_hints_stop_once_the_reads_begin(hints):
    state = _state(4, 6 << 20, 2)  # 24 MiB each: 3 pieces of a hint apiece
    snap = Snapshot.take(hints, {"s": state})
    HintLog.hints, HintLog.reads, HintLog.slow = [], [], 0.2
    out = StateDict({k: torch.zeros_like(v) for k, v in state.items()})
    snap.restore({"s": out})
    assert all(torch.equal(out[k], state[k]) for k in state)
    assert HintLog.hints and HintLog.reads
    # Hints of 0.2 s each during 0.3 s of planning: a few began (two on an idle machine),
    # then the reads, and no hint after them: the state's 12 pieces were never all hinted.
    assert 1 <= len(HintLog.hints) < 12
    assert max(t for t, *_ in HintLog.hints) < min(HintLog.reads)


def test_a_failing_hint_never_fails_a_restore(hints):
    state = _state(30, 1000, 3)
    snap = Snapshot.take(hints, {"s": state})
    HintLog.fail = True
    out = StateDict({k: torch.zeros_like(v) for k, v in state.items()})
    snap.restore({"s": out})
    assert HintLog.hints and all(torch.equal(out[k], state[k]) for k in state)


def _resident_fraction(path: str) -> float:
    """The share of the file's pages in the page cache (``mincore``)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        # Private and writable only so that ctypes takes its address; nothing writes to it.
        m = mmap.mmap(
            f.fileno(), size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    try:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        first = ctypes.c_char.from_buffer(m)
        addr = ctypes.addressof(first)  # the mapping's address
        del first  # (the mapping closes only once nothing views it)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
        if libc.mincore(addr, size, vec) != 0:
            pytest.skip(f"mincore failed: errno {ctypes.get_errno()}")
        return sum(v & 1 for v in vec) / pages
    finally:
        m.close()


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise on this platform")
@pytest.mark.skipif(sys.platform != "linux", reason="mincore through libc: Linux")
def test_the_local_plugins_hint_reads_into_the_page_cache_without_following_links(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    blob = root / "blob"
    blob.write_bytes(os.urandom(8 << 20))
    drop_page_cache(str(blob))
    if _resident_fraction(str(blob)) > 0.5:
        pytest.skip("this file system keeps the file in memory (tmpfs): nothing to read ahead")
    plugin = FSStoragePlugin(str(root))
    asyncio.run(plugin.read_ahead("blob", 0, 4 << 20))
    deadline = time.monotonic() + 10
    while _resident_fraction(str(blob)) < 0.45 and time.monotonic() < deadline:
        time.sleep(0.01)  # the kernel's reads complete in the background
    assert 0.45 <= _resident_fraction(str(blob)) <= 0.75  # the first half, and little more
    # The same hint given at once, from the caller's thread (as the restore's hint thread does).
    assert plugin.read_ahead_now("blob", 4 << 20, 4 << 20)
    while _resident_fraction(str(blob)) < 0.95 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _resident_fraction(str(blob)) >= 0.95
    outside = tmp_path / "outside"
    outside.write_bytes(b"x" * 4096)
    (root / "link").symlink_to(outside)
    with pytest.raises(UnsafeBlobError):
        asyncio.run(plugin.read_ahead("link", 0, 4096))
    with pytest.raises(UnsafeBlobError):
        plugin.read_ahead_now("link", 0, 4096)


def test_the_local_plugins_hints_go_out_from_the_restores_own_thread(tmp_path, monkeypatch):
    state = _state(20, 1000, 5)
    snap = Snapshot.take(str(tmp_path / "s"), {"s": state})
    seen: list[str] = []
    original = FSStoragePlugin._read_ahead_sync

    def record(self, path, offset, nbytes):
        seen.append(threading.current_thread().name)
        original(self, path, offset, nbytes)

    monkeypatch.setattr(FSStoragePlugin, "_read_ahead_sync", record)
    out = StateDict({k: torch.zeros_like(v) for k, v in state.items()})
    snap.restore({"s": out})
    assert all(torch.equal(out[k], state[k]) for k in state)
    # Straight from the hint thread (``read_ahead_now``): not through the loop or the pool.
    assert seen and set(seen) == {"statesnap-hints"}


def test_a_plugins_own_async_hint_is_awaited_on_the_io_loop(hints):
    state = _state(20, 1000, 4)
    snap = Snapshot.take(hints, {"s": state})
    seen: list[str] = []
    original = HintLog.read_ahead

    async def record(self, path, offset, nbytes):
        seen.append(threading.current_thread().name)
        await original(self, path, offset, nbytes)

    HintLog.read_ahead = record
    try:
        snap.restore({"s": StateDict({k: torch.zeros_like(v) for k, v in state.items()})})
    finally:
        HintLog.read_ahead = original
    assert seen and set(seen) == {"statesnap-io"}  # the I/O loop's thread


def test_only_a_store_that_reads_ahead_is_given_hints(tmp_path):
    from snapshot._engine.restore.linked import LinkedStorage
    from storage_plugins.memory import MemoryStoragePlugin

    fs = FSStoragePlugin(str(tmp_path))
    linked = LinkedStorage(fs, str(tmp_path), None)
    assert read_ahead.takes_hints(fs)
    assert read_ahead.takes_hints(linked)
    assert not read_ahead.takes_hints(MemoryStoragePlugin("memory://x"))
    # Before a manifest is decoded, known from the plugin's class: nothing opened for nothing.
    assert read_ahead._serves_hints(str(tmp_path))
    assert not read_ahead._serves_hints("memory://x")
    assert not read_ahead._serves_hints("nosuchscheme://x")
    # A sibling snapshot's blob is hinted through ``read_ahead`` on the loop, where its plugin
    # is made: not at once from the hint thread.
    assert not linked.read_ahead_now("../base/0/blob", 0, 10)
    assert not MemoryStoragePlugin("memory://x").read_ahead_now("blob", 0, 10)


# ---- hints given as the manifest is decoded ------------------------------------------------------


def _intervals(spans):
    """The byte ranges of ``spans`` per blob, merged: {blob: [(start, end), ...]}."""
    out: dict[str, list[list[int]]] = {}
    for blob, offset, nbytes in sorted(spans):
        runs = out.setdefault(blob, [])
        if runs and offset <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], offset + nbytes)
        else:
            runs.append([offset, offset + nbytes])
    return out


def _covers(spans, blob, start, end) -> bool:
    return any(a <= start and end <= b for a, b in _intervals(spans).get(blob, []))


def _decoded_ranges(data: bytes, roots, *, verify: bool = True, piece_chars: int | None = None):
    """The ranges a restore of ``roots`` hints while it decodes ``data`` (a manifest's
    bytes), and the manifest decoded (or the error decoding it raised)."""
    import manifest as mf
    from manifest import codec

    feed = read_ahead.DecodedRanges(tuple(f"{r}/" for r in roots), read_ahead.GAP_BYTES)
    saved = codec.PIECE_CHARS
    if piece_chars is not None:
        codec.PIECE_CHARS = piece_chars
    try:
        decoded = mf.loads(data, verify=verify, on_tensors=feed.tensors)
    except mf.ManifestDecodeError as e:
        decoded = e
    finally:
        codec.PIECE_CHARS = saved
        feed.end()
    return list(feed), decoded


@pytest.mark.parametrize("seed", range(4))
def test_ranges_found_as_the_manifest_is_decoded_cover_each_keys_tensors_and_nothing_else(
    tmp_path, seed
):
    """For each key, alone or with others, and whatever the pieces the manifest is decoded
    in: every dense tensor under it is covered, and no range reaches outside the extent of
    the key's own tensors in each blob. Keys needing escapes in the manifest's text are found
    too."""
    g = torch.Generator().manual_seed(seed)
    sizes = [1, 100, 3000, 70_000, 300_000]

    def tensor():
        return torch.randn(sizes[int(torch.randint(len(sizes), (1,), generator=g))], generator=g)

    keys = ["model", 'q"uote', "line\u2028sep", "ünï", f"k{seed}", f"k{seed}x"]
    app = {
        k: StateDict(
            w=tensor(),
            nested={"a": [tensor(), tensor(), {"deep": tensor()}], "b": tensor(), "n": 3},
            more={f"t{i}": tensor() for i in range(int(torch.randint(1, 30, (1,), generator=g)))},
        )
        for k in keys
    }
    path = str(tmp_path / "s")
    Snapshot.take(path, app)
    with open(os.path.join(path, "manifest.yaml"), "rb") as f:
        data = f.read()
    manifest = Snapshot(path).get_manifest()
    from manifest import TensorEntry
    from snapshot._engine.flatten import escape_key

    for piece_chars in (None, 200, 1):  # the default; a few lines; one line a piece
        for chosen in [[k] for k in keys] + [keys[::2]]:
            roots = [f"0/{escape_key(k)}" for k in chosen]
            spans, decoded = _decoded_ranges(data, roots, piece_chars=piece_chars)
            assert dict(decoded.entries) == dict(manifest.items())
            mine = [
                loc
                for root in roots
                for p in subtree(manifest, root)
                if type(manifest[p]) is TensorEntry
                for loc in manifest[p].chunks
            ]
            for c in mine:
                assert _covers(spans, c.blob, c.offset, c.offset + c.nbytes), (chosen, c)
            for blob, offset, nbytes in spans:
                own = [c for c in mine if c.blob == blob]
                assert own, (chosen, blob)
                assert min(c.offset for c in own) <= offset
                assert offset + nbytes <= max(c.offset + c.nbytes for c in own)


def test_ranges_hinted_while_decoding_name_plain_blobs_only():
    """A hint opens a blob: a forged line whose blob would leave the snapshot, or point into a
    sibling, gives none (the decoding refuses the manifest, after the plain lines before it
    were hinted)."""
    import manifest as mf

    def line(path, blob):
        return (
            f'  "{path}": {{"type": "tensor", "dtype": "uint8", "shape": [4], '
            f'"chunks": [["{blob}", 0, 4, 1]]}}'
        )

    head = ["format: statesnap", "format_version: 1", "world_size: 1", "entries:"]
    for forged in ("../../etc/passwd", "/etc/passwd", "../s1/0/3"):
        data = "\n".join(
            [
                *head,
                '  "0/k": {"type": "dict", "keys": ["a", "b"]}',
                line("0/k/a", "0/7"),
                line("0/k/b", forged),
                "",
            ]
        ).encode()
        spans, decoded = _decoded_ranges(data, ["0/k"], verify=False)
        assert isinstance(decoded, mf.UnsafeManifestError), forged
        assert spans == [("0/7", 0, 4)]
        spans, _ = _decoded_ranges(data, ["0/other"], verify=False)
        assert spans == []


def test_merged_ranges_join_a_blobs_close_ranges_only():
    def loc(blob, offset, nbytes):
        return new_location(blob, offset, nbytes, 1)

    locations = [
        loc("0/1", 100, 10),  # out of order with the next, close: one range
        loc("0/1", 0, 100),
        loc("0/1", 10_000, 5),  # far from them: a range of its own
        loc("0/2", 0, 8),
        loc("0/1", 110, 10),  # the first blob again, after another: a new run
    ]
    assert read_ahead.merged(locations, 100) == [
        ("0/1", 0, 110),
        ("0/1", 10_000, 5),
        ("0/2", 0, 8),
        ("0/1", 110, 10),
    ]
    # A gap as wide as the extent: each run of a blob is one range.
    assert read_ahead.merged(locations, 10_000)[0] == ("0/1", 0, 10_005)
    assert read_ahead.merged([], 100) == []


def test_a_restore_of_an_opened_snapshot_hints_as_it_decodes_the_manifest(tmp_path, monkeypatch):
    """The hints start before the decoding and are given piece by piece while it runs; the
    restore does not look for its ranges again."""
    import snapshot.snapshot as public
    from manifest import codec

    state = _state(50, 1000, 6)
    path = str(tmp_path / "s")
    Snapshot.take(path, {"s": state, "other": _state(3, 10, 7)})
    events: list[str] = []
    decode = public.decode_manifest
    started = read_ahead.ReadAhead.__init__
    fed = read_ahead.DecodedRanges.tensors
    merged = read_ahead.merged
    hinted: list[tuple[str, int, int]] = []

    def decoding(*args, **kwargs):
        events.append("decode")
        out = decode(*args, **kwargs)
        events.append("decoded")
        return out

    def starting(self, plugin, spans, *args):
        events.append("hints")
        started(self, plugin, spans, *args)

    def feeding(self, items):
        events.append("piece")
        fed(self, items)

    def merging(*args):
        spans = merged(*args)
        hinted.extend(spans)
        return spans

    def no_ranges(*args):
        raise AssertionError("the restore found its ranges again")

    monkeypatch.setattr(codec, "PIECE_CHARS", 2000)  # several pieces of this small manifest
    monkeypatch.setattr(public, "decode_manifest", decoding)
    monkeypatch.setattr(read_ahead.ReadAhead, "__init__", starting)
    monkeypatch.setattr(read_ahead.DecodedRanges, "tensors", feeding)
    monkeypatch.setattr(read_ahead, "merged", merging)
    monkeypatch.setattr(read_ahead, "ranges", no_ranges)
    snap = Snapshot(path)
    assert events == []  # opening decodes nothing
    out = StateDict({k: torch.zeros_like(v) for k, v in state.items()})
    snap.restore({"s": out})
    assert all(torch.equal(out[k], state[k]) for k in state)
    assert events[:2] == ["hints", "decode"] and events[-1] == "decoded"
    assert events.count("piece") > 1 and set(events[2:-1]) == {"piece"}
    stored = sum(e.nbytes for p, e in snap.get_manifest().items() if p.startswith("0/s/"))
    # The members and the alignment padding between them, of this key only.
    total = sum(n for *_, n in hinted)
    assert stored <= total < stored + 50 * 16


@pytest.mark.parametrize("damage", ["forged blob", "missing key"])
def test_hints_fed_by_a_decoding_end_with_it_whatever_it_finds(tmp_path, damage):
    """The hint thread of a restore that feeds it while decoding ends when the restore does:
    after a manifest refused half-way through (its checksum line made to match), and after
    a restore of a key the snapshot does not hold (nothing to hint)."""
    from tests.helpers import seal_manifest

    path = str(tmp_path / "s")
    state = _state(30, 100, 3)
    Snapshot.take(path, {"s": state})
    out = StateDict({k: torch.zeros_like(v) for k, v in state.items()})
    if damage == "forged blob":
        name = os.path.join(path, "manifest.yaml")
        with open(name, "rb") as f:
            body = f.read().rsplit(b"# crc32", 1)[0]
        lines = body.split(b"\n")
        last = max(i for i, line in enumerate(lines) if b'"chunks": [["0/' in line)
        lines[last] = lines[last].replace(b'[["0/', b'[["../../0/', 1)
        with open(name, "wb") as f:
            f.write(seal_manifest(b"\n".join(lines)))
        with pytest.raises(Exception, match="unsafe blob path"):
            Snapshot(path).restore({"s": out})
    else:
        with pytest.raises(Exception, match="nokey"):
            Snapshot(path).restore({"nokey": out})
    deadline = time.monotonic() + 10
    while any(t.name == "statesnap-hints" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "a hint thread outlived its restore"
        time.sleep(0.01)


def test_a_manifest_read_by_the_yaml_path_is_hinted_once_decoded(tmp_path, monkeypatch):
    """A manifest not laid out as the writer lays it out (re-dumped as block YAML) is decoded
    by the YAML path: its tensors reach the hints once decoded, and the restore is exact."""
    import yaml

    from tests.helpers import seal_manifest

    path = str(tmp_path / "s")
    state = _state(20, 300, 4)
    Snapshot.take(path, {"s": state})
    name = os.path.join(path, "manifest.yaml")
    with open(name, "rb") as f:
        doc = yaml.safe_load(f.read().decode())
    with open(name, "wb") as f:
        f.write(seal_manifest(yaml.safe_dump(doc, sort_keys=False).encode()))
    merged = read_ahead.merged
    hinted: list[tuple[str, int, int]] = []

    def merging(*args):
        spans = merged(*args)
        hinted.extend(spans)
        return spans

    monkeypatch.setattr(read_ahead, "merged", merging)
    out = StateDict({k: torch.zeros_like(v) for k, v in state.items()})
    snap = Snapshot(path)
    snap.restore({"s": out})
    assert all(torch.equal(out[k], state[k]) for k in state)
    stored = sum(e.nbytes for p, e in snap.get_manifest().items() if p.startswith("0/s/"))
    assert stored <= sum(n for *_, n in hinted) < stored + 20 * 16


def test_the_read_ahead_device_benchmark_runs_every_way(tmp_path, capsys):
    """``benchmarks/read_ahead_device.py`` at a small size: every way moves every byte of the
    snapshot's blobs (the script stops otherwise) and gets its table row."""
    from benchmarks import read_ahead_device

    read_ahead_device.main(["--count", "300", "--reps", "2", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "300 tensors of 10 KiB" in out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| way | median s |")
    names = [r.split(" | ")[0].removeprefix("| ") for r in rows[1:]]
    assert names == [
        f"advise {read_ahead.PIECE_BYTES >> 20} MiB, 1 thread (the library's)",
        "reads 1 x 1 MiB",
        "reads 2 x 1 MiB",
        "reads 4 x 1 MiB",
        "raw 4 x 8 MiB",
        "raw 4 x 1 MiB",
    ]
    assert list(tmp_path.iterdir()) == []  # the snapshot is removed
