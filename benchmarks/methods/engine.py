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
    try:  # the process's runtime holds the pool
        from snapshot import Options
        from snapshot._engine.io import staging

        pool = staging.process_pool(Options.from_env())
    except ImportError:
        try:
            from snapshot._engine.io.staging import default_pool
        except ImportError:  # a tree from before the engine moved to snapshot._engine
            from snapshot.staging import default_pool  # type: ignore[no-redef]
        pool = default_pool()
    try:
        from snapshot import Options
    except ImportError:  # a tree from before snapshot.Options: the per-knob functions
        from snapshot import knobs

        budget = knobs.memory_budget_bytes(pool.free_bytes)
    else:
        budget = Options.from_env().budget(pool.free_bytes)
    return pool.allocated_bytes, pool.free_bytes, budget
