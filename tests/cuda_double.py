"""A CPU stand-in for CUDA's streams and copies, so tests can check the library's ordering rules
(which stream waits for which, when copied bytes may be read, when pinned memory is used)
without a GPU. It replaces the functions of ``snapshot._engine.io.device``, the one module through which
the library makes those calls.

Usage::

    from tests.cuda_double import CudaDouble

    def test_something(monkeypatch):
        cuda = CudaDouble(monkeypatch, devices=2)  # installed; monkeypatch undoes it
        w = cuda.tensor(torch.randn(64), device=1)  # a tensor "on cuda:1"
        cuda.launch(lambda: w.mul_(2), device=1)  # a kernel queued on cuda:1's current stream
        ...  # call the library
        cuda.synchronize()  # run everything queued, as torch.cuda.synchronize() on each device
        assert torch.equal(cuda.values(w), ...)

The model:

- Device tensors (``cuda.tensor(t, device=i)``) are CPU tensors of a subclass whose ``device``
  is ``cuda:i`` (``is_cuda`` True, ``is_cpu`` False, ``get_device()`` i); ``install`` adds the
  subclasses to the dense kind in the handler table (``handlers.register``), so the library
  stores them as dense tensors. Torch operations on them run at once on their CPU memory; a view or result of an
  operation on a device tensor is a device tensor on the same device (``.cpu()``,
  ``.to("cpu")``, ``.numpy()``, ``.tolist()``, ``.item()`` give host values). Read a device
  tensor's values with ``cuda.values(t)`` (it synchronizes its device first).
- Streams: each device has a default stream, the current stream of every thread until
  ``snapshot._engine.io.device.use_stream`` makes another current; ``snapshot._engine.io.device.new_stream`` makes
  side streams. What is queued on a stream (``launch``ed kernels, non-blocking copies, waits on
  other streams) runs in order, and only when the stream is synchronized
  (``snapshot._engine.io.device.synchronize(stream)``, ``cuda.synchronize()``) or when a stream that
  waits on it (``snapshot._engine.io.device.wait_stream``) runs past the point where it waited.
- ``snapshot._engine.io.device.copy(dst, src, non_blocking)`` between host memory and a device tensor uses
  the current stream of the device tensor's device (as torch does). With ``non_blocking`` and
  pinned host memory it is queued: the bytes land when that stream runs. Otherwise the stream
  first runs what was queued on it and the copy is made at once (a synchronous copy, or one
  to or from pageable memory, waits for its stream in CUDA too). Copies between two devices
  are not modelled (AssertionError).
- Pinned memory: ``snapshot._engine.io.device.pinned_empty`` returns CPU tensors the double remembers as
  pinned (``cuda.is_pinned(t)``, views included); with ``cuda.fail_pinning = True`` it raises
  RuntimeError, as torch does when locked memory runs out. ``snapshot._engine.io.device.empty_host_cache``
  only counts its calls (``cuda.host_cache_emptied``).
- Events: ``snapshot._engine.io.device.record_event(stream)`` marks the point a stream has queued
  to; ``event_done`` says whether the stream has run past it. Nothing runs in the background,
  so a point is passed only once the stream is synchronized (a device slower than the host),
  unless ``cuda.copies_done_when_asked = True``: then asking runs the stream to the point (a
  device that keeps up with the host).
- ``cuda.events`` logs every call into the seam, in order: ``("stream", i)`` (a stream made on
  device i), ``("wait", waiter, waited)``, ``("copy", i, stream, "queued" | "now")``,
  ``("record", stream)``, ``("query", stream, passed)``, ``("sync", stream)``, ``("pin", nbytes)``, ``("empty_host_cache",)``; streams appear by
  name (``"cuda:1/default"``, ``"cuda:1/s0"``). A host-only state must leave it empty.

What the double cannot show: real DMA timing, the caching allocators' reuse of memory across
streams, and everything torch does inside one copy. Those need a GPU (benchmarks/gpu_check.py).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from snapshot._engine.format.serialization import BYTE_VIEW_DTYPES
from snapshot._engine.handlers import dense, register
from snapshot._engine.io import device as seam


class FakeStream:
    """A stream of one device: work queued in order, run when synchronized (or waited on)."""

    def __init__(self, double: CudaDouble, index: int, name: str) -> None:
        self.double = double
        self.device_index = index
        self.name = name
        self._ops: deque[Callable[[], None]] = deque()
        self.issued = 0  # operations ever queued
        self.done = 0  # operations ever run

    def __repr__(self) -> str:
        return f"FakeStream({self.name}, {self.issued - self.done} pending)"

    def queue(self, op: Callable[[], None]) -> None:
        with self.double._lock:
            self._ops.append(op)
            self.issued += 1

    def run_to(self, target: int) -> None:
        """Runs queued operations until ``target`` of them have ever run."""
        with self.double._lock:
            while self.done < target:
                op = self._ops.popleft()
                self.done += 1
                op()

    def run_all(self) -> None:
        self.run_to(self.issued)

    @property
    def pending(self) -> int:
        return self.issued - self.done


class _DeviceTensor(torch.Tensor):
    """A CPU tensor that says it is on ``cuda:<index>`` (one subclass per index)."""

    index = 0

    @property  # type: ignore[override]
    def device(self) -> torch.device:
        return torch.device("cuda", type(self).index)

    @property  # type: ignore[override]
    def is_cpu(self) -> bool:
        return False

    @property  # type: ignore[override]
    def is_cuda(self) -> bool:
        return True

    def get_device(self) -> int:  # type: ignore[override]
        return type(self).index

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if not args or type(args[0]) is not cls:
            return out
        if _to_host(func, args, kwargs):
            if isinstance(out, _DeviceTensor):  # the same CPU memory: give a host copy
                with torch._C.DisableTorchFunctionSubclass():
                    return out.as_subclass(torch.Tensor).clone()
            return out
        return _wrap(out, cls)


_HOST_RESULTS = {"cpu", "numpy", "tolist", "item"}


def _to_host(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    name = getattr(func, "__name__", "")
    if name in _HOST_RESULTS:
        return True
    if name == "to":
        for a in (*args[1:], kwargs.get("device")):
            if isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu":
                return True
    return False


def _wrap(out: Any, cls: type[_DeviceTensor]) -> Any:
    if type(out) is torch.Tensor:
        return out.as_subclass(cls)
    if isinstance(out, (tuple, list)):
        return type(out)(_wrap(o, cls) for o in out)
    return out


_CLASSES: dict[int, type[_DeviceTensor]] = {}


def device_class(index: int) -> type[_DeviceTensor]:
    """The tensor subclass of device tensors on ``cuda:<index>``."""
    cls = _CLASSES.get(index)
    if cls is None:
        cls = _CLASSES[index] = type(f"CudaTensor{index}", (_DeviceTensor,), {"index": index})
    return cls


def _index(t: torch.Tensor) -> int | None:
    return type(t).index if isinstance(t, _DeviceTensor) else None


class _Registration:
    """Holds the undo of a handler registration; monkeypatch's teardown, setting ``undo`` back
    to None, runs it (in the reverse order of the test's other patches, as they were made)."""

    _undo: Callable[[], None] | None = None

    @property
    def undo(self) -> Callable[[], None] | None:
        return self._undo

    @undo.setter
    def undo(self, undo: Callable[[], None] | None) -> None:
        if undo is None and self._undo is not None:
            self._undo()
        self._undo = undo


class CudaDouble:
    """Installs itself into ``snapshot._engine.io.device`` (and the dense kind's types) through
    ``monkeypatch``, for ``devices`` devices (see the module's docstring)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, devices: int = 1) -> None:
        self.devices = devices
        self._lock = threading.RLock()
        self._local = threading.local()
        self.default = [FakeStream(self, i, f"cuda:{i}/default") for i in range(devices)]
        self.side: list[list[FakeStream]] = [[] for _ in range(devices)]
        self.events: list[tuple[Any, ...]] = []
        self.fail_pinning = False
        self.copies_done_when_asked = False
        self.host_cache_emptied = 0
        self._pinned: list[tuple[weakref.ref[torch.Tensor], int, int]] = []
        classes = tuple(device_class(i) for i in range(devices))
        # The device tensor types join the dense kind in the handler table; the registration
        # is undone at teardown.
        undo = register(dense.Dense(value_types=classes, entry_types=()))
        monkeypatch.setattr(_Registration(), "undo", undo)
        for name, fn in {
            "cuda_index": self.cuda_index,
            "current_stream": self.current_stream,
            "new_stream": self.new_stream,
            "wait_stream": self.wait_stream,
            "use_stream": self.use_stream,
            "copy": self.copy,
            "synchronize": self.synchronize_stream,
            "record_event": self.record_event,
            "event_done": self.event_done,
            "pinned_empty": self.pinned_empty,
            "empty_host_cache": self.empty_host_cache,
        }.items():
            monkeypatch.setattr(seam, name, fn)

    # -- for tests ------------------------------------------------------------------------------

    def tensor(self, t: torch.Tensor, device: int = 0) -> torch.Tensor:
        """A device tensor on ``cuda:<device>`` holding a copy of ``t``'s values."""
        self._check(device)
        t = t.detach()
        if t.dtype in BYTE_VIEW_DTYPES:  # no copy kernel: cloned as bytes
            return t.view(torch.uint8).clone().view(t.dtype).as_subclass(device_class(device))
        return t.clone().as_subclass(device_class(device))

    def launch(self, fn: Callable[[], Any], device: int = 0) -> None:
        """Queues ``fn`` (a "kernel": say, ``lambda: w.add_(1)``) on the calling thread's
        current stream of ``device``; it runs when that stream runs."""
        self.current_stream(device).queue(lambda: _no_grad(fn))

    def synchronize(self, device: int | None = None) -> None:
        """Runs everything queued on the streams of ``device`` (every device if None)."""
        indices = range(self.devices) if device is None else [device]
        while True:
            streams = [s for i in indices for s in (self.default[i], *self.side[i]) if s.pending]
            if not streams:
                return
            for s in streams:
                s.run_all()

    def values(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of a device tensor's values, once its device's queued work has run."""
        index = _index(t)
        if index is not None:
            self.synchronize(index)
        with torch._C.DisableTorchFunctionSubclass():
            return t.detach().clone().as_subclass(torch.Tensor)

    def pending(self) -> int:
        """Operations queued on any stream and not run yet."""
        return sum(s.pending for i in range(self.devices) for s in (self.default[i], *self.side[i]))

    def is_pinned(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s memory lies in a block ``pinned_empty`` gave (and that is alive)."""
        ptr = t.data_ptr()
        with self._lock:
            self._pinned = [(ref, lo, hi) for ref, lo, hi in self._pinned if ref() is not None]
            return any(lo <= ptr < hi for _, lo, hi in self._pinned)

    def streams_made(self) -> dict[int, int]:
        """Device index -> how many streams ``new_stream`` made on it."""
        return {i: len(self.side[i]) for i in range(self.devices) if self.side[i]}

    def calls(self, kind: str) -> list[tuple[Any, ...]]:
        """The events of one kind (``"copy"``, ``"sync"``...)."""
        return [e for e in self.events if e[0] == kind]

    # -- the seam (snapshot._engine.io.device) -------------------------------------------------------------

    def cuda_index(self, t: torch.Tensor) -> int | None:
        return _index(t)

    def current_stream(self, index: int) -> FakeStream:
        self._check(index)
        current = getattr(self._local, "current", None)
        if current is not None and index in current:
            return current[index]
        return self.default[index]

    def new_stream(self, index: int) -> FakeStream:
        self._check(index)
        with self._lock:
            stream = FakeStream(self, index, f"cuda:{index}/s{len(self.side[index])}")
            self.side[index].append(stream)
            self.events.append(("stream", index))
        return stream

    def wait_stream(self, stream: FakeStream, other: FakeStream) -> None:
        assert stream.device_index == other.device_index, "streams of two devices"
        target = other.issued
        stream.queue(lambda: other.run_to(target))
        self.events.append(("wait", stream.name, other.name))

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream) -> Iterator[None]:
        current = getattr(self._local, "current", None)
        if current is None:
            current = self._local.current = {}
        before = current.get(stream.device_index)
        current[stream.device_index] = stream
        try:
            yield
        finally:
            if before is None:
                del current[stream.device_index]
            else:
                current[stream.device_index] = before

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
        src_index, dst_index = _index(src), _index(dst)
        assert (src_index is None) != (dst_index is None), "only host <-> device copies"
        index = src_index if src_index is not None else dst_index
        assert index is not None
        host = dst if src_index is not None else src
        stream = self.current_stream(index)
        queued = non_blocking and self.is_pinned(host)
        self.events.append(("copy", index, stream.name, "queued" if queued else "now"))

        def op() -> None:
            with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
                dst.copy_(src)

        if queued:
            stream.queue(op)
        else:
            stream.run_all()
            op()

    def record_event(self, stream: FakeStream) -> tuple[FakeStream, int]:
        """``snapshot._engine.io.device.record_event``: the point of ``stream`` reached so far."""
        self.events.append(("record", stream.name))
        return (stream, stream.issued)

    def event_done(self, event: tuple[FakeStream, int]) -> bool:
        """``snapshot._engine.io.device.event_done``: whether ``stream`` has run to the point. With
        ``copies_done_when_asked`` (a device that keeps up), it runs to it first."""
        stream, point = event
        if self.copies_done_when_asked:
            stream.run_to(point)
        self.events.append(("query", stream.name, stream.done >= point))
        return stream.done >= point

    def synchronize_stream(self, stream: FakeStream) -> None:
        """``snapshot._engine.io.device.synchronize``: runs what was queued on ``stream``."""
        self.events.append(("sync", stream.name))
        stream.run_all()

    def pinned_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if self.fail_pinning:
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc, the double)")
        t = torch.empty(shape, dtype=dtype)
        nbytes = t.numel() * t.element_size()
        with self._lock:
            self._pinned.append((weakref.ref(t), t.data_ptr(), t.data_ptr() + max(1, nbytes)))
        self.events.append(("pin", nbytes))
        return t

    def empty_host_cache(self) -> None:
        self.host_cache_emptied += 1
        self.events.append(("empty_host_cache",))

    def _check(self, index: int) -> None:
        if not 0 <= index < self.devices:
            raise AssertionError(f"cuda:{index} does not exist (the double has {self.devices})")


def _no_grad(fn: Callable[[], Any]) -> None:
    with torch.no_grad():
        fn()
