"""The steps of a restore, in order, and ``read_object``; the Snapshot facade calls these.

A restore gets each app_state value's ``state_dict()``, plans the reads of its entries into the
tensors found there (``Loader``, through the handler of each entry's kind), agrees with the
other ranks that every rank's plan holds, runs the reads, agrees again, and hands each value
its restored state (``load_state_dict``). ``read_object`` plans and runs the reads of one
entry (or one container, whole) into new values, or into the caller's tensor.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

import torch

import manifest as mf
from manifest import Entry, Manifest, ShardedTensorEntry
from snapshot._engine.app_state import check_app_state, ordered_keys, state_dict_of
from snapshot._engine.context import gc_paused
from snapshot._engine.dist import shared_reads
from snapshot._engine.dist.dist import Coordinator
from snapshot._engine.flatten import (
    CONTAINER_TYPES,
    child_prefix,
    dict_names,
    escape_key,
    flatten,
    subtree,
)
from snapshot._engine.handlers import for_entry
from snapshot._engine.restore import read_ahead, suggest
from snapshot._engine.restore.claims import ClaimCheck
from snapshot._engine.restore.linked import open_linked
from snapshot._engine.restore.loader import PENDING, Loader, tile_bytes
from snapshot._engine.restore.read_ahead import ReadAhead
from snapshot._engine.restore.restore_guard import RestoreProgress
from snapshot.errors import (
    EntryNotFoundError,
    InvalidArgumentError,
    RankFailedError,
    SnapshotError,
    StatefulError,
    StateMismatchError,
)
from snapshot.options import Options
from snapshot.sharding.mapping import ShardedTensorFactory, apply_factory_merges

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
    ahead: ReadAhead | None = None,
) -> None:
    """Loads each app_state value's entries in place, then calls its ``load_state_dict``.

    Each rank restores independently; the ranks then agree, so that when one fails every rank
    raises (naming it) rather than some carrying on with a half-restored group. ``strict`` and
    ``verify_first``: as ``Snapshot.restore`` says; ``options``: the call's, resolved
    (``snapshot.options.resolve``). The error a failed restore raises, of any kind, says which
    of this rank's app_state keys it modified (``RestoreProgress.account``). ``ahead``: hints of
    what the restore reads, given since before the manifest was decoded (``read_ahead.early``);
    stopped when the reads begin, as the restore's own would be.
    """
    progress = RestoreProgress(app_state)
    try:
        _restore_agreed(
            manifest,
            app_state,
            path,
            coordinator,
            storage_options,
            options=options,
            strict=strict,
            verify_first=verify_first,
            progress=progress,
            ahead=ahead,
        )
    except BaseException as e:
        progress.account(e, coordinator.rank, coordinator.world_size)
        raise


def _restore_agreed(
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
    ahead: ReadAhead | None,
) -> None:
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
                ahead=ahead,
            )
    except RankFailedError:
        raise  # raised by an agreement inside, on every rank alike
    except Exception as e:
        error = e
    coordinator.agree("restore", error=error)


def rank_prefix(manifest: Manifest, rank: int) -> str:
    """The prefix of the entries ``rank`` restores: its own, or rank 0's for a rank the
    snapshot did not have (a larger world), which may then use replicated entries only."""
    return f"{rank if rank < manifest.world_size else 0}/"


def rank_view(manifest: Manifest, rank: int) -> Mapping[str, Entry]:
    """The entries ``rank`` restores from: with the replicated leaves the manifest lists once,
    under rank 0's prefix, under its own prefix too (``Manifest.view``)."""
    return manifest.view(rank if rank < manifest.world_size else 0)


def _not_restorable_here(
    manifest: Manifest, entries: Mapping[str, Entry], root: str, rank: int
) -> str | None:
    """For a rank the snapshot did not have, the first path under ``root`` (a key of rank 0's)
    that holds rank 0's own value, which that rank cannot use; None when every leaf there is
    one value for all ranks (replicated, or a sharded tensor's entry, which lists every
    shard)."""
    for p in subtree(entries, root):
        entry = entries.get(p)
        if (
            entry is not None
            and not entry.replicated
            and not mf.is_container(entry)
            and not isinstance(entry, ShardedTensorEntry)
        ):
            return p
    return None


def _restore(
    manifest: Manifest,
    app_state: Mapping[str, Any],
    path: str,
    coordinator: Coordinator,
    storage_options: dict[str, Any] | None,
    *,
    options: Options,
    strict: bool = True,
    verify_first: bool = False,
    progress: RestoreProgress | None = None,
    ahead: ReadAhead | None = None,
) -> None:
    check_app_state(app_state, path)
    t0 = time.perf_counter()
    entries = rank_view(manifest, coordinator.rank)
    prefix = rank_prefix(manifest, coordinator.rank)
    keys = ordered_keys(app_state)
    roots = {k: prefix + escape_key(k) for k in keys}
    # A value's state_dict() and load_state_dict() may be collectives (FSDP's are): every rank
    # must call them, the same ones, even where this rank already knows the restore fails here.
    # So the checks' outcome waits until every rank has its state dicts, and the ranks agree on
    # it (and later on the reads') before any load_state_dict: a rank that fails never leaves
    # the others waiting in a collective of the application's.
    error: Exception | None = None
    try:
        keys = _restorable_keys(manifest, entries, keys, roots, prefix, path, coordinator, strict)
    except SnapshotError as e:
        error = e
    states = {key: state_dict_of(key, app_state[key], path) for key in keys}
    # Whether the ranks check before they write decides which agreements follow: it must be
    # the same everywhere, or the ranks' collectives would pair up wrongly.
    chosen = coordinator.agree("restore: checks", value=verify_first, error=error)
    if len(set(chosen)) > 1:
        raise InvalidArgumentError(
            f"snapshot {path}: the ranks passed different verify_first values "
            f"({dict(enumerate(chosen))}, by rank); pass the same on every rank"
        )
    budget = options.budget()
    loader = Loader(
        manifest,
        options,
        tile_bytes=tile_bytes(budget, options),
        where=path,
        entries=entries,
        # Asked to check first, the restore checks every recorded CRC-32, whatever the options.
        verify=bool(options.checksums) or verify_first,
        claims=ClaimCheck(manifest, path, storage_options, options),
    )
    stats = None
    # The values of the keys whose leaves wait for no read, rebuilt while the reads run on
    # other threads (the caller's would only wait for them); the others after the reads.
    early: dict[str, Any] = {}

    def inflate_early() -> None:
        for key in keys:
            value = loader.inflate_ready(roots[key])
            if value is not PENDING:
                early[key] = value

    with contextlib.ExitStack() as stack:
        plugin = None
        try:
            plugin = stack.enter_context(open_linked(path, manifest, storage_options, options))
            # The device reads what the plan will ask for while the plan is made (and, with
            # ``ahead`` given, since before the manifest was decoded).
            walks: dict[str, list[str]] = {}  # each key's paths, where the read-ahead listed them
            if ahead is None and read_ahead.takes_hints(plugin):
                # In a group, replicated leaves are left out where one rank may read them for
                # all (``shared_reads``; its hosts are known only at its agreement).
                once = coordinator.world_size > 1 and shared_reads.decide(
                    options.read_replicated_once, path, []
                )
                try:
                    walks = {k: subtree(entries, roots[k]) for k in keys}  # the planning's too
                    spans = read_ahead.ranges(entries, walks.values(), once)
                except SnapshotError as e:
                    # A damaged manifest: the planning next reports it, naming the snapshot.
                    logger.debug("restore %s: no read-ahead: %s", path, e)
                    walks, spans = {}, []
                ahead = ReadAhead(plugin, spans)
                stack.callback(ahead.close)
            t_ahead = time.perf_counter()
            with_factories = set()
            for key in keys:
                targets, factories = _targets(states[key], roots[key])
                if factories:
                    with_factories.add(key)
                if progress is not None:
                    progress.targets[key] = targets
                loader.add_subtree(roots[key], targets, owner=key, paths=walks.get(key))
            t_plan = time.perf_counter()
            if ahead is not None:
                ahead.stop()
                logger.debug(
                    "restore %s: %.1f MB read ahead before the reads (planning %.3f s)",
                    path,
                    ahead.nbytes / 1e6,
                    t_plan - t_ahead,
                )
            if verify_first:
                checked = loader.verify_first(plugin, budget)
                logger.debug(
                    "restore %s: checked %.1f MB before writing any target in %.3f s",
                    path,
                    checked.nbytes / 1e6,
                    time.perf_counter() - t_plan,
                )
        except Exception as e:
            error = e
        # Replicated tensors read by one rank each and broadcast (a collective of every rank).
        shared = (
            shared_reads.plan(loader, entries, prefix, path, coordinator, options, error)
            if coordinator.world_size > 1
            else None
        )
        if verify_first:
            # No rank writes a target until every rank's bytes have passed their checks.
            coordinator.agree("restore: verifying", error=error)
        try:
            if error is None and plugin is not None:
                stats = loader.execute(plugin, budget, progress, meanwhile=inflate_early)
        except Exception as e:
            error = e
    coordinator.agree("restore: reading", error=error)
    assert stats is not None
    if shared is not None:
        if progress is not None:
            for _, leaf, _ in shared.items:
                for key, root in roots.items():
                    if leaf == root or leaf.startswith(root + "/"):
                        progress.wrote(key)
        shared_reads.receive(shared, coordinator)
        logger.debug(
            "restore %s: %.1f MB of replicated tensors read once and broadcast",
            path,
            shared.nbytes / 1e6,
        )
    t_read = time.perf_counter()
    for key in keys:
        value = early.pop(key, PENDING)
        if value is PENDING:
            value = loader.inflate(roots[key])
        if progress is not None:
            # From here the key's own code runs on its state: whatever it does before it
            # returns (or raises) counts as written.
            progress.loading(key)
        if key in with_factories:  # what they built goes back through their merge_fn
            value = apply_factory_merges(value, states[key])
        stateful = app_state[key]
        try:
            if not strict and isinstance(stateful, torch.nn.Module):
                # torchsnapshot's strict=False, for modules: their own check of parameter and
                # buffer names lets names missing on either side pass.
                stateful.load_state_dict(value, strict=False)
            else:
                stateful.load_state_dict(value)
        except Exception as e:
            raise StatefulError(
                f"snapshot {path}: app_state[{key!r}].load_state_dict() raised "
                f"{type(e).__name__}: {e}"
            ) from e
        if progress is not None:
            progress.loaded(key)
    t_end = time.perf_counter()
    logger.info(
        "restored %s from %s: %.1f MB in %.3f s (%.2f GB/s)",
        keys,
        path,
        stats.nbytes / 1e6,
        t_end - t0,
        stats.nbytes / max(t_end - t0, 1e-9) / 1e9,
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
    """The app_state keys this rank restores: all of them, less (``strict=False``) those the
    snapshot lacks.

    Raises:
        StateMismatchError: a key is missing (``strict``), or this rank, which the snapshot did
            not have, would need a value that differed between the ranks that took it.
    """
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
        for key in keys:
            own = _not_restorable_here(manifest, entries, roots[key], coordinator.rank)
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


def _targets(state: Any, root: str) -> tuple[dict[str, Any], bool]:
    """The leaves of a state to restore, by path (what a ``ShardedTensorFactory`` builds
    stands in for it), and whether there was a factory."""
    if type(state) is dict:
        # Most states: a dict of tensors, paths and values taken in C-level passes; the few
        # types among the values are asked about once each (``ShardedTensorFactory`` is an
        # ABC: an ``isinstance`` per value runs Python code).
        names = dict_names(state)
        values = list(state.values())
        kinds = set(map(type, values))
        if (
            names is not None
            and not kinds & CONTAINER_TYPES
            and not any(issubclass(kind, ShardedTensorFactory) for kind in kinds)
        ):
            return dict(zip(map(child_prefix(root).__add__, names), values, strict=True)), False
    targets: dict[str, Any] = {}
    factories = False
    for p, node, value in flatten(state, root):
        if node is not None:
            continue
        if isinstance(value, ShardedTensorFactory):
            factories = True
            for q, inner, built in flatten(value.build(), p):
                if inner is None:
                    targets[q] = built
        else:
            targets[p] = value
    return targets, factories


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
    """Reads the entry at ``logical_path`` (and everything below it, for a container), with
    ``options`` (the call's, resolved; None: the environment's, for callers with no options of
    their own, such as the command line).

    A path under any rank's prefix finds the replicated leaves the manifest lists once, under
    rank 0's (``"1/model/w"`` reads ``"0/model/w"`` when that is replicated)."""
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
        claims = ClaimCheck(manifest, path, storage_options, options)
        loader = Loader(manifest, options, tile, where=path, entries=entries, claims=claims)
        loader.add_subtree(logical_path, {logical_path: obj_out})
        loader.plan_deferred()
        if loader.planned:
            with open_linked(path, manifest, storage_options, options) as plugin:
                loader.execute(plugin, budget)
        return loader.inflate(logical_path)
