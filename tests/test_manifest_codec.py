"""The manifest file format: byte-exact golden output, strict decoding, round trips."""

from __future__ import annotations

import math

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

import manifest as mf
from manifest import (
    DictEntry,
    ListEntry,
    Location,
    Manifest,
    ObjectEntry,
    PrimitiveEntry,
    TensorEntry,
    TupleEntry,
    codec,
)
from manifest.frames import Frame
from tests.helpers import seal_manifest

GOLDEN = Manifest(
    world_size=1,
    metadata={"library": "statesnap 0.1.0"},
    entries={
        "0/m": DictEntry(keys=("w", 3, "a b"), ordered=True),
        "0/m/w": TensorEntry(
            dtype="bfloat16",
            shape=(2, 3),
            chunks=(Location(blob="0/0", offset=0, nbytes=12, crc32=0xDEADBEEF),),
        ),
        "0/m/3": ListEntry(length=1, replicated=True),
        "0/m/3/0": PrimitiveEntry(value=float("-inf")),
        "0/m/a b": TupleEntry(length=2),
        "0/m/a b/0": PrimitiveEntry(value=b"\x00\x01"),
        "0/m/a b/1": ObjectEntry(
            serializer="torch_save",
            obj_type="set",
            location=Location(blob="0/1", offset=8, nbytes=100),
        ),
    },
)

GOLDEN_TEXT = """\
format: statesnap
format_version: 1
world_size: 1
metadata: {"library": "statesnap 0.1.0"}
entries:
  "0/m": {"type": "dict", "keys": ["w", 3, "a b"], "ordered": true}
  "0/m/w": {"type": "tensor", "dtype": "bfloat16", "shape": [2, 3], "chunks": [["0/0", 0, 12, 3735928559]]}
  "0/m/3": {"type": "list", "length": 1, "replicated": true}
  "0/m/3/0": {"type": "primitive", "value_type": "float", "value": "-inf"}
  "0/m/a b": {"type": "tuple", "length": 2}
  "0/m/a b/0": {"type": "primitive", "value_type": "bytes", "value": "AAE="}
  "0/m/a b/1": {"type": "object", "serializer": "torch_save", "obj_type": "set", "location": ["0/1", 8, 100]}
"""


# The CRC-32 of GOLDEN_TEXT, as its last line records it.
GOLDEN_BYTES = GOLDEN_TEXT.encode() + b"# crc32 8d4ea127\n"


def test_golden_bytes():
    assert mf.dumps(GOLDEN) == GOLDEN_BYTES
    assert mf.loads(GOLDEN_BYTES) == GOLDEN
    assert seal_manifest(GOLDEN_TEXT.encode()) == GOLDEN_BYTES


def test_positional_constructors_make_what_the_dataclasses_make():
    """``new_location`` and ``new_tensor_entry`` set every field (a field added later too)."""
    import dataclasses

    loc = mf.new_location("0/s1", 16, 40, 7)
    assert loc == Location(blob="0/s1", offset=16, nbytes=40, crc32=7)
    assert mf.new_location("0/1", 0, 3) == Location(blob="0/1", offset=0, nbytes=3)
    entry = mf.new_tensor_entry("int8", (2, 20), (loc,), True)
    assert entry == TensorEntry(dtype="int8", shape=(2, 20), chunks=(loc,), replicated=True)
    assert mf.new_tensor_entry("int8", (0,), ()) == TensorEntry(dtype="int8", shape=(0,), chunks=())
    for made in (loc, entry):
        for f in dataclasses.fields(made):
            getattr(made, f.name)  # AttributeError for a slot never set
        assert hash(made) == hash(dataclasses.replace(made))


def test_the_checksum_line_is_checked():
    body = GOLDEN_TEXT.encode()
    for damaged in [
        body.replace(b'"length": 2', b'"length": 3') + GOLDEN_BYTES[len(body) :],  # edited
        GOLDEN_BYTES[:-3] + b"0\n",  # the line itself changed
        body,  # no checksum line (a manifest cut short at a line's end looks like this)
        GOLDEN_BYTES[:-1],  # the line cut short
        b"",
    ]:
        with pytest.raises(mf.ManifestChecksumError):
            mf.loads(damaged)
    # Unverified, an edit is read as written; a missing line is no error.
    edited = body.replace(b'"length": 2', b'"length": 3') + GOLDEN_BYTES[len(body) :]
    assert mf.loads(edited, verify=False).entries["0/m/a b"] == TupleEntry(length=3)
    assert mf.loads(body, verify=False) == GOLDEN


def test_location_checksums_are_checked_integers():
    line = '["0/0", 0, 12, 3735928559]'
    for bad in ['["0/0", 0, 12, -1]', '["0/0", 0, 12, 4294967296]', '["0/0", 0, 12, "x"]',
                '["0/0", 0, 12, 1, 2]', '["0/0", 0, 12, 1.5]']:  # fmt: skip
        text = seal_manifest(GOLDEN_TEXT.replace(line, bad).encode())
        with pytest.raises(mf.ManifestDecodeError, match=r"0/m/w: expected \[blob, offset"):
            mf.loads(text)


def _fast(text):
    """The fast reading of a manifest's text, its entries in the plain-data form a YAML reader
    gives (the tensor lines it decoded straight into entries put back in that form); None when
    the text is not in the writer's layout."""
    fast = codec._parse_fast(text)
    if fast is None:
        return None
    entries = fast["entries"]
    plain = {p: e if isinstance(e, dict) else mf.entry_to_dict(e) for p, e in entries.items()}
    return {**fast, "entries": plain}


def _text(data):
    return data[: data.rindex(b"# crc32")].decode()


def test_the_file_is_yaml_and_yaml_readers_agree(monkeypatch):
    """Any YAML reader gets the same document; a hand-edited file goes through the YAML path."""
    doc = yaml.safe_load(GOLDEN_BYTES)  # the checksum line is a YAML comment
    assert doc["entries"]["0/m/w"]["chunks"] == [["0/0", 0, 12, 0xDEADBEEF]]
    assert _fast(GOLDEN_TEXT) == doc
    edited = GOLDEN_TEXT.replace('  "0/m/3": {', '  # a comment\n  "0/m/3": {')
    assert codec._parse_fast(edited) is None
    assert mf.loads(seal_manifest(edited.encode())) == GOLDEN
    reformatted = yaml.safe_dump(doc)  # block style, unquoted: still the same manifest
    assert mf.loads(seal_manifest(reformatted.encode())) == GOLDEN


def test_uses_libyaml_when_present():
    if not yaml.__with_libyaml__:
        pytest.skip("PyYAML was built without libyaml here; the pure-Python classes are used")
    assert codec._Loader is yaml.CSafeLoader


def test_safe_loader_refuses_python_tags():
    for old in [
        '{"library": "statesnap 0.1.0"}',
        '{"type": "list", "length": 1, "replicated": true}',
    ]:
        text = GOLDEN_TEXT.replace(old, "!!python/object/apply:os.system [echo hi]")
        assert text != GOLDEN_TEXT
        with pytest.raises(mf.UnsafeManifestError, match="YAML tag .*python/object/apply"):
            mf.loads(seal_manifest(text.encode()))


@pytest.mark.parametrize(
    "blob", ["../x", "a/../../b", "/abs", "a//b", "", "./a", "c:\\x", "a\\b", "s3://b/k"]
)
def test_unsafe_blob_paths(blob):
    with pytest.raises(mf.ManifestDecodeError, match="unsafe blob path"):
        mf.check_blob_path(blob)


def test_safe_blob_paths():
    for blob in ["0/1", "rank_3/slab.12", "a/b/c"]:
        assert mf.check_blob_path(blob) == blob


_locations = st.builds(
    Location,
    blob=st.from_regex(r"[0-9a-z]{1,4}(/[0-9a-z_.]{1,6}){0,2}", fullmatch=True).filter(
        lambda b: all(p not in (".", "..") for p in b.split("/"))
    ),
    offset=st.integers(0, 2**40),
    nbytes=st.integers(0, 2**40),
    crc32=st.one_of(st.none(), st.integers(0, 2**32 - 1)),
    # (Format 6: where a compressed range lies as stored; a frame holds at most 2**15 times
    # its bytes, so a frame of 2**25 bytes or more may hold any nbytes drawn above.)
    stored=st.one_of(
        st.none(),
        st.builds(
            Frame,
            codec=st.just("zstd"),
            offset=st.integers(0, 2**40),
            nbytes=st.integers(2**25, 2**40),
            crc32=st.one_of(st.none(), st.integers(0, 2**32 - 1)),
        ),
    ),
)
_entries = st.one_of(
    st.builds(
        TensorEntry,
        dtype=st.sampled_from(["float32", "int8", "bool"]),
        shape=st.lists(st.integers(0, 10**6), max_size=4).map(tuple),
        chunks=st.lists(_locations, max_size=3).map(tuple),
        replicated=st.booleans(),
    ),
    st.builds(
        ObjectEntry,
        serializer=st.sampled_from(["torch_save", "bytes", "utf8"]),
        obj_type=st.text(min_size=1, max_size=10),
        location=_locations,
    ),
    st.builds(
        PrimitiveEntry,
        value=st.one_of(
            st.none(),
            st.booleans(),
            st.integers(),
            st.floats(allow_nan=False),
            st.text(),
            st.binary(),
        ),
    ),
    st.builds(
        DictEntry,
        keys=st.lists(st.one_of(st.text(max_size=5), st.integers()), unique=True).map(tuple),
        ordered=st.booleans(),
    ),
    st.builds(ListEntry, length=st.integers(0, 100)),
    st.builds(TupleEntry, length=st.integers(0, 100)),
)


@given(
    entries=st.dictionaries(st.text(min_size=1, max_size=30), _entries, max_size=8),
    world_size=st.integers(1, 1024),
)
def test_any_manifest_round_trips(entries, world_size):
    framed = any(loc.stored for e in entries.values() for loc in e.locations)
    version = mf.COMPRESSED_VERSION if framed else 1
    m = Manifest(
        format_version=version, world_size=world_size, entries=entries, metadata={"k": [1, "v"]}
    )
    data = mf.dumps(m)
    back = mf.loads(data)
    assert back == m
    assert list(back.entries) == list(entries)
    # The YAML reading of the same bytes agrees with the fast one.
    fast = _fast(_text(data))
    assert fast is not None or not entries  # "entries: {}" goes through YAML
    assert fast is None or fast == yaml.load(data, Loader=codec._Loader)


@pytest.mark.parametrize("char", ["\x7f", "\x85", "\u2028", "\ufeff"])
def test_characters_yaml_cannot_hold_raw_are_escaped(char):
    """JSON leaves these raw, YAML does not accept them raw: the writer escapes them, also in
    an otherwise ASCII file (where it skips the search)."""
    m = Manifest(entries={f"0/k{char}": PrimitiveEntry(value=f"v{char}")})
    data = mf.dumps(m)
    assert char.encode() not in data
    assert f"\\u{ord(char):04x}".encode() in data
    assert mf.loads(data) == m
    assert yaml.load(data, Loader=codec._Loader)["entries"] == {
        f"0/k{char}": {"type": "primitive", "value_type": "str", "value": f"v{char}"}
    }


def test_nan_primitive_round_trips():
    m = Manifest(entries={"p": PrimitiveEntry(value=float("nan"))})
    assert math.isnan(mf.loads(mf.dumps(m)).entries["p"].value)


@given(
    entries=st.lists(
        st.builds(
            TensorEntry,
            dtype=st.sampled_from(["float32", "uint4", 'bad"dtype']),
            shape=st.lists(st.integers(0, 10**9), max_size=4).map(tuple),
            chunks=st.lists(_locations, max_size=3).map(tuple),
            replicated=st.booleans(),
        ),
        max_size=5,
    ),
    path=st.text(max_size=12),
)
def test_tensor_lines_formatted_directly_match_the_encoder(entries, path):
    """The formatter's own text for a one-range tensor, from an entry or from its fields, is
    the encoder's, whatever needs escaping."""
    fmt = codec.EntryFormatter()
    for entry in entries:
        generic = "  " + codec._ENCODER.encode({path: mf.entry_to_dict(entry)})[1:-1]
        assert fmt.entry(path, entry) == generic
        if len(entry.chunks) == 1 and entry.chunks[0].stored is None:  # (a plain range)
            c = entry.chunks[0]
            direct = fmt.tensor(
                path, entry.dtype, entry.shape, c.blob, c.offset, c.nbytes, c.crc32,
                entry.replicated,
            )  # fmt: skip
            assert direct == generic


def test_dumps_writes_formatted_lines_as_they_are():
    """A manifest whose entries are given partly as lines the formatter made is the same
    file as the one made from the entries."""
    loc = Location(blob="0/s0", offset=16, nbytes=40, crc32=7)
    entries = {
        "0/m": DictEntry(keys=("w", "b")),
        "0/m/w": TensorEntry(dtype="float32", shape=(2, 5), chunks=(loc,)),
        "0/m/b": PrimitiveEntry(value=3),
    }
    m = Manifest(world_size=2, entries=entries, metadata={"x": 1})
    fmt = codec.EntryFormatter()
    mixed = {p: fmt.entry(p, e) if p == "0/m/w" else e for p, e in entries.items()}
    assert codec.dumps_entries(1, 2, {"x": 1}, mixed) == mf.dumps(m)
    assert mf.loads(mf.dumps(m)) == m
    # Every entry given as its line (a take's manifest, most often).
    lines = {p: fmt.entry(p, e) for p, e in entries.items()}
    assert codec.dumps_entries(1, 2, {"x": 1}, lines) == mf.dumps(m)


_plain_blobs = st.builds("{}/{}{}".format, st.integers(0, 999), st.sampled_from(["", "s", "x"]),
                         st.integers(0, 10**6))  # fmt: skip


@given(
    items=st.lists(
        st.tuples(
            st.one_of(st.text(max_size=12), st.from_regex(r"0/m/[a-z.]{1,8}", fullmatch=True)),
            st.builds(
                TensorEntry,
                dtype=st.sampled_from(["float32", "bfloat16", "float8_e4m3fn", "uint4"]),
                shape=st.lists(st.integers(0, 10**12), max_size=4).map(tuple),
                chunks=st.lists(
                    st.builds(
                        Location,
                        blob=st.one_of(_plain_blobs, st.sampled_from(["0/a/1", "00/1", "r/0"])),
                        offset=st.integers(0, 2**64),
                        nbytes=st.integers(0, 2**64),
                        crc32=st.one_of(st.none(), st.integers(0, 2**32 - 1)),
                    ),
                    min_size=1,
                    max_size=2,
                ).map(tuple),
                replicated=st.booleans(),
            ),
        ),
        max_size=6,
    ),
)
def test_tensor_lines_decode_as_the_json_path_decodes_them(items):
    """Every tensor line decodes to the entry written, and the fast reading agrees with a YAML
    reader's."""
    entries = dict(items)
    m = Manifest(entries=entries)
    data = mf.dumps(m)
    back = mf.loads(data)
    assert back == m
    assert list(back.entries) == list(entries)
    fast = _fast(_text(data))
    assert fast is not None or not entries
    if fast is not None:
        assert fast == yaml.load(data, Loader=codec._Loader)


def test_tensor_lines_out_of_the_common_layout_are_still_decoded_and_checked():
    """Lines out of the writer's own layout are still decoded and checked: an escaped path
    (JSON's reading), a leading zero (JSON refuses it: the YAML reading), a CRC beyond 32 bits
    (refused)."""
    line = GOLDEN_TEXT.splitlines()[6]
    assert line.startswith('  "0/m/w": {"type": "tensor"')
    escaped = line.replace('"0/m/w"', '"0/m/\\u0077"')
    leading_zero = line.replace("[2, 3]", "[02, 3]")
    for variant, fast in ((escaped, True), (leading_zero, False)):
        text = GOLDEN_TEXT.replace(line, variant)
        assert (codec._parse_fast(text) is not None) == fast
        assert mf.loads(seal_manifest(text.encode())) == GOLDEN
    big = seal_manifest(GOLDEN_TEXT.replace("3735928559", str(2**32)).encode())
    with pytest.raises(mf.ManifestDecodeError, match=r"0/m/w: expected \[blob, offset"):
        mf.loads(big)


def test_many_tensor_lines_round_trip_in_order():
    """Entry lines of many tensors decode to the manifest written, in the manifest's order."""
    entries = dict(GOLDEN.entries)
    for i in range(40):
        entries[f"0/t/{i}"] = TensorEntry(
            dtype="float32",
            shape=(i, 2),
            chunks=(Location(blob=f"0/{i % 3}", offset=8 * i, nbytes=8 * i, crc32=i),),
            parameter=i == 7,
        )
    m = Manifest(entries=entries)
    back = mf.loads(mf.dumps(m))
    assert back == m and list(back.entries) == list(entries)


def test_blob_sizes_and_bases_cover_every_kind_of_range():
    """Each blob's size is the end of its last range, whatever the entry kind or the order of
    the ranges; the bases are the sibling snapshots that some range points into."""

    def loc(blob: str, offset: int, nbytes: int) -> Location:
        return Location(blob=blob, offset=offset, nbytes=nbytes)

    m = Manifest(
        format_version=5,
        entries={
            "0/s": DictEntry(keys=("t", "o", "sh", "e", "p")),
            # Chunks out of order: the later one in the blob is listed first.
            "0/s/t": TensorEntry(
                dtype="uint8", shape=(30,), chunks=(loc("0/a", 20, 10), loc("0/a", 0, 20))
            ),
            "0/s/o": ObjectEntry(
                serializer="torch_save", obj_type="int", location=loc("0/b", 5, 7)
            ),
            "0/s/sh": mf.ShardedTensorEntry(
                key="k",
                dtype="uint8",
                shape=(8,),
                shards=(
                    mf.Shard(offsets=(0,), sizes=(4,), chunks=(loc("0/c", 0, 4),)),
                    mf.Shard(offsets=(4,), sizes=(4,), chunks=(loc("../s1/0/a", 96, 4),)),
                ),
            ),
            "0/s/e": TensorEntry(dtype="uint8", shape=(0,), chunks=(loc("0/d", 0, 0),)),
            "0/s/p": PrimitiveEntry(value=3),
            "0/u": TensorEntry(dtype="uint8", shape=(2,), chunks=(loc("../s0/0/x", 2, 2),)),
        },
    )
    assert m.blob_sizes == {
        "0/a": 30,
        "0/b": 12,
        "0/c": 4,
        "../s1/0/a": 100,
        "0/d": 0,
        "../s0/0/x": 4,
    }
    assert m.bases == ("s0", "s1")
    assert Manifest(entries={"0/p": PrimitiveEntry(value=1)}).bases == ()
    assert Manifest(entries={"0/p": PrimitiveEntry(value=1)}).blob_sizes == {}
    # Runs of one blob, the same blob again later with a smaller end: the largest end wins.
    runs = Manifest(
        entries={
            f"0/t{i}": TensorEntry(dtype="uint8", shape=(4,), chunks=(loc(blob, at, 4),))
            for i, (blob, at) in enumerate([("a", 0), ("a", 40), ("b", 0), ("a", 8), ("b", 4)])
        }
    )
    assert runs.blob_sizes == {"a": 44, "b": 8}
