"""A take, step by step: capture the state, plan it (``plan``: no I/O), agree across ranks,
execute the plan's writes (``pipeline.WritePipeline``), and commit (the storage side in
``commit``): rank 0 writes a pending marker before the first blob and the manifest last, once
every rank wrote and every blob is durable; a failed take removes what it wrote."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

import manifest as mf
from snapshot._engine import state_dicts
from snapshot._engine.dist import replication
from snapshot._engine.dist.dist import Coordinator, describe
from snapshot._engine.dist.replication import Decision, Facts, Pending
from snapshot._engine.handlers import sharded
from snapshot._engine.handlers.table import Layout, Made, PrepareFunc, merge_entries
from snapshot._engine.io.pipeline import IOStats, WritePipeline, plugin_location
from snapshot._engine.io.staging import StagingPool
from snapshot._engine.io.storage_calls import call, make_plugin, open_plugin
from snapshot._engine.runtime import gc_paused, naming_snapshot, run
from snapshot._engine.state_dicts import (
    check_app_state,
    check_nesting,
    escape_key,
    ordered_keys,
    state_dict_of,
)
from snapshot._engine.take.commit import begin, commit, not_committed, remove_written
from snapshot._engine.take.incremental import Reuse
from snapshot._engine.take.plan import TakePlan, collect, format_version, place
from snapshot.errors import (
    PathMismatchWarning,
    RankFailedError,
    SnapshotError,
    SnapshotExistsError,
)
from snapshot.options import Options
from snapshot.version import __version__
from storage_plugins import StoragePlugin
from storage_plugins.registry import chunk_bytes_hint

if TYPE_CHECKING:
    from snapshot._engine.progress import Reporter

logger = logging.getLogger("snapshot")


def _int(value: int | None) -> int:  # a field of resolved ``Options``: never None
    assert value is not None
    return value


class TakeJob:
    """One take. ``start``, on the caller's thread, captures and plans the state and executes
    the plan's writes (staged on this thread, written on the I/O loop). With a staging ``pool``
    (async take) every payload is copied into pooled buffers, and the writes are held until
    ``release_writes``; without one the caller must not change its tensors until the take is
    done. ``finish`` (a background thread's, for async take) waits for the writes and commits.

    Across ranks, each rank's outcome is carried to the others: after capture by agreements
    (``Coordinator.agree``: rank 0's path and layout; which leaves are one value for all ranks,
    ``replication``); after writing by one gather to rank 0, which commits only if every rank
    wrote, and one broadcast of its verdict. A rank that fails still takes part, so every rank
    raises the same error; nothing is committed and each rank deletes what it wrote."""

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
        options: Options,
        strategies: dict[str, list[Any]] | None = None,
        base: str | None = None,
        user_metadata: Mapping[str, Any] | None = None,
        progress: Reporter | None = None,
    ) -> None:
        check_app_state(app_state, path)
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
        self.options = options
        self.strategies = strategies  # the backend and version that write each part
        self.base = base  # an incremental take's base (a sibling snapshot's path)
        self.reuse: Reuse | None = None
        self.user_metadata = user_metadata
        self.progress = progress  # reports each blob written (``progress=`` of the call)
        self.plugin: StoragePlugin | None = None
        self.where = path
        self.plan: TakePlan | None = None
        self.pipeline: WritePipeline | None = None
        self._shared_paths: list[str] = []  # the replicated leaves, once agreed across ranks
        self._facts: Facts | None = None  # what this rank said of its leaves, until agreed
        self._copies: Pending | None = None  # the boxes several ranks hold copies of
        self._copy_crcs = b""  # the CRC-32s of this rank's copies, checked after writing
        self._error: BaseException | None = None  # met while staging, reported when agreeing
        self._marker_write: asyncio.Future[None] | None = None  # rank 0's pending marker
        self._released = threading.Event()  # set once the caller handed every staged write over
        self._times: dict[str, float] = {}  # when it started; then each step's seconds
        self._budget = 0  # bytes of staging this take may hold, fixed when it captures
        # Rank 0's commit: the manifest, whether its write began (the path may hold it), and
        # the error that stopped it.
        self._data: bytes | None = None
        self._landed = False
        self._failure: BaseException | None = None
        self.held = False  # set before ``start``: the writes are staged by ``stage_held``

    # -- capture, plan, execute ---------------------------------------------------------------

    def start(self) -> None:
        with gc_paused():
            try:
                self._start()
            except Exception:
                raise  # each step that meets one stops the writes and cleans up itself
            except BaseException as e:
                self._abandon(e)  # Ctrl-C or an exit: this rank's writes stop and go
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
            path, layout, decision = self._agree(coord.agree("take", info, error))
        except Exception as e:
            self._abandon(e)
            raise
        self._times["plan"] = time.perf_counter() - t0
        own = None
        if decision is None:  # a process alone: its replicated payloads are its own to write
            writers = {(p.logical, p.index): 0 for p in self.collected.replicated}
        else:
            writers = replication.assign_writers(decision.signature, decision.local_bytes)
            own, self._shared_paths = replication.settle(
                self.collected, decision, f"{coord.rank}/", layout, self.pool
            )
            self._facts = None
        self.plan = place(
            self.collected, rank=coord.rank, layout=layout, writer_of=writers,
            stager=self.pool, own=own,
        )  # fmt: skip
        if coord.rank != 0:
            # The manifest lists a replicated leaf once, under rank 0's prefix: rank 0 gives it.
            for p in self._shared_paths:
                del self.collected.entries[p]
        try:
            if self.plugin is None:
                if not state_dicts.same_location(self.path, path):
                    warnings.warn(
                        f"rank {coord.rank} asked for a snapshot at {self.path!r}, but ranks of "
                        "one process group take one snapshot, at rank 0's path: it is written "
                        f"at {path!r}, and nothing at {self.path!r}",
                        PathMismatchWarning,
                        stacklevel=5,  # past _start, start, snapshot._start, take: the caller
                    )
                self.path = path  # rank 0's path wins
                self.plugin = open_plugin(path, self.storage_options)
                self.where = plugin_location(self.plugin)
            plugin = self.plugin
            if self.progress is not None:
                plugin = self.progress.counting(plugin, self.plan.writes, self.where)
            self.pipeline = WritePipeline(
                plugin,
                budget_bytes=self._budget,
                max_concurrency=_int(self.options.max_concurrent_io),
                # Async take holds its writes until everything is staged (``release_writes``),
                # and stages within the process's budget, shared with the snapshots pending.
                batch_bytes=self.options.write_batch_bytes if self.pool is None else None,
                budget=self.pool.share(self._budget) if self.pool is not None else None,
                options=self.options,
            )
            dropped = SnapshotError(f"the take of {self.path} was dropped before it finished")
            weakref.finalize(self, self.pipeline.stop, dropped)  # its writes end with the job
            for request in () if self.held else self.plan.writes:
                self.pipeline.submit(request)
            if self.pool is None:
                self.release_writes()
            elif not self.held:  # async take: the call returns once every copy has landed
                self.pipeline.ready()
        except Exception as e:
            if coord.world_size == 1:
                self._abandon(e)
                raise
            if self.pipeline is not None:
                self.pipeline.abort(e)
            self._error = e  # the others learn of it at the next agreement
            self._released.set()  # nothing left to hand over
        self._times["staged"] = time.perf_counter() - t0

    def _capture(self) -> dict[str, Any]:
        """This rank's part before the first agreement: its state dicts collected (and described
        across ranks: ``replication.describe``); on rank 0, ``begin``."""
        coord = self.coordinator
        states = [
            (k, state_dict_of(k, self.app_state[k], self.path))
            for k in ordered_keys(self.app_state)
        ]
        with naming_snapshot(self.path):  # before the marker or any blob
            for k, state in states:
                check_nesting(state, f"{coord.rank}/{escape_key(k)}")
        opts = self.options
        # One budget for the whole take. The pool's blocks (free, or lent to a pending
        # snapshot's writes) are memory this take reuses; pending snapshots share the budget.
        self._budget = opts.budget(
            self.pool.free_bytes + self.pool.leased_bytes if self.pool is not None else 0
        )
        # An async take stages a slab whole (so does a compressed take): a quarter of the budget.
        slab_bytes = max(1, min(_int(opts.slab_bytes), self._budget // 4))
        layout = Layout(
            chunk_bytes=opts.chunk(chunk_bytes_hint(self.path)),
            slab_threshold_bytes=opts.slab_threshold(slab_bytes),
            slab_bytes=slab_bytes,
            checksums=bool(opts.checksums),
            zstd_level=_int(opts.zstd_level),
            take_id=uuid.uuid4().hex[:8],
        )
        if self.base is not None or opts.digests:
            self.reuse = Reuse(self.path, self.base, self.storage_options, opts, coord.rank)
        if coord.rank == 0:
            self._marker_write = run(self._begin())
        with naming_snapshot(self.path):
            self.collected = collect(
                ((escape_key(k), sd) for k, sd in states),
                rank=coord.rank,
                prepare=self.prepare,
                replicated=self.replicated,
                inline_max_bytes=_int(opts.inline_max_bytes),
                chunk_bytes=layout.chunk_bytes,
                reuse=self.reuse,
            )
        info: dict[str, Any] = {
            "path": self.path,
            "layout": layout,
            "pieces": self.collected.pieces,
            "objects": self.collected.objects,
        }
        if coord.world_size > 1:  # what its leaves are, compared across ranks
            facts = self._facts = replication.describe(self.collected, f"{coord.rank}/")
            info["marked"], info["prints"] = facts.marked, facts.prints
            info["own_bytes"] = self.collected.own_bytes = sum(
                p.nbytes for p in self.collected.payloads
            )
        return info

    async def _begin(self) -> asyncio.Future[None]:
        """Rank 0's storage opened and ``begin`` run there, in one trip to the I/O loop."""
        self.plugin = await make_plugin(self.path, self.storage_options)
        self.where = plugin_location(self.plugin)
        return await begin(self.plugin, self.where, self.options)

    def _agree(self, infos: list[dict[str, Any]]) -> tuple[str, Layout, Decision | None]:
        """Rank 0's path and layout, and which leaves are replicated (None for a process alone);
        every rank computes it from the same facts, so checks fail on all ranks alike."""
        first = infos[0]
        for rank, info in enumerate(infos[1:], start=1):
            if info["layout"] != first["layout"]:
                raise SnapshotError(
                    f"snapshot {first['path']}: rank {rank} has layout settings "
                    f"{info['layout']} but rank 0 has {first['layout']}; give every rank the "
                    "same chunk, slab, checksum, compression and memory budget options "
                    "(Options, or STATESNAP_CHUNK_BYTES / STATESNAP_SLAB_* / STATESNAP_CHECKSUMS "
                    "/ STATESNAP_ZSTD_LEVEL / STATESNAP_MEMORY_BUDGET_BYTES)"
                )
        if any(info["pieces"] for info in infos):
            sharded.check_coverage([info["pieces"] for info in infos])
        if any(info["objects"] for info in infos):
            sharded.check_objects([info["objects"] for info in infos])
        if len(infos) == 1:
            return first["path"], first["layout"], None
        pending = replication.decide(first["path"], infos)
        assert self._facts is not None
        if pending.copies:  # read now, while the copies hold the call's values
            self._copies = pending
            try:
                self._copy_crcs = pending.copy_crcs(self._facts.sources, self.coordinator.rank)
            except Exception as e:
                self._error = e  # the others learn of it at the next agreement
        if not pending.to_confirm:
            return first["path"], first["layout"], pending.confirm(None)
        digests = error = None
        try:
            digests = pending.digests(self._facts.sources)
        except Exception as e:
            error = e
        decision = pending.confirm(self.coordinator.agree("take: digests", digests, error))
        return first["path"], first["layout"], decision

    async def _writes_done(self, pipeline: WritePipeline) -> IOStats:
        """This rank's writes and its pending marker, done and durable: each rank syncs what it
        wrote (the directories it wrote into or made) before rank 0 may commit, on every rank at
        once, where rank 0 alone could not reach another host's disk."""
        stats = await pipeline.wait()
        if self._marker_write is not None:
            await self._marker_write
        assert self.plugin is not None  # the pipeline writes to it
        plugin = self.plugin
        await call(plugin, "sync", "", self.where, plugin.sync, options=self.options)
        return stats

    # -- writing and commit -----------------------------------------------------------------

    def stage_held(self) -> BaseException | None:
        """Stages the writes ``start`` held (``held``) and hands them to the I/O loop, as
        ``start`` and ``release_writes`` do for an async take, on a thread of the library's;
        returns the error that stopped staging, kept for ``finish`` to report."""
        try:
            if self._error is None and self.pipeline is not None and self.plan is not None:
                for request in self.plan.writes:
                    self.pipeline.submit(request)
                self.pipeline.ready()
        except BaseException as e:
            assert self.pipeline is not None
            self.pipeline.abort(e)
            self._error = e
        self.release_writes()
        return self._error

    def release_writes(self) -> None:
        """On the caller's thread, after ``start``: the staged writes go to the I/O loop."""
        try:
            if self.pipeline is not None:
                self.pipeline.flush()
        except Exception as e:  # a write that failed: ``finish`` reports it
            assert self.pipeline is not None
            self.pipeline.abort(e)
            self._error = self._error or e
        finally:
            self._released.set()

    def finish(self, coordinator: Coordinator | None = None) -> bytes | None:
        """Waits for this rank's writes, then commits with the others (through ``coordinator``:
        async take's is on a group of its own); the manifest's bytes on rank 0."""
        coord = coordinator or self.coordinator
        assert self.plan is not None  # the plugin may be missing: a rank that could not open it
        stats = None
        self._released.wait()  # until then, the pipeline may not be drained
        error = self._error
        if self.pipeline is not None:  # once aborted, it raises the error that stopped it
            try:
                stats = run(self._writes_done(self.pipeline))
            except Exception as e:
                error = error or e
        self._times["written"] = time.perf_counter() - self._times["start"]
        if self.pool is not None:
            self.pool.trim()  # this take's blocks are back: unlock pinned memory it dropped
        checksums = self.pipeline.checksums if self.pipeline is not None else {}
        # What this rank tells rank 0: its error, or the checksums of what it wrote for the
        # others (rank 0's entries of a replicated value point at the blob one rank wrote),
        # the CRC-32s of its copies, and its entries (rank 0 makes its own once it has the
        # others' checksums).
        part = None
        if error is None:
            try:
                with gc_paused():
                    shared = self.plan.shared_checksums(checksums)
                    entries = self.plan.entries(checksums) if coord.rank != 0 else {}
                part = (shared, self._copy_crcs, entries)
            except Exception as e:
                error = e
            except BaseException:
                self._abandon()
                raise
        # One gather and rank 0's verdict: rank 0 commits only when every rank wrote. From the
        # gather on rank 0 may commit a manifest that names every rank's blobs, so a rank
        # removes its blobs only when it knows that no manifest of this take landed.
        coord.step = "take: commit"
        try:
            with gc_paused():
                parts = coord.gather((part, None if error is None else describe(error)))
            verdict = None if parts is None else self._decide(parts, checksums)
            message, failures, landed, count = coord.broadcast_object(verdict)
        except BaseException:
            if coord.rank == 0 and not self._landed:
                self._abandon()
            elif coord.rank == 0:
                self._leave("failed after its manifest may have been committed")
            else:
                self._leave("lost the other ranks before rank 0's verdict (it may have committed)")
            raise
        if message is not None:
            if landed:
                self._leave("failed after its manifest may have been committed")
            else:
                self._abandon()
            cause = error or self._failure  # this rank's own, or rank 0's commit's
            if coord.world_size == 1 and cause is not None:  # a process alone: as it is
                raise cause
            if failures:
                raise RankFailedError(message, failures) from cause
            raise SnapshotError(message) from cause
        assert self.plugin is not None and stats is not None  # no error: both are there
        run(self.plugin.close())
        self._log(stats, count)
        return self._data

    def _decide(
        self, parts: Sequence[tuple[Any, str | None]], checksums: dict[Any, Any]
    ) -> tuple[str | None, dict[int, str], bool, int]:
        """Rank 0's verdict on every rank's ``parts``: the error message (None when the
        snapshot is committed), the failed ranks and their errors, whether a manifest of this
        take may be at the path, and the number of entries. Commits when every rank wrote."""
        failures = {r: failed for r, (_, failed) in enumerate(parts) if failed is not None}
        if failures:
            return self.coordinator.failed("take: writing", failures), failures, False, 0
        assert self.plan is not None and self.plugin is not None  # rank 0 opened it first
        try:  # any error is the verdict: every rank waits for it
            if self._copies is not None:
                try:
                    self._copies.check_copies([crcs for (_, crcs, _), _ in parts])
                except SnapshotError as e:  # no rank failed: copies that must be equal differ
                    self._failure = e
                    return str(e), {}, False, 0
            for (shared, _, _), _ in parts:
                checksums.update(shared)
            with gc_paused():
                entries = [self.plan.entries(checksums), *(e for (_, _, e), _ in parts[1:])]
                count, self._data = self._manifest(entries)
            self._landed = True
            run(commit(self.plugin, self._data, self.options))
        except Exception as e:
            self._failure = e
            # Unless the write began and the path may hold it: another take's manifest won
            # there, or the manifest reads back as not this take's.
            self._landed = (
                self._landed
                and not isinstance(e, SnapshotExistsError)
                and not run(not_committed(self.plugin, self._data))
            )
            failures = {0: describe(e)}
            return self.coordinator.failed("take: commit", failures), failures, self._landed, 0
        return None, {}, True, count

    def _manifest(self, parts: Sequence[Mapping[str, Made]]) -> tuple[int, bytes]:
        """The number of entries and the manifest of every rank's entries (``parts``, in rank
        order), in the lowest format version that holds them."""
        world_size = self.coordinator.world_size
        entries = merge_entries(parts)
        metadata = {
            "library": f"statesnap {__version__}",
            "torch": str(torch.__version__),
            "created_unix": round(time.time(), 3),
            **({"strategies": self.strategies} if self.strategies else {}),
            **({"user": dict(self.user_metadata)} if self.user_metadata is not None else {}),
        }
        once = bool(self._shared_paths) and world_size > 1
        # (Ranges stored compressed: written so by this take, or reused from a base's.)
        framed = self.reuse is not None or (self.plan is not None and self.plan.compressed)
        version = format_version(entries, replicated_once=once, maybe_compressed=framed)
        return len(entries), mf.dumps_entries(version, world_size, metadata, entries)

    def _leave(self, why: str) -> None:
        """After a failure that may have left a manifest naming this rank's blobs: they stay."""
        logger.warning(
            "take %s (rank %d) %s: its blobs are left in place",
            self.where, self.coordinator.rank, why,
        )  # fmt: skip
        if self.plugin is not None:
            run(self.plugin.close())

    def _abandon(self, error: BaseException | None = None) -> None:
        """After a failure: the writes stopped (with ``error``), what this rank wrote removed."""
        if error is not None and self.pipeline is not None:
            self.pipeline.abort(error)
        if self.plugin is not None:
            blobs = [w.blob for w in self.plan.writes] if self.plan is not None else []
            run(remove_written(self.plugin, self.where, blobs, self._marker_write))

    def _log(self, stats: IOStats, entries: int) -> None:
        times = self._times
        total = time.perf_counter() - times["start"]
        rank = self.coordinator.rank
        if self.reuse is not None and self.base is not None:
            logger.info(
                "take %s (rank %d): %.1f MB of %.1f MB of tensors compared were unchanged since "
                "base %s and not written again",
                self.where, rank, self.reuse.reused_bytes / 1e6, self.reuse.hashed_bytes / 1e6,
                self.base,
            )  # fmt: skip
        logger.info(
            "took snapshot %s (rank %d of %d): %d entries, %d blobs, %.1f MB in %.3f s (%.2f GB/s)",
            self.where, rank, self.coordinator.world_size, entries, stats.blobs,
            stats.nbytes / 1e6, total, stats.nbytes / max(total, 1e-9) / 1e9,
        )  # fmt: skip
        logger.debug(
            "take %s phases: state_dict+plan %.3f s, staged by %.3f s, written by %.3f s "
            "(%.2f GB/s, peak staged %d B), committed by %.3f s",
            self.where, times["plan"], times["staged"], times["written"], stats.gbps,
            stats.peak_budget_bytes, total,
        )  # fmt: skip
