"""Replicated tensors read once per restore: one rank reads each, the others receive it.

Where every rank would fetch a replicated value from far (an object store, a file system several
hosts share), ``plan`` gives each such tensor to one reader and ``receive`` broadcasts it once the
reads succeeded. Ranks of one host reading a local directory share its page cache instead, which
a broadcast does not beat (``decide``).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from manifest import Entry, TensorEntry
from snapshot._engine.dist.dist import Coordinator
from snapshot._engine.restore.loader import Loader
from snapshot.options import Options
from storage_plugins.registry import split_url

# Small tensors travel packed into buffers of this size (one collective each), larger ones alone.
PACK_BYTES = 16 << 20


@dataclass
class Shared:
    """The tensors this rank receives or sends: (reader rank, path, target), in broadcast
    order."""

    items: list[tuple[int, str, torch.Tensor]]


def candidates(loader: Loader, entries: Mapping[str, Entry], prefix: str) -> dict[str, int]:
    """The replicated tensors this rank's planned reads put straight into a contiguous CPU
    tensor of the stored dtype and shape (what a broadcast can fill): path below ``prefix`` ->
    size."""
    indirect = {need.label for need in loader.needs if need.scratch_bytes or need.done is not None}
    out: dict[str, int] = {}
    for path in {need.label for need in loader.needs} - indirect:
        entry, target = entries.get(path), loader.tensors.get(path)
        if (
            type(entry) is TensorEntry
            and entry.replicated
            and path.startswith(prefix)
            and isinstance(target, torch.Tensor)
            and target.is_cpu
            and target.is_contiguous()
            and target.nbytes == entry.nbytes
        ):
            out[path[len(prefix) :]] = target.nbytes
    return out


def decide(once: bool | None, path: str, hosts: list[str]) -> bool:
    """Whether replicated tensors are read once: ``once`` (the option) when set, else the
    library's choice for a snapshot at ``path`` and ranks on ``hosts``: unless ``path`` names a
    local directory (no URL scheme, ``fs://`` or ``file://``) and the ranks share one host."""
    if once is not None:
        return once
    return split_url(path)[0] not in ("fs", "file") or len(set(hosts)) > 1


def choice(options: Options, path: str) -> tuple[str, bool | None, str]:
    """This rank's part in ``plan``'s choice (gathered with the restore's checks)."""
    return (socket.gethostname(), options.read_replicated_once, path)


def plan(
    loader: Loader,
    entries: Mapping[str, Entry],
    prefix: str,
    coordinator: Coordinator,
    choices: Sequence[tuple[str, bool | None, str]],
) -> Shared | None:
    """Whether replicated tensors are read once, by every rank's ``choice`` (rank 0's option
    and path decide, with every rank's host); if so, agrees with the other ranks (a
    collective of every rank) on which rank reads each and drops this rank's reads of the
    others'. None when every rank reads them (then no rank walks its reads)."""
    if not decide(choices[0][1], choices[0][2], [c[0] for c in choices]):
        return None
    mine: dict[str, int] = {}
    failed: Exception | None = None
    try:
        loader.materialize()  # the choice below is made, and applied, need by need
        mine = candidates(loader, entries, prefix)
    except Exception as e:  # every rank must still reach the next collective
        failed = e
    offers = coordinator.agree("restore: shared tensors", value=mine, error=failed)
    common = dict(offers[0])
    for theirs in offers[1:]:
        common = {p: n for p, n in common.items() if theirs.get(p) == n}
    if not common:
        return None
    load = [0] * coordinator.world_size
    reader: dict[str, int] = {}
    for p, n in sorted(common.items(), key=lambda item: (-item[1], item[0])):
        rank = min(range(len(load)), key=load.__getitem__)
        reader[p] = rank
        load[rank] += n
    me = coordinator.rank
    cut = len(prefix)
    loader.needs = [
        need
        for need in loader.needs
        if reader.get(need.label[cut:], me) == me or not need.label.startswith(prefix)
    ]
    items = [(reader[p], prefix + p, loader.tensors[prefix + p]) for p in sorted(reader)]
    return Shared(items)


def receive(shared: Shared, coordinator: Coordinator) -> None:
    """Broadcasts each shared tensor from its reader into every other rank's target."""
    by_reader: dict[int, list[torch.Tensor]] = {}
    for src, _, target in shared.items:
        by_reader.setdefault(src, []).append(target)
    for src in sorted(by_reader):
        pack: list[torch.Tensor] = []
        size = 0
        for target in by_reader[src]:
            if target.nbytes >= PACK_BYTES:
                coordinator.broadcast(_bytes_of(target), src)
                continue
            if size + target.nbytes > PACK_BYTES:
                _broadcast_packed(pack, src, coordinator)
                pack, size = [], 0
            pack.append(target)
            size += target.nbytes
        if pack:
            _broadcast_packed(pack, src, coordinator)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's memory as a 1-d uint8 tensor (contiguous: checked by ``candidates``)."""
    return tensor.detach().reshape(-1).view(torch.uint8)


def _broadcast_packed(targets: list[torch.Tensor], src: int, coordinator: Coordinator) -> None:
    views = [_bytes_of(t) for t in targets]
    if coordinator.rank == src:
        coordinator.broadcast(torch.cat(views), src)
        return
    buf = torch.empty(sum(v.numel() for v in views), dtype=torch.uint8)
    coordinator.broadcast(buf, src)
    for view, part in zip(views, buf.split([v.numel() for v in views]), strict=True):
        view.copy_(part)
