"""The loader: collects the reads that rebuild a set of manifest entries, runs them, and
rebuilds the values (``inflate``).

Each leaf entry is planned by the kind that restores it (``handlers.table``:
``kind.restore(loader, path, entry, target)``; the loader is the kinds' ``ReadPlanner``), which
adds its needs to the loader and records where its value will be (``tensors``, ``objects``);
the loader itself only knows the one kind of target every kind treats alike, a
``LocalNonpersistentObject`` (the restoring rank's own object, never read). A whole stored
range read straight into the caller's tensor is kept as a row of columns (``add_direct``:
``DirectReads``), not as a need. Then ``execute`` cuts the rows, and merges the needs, into
scatter reads (``DirectReads.requests``, ``coalesce``) and runs them under the memory budget;
``verify_first`` is the first pass of a restore that checks every stored range before it
writes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from operator import add, attrgetter
from typing import Any

import torch

from manifest import Entry, Location, Manifest, TensorEntry, reference_of
from snapshot._engine.context import naming_snapshot
from snapshot._engine.flatten import inflate, subtree
from snapshot._engine.handlers.local import LOCAL
from snapshot._engine.handlers.table import by_entry_type
from snapshot._engine.io.io_loop import join, spawn
from snapshot._engine.io.pipeline import IOStats, read_all
from snapshot._engine.io.requests import AnyReadRequest, DirectRequest
from snapshot._engine.io.storage_calls import call
from snapshot._engine.io.tensor_memory import memory_span
from snapshot._engine.restore.claims import ClaimCheck
from snapshot._engine.restore.direct_reads import DirectReads, clashes
from snapshot._engine.restore.landing import Landing
from snapshot._engine.restore.reads import Need, ScratchPool, coalesce, label_of
from snapshot._engine.restore.restore_guard import (
    CHECK_PIECE_BYTES,
    RestoreProgress,
    ScratchKeeper,
    check_needs,
    locations_read,
)
from snapshot.errors import CorruptSnapshotError, StateMismatchError
from snapshot.options import Options
from snapshot.sharding.mapping import LocalNonpersistentObject
from storage_plugins import StoragePlugin

logger = logging.getLogger(__name__)
_nbytes = attrgetter("nbytes")

PENDING = object()
"""``Loader.inflate_ready``'s answer for a value that waits for a read."""


def tile_bytes(budget: int, options: Options) -> int:
    """The scratch tile of one read, out of a budget of ``budget`` bytes: two tiles per
    worker can be in flight, and their sum stays within the budget."""
    assert options.max_concurrent_io is not None
    return max(1, budget // (2 * options.max_concurrent_io))


class Loader:
    """Collects the reads that rebuild a set of manifest entries, runs them, and inflates.

    The kinds' ``ReadPlanner`` (``handlers.table``): the read sizes (``piece_bytes``: the
    longest need into a target's memory, ``tile_bytes``: the longest through scratch,
    ``gap_bytes``) and ``verify``; ``add_needs``, ``add_direct``, ``claim`` and ``later``;
    where values land (``tensors``, ``objects``, ``indirect``); the scratch the reads share
    (``scratch``, ``landing``); and each kind's own state (``kind_state``).
    """

    def __init__(
        self,
        manifest: Manifest,
        options: Options,
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
        assert options.read_request_bytes is not None and options.read_gap_bytes is not None
        assert options.max_concurrent_io is not None and options.checksums is not None
        self.piece_bytes = options.read_request_bytes
        self.gap_bytes = options.read_gap_bytes
        self.concurrency = options.max_concurrent_io
        self.options = options  # each storage call's retries and deadline
        # Whether reads check recorded CRC-32s: the options' setting unless the caller decides.
        self.verify = options.checksums if verify is None else verify
        # The app_state key whose targets the subtree being planned fills (``Need.owner``).
        self.owner: str | None = None
        self.needs: list[Need] = []
        # The reads of whole stored ranges into the caller's tensors (most reads), as columns.
        self.direct = DirectReads()
        self.tensors: dict[str, Any] = {}
        # Decoded objects, primitives' values, LocalNonpersistentObject values.
        self.objects: dict[str, Any] = {}
        self.scratch = ScratchPool()  # for reads of sharded tensors through their gaps
        # The copies of scratch tiles into targets, and the device streams they run on
        # (made, and ordered after the caller's current streams, as targets are planned).
        self.landing = Landing()
        # Planning steps that wait until every other read is planned (``later``).
        self._later: list[Callable[[], None]] = []
        # Each kind's own bookkeeping, by the kind's name (the dense kind's new tensors).
        self.kind_state: dict[str, Any] = {}
        # The caller's CPU tensors that reads planned as needs fill (not ``direct`` rows), by
        # path: with the rows, checked for targets that share memory (``_separate_overlaps``).
        self.indirect: list[tuple[str, torch.Tensor]] = []
        # Targets that share memory with another target and would receive other bytes: read
        # into new tensors, then copied into the targets in the order they were planned
        # (``_land_overlapped``), as ``load_state_dict`` copies one key after the other.
        self._overlapped: list[tuple[str, torch.Tensor]] = []
        self._overlaps_checked = False

    # -- what the kinds' restore functions call -------------------------------------------------

    def add_needs(self, needs: list[Need], *, into_target: bool) -> None:
        """Adds a leaf's needs; ``into_target``: they land in the caller's target (a tensor,
        or a piece of a sharded one, that a ``state_dict()`` returned), and so write the live
        state of the app_state key being planned (``owner``)."""
        owner = self.owner
        if into_target and owner is not None:
            for need in needs:
                need.owner = owner
        self.needs.extend(needs)

    def add_direct(self, path: str, chunk: Location, address: int) -> None:
        """Adds the read of ``chunk``, whole, to ``address``: the memory of the caller's
        tensor for entry ``path`` (``dense.direct_address``), live state of ``owner``."""
        self.direct.add(path, chunk, address, self.owner)

    @property
    def planned(self) -> bool:
        """Whether any read is planned."""
        return bool(self.needs) or bool(len(self.direct))

    def materialize(self) -> None:
        """Turns the direct reads' rows into needs, for the steps that work need by need (the
        first pass of ``verify_first``, ``shared_reads``)."""
        self._separate_overlaps()
        self.needs.extend(self.direct.needs(self.verify))

    def claim(self) -> None:
        """Called by a kind before it plans a read that takes memory of the size the manifest
        records: the claims of every read of the subtree being planned that allocates
        (``ClaimCheck``) are checked at once, the first time. Reads into the caller's tensors,
        most of a restore, plan no allocation, and a subtree of only those is walked once."""
        unclaimed, self._unclaimed = self._unclaimed, None
        if unclaimed is not None and self.claims is not None:
            root, targets = unclaimed
            self.claims.check(self.entries, subtree(self.entries, root), targets)

    def later(self, step: Callable[[], None]) -> None:
        """Runs ``step`` once every read is planned, before the reads run (``plan_deferred``)."""
        self._later.append(step)

    # -- planning --------------------------------------------------------------------------------

    def add_subtree(
        self,
        root: str,
        targets: Mapping[str, Any],
        owner: str | None = None,
        paths: Sequence[str] | None = None,
    ) -> None:
        """Plans the reads of every leaf under ``root`` into ``targets`` (by path); the needs
        that land bytes in a target (the live state of app_state key ``owner``) are marked with
        ``owner`` (``Need.owner``). ``paths``: ``subtree(entries, root)``, where the caller
        listed it already."""
        entries = self.entries
        self.owner = owner
        self._overlaps_checked = False
        with naming_snapshot(self.where):
            # Checked when the first read that allocates is planned (``claim``), if any.
            self._unclaimed = (root, targets)
            for p in subtree(entries, root) if paths is None else paths:
                entry = entries.get(p)
                if entry is None:
                    raise CorruptSnapshotError(
                        f"{p}: listed by its parent but missing from the manifest"
                    )
                target = targets.get(p)
                kind = by_entry_type.get(type(entry))
                if kind is None:
                    continue  # a container, which ``inflate`` rebuilds
                if isinstance(target, LocalNonpersistentObject):
                    kind = LOCAL  # this rank's own, never read
                kind.restore(self, p, entry, target)

    def plan_deferred(self) -> None:
        """Runs the planning steps that wait for every other read (``later``): view entries
        read into no target, say, which become views of their base's new tensor."""
        with naming_snapshot(self.where):
            self._separate_overlaps()
            while self._later:
                steps, self._later = self._later, []
                for step in steps:
                    step()

    # -- reading ---------------------------------------------------------------------------------

    def execute(
        self,
        plugin: StoragePlugin,
        budget_bytes: int,
        progress: RestoreProgress | None = None,
        meanwhile: Callable[[], None] | None = None,
    ) -> IOStats:
        """Runs the planned reads; ``progress`` records which app_state keys' targets they
        begin to write. ``meanwhile`` runs on the caller's thread while the reads run (work
        that waits for no read, done where the caller would only wait: ``inflate_ready``)."""
        self.plan_deferred()
        with naming_snapshot(self.where):
            stats = self._execute(
                plugin, budget_bytes, self.needs, progress, meanwhile, direct=self.direct
            )
        self._land_overlapped()
        return stats

    def _separate_overlaps(self) -> None:
        """Finds the caller's tensors that share memory with another target and would receive
        other bytes (a flat buffer and views of it, restored from a snapshot of separate
        tensors; weights tied in the model, not in the snapshot): reads landing in such memory
        would overwrite one another in whatever order they finish, and a CRC-32 checked over
        the memory a read landed in would fail on an intact snapshot. Those read by whole
        stored ranges (``direct`` rows) are read into new tensors instead, and copied into the
        targets once every read is done (``_land_overlapped``).

        Raises:
            StateMismatchError: naming the targets, when one of a group of such targets is
                filled by reads in pieces or through a cast, which are not read apart.
        """
        if self._overlaps_checked:
            return
        self._overlaps_checked = True
        direct = self.direct
        rows = len(direct)
        chunks = direct.chunks
        starts = direct.addresses + [memory_span(t)[0] for _, t in self.indirect]
        ends = list(map(add, direct.addresses, map(_nbytes, chunks)))
        ends += [memory_span(t)[1] for _, t in self.indirect]
        entries = self.entries

        def source(i: int) -> object:
            path = direct.paths[i] if i < rows else self.indirect[i - rows][0]
            entry = entries[path]
            return (entry.dtype, entry.chunks) if type(entry) is TensorEntry else path

        groups = clashes(starts, ends, source)
        if not groups:
            return
        for group in groups:
            if group[-1] >= rows:
                paths = [direct.paths[i] if i < rows else self.indirect[i - rows][0] for i in group]
                raise StateMismatchError(
                    f"the tensors being restored at {', '.join(map(repr, paths))} share memory "
                    "(views of one buffer that overlap), and the snapshot holds different "
                    "values for them, some of which are read in pieces or cast; restore into "
                    "tensors that do not overlap (.clone() them, or restore the buffer alone)"
                )
        moved = sorted(i for g in groups for i in g)
        planned = [(direct.paths[i], direct.owners[i]) for i in moved]
        logger.info(
            "restore %s: %d targets share memory with others and receive other bytes: read "
            "apart, then copied in order",
            self.where,
            len(moved),
        )
        direct.remove(moved)
        owner = self.owner
        for path, _ in planned:
            target = self.tensors[path]
            entry = entries[path]
            kind = by_entry_type[type(entry)]
            self.owner = None  # a new tensor: no live state is written by its reads
            kind.restore(self, path, entry, None)
            self._overlapped.append((path, target))
        self.owner = owner

    def _land_overlapped(self) -> None:
        """Copies the values read for targets that share memory into them, in the order they
        were planned: where targets overlap, the later one's value stays, as with
        ``load_state_dict``."""
        if not self._overlapped:
            return
        with torch.no_grad():
            for path, target in self._overlapped:
                target.copy_(self.tensors[path])
                self.tensors[path] = target
        self._overlapped = []

    def verify_first(self, plugin: StoragePlugin, budget_bytes: int) -> IOStats:
        """The first pass of a restore that checks before it writes: reads the needs that
        write no live state (objects, new tensors: decoded and checked as usual), and every
        stored range the other needs read, whole, against its recorded CRC-32 (into scratch,
        which is given back as each read is done). Leaves those other needs, which write into
        targets, for ``execute``; their ranges are then read a second time."""
        self.plan_deferred()
        self.materialize()
        private = [n for n in self.needs if n.owner is None]
        writing = [n for n in self.needs if n.owner is not None]
        piece = min(CHECK_PIECE_BYTES, self.tile_bytes)
        scratch = ScratchKeeper(max(0, budget_bytes - self.concurrency * self.tile_bytes))
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
        meanwhile: Callable[[], None] | None = None,
        direct: DirectReads | None = None,
    ) -> IOStats:
        try:
            # The reads are cut on the caller's thread before they start: on the I/O loop the
            # cutting would compete for the GIL with ``meanwhile``, and hold back every read.
            requests = self._requests(budget_bytes, needs, direct)
            if progress is not None:
                progress.watch(requests)
            future = spawn(self._read(plugin, budget_bytes, requests))
            if meanwhile is not None:
                try:
                    meanwhile()
                except BaseException:
                    future.cancel()  # as ``join`` does when the caller is interrupted
                    raise
            return join(future)
        finally:
            # On the caller's thread, after every read (also a failed one): waits for the
            # device copies still in flight, so the targets hold their bytes on return.
            self.landing.finish()

    def _requests(
        self, budget_bytes: int, needs: list[Need], direct: DirectReads | None
    ) -> list[AnyReadRequest]:
        """The scatter reads of ``needs`` and of the rows of ``direct``."""
        # The reads hold up to one tile of scratch per worker, charged; the rest of the budget
        # bounds what the landing holds beside them: tiles kept for reuse, and pinned tiles
        # whose device copies are still in flight.
        self.landing.spare_bytes = max(0, budget_bytes - self.concurrency * self.tile_bytes)
        requests: list[AnyReadRequest] = []
        if direct is not None and len(direct):
            cut, leftovers = direct.requests(
                verify=self.verify,
                max_gap_bytes=self.gap_bytes,
                max_request_bytes=self.piece_bytes,
            )
            requests.extend(cut)
            needs = needs + leftovers
        requests += coalesce(
            needs,
            max_gap_bytes=self.gap_bytes,
            max_request_bytes=self.piece_bytes,
            # Into device targets a read holds one short pinned tile (``DEVICE_TILE_BYTES``),
            # not several merged up to the budget's tile.
            max_scratch_bytes=self.landing.scratch_limit(self.tile_bytes),
        )
        return requests

    async def _read(
        self, plugin: StoragePlugin, budget_bytes: int, requests: list[AnyReadRequest]
    ) -> IOStats:
        concurrency = self.concurrency
        stats = await read_all(
            plugin,
            requests,
            budget_bytes=budget_bytes,
            max_concurrency=concurrency,
            options=self.options,
        )
        if self.verify:
            # After the reads: a store may learn sizes from them (an S3 ranged GET's answer
            # carries the object's length), and a blob cut short has failed its read already.
            await self._check_sizes(plugin, requests, concurrency)
        return stats

    async def _check_sizes(
        self, plugin: StoragePlugin, requests: Sequence[AnyReadRequest], concurrency: int
    ) -> None:
        """Each blob read must be as long as the manifest says: not shorter (cut), and not
        longer (bytes appended after the take, or a blob of another snapshot). Runs after the
        reads, one size query per blob."""
        by_blob: dict[str, list[AnyReadRequest]] = {}
        for req in requests:  # a few per blob, where there are thousands of needs
            by_blob.setdefault(req.blob, []).append(req)
        expected = self.manifest.blob_sizes
        blobs = iter(by_blob.items())
        options = self.options

        async def worker() -> None:
            for blob, reqs in blobs:
                # The label of all the blob's needs (coalesce labelled each request's).
                label = reqs[0].label if len(reqs) == 1 else label_of(_labels_of(reqs))
                size = await call(
                    plugin, "read", blob, label, lambda b=blob: plugin.size(b), options=options
                )
                want = expected[blob]
                # A sibling snapshot's blob (an incremental take's base) may hold more than
                # the ranges this snapshot reuses: only one cut short is wrong.
                if (
                    size is not None
                    and size != want
                    and (size < want or reference_of(blob) is None)
                ):
                    how = "longer" if size > want else "shorter"
                    raise CorruptSnapshotError(
                        f"{label}: blob {plugin.describe(blob)} is {how} than the manifest says "
                        f"({size:,} bytes; the manifest's last range in it ends at {want:,})"
                    )

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(by_blob)))))

    # -- the values ------------------------------------------------------------------------------

    def value(self, path: str, entry: Entry) -> Any:
        tensor = self.tensors.get(path)  # most leaves (a path is in one of these dicts at most)
        if tensor is not None:
            return tensor
        return self.objects[path]  # a KeyError: an entry that no read planned

    def inflate(self, root: str) -> Any:
        with naming_snapshot(self.where):
            return self._inflate(root)

    def inflate_ready(self, root: str) -> Any:
        """``inflate(root)`` where every leaf under ``root`` has its value already (tensors
        read into their targets or planned as new ones, primitives, local objects), else
        ``PENDING`` (an object that a read is still decoding). Made to run while the reads run
        (``execute``'s ``meanwhile``): it changes nothing, and raises nothing; whatever keeps
        a value from being rebuilt (a damaged manifest too) is left to ``inflate`` after the
        reads, which reports it as it always does."""
        if self._overlapped:
            return PENDING  # their targets get their values after the reads
        try:
            return inflate(self.entries, root, self.value, self.tensors)
        except Exception:
            return PENDING

    def _inflate(self, root: str) -> Any:
        try:
            return inflate(self.entries, root, self.value, self.tensors)
        except KeyError as e:
            raise CorruptSnapshotError(f"{root}: entry {e} is missing from the manifest") from None
        except RecursionError:
            raise CorruptSnapshotError(f"{root}: containers nested too deeply to rebuild") from None


def _labels_of(requests: Sequence[AnyReadRequest]) -> Iterator[str]:
    """The entry paths some read requests serve (a ``ReadRequest``'s other segments are
    skipped gaps)."""
    for req in requests:
        if type(req) is DirectRequest:
            yield from req.paths
            continue
        for seg in req.segments:
            if isinstance(seg, Need):
                yield seg.label
