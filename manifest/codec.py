"""The manifest file: YAML whose entries are one JSON object per line, read strictly.

The file is a YAML block mapping of header fields and ``entries``; every entry line is written
in JSON syntax, which is also YAML. So any YAML reader can read it, while ``loads`` reads the
entry lines with the JSON decoder (a YAML loader is slow on many entries). A file not laid out
as ``dumps`` lays it out (hand-edited) is read with ``load_yaml``, the safe subset of YAML the
writer emits: no tags, anchors, aliases or merge keys, nesting at most ``MAX_DEPTH``. Both
paths feed the same strict decoding of every entry (``EntryDecoder``).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml  # type: ignore[import-untyped]
from isal import isal_zlib

from manifest.entries import (
    _ENCODERS,
    FORMAT_VERSION,
    MAX_CRC32,
    PLAIN_BLOB,
    TYPES,
    DictEntry,
    Entry,
    EntryDecoder,
    ListEntry,
    Location,
    ManifestChecksumError,
    ManifestDecodeError,
    ShardedObjectEntry,
    ShardedTensorEntry,
    TensorEntry,
    TupleEntry,
    UnsafeManifestError,
    UnsupportedFormatError,
    reference_of,
)

# An int is written in decimal, and Python refuses to read a decimal text of more than
# ``sys.int_info.default_max_str_digits`` digits: a take refuses larger ints (as values or dict
# keys) so that it never commits what a restore refuses.
MAX_INT_DIGITS = 4300
_INT_BOUND = 10**MAX_INT_DIGITS
# A take refuses containers nested deeper than this below an app_state key: a restore rebuilds
# them with one level of recursion each.
MAX_NESTING = 100


def int_fits(value: int) -> bool:
    """Whether ``value`` is an int every reader can read from a manifest (at most
    ``MAX_INT_DIGITS`` decimal digits)."""
    return -_INT_BOUND < value < _INT_BOUND


# Entries that are never listed once for every rank (``Manifest.view``).
_NOT_SHARED = (DictEntry, ListEntry, TupleEntry, ShardedTensorEntry, ShardedObjectEntry)


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """A whole snapshot's description: logical path -> entry (in the order taken), the number
    of processes that took it, and free-form ``metadata`` (library version, time taken)."""

    format_version: int = 1  # what the writer needs; FORMAT_VERSION is the newest readable
    world_size: int = 1
    entries: dict[str, Entry]
    metadata: dict[str, Any] = field(default_factory=dict)

    def view(self, rank: int) -> dict[str, Entry]:
        """The entries as rank ``rank`` reads them: every entry, and under ``<rank>/`` also each
        replicated leaf listed under ``0/`` only (version 3 lists it once). ``entries`` itself
        when nothing is added; else a new dict, kept per rank."""
        entries = self.entries
        if rank == 0 or self.world_size == 1:
            return entries
        views: dict[int, dict[str, Entry]] = self.__dict__.setdefault("_views", {})
        if rank not in views:
            prefix = f"{rank}/"
            added = {
                prefix + p[2:]: e
                for p, e in entries.items()
                if e.replicated
                and p.startswith("0/")
                and not isinstance(e, _NOT_SHARED)
                and prefix + p[2:] not in entries
            }
            views[rank] = {**entries, **added} if added else entries
        return views[rank]

    @functools.cached_property
    def blob_sizes(self) -> dict[str, int]:
        """The length each blob must have: the end of the last range recorded in it (for a
        sibling snapshot's blob, the length it must have at least)."""
        sizes: dict[str, int] = {}
        for entry in self.entries.values():
            for loc in entry.locations:
                at = loc if loc.stored is None else loc.stored  # (compressed: as stored)
                end = at.offset + at.nbytes
                if end > sizes.get(loc.blob, -1):
                    sizes[loc.blob] = end
        return sizes

    def with_blob_sizes(self, sizes: Mapping[str, int]) -> Manifest:
        """This manifest, with the length each of its blobs must have taken from ``sizes``
        rather than from its entries: another library's files hold bytes no entry reads (an
        archive's directory, a header), which are not damage."""
        self.__dict__["blob_sizes"] = {blob: sizes[blob] for blob in self.blob_sizes}
        return self

    @functools.cached_property
    def bases(self) -> tuple[str, ...]:
        """The names of the sibling snapshots whose blobs this one's entries point at, sorted."""
        refs = (reference_of(blob) for blob in self.blob_sizes)
        return tuple(sorted({ref[0] for ref in refs if ref is not None}))


FORMAT_NAME = "statesnap"
_ENTRIES_LINE = "entries:"
# The last line: a YAML comment holding the CRC-32 of every byte before it.
_TRAILER = b"# crc32 %08x\n"
_TRAILER_RE = re.compile(rb"# crc32 ([0-9a-f]{8})\n\Z")
# The deepest nesting a manifest may hold, the document's mapping being level 1 (the writer
# nests at most 7): every walk of a decoded value stays far from the recursion limit.
MAX_DEPTH = 32


def _body_end(data: bytes, source: str, verify: bool) -> int:
    """Where the checksum line starts (the end of ``data`` when there is none and ``verify``
    is off), after checking the bytes before it against it when ``verify`` (no copy made)."""
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


# -- writing -----------------------------------------------------------------------------------

# JSON leaves these characters raw, but YAML reads them as line breaks or does not allow them
# unescaped; \uXXXX escapes mean the same character to both.
_NOT_YAML_PRINTABLE = re.compile("[\x7f-\x9f\u2028\u2029\ufeff\ufffe\uffff]")
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(", ", ": "))
# Strings JSON writes verbatim between quotes.
_VERBATIM = re.compile(r"[ !#-\[\]-~]*")


def _yaml_printable(text: str) -> str:
    if text.isascii() and "\x7f" not in text:
        return text  # the usual manifest: no such character
    return _NOT_YAML_PRINTABLE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def entry_to_dict(entry: Entry) -> dict[str, Any]:
    """The plain-data form of an entry, as written in the manifest file; optional fields only
    when set."""
    spec = TYPES.get(entry.tag)
    if spec is None or not isinstance(entry, spec[0]):
        raise TypeError(f"unknown entry class {type(entry).__name__}")
    _, required, optional, _ = spec
    out: dict[str, Any] = {"type": entry.tag}
    for name in required:
        value = getattr(entry, name)
        out[name] = _ENCODERS[name](value) if name in _ENCODERS else value
    for name in optional:
        value = getattr(entry, name)
        if value is not None and value is not False:
            out[name] = _ENCODERS[name](value) if name in _ENCODERS else value
    if entry.replicated:
        out["replicated"] = True
    return out


class EntryFormatter:
    """Formats entries as manifest lines, each exactly as the JSON encoder would write it.

    ``tensor`` formats the line of a tensor stored in one range from its fields, without an
    entry object (a take of many small tensors makes one such line per tensor); fields that
    JSON would escape go through the encoder.
    """

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
        # (Strings JSON writes verbatim, joined, are such a string: one match checks all three.)
        if not _VERBATIM.fullmatch(path + dtype + blob):
            location = Location(blob=blob, offset=offset, nbytes=nbytes, crc32=crc32)
            entry = TensorEntry(dtype=dtype, shape=shape, chunks=(location,), replicated=replicated)
            return self.entry(path, entry)
        dims = ", ".join(map(str, shape))
        crc = "" if crc32 is None else f", {crc32}"
        tail = ', "replicated": true}' if replicated else "}"
        return (
            f'  "{path}": {{"type": "tensor", "dtype": "{dtype}", "shape": [{dims}], '
            f'"chunks": [["{blob}", {offset}, {nbytes}{crc}]]{tail}'
        )

    def entry(self, path: str, entry: Entry) -> str:
        """The line of any entry: ``{"path": {...}}`` without its braces."""
        return "  " + _ENCODER.encode({path: entry_to_dict(entry)})[1:-1]


def dumps(manifest: Manifest) -> bytes:
    """Serializes a manifest (UTF-8 YAML, one line per entry, then the checksum line)."""
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
    ``str`` is the line an ``EntryFormatter`` made for that path."""
    lines = [
        f"format: {FORMAT_NAME}",
        f"format_version: {format_version}",
        f"world_size: {world_size}",
        f"metadata: {_ENCODER.encode(dict(metadata))}",
    ]
    if entries:
        lines.append(_ENTRIES_LINE)
        fmt = EntryFormatter()
        lines += (e if isinstance(e, str) else fmt.entry(p, e) for p, e in entries.items())
    else:
        lines.append(f"{_ENTRIES_LINE} {{}}")
    lines.append("")
    body = _yaml_printable("\n".join(lines)).encode("utf-8")
    return body + _TRAILER % isal_zlib.crc32(body)


# -- reading -----------------------------------------------------------------------------------

# A depth scan of JSON text keeps its quotes and brackets only: escapes go first, then every
# other byte, strings holding brackets, and innermost pairs of brackets, level by level.
_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')
_STRING = re.compile(rb'"[^"]*"?')
_INNERMOST = re.compile(rb"\[\]|\{\}")


def nests_within(text: str, levels: int) -> bool:
    """Whether JSON text ``text`` is balanced and opens at most ``levels`` levels of brackets:
    checked without recursion, so that a hostile text never reaches the JSON decoder's own
    recursion (each pass removes the innermost level)."""
    data = _ESCAPE.sub(b"", text.encode("utf-8", "surrogatepass"))
    rest = data.translate(None, _NOT_STRUCTURE).replace(b'""', b"")
    rest = _STRING.sub(b"", rest)
    for _ in range(levels):
        if not rest:
            return True
        rest, removed = _INNERMOST.subn(b"", rest)
        if not removed:
            return False
    return not rest


# The common tensor line: most lines of a manifest are tensors stored in one range (its CRC-32 or
# none), written by ``EntryFormatter.tensor`` with every string verbatim. ``_tensor_lines``
# matches each such line with one regular expression, over the whole text in C, and builds its
# entry from the matched fields: it skips, for nearly every line, the JSON decoder's mapping, the
# field-by-field checks of ``EntryDecoder`` and the depth scan the other lines get (the pattern
# is those checks), which made most of the time of reading a manifest of many small tensors.

# Decimal numbers as JSON writes them, short enough for ``int`` (longer ones: the JSON path).
_NUMBER = "0|[1-9][0-9]{0,30}"
# A line exactly as ``EntryFormatter.tensor`` writes a path, dtype and blob JSON leaves as they
# are (a blob name the writer makes, so safe), with one range and its CRC-32 if any; or any other
# line.
_TENSOR_LINE = re.compile(
    rf'^(?:  "([ !#-\[\]-~]*)": \{{"type": "tensor", "dtype": "([a-z0-9_]+)", '
    rf'"shape": \[((?:{_NUMBER})(?:, (?:{_NUMBER}))*)?\], '
    rf'"chunks": \[\["({PLAIN_BLOB.pattern})", ({_NUMBER}), ({_NUMBER})(?:, ({_NUMBER}))?\]\]'
    rf'(, "replicated": true)?\}}|(.*))$',
    re.MULTILINE,
)


def _tensor_lines(body: str) -> tuple[list[Any], list[tuple[int, str]]] | None:
    """The lines of ``body`` (``\\n``-separated, the last one ended): each tensor line's path
    and entry, in order, with None in place of every other line; and those other lines, each
    with its place. None for a CRC-32 out of range (the YAML path reports it)."""
    if body.endswith("\n"):
        body = body[:-1]
    items: list[Any] = []
    others: list[tuple[int, str]] = []
    shapes: dict[str, tuple[int, ...]] = {}  # by their text: most tensors share a few shapes
    blobs: dict[str, str] = {}  # each blob name kept once
    rows = _TENSOR_LINE.findall(body)
    for path, dtype, shape, blob, offset, nbytes, crc, replicated, other in rows:
        if dtype:
            crc32 = int(crc) if crc else None
            if crc32 is not None and crc32 > MAX_CRC32:
                return None
            dims = shapes.get(shape)
            if dims is None:
                dims = shapes[shape] = tuple(map(int, shape.split(", "))) if shape else ()
            loc = Location(blobs.setdefault(blob, blob), int(offset), int(nbytes), crc32)
            entry = TensorEntry(dtype, dims, (loc,))
            if replicated:  # (rare: the keyword costs every other line its handling)
                entry.replicated = True
            items.append((path, entry))
        else:
            others.append((len(items), other))
            items.append(None)
    return items, others


def _parse_fast(text: str, source: str = "manifest") -> dict[str, Any] | None:
    """The document, if the text is laid out exactly as ``dumps`` writes it (one entry per line,
    JSON, nesting within ``MAX_DEPTH``, no path twice); else None (``load_yaml`` then reads, or
    refuses, it). Its ``entries`` map each path to the entry's plain data, or, for a tensor line
    of the writer's common layout, to its entry (``_tensor_lines``)."""
    head, sep, body = text.partition(f"\n{_ENTRIES_LINE}\n")
    if not sep:
        return None
    try:
        doc = load_yaml(head, source)
    except UnsafeManifestError:
        raise
    except ManifestDecodeError:
        return None
    found = _tensor_lines(body) if body else ([], [])
    if not isinstance(doc, dict) or "entries" in doc or found is None:
        return None
    items, others = found
    joined = ",".join(line for _, line in others)
    # The lines are the values of ``entries`` (level 2): they may open MAX_DEPTH - 2 levels.
    if not all(line.startswith('  "') for _, line in others) or not nests_within(
        joined, MAX_DEPTH - 2
    ):
        return None
    try:
        decoded = json.loads("{" + joined + "}")
    except ValueError:
        return None
    if len(decoded) != len(others):
        return None  # a line of several entries, or a path repeated
    for (place, _), item in zip(others, decoded.items(), strict=True):
        items[place] = item
    entries = dict(items)
    if len(entries) != len(items):
        return None  # a path repeated
    doc["entries"] = entries
    return doc


def _header(doc: Any, source: str) -> tuple[int, int, dict[str, Any]]:
    """The format version, world size and metadata of a decoded document, each checked."""
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
    """The checks of ``loads`` that need no entry decoded: the checksum line (with ``verify``)
    and, when laid out as ``dumps`` writes it, the header's fields."""
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
) -> Manifest:
    """Parses manifest bytes; ``source`` names the file in error messages.

    With ``verify``, the bytes must end with the checksum line ``dumps`` writes, and match it.

    Raises:
        ManifestChecksumError: (with ``verify``) the checksum line is missing or does not match.
        ManifestDecodeError: not valid UTF-8 YAML of a manifest, or a field is missing, of the
            wrong type or unknown.
        UnsafeManifestError: what the writer never emits: a YAML anchor, alias, tag or merge
            key, nesting past ``MAX_DEPTH``, a blob path leaving the root.
        UnsupportedFormatError: the format version is newer than this library's.
    """
    try:
        text = data[: _body_end(data, source, verify)].decode("utf-8")
    except UnicodeDecodeError as e:
        raise ManifestDecodeError(f"{source} is not valid YAML: {e}") from None
    doc = _parse_fast(text, source)
    if doc is None:
        doc = load_yaml(text, source)
    version, world_size, metadata = _header(doc, source)
    raw = doc.get("entries")
    if not isinstance(raw, dict):
        raise ManifestDecodeError(f"{source}: entries missing or not a mapping")
    # Decoded in place: the tensor lines of ``_parse_fast`` are entries (checked) already.
    entries: dict[str, Entry] = raw
    decode = EntryDecoder(version)
    for path in [p for p, value in raw.items() if type(value) is not TensorEntry]:
        if type(path) is not str:
            raise ManifestDecodeError(f"{source}: entry path {path!r} is not a string")
        try:
            entries[path] = decode(raw[path], path)
        except ManifestDecodeError as e:
            raise type(e)(f"{source}: {e}") from None  # the class says unsafe or damaged
    return Manifest(
        format_version=version, world_size=world_size, entries=entries, metadata=metadata
    )


# -- the safe YAML subset ----------------------------------------------------------------------

# libyaml's C classes when PyYAML has them; the pure-Python ones behave identically.
_Loader: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_TAG = "tag:yaml.org,2002:"
_PLAIN_TAGS = {_TAG + kind for kind in ("str", "null", "bool", "int", "float")}
_NO_KEY = object()  # what an open mapping holds while it waits for its next key
_SHOWN_CHARS = 200  # of a key or tag quoted in a message


def load_yaml(text: str, source: str = "manifest") -> Any:
    """The one document in YAML ``text``, as plain data (dict, list, str, int, float, bool,
    None), read as the safe loader reads it; ``source`` names the file in error messages.

    Built from the parser's events with a stack of open collections (no recursion), refusing
    what the writer never emits as its event arrives: an alias (which could expand a small file
    into millions of nodes), an anchor, a tag, a merge key, a plain scalar of a type JSON
    cannot write (a timestamp), a collection as a key, nesting past ``MAX_DEPTH``.

    Raises:
        UnsafeManifestError: any of those.
        ManifestDecodeError: the text is not YAML, holds more than one document, or a
            mapping repeats a key.
    """
    loader = _Loader(text)
    try:
        return _build(loader, source)
    except yaml.YAMLError as e:
        # libyaml's scanner has a nesting limit of its own: a deep flow collection may meet it.
        if "nesting depth" in str(getattr(e, "problem", "")):
            raise UnsafeManifestError(
                f"{source}: nesting deeper than {MAX_DEPTH} levels, which this library never "
                f"writes ({e})"
            ) from None
        raise ManifestDecodeError(f"{source} is not valid YAML: {e}") from None
    finally:
        loader.dispose()


def _build(loader: Any, source: str) -> Any:
    """The document ``loader``'s events describe (``load_yaml``)."""
    stack: list[Any] = []  # the open collections, outermost first
    keys: list[Any] = []  # beside each: a mapping's pending key (or _NO_KEY); None for a list
    root: Any = None
    documents = 0

    def unsafe(what: str) -> UnsafeManifestError:
        where = _place(event, keys, source)
        return UnsafeManifestError(f"{where}: {what}, which this library never writes")

    while True:
        event = loader.get_event()
        kind = type(event)
        if kind is yaml.AliasEvent:
            raise unsafe(f"the YAML alias *{_clip(event.anchor)}")
        if kind in (yaml.ScalarEvent, yaml.MappingStartEvent, yaml.SequenceStartEvent):
            if event.anchor is not None:
                raise unsafe(f"the YAML anchor &{_clip(event.anchor)}")
            if event.tag is not None:
                raise unsafe(f"the YAML tag {_clip(event.tag)}")
        if kind is yaml.ScalarEvent:
            # implicit[0]: a plain scalar, typed by the resolver; any other style is a string.
            value = event.value
            if event.implicit[0]:
                tag = loader.resolve(yaml.ScalarNode, value, (True, False))
                if tag == _TAG + "merge":
                    raise unsafe("a merge key (<<)")
                if tag not in _PLAIN_TAGS:
                    raise unsafe(f"a plain scalar read as {tag}")
                try:
                    if tag != _TAG + "str":
                        value = loader.yaml_constructors[tag](loader, yaml.ScalarNode(tag, value))
                except ValueError:  # the resolver takes "0b_" for an int that int() refuses
                    raise ManifestDecodeError(
                        f"{_place(event, keys, source)}: the plain scalar {_shown(value)} reads "
                        "as a number but is none"
                    ) from None
        elif kind is yaml.MappingStartEvent or kind is yaml.SequenceStartEvent:
            if len(stack) >= MAX_DEPTH:
                raise unsafe(f"nesting deeper than {MAX_DEPTH} levels")
            value = {} if kind is yaml.MappingStartEvent else []
        elif kind is yaml.MappingEndEvent or kind is yaml.SequenceEndEvent:
            stack.pop()
            keys.pop()
            if keys and keys[-1] is not None:
                keys[-1] = _NO_KEY  # the value of a mapping's key is complete
            continue
        elif kind is yaml.DocumentStartEvent:
            documents += 1
            if documents > 1:
                raise ManifestDecodeError(f"{source} holds more than one YAML document")
            continue
        elif kind is yaml.StreamEndEvent:
            return root
        else:  # the stream's start, a document's end
            continue
        if not stack:
            root = value
        elif keys[-1] is None:
            stack[-1].append(value)
        elif keys[-1] is _NO_KEY:
            if type(value) is dict or type(value) is list:
                raise unsafe("a collection as a mapping key")
            if value in stack[-1]:
                raise ManifestDecodeError(
                    f"{_place(event, keys, source)}: the key {_shown(value)} appears twice in "
                    "one mapping"
                )
            keys[-1] = value
        else:
            # A collection's key stays pending until it is closed: messages name the entry.
            stack[-1][keys[-1]] = value
            if kind is yaml.ScalarEvent:
                keys[-1] = _NO_KEY
        if kind is not yaml.ScalarEvent:
            stack.append(value)
            keys.append(_NO_KEY if type(value) is dict else None)


def _place(event: Any, keys: list[Any], source: str) -> str:
    """Where an event stands: the file, the entry (inside ``entries``), line and column."""
    mark = event.start_mark
    at = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "?"
    if len(keys) >= 2 and keys[0] == "entries" and keys[1] not in (None, _NO_KEY):
        return f"{source}: entry {_shown(keys[1])} ({at})"
    if keys and keys[0] not in (None, _NO_KEY):
        return f"{source}: {_shown(keys[0])} ({at})"
    return f"{source} ({at})"


def _clip(text: str) -> str:
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."


def _shown(key: Any) -> str:
    return repr(_clip(key)) if type(key) is str else repr(key)
