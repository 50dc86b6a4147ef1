"""The names a take's commit protocol (``take``) writes at the top of a snapshot, which readers,
the checkpoint manager and cleanup look for.

A snapshot is visible once its manifest is there, and only then; a path holding the pending
marker without a manifest is a take that was interrupted (``manifest_io`` says so; a new take
there replaces what it left).
"""

from __future__ import annotations

import re

MANIFEST_NAME = "manifest.yaml"
# Written before the first blob and deleted after the commit.
PENDING_NAME = ".statesnap-pending"
# The detached signature ``snapshot.signing`` writes beside a committed manifest (never a take).
SIGNATURE_NAME = "manifest.sig.json"

# What a take writes at the top of its directory, and so what an interrupted one may leave
# there: rank directories of blobs ("0", "1", ...), the pending marker, and the local plugin's
# temporary files (".<name>.<12 hex digits>.tmp", renamed into place when written); and a
# signature left by an earlier snapshot there (it fails to verify the new one, so is harmless).
TAKE_DEBRIS = re.compile(r"[0-9]+|\.statesnap-pending|manifest\.sig\.json|\..+\.[0-9a-f]{12}\.tmp")
# Names of the directory asked for before a take: beyond the debris of a few thousand ranks.
LISTED_NAMES = 4096


def left_by_a_take(name: str) -> bool:
    return TAKE_DEBRIS.fullmatch(name) is not None
