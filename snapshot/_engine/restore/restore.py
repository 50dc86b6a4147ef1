"""The steps of a restore, and ``read_object``; the Snapshot facade calls these.

A restore opens the snapshot's storage (``open_linked``), plans the reads of each app_state
value's entries into the tensors its ``state_dict()`` returned (``Loader.add_subtree``),
executes them (``Loader.execute``), and lands each value through its ``load_state_dict``; the
ranks agree after each step, so that a failure on one fails all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

import manifest as mf
from manifest import DictEntry, Entry, Manifest, ShardedTensorEntry
from snapshot._engine.dist import shared_reads
from snapshot._engine.dist.dist import Coordinator
from snapshot._engine.format.manifest_io import open_linked
from snapshot._engine.handlers import for_entry
from snapshot._engine.io.pipeline import ReadRequest
from snapshot._engine.restore import suggest
from snapshot._engine.restore.loader import Loader, tile_bytes
from snapshot._engine.runtime import gc_paused
from snapshot._engine.state_dicts import (
    CONTAINER_TYPES,
    check_app_state,
    child_prefix,
    dict_names,
    escape_key,
    flatten,
    ordered_keys,
    state_dict_of,
    subtree,
)
from snapshot.errors import (
    EntryNotFoundError,
    InvalidArgumentError,
    RankFailedError,
    SnapshotError,
    StatefulError,
    StateMismatchError,
)
from snapshot.options import Options
from snapshot.sharding.mapping import ShardedTensor, ShardedTensorFactory, apply_factory_merges

if TYPE_CHECKING:
    from snapshot._engine.progress import Reporter

logger = logging.getLogger("snapshot")


def restore(
    manifest: Manifest,
    app_state: Mapping[str, Any],
    *,
    path: str,
    coordinator: Coordinator,
    storage_options: dict[str, Any] | None,
    options: Options,
    strict: bool = True,
    verify_first: bool = False,
    reporter: Reporter | None = None,
) -> None:
    """Loads each app_state value's entries in place, then calls its ``load_state_dict``.

    The ranks agree at the end, so that when one fails every rank raises (naming it); the
    error says which of this rank's keys it modified (``RestoreProgress.account``).
    ``reporter`` is told the bytes of each read of the state as it lands (not the reads of
    ``verify_first``'s pass).
    """
    progress = RestoreProgress(app_state)
    try:
        error = None
        try:
            with gc_paused():
                _restore(
                    manifest,
                    app_state,
                    path,
                    coordinator,
                    storage_options,
                    options=options,
                    strict=strict,
                    verify_first=verify_first,
                    progress=progress,
                    reporter=reporter,
                )
        except RankFailedError:
            raise  # raised by an agreement inside, on every rank alike
        except Exception as e:
            error = e
        coordinator.agree_outcome("restore", error)
    except BaseException as e:
        progress.account(e, coordinator.rank, coordinator.world_size)
        raise


def rank_prefix(manifest: Manifest, rank: int) -> str:
    """The prefix ``rank`` restores: its own, or rank 0's for a rank the snapshot lacked."""
    return f"{rank if rank < manifest.world_size else 0}/"


def rank_view(manifest: Manifest, rank: int) -> Mapping[str, Entry]:
    """The entries ``rank`` restores from, replicated leaves under its prefix too."""
    return manifest.view(rank if rank < manifest.world_size else 0)


def _restore(
    manifest: Manifest,
    app_state: Mapping[str, Any],
    path: str,
    coordinator: Coordinator,
    storage_options: dict[str, Any] | None,
    *,
    options: Options,
    strict: bool,
    verify_first: bool,
    progress: RestoreProgress,
    reporter: Reporter | None = None,
) -> None:
    check_app_state(app_state, path)
    t0 = time.perf_counter()
    entries = rank_view(manifest, coordinator.rank)
    prefix = rank_prefix(manifest, coordinator.rank)
    keys = ordered_keys(app_state)
    roots = {k: prefix + escape_key(k) for k in keys}
    # A value's state_dict() and load_state_dict() may be collectives (FSDP's are): every rank
    # calls the same ones, even where it knows the restore fails here; so the ranks agree on
    # each step's outcome before any load_state_dict, and none is left waiting in one.
    error: Exception | None = None
    try:
        keys = _restorable_keys(manifest, entries, keys, roots, prefix, path, coordinator, strict)
    except SnapshotError as e:
        error = e
    states = {key: state_dict_of(key, app_state[key], path) for key in keys}
    planned: dict[str, tuple[dict[str, Any], bool]] = {}
    if error is None:
        try:
            planned = {key: _targets(states[key], roots[key]) for key in keys}
            if manifest.world_size != coordinator.world_size:
                # Before anything is read: a target's key that no saved rank holds fails here.
                targets = {key: planned[key][0] for key in keys}
                entries = _merged_view(
                    manifest, entries, prefix, targets, path, coordinator, strict
                )
        except Exception as e:
            error = e
    budget = options.budget()
    # Asked to check first, the restore checks every recorded CRC-32, whatever the options.
    verify = bool(options.checksums) or verify_first
    tile = tile_bytes(budget, options)
    loader = Loader(manifest, options, tile, path, storage_options, entries, verify)
    stats = None
    with_factories = set()
    with contextlib.ExitStack() as stack:
        plugin = None
        try:  # open, then plan
            if error is None:
                plugin = stack.enter_context(open_linked(path, manifest, storage_options, options))
                for key in keys:
                    targets, factories = planned[key]
                    if factories:
                        with_factories.add(key)
                    progress.targets[key] = targets
                    loader.add_subtree(roots[key], targets, owner=key)
        except Exception as e:
            error = e
        # Before any read: each rank's outcome, verify_first and part in the read-once choice.
        sharing = shared_reads.choice(options, path) if coordinator.world_size > 1 else None
        agreed = coordinator.agree("restore: checks", (verify_first, sharing), error)
        flags, choices = zip(*agreed, strict=True)
        if len(set(flags)) > 1:
            raise InvalidArgumentError(
                f"snapshot {path}: the ranks passed different verify_first values "
                f"({dict(enumerate(flags))}, by rank); pass the same on every rank"
            )
        assert plugin is not None  # opened: every rank's steps so far succeeded
        if verify_first:  # no rank writes a target until every rank's bytes passed their checks
            try:
                loader.verify_first(plugin, budget)
            except Exception as e:
                error = e
            coordinator.agree_outcome("restore: verifying", error)
        # Replicated tensors read by one rank each and broadcast (a collective of every rank).
        shared = None
        if coordinator.world_size > 1:
            shared = shared_reads.plan(loader, entries, prefix, coordinator, choices)
        t_plan = time.perf_counter()
        try:  # execute
            stats = loader.execute(plugin, budget, progress, reporter)
        except Exception as e:
            error = e
    coordinator.agree_outcome("restore: reading", error)
    t_read = time.perf_counter()
    assert stats is not None
    if shared is not None:
        for _, leaf, _ in shared.items:
            for key, root in roots.items():
                if leaf == root or leaf.startswith(root + "/"):
                    progress.wrote(key)
        shared_reads.receive(shared, coordinator)
    for key in keys:  # land: each value's own load_state_dict
        value = loader.inflate(roots[key])
        # From here the key's own code runs on its state: whatever it does counts as written.
        progress.wrote(key)
        if key in with_factories:  # what they built goes back through their merge_fn
            value = apply_factory_merges(value, states[key])
        stateful = app_state[key]
        try:
            if not strict and isinstance(stateful, torch.nn.Module):
                # torchsnapshot's strict=False, for modules: names missing on either side pass.
                stateful.load_state_dict(value, strict=False)
            else:
                stateful.load_state_dict(value)
        except Exception as e:
            raise StatefulError(
                f"snapshot {path}: app_state[{key!r}].load_state_dict() raised "
                f"{type(e).__name__}: {e}"
            ) from e
        progress.loaded(key)
    t_end = time.perf_counter()
    seconds = t_end - t0
    logger.info(
        "restored %s from %s: %.1f MB in %.3f s (%.2f GB/s)",
        keys,
        path,
        stats.nbytes / 1e6,
        seconds,
        stats.nbytes / max(seconds, 1e-9) / 1e9,
    )
    logger.debug(
        "restore %s phases: state_dict+plan %.3f s, read %.3f s (%d blobs, %.2f GB/s, peak "
        "scratch %d B), load_state_dict %.3f s",
        path,
        t_plan - t0,
        t_read - t_plan,
        stats.blobs,
        stats.gbps,
        stats.peak_budget_bytes,
        t_end - t_read,
    )


def _restorable_keys(
    manifest: Manifest,
    entries: Mapping[str, Entry],
    keys: list[str],
    roots: dict[str, str],
    prefix: str,
    path: str,
    coordinator: Coordinator,
    strict: bool,
) -> list[str]:
    """The app_state keys this rank restores: all, less (``strict=False``) those the snapshot
    lacks. ``StateMismatchError``: a key is missing (``strict``), or this rank, which the
    snapshot did not have, would need a value that differed between the ranks that took it."""
    missing = [k for k in keys if roots[k] not in entries]
    if missing:
        available = sorted(
            {p[len(prefix) :].split("/", 1)[0] for p in entries if p.startswith(prefix)}
        )
        if strict:
            raise StateMismatchError(
                f"snapshot {path} has no app_state key(s) {missing}; it holds {available}"
            )
        # Not strict: those values are neither read nor given to load_state_dict, so they keep
        # what they hold. A warning, since a misspelt key would otherwise pass unnoticed.
        logger.warning(
            "restore from %s (strict=False): no app_state key(s) %s there, left as they are; "
            "it holds %s",
            path,
            missing,
            available,
        )
        keys = [k for k in keys if k not in missing]
    if prefix != f"{coordinator.rank}/":
        # A rank the snapshot did not have can use only values that are one for all ranks:
        # replicated, a sharded tensor's entry (which lists every shard), or a leaf that no
        # saved rank but rank 0 holds (a pipeline stage's, say).
        cut = len(prefix)
        others = range(1, manifest.world_size)
        for key in keys:
            own = next(
                (
                    p
                    for p in subtree(entries, roots[key])
                    if not (p not in entries or entries[p].replicated)
                    and not mf.is_container(entries[p])
                    and not isinstance(entries[p], ShardedTensorEntry)
                    and any(f"{q}/{p[cut:]}" in manifest.entries for q in others)
                ),
                None,
            )
            if own is None:
                continue
            logical = own[len(prefix) :]
            raise StateMismatchError(
                f"snapshot {path}: app_state[{key!r}] cannot be restored on rank "
                f"{coordinator.rank}: the snapshot was taken on {manifest.world_size} ranks and "
                f"is restored on {coordinator.world_size}, and {logical!r} differed between "
                f"ranks when it was taken (each of ranks 0-{manifest.world_size - 1} has its own "
                f"value), so rank {coordinator.rank}, which the snapshot did not have, has none. "
                f"Restore on {manifest.world_size} ranks; or keep such values equal on every "
                "rank when taking (equal values are stored once, for any rank), or mark them "
                "with Snapshot.take(..., replicated=[...]); or read the value a given rank took "
                f"with Snapshot.read_object('<rank>/{logical}') and load it yourself"
            )
    return keys


def _merged_view(
    manifest: Manifest,
    entries: Mapping[str, Entry],
    prefix: str,
    targets: Mapping[str, Mapping[str, Any]],
    path: str,
    coordinator: Coordinator,
    strict: bool,
) -> Mapping[str, Entry]:
    """This rank's view (``entries``, under ``prefix``) with each target leaf it lacks taken
    from the saved rank that holds it, on a restore at another world size than the take's.

    A leaf is taken when exactly one saved rank holds it, or several hold one value (a
    replicated leaf, or a sharded tensor's entry, which lists every shard); it comes with
    the containers above it that this view lacks, each whole from that rank, and its name
    is added to the nearest dict above it that this view has (a list or tuple is never
    merged across ranks). ``StateMismatchError``, before anything is read: a leaf no saved
    rank holds (``strict``; else a warning, and the leaf is left as it is), or one that
    several hold with different values. The manifest's entries are never changed."""
    cut, saved, world = len(prefix), manifest.entries, manifest.world_size
    added: dict[str, Entry] = {}
    missing: dict[str, list[str]] = {}
    differing: dict[str, list[str]] = {}
    for key, leaves in targets.items():
        for p in [p for p in leaves if p not in entries]:
            if p in added:
                continue  # taken with a container above it
            parent, _, name = p.rpartition("/")
            while parent not in added and parent not in entries and "/" in parent:
                parent, _, name = parent.rpartition("/")
            above = added.get(parent) or entries.get(parent)
            if not isinstance(above, DictEntry):
                if above is None or mf.is_container(above):  # none, or a list or tuple
                    missing.setdefault(key, []).append(p[cut:])
                continue  # else inside a leaf saved whole (a dict stored as one object)
            logical = p[cut:]
            holders = [q for q in range(world) if f"{q}/{logical}" in saved]
            found = [saved[f"{q}/{logical}"] for q in holders]
            if not holders:
                missing.setdefault(key, []).append(logical)
                continue
            if len(holders) > 1 and not (
                all(e.replicated for e in found)
                or all(isinstance(e, ShardedTensorEntry) for e in found)
            ):
                differing.setdefault(key, []).append(logical)
                continue
            source = manifest.view(holders[0])
            top = f"{parent}/{name}"
            there = f"{holders[0]}/"
            for sp in subtree(source, there + top[cut:]):
                added[prefix + sp[len(there) :]] = source[sp]
            theirs = source.get(there + parent[cut:])
            real = next((k for k in getattr(theirs, "keys", ()) if escape_key(k) == name), name)
            added[parent] = dataclasses.replace(above, keys=(*above.keys, real))
    where = (
        f"snapshot {path}: taken on {world} ranks and restored on {coordinator.world_size}, "
        f"rank {coordinator.rank}"
    )
    if differing:
        raise StateMismatchError(
            f"{where}: its own saved state lacks these keys of the state_dict(), and several "
            f"saved ranks hold different values for each, so none can be chosen: "
            f"{_listed(differing)}; restore on "
            f"{world} ranks, or read the value a given rank took with "
            "Snapshot.read_object('<rank>/<path>') and load it yourself"
        )
    if missing:
        problem = (
            f"{where}: no saved rank holds these keys of the state_dict(): "
            f"{_listed(missing)} (searched the saved states of ranks 0-{world - 1}; a key "
            "this rank's own saved state lacks is taken from the one rank that holds it, but "
            "a list or tuple is never merged across ranks)"
        )
        if strict:
            raise StateMismatchError(
                f"{problem}; nothing was modified. Restore on {world} ranks, or pass "
                "strict=False to leave those as they are"
            )
        logger.warning("%s (strict=False): left as they are", problem)
    return {**entries, **added} if added else entries


def _listed(paths: Mapping[str, list[str]]) -> str:
    """Paths by app_state key, the first few of each, for a message."""
    return "; ".join(
        f"app_state[{key!r}]: {len(ps)} key(s), {', '.join(map(repr, ps[:8]))}"
        + (f" and {len(ps) - 8} more" if len(ps) > 8 else "")
        for key, ps in paths.items()
    )


def _targets(state: Any, root: str) -> tuple[dict[str, Any], bool]:
    """A state's leaves by path (a factory's built ones for it), and whether any was one."""
    names = dict_names(state) if type(state) is dict else None
    if names is not None and CONTAINER_TYPES.isdisjoint(map(type, state.values())):
        # A dict of leaves (most states), without a step per leaf.
        leaves = dict(zip(map(child_prefix(root).__add__, names), state.values(), strict=True))
    else:
        leaves = {p: value for p, node, value in flatten(state, root) if node is None}
    # A factory is found by its type (an isinstance check of the ABC per leaf costs more).
    if not any(issubclass(t, ShardedTensorFactory) for t in set(map(type, leaves.values()))):
        return leaves, False
    targets: dict[str, Any] = {}
    for p, value in leaves.items():
        if isinstance(value, ShardedTensorFactory):
            for q, inner, built in flatten(value.build(), p):
                if inner is None:
                    targets[q] = built
        else:
            targets[p] = value
    return targets, True


# ---------------------------------------------------------------------------------------------
# What a failed restore did to the live state: a key is written once a read into its targets
# (usually the object's own memory) starts, or its ``load_state_dict`` is called; a key whose
# targets share memory with a written key's (a tied weight) counts as written too.

PARTIALLY = "partially"
FULLY = "fully"


class RestoreProgress:
    """Per app_state key, whether the restore has begun to write its live state; the account a
    failed restore's error carries (``SnapshotError.modified`` / ``untouched``)."""

    def __init__(self, app_state: Any) -> None:
        # A non-mapping app_state is refused before anything is read: there are no keys.
        self.keys: list[str] = list(app_state) if isinstance(app_state, Mapping) else []
        self.written: dict[str, str] = {}
        self.targets: dict[str, Mapping[str, Any]] = {}  # each key's targets, once planned

    def wrote(self, key: str) -> None:
        """``key``'s state may change from now on (a read into it, or its load_state_dict)."""
        self.written.setdefault(key, PARTIALLY)

    def loaded(self, key: str) -> None:
        """``key``'s ``load_state_dict`` returned: it holds the snapshot's state."""
        self.written[key] = FULLY

    def watch(self, requests: Sequence[ReadRequest]) -> None:
        """Makes each request that writes into targets mark their keys when it starts: its
        first segment's ``dest`` (a need: a request never starts with a gap) marks them."""
        for req in requests:
            owners = {seg.owner for seg in req.segments if seg.owner is not None}
            if owners:
                first = req.segments[0]
                assert first.dest is not None
                first.dest = functools.partial(self._starting, tuple(owners), first.dest)

    def _starting(self, keys: tuple[str, ...], dest: Callable[[], memoryview]) -> memoryview:
        for key in keys:
            self.wrote(key)
        return dest()

    def account(self, error: BaseException, rank: int, world_size: int) -> None:
        """Sets the account on ``error``: ``modified``, ``untouched`` and the sentence its
        message ends with on a ``SnapshotError``; that sentence as a note on any other."""
        if not self.keys:
            return
        written = self._with_shared_memory()
        modified = {k: written[k] for k in self.keys if k in written}
        untouched = tuple(k for k in self.keys if k not in written)
        where = f" on rank {rank}" if world_size > 1 else ""
        changed = ", ".join(f"{k!r} ({how})" for k, how in modified.items()) or "none"
        left = ", ".join(map(repr, untouched)) or "none"
        sentence = (
            f"app_state keys modified{where} before the failure: {changed}; untouched: {left}"
        )
        if isinstance(error, SnapshotError):
            error.modified = modified
            error.untouched = untouched
            error.restore_account = sentence
        else:
            error.add_note(sentence)

    def _with_shared_memory(self) -> dict[str, str]:
        """``written``, with each key whose targets share a storage with a written key's
        marked as partially written."""
        written = dict(self.written)
        if not written or len(written) == len(self.keys):
            return written
        memory = {k: _storages(t.values()) for k, t in self.targets.items()}
        reached = set().union(*(memory.get(k, set()) for k in written))
        for key, storages in memory.items():
            if key not in written and not storages.isdisjoint(reached):
                written[key] = PARTIALLY
        return written


def _storages(values: Iterable[Any]) -> set[tuple[str, int]]:
    """The storages (device, address) that the tensors among ``values`` view (for a piece of
    a sharded tensor or a DTensor, its local data's)."""
    found: set[tuple[str, int]] = set()
    for value in values:
        if isinstance(value, ShardedTensor):
            tensors = [] if value.data is None else [value.data]
        elif callable(getattr(value, "local_shards", None)):  # torch's ShardedTensor
            tensors = [shard.tensor for shard in value.local_shards()]
        elif callable(getattr(value, "to_local", None)):  # a DTensor
            tensors = [value.to_local()]
        else:
            tensors = [value] if isinstance(value, torch.Tensor) else []
        for t in tensors:
            try:
                address = t.untyped_storage().data_ptr()
            except (RuntimeError, NotImplementedError):  # no storage (a meta or fake tensor)
                continue
            if address:
                found.add((str(t.device), address))
    return found


# ---------------------------------------------------------------------------------------------
# read_object.


def read_object(
    manifest: Manifest,
    logical_path: str,
    obj_out: Any,
    memory_budget_bytes: int | None,
    *,
    path: str,
    storage_options: dict[str, Any] | None,
    options: Options | None = None,
) -> Any:
    """Reads the entry at ``logical_path`` (and all below it), with ``options`` (None: the
    environment's). A path under any rank's prefix finds the replicated leaves the manifest
    lists once, under rank 0's (``"1/model/w"`` reads a replicated ``"0/model/w"``)."""
    entries: Mapping[str, Entry] = manifest.entries
    head = logical_path.split("/", 1)[0]
    if head.isdigit() and 0 < int(head) < manifest.world_size:
        entries = manifest.view(int(head))
    entry = entries.get(logical_path)
    if entry is None:
        close = suggest.close_matches(logical_path, entries, n=3)
        hint = f"; did you mean {close}?" if close else "; see get_manifest() for the paths"
        raise EntryNotFoundError(f"snapshot {path} has no entry {logical_path!r}{hint}")
    kind = for_entry(entry)
    if obj_out is not None and kind is not None:  # refused before any byte is read
        kind.check_target(f"snapshot {path}: {logical_path}", entry, obj_out)
    if memory_budget_bytes is not None and memory_budget_bytes < 1:
        raise InvalidArgumentError(
            f"snapshot {path}: memory_budget_bytes must be positive, got {memory_budget_bytes}"
        )
    if options is None:
        options = Options.from_env()
    budget = memory_budget_bytes or options.budget()
    tile = memory_budget_bytes or tile_bytes(budget, options)
    with gc_paused():
        loader = Loader(manifest, options, tile, path, storage_options, entries)
        loader.add_subtree(logical_path, {logical_path: obj_out})
        loader.plan_deferred()
        if loader.needs:
            with open_linked(path, manifest, storage_options, options) as plugin:
                loader.execute(plugin, budget)
        return loader.inflate(logical_path)
