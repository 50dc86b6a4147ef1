"""Background staging of ``Snapshot.async_take(..., stage_in_background=True)``: the call
returns once the state is captured and planned; a thread of the library's copies the tensors
into staging buffers (``TakeJob.stage_held``), while hooks hold the first optimizer step and
the first forward of a module with buffers until the bytes are staged."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from snapshot._engine.handlers.table import Payload
from snapshot._engine.io import device
from snapshot._engine.take.take import TakeJob


class StagingGuard:
    """Hooks on the state of ``app_state`` that wait until ``staged`` is set: a step pre-hook
    on each optimizer (an app_state value, or an attribute of one), a forward pre-hook on each
    module with buffers (an app_state value or an attribute of one, and their submodules that
    hold buffers of their own). ``error``: what stopped staging, once ``staged`` is set.

    ``end`` removes the hooks, except an optimizer's whose step is waiting in it: removing it
    would change the dict of hooks torch is iterating; that step removes it after it ran."""

    def __init__(self, app_state: Mapping[str, Any]) -> None:
        self.staged = threading.Event()
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._hooks: dict[int, Any] = {}  # id of an optimizer or a module -> its hook's handle
        self._waiting: set[int] = set()  # optimizers whose step waits in the hook
        try:
            for value in _reachable(app_state.values()):
                if id(value) in self._hooks:
                    continue
                if isinstance(value, torch.optim.Optimizer):
                    self._hooks[id(value)] = value.register_step_pre_hook(self._hold_step)
                elif isinstance(value, torch.nn.Module):
                    for m in value.modules():
                        has = next(m.buffers(recurse=m is value), None) is not None
                        if has and id(m) not in self._hooks:
                            self._hooks[id(m)] = m.register_forward_pre_hook(self._hold_forward)
        except BaseException as e:
            self.end(e)
            raise

    def _hold_forward(self, module: torch.nn.Module, args: Any) -> None:
        self.staged.wait()

    def _hold_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        key = id(optimizer)
        with self._lock:
            self._waiting.add(key)
        self.staged.wait()
        with self._lock:
            self._waiting.discard(key)
            handle = self._hooks.pop(key, None) if self.staged.is_set() else None
        if handle is not None:  # ``end`` left it: removed once the step ran
            after: list[Any] = []

            def remove(*_: Any) -> None:
                handle.remove()
                after[0].remove()  # the last post-hook of this step: safe to remove

            after.append(optimizer.register_step_post_hook(remove))

    def end(self, error: BaseException | None) -> None:
        """Staging is over (``error``: what stopped it): the held steps and forwards run."""
        with self._lock:
            self.error = error
            self.staged.set()
            handles = [h for k, h in self._hooks.items() if k not in self._waiting]
            self._hooks = {k: h for k, h in self._hooks.items() if k in self._waiting}
        for handle in handles:
            handle.remove()

    def start(self, job: TakeJob) -> None:
        """Stages ``job``'s held writes on a thread of its own, then ``end``. CUDA copies are
        ordered after the kernels queued on the caller's current streams by now."""
        collected = job.collected
        streams = caller_streams([*collected.payloads, *collected.replicated])

        def stage() -> None:
            error: BaseException | None = None
            try:
                with _current(streams):
                    error = job.stage_held()
            except BaseException as e:
                error = e
            finally:
                self.end(error)

        threading.Thread(target=stage, name="statesnap-staging", daemon=True).start()


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
