"""The steps of take, restore and read_object, in order; the Snapshot facade calls these."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

import manifest as mf
from manifest import (
    Entry,
    Manifest,
    ObjectEntry,
    PickledTensorEntry,
    PrimitiveEntry,
    ShardedObjectEntry,
    ShardedTensorEntry,
    TensorEntry,
)
from snapshot import knobs
from snapshot._engine import arguments, sharded, suggest
from snapshot._engine.claims import ClaimCheck
from snapshot._engine.commit import LISTED_NAMES, MANIFEST_NAME, PENDING_NAME, left_by_a_take
from snapshot._engine.context import gc_paused, naming_snapshot
from snapshot._engine.dist import Coordinator
from snapshot._engine.flatten import escape_key, flatten, inflate, subtree
from snapshot._engine.handlers.dense import is_dense_tensor
from snapshot._engine.landing import Landing
from snapshot._engine.planner import (
    Layout,
    Need,
    Placer,
    PrepareFunc,
    Recorder,
    ScratchPool,
    TakePlan,
    assign_writers,
    coalesce,
    collect,
    direct_read,
    needs_label,
    place,
    plan_object_read,
    plan_pickled_tensor_read,
    plan_sharded_read,
    plan_tensor_read,
    resolve_view,
)
from snapshot._engine.replication import Decision, Facts, Pending, decide, describe, joined, settle
from snapshot._engine.requests import ReadRequest
from snapshot._engine.restore_guard import (
    CHECK_PIECE_BYTES,
    RestoreProgress,
    ScratchKeeper,
    check_needs,
    locations_read,
)
from snapshot._engine.scheduler import (
    IOStats,
    WritePipeline,
    call,
    join,
    open_plugin,
    open_storage,
    read_all,
    read_unrecorded,
    refused,
    run,
    spawn,
)
from snapshot._engine.staging import StagingPool
from snapshot._engine.text import printable_message
from snapshot._engine.torchsnapshot_format import FOREIGN_MARKERS, open_foreign
from snapshot.errors import (
    ChecksumError,
    CorruptSnapshotError,
    EntryNotFoundError,
    IncompatibleSnapshotError,
    IncompleteSnapshotError,
    InvalidArgumentError,
    NotStatefulError,
    PathMismatchWarning,
    PathNotEmptyError,
    RankFailedError,
    SnapshotError,
    SnapshotExistsError,
    SnapshotNotFoundError,
    StatefulError,
    StateMismatchError,
    StorageError,
    UnsafeSnapshotError,
)
from snapshot.sharding.mapping import (
    LocalNonpersistentObject,
    ShardedTensorFactory,
    apply_factory_merges,
)
from snapshot.stateful import RNGState, Stateful
from snapshot.version import __version__
from storage_plugins import StoragePlugin, UnsafeBlobError
from storage_plugins.registry import chunk_bytes_hint

logger = logging.getLogger("snapshot")


def _ordered_keys(app_state: Mapping[str, Any]) -> list[str]:
    """app_state keys with RNGState values last, so capturing or restoring the other objects
    cannot move the generators after their state is taken or set."""
    keys = list(app_state)
    return [k for k in keys if not isinstance(app_state[k], RNGState)] + [
        k for k in keys if isinstance(app_state[k], RNGState)
    ]


def check_app_state(app_state: Any, path: str) -> None:
    """Refuses an app_state that is not a mapping of str -> Stateful; ``path`` is the snapshot's."""
    if not isinstance(app_state, Mapping):
        raise NotStatefulError(
            f"snapshot {path}: app_state must be a dict of name -> Stateful, "
            f"got {type(app_state).__name__}"
        )
    for key, value in app_state.items():
        if type(key) is not str:
            raise NotStatefulError(f"snapshot {path}: app_state key {key!r} is not a str")
        if not isinstance(value, Stateful):
            raise NotStatefulError(
                f"snapshot {path}: app_state[{key!r}] is a {type(value).__name__}, which has no "
                "state_dict() and load_state_dict(); wrap plain values in snapshot.StateDict"
            )


def _state_dict(key: str, value: Stateful, path: str) -> Any:
    try:
        return value.state_dict()
    except Exception as e:
        raise StatefulError(
            f"snapshot {path}: app_state[{key!r}].state_dict() raised {type(e).__name__}: {e}"
        ) from e


def _describe(plugin: StoragePlugin) -> str:
    return plugin.describe("").rstrip("/")


# ---------------------------------------------------------------------------------------------
# Take.


class TakeJob:
    """One take.

    ``start`` runs on the caller's thread: it captures every value (state_dict calls, planning,
    staging) and queues the writes (a take's writes start while it stages; in a process alone,
    while it plans). When it returns,
    later changes to the application's tensors cannot reach the snapshot if a staging ``pool``
    was given (async take: every payload is copied into pooled buffers, and the writes are held
    until ``release_writes``, unless the budget is full); otherwise the caller must not change
    them until the take is done.

    Then ``finish`` (on the caller's thread for take, on a background thread for async take)
    waits for the writes and commits the manifest.

    Across ranks, three agreement points carry each rank's outcome (``Coordinator.agree``):
    after capture (rank 0's path, existence check and layout; what every rank's leaves are, to
    decide which are one value for all ranks: ``replication``, whose BLAKE2b digests of the
    leaves whose CRCs matched are compared at one more point when there are any), after
    writing, and after rank 0's commit. A rank that fails still reaches the next point, so
    every rank raises the same error and none waits for a rank that will not come. Whatever
    fails, nothing is committed and each rank deletes what it wrote.
    """

    def __init__(
        self,
        path: str,
        app_state: Mapping[str, Any],
        *,
        coordinator: Coordinator,
        replicated: Sequence[str],
        storage_options: dict[str, Any] | None,
        prepare: PrepareFunc | None,
        pool: StagingPool | None,
        strategies: dict[str, list[Any]] | None = None,
    ) -> None:
        check_app_state(app_state, path)
        replicated = arguments.glob_list(replicated, "take", path)
        self.path = path
        self.app_state = app_state
        self.coordinator = coordinator
        # A module wrapped in DistributedDataParallel is the same on every rank.
        self.replicated = list(replicated) + [
            f"{escape_key(k)}/**"
            for k, v in app_state.items()
            if isinstance(v, torch.nn.parallel.DistributedDataParallel)
        ]
        self.storage_options = storage_options
        self.prepare = prepare
        self.pool = pool
        # Which backend and version write each part (recorded in the manifest for restore).
        self.strategies = strategies
        self.plugin: StoragePlugin | None = None
        self.where = path
        self.plan: TakePlan | None = None
        self._own: Placer | None = None  # places this rank's own payloads while planning
        # Across ranks, records them instead until the first agreement (``replication``).
        self._recorder: Recorder | None = None
        # The replicated leaves (paths with this rank's prefix), once agreed across ranks.
        self._shared_paths: list[str] = []
        self._facts: Facts | None = None  # what this rank said of its leaves, until agreed
        self.pipeline: WritePipeline | None = None
        self._error: BaseException | None = None  # met while staging, reported when agreeing
        self._marker = False  # whether this rank wrote the pending marker
        self._marker_write: asyncio.Future[None] | None = None
        self._released = threading.Event()  # set once the caller handed every staged write over
        self._times: dict[str, float] = {}
        self._budget = 0  # bytes of staging this take may hold, fixed when it captures
        self._abandoned = False  # ``_abandon`` ran

    # -- capture ----------------------------------------------------------------------------

    def start(self) -> None:
        with gc_paused():
            try:
                self._start()
            except Exception:
                raise  # each step that meets one stops the writes and cleans up itself
            except BaseException as e:
                # Ctrl-C or an exit while capturing or staging: no other rank hears of it (it
                # never reaches an agreement), but this rank's writes stop and their workers
                # end, and what it wrote is removed, before it goes on up.
                self._abandon(e)
                raise

    def _start(self) -> None:
        coord = self.coordinator
        t0 = self._times["start"] = time.perf_counter()
        info = error = None
        try:
            info = self._capture()
        except Exception as e:
            error = e
        try:
            infos = coord.agree("take", info, error)
            path, layout, pending = self._agree_layout(infos)
            decision = None if pending is None else self._confirm(pending)
        except BaseException as e:
            self._abandon(e)
            raise
        self._times["plan"] = time.perf_counter() - t0
        if decision is None:  # a process alone: its replicated payloads are its own to write
            writers = {(p.logical, p.index): 0 for p in self.collected.replicated}
        else:
            # Which leaves are one value is decided: mark them, place this rank's own payloads.
            assert self._recorder is not None
            writers = assign_writers(decision.signature, decision.local_bytes)
            self._own, self._shared_paths = settle(
                self.collected,
                self._recorder,
                decision.replicated,
                f"{coord.rank}/",
                layout,
                self.pool,
            )
            self._recorder = self._facts = None
        assert self._own is not None
        self.plan = place(
            self.collected,
            self._own,
            rank=coord.rank,
            layout=layout,
            writer_of=writers,
            pool=self.pool,
        )
        if coord.rank != 0:
            # The manifest lists a replicated leaf once, under rank 0's prefix (format 3;
            # ``Manifest.view`` shows it under every rank's): rank 0 gives its entry.
            drafts = self.plan.drafts
            for p in self._shared_paths:
                del drafts[p]
        try:
            if self.plugin is None:
                if not _same_location(self.path, path):
                    _warn_path_ignored(self.path, path, coord.rank)
                self.path = path  # rank 0's path wins
                self.plugin = open_plugin(path, self.storage_options)
                self.where = _describe(self.plugin)
            if self.pipeline is None:
                self.pipeline = self._new_pipeline()
            for request in self.plan.writes[self.collected.submitted :]:
                self.pipeline.submit(request)
            if self.pool is None:
                self.release_writes()
        except Exception as e:
            if self.pipeline is not None:
                self.pipeline.abort(e)
            if coord.world_size == 1:
                self._close_after_failure()
                raise
            self._error = e  # the others learn of it at the next agreement
            self._released.set()  # nothing left to hand over
        self._times["staged"] = time.perf_counter() - t0

    def _capture(self) -> dict[str, Any]:
        """This rank's part before the first agreement: state dicts, entries, payloads (across
        ranks, with what its leaves are: ``replication.describe``); on rank 0 also the
        existence checks and the pending marker."""
        coord = self.coordinator
        states = [
            (k, _state_dict(k, self.app_state[k], self.path)) for k in _ordered_keys(self.app_state)
        ]
        # One budget for the whole take. The pool's blocks (free, or lent to a pending
        # snapshot's writes, which give them back) are memory this take reuses, not memory it
        # takes. With a pool, the budget is the process's: pending snapshots share it
        # (``_new_pipeline``).
        self._budget = knobs.memory_budget_bytes(
            self.pool.free_bytes + self.pool.leased_bytes if self.pool is not None else 0
        )
        layout = Layout(
            chunk_bytes=knobs.chunk_bytes(chunk_bytes_hint(self.path)),
            slab_threshold_bytes=knobs.slab_threshold_bytes(),
            # A slab is staged whole: keep it to a quarter of the budget.
            slab_bytes=max(1, min(knobs.slab_bytes(), self._budget // 4)),
            checksums=knobs.checksums(),
        )
        if coord.rank == 0:
            self.plugin = open_plugin(self.path, self.storage_options)
            self.where = _describe(self.plugin)
            run(self._begin())
        # A process alone places its own blobs while the state is planned, and has nothing to
        # agree on first: its writes start as soon as each blob is complete, so writing
        # overlaps planning. Across ranks the writes wait for the first agreement (rank 0's
        # path and layout, no snapshot there yet, and which leaves are one value for all
        # ranks), so the payloads are only recorded while planning, and placed after it.
        own: Placer | Recorder
        submit = None
        if coord.world_size == 1:
            own = self._own = Placer(f"{coord.rank}/", layout, mine=True, pool=self.pool)
            self.pipeline = self._new_pipeline()
            submit = self.pipeline.submit
        else:
            own = self._recorder = Recorder(layout)
        with naming_snapshot(self.path):
            self.collected = collect(
                ((escape_key(k), sd) for k, sd in states),
                rank=coord.rank,
                prepare=self.prepare,
                replicated=self.replicated,
                inline_max_bytes=knobs.inline_max_bytes(),
                own=own,
                submit=submit,
            )
        info: dict[str, Any] = {
            "path": self.path,
            "layout": layout,
            "pieces": self.collected.pieces,
            "objects": self.collected.objects,
        }
        if coord.world_size > 1:
            # What each leaf is (and, for those no glob marked, a digest of its bytes): the
            # first agreement compares them across ranks (``replication.decide``).
            t = time.perf_counter()
            facts = self._facts = describe(self.collected, f"{coord.rank}/")
            info["marked"], info["prints"] = facts.marked, facts.prints
            info["own_bytes"] = self.collected.own_bytes
            logger.debug(
                "take %s: %d values marked replicated, %d described in %.3f s",
                self.path,
                len(facts.marked),
                len(facts.prints),
                time.perf_counter() - t,
            )
        return info

    def _agree_layout(self, infos: list[dict[str, Any]]) -> tuple[str, Layout, Pending | None]:
        """Rank 0's path and layout; across ranks, which leaves are replicated, pending the
        confirmation of those whose CRCs matched (None for a process alone). Every rank
        computes the same answer from the same gathered facts, so checks fail on all ranks
        alike."""
        first = infos[0]
        for rank, info in enumerate(infos[1:], start=1):
            if info["layout"] != first["layout"]:
                raise SnapshotError(
                    f"snapshot {first['path']}: rank {rank} has layout settings "
                    f"{info['layout']} but rank 0 has {first['layout']}; set the same "
                    "STATESNAP_CHUNK_BYTES / STATESNAP_SLAB_* / STATESNAP_CHECKSUMS / memory "
                    "budget on every rank"
                )
        if any(info["pieces"] for info in infos):
            sharded.check_coverage([info["pieces"] for info in infos])
        if any(info["objects"] for info in infos):
            sharded.check_objects([info["objects"] for info in infos])
        decision = decide(first["path"], infos) if len(infos) > 1 else None
        return first["path"], first["layout"], decision

    def _confirm(self, pending: Pending) -> Decision:
        """The leaves whose descriptions and CRCs matched on every rank, confirmed by their
        BLAKE2b (``replication``), exchanged at one more agreement. Every rank knows the same
        list, so all of them agree here, or none (nothing to confirm)."""
        if not pending.to_confirm:
            return pending.confirm(None)
        digests = error = None
        t = time.perf_counter()
        try:
            assert self._facts is not None
            digests = joined(self._facts.sources, pending.to_confirm)
        except Exception as e:
            error = e
        confirmed = self.coordinator.agree("take: digests", digests, error)
        logger.debug(
            "take %s: %d values' digests compared in %.3f s",
            self.path,
            len(pending.to_confirm),
            time.perf_counter() - t,
        )
        return pending.confirm(confirmed)

    def _new_pipeline(self) -> WritePipeline:
        assert self.plugin is not None
        pipeline = WritePipeline(
            self.plugin,
            budget_bytes=self._budget,
            max_concurrency=knobs.max_concurrent_io(),
            # Async take holds its writes until everything is staged (``release_writes``
            # starts them): while the caller waits, they would only slow its copies down.
            batch_bytes=knobs.write_batch_bytes() if self.pool is None else None,
            # Async take stages within the process's staging budget, shared with the
            # snapshots still pending: a second one waits for their writes to free blocks
            # instead of staging a budget of its own.
            budget=self.pool.share(self._budget) if self.pool is not None else None,
        )
        # A take dropped before it finished (an async save's request never run) ends its
        # writes when collected, or at exit: its workers would otherwise wait for ever.
        dropped = SnapshotError(f"the take of {self.path} was dropped before it finished")
        weakref.finalize(self, pipeline.stop, dropped)
        return pipeline

    async def _begin(self) -> None:
        plugin, where = self.plugin, self.where
        assert plugin is not None
        # Our manifest, and the files that mark another library's checkpoint (which statesnap
        # may read, but must never write into), asked about at once; and, at the same time,
        # the names the path holds (below).
        names = (MANIFEST_NAME, *FOREIGN_MARKERS)
        *found, listed = await asyncio.gather(
            *(call(plugin, "check", n, where, lambda n=n: plugin.exists(n)) for n in names),
            call(plugin, "list", "", where, lambda: plugin.list_names(LISTED_NAMES)),
        )
        if found[0]:
            raise SnapshotExistsError(
                f"{where} already holds a snapshot; take a new one at another path, "
                "or delete this one first"
            )
        for name, there in zip(names[1:], found[1:], strict=True):
            if there:
                raise SnapshotExistsError(
                    f"{where} holds {FOREIGN_MARKERS[name]} ({name}), which statesnap never "
                    "writes into; take the snapshot at another path"
                )
        # Nor into a directory (or prefix) holding files of its own: the snapshot's would mix
        # with them, and deleting the snapshot would take them along or leave it half there.
        # Missing, empty, or holding what an interrupted take left is fine. Only stores that
        # can list cheaply are checked (``StoragePlugin.list_names``: local disk, memory, S3).
        others = sorted(n for n in listed or () if not left_by_a_take(n))
        if others:
            shown = ", ".join(repr(n) for n in others[:5]) + (", ..." if len(others) > 5 else "")
            raise PathNotEmptyError(
                f"{where} is not empty: it holds {shown}, which no snapshot wrote; take the "
                "snapshot at a new or empty directory, or move those files away first"
            )
        marker = f"pid {os.getpid()} started {time.time():.3f}\n".encode()
        # Written in the background, alongside the blobs; the commit waits for it. On local
        # disk the write is fsync'd, and an fsync may wait for the file system's journal to
        # commit whatever else is pending (such as the deletion of an older snapshot): up to
        # a few hundred milliseconds that the caller need not wait for.
        self._marker_write = asyncio.ensure_future(
            call(plugin, "write", PENDING_NAME, where, lambda: plugin.write(PENDING_NAME, [marker]))
        )
        self._marker = True

    async def _marker_written(self) -> None:
        if self._marker_write is not None:
            await self._marker_write

    async def _writes_done(self, pipeline: WritePipeline) -> IOStats:
        """This rank's writes and its pending marker, done."""
        stats = await pipeline.wait()
        await self._marker_written()
        return stats

    # -- writing and commit -----------------------------------------------------------------

    def release_writes(self) -> None:
        """On the caller's thread, after ``start``: hands the staged writes to the I/O loop
        (take does it at the end of ``start``; async take as the last step of its call)."""
        if self.pipeline is not None:
            self.pipeline.flush()
        self._released.set()

    def finish(self, coordinator: Coordinator | None = None) -> bytes | None:
        """Waits for this rank's writes, agrees with the others, and commits (rank 0).

        ``coordinator`` is whom to agree with: by default the one of ``start``; async take
        passes one on a group of its own, so that this (on a background thread) never runs a
        collective on a group the caller's thread may be using.

        Returns the committed manifest's bytes on rank 0, None on the other ranks (which read
        it from storage when they need it).
        """
        coord = coordinator or self.coordinator
        assert self.plan is not None
        stats = None
        error = self._error
        # Until the caller has handed over what it staged, the pipeline may not be drained.
        self._released.wait()
        early = ready = None
        if error is None and self.pipeline is not None:
            writing = spawn(self._writes_done(self.pipeline))
            try:
                # Most entries need no CRC from a write (slab members were checksummed when
                # staged): they are made while the last writes and their fsyncs finish, and so
                # is the manifest of a process alone when that is all of them.
                with gc_paused():
                    early = self.plan.early_entries()
                    if coord.world_size == 1 and None not in early.values():
                        ready = self._manifest([early])
            except Exception as e:  # every rank learns of it at the next agreement
                early = ready = None
                error = e
            except BaseException:  # KeyboardInterrupt: stop waiting, as ``run`` does
                writing.cancel()
                raise
            try:
                stats = join(writing)
            except Exception as e:
                error = error or e
        elif self.pipeline is not None:
            run(self.pipeline.wait_quietly())
        t_written = time.perf_counter()
        if self.pool is not None:
            self.pool.trim()  # this take's blocks are back: unlock pinned memory it dropped
        checksums = self.pipeline.checksums if self.pipeline is not None else {}
        try:
            # Every rank's entries of a replicated value point at the blob one rank wrote: that
            # rank shares the checksums of what it wrote for the others.
            shared = self.plan.shared_checksums(checksums) if error is None else {}
            for part in coord.agree("take: writing", value=shared, error=error):
                checksums.update(part)
            with gc_paused():
                entries = self.plan.entries(checksums, early)
                del early
                parts = coord.gather(entries)
        except BaseException:
            self._close_after_failure()
            raise
        data = error = None
        count = len(entries)
        if parts is not None:  # rank 0: write the manifest of every rank's entries
            try:
                with gc_paused():
                    count, data = ready if ready is not None else self._manifest(parts)
                run(_commit(self.plugin, data))
            except Exception as e:
                error = e
        try:
            coord.agree("take: commit", error=error)
        except BaseException:
            self._close_after_failure()
            raise
        run(self.plugin.close())
        assert stats is not None
        self._log(stats, t_written, count)
        return data

    def _manifest(self, parts: Sequence[Mapping[str, Entry | str]]) -> tuple[int, bytes]:
        """The number of entries and the bytes of the manifest holding every rank's."""
        entries = sharded.merge_entries(parts)
        # Version 2 adds sharded entries; a manifest without any stays readable by version 1.
        kinds = set(map(type, entries.values()))
        with_shards = ShardedTensorEntry in kinds or ShardedObjectEntry in kinds
        metadata = {
            "library": f"statesnap {__version__}",
            "torch": str(torch.__version__),
            "created_unix": round(time.time(), 3),
            **({"strategies": self.strategies} if self.strategies else {}),
        }
        # Version 3 lists a replicated leaf once, under rank 0's prefix: a manifest of several
        # ranks with such leaves is one an older reader would misread (``mf.FORMAT_VERSION``).
        if self._shared_paths and self.coordinator.world_size > 1:
            version = mf.REPLICATED_ONCE_VERSION
        else:
            version = 2 if with_shards else 1
        # Version 4 adds what a tensor was beyond its values (a Parameter, requires_grad, a
        # view of another's storage); such entries are objects, never preformatted lines.
        if TensorEntry in kinds and any(
            e.has_attrs for e in entries.values() if type(e) is TensorEntry
        ):
            version = mf.TENSOR_ATTRS_VERSION
        data = mf.dumps_entries(version, self.coordinator.world_size, metadata, entries)
        return len(entries), data

    # -- failure ----------------------------------------------------------------------------

    def _abandon(self, error: BaseException) -> None:
        """Stops the writes started while capturing (their workers end) and removes what was
        written; once, whichever failure handler comes first."""
        if self._abandoned:
            return
        self._abandoned = True
        if self.pipeline is not None:
            self.pipeline.abort(error)
        self._close_after_failure()

    def _close_after_failure(self) -> None:
        if self.plugin is not None:
            run(self._cleanup())

    async def _cleanup(self) -> None:
        """After a failure: best effort removal of what this rank wrote, then storage closed."""
        plugin = self.plugin
        assert plugin is not None
        if self.plan is not None:
            writes = self.plan.writes
        elif self._own is not None and self.pipeline is not None:
            # Failed while planning, with writes under way: what was placed so far.
            writes = self._own.writes
        else:  # nothing written yet (across ranks, writes wait for the first agreement)
            writes = []
        blobs = [w.blob for w in writes]
        if self._marker:
            with contextlib.suppress(Exception):
                await self._marker_written()  # so that it cannot land after its deletion
            blobs.append(PENDING_NAME)
        failed: list[tuple[str, Exception]] = []
        try:
            # Each blob on its own: one that cannot be removed (a link on its way, which the
            # plugin refuses to follow) leaves the others, the marker too, to be removed.
            for blob in blobs:
                try:
                    await plugin.delete(blob)
                except (FileNotFoundError, NotADirectoryError):
                    pass  # never written
                except Exception as e:
                    failed.append((blob, e))
        finally:
            await plugin.close()
        if failed:
            blob, error = failed[0]
            logger.warning(
                "could not remove %d blob(s) of a failed take at %s; the first, %s: %s: %s",
                len(failed),
                self.where,
                blob,
                type(error).__name__,
                error,
            )

    def _log(self, stats: IOStats, t_written: float, entries: int) -> None:
        t0 = self._times["start"]
        total = time.perf_counter() - t0
        logger.info(
            "took snapshot %s (rank %d of %d): %d entries, %d blobs, %.1f MB in %.3f s (%.2f GB/s)",
            self.where,
            self.coordinator.rank,
            self.coordinator.world_size,
            entries,
            stats.blobs,
            stats.nbytes / 1e6,
            total,
            stats.nbytes / max(total, 1e-9) / 1e9,
        )
        logger.debug(
            "take %s phases: state_dict+plan %.3f s, staged by %.3f s, written by %.3f s "
            "(%.2f GB/s, peak staged %d B), committed by %.3f s",
            self.where,
            self._times["plan"],
            self._times["staged"],
            t_written - t0,
            stats.gbps,
            stats.peak_budget_bytes,
            total,
        )


def _same_location(a: str, b: str) -> bool:
    """Whether two spellings of a snapshot's path name one location: equal, or equal but for
    trailing slashes (and, for a local path, ``.`` and ``..`` parts)."""
    if a == b:
        return True
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.normpath(a) == os.path.normpath(b)


def _warn_path_ignored(own: str, used: str, rank: int) -> None:
    """Tells a rank's caller that its path was not used: the snapshot is at rank 0's, which
    the snapshot (or pending snapshot) the call returns names too."""
    warnings.warn(
        f"rank {rank} asked for a snapshot at {own!r}, but ranks of one process group take one "
        f"snapshot, at rank 0's path: it is written at {used!r}, and nothing at {own!r}",
        PathMismatchWarning,
        # Past this function, _start, start and the take (or async_take): the caller's line.
        stacklevel=5,
    )


async def _commit(plugin: StoragePlugin, manifest_bytes: bytes) -> None:
    """Makes the snapshot visible: blobs durable, then the manifest, then the manifest durable.

    Nothing before the manifest's write makes the snapshot visible; a crash at any point leaves
    either no manifest (an incomplete snapshot) or a complete one.
    """
    where = _describe(plugin)
    await call(plugin, "sync", "", where, plugin.sync)
    await call(
        plugin, "write", MANIFEST_NAME, where, lambda: plugin.write(MANIFEST_NAME, [manifest_bytes])
    )
    await call(plugin, "sync", "", where, plugin.sync)
    try:
        await plugin.delete(PENDING_NAME)
    except FileNotFoundError:
        pass
    except OSError:
        logger.warning("snapshot %s committed, but its pending marker could not be removed", where)


# ---------------------------------------------------------------------------------------------
# Opening a snapshot.


def load_manifest(path: str, storage_options: dict[str, Any] | None) -> Manifest:
    """Reads and decodes the committed manifest at ``path``."""
    t0 = time.perf_counter()
    with open_storage(path, storage_options) as plugin:
        where = _describe(plugin)

        async def fetch() -> bytes | None:
            try:
                return await read_unrecorded(plugin, MANIFEST_NAME, where)
            except (FileNotFoundError, NotADirectoryError):  # (the path is a file)
                exists = lambda: plugin.exists(PENDING_NAME)  # noqa: E731
                if await call(plugin, "check", PENDING_NAME, where, exists, convert=False):
                    raise IncompleteSnapshotError(
                        f"{where} holds an incomplete snapshot: a take started there but never "
                        "committed (it was interrupted or failed). Its blobs are not usable; "
                        "taking a new snapshot at this path replaces them."
                    ) from None
                return None

        try:
            data = run(fetch())
        except SnapshotError:
            raise
        except UnsafeBlobError as e:  # the pending marker, or a link on the way to it
            raise refused(where, e) from e
        except Exception as e:
            raise StorageError(f"cannot read the manifest of {where}: {e}") from e
        if data is None:
            # Another library's checkpoint: torchsnapshot's is translated (read-only), others
            # are refused with what to load them with.
            with gc_paused():
                foreign = open_foreign(plugin, where, path, storage_options)
            if foreign is None:
                raise SnapshotNotFoundError(f"no snapshot at {where} (no {MANIFEST_NAME} there)")
            logger.debug(
                "manifest of %s: %d entries translated from torchsnapshot's in %.3f s",
                where,
                len(foreign.entries),
                time.perf_counter() - t0,
            )
            return foreign
    t_read = time.perf_counter()
    manifest = decode_manifest(data, where)
    logger.debug(
        "manifest of %s: %d entries, %d bytes; read %.3f s, decoded %.3f s",
        where,
        len(manifest.entries),
        len(data),
        t_read - t0,
        time.perf_counter() - t_read,
    )
    return manifest


def decode_manifest(data: bytes, where: str) -> Manifest:
    """The manifest in ``data``, read from the snapshot ``where`` (or just written there)."""
    try:
        with gc_paused():
            return mf.loads(data, source=f"{where}/{MANIFEST_NAME}", verify=knobs.checksums())
    # The codec's messages quote the manifest's own text (keys, field values): escaped, like
    # every message that names what a snapshot holds.
    except mf.UnsupportedFormatError as e:
        raise IncompatibleSnapshotError(printable_message(str(e))) from None
    except mf.ManifestChecksumError as e:
        raise ChecksumError(f"{e} (STATESNAP_CHECKSUMS=0 reads it unchecked)") from None
    except mf.UnsafeManifestError as e:  # what the library never writes: aliases, tags, depth
        raise UnsafeSnapshotError(printable_message(str(e))) from None
    except mf.ManifestDecodeError as e:
        raise CorruptSnapshotError(printable_message(str(e))) from None


# ---------------------------------------------------------------------------------------------
# Reading.


class _Loader:
    """Collects the reads that rebuild a set of manifest entries, runs them, and inflates."""

    def __init__(
        self,
        manifest: Manifest,
        tile_bytes: int,
        where: str,
        entries: Mapping[str, Entry] | None = None,
        verify: bool | None = None,
        claims: ClaimCheck | None = None,
    ) -> None:
        self.manifest = manifest
        # What the reads that allocate memory of the size the manifest records claim, checked
        # against the store before the first of them is planned: the subtree being planned
        # (root, targets) until then.
        self.claims = claims
        self._unclaimed: tuple[str, Mapping[str, Any]] | None = None
        # The entries as the reading rank sees them (``Manifest.view``); all of them by default.
        self.entries = manifest.entries if entries is None else entries
        self.where = where
        self.tile_bytes = tile_bytes
        self.piece_bytes = knobs.read_request_bytes()
        # Whether reads check recorded CRC-32s: the knob's setting unless the caller decides.
        self.verify = knobs.checksums() if verify is None else verify
        self.needs: list[Need] = []
        self.tensors: dict[str, Any] = {}
        self.objects: dict[str, Any] = {}
        self.local: dict[str, Any] = {}  # LocalNonpersistentObject values, by path
        self.scratch = ScratchPool()  # for reads of sharded tensors through their gaps
        # The copies of scratch tiles into targets, and the device streams they run on
        # (made, and ordered after the caller's current streams, as targets are planned).
        self.landing = Landing()
        # Tensors read into no target share storage as torch.load's do: the new tensor of each
        # stored range, by what it holds (``_stored_key``: entries recording the same bytes
        # were one tensor when taken); what was made of them (a view, a Parameter, a tensor
        # requiring grad), each with the tensor it was made of (kept alive, its id being part
        # of the key); and the view entries waiting for every read to be planned
        # (``plan_views``).
        self.fresh: dict[tuple[Any, ...], torch.Tensor] = {}
        self.made: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        self.views: list[tuple[str, TensorEntry]] = []

    def add(self, path: str, target: Any = None) -> None:
        """Plans the read of leaf entry ``path``; a tensor ``target`` is filled in place."""
        with naming_snapshot(self.where):
            self._unclaimed = (path, {path: target})
            self._add(path, target)

    def _check_claims(self) -> None:
        """The claims of every read of the subtree being planned that allocates (``ClaimCheck``),
        checked at once. Run by the first read planned that may allocate (``_add``): reads
        into the caller's tensors, most of a restore, plan no allocation, and a subtree of only
        those is walked once."""
        unclaimed, self._unclaimed = self._unclaimed, None
        if unclaimed is not None and self.claims is not None:
            root, targets = unclaimed
            self.claims.check(self.entries, subtree(self.entries, root), targets)

    def _add(self, path: str, target: Any) -> None:
        if self._unclaimed is not None:
            self._check_claims()
        entry = self.entries[path]
        if isinstance(entry, TensorEntry):  # first: by far the most common
            if isinstance(target, LocalNonpersistentObject):
                self.local[path] = target.unwrap()
                return
            t = target if is_dense_tensor(target) else None
            if t is None and sharded.is_sharded(target):
                raise StateMismatchError(
                    f"{path}: the snapshot holds a whole tensor here, the object being restored "
                    "is a piece of a sharded one; restore it into a plain tensor, or take the "
                    "snapshot from sharded state"
                )
            self._add_tensor(path, entry, t)
        elif isinstance(target, LocalNonpersistentObject):
            self.local[path] = target.unwrap()  # this rank's own, never read from storage
        elif isinstance(entry, (ObjectEntry, ShardedObjectEntry)):
            self.needs.append(plan_object_read(path, entry, self.objects, verify=self.verify))
        elif isinstance(entry, PickledTensorEntry):  # torchsnapshot's torch.save'd tensors
            if sharded.is_sharded(target):
                raise StateMismatchError(
                    f"{path}: the snapshot holds a whole tensor here (pickled), the object being "
                    "restored is a piece of a sharded one; restore it into a plain tensor"
                )
            t = target if is_dense_tensor(target) else None
            self.needs.extend(
                plan_pickled_tensor_read(
                    path, entry, t, self.objects, verify=self.verify, landing=self.landing
                )
            )
        elif isinstance(entry, ShardedTensorEntry):
            read = plan_sharded_read(
                path,
                entry,
                target,
                self.piece_bytes,
                verify=self.verify,
                gap_bytes=knobs.read_gap_bytes(),
                box_bytes=min(self.tile_bytes, _BOX_BYTES),
                pool=self.scratch,
                tile_bytes=self.tile_bytes,
                landing=self.landing,
            )
            self.needs.extend(read.needs)
            self.tensors[path] = read.result

    def _add_tensor(self, path: str, entry: TensorEntry, target: torch.Tensor | None) -> None:
        if target is None:
            if entry.view is not None:
                self.views.append((path, entry))  # for ``plan_views``
                return
            tensor = self._new_tensor(path, entry)
            if entry.parameter or entry.requires_grad:
                tensor = self._loaded(path, entry, tensor)
            self.tensors[path] = tensor
            return
        need = direct_read(path, entry, target, self.piece_bytes, self.verify)
        if need is not None:  # most tensors: straight into the target, one need
            self.needs.append(need)
            self.tensors[path] = target
            return
        self._plan_tensor(path, entry, target)

    def _plan_tensor(self, path: str, entry: TensorEntry, target: torch.Tensor | None) -> None:
        self.tensors[path] = self._planned(path, entry, target)

    def _planned(self, path: str, entry: TensorEntry, target: torch.Tensor | None) -> torch.Tensor:
        """Plans the reads of ``entry`` into ``target`` (a new tensor when None); returns the
        tensor that holds the value once they ran."""
        read = plan_tensor_read(
            path,
            entry,
            target,
            self.tile_bytes,
            self.piece_bytes,
            verify=self.verify,
            landing=self.landing,
        )
        self.needs.extend(read.needs)
        return read.result

    def _new_tensor(self, path: str, entry: TensorEntry) -> torch.Tensor:
        """The new tensor that receives ``entry``'s bytes: the one planned already for an entry
        recording the same bytes (tied weights, written once), else one planned now."""
        key = _stored_key(entry)
        tensor = self.fresh.get(key) if key is not None else None
        if tensor is None:
            tensor = self._planned(path, entry, None)
            if key is not None:
                self.fresh[key] = tensor
        return tensor

    def plan_views(self) -> None:
        """Plans each view entry read into no target, once every other read is planned: a view
        of its base's new tensor when the base is read into one too (one storage, as
        ``torch.load`` gives), else a tensor of the view's own bytes (a view read alone reads
        no more than itself). Every view is checked (``resolve_view``) either way."""
        views, self.views = self.views, []
        with naming_snapshot(self.where):
            for path, entry in views:
                _, base = resolve_view(self.entries, path, entry)
                key = _stored_key(base)
                raw = self.fresh.get(key) if key is not None else None
                if raw is None:
                    value = self._new_tensor(path, entry)
                else:
                    value = self._as_view(raw, entry)
                if entry.parameter or entry.requires_grad:
                    value = self._loaded(path, entry, value)
                self.tensors[path] = value

    def _as_view(self, raw: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
        """``entry``'s view of ``raw``, its base's new tensor; one object for equal views."""
        view = entry.view
        assert view is not None
        key = (id(raw), entry.shape, view.offset, view.stride)
        made = self.made.get(key)
        if made is None:
            out = raw.as_strided(entry.shape, view.stride, raw.storage_offset() + view.offset)
            made = self.made[key] = (raw, out)
        return made[1]

    def _loaded(self, path: str, entry: TensorEntry, tensor: torch.Tensor) -> torch.Tensor:
        """What ``torch.load`` gives for ``entry``, recorded as an ``nn.Parameter`` or as
        requiring grad, holding ``tensor``'s values: a new object sharing its storage, one per
        kind, so that tied entries of one kind are one object."""
        parameter, requires_grad = entry.parameter, entry.requires_grad
        if requires_grad and not (tensor.is_floating_point() or tensor.is_complex()):
            raise CorruptSnapshotError(
                f"{path}: the manifest says this {entry.dtype} tensor requires grad, which only "
                "floating point and complex tensors can"
            )
        key = (id(tensor), parameter, requires_grad)
        made = self.made.get(key)
        if made is None:
            if parameter:
                out = torch.nn.Parameter(tensor, requires_grad=requires_grad)
            else:
                out = tensor.detach().requires_grad_()
            made = self.made[key] = (tensor, out)
        return made[1]

    def add_subtree(self, root: str, targets: Mapping[str, Any], owner: str | None = None) -> None:
        """Plans the reads of every leaf under ``root`` into ``targets`` (by path); the needs
        that land bytes in a target (the live state of app_state key ``owner``) are marked with
        ``owner`` (``Need.owner``)."""
        entries = self.entries
        needs, tensors = self.needs, self.tensors
        piece_bytes, verify = self.piece_bytes, self.verify
        with naming_snapshot(self.where):
            # Checked when the first read that allocates is planned (``_add``), if any.
            self._unclaimed = (root, targets)
            for p in subtree(entries, root):
                entry = entries.get(p)
                if entry is None:
                    raise CorruptSnapshotError(
                        f"{p}: listed by its parent but missing from the manifest"
                    )
                first = len(needs)
                if type(entry) is TensorEntry:
                    target = targets.get(p)
                    # ``_add_tensor`` inline for most leaves: read straight into the target.
                    need = direct_read(p, entry, target, piece_bytes, verify)
                    if need is not None:
                        need.owner = owner
                        needs.append(need)
                        tensors[p] = target
                        continue
                    if is_dense_tensor(target):  # no dispatch on kinds
                        self._plan_tensor(p, entry, target)
                    else:
                        self._add(p, target)
                elif not mf.is_container(entry):
                    self._add(p, targets.get(p))
                if owner is not None and _fills_target(entry, targets.get(p)):
                    for need in needs[first:]:
                        need.owner = owner

    def execute(
        self, plugin: StoragePlugin, budget_bytes: int, progress: RestoreProgress | None = None
    ) -> IOStats:
        """Runs the planned reads; ``progress`` records which app_state keys' targets they
        begin to write."""
        self.plan_views()
        with naming_snapshot(self.where):
            return self._execute(plugin, budget_bytes, self.needs, progress)

    def verify_first(self, plugin: StoragePlugin, budget_bytes: int) -> IOStats:
        """The first pass of a restore that checks before it writes: reads the needs that
        write no live state (objects, new tensors: decoded and checked as usual), and every
        stored range the other needs read, whole, against its recorded CRC-32 (into scratch,
        which is given back as each read is done). Leaves those other needs, which write into
        targets, for ``execute``; their ranges are then read a second time."""
        self.plan_views()
        private = [n for n in self.needs if n.owner is None]
        writing = [n for n in self.needs if n.owner is not None]
        concurrency = knobs.max_concurrent_io()
        piece = min(CHECK_PIECE_BYTES, self.tile_bytes)
        scratch = ScratchKeeper(max(0, budget_bytes - concurrency * self.tile_bytes))
        with naming_snapshot(self.where):
            checks = check_needs(locations_read(self.entries, writing), piece, scratch)
            stats = self._execute(plugin, budget_bytes, private + checks, None)
        self.needs = writing
        return stats

    def _execute(
        self,
        plugin: StoragePlugin,
        budget_bytes: int,
        needs: list[Need],
        progress: RestoreProgress | None,
    ) -> IOStats:
        try:
            return run(self._read(plugin, budget_bytes, needs, progress))
        finally:
            # On the caller's thread, after every read (also a failed one): waits for the
            # device copies still in flight, so the targets hold their bytes on return.
            self.landing.finish()

    async def _read(
        self,
        plugin: StoragePlugin,
        budget_bytes: int,
        needs: list[Need],
        progress: RestoreProgress | None,
    ) -> IOStats:
        concurrency = knobs.max_concurrent_io()
        # The reads hold up to one tile of scratch per worker, charged; the rest of the budget
        # bounds what the landing holds beside them: tiles kept for reuse, and pinned tiles
        # whose device copies are still in flight.
        self.landing.spare_bytes = max(0, budget_bytes - concurrency * self.tile_bytes)
        requests = coalesce(
            needs,
            max_gap_bytes=knobs.read_gap_bytes(),
            max_request_bytes=self.piece_bytes,
            max_scratch_bytes=self.tile_bytes,
        )
        if progress is not None:
            progress.watch(requests)
        stats = await read_all(
            plugin, requests, budget_bytes=budget_bytes, max_concurrency=concurrency
        )
        if self.verify:
            # After the reads: a store may learn sizes from them (an S3 ranged GET's answer
            # carries the object's length), and a blob cut short has failed its read already.
            await self._check_sizes(plugin, requests, concurrency)
        return stats

    async def _check_sizes(
        self, plugin: StoragePlugin, requests: Sequence[ReadRequest], concurrency: int
    ) -> None:
        """Each blob read must be as long as the manifest says: not shorter (cut), and not
        longer (bytes appended after the take, or a blob of another snapshot). Runs after the
        reads, one size query per blob."""
        by_blob: dict[str, list[ReadRequest]] = {}
        for req in requests:  # a few per blob, where there are thousands of needs
            by_blob.setdefault(req.blob, []).append(req)
        expected = self.manifest.blob_sizes
        blobs = iter(by_blob.items())

        async def worker() -> None:
            for blob, reqs in blobs:
                # The label of all the blob's needs (coalesce labelled each request's).
                label = reqs[0].label if len(reqs) == 1 else needs_label(_needs_of(reqs))
                size = await call(plugin, "read", blob, label, lambda b=blob: plugin.size(b))
                want = expected[blob]
                if size is not None and size != want:
                    how = "longer" if size > want else "shorter"
                    raise CorruptSnapshotError(
                        f"{label}: blob {plugin.describe(blob)} is {how} than the manifest says "
                        f"({size:,} bytes; the manifest's last range in it ends at {want:,})"
                    )

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(by_blob)))))

    def value(self, path: str, entry: Entry) -> Any:
        tensor = self.tensors.get(path)  # most leaves (a path is in one of these dicts at most)
        if tensor is not None:
            return tensor
        if path in self.local:
            return self.local[path]
        if isinstance(entry, PrimitiveEntry):
            return entry.value
        if isinstance(entry, (TensorEntry, ShardedTensorEntry)):
            return self.tensors[path]
        return self.objects[path]

    def inflate(self, root: str) -> Any:
        with naming_snapshot(self.where):
            return self._inflate(root)

    def _inflate(self, root: str) -> Any:
        try:
            return inflate(self.entries, root, self.value)
        except KeyError as e:
            raise CorruptSnapshotError(f"{root}: entry {e} is missing from the manifest") from None
        except RecursionError:
            raise CorruptSnapshotError(f"{root}: containers nested too deeply to rebuild") from None


def _stored_key(entry: TensorEntry) -> tuple[Any, ...] | None:
    """What identifies the bytes an entry records, for sharing one new tensor among the
    entries that record the same ones (None for an empty tensor: no bytes to share)."""
    chunks = entry.chunks
    if len(chunks) == 1:  # most tensors: the fields of the one range, not its record's hash
        c = chunks[0]
        return (entry.dtype, entry.shape, c.blob, c.offset, c.nbytes, c.crc32)
    return (entry.dtype, entry.shape, chunks) if chunks else None


def restore(
    manifest: Manifest,
    app_state: Mapping[str, Any],
    *,
    path: str,
    coordinator: Coordinator,
    storage_options: dict[str, Any] | None,
    strict: bool = True,
    verify_first: bool = False,
) -> None:
    """Loads each app_state value's entries in place, then calls its ``load_state_dict``.

    Each rank restores independently; the ranks then agree, so that when one fails every rank
    raises (naming it) rather than some carrying on with a half-restored group. ``strict`` and
    ``verify_first``: as ``Snapshot.restore`` says. The error a failed restore raises, of any
    kind, says which of this rank's app_state keys it modified (``RestoreProgress.account``).
    """
    progress = RestoreProgress(app_state)
    try:
        _restore_agreed(
            manifest,
            app_state,
            path,
            coordinator,
            storage_options,
            strict=strict,
            verify_first=verify_first,
            progress=progress,
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
    strict: bool,
    verify_first: bool,
    progress: RestoreProgress,
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
                strict=strict,
                verify_first=verify_first,
                progress=progress,
            )
    except RankFailedError:
        raise  # raised by an agreement inside, on every rank alike
    except Exception as e:
        error = e
    coordinator.agree("restore", error=error)


def _needs_of(requests: Sequence[ReadRequest]) -> Iterator[Need]:
    """The needs that some read requests serve (their other segments are skipped gaps)."""
    for req in requests:
        for seg in req.segments:
            if isinstance(seg, Need):
                yield seg


def _namespace(manifest: Manifest, rank: int) -> str:
    """The rank whose entries ``rank`` restores: its own, or rank 0's for a rank the snapshot
    did not have (a larger world), which may then use replicated entries only."""
    return f"{rank if rank < manifest.world_size else 0}/"


def _view(manifest: Manifest, rank: int) -> Mapping[str, Entry]:
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
    strict: bool = True,
    verify_first: bool = False,
    progress: RestoreProgress | None = None,
) -> None:
    check_app_state(app_state, path)
    t0 = time.perf_counter()
    entries = _view(manifest, coordinator.rank)
    rank_prefix = _namespace(manifest, coordinator.rank)
    keys = _ordered_keys(app_state)
    roots = {k: rank_prefix + escape_key(k) for k in keys}
    # A value's state_dict() and load_state_dict() may be collectives (FSDP's are): every rank
    # must call them, the same ones, even where this rank already knows the restore fails here.
    # So the checks' outcome waits until every rank has its state dicts, and the ranks agree on
    # it (and later on the reads') before any load_state_dict: a rank that fails never leaves
    # the others waiting in a collective of the application's.
    error: Exception | None = None
    try:
        keys = _restorable_keys(
            manifest, entries, keys, roots, rank_prefix, path, coordinator, strict
        )
    except SnapshotError as e:
        error = e
    states = {key: _state_dict(key, app_state[key], path) for key in keys}
    # Whether the ranks check before they write decides which agreements follow: it must be
    # the same everywhere, or the ranks' collectives would pair up wrongly.
    chosen = coordinator.agree("restore: checks", value=verify_first, error=error)
    if len(set(chosen)) > 1:
        raise InvalidArgumentError(
            f"snapshot {path}: the ranks passed different verify_first values "
            f"({dict(enumerate(chosen))}, by rank); pass the same on every rank"
        )
    budget = knobs.memory_budget_bytes()
    loader = _Loader(
        manifest,
        tile_bytes=_tile_bytes(budget),
        where=path,
        entries=entries,
        # Asked to check first, the restore checks every recorded CRC-32, whatever the knob.
        verify=knobs.checksums() or verify_first,
        claims=ClaimCheck(manifest, path, storage_options),
    )
    stats = None
    try:
        with_factories = set()
        for key in keys:
            targets, factories = _targets(states[key], roots[key])
            if factories:
                with_factories.add(key)
            if progress is not None:
                progress.targets[key] = targets
            loader.add_subtree(roots[key], targets, owner=key)
        t_plan = time.perf_counter()
        if verify_first:
            with open_storage(path, storage_options) as plugin:
                checked = loader.verify_first(plugin, budget)
            logger.debug(
                "restore %s: checked %.1f MB before writing any target in %.3f s",
                path,
                checked.nbytes / 1e6,
                time.perf_counter() - t_plan,
            )
    except Exception as e:
        error = e
    if verify_first:
        # No rank writes a target until every rank's bytes have passed their checks.
        coordinator.agree("restore: verifying", error=error)
    try:
        if error is None:
            with open_storage(path, storage_options) as plugin:
                stats = loader.execute(plugin, budget, progress)
    except Exception as e:
        error = e
    coordinator.agree("restore: reading", error=error)
    assert stats is not None
    t_read = time.perf_counter()
    for key in keys:
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
    rank_prefix: str,
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
            {p[len(rank_prefix) :].split("/", 1)[0] for p in entries if p.startswith(rank_prefix)}
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
    if rank_prefix != f"{coordinator.rank}/":
        for key in keys:
            own = _not_restorable_here(manifest, entries, roots[key], coordinator.rank)
            if own is None:
                continue
            logical = own[len(rank_prefix) :]
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


def _fills_target(entry: Entry, target: Any) -> bool:
    """Whether the reads of ``entry`` land in ``target`` itself (a tensor, or a piece of a
    sharded one, that the restored value's ``state_dict()`` returned), rather than in a new
    tensor or a decoded object that only ``load_state_dict`` hands over."""
    return isinstance(entry, (TensorEntry, PickledTensorEntry, ShardedTensorEntry)) and (
        is_dense_tensor(target) or sharded.is_sharded(target)
    )


def _targets(state: Any, root: str) -> tuple[dict[str, Any], bool]:
    """The leaves of a state to restore, by path (what a ``ShardedTensorFactory`` builds
    stands in for it), and whether there was a factory."""
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


# Scratch of one box of a sharded read (planner.plan_sharded_read): small enough to be in the
# CPU's cache when it is copied into place.
_BOX_BYTES = 4 << 20


def _tile_bytes(budget: int) -> int:
    # Two tiles per worker can be in flight; keep their sum within the budget.
    return max(1, budget // (2 * knobs.max_concurrent_io()))


def _check_obj_out(entry: Entry, obj_out: Any, logical_path: str, where: str) -> None:
    """Refuses a ``read_object`` target that is no tensor for a stored tensor, before any byte
    is read (the rest of what a target must be, the loader checks: shape, dtype, memory).
    Objects, primitives and containers are never loaded in place: their ``obj_out`` is
    ignored."""
    if not isinstance(entry, (TensorEntry, PickledTensorEntry, ShardedTensorEntry)):
        return
    if is_dense_tensor(obj_out) or sharded.is_sharded(obj_out):
        return
    raise StateMismatchError(
        f"snapshot {where}: {logical_path}: the snapshot holds a {entry.dtype}"
        f"{list(entry.shape)} tensor, which obj_out, a {_kind_of(obj_out)}, cannot receive in "
        "place; pass a dense tensor of that shape, or no obj_out"
    )


def _kind_of(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        layout = "nested" if value.is_nested else str(value.layout).removeprefix("torch.")
        quantized = " quantized" if value.is_quantized else ""
        return f"{type(value).__name__} ({layout}{quantized})"
    return type(value).__name__


def read_object(
    manifest: Manifest,
    logical_path: str,
    obj_out: Any,
    memory_budget_bytes: int | None,
    *,
    path: str,
    storage_options: dict[str, Any] | None,
) -> Any:
    """Reads the entry at ``logical_path`` (and everything below it, for a container).

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
    if obj_out is not None:
        _check_obj_out(entry, obj_out, logical_path, path)
    if memory_budget_bytes is not None and memory_budget_bytes < 1:
        raise InvalidArgumentError(
            f"snapshot {path}: memory_budget_bytes must be positive, got {memory_budget_bytes}"
        )
    budget = memory_budget_bytes or knobs.memory_budget_bytes()
    tile = memory_budget_bytes or _tile_bytes(budget)
    with gc_paused():
        claims = ClaimCheck(manifest, path, storage_options)
        loader = _Loader(manifest, tile_bytes=tile, where=path, entries=entries, claims=claims)
        loader.add_subtree(logical_path, {logical_path: obj_out})
        loader.plan_views()
        if loader.needs:
            with open_storage(path, storage_options) as plugin:
                loader.execute(plugin, budget)
        return loader.inflate(logical_path)
