"""The one place the benchmarks reach below statesnap's public API.

The async case reports statesnap's staging pool (the pinned or page-aligned buffers an async
take stages into, kept for the next take) and the memory budget a take would compute at that
moment; neither is public. Both come from :func:`staging_figures`, which knows where each tree
of the library keeps them, so that a run can measure the working tree and an older one side by
side (``--library``). When the engine moves them again, update this function only.
"""

from __future__ import annotations


def staging_figures() -> tuple[int, int, int]:
    """(bytes the default staging pool has allocated, bytes of it free now, the memory budget a
    take would compute now, counting the pool's free blocks as available)."""
    from snapshot import Options

    try:  # the staging module makes the process's pool
        from snapshot._engine.io import staging

        pool = staging.process_pool(Options.from_env())
    except ImportError:  # a tree from before the engine's folders: the runtime makes it
        from snapshot._engine import runtime

        pool = runtime.get().staging_pool(Options.from_env())  # type: ignore[attr-defined]
    budget = Options.from_env().budget(pool.free_bytes)
    return pool.allocated_bytes, pool.free_bytes, budget
