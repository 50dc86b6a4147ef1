"""Tensor leaves that are views of another leaf's memory, found after planning a take, so that
a restore into new tensors makes one storage of them, as ``torch.load`` does."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from manifest import TensorView

if TYPE_CHECKING:
    from snapshot._engine.handlers.table import Draft


def relate(
    drafts: Iterable[tuple[str, Draft]], rank_prefix: str
) -> dict[str, tuple[TensorView, Draft]]:
    """Each CPU tensor leaf (of ``drafts``, by path) whose elements lie within the memory of a
    contiguous leaf of its storage and dtype, as a view of it, with that leaf's draft (never a
    view of a view).
    Tied leaves (the same view of one memory) share payloads and need no record; negated or
    conjugate tensors hold other values than their memory, and are left alone. For a take
    without a prepare function, when planning met a leaf that may be such a view."""
    cut = len(rank_prefix)
    storages: dict[tuple[Any, ...], list[tuple[int, int, str, torch.Tensor, Draft]]] = {}
    views: dict[str, tuple[TensorView, Draft]] = {}
    for path, draft in drafts:
        first = draft.payloads[0]
        t = first.tensor if first.source is None else first.source.tensor
        if t is None or not t.is_cpu or t.is_neg() or t.is_conj():
            continue
        start = int(t.storage_offset())
        end = start + 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        key = (t.untyped_storage().data_ptr(), t.dtype)
        storages.setdefault(key, []).append((start, -end, path, t, draft))
    for members in storages.values():
        if len(members) < 2:
            continue
        # By where their elements start, the widest first, contiguous ones first among equal
        # spans (a transpose and its base): a leaf within the span of the contiguous leaf
        # reaching furthest so far is a view of that one.
        members.sort(key=lambda m: (m[0], m[1], not m[3].is_contiguous()))
        base: tuple[int, int, str, torch.Tensor, Draft] | None = None
        for start, neg_end, path, t, draft in members:
            if base is not None and -neg_end <= base[1]:
                b_start, _, b_path, b_t, b_draft = base
                tied = (
                    start == b_start
                    and t.shape == b_t.shape
                    and t.stride() == b_t.stride()
                    and draft.payloads[0] is b_draft.payloads[0]
                )
                if not tied:
                    offset, stride = start - b_start, tuple(t.stride())
                    view = TensorView(base=b_path[cut:], offset=offset, stride=stride)
                    views[path] = (view, b_draft)
            elif t.is_contiguous():
                base = (start, -neg_end, path, t, draft)
    return views
