"""Damaged snapshots raise the library's errors and nothing else (hypothesis).

A real snapshot (tensors of several dtypes, chunks, slabs, containers, primitives, an object) has
its manifest damaged at random: bytes flipped, cut short, a run deleted or repeated, a number
changed, lines swapped. With its checksum line as taken, any change is a ``ChecksumError`` when
the snapshot is opened. Forged (the checksum line recomputed, so that the decoder itself is what
is tested), opening it, reading every entry and restoring it must either work or raise a
``SnapshotError`` subclass: never another exception, a crash or a hang. Blobs damaged at random
(bytes flipped, cut short, grown, removed) must raise ``CorruptSnapshotError`` whenever an entry
stored in them is read, and only then.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import manifest as mf
from snapshot import (
    ChecksumError,
    CorruptSnapshotError,
    Options,
    Snapshot,
    SnapshotError,
    StateDict,
    UnsafeSnapshotError,
)
from tests.helpers import open_decoded, seal_manifest

MANIFEST = "manifest.yaml"


def _state() -> dict[str, StateDict]:
    return {
        "model": StateDict(
            w=torch.arange(12.0).reshape(3, 4),
            b=torch.ones(5, dtype=torch.bfloat16),
            big=torch.arange(100_000, dtype=torch.int32),  # chunked below
        ),
        "extra": StateDict(
            step=7, name="run", ratio=0.5, flags=[True, None], nested={"k": (1, 2)}, obj={1, 2}
        ),
    }


def _targets() -> dict[str, StateDict]:
    return {
        "model": StateDict(
            w=torch.zeros(3, 4),
            b=torch.zeros(5, dtype=torch.bfloat16),
            big=torch.zeros(100_000, dtype=torch.int32),
        ),
        "extra": StateDict(),
    }


@pytest.fixture(scope="module")
def snapshot_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "snap"
    options = Options(
        chunk_bytes=65536,  # the big tensor in several chunks...
        slab_threshold_bytes=1024,  # ...of their own; the rest in a slab
    )
    Snapshot.take(str(path), _state(), options=options)
    with open(path / MANIFEST, "rb") as f:
        original = f.read()
    assert len(_blobs(str(path))) >= 8  # 7 chunks, a slab, an object
    yield str(path), original


def _exercise(path: str) -> None:
    """Everything a user does with a snapshot; SnapshotError is an acceptable outcome."""
    try:
        snap = Snapshot(path)
        for logical in list(snap.get_manifest()):
            snap.read_object(logical)
        snap.restore(_targets())
    except SnapshotError:
        pass


@st.composite
def damaged(draw, original: bytes) -> bytes:
    data = bytearray(original)
    kind = draw(st.sampled_from(["flip", "cut", "delete", "repeat", "number", "swap"]))
    if kind == "flip":
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] = draw(st.integers(0, 255))
    elif kind == "cut":
        del data[draw(st.integers(0, len(data) - 1)) :]
    elif kind in ("delete", "repeat"):
        i = draw(st.integers(0, len(data) - 1))
        j = draw(st.integers(i, min(len(data), i + 64)))
        data[i:j] = b"" if kind == "delete" else data[i:j] * 2
    elif kind == "number":
        numbers = list(re.finditer(rb"-?\d+", bytes(data)))
        m = draw(st.sampled_from(numbers))
        new = draw(
            st.sampled_from([b"0", b"-1", b"1", b"3", b"65536", b"4294967296", b"99999999999999"])
        )
        data[m.start() : m.end()] = new
    else:
        lines = bytes(data).split(b"\n")
        i = draw(st.integers(0, len(lines) - 1))
        j = draw(st.integers(0, len(lines) - 1))
        lines[i], lines[j] = lines[j], lines[i]
        data = bytearray(b"\n".join(lines))
    return bytes(data)


@pytest.mark.slow
@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_a_damaged_manifest_raises_only_snapshot_errors(snapshot_dir, data):
    path, original = snapshot_dir
    body, trailer = _split(original)
    bad = data.draw(damaged(body))
    try:
        # As damaged: the checksum line no longer matches, unless nothing changed.
        with open(os.path.join(path, MANIFEST), "wb") as f:
            f.write(bad + trailer)
        if bad != body:
            with pytest.raises(ChecksumError):
                Snapshot(path)
        else:
            _exercise(path)
        # Forged: the decoder and the reads must hold on their own.
        with open(os.path.join(path, MANIFEST), "wb") as f:
            f.write(seal_manifest(bad))
        _exercise(path)
    finally:
        with open(os.path.join(path, MANIFEST), "wb") as f:
            f.write(original)


def _split(manifest: bytes) -> tuple[bytes, bytes]:
    """A manifest's bytes before its checksum line, and the line."""
    cut = manifest.rindex(b"# crc32 ")
    return manifest[:cut], manifest[cut:]


def test_the_undamaged_snapshot_restores(snapshot_dir):
    path, _ = snapshot_dir
    out = _targets()
    Snapshot(path).restore(out)
    assert torch.equal(out["model"]["big"], torch.arange(100_000, dtype=torch.int32))
    assert out["extra"]["obj"] == {1, 2} and out["extra"]["nested"] == {"k": (1, 2)}


def _blobs(path: str) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), path)
        for d, _, fs in os.walk(path)
        for f in fs
        if f != MANIFEST
    )


@pytest.mark.slow
@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_a_damaged_blob_is_corrupt_for_its_entries_only(snapshot_dir, data):
    path, _ = snapshot_dir
    blob = data.draw(st.sampled_from(_blobs(path)))
    full = os.path.join(path, blob)
    with open(full, "rb") as f:
        content = f.read()
    kind = data.draw(st.sampled_from(["flip", "cut", "grow", "remove"]))
    bad = bytearray(content)
    flipped: set[int] = set()
    if kind == "flip":
        flipped = data.draw(st.sets(st.integers(0, len(bad) - 1), min_size=1, max_size=3))
        for i in flipped:
            bad[i] ^= data.draw(st.integers(1, 255))
    elif kind == "cut":
        del bad[data.draw(st.integers(0, len(bad) - 1)) :]
    elif kind == "grow":
        bad += data.draw(st.binary(min_size=1, max_size=64))
    pattern = {
        "flip": "checksum mismatch",
        "cut": "shorter",
        "grow": "longer",
        "remove": "missing",
    }[kind]
    try:
        if kind == "remove":
            os.remove(full)
        else:
            with open(full, "wb") as f:
                f.write(bad)
        snap = Snapshot(path)
        manifest = snap.get_manifest()

        def hit(loc) -> bool:
            # A flip damages the ranges holding a flipped byte (not the padding between slab
            # members); any other damage is seen by every read of the blob (its size).
            if loc.blob != blob:
                return False
            return kind != "flip" or any(loc.offset <= i < loc.offset + loc.nbytes for i in flipped)

        for logical in manifest:
            below = [p for p in manifest if p == logical or p.startswith(logical + "/")]
            if any(hit(loc) for p in below for loc in manifest[p].locations):
                with pytest.raises(CorruptSnapshotError, match=f"{pattern}"):
                    snap.read_object(logical)
            else:
                snap.read_object(logical)  # nothing of it is in the damaged blob
        if any(hit(loc) for e in manifest.values() for loc in e.locations):
            with pytest.raises(CorruptSnapshotError, match=pattern):
                snap.restore(_targets())
        else:
            snap.restore(_targets())
    finally:
        with open(full, "wb") as f:
            f.write(content)


@pytest.mark.parametrize(
    ("pattern", "replacement", "error"),
    [
        # An object's size: reading it must not try to allocate what the manifest claims (the
        # blob's size is asked first).
        (
            rb'("obj_type": "set", "location": \["[^"]+", 0, )\d+',
            rb"\g<1>99999999999999",
            "shorter than the manifest says",
        ),
        # A tuple's length: never build or walk that many child paths.
        (
            rb'("0/extra/nested/k": \{"type": "tuple", "length": )\d+',
            rb"\g<1>99999999999999",
            "holds only",
        ),
    ],
)
def test_sizes_claimed_by_a_damaged_manifest_are_not_trusted(
    snapshot_dir, pattern, replacement, error
):
    """Found by the fuzz test above: each once exhausted memory."""
    path, original = snapshot_dir
    bad, n = re.subn(pattern, replacement, _split(original)[0])
    assert n == 1
    with open(os.path.join(path, MANIFEST), "wb") as f:
        f.write(seal_manifest(bad))
    try:
        snap = Snapshot(path)
        key = "0/extra/nested/k" if error == "holds only" else "0/extra/obj"
        for attempt in (lambda: snap.read_object(key), lambda: snap.restore(_targets())):
            with pytest.raises(CorruptSnapshotError) as caught:
                attempt()
            message = str(caught.value)
            assert path in message and key in message and error in message
    finally:
        with open(os.path.join(path, MANIFEST), "wb") as f:
            f.write(original)


# YAML the writer never emits, and YAML it does not write but a person might: each put into the
# real manifest at a random place, its checksum line recomputed. Opening, reading every entry
# and restoring must raise only SnapshotError subclasses (features the writer never emits are
# refused as UnsafeSnapshotError), or succeed.
_TAGS = [
    "!!str ", "!!int ", "!!float ", "!!binary ", "!!set ", "!!omap ", "!!timestamp ", "!! ",
    "!custom ", "! ", "!!python/name:os.system ", "!!python/object/apply:os.system ",
    "!<tag:yaml.org,2002:str> ",
]  # fmt: skip
_SCALARS = [
    "yes", "No", "on", "~", "null", "", ".inf", "-.Inf", ".nan", "0x1F", "0o17", "0b101",
    "1_000", "1:20", "2024-01-01", "2001-12-14t21:59:43.10-05:00", "=", "<<", "1e5", "-.0",
    "'it''s'", '"\\u2028"', '"\\x00"', "|\n  block", ">-\n  folded", "[]", "{}", "null null",
    "9" * 400, "-0", "+12", "0.", "@x", "`x", "%x", "0b_", "0x_", "-0b_", "._", "1:0.5",
]  # fmt: skip
_LINES = [
    "---", "...", "%YAML 1.1", "%TAG ! tag:example.com,2000:", "# a comment", "? complex",
    ": value", "<<: {a: 1}", "&anchor x: 1", "*alias : 1", "  ? [a, b]\n  : 1", "- item",
]  # fmt: skip


@st.composite
def yaml_featured(draw, body: bytes) -> tuple[bytes, list[str]]:
    """``body`` with YAML features put in, and their kinds: an anchor and an alias, a tag, a
    merge key, a flow collection without quotes, deep nesting, an odd scalar, a stray line, or
    a block-style rewrite of the whole document; one to three of them."""
    text = body.decode()
    kinds: list[str] = []
    for _ in range(draw(st.integers(1, 3))):
        values = [m.end() for m in re.finditer(r"(?::|,|\[) ?", text)]
        at = draw(st.sampled_from(values)) if values else 0
        kind = draw(
            st.sampled_from(
                ["alias", "anchor", "tag", "merge", "flow", "deep", "scalar", "line", "block"]
            )
        )
        kinds.append(kind)
        if kind == "alias":  # a value anchored, another replaced by its alias
            numbers = list(re.finditer(r"(?<=[ \[])\d+(?=[,\]}])", text))
            if len(numbers) >= 2:
                a, b = sorted(draw(st.lists(st.sampled_from(numbers), min_size=2, max_size=2,
                                            unique_by=lambda m: m.start())),
                              key=lambda m: m.start())  # fmt: skip
                text = (
                    text[: a.start()] + "&x " + text[a.start() : b.start()] + "*x" + text[b.end() :]
                )
            else:
                kinds.pop()
        elif kind == "anchor":
            text = text[:at] + f"&{draw(st.sampled_from(['a', 'x1', 'ü']))} " + text[at:]
        elif kind == "tag":
            text = text[:at] + draw(st.sampled_from(_TAGS)) + text[at:]
        elif kind == "merge":
            braces = [m.end() for m in re.finditer(r"\{", text)] or [0]
            i = draw(st.sampled_from(braces))
            text = text[:i] + '<<: {"replicated": true}, ' + text[i:]
        elif kind == "flow":  # a line's quotes dropped: flow YAML the writer does not write
            lines = text.split("\n")
            i = draw(st.integers(0, len(lines) - 1))
            lines[i] = lines[i].replace('"type": ', "type: ").replace('": "', '": ')
            text = "\n".join(lines)
        elif kind == "deep":
            depth = draw(st.sampled_from([2, 29, 30, 31, 32, 33, 1000, 100_000]))
            opener = draw(st.sampled_from(["[", "{a: "]))
            closer = "]" if opener == "[" else "}"
            text = text[:at] + opener * depth + "1" + closer * depth + text[at:]
        elif kind == "scalar":
            numbers = list(re.finditer(r"(?<=: )(\d+|\"[^\"]*\"|true|false|null)", text))
            if numbers:
                m = draw(st.sampled_from(numbers))
                text = text[: m.start()] + draw(st.sampled_from(_SCALARS)) + text[m.end() :]
        elif kind == "line":
            lines = text.split("\n")
            i = draw(st.integers(0, len(lines)))
            lines.insert(i, draw(st.sampled_from(_LINES)))
            text = "\n".join(lines)
        else:  # the whole document in block style, as a person's YAML tool would write it
            try:
                text = yaml.safe_dump(mf.load_yaml(text), default_flow_style=False)
            except mf.ManifestDecodeError:
                kinds.pop()  # not a document the reader takes: left as it is
    return text.encode("utf-8", "surrogatepass"), kinds


@pytest.mark.slow
@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_yaml_features_raise_only_snapshot_errors(snapshot_dir, data):
    path, original = snapshot_dir
    body, _ = _split(original)
    forged, kinds = data.draw(yaml_featured(body))
    try:
        with open(os.path.join(path, MANIFEST), "wb") as f:
            f.write(seal_manifest(forged))
        _exercise(path)
        if kinds == ["alias"]:  # a number anchored, a later one its alias: refused as unsafe
            with pytest.raises(UnsafeSnapshotError, match="YAML anchor &x"):
                open_decoded(path)
    finally:
        with open(os.path.join(path, MANIFEST), "wb") as f:
            f.write(original)
