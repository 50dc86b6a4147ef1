"""Incremental takes: a tensor whose bytes did not change since a base snapshot is not written
again; its entry points at the base's bytes, ``../<base name>/<blob>`` (``manifest.reference_of``).

A change is told by an XXH3-128 digest of the bytes (``TensorEntry.digest``, recorded by every
take that may serve as a base): two byte strings share one by accident with a chance of about
2^-128, where a CRC-32 could not be trusted; it guards against accidents, not crafted collisions.
Bases are siblings (in the new snapshot's parent, as a manager's step folders are); a range the
base itself reused keeps pointing at the snapshot holding it, so a chain never reads through more
than one hop (readers resolve each by ``checked_sibling``). Only tensors of the planner's fast
path (contiguous CPU tensors written from their own memory, without a prepare function) are
compared; others are written in full and carry no digest.
"""

from __future__ import annotations

import logging
import os
import posixpath
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from manifest import SIBLING_NAME, TensorEntry, reference_of
from snapshot._engine.format.manifest_io import load_manifest, sibling_path, split_parent
from snapshot._engine.format.serialization import dtype_name, tensor_memoryview
from snapshot.errors import (
    InvalidArgumentError,
    MissingBaseError,
    SnapshotNotFoundError,
)

if TYPE_CHECKING:
    from snapshot.options import Options

logger = logging.getLogger("snapshot")

# How ``TensorEntry.digest`` records the digest of a tensor's bytes.
DIGEST_PREFIX = "xxh3_128:"


def base_name(path: str, base: str) -> str:
    """The name by which the snapshot at ``path`` refers to its ``base``: the base's folder
    name, when the two are siblings.

    Raises:
        InvalidArgumentError: the base is not in the same folder as ``path``, is ``path``
            itself, or has a name a manifest cannot record.
    """
    parent, name = split_parent(path)
    b_parent, b_name = split_parent(base)
    if "://" not in path and "://" not in base:
        same = os.path.normpath(parent) == os.path.normpath(b_parent)
    else:
        same = posixpath.normpath(parent) == posixpath.normpath(b_parent) and parent != ""
    if not same:
        if "://" in path and not parent:
            sibling = f"none: {path} lies at the root of its store"
        else:
            sibling = sibling_path(path, b_name or "<name>")
        raise InvalidArgumentError(
            f"base {base!r} of the take at {path!r} must be a snapshot in the same folder "
            f"(a sibling: {sibling!r}): an incremental snapshot points at its base's bytes by "
            "the base's name"
        )
    if b_name == name:
        raise InvalidArgumentError(f"the take at {path!r} cannot be its own base")
    if not SIBLING_NAME.fullmatch(b_name):
        raise InvalidArgumentError(
            f"base {base!r}: its folder name {b_name!r} is not one a manifest records (letters, "
            "digits and '_.=+-', not starting with '.' or '-')"
        )
    return b_name


class Reuse:
    """What one rank's take at ``path`` reuses of its ``base`` (whose manifest every rank
    reads); without a base, a take that only records digests. ``reused(path, tensor)``, for
    each tensor of the planner's fast path: the entry pointing at the base's bytes when the base
    holds the same ones at ``path``, else None, the tensor's digest recorded in ``digests``.
    """

    def __init__(
        self,
        path: str,
        base: str | None,
        storage_options: dict[str, Any] | None,
        options: Options,
        rank: int,
    ) -> None:
        self.name = None if base is None else base_name(path, base)
        self.entries: dict[str, Any] = {}
        self.digests: dict[str, str] = {}
        self.reused_bytes = 0
        self.hashed_bytes = 0
        if base is None:
            return
        try:
            self.entries = load_manifest(base, storage_options, options).view(rank)
        except SnapshotNotFoundError as e:
            raise MissingBaseError(f"cannot take {path} on base {base}: {e}", base=base) from e
        tensors = [e for e in self.entries.values() if type(e) is TensorEntry]
        if tensors and all(e.digest is None for e in tensors):
            # Nothing to compare with: every tensor is written again. Digests are off by
            # default (their cost on a take of many small tensors), so a chain's first
            # snapshot often lacks them; the take says how to start one that has them.
            logger.warning(
                "take on base %s: the base recorded no digests of its tensors, so nothing "
                "can be reused and every tensor is written in full; take the base with "
                "Options(digests=True) (or STATESNAP_DIGESTS=1). This snapshot records them: "
                "a take on it reuses what is unchanged",
                self.name,
            )

    def reused(self, path: str, tensor: torch.Tensor) -> TensorEntry | None:
        digest = DIGEST_PREFIX + xxhash.xxh3_128_hexdigest(tensor_memoryview(tensor))
        self.hashed_bytes += tensor.nbytes
        old = self.entries.get(path)
        if (
            type(old) is TensorEntry
            and old.digest == digest
            and old.shape == tuple(tensor.shape)
            and old.dtype == dtype_name(tensor.dtype)
            and sum(c.nbytes for c in old.chunks) == tensor.nbytes
        ):
            self.reused_bytes += tensor.nbytes
            # A base's blob is named through the base, or, for a range the base itself reused,
            # through the snapshot that holds it (a sibling of both).
            chunks = tuple(
                c if reference_of(c.blob) else replace(c, blob=f"../{self.name}/{c.blob}")
                for c in old.chunks
            )
            return TensorEntry(dtype=old.dtype, shape=old.shape, chunks=chunks, digest=digest)
        self.digests[path] = digest
        return None
