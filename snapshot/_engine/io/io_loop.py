"""Running work on the I/O loop: the one event loop (on a background thread, "statesnap-io",
owned by the process's ``Runtime``) that every storage call of the library runs on, so that
callers need no loop of their own and can call the library from inside one (a notebook, say).

``run`` runs a coroutine there and waits for it; ``spawn`` starts one and ``join`` waits for it
later (the caller does other work meanwhile); ``hold`` keeps a task nobody awaits alive.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Coroutine
from typing import Any, TypeVar

from snapshot._engine import runtime

_T = TypeVar("_T")


def io_loop() -> asyncio.AbstractEventLoop:
    """The library's event loop, started on first use (and again in a forked child)."""
    return runtime.get().loop()


def run(coro: Coroutine[Any, Any, _T]) -> _T:
    """Runs ``coro`` on the I/O loop and waits for its result, from any thread but the loop's."""
    return join(spawn(coro))


def spawn(coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
    """Starts ``coro`` on the I/O loop, from any thread but the loop's; ``join`` waits for it
    (the caller does other work meanwhile)."""
    rt = runtime.get()
    loop = rt.loop()
    if rt.on_loop_thread():
        coro.close()
        raise RuntimeError("snapshot I/O called from the I/O loop itself; this would deadlock")
    return asyncio.run_coroutine_threadsafe(coro, loop)


def join(future: concurrent.futures.Future[_T]) -> _T:
    """Waits for what ``spawn`` started, and gives its result or raises its error."""
    try:
        return future.result()
    except BaseException:
        future.cancel()  # KeyboardInterrupt in the caller: stop the work, don't leave it running
        raise


def hold(task: asyncio.Task[Any]) -> None:
    """Keeps ``task`` alive until it is done: the loop itself keeps only weak references to
    tasks, and a task nobody awaits could otherwise be collected mid-way."""
    runtime.get().hold(task)
