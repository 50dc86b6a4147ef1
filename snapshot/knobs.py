"""Tunables, each overridable by an environment variable of the same name prefixed STATESNAP_."""

from __future__ import annotations

import os

_MIB = 1 << 20


def _env_int(name: str, default: int, minimum: int) -> int:
    raw = os.environ.get(f"STATESNAP_{name}")
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"STATESNAP_{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"STATESNAP_{name} must be >= {minimum}, got {value}")
    return value


def _available_memory_bytes() -> int | None:
    try:
        pages = os.sysconf("SC_AVPHYS_PAGES")
        page_size = os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return pages * page_size if pages > 0 and page_size > 0 else None


def max_concurrent_io() -> int:
    """Blob reads/writes in flight at once (STATESNAP_MAX_CONCURRENT_IO, default 16)."""
    return _env_int("MAX_CONCURRENT_IO", 16, 1)


def memory_budget_bytes() -> int:
    """Bytes of staging/scratch memory one take or restore may hold at once, per process.

    STATESNAP_MEMORY_BUDGET_BYTES; by default a quarter of the memory available when asked,
    clamped to [64 MiB, 4 GiB].
    """
    available = _available_memory_bytes()
    default = 1024 * _MIB if available is None else available // 4
    default = max(64 * _MIB, min(default, 4096 * _MIB))
    return _env_int("MEMORY_BUDGET_BYTES", default, 1)


def inline_max_bytes() -> int:
    """str/bytes values up to this size live in the manifest; longer ones get a blob of their own
    (STATESNAP_INLINE_MAX_BYTES, default 1024)."""
    return _env_int("INLINE_MAX_BYTES", 1024, 0)


def write_batch_bytes() -> int:
    """Staged bytes handed from the caller's thread to the I/O loop at a time
    (STATESNAP_WRITE_BATCH_BYTES, default 64 MiB): smaller starts writing sooner."""
    return _env_int("WRITE_BATCH_BYTES", 64 * _MIB, 1)
