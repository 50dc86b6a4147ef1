"""The loader: plans the reads that rebuild a set of manifest entries, runs them, and rebuilds
the values (``inflate``).

Each leaf is planned by the kind that restores it (``kind.restore(loader, path, entry,
target)``: the loader is the kinds' ``ReadPlanner``, ``handlers.table``), which adds needs and
records where its value will be; ``execute`` merges the needs into scatter reads and runs them
under the memory budget.
"""

from __future__ import annotations

import functools
import logging
import operator
from collections.abc import Callable, Mapping
from itertools import groupby
from typing import TYPE_CHECKING, Any

import torch

from manifest import Entry, Location, Manifest, TensorEntry
from snapshot._engine.format.serialization import WholeCheck, memory_span, raw_memoryview
from snapshot._engine.handlers.local import LOCAL
from snapshot._engine.handlers.table import by_entry_type
from snapshot._engine.io.pipeline import IOStats, read_all
from snapshot._engine.restore.checks import (
    CHECK_PIECE_BYTES,
    check_blob_sizes,
    check_claims,
    check_needs,
    locations_read,
)
from snapshot._engine.restore.reads import (
    Landing,
    Need,
    ScratchPool,
    coalesce,
)
from snapshot._engine.runtime import naming_snapshot, run
from snapshot._engine.state_dicts import inflate, subtree
from snapshot.errors import CorruptSnapshotError, StateMismatchError
from snapshot.options import Options
from snapshot.sharding.mapping import LocalNonpersistentObject
from storage_plugins import StoragePlugin

if TYPE_CHECKING:
    from snapshot._engine.progress import Reporter
    from snapshot._engine.restore.restore import RestoreProgress

logger = logging.getLogger(__name__)


_blob = operator.attrgetter("blob")
_label = operator.attrgetter("label")


def tile_bytes(budget: int, options: Options) -> int:
    """The scratch tile of one read: two per worker in flight stay within ``budget``."""
    assert options.max_concurrent_io is not None
    return max(1, budget // (2 * options.max_concurrent_io))


class Loader:
    """Plans the reads that rebuild a set of manifest entries, runs them, and inflates.

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
        storage_options: dict[str, Any] | None,
        entries: Mapping[str, Entry],
        verify: bool | None = None,
    ) -> None:
        self.manifest = manifest
        # The claims of reads that allocate, checked before the first: the subtree until then.
        self._unclaimed: tuple[str, Mapping[str, Any]] | None = None
        self.checked_blobs: set[str] = set()  # the blobs whose claims were checked
        self.unchecked_bytes = 0  # claimed by the reads planned without asking the store
        self.storage_options = storage_options
        self.entries = entries  # the rank's view
        self.where = where
        self.tile_bytes = tile_bytes
        assert options.read_request_bytes is not None and options.read_gap_bytes is not None
        assert options.max_concurrent_io is not None and options.checksums is not None
        self.piece_bytes = options.read_request_bytes
        self.gap_bytes = options.read_gap_bytes
        self.concurrency = options.max_concurrent_io
        self.options = options  # each storage call's retries and deadline
        self.verify = options.checksums if verify is None else verify
        self.owner: str | None = None  # the app_state key being planned (``Need.owner``)
        self.needs: list[Need] = []
        self.tensors: dict[str, Any] = {}
        # Decoded objects, primitives' values, LocalNonpersistentObject values.
        self.objects: dict[str, Any] = {}
        self.scratch = ScratchPool()  # for reads of sharded tensors through their gaps
        self.landing = Landing()
        self._later: list[Callable[[], None]] = []
        # Each kind's own bookkeeping, by the kind's name (the dense kind's new tensors).
        self.kind_state: dict[str, Any] = {}
        # The caller's CPU tensors filled in place, checked for shared memory
        # (``materialize``): by whole chunks, (path, address, need) each, and by other
        # needs, (path, tensor) each.
        self._direct: list[tuple[str, int, Need]] = []
        self.indirect: list[tuple[str, torch.Tensor]] = []
        # Targets sharing memory that receive other bytes: read apart, then copied in order.
        self._overlapped: list[tuple[str, torch.Tensor]] = []
        self._overlaps_checked = False

    # -- what the kinds' restore functions call -------------------------------------------------

    def add_needs(self, needs: list[Need], *, into_target: bool) -> None:
        """Adds a leaf's needs; ``into_target``: they write the caller's target (``owner``'s)."""
        if into_target and self.owner is not None:
            for need in needs:
                need.owner = self.owner
        self.needs.extend(needs)

    def add_direct(self, reads: list[tuple[str, Location, int]]) -> None:
        """Adds reads of whole chunks into the caller's CPU tensors: ``(path, chunk, address
        of the tensor's memory)`` each (the owner's live state)."""
        owner, verify, needs, direct = self.owner, self.verify, self.needs, self._direct
        for path, chunk, address in reads:
            n = chunk.nbytes
            check = WholeCheck(path, chunk) if verify and chunk.crc32 is not None else None
            dest = functools.partial(raw_memoryview, address, n)
            need = Need(n, dest, check, owner, chunk.blob, chunk.offset, None, 0, path)
            needs.append(need)
            direct.append((path, address, need))

    def claim(self) -> None:
        """Called before planning a read into new memory: checks the subtree's claims, once."""
        unclaimed, self._unclaimed = self._unclaimed, None
        if unclaimed is not None:
            root, targets = unclaimed
            check_claims(self, subtree(self.entries, root), targets)

    def later(self, step: Callable[[], None]) -> None:
        """Runs ``step`` once every read is planned, before the reads run (``plan_deferred``)."""
        self._later.append(step)

    # -- planning --------------------------------------------------------------------------------

    def add_subtree(self, root: str, targets: Mapping[str, Any], owner: str | None = None) -> None:
        """Plans the reads of every leaf under ``root`` into ``targets`` (by path); the needs
        that land bytes in a target are marked with ``owner`` (an app_state key)."""
        self.owner = owner
        self._overlaps_checked = False
        with naming_snapshot(self.where):
            self._unclaimed = (root, targets)
            entries = self.entries
            paths = subtree(entries, root)
            run: list[tuple[str, Any, Any]] = []  # consecutive leaves of one kind
            run_kind = entry_type = entry_kind = None
            found = zip(paths, map(entries.get, paths), map(targets.get, paths), strict=True)
            for p, entry, target in found:
                if type(entry) is not entry_type:
                    if entry is None:
                        raise CorruptSnapshotError(
                            f"{p}: listed by its parent but missing from the manifest"
                        )
                    entry_type = type(entry)
                    entry_kind = by_entry_type.get(entry_type)
                kind = entry_kind
                if kind is None:
                    continue  # a container, which ``inflate`` rebuilds
                if isinstance(target, LocalNonpersistentObject):
                    kind = LOCAL  # this rank's own, never read
                if kind is not run_kind:
                    if run_kind is not None:
                        run_kind.restore_all(self, run)
                    run_kind, run = kind, []
                run.append((p, entry, target))
            if run_kind is not None:
                run_kind.restore_all(self, run)

    def plan_deferred(self) -> None:
        """Runs the planning steps that wait for every other read (``later``)."""
        with naming_snapshot(self.where):
            self.materialize()
            while self._later:
                steps, self._later = self._later, []
                for step in steps:
                    step()

    def materialize(self) -> None:
        """Settles the needs (``shared_reads`` too calls it): finds the caller's tensors that
        share memory with another target and would receive other bytes (weights tied in the
        model, not in the snapshot): their reads would race. Those read by whole ranges are
        read into new tensors and copied in order after the reads; a ``StateMismatchError``
        where one is filled in pieces or through a cast."""
        if self._overlaps_checked:
            return
        self._overlaps_checked = True
        direct, rows = self._direct, len(self._direct)
        spans = [(a, a + need.nbytes) for _, a, need in direct]
        spans += [memory_span(t) for _, t in self.indirect]

        def path_of(i: int) -> str:
            return direct[i][0] if i < rows else self.indirect[i - rows][0]

        def source(i: int) -> object:
            entry = self.entries[path_of(i)]
            return (entry.dtype, entry.chunks) if type(entry) is TensorEntry else path_of(i)

        groups = clashes(spans, source)
        if not groups:
            return
        for group in groups:
            if group[-1] >= rows:
                raise StateMismatchError(
                    f"the tensors being restored at {', '.join(repr(path_of(i)) for i in group)} "
                    "share memory (views of one buffer that overlap), and the snapshot holds "
                    "different values for them, some of which are read in pieces or cast; "
                    "restore into tensors that do not overlap (.clone() them, or restore the "
                    "buffer alone)"
                )
        moved = sorted(i for g in groups for i in g)
        logger.info(
            "restore %s: %d targets share memory with others and receive other bytes: read "
            "apart, then copied in order",
            self.where,
            len(moved),
        )
        gone = {id(direct[i][2]) for i in moved}
        self.needs = [n for n in self.needs if id(n) not in gone]
        self._direct = [d for d in direct if id(d[2]) not in gone]
        owner, self.owner = self.owner, None  # new tensors: no live state written
        for path in [direct[i][0] for i in moved]:
            target = self.tensors[path]
            entry = self.entries[path]
            by_entry_type[type(entry)].restore(self, path, entry, None)
            self._overlapped.append((path, target))
        self.owner = owner

    def _land_overlapped(self) -> None:
        """Copies the values read apart into their targets, in planned order."""
        with torch.no_grad():
            for path, target in self._overlapped:
                target.copy_(self.tensors[path])
                self.tensors[path] = target
        self._overlapped = []

    # -- reading ---------------------------------------------------------------------------------

    def execute(
        self,
        plugin: StoragePlugin,
        budget_bytes: int,
        progress: RestoreProgress | None = None,
        reporter: Reporter | None = None,
    ) -> IOStats:
        """Runs the planned reads; ``progress`` records the keys whose targets they write,
        ``reporter`` is told the bytes of each read that landed (``progress=`` of the call)."""
        self.plan_deferred()
        with naming_snapshot(self.where):
            stats = self._execute(plugin, budget_bytes, self.needs, progress, reporter)
        self._land_overlapped()
        return stats

    def verify_first(self, plugin: StoragePlugin, budget_bytes: int) -> IOStats:
        """The first pass of a restore that checks before it writes: runs the needs that write
        no live state, and checks every range the others read (whole, into scratch); leaves
        the others for ``execute``."""
        self.plan_deferred()
        private = [n for n in self.needs if n.owner is None]
        writing = [n for n in self.needs if n.owner is not None]
        piece = min(CHECK_PIECE_BYTES, self.tile_bytes)
        with naming_snapshot(self.where):
            checks = check_needs(locations_read(self.entries, writing), piece)
            stats = self._execute(plugin, budget_bytes, private + checks, None)
        self.needs = writing
        return stats

    def _execute(
        self,
        plugin: StoragePlugin,
        budget_bytes: int,
        needs: list[Need],
        progress: RestoreProgress | None,
        reporter: Reporter | None = None,
    ) -> IOStats:
        """Runs ``needs``: merged into scatter reads, read within the budget, each blob read
        then checked against the manifest's length when reads verify."""
        # The reads hold up to one tile of scratch per worker; the rest of the budget bounds
        # what the landing keeps beside them (tiles for reuse, pinned tiles in flight).
        self.landing.spare_bytes = max(0, budget_bytes - self.concurrency * self.tile_bytes)
        requests = coalesce(
            needs,
            max_gap_bytes=self.gap_bytes,
            max_request_bytes=self.piece_bytes,
            max_scratch_bytes=self.landing.scratch_limit(self.tile_bytes),
        )
        if progress is not None:
            progress.watch(requests)
        if reporter is not None:
            reporter.watch(requests, self.where)
        options, jobs = self.options, self.concurrency

        async def read() -> IOStats:
            stats = await read_all(
                plugin, requests, budget_bytes=budget_bytes, max_concurrency=jobs, options=options
            )
            if self.verify:
                # After the reads: a store may learn sizes from them (an S3 ranged GET's answer
                # carries the object's length), and a blob cut short has failed its read
                # already. Each blob read must be as long as the manifest says: not cut, nor
                # appended to.
                readers: dict[str, list[str]] = {}  # (in runs of one blob, as most needs come)
                for blob, run_ in groupby(needs, _blob):
                    readers.setdefault(blob, []).extend(map(_label, run_))
                expected = self.manifest.blob_sizes
                await check_blob_sizes(plugin, readers, expected, jobs, options)
            return stats

        try:
            return run(read())
        finally:
            # After every read (a failed one too): waits for device copies still in flight.
            self.landing.finish()

    # -- the values ------------------------------------------------------------------------------

    def value(self, path: str, entry: Entry) -> Any:
        tensor = self.tensors.get(path)
        if tensor is not None:
            return tensor
        return self.objects[path]  # a KeyError: an entry that no read planned

    def inflate(self, root: str) -> Any:
        """The value at ``root``, rebuilt from the leaves' values once the reads are done."""
        with naming_snapshot(self.where):
            try:
                return inflate(self.entries, root, self.value, self.tensors)
            except KeyError as e:
                problem = f"entry {e} is missing from the manifest"
            except RecursionError:
                problem = "containers nested too deeply to rebuild"
            raise CorruptSnapshotError(f"{root}: {problem}") from None


def clashes(spans: list[tuple[int, int]], source: Callable[[int], object]) -> list[list[int]]:
    """The groups of memory ranges ``[start, end)`` (by index in ``spans``) that overlap and
    would receive different bytes, each a list of indices in ascending order. Ranges that are
    the same memory and read the same stored bytes (``source`` equal: tied weights restored
    from tied weights) write the same values, and are no clash."""
    # No two ranges overlap when, both sorted, each end is at or before the next start.
    starts, ends = sorted(s for s, _ in spans), sorted(e for _, e in spans)
    if all(map(operator.le, ends, starts[1:])):
        return []
    out: list[list[int]] = []
    group: list[tuple[int, int, int]] = []
    reach = 0
    last = ends[-1]
    for span in [*sorted((s, e, i) for i, (s, e) in enumerate(spans)), (last, last, -1)]:
        if group and span[0] >= reach:  # (the last span closes the last group)
            if len(group) > 1 and len({(s, e, source(i)) for s, e, i in group}) > 1:
                out.append(sorted(i for _, _, i in group))
            group = []
        reach = max(reach, span[1]) if group else span[1]
        group.append(span)
    return out
