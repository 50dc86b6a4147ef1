"""``Snapshot.metadata``: what a snapshot's manifest says about it, as one frozen object."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from manifest import Entry, Manifest

# How a take records the writer in the manifest's metadata: "statesnap 0.1.0".
_LIBRARY_PREFIX = "statesnap "


@dataclass(frozen=True)
class SnapshotMetadata:
    """Facts about a committed snapshot, read from its manifest (torchsnapshot's
    ``Snapshot.metadata``: ``version``, ``world_size``, ``manifest``; the rest is this
    library's).

    Attributes:
        version: the version of the library that took the snapshot (``"0.1.0"``); None when
            the manifest does not record it.
        world_size: how many processes took it.
        manifest: logical path -> entry, every rank's (what :meth:`Snapshot.get_manifest`
            returns); a copy, not shown by ``repr``.
        format_version: the manifest format the snapshot needs (2 when it holds sharded
            entries, else 1).
        torch_version: ``torch.__version__`` of the process that took it, when recorded.
        created_unix: when it was committed, in seconds since the epoch, when recorded.
        info: the manifest's metadata as recorded (a copy): ``library``, ``torch``,
            ``created_unix``, ``strategies`` (which backend and version wrote each part), and
            anything else a writer put there.
        user: what the take's ``user_metadata`` was (a copy), or None.
        bases: the names of the sibling snapshots (folders beside this one) whose bytes this
            snapshot's entries point at: an incremental take's base, and the snapshots that
            base pointed at. Empty for a snapshot that holds all its bytes.
    """

    version: str | None
    world_size: int
    manifest: dict[str, Entry] = field(repr=False)
    format_version: int = 1
    torch_version: str | None = None
    created_unix: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    user: dict[str, Any] | None = None
    bases: tuple[str, ...] = ()

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> SnapshotMetadata:
        """The metadata of the snapshot whose decoded manifest is ``manifest``; the entries and
        the metadata are copied, so changing the result's dicts leaves ``manifest`` as it is."""
        info = copy.deepcopy(manifest.metadata)
        library = info.get("library")
        if isinstance(library, str):
            version: str | None = library.removeprefix(_LIBRARY_PREFIX)
        else:
            version = None
        torch_version = info.get("torch")
        created = info.get("created_unix")
        return cls(
            version=version,
            world_size=manifest.world_size,
            manifest=dict(manifest.entries),
            format_version=manifest.format_version,
            torch_version=torch_version if isinstance(torch_version, str) else None,
            created_unix=(
                float(created)
                if isinstance(created, (int, float)) and not isinstance(created, bool)
                else None
            ),
            info=info,
            user=copy.deepcopy(user) if isinstance(user := info.get("user"), dict) else None,
            bases=manifest.bases,
        )


__all__ = ["SnapshotMetadata"]
