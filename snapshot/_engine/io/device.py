"""The library's calls into CUDA (streams, copies, events, pinned memory), in one place.

Only a machine with a GPU runs them (all but ``cuda_index``; benchmarks/gpu_check.py checks
them). Tests on CPU replace them with a double (``tests/cuda_double.py``), so callers look them
up on this module at call time (``device.copy(...)``), and ask ``cuda_index`` first, so that a
state without device tensors never creates a CUDA context.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

# A ``torch.cuda.Stream`` (or a test double's stream): kept opaque here.
Stream = Any


def cuda_index(t: torch.Tensor) -> int | None:
    """The index of the CUDA device holding ``t``'s memory; None for any other memory."""
    return t.device.index if t.is_cuda else None


def current_stream(index: int) -> Stream:
    """The calling thread's current stream on device ``index``."""
    return torch.cuda.current_stream(index)


def new_stream(index: int) -> Stream:
    """A new stream on device ``index``."""
    return torch.cuda.Stream(device=index)


def wait_stream(stream: Stream, other: Stream) -> None:
    """Work queued on ``stream`` from now on starts after that queued on ``other`` so far."""
    stream.wait_stream(other)


def use_stream(stream: Stream) -> contextlib.AbstractContextManager[Any]:
    """A context in which ``stream`` is its device's current stream."""
    return torch.cuda.stream(stream)


def copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
    """``dst.copy_(src)`` between host and device, on the device's current stream."""
    dst.copy_(src, non_blocking=non_blocking)


def record_event(stream: Stream) -> Any:
    """A marker after the work queued on ``stream`` so far (``event_done`` asks about it)."""
    event = torch.cuda.Event()
    event.record(stream)
    return event


def event_done(event: Any) -> bool:
    """Whether the device has run everything queued before ``event``; never blocks."""
    return bool(event.query())


def synchronize(stream: Stream) -> None:
    """Blocks until everything queued on ``stream`` so far is done."""
    stream.synchronize()


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A new page-locked host tensor; RuntimeError when pinning fails."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def empty_host_cache() -> None:
    """Hands the freed pinned blocks torch's host allocator keeps back to the system."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is None:  # an older torch, with no public call for it
        empty = torch._C._host_emptyCache
    empty()
