"""The steps of a take, in order: capture, agreement across ranks, writing, the commit."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from manifest import Entry
from snapshot._engine import arguments, runtime
from snapshot._engine.arguments import check_app_state, ordered_keys, state_dict_of
from snapshot._engine.context import gc_paused, naming_snapshot
from snapshot._engine.dist import replication
from snapshot._engine.dist.dist import Coordinator
from snapshot._engine.dist.replication import Decision, Facts, Pending
from snapshot._engine.flatten import check_nesting, escape_key
from snapshot._engine.format.manifest_io import load_manifest
from snapshot._engine.handlers import sharded
from snapshot._engine.io import stage
from snapshot._engine.io.io_loop import join, run, spawn
from snapshot._engine.io.pipeline import IOStats, WritePipeline, plugin_location
from snapshot._engine.io.staging import StagingPool
from snapshot._engine.io.storage_calls import open_plugin
from snapshot._engine.take.commit import (
    begin,
    commit,
    manifest_bytes,
    remove_written,
)
from snapshot._engine.take.drafts import Layout, PrepareFunc
from snapshot._engine.take.incremental import Reuse, base_name
from snapshot._engine.take.placement import Placer, Recorder, assign_writers, place
from snapshot._engine.take.plan import TakePlan, collect
from snapshot.errors import (
    MissingBaseError,
    PathMismatchWarning,
    SnapshotError,
    SnapshotNotFoundError,
)
from snapshot.options import Options, resolve
from storage_plugins import StoragePlugin
from storage_plugins.registry import chunk_bytes_hint

logger = logging.getLogger("snapshot")


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

    Its tunables are ``options``, resolved once by the caller: the layout (chunk and slab sizes,
    checksums), the inline size of str and bytes values, the staging budget, and the write
    pipeline's concurrency and batches (and each storage call's retries and deadline).
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
        options: Options | None = None,
        strategies: dict[str, list[Any]] | None = None,
        base: str | None = None,
        user_metadata: Mapping[str, Any] | None = None,
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
        # The call's, resolved by the facade (from the environment when none is given).
        self.options = options if options is not None else resolve(None)
        # Which backend and version write each part (recorded in the manifest for restore).
        self.strategies = strategies
        # An incremental take's base (a sibling snapshot's path), and what it reused from it.
        self.base = base
        self.reuse: Reuse | None = None
        self.user_metadata = user_metadata
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
        # The pending marker's write, once this rank (rank 0) started it.
        self._marker_write: asyncio.Future[None] | None = None
        self._released = threading.Event()  # set once the caller handed every staged write over
        self._times: dict[str, float] = {}
        self._budget = 0  # bytes of staging this take may hold, fixed when it captures
        # How placed blobs are staged: through the pool's buffers when there is one.
        self._stager = stage.stager(pool)
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
            self._own, self._shared_paths = replication.settle(
                self.collected,
                self._recorder,
                decision.replicated,
                f"{coord.rank}/",
                layout,
                self._stager,
            )
            self._recorder = self._facts = None
        assert self._own is not None
        self.plan = place(
            self.collected,
            self._own,
            rank=coord.rank,
            layout=layout,
            writer_of=writers,
            stager=self._stager,
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
                self.where = plugin_location(self.plugin)
            if self.pipeline is None:
                self.pipeline = self._new_pipeline()
            for request in self.plan.writes[self.collected.submitted :]:
                self.pipeline.submit(request)
            # Async take: the copies of large tensors still running on the copier thread land
            # before the call returns (the caller may change its tensors then).
            self._stager.settle()
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
            (k, state_dict_of(k, self.app_state[k], self.path))
            for k in ordered_keys(self.app_state)
        ]
        with naming_snapshot(self.path):  # refused whole, before the marker or any blob
            for k, state in states:
                check_nesting(state, f"{coord.rank}/{escape_key(k)}")
        opts = self.options
        # One budget for the whole take. The pool's blocks (free, or lent to a pending
        # snapshot's writes, which give them back) are memory this take reuses, not memory it
        # takes. With a pool, the budget is the process's: pending snapshots share it
        # (``_new_pipeline``).
        self._budget = opts.budget(
            self.pool.free_bytes + self.pool.leased_bytes if self.pool is not None else 0
        )
        layout = Layout(
            chunk_bytes=opts.chunk(chunk_bytes_hint(self.path)),
            slab_threshold_bytes=opts.slab_threshold_bytes,
            # A slab is staged whole: keep it to a quarter of the budget.
            slab_bytes=max(1, min(opts.slab_bytes, self._budget // 4)),
            checksums=bool(opts.checksums),
            take_id=uuid.uuid4().hex[:8],
        )
        if self.base is not None or opts.digests:
            self.reuse = self._reuse()
        if coord.rank == 0:
            self.plugin = open_plugin(self.path, self.storage_options)
            self.where = plugin_location(self.plugin)
            self._marker_write = run(begin(self.plugin, self.where, opts))
        # A process alone places its own blobs while the state is planned, and has nothing to
        # agree on first: its writes start as soon as each blob is complete, so writing
        # overlaps planning. Across ranks the writes wait for the first agreement (rank 0's
        # path and layout, no snapshot there yet, and which leaves are one value for all
        # ranks), so the payloads are only recorded while planning, and placed after it.
        own: Placer | Recorder
        submit = None
        if coord.world_size == 1:
            own = self._own = Placer(f"{coord.rank}/", layout, mine=True, stager=self._stager)
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
                inline_max_bytes=opts.inline_max_bytes,
                own=own,
                submit=submit,
                reuse=self.reuse,
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
            facts = self._facts = replication.describe(self.collected, f"{coord.rank}/")
            info["marked"], info["prints"] = facts.marked, facts.prints
            info["own_bytes"] = self.collected.own_bytes
            t = time.perf_counter() - t
            logger.debug("take %s: %d values marked replicated, %d described in %.3f s",
                         self.path, len(facts.marked), len(facts.prints), t)  # fmt: skip
        return info

    def _reuse(self) -> Reuse:
        """What this take compares with its base (and records digests into): the base's
        manifest, read by every rank."""
        if self.base is None:
            return Reuse(None, None, self.coordinator.rank)
        name = base_name(self.path, self.base)
        t = time.perf_counter()
        try:
            base = load_manifest(self.base, self.storage_options, self.options)
        except SnapshotNotFoundError as e:
            raise MissingBaseError(
                f"cannot take {self.path} on base {self.base}: {e}", base=self.base
            ) from e
        logger.debug(
            "take %s: base %s read (%d entries) in %.3f s",
            self.path,
            self.base,
            len(base.entries),
            time.perf_counter() - t,
        )
        return Reuse(name, base, self.coordinator.rank)

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
                    f"{info['layout']} but rank 0 has {first['layout']}; give every rank the "
                    "same chunk, slab, checksum and memory budget options (Options, or "
                    "STATESNAP_CHUNK_BYTES / STATESNAP_SLAB_* / STATESNAP_CHECKSUMS / "
                    "STATESNAP_MEMORY_BUDGET_BYTES)"
                )
        if any(info["pieces"] for info in infos):
            sharded.check_coverage([info["pieces"] for info in infos])
        if any(info["objects"] for info in infos):
            sharded.check_objects([info["objects"] for info in infos])
        decision = replication.decide(first["path"], infos) if len(infos) > 1 else None
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
            digests = replication.joined(self._facts.sources, pending.to_confirm)
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
            max_concurrency=self.options.max_concurrent_io,
            # Async take holds its writes until everything is staged (``release_writes``
            # starts them): while the caller waits, they would only slow its copies down.
            batch_bytes=self.options.write_batch_bytes if self.pool is None else None,
            # Async take stages within the process's staging budget, shared with the
            # snapshots still pending: a second one waits for their writes to free blocks
            # instead of staging a budget of its own.
            budget=self.pool.share(self._budget) if self.pool is not None else None,
            options=self.options,
            settle=self._stager.settle,
        )
        # A take dropped before it finished (an async save's request never run) ends its
        # writes when collected, or at exit: its workers would otherwise wait for ever.
        dropped = SnapshotError(f"the take of {self.path} was dropped before it finished")
        weakref.finalize(self, pipeline.stop, dropped)
        return pipeline

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
        """On the caller's thread, after ``start`` (take: at its end; async take: the call's
        last step): the staged writes go to the I/O loop, async take's from the copier thread.
        Waking the loop from the caller's thread lets the GIL go (a socket write): the loop's
        thread ran the writes' start in Python while the caller, about to return, waited up to
        the switch interval. ``finish`` drains the pipeline once they are handed over."""
        if self.pipeline is None:
            self._released.set()
        elif self.pool is None:
            self._hand_over()
        else:
            try:
                runtime.get().copier().submit(self._hand_over)
            except RuntimeError:  # the interpreter is shutting down: no new threads' work
                self._hand_over()

    def _hand_over(self) -> None:
        assert self.pipeline is not None
        try:
            self.pipeline.flush()
        except Exception as e:  # a copy that failed (``settle``): ``finish`` reports it
            self.pipeline.abort(e)
            self._error = self._error or e
        finally:
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
        # Until the caller has handed over what it staged, the pipeline may not be drained.
        self._released.wait()
        error = self._error
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
                run(commit(self.plugin, data, self.options))
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
        return manifest_bytes(
            parts,
            world_size=self.coordinator.world_size,
            replicated_once=bool(self._shared_paths),
            strategies=self.strategies,
            user=self.user_metadata,
        )

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
        """After a failure: best effort removal of what this rank wrote, then storage closed."""
        if self.plugin is not None:
            blobs = self._written_blobs()
            run(remove_written(self.plugin, self.where, blobs, self._marker_write))

    def _written_blobs(self) -> list[str]:
        """The blobs this rank may have written so far."""
        if self.plan is not None:
            writes = self.plan.writes
        elif self._own is not None and self.pipeline is not None:
            # Failed while planning, with writes under way: what was placed so far.
            writes = self._own.writes
        else:  # nothing written yet (across ranks, writes wait for the first agreement)
            writes = []
        return [w.blob for w in writes]

    def _log(self, stats: IOStats, t_written: float, entries: int) -> None:
        t0 = self._times["start"]
        total = time.perf_counter() - t0
        if self.reuse is not None and self.base is not None:
            logger.info(
                "take %s (rank %d): %.1f MB of %.1f MB of tensors compared were unchanged since "
                "base %s and not written again",
                self.where,
                self.coordinator.rank,
                self.reuse.reused_bytes / 1e6,
                self.reuse.hashed_bytes / 1e6,
                self.base,
            )
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
