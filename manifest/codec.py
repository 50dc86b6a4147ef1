"""The manifest file: YAML whose entries are one JSON object per line, decoded strictly.

The file is YAML (a block mapping of header fields and ``entries``), and every entry line is
written in JSON syntax, which is also YAML. So any YAML reader (or person) can read it, while this
codec reads the entry lines with the C JSON decoder, all of them in one call, and the common
tensor line with one regular expression: no YAML event is built per entry, which is what makes a
YAML loader slow on a manifest of many entries. A file that is not laid out as the writer lays it
out (hand-edited, say) is read with the safe YAML loader instead (:mod:`manifest.yaml_loader`);
both paths feed the same strict decoding of every field (:mod:`manifest.decode`).
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable, Collection, Mapping
from itertools import compress, count, repeat
from operator import is_not
from typing import Any

from isal import isal_zlib

from manifest.decode import MAX_CRC32, PLAIN_BLOB, entry_from_dict
from manifest.entries import (
    FORMAT_VERSION,
    INCREMENTAL_VERSION,
    REFERENCE_PREFIX,
    DictEntry,
    Entry,
    ListEntry,
    Location,
    Manifest,
    ObjectEntry,
    PrimitiveEntry,
    ShardedObjectEntry,
    ShardedTensorEntry,
    TensorEntry,
    TupleEntry,
    new_location,
    new_tensor_entry,
)
from manifest.errors import (
    ManifestChecksumError,
    ManifestDecodeError,
    UnsafeManifestError,
    UnsupportedFormatError,
)
from manifest.yaml_loader import MAX_DEPTH, load_yaml

FORMAT_NAME = "statesnap"
_ENTRIES_LINE = "entries:"


# The last line of a manifest: a YAML comment (so any YAML reader ignores it) holding the
# CRC-32 of every byte before it.
_TRAILER = b"# crc32 %08x\n"
_TRAILER_RE = re.compile(rb"# crc32 ([0-9a-f]{8})\n\Z")


def _split_trailer(data: bytes, source: str, verify: bool) -> bytes:
    """The manifest's bytes before its checksum line, after checking them against it (when
    ``verify``)."""
    return data[: _body_end(data, source, verify)]


def _body_end(data: bytes, source: str, verify: bool) -> int:
    """Where the manifest's checksum line starts (the end of the bytes it covers; the end of
    ``data`` when there is none and ``verify`` is off), after checking the bytes before it
    against it (when ``verify``; in place, no copy made)."""
    start = data.rfind(b"\n", 0, len(data) - 1) + 1
    match = _TRAILER_RE.match(data, start)
    if match is None:
        if verify:
            raise ManifestChecksumError(
                f"{source} does not end with its checksum line: it was cut short or edited"
            )
        return len(data)
    if verify:
        expected = int(match.group(1), 16)
        with memoryview(data) as view:
            actual = isal_zlib.crc32(view[:start])
        if actual != expected:
            raise ManifestChecksumError(
                f"{source} is damaged: its bytes have crc32 {actual:#010x}, its last line "
                f"records {expected:#010x}"
            )
    return start


# JSON leaves these characters raw, but YAML reads them as line breaks or does not allow them
# unescaped; \uXXXX escapes mean the same character to both.
_NOT_YAML_PRINTABLE = re.compile("[\x7f-\x9f\u2028\u2029\ufeff\ufffe\uffff]")


_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(", ", ": "))


def _yaml_printable(text: str) -> str:
    # The common case, ASCII text, in two scans in C; the regular expression, slower per
    # character, runs only on text that has other characters.
    if text.isascii() and "\x7f" not in text:
        return text
    if _NOT_YAML_PRINTABLE.search(text):
        text = _NOT_YAML_PRINTABLE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
    return text


def path_text(path: str) -> str:
    """``path`` as an entry's line writes it: a JSON string, with the characters YAML cannot
    hold raw escaped."""
    return _yaml_printable(_ENCODER.encode(path))


def _location_to_list(loc: Location) -> list[Any]:
    if loc.crc32 is None:
        return [loc.blob, loc.offset, loc.nbytes]
    return [loc.blob, loc.offset, loc.nbytes, loc.crc32]


def entry_to_dict(entry: Entry) -> dict[str, Any]:
    """The plain-data form of an entry, as written in the manifest file.

    Floats are written as their ``repr`` in a string (``"0.1"``, ``"nan"``): exact, and the same
    to JSON and YAML readers; bytes as base64.
    """
    out: dict[str, Any] = {"type": entry.type}
    if isinstance(entry, TensorEntry):
        out["dtype"] = entry.dtype
        out["shape"] = list(entry.shape)
        out["chunks"] = [_location_to_list(c) for c in entry.chunks]
        # Written only when set: an ordinary tensor's line is the same as before they existed.
        if entry.parameter:
            out["parameter"] = True
        if entry.requires_grad:
            out["requires_grad"] = True
        view = entry.view
        if view is not None:
            out["view"] = {"base": view.base, "offset": view.offset, "stride": list(view.stride)}
        if entry.digest is not None:
            out["digest"] = entry.digest
    elif isinstance(entry, ObjectEntry):
        out["serializer"] = entry.serializer
        out["obj_type"] = entry.obj_type
        out["location"] = _location_to_list(entry.location)
    elif isinstance(entry, PrimitiveEntry):
        value = entry.value
        out["value_type"] = entry.value_type
        if isinstance(value, bytes):
            value = base64.b64encode(value).decode("ascii")
        elif isinstance(value, float):
            value = repr(value)
        out["value"] = value
    elif isinstance(entry, DictEntry):
        out["keys"] = list(entry.keys)
        if entry.ordered:
            out["ordered"] = True
    elif isinstance(entry, (ListEntry, TupleEntry)):
        out["length"] = entry.length
    elif isinstance(entry, ShardedTensorEntry):
        out["key"] = entry.key
        out["dtype"] = entry.dtype
        out["shape"] = list(entry.shape)
        out["shards"] = [
            {
                "offsets": list(s.offsets),
                "sizes": list(s.sizes),
                "chunks": [_location_to_list(c) for c in s.chunks],
            }
            for s in entry.shards
        ]
    elif isinstance(entry, ShardedObjectEntry):
        out["key"] = entry.key
        out["serializer"] = entry.serializer
        out["obj_type"] = entry.obj_type
        out["location"] = _location_to_list(entry.location)
    else:  # pragma: no cover - every entry type is listed above
        raise TypeError(f"unknown entry class {type(entry).__name__}")
    if entry.replicated:
        out["replicated"] = True
    return out


# Strings JSON writes verbatim between quotes. A character class repeated: a concatenation of
# strings matches exactly when each of them does.
_VERBATIM = re.compile(r"[ !#-\[\]-~]*")


class EntryFormatter:
    """Formats entries as manifest lines, each exactly as the JSON encoder would write it.

    ``tensor`` formats a tensor stored in one range from its fields, without an entry object: a
    take of many small tensors formats one such line per tensor, and builds no two records per
    tensor only to format them. The formatter keeps the constant text of the lines of each
    (dtype, blob) pair that JSON writes verbatim (thousands of slab members share one) and the
    text of each shape.

    ``paths`` (a set, or a mapping's keys: membership is asked once per line): the paths the
    lines will be for, checked for verbatim writing in one pass over them all rather than by a
    pattern match per line; a path not among them is checked when its line is made.
    """

    __slots__ = ("_heads", "_paths", "_shapes")

    def __init__(self, paths: Collection[str] = ()) -> None:
        self._heads: dict[tuple[str, str], tuple[str, str] | None] = {}
        self._shapes: dict[tuple[int, ...], str] = {}
        self._paths = paths if _VERBATIM.fullmatch("".join(paths)) is not None else ()

    def _head(self, dtype: str, blob: str) -> tuple[str, str] | None:
        """The text between a line's path and its shape, and between its shape and its offset;
        None when the dtype or blob needs escapes."""
        key = (dtype, blob)
        if key not in self._heads:
            self._heads[key] = (
                (
                    f'": {{"type": "tensor", "dtype": "{dtype}", "shape": [',
                    f'], "chunks": [["{blob}", ',
                )
                if _VERBATIM.fullmatch(dtype) and _VERBATIM.fullmatch(blob)
                else None
            )
        return self._heads[key]

    def _shape(self, shape: tuple[int, ...]) -> str:
        text = self._shapes.get(shape)
        if text is None:
            text = self._shapes[shape] = ", ".join(map(str, shape))
        return text

    def tensor(
        self,
        path: str,
        dtype: str,
        shape: tuple[int, ...],
        blob: str,
        offset: int,
        nbytes: int,
        crc32: int | None,
        replicated: bool = False,
    ) -> str:
        """The line of a ``TensorEntry`` whose one chunk is ``blob[offset : offset + nbytes]``
        with CRC-32 ``crc32`` (None: not recorded)."""
        head = self._heads.get((dtype, blob)) or self._head(dtype, blob)
        if head is not None and (path in self._paths or _VERBATIM.fullmatch(path)):
            dims = self._shapes.get(shape) or self._shape(shape)
            crc = "" if crc32 is None else f", {crc32}"
            tail = ', "replicated": true}' if replicated else "}"
            return f'  "{path}{head[0]}{dims}{head[1]}{offset}, {nbytes}{crc}]]{tail}'
        location = new_location(blob, offset, nbytes, crc32)
        return self._encoded(path, new_tensor_entry(dtype, shape, (location,), replicated))

    def entry(self, path: str, entry: Entry) -> str:
        """The line of any entry."""
        if type(entry) is TensorEntry and len(entry.chunks) == 1 and not entry.has_attrs:
            c = entry.chunks[0]
            return self.tensor(
                path, entry.dtype, entry.shape, c.blob, c.offset, c.nbytes, c.crc32,
                entry.replicated,
            )  # fmt: skip
        return self._encoded(path, entry)

    @staticmethod
    def _encoded(path: str, entry: Entry) -> str:
        # {"path": {...}} without its braces is the line.
        return "  " + _ENCODER.encode({path: entry_to_dict(entry)})[1:-1]


def dumps(manifest: Manifest) -> bytes:
    """Serializes a manifest (UTF-8 YAML, one line per entry)."""
    return dumps_entries(
        manifest.format_version, manifest.world_size, manifest.metadata, manifest.entries
    )


def dumps_entries(
    format_version: int,
    world_size: int,
    metadata: Mapping[str, Any],
    entries: Mapping[str, Entry | str],
) -> bytes:
    """Serializes a manifest given by its fields, where an entry may already be formatted: a
    ``str`` is a line an ``EntryFormatter`` made for that path, written as it is."""
    encode = _ENCODER.encode
    lines = [
        f"format: {FORMAT_NAME}",
        f"format_version: {format_version}",
        f"world_size: {world_size}",
        f"metadata: {encode(dict(metadata))}",
    ]
    if entries:
        lines.append(_ENTRIES_LINE)
        # A take's entries are mostly lines already: the others are found by passes in C.
        values = list(entries.values())
        others = list(compress(count(), map(is_not, repeat(str), map(type, values))))
        if others:
            paths = list(entries)
            line = EntryFormatter({paths[i] for i in others}).entry
            for i in others:
                values[i] = line(paths[i], values[i])
        lines.extend(values)
    else:
        lines.append(f"{_ENTRIES_LINE} {{}}")
    lines.append("")
    body = _yaml_printable("\n".join(lines)).encode("utf-8")
    return body + _TRAILER % isal_zlib.crc32(body)


# A tensor line exactly as ``EntryFormatter.tensor`` writes the common case (one chunk with a
# CRC, not replicated, path written verbatim), every field in a form the JSON decoder would read
# identically (no escapes, no leading zeros). Such lines are decoded by this pattern straight
# into entries, skipping the JSON decoder's dict and the field checks of ``entry_from_dict``
# (the pattern is those checks). The blob must be a ``PLAIN_BLOB``, so it needs no further
# check; the CRC's bound is checked by the caller.
_NATURAL = "0|[1-9][0-9]*"
_TENSOR_LINE = re.compile(
    rf'  "({_VERBATIM.pattern})": \{{"type": "tensor", "dtype": "([a-z0-9_]+)", '
    rf'"shape": \[((?:{_NATURAL})(?:, (?:{_NATURAL}))*)?\], '
    rf'"chunks": \[\["({PLAIN_BLOB.pattern})", ({_NATURAL}), ({_NATURAL}), ({_NATURAL})\]\]\}}'
)


# A depth scan of JSON text (``nests_within``) keeps its quotes and brackets only: an escape
# (a backslash and the character after it, which may be a quote) goes first, every other byte
# is then deleted by one translation in C.
_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')
# A string, its closing quote included (a string left open runs to the end of the text: the
# JSON decoder fails there, past the brackets counted before it).
_STRING = re.compile(rb'"[^"]*"?')
# A pair of brackets with nothing left between them: a collection nested no further.
_INNERMOST = re.compile(rb"\[\]|\{\}")


def nests_within(text: str, levels: int) -> bool:
    """Whether JSON text ``text`` is balanced and opens at most ``levels`` levels of brackets.

    Without recursion, in passes in C. Once escapes are dropped, a bracket is inside a string
    when an odd number of quotes precede it; dropping two quotes in a row (most strings, once
    only quotes and brackets are left) keeps that parity for every other character, so the
    few strings left holding brackets are dropped next, one match each. Then each pass removes
    the pairs that hold no other (the innermost level): a text nesting ``n`` levels is empty
    after ``n`` passes. At most ``levels`` passes, each over what the one before left.
    """
    data = text.encode("utf-8", "surrogatepass")
    if b"\\" in data:
        data = _ESCAPE.sub(b"", data)
    rest = data.translate(None, _NOT_STRUCTURE).replace(b'""', b"")
    if b'"' in rest:
        rest = _STRING.sub(b"", rest)
    for _ in range(levels):
        if not rest:
            return True
        rest, removed = _INNERMOST.subn(b"", rest)
        if not removed:
            return False  # unbalanced: not for the fast path
    return not rest


# Every line of the entries: a tensor line in the writer's common layout (``_TENSOR_LINE``'s
# groups), or any other line whole (the last group; the others then empty). ``findall`` over
# a piece of the text gives every line's fields in one pass in C, where matching line by line
# took a call, a match object and a groups tuple per line.
_LINE = re.compile(rf"^(?:{_TENSOR_LINE.pattern}|(.*))$", re.MULTILINE)

# The entries are decoded in pieces of at most this many characters (some 1,800 tensor lines),
# each handed to ``on_tensors`` as soon as it is decoded. The first piece is of
# ``FIRST_PIECE_CHARS`` and each next one twice the one before: the first tensors reach
# ``on_tensors`` (a restore's read-ahead) a hundred lines into the decoding, where a whole
# first piece would keep them until some 1,800 lines are decoded; the later, longer pieces
# keep the count of calls low.
PIECE_CHARS = 256 << 10
FIRST_PIECE_CHARS = 16 << 10

TensorsDecoded = Callable[[list[tuple[str, TensorEntry]]], None]
"""Called by ``loads`` with the tensor entries of each piece of the manifest as they are
decoded, as (path, entry) pairs in the manifest's order: those of the writer's common layout
(one range with a CRC, nothing else), checked as every entry is."""


def _parse_fast(
    text: str, source: str = "manifest", on_tensors: TensorsDecoded | None = None
) -> dict[str, Any] | None:
    """The document, if it is laid out exactly as ``dumps`` writes it; else None.

    Its ``entries`` map each path to the entry's raw mapping, or for a tensor line in the
    writer's common layout, to the ``TensorEntry`` it holds, already checked. The other entry
    lines, joined with commas and wrapped in braces, are one JSON object: a single call of the
    C decoder reads them all. Each line must hold exactly one entry and no path may repeat (the
    count of lines and of entries must agree, and the lines must nest no deeper than
    ``MAX_DEPTH``); anything else goes to the YAML path, which refuses or reports it.
    ``on_tensors`` is given each piece's tensor entries as they are decoded (some may belong
    to a document that then goes to the YAML path: it decodes them again).

    Raises:
        UnsafeManifestError: the header uses what the writer never emits (``load_yaml``).
    """
    head, sep, body = text.partition(f"\n{_ENTRIES_LINE}\n")
    if not sep:
        return None
    try:
        doc = load_yaml(head, source)
    except UnsafeManifestError:
        raise
    except ManifestDecodeError:
        return None
    if not isinstance(doc, dict) or "entries" in doc:
        return None
    # The lines: the text split at its line ends, less one empty line after the last.
    end = len(body) - 1 if body.endswith("\n") else len(body)
    findall = _LINE.findall
    tensors: list[tuple[str, TensorEntry] | None] = []  # None: the line is among ``others``
    others: list[str] = []
    shapes: dict[str, tuple[int, ...]] = {}  # by their text: shapes repeat across tensors
    pos = 0 if body else 1  # no text: no line at all
    size = min(FIRST_PIECE_CHARS, PIECE_CHARS)
    while pos <= end:
        # A piece ends at a line's end: the next piece starts at a line's start.
        cut = body.find("\n", min(pos + size, end), end)
        size = min(2 * size, PIECE_CHARS)
        if cut < 0:
            cut = end
        first = len(tensors)
        for path, dtype, shape, blob, offset, nbytes, crc, other in findall(body, pos, cut):
            if dtype:  # a tensor line: the pattern checked every field but the CRC's bound
                crc32 = int(crc)
                if crc32 <= MAX_CRC32:
                    loc = new_location(blob, int(offset), int(nbytes), crc32)
                    dims = shapes.get(shape)
                    if dims is None:
                        dims = shapes[shape] = tuple(map(int, shape.split(", "))) if shape else ()
                    tensors.append((path, new_tensor_entry(dtype, dims, (loc,))))
                    continue
                return None  # a CRC out of range: the YAML path reports it, naming the path
            if not other.startswith('  "'):
                return None
            tensors.append(None)
            others.append(other)
        if on_tensors is not None and (items := list(filter(None, tensors[first:]))):
            on_tensors(items)
        pos = cut + 1
    joined = ",".join(others)
    # The lines are the values of ``entries`` (level 2): they may open MAX_DEPTH - 2 levels.
    if not nests_within(joined, MAX_DEPTH - 2):
        return None
    try:
        decoded = json.loads("{" + joined + "}") if others else {}
    except ValueError:
        return None
    if len(decoded) != len(others):
        return None
    rest = iter(decoded.items())
    entries = dict(item if item is not None else next(rest) for item in tensors)
    if len(entries) != len(tensors):
        return None
    doc["entries"] = entries
    return doc


def _header(doc: Any, source: str) -> tuple[int, int, dict[str, Any]]:
    """The format version, world size and metadata of a decoded manifest document ``doc``,
    each checked."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise ManifestDecodeError(f"{source} is not a {FORMAT_NAME} manifest")
    version = doc.get("format_version")
    if type(version) is not int:
        raise ManifestDecodeError(f"{source}: format_version missing or not an integer")
    if version > FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"{source} has format version {version}, newer than the {FORMAT_VERSION} this "
            "library reads; upgrade statesnap to read it"
        )
    if version < 1:
        raise ManifestDecodeError(f"{source}: invalid format_version {version}")
    world_size = doc.get("world_size")
    if type(world_size) is not int or world_size < 1:
        raise ManifestDecodeError(
            f"{source}: world_size: expected an integer >= 1, got {world_size!r}"
        )
    metadata = doc.get("metadata", {})
    if not isinstance(metadata, dict):
        raise ManifestDecodeError(f"{source}: metadata must be a mapping")
    return version, world_size, metadata


def check_head(data: bytes, source: str = "manifest", *, verify: bool = True) -> None:
    """The checks of ``loads`` that need none of the entries decoded: the checksum line (with
    ``verify``) and, when the header is laid out as ``dumps`` writes it, the header's fields (a
    format version newer than this library's included). ``loads`` makes every check again.

    Raises:
        The errors of ``loads``, for those checks.
    """
    # In place: a copy of a large manifest's bytes here would stay in the process's heap.
    end = data.find(f"\n{_ENTRIES_LINE}\n".encode(), 0, _body_end(data, source, verify))
    if end < 0:
        return  # not the writer's layout: ``loads`` reports what it is
    try:
        head = data[:end].decode("utf-8")
    except UnicodeDecodeError:
        return  # ``loads`` reports it
    _header(load_yaml(head, source), source)


def loads(
    data: bytes,
    source: str = "manifest",
    *,
    verify: bool = True,
    on_tensors: TensorsDecoded | None = None,
) -> Manifest:
    """Parses manifest bytes; ``source`` names the file in error messages.

    With ``verify``, the bytes must end with the checksum line ``dumps`` writes, and match it.
    ``on_tensors`` is given the tensor entries as they are decoded, piece by piece (some twice
    when the fast path hands the text to the YAML path), before the whole is checked: a caller
    may act on them early (read-ahead hints), never trust them before ``loads`` returns.

    Raises:
        ManifestChecksumError: (with ``verify``) the checksum line is missing or does not match.
        ManifestDecodeError: the bytes are not valid UTF-8 YAML of a manifest, or any field is
            missing, of the wrong type or unknown.
        UnsafeManifestError: (a ManifestDecodeError) the bytes use what the writer never
            emits: a YAML anchor, alias, tag or merge key, nesting past ``MAX_DEPTH``, a blob
            path leaving the root (``load_yaml``, ``check_blob_path``).
        UnsupportedFormatError: the manifest's format version is newer than this library's.
    """
    data = _split_trailer(data, source, verify)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ManifestDecodeError(f"{source} is not valid YAML: {e}") from None
    doc = _parse_fast(text, source, on_tensors)
    if doc is None:
        doc = load_yaml(text, source)
    version, world_size, metadata = _header(doc, source)
    entries = doc.get("entries")
    if not isinstance(entries, dict):
        raise ManifestDecodeError(f"{source}: entries missing or not a mapping")
    # Decoded in place. The tensor lines ``_parse_fast`` decoded are entries already (most of
    # them, found by passes in C); every other value is a mapping to decode.
    values = entries.values()
    rest: list[tuple[str, TensorEntry]] = []  # tensors of other layouts, for ``on_tensors``
    for path in list(compress(entries, map(is_not, repeat(TensorEntry), map(type, values)))):
        if type(path) is not str:
            raise ManifestDecodeError(f"{source}: entry path {path!r} is not a string")
        try:
            entry = entries[path] = entry_from_dict(entries[path], path)
        except ManifestDecodeError as e:
            raise type(e)(f"{source}: {e}") from None  # the class says unsafe or damaged
        if version < INCREMENTAL_VERSION:
            # Only a version 5 writer points a range into a sibling snapshot; in an older
            # manifest such a blob path leaves the root. (The tensor lines decoded above by
            # ``_parse_fast`` hold plain blob names only.)
            for loc in entry.locations:
                if loc.blob.startswith(REFERENCE_PREFIX):
                    raise UnsafeManifestError(
                        f"{source}: {path}: unsafe blob path {loc.blob!r}: a manifest of "
                        f"format version {version} keeps every blob under its root"
                    )
        if on_tensors is not None and type(entry) is TensorEntry:
            rest.append((path, entry))
    if rest and on_tensors is not None:
        on_tensors(rest)
    return Manifest(
        format_version=version, world_size=world_size, entries=entries, metadata=metadata
    )
