"""What a tensor's memory can be trusted for: whether its storage holds every element it views,
and whether two of its elements are one place in memory.

The engine reads a tensor being taken, and writes a restore target, through raw addresses
(``serialization.raw_memoryview``) as well as through torch: a view past the end of its storage
(whose memory was freed, as FSDP frees a parameter's unsharded storage with ``resize_(0)``)
would be read or written out of bounds, and a target whose elements overlap cannot hold
distinct values. Both are asked before any byte moves. So is whether its memory holds its
values at all: a lazily negated or conjugated view does not (``negated``, ``conjugated``).
"""

from __future__ import annotations

import threading

import torch

# ``Tensor.is_neg()`` and ``is_conj()`` give up the GIL inside, as most of torch's bound
# methods do, and must take it back after: beside another thread that runs Python (the
# training loop an async take runs beside, any busy thread of the application), only at that
# thread's next switch. Planning 20,000 tensors asked each once and waited that long each time
# (``benchmarks/busy_thread.py``). The tensor's dispatch keys say the same with the GIL held:
# the lazy negation and conjugation are the ``Negative`` and ``Conjugate`` keys.
_keys = getattr(torch._C, "_dispatch_keys", None)
_NEGATIVE = getattr(getattr(torch._C, "DispatchKey", None), "Negative", None)
_CONJUGATE = getattr(getattr(torch._C, "DispatchKey", None), "Conjugate", None)


def negated(t: torch.Tensor) -> bool:
    """``t.is_neg()``, with the GIL held."""
    return _keys(t).has(_NEGATIVE)  # type: ignore[misc]


def conjugated(t: torch.Tensor) -> bool:
    """``t.is_conj()``, with the GIL held."""
    return _keys(t).has(_CONJUGATE)  # type: ignore[misc]


if _keys is None or _NEGATIVE is None or _CONJUGATE is None:  # a torch without them: as asked
    negated = torch.Tensor.is_neg  # type: ignore[assignment]
    conjugated = torch.Tensor.is_conj  # type: ignore[assignment]


def beside_others() -> bool:
    """Whether a Python thread other than the caller's and the library's own (``statesnap-*``)
    is alive: one that may run Python, and hold the GIL until made to switch. Without one, a
    planning loop may ask ``Tensor.is_neg()`` and ``is_conj()`` (a quarter of the dispatch
    keys' cost; their GIL given up and taken back at once, which also lets the restore's hint
    thread in: benchmarks/results/2026-11-28-direct-reads.md)."""
    me = threading.current_thread()
    return any(t is not me and not t.name.startswith("statesnap-") for t in threading.enumerate())


def _extent(t: torch.Tensor) -> int:
    """Elements from the storage's start to ``t``'s last element, inclusive (``t`` not empty)."""
    reach = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return t.storage_offset() + reach + 1


def memory_span(t: torch.Tensor) -> tuple[int, int]:
    """The addresses ``[start, end)`` of the memory ``t``'s elements lie in (empty when it has
    none), whatever the signs of its strides."""
    if t.numel() == 0:
        return 0, 0
    low = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if s < 0)
    high = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if s > 0)
    size = t.element_size()
    return t.data_ptr() + low * size, t.data_ptr() + (high + 1) * size


def storage_shortfall(t: torch.Tensor) -> tuple[int, int] | None:
    """``(bytes needed, bytes held)`` when ``t``'s storage is shorter than the elements it views
    reach; None when it holds them (or ``t`` has none)."""
    if t.numel() == 0:
        return None
    held = t.untyped_storage().nbytes()
    needed = _extent(t) * t.element_size()
    return (needed, held) if needed > held else None


def shares_memory(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` are one place in memory (an expanded view, or
    ``as_strided`` with overlapping strides): writing distinct values there cannot work.

    The dimensions of more than one element, by increasing stride, must each step past all the
    memory the smaller ones span; a zero stride never does. Layouts that fail the test without a
    zero stride (interleaved dimensions, rare) are decided exactly, by the elements' offsets.
    """
    if t.layout is not torch.strided or t.numel() <= 1 or t.is_contiguous():
        return False
    dims = sorted((s, n) for n, s in zip(t.shape, t.stride(), strict=True) if n > 1)
    span = 1  # elements spanned by the dimensions so far
    for stride, size in dims:
        if stride == 0:
            return True
        if stride < span:
            return _offsets_repeat(t)
        span += stride * (size - 1)
    return False


def _offsets_repeat(t: torch.Tensor) -> bool:
    offsets = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride(), strict=True):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return offsets.flatten().unique().numel() != t.numel()
