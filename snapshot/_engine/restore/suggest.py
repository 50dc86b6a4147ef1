"""Logical paths resembling one that is not in a manifest, for "did you mean" hints: difflib's
close matches at a cost bounded by the manifest's size (only the first ``_COMPARED`` characters
compared, the full ratio computed for the ``_SHORTLIST`` best by difflib's cheap bound), since
a manifest of many long, similar keys made ``difflib.get_close_matches`` take minutes."""

from __future__ import annotations

import difflib
import heapq
from collections.abc import Iterable

_COMPARED = 200  # characters of each path compared: paths differ near their start or end
_SHORTLIST = 50  # candidates whose full ratio is computed


def close_matches(
    word: str, candidates: Iterable[str], n: int = 3, cutoff: float = 0.6
) -> list[str]:
    """Up to ``n`` of ``candidates`` that resemble ``word``, best first (ratios of at least
    ``cutoff``, as ``difflib.get_close_matches`` rates them, on their first ``_COMPARED``
    characters)."""
    matcher = difflib.SequenceMatcher()
    matcher.set_seq2(word[:_COMPARED])  # the side difflib indexes, once
    bounded: list[tuple[float, str]] = []
    for candidate in candidates:
        matcher.set_seq1(candidate[:_COMPARED])
        if matcher.real_quick_ratio() >= cutoff:
            bound = matcher.quick_ratio()
            if bound >= cutoff:
                bounded.append((bound, candidate))
    scored = []
    for _, candidate in heapq.nlargest(_SHORTLIST, bounded):
        matcher.set_seq1(candidate[:_COMPARED])
        ratio = matcher.ratio()
        if ratio >= cutoff:
            scored.append((ratio, candidate))
    return [candidate for _, candidate in heapq.nlargest(n, scored)]
