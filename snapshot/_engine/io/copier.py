"""The copier thread of async take: a large host tensor is copied into its pooled buffer on a
thread of its own (the runtime's ``copier``) while the caller goes on planning and staging the
rest. torch's copy lets the GIL go, so the caller's Python and the copy run at once: on two
cores, the call of a state that is mostly large tensors stalls its caller for about the longer
of the two, not their sum (the async case of ``benchmarks.bench_io``).

A copy started here is awaited by the lease it fills (``Lease.copy``, ``Lease.ready``), which
the write pipeline readies before it hands the write over (``WritePipeline.flush``), and which
waits before its block is lent again: no write reads a buffer before its copy landed, and the
call returns with every copy done (``TakeJob`` readies every lease before it returns).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from snapshot._engine import runtime

# A host tensor of at least this many bytes, a blob of its own, is copied on the copier thread:
# each copy is long enough to hide the caller's planning of many small tensors behind it.
MIN_BYTES = 4 << 20


def start(copy: Callable[[], None]) -> Future[None] | None:
    """Runs ``copy()`` on the copier thread; None when it ran here instead (the interpreter is
    shutting down: no new work for threads)."""
    try:
        return runtime.get().copier().submit(copy)
    except RuntimeError:
        copy()
        return None
