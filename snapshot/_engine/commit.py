"""The commit protocol of a take: the names it writes at the top of a snapshot, the pending
marker written before the first blob, the manifest written last, and the cleanup of what a
failed take left."""

from __future__ import annotations

import re

MANIFEST_NAME = "manifest.yaml"
# Written before the first blob and deleted after the commit: its presence without a manifest
# means a take was interrupted.
PENDING_NAME = ".statesnap-pending"

# What a take writes at the top of its directory, and so what an interrupted one may leave
# there (with the pending marker, or without it once its cleanup deleted the marker): rank
# directories of blobs ("0", "1", ...) and the local plugin's temporary files
# (".<name>.<12 hex digits>.tmp", renamed into place when written).
TAKE_DEBRIS = re.compile(r"[0-9]+|\.statesnap-pending|\..+\.[0-9a-f]{12}\.tmp")
# Names of the directory asked for before a take: beyond the debris of a few thousand ranks.
LISTED_NAMES = 4096


def left_by_a_take(name: str) -> bool:
    return TAKE_DEBRIS.fullmatch(name) is not None
