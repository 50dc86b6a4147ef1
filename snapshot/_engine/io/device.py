"""The library's calls into CUDA for staging, in one place.

Async take copies device tensors into pinned host buffers on side streams, and restores copy
pinned tiles to devices; those few calls (which stream is current, making a stream, ordering
one stream after another, the non-blocking copy, marking a point of a stream and asking
whether the device has passed it, waiting for a stream, pinned allocation, emptying torch's
pinned-memory cache) are the functions below and nothing else in the library calls
``torch.cuda`` for them. Two reasons:

- Only a machine with a GPU can run them; tests on CPU replace these functions with a double
  (``tests/cuda_double.py``) that holds each non-blocking copy until its stream is
  synchronized, so the ordering rules built on them (``staging.Lease``, ``plan.Placer``) are
  exercised without a GPU.
- Nothing here runs for host memory: callers ask ``cuda_index`` first (a tensor's own
  properties, no CUDA call), so a state without device tensors never creates a CUDA context,
  pins memory or makes a stream.

Callers must look the functions up on this module at call time (``device.copy(...)``, not
``from snapshot._engine.io.device import copy``), so that a test's replacement is the one called.

Every function below except ``cuda_index`` runs only on a machine with a GPU; what each one
does is torch's documented behaviour, which only a GPU run proves (benchmarks/gpu_check.py).
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
    """The calling thread's current stream on device ``index``: where the application's kernels
    that produced (and will next change) its tensors are queued."""
    return torch.cuda.current_stream(index)


def new_stream(index: int) -> Stream:
    """A new stream on device ``index`` (one per device for staging copies, so they do not
    queue behind the application's kernels)."""
    return torch.cuda.Stream(device=index)


def wait_stream(stream: Stream, other: Stream) -> None:
    """Work queued on ``stream`` from now on starts after the work queued on ``other`` so far
    (both on one device). Does not block the host."""
    stream.wait_stream(other)


def use_stream(stream: Stream) -> contextlib.AbstractContextManager[Any]:
    """A context in which ``stream`` is its device's current stream (and its device the current
    device), so copies from that device's tensors are queued on it."""
    return torch.cuda.stream(stream)


def copy(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
    """``dst.copy_(src)`` between host memory and a device, queued on the device's current
    stream. With ``non_blocking`` and pinned host memory the call returns at once and the bytes
    are there only once that stream is synchronized; otherwise it returns when they are."""
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
    """A new uninitialised page-locked host tensor (through torch's caching host allocator,
    which rounds the size up to a power of two). Raises RuntimeError when pinning fails (locked
    memory exhausted by ``ulimit -l``, a container's limit, no driver)."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def empty_host_cache() -> None:
    """Hands the pinned blocks torch's host allocator caches (freed, but kept locked for reuse)
    back to the system. A tensor of pinned memory that is freed stays locked until this runs."""
    fn = getattr(torch._C, "_host_emptyCache", None)  # CUDA builds of torch
    if fn is not None:
        fn()
    else:  # the accelerator-generic call (also in torch 2.13's CUDA builds)
        torch._C._accelerator_emptyHostCache()
