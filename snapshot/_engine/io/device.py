"""The library's calls into CUDA for staging, in one place: which stream is current, making a
stream, ordering one stream after another, the non-blocking copy, events, waiting for a stream,
pinned allocation, emptying torch's pinned-memory cache.

Only a machine with a GPU runs them (all but ``cuda_index``; benchmarks/gpu_check.py checks
them). Tests on CPU replace them with a double (``tests/cuda_double.py``) that holds each
non-blocking copy until its stream is synchronized: callers look them up on this module at call
time (``device.copy(...)``). Callers ask ``cuda_index`` first, so a state without device
tensors never creates a CUDA context.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

# A ``torch.cuda.Stream`` (or a test double's stream): kept opaque here.
Stream = Any


def cuda_index(t: torch.Tensor) -> int | None:
    """The index of the CUDA device holding ``t``'s memory; None for host memory (and for
    other device types, whose copies the library makes synchronously)."""
    return t.device.index if t.is_cuda else None


def current_stream(index: int) -> Stream:
    """The calling thread's current stream on device ``index``, where the application's kernels
    are queued."""
    return torch.cuda.current_stream(index)


def new_stream(index: int) -> Stream:
    """A new stream on device ``index``."""
    return torch.cuda.Stream(device=index)


def wait_stream(stream: Stream, other: Stream) -> None:
    """Work queued on ``stream`` from now on starts after the work queued on ``other`` so far
    (both on one device). Does not block the host."""
    stream.wait_stream(other)


def use_stream(stream: Stream) -> contextlib.AbstractContextManager[Any]:
    """A context in which ``stream`` is its device's current stream."""
    return torch.cuda.stream(stream)


def copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
    """``dst.copy_(src)`` between host memory and a device, on the device's current stream; with
    ``non_blocking`` and pinned host memory, the bytes are there once that stream is
    synchronized."""
    dst.copy_(src, non_blocking=non_blocking)


def record_event(stream: Stream) -> Any:
    """A marker after the work queued on ``stream`` so far (``event_done`` asks whether the
    device has passed it). Does not block the host."""
    event = torch.cuda.Event()
    event.record(stream)
    return event


def event_done(event: Any) -> bool:
    """Whether the device has run everything queued before ``event`` was recorded; never
    blocks."""
    return bool(event.query())


def synchronize(stream: Stream) -> None:
    """Blocks until everything queued on ``stream`` so far is done."""
    stream.synchronize()


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A new page-locked host tensor; RuntimeError when pinning fails (``ulimit -l``, no
    driver)."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def empty_host_cache() -> None:
    """Hands the freed pinned blocks torch's host allocator keeps locked back to the system."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if empty is None:  # an older torch, with no public call for it
        empty = torch._C._host_emptyCache
    empty()
