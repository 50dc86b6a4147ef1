"""Tensor lines of the writer's common layout, decoded by one pattern.

Most lines of a manifest are tensors stored in one range with a CRC-32, written by
``EntryFormatter.tensor`` with every string verbatim. ``split`` matches each such line with one
regular expression, over the whole text in C, and builds its entry from the matched fields: it
skips, for nearly every line, the JSON decoder's mapping, the field-by-field checks of
``EntryDecoder`` and the depth scan the other lines get before the JSON decoder sees them (the
pattern is those checks), which made most of the time of reading a manifest of many small
tensors. Any other line is left to the JSON path.
"""

from __future__ import annotations

import re

from manifest.entries import MAX_CRC32, PLAIN_BLOB, Location, TensorEntry

# Decimal numbers as JSON writes them, short enough for ``int`` (longer ones: the JSON path).
_NUMBER = "0|[1-9][0-9]{0,30}"
# A line exactly as ``EntryFormatter.tensor`` writes a path, dtype and blob JSON leaves as they
# are (a blob name the writer makes, so safe), with one range and its CRC-32; or any other line.
_LINE = re.compile(
    rf'^(?:  "([ !#-\[\]-~]*)": \{{"type": "tensor", "dtype": "([a-z0-9_]+)", '
    rf'"shape": \[((?:{_NUMBER})(?:, (?:{_NUMBER}))*)?\], '
    rf'"chunks": \[\["({PLAIN_BLOB.pattern})", ({_NUMBER}), ({_NUMBER}), ({_NUMBER})\]\]'
    rf'(, "replicated": true)?\}}|(.*))$',
    re.MULTILINE,
)


def split(body: str) -> tuple[list[tuple[str, TensorEntry] | None], list[str]] | None:
    """The lines of ``body`` (``\\n``-separated, the last one ended): each tensor line's path
    and entry, in order, with None in place of every other line; and those other lines. None
    for a CRC-32 out of range (the YAML path reports it)."""
    if body.endswith("\n"):
        body = body[:-1]
    items: list[tuple[str, TensorEntry] | None] = []
    others: list[str] = []
    shapes: dict[str, tuple[int, ...]] = {}  # by their text: most tensors share a few shapes
    blobs: dict[str, str] = {}  # each blob name kept once
    for path, dtype, shape, blob, offset, nbytes, crc, replicated, other in _LINE.findall(body):
        if dtype:
            if int(crc) > MAX_CRC32:
                return None
            dims = shapes.get(shape)
            if dims is None:
                dims = shapes[shape] = tuple(map(int, shape.split(", "))) if shape else ()
            loc = Location(blobs.setdefault(blob, blob), int(offset), int(nbytes), int(crc))
            items.append((path, TensorEntry(dtype, dims, (loc,), replicated=bool(replicated))))
        else:
            items.append(None)
            others.append(other)
    return items, others
