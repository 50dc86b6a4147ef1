"""Background staging of ``Snapshot.async_take(..., stage_in_background=True)``: the call
returns once the state is captured and planned; a thread of the library's copies the tensors
into staging buffers (``TakeJob.stage_held``), while hooks hold the first optimizer step and
the first forward of a module with buffers until the bytes are staged."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from snapshot._engine import runtime
from snapshot._engine.handlers.table import Payload
from snapshot._engine.io import device
from snapshot._engine.take.take import TakeJob


class StagingGuard:
    """Hooks on the state of ``app_state`` that wait until ``staged`` is set: a step pre-hook
    on each optimizer (an app_state value, or an attribute of one), a forward pre-hook on each
    module with buffers (an app_state value or an attribute of one, and their submodules that
    hold buffers of their own). ``error``: what stopped staging, once ``staged`` is set.

    ``end`` removes the forward hooks (torch runs a copy of the list of them). A step hook is
    removed by the optimizer's first step that meets it once staging ended, after the step,
    on the thread that steps: torch iterates the dict of step hooks itself, so removing one
    from another thread could break a step under way."""

    def __init__(self, app_state: Mapping[str, Any]) -> None:
        self.staged = threading.Event()
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._steps: dict[int, Any] = {}  # id of an optimizer -> its hook's handle
        self._forwards: dict[int, Any] = {}  # id of a module -> its hook's handle
        # The staging thread, once it runs this take's staging: it never waits.
        self._thread: threading.Thread | None = None
        try:
            for value in _reachable(app_state.values()):
                if isinstance(value, torch.optim.Optimizer) and id(value) not in self._steps:
                    self._steps[id(value)] = value.register_step_pre_hook(self._hold_step)
                elif isinstance(value, torch.nn.Module):
                    for m in value.modules():
                        has = next(m.buffers(recurse=m is value), None) is not None
                        if has and id(m) not in self._forwards:
                            self._forwards[id(m)] = m.register_forward_pre_hook(self._hold)
        except BaseException as e:
            self.end(e)
            raise

    def _wait(self) -> None:
        if threading.current_thread() is not self._thread:  # a prepare func's forward
            self.staged.wait()

    def _hold(self, module: torch.nn.Module, args: Any) -> None:
        self._wait()

    def _hold_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._wait()
        with self._lock:
            handle = self._steps.pop(id(optimizer), None)
        if handle is not None:
            _remove_after_step(optimizer, handle)

    def end(self, error: BaseException | None) -> None:
        """Staging is over (``error``: what stopped it): the held steps and forwards run."""
        with self._lock:
            self.error = error
            self.staged.set()
            forwards, self._forwards = self._forwards, {}
        for handle in forwards.values():
            handle.remove()

    def start(self, job: TakeJob) -> None:
        """Stages ``job``'s held writes on the runtime's staging thread (after the takes
        queued there before), then ``end``. CUDA copies are ordered after the kernels queued
        on the caller's current streams by now."""
        collected = job.collected
        streams = caller_streams([*collected.payloads, *collected.replicated])

        def stage() -> None:
            self._thread = threading.current_thread()
            error: BaseException | None = None
            try:
                with _current(streams):
                    error = job.stage_held()
            except BaseException as e:
                error = e
            finally:
                self.end(error)

        runtime.get().stager().submit(stage)


# Optimizer -> the post-hook that removes, once the step ends, itself and the step hooks after
# it in the list. All on the stepping thread: removed by the last post-hook of the step
# (registered during it), the dicts torch iterates are not changed under its iteration.
_AFTER_STEP: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[Any]] = (
    weakref.WeakKeyDictionary()
)


def _remove_after_step(optimizer: torch.optim.Optimizer, handle: Any) -> None:
    handles = _AFTER_STEP.get(optimizer)
    if handles is None:
        handles = _AFTER_STEP[optimizer] = [optimizer.register_step_post_hook(_remove)]
    handles.append(handle)


def _remove(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    for handle in _AFTER_STEP.pop(optimizer, ()):
        handle.remove()


def _reachable(values: Iterable[Any]) -> Iterator[Any]:
    """The app_state values, and the optimizers and modules among their attributes (and in
    lists, tuples and dicts held by an attribute): a wrapper's, one level down."""
    kinds = (torch.optim.Optimizer, torch.nn.Module)
    for value in values:
        yield value
        if isinstance(value, kinds):
            continue
        for attr in getattr(value, "__dict__", {}).values():
            items = attr.values() if isinstance(attr, dict) else attr
            if isinstance(items, (list, tuple)) or isinstance(attr, dict):
                yield from (v for v in items if isinstance(v, kinds))
            elif isinstance(attr, kinds):
                yield attr


def caller_streams(payloads: Iterable[Payload]) -> list[device.Stream]:
    """On the caller's thread: for each CUDA device the state's tensors are on, a new stream
    that waits for the work queued so far on the caller's current stream there. The staging
    thread makes them its current streams, so the staging streams wait for that work only, not
    for the forward and backward the caller queues after the call (only a GPU run proves the
    overlap; ``tests/cuda_double.py`` checks the order)."""
    indices = {device.cuda_index(p.source.tensor) for p in payloads if p.source is not None}
    streams = []
    for index in sorted(i for i in indices if i is not None):
        stream = device.new_stream(index)
        device.wait_stream(stream, device.current_stream(index))
        streams.append(stream)
    return streams


@contextlib.contextmanager
def _current(streams: list[device.Stream]) -> Iterator[None]:
    """Each of ``streams`` the current stream of its device on this thread."""
    with contextlib.ExitStack() as stack:
        for stream in streams:
            stack.enter_context(device.use_stream(stream))
        yield
