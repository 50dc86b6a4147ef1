"""What a restore will read, found in a manifest's bytes before they are decoded: the ranges of
the dense tensors under some paths, given to the store as read-ahead hints while the entries
are decoded (decoding tens of thousands of entries takes longer than finding their ranges)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from itertools import groupby
from operator import add, itemgetter

from manifest.codec import path_text
from manifest.decode import PLAIN_BLOB

# A tensor line's shape and first chunk as the writer lays them out (``EntryFormatter``), its
# blob a plain one (no sibling snapshot's, nothing that leaves the root): a sharded tensor's
# chunks follow the ``sizes`` of a shard, never a ``shape``, and are left out.
_CHUNK = re.compile(
    rb'"shape": \[[0-9, ]*\], "chunks": \[\["(' + PLAIN_BLOB.pattern.encode() + rb')", '
    rb"([0-9]+), ([0-9]+)[,\]]"
)


def tensor_ranges(data: bytes, roots: Iterable[str], gap_bytes: int) -> list[tuple[str, int, int]]:
    """``(blob, offset, nbytes)`` covering the dense tensors of the entries under each of
    ``roots`` (manifest paths) in ``data``, a manifest's bytes as the writer lays them out:
    each root's line, then the lines of its subtree (the writer lists an app_state key's entries
    together); a blob's ranges at most ``gap_bytes`` apart are one. For hints only: entries in
    another layout, or a manifest laid out otherwise, give fewer ranges or none, and nothing
    here checks the manifest (decoding it does)."""
    out: list[tuple[str, int, int]] = []
    for root in roots:
        quoted = path_text(root)[:-1].encode("utf-8")  # '"root'
        start = data.find(b"\n  " + quoted + b'": ')
        if start < 0:
            continue
        # The subtree ends at the first line after the root's that is not under the root.
        below = re.compile(rb"\n(?!  " + re.escape(quoted) + rb"/)")
        found = below.search(data, start + 1)
        end = found.start() if found is not None else len(data)
        out.extend(_merged(_CHUNK.findall(data, start, end), gap_bytes))
    return out


def _merged(found: list[tuple[bytes, bytes, bytes]], gap: int) -> list[tuple[str, int, int]]:
    """The ranges found, one per run of a blob's ranges (in the manifest's order) that lie at
    most ``gap`` apart; each run's numbers converted in C-level passes."""
    out: list[tuple[str, int, int]] = []
    for blob, run in groupby(found, key=itemgetter(0)):
        rows = list(run)
        offsets = list(map(int, map(itemgetter(1), rows)))
        ends = list(map(add, offsets, map(int, map(itemgetter(2), rows))))
        name = blob.decode("ascii")
        lo, hi = min(offsets), max(ends)
        if hi - lo <= sum(ends) - sum(offsets) + gap:
            out.append((name, lo, hi - lo))
            continue
        # Ranges far apart: merged one by one.
        start = end = -1
        for offset, stop in zip(offsets, ends, strict=True):
            if start >= 0 and start - gap <= stop and offset <= end + gap:  # within ``gap``
                start, end = min(start, offset), max(end, stop)
                continue
            if start >= 0:
                out.append((name, start, end - start))
            start, end = offset, stop
        out.append((name, start, end - start))
    return out
