"""The public face: Snapshot.take / async_take / restore / read_object / get_manifest."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed

from manifest import Entry, Manifest
from snapshot._engine import runtime, state_dicts
from snapshot._engine.dist import dist
from snapshot._engine.dist.dist import Coordinator
from snapshot._engine.format import serialization as writers
from snapshot._engine.format.manifest_io import decode_manifest, read_manifest
from snapshot._engine.io.async_queue import AsyncRequest
from snapshot._engine.io.staging import process_pool
from snapshot._engine.restore.restore import rank_prefix, rank_view, read_object
from snapshot._engine.restore.restore import restore as restore_app_state
from snapshot._engine.runtime import gc_paused
from snapshot._engine.state_dicts import escape_key
from snapshot._engine.take.take import TakeJob
from snapshot.errors import EntryNotFoundError, InvalidArgumentError, SnapshotExistsError
from snapshot.metadata import SnapshotMetadata
from snapshot.options import Options, Progress, resolve
from snapshot.pending import PendingSnapshot

if TYPE_CHECKING:
    from snapshot._engine.progress import Reporter

T = TypeVar("T")
Prepare = Callable[[str, torch.Tensor, bool], torch.Tensor]
# What ``progress=`` takes: False (no progress), True (a bar, or log lines), or a callable.
ProgressArg = bool | Callable[[Progress], object]


class Snapshot:
    """A committed snapshot of an application's state.

    Create one with :meth:`Snapshot.take`, or open an existing one with ``Snapshot(path)``,
    which reads its manifest at once (its entries are decoded on first use).

    Args:
        path: a local path, or a URL whose prefix (``memory://``, ``s3://``, any fsspec
            protocol) picks the storage plugin.
        pg: the process group; None for the default group when ``torch.distributed`` is
            initialized, else this process alone.
        storage_options: options for the storage plugin (credentials, endpoints, ``fsync``...).
        options: the tunables the manifest is read with (:class:`~snapshot.Options`).

    Raises:
        SnapshotNotFoundError: no committed snapshot at ``path``
            (:class:`IncompleteSnapshotError` when a take started there but never committed).
        ChecksumError: the manifest's bytes do not match their checksum line.
        CorruptSnapshotError: the manifest's header cannot be decoded.
        IncompatibleSnapshotError: the manifest is of a newer format.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        pg: Any | None = None,
        storage_options: dict[str, Any] | None = None,
        *,
        options: Options | None = None,
        _manifest: Manifest | bytes | None = None,
        _committed: bool = False,
    ) -> None:
        self.path = path = state_dicts.snapshot_path(path, "Snapshot")
        state_dicts.process_group(pg, "Snapshot", path)
        self.pg = pg
        self.storage_options = state_dicts.options(storage_options, "Snapshot", path)
        resolved = resolve(options)
        # Bytes handed over by a take are checked when decoded; bytes read here were checked
        # as they were read. Decoding waits for first use: a training script that takes a
        # snapshot and goes on never pays for it.
        self._verify_manifest = bool(resolved.checksums) and _manifest is not None
        self._where = path
        self._resolved = resolved
        if _manifest is None and not _committed:
            _manifest, self._where = read_manifest(path, self.storage_options, resolved)
        # None: a take has just committed it (ranks other than 0 hold no copy); read on first
        # use, so that a rank that goes on training does not read it back.
        self._decoded: Manifest | bytes | None = _manifest

    @property
    def _manifest(self) -> Manifest:
        """The manifest, read (if a take handed none over) and decoded on first use."""
        if self._decoded is None:
            self._decoded, self._where = read_manifest(
                self.path, self.storage_options, self._resolved
            )
        if isinstance(self._decoded, bytes):
            self._decoded = decode_manifest(
                self._decoded, self._where, verify=self._verify_manifest
            )
        return self._decoded

    def __repr__(self) -> str:
        return f"Snapshot(path={self.path!r})"

    @classmethod
    def take(
        cls,
        path: str | os.PathLike[str],
        app_state: dict[str, Any],
        pg: Any | None = None,
        replicated: list[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        _custom_tensor_prepare_func: Prepare | None = None,
        *,
        options: Options | None = None,
        base: Snapshot | str | os.PathLike[str] | None = None,
        user_metadata: dict[str, Any] | None = None,
        progress: ProgressArg = False,
    ) -> Snapshot:
        """Takes a snapshot of ``app_state`` at ``path`` and returns it once committed.

        Args:
            path: where to write (see the class); must not hold a committed snapshot already.
            app_state: name -> Stateful (``nn.Module``, optimizer, LR scheduler,
                :class:`StateDict`, :class:`RNGState`, anything with ``state_dict()`` and
                ``load_state_dict()``).
            pg: the participating process group (see the class).
            replicated: globs of logical paths (``"model/**"``) whose values are the same on
                every rank (values with equal bytes are found without them too): written by
                one rank, listed once, restored by any rank.
            storage_options: options for the storage plugin.
            _custom_tensor_prepare_func: ``f(logical_path, tensor, tracing) -> tensor`` applied
                to each tensor before it is written (a cast to bf16, say), once while planning
                (``tracing=True``: only dtype and shape count) and once when writing.
            options: the tunables of this take (:class:`~snapshot.Options`).
            base: an earlier snapshot (or its path) in the same folder: CPU tensors whose
                digest equals the base's at the same path are not written but point at the
                base's bytes, so the base must stay (else :class:`MissingBaseError`).
            user_metadata: plain data (str keys; None, bool, int, finite float, str, lists and
                dicts of them) kept in the manifest, read back as ``metadata.user``.
            progress: False (the default): nothing is reported. True: a bar of the bytes this
                rank writes, drawn on stderr when it is a terminal (with ``tqdm``, imported
                then only), else an INFO line of the ``snapshot`` logger each tenth of the
                bytes. A callable: called with a :class:`~snapshot.options.Progress` record
                once the writes are planned (nothing done yet; on the calling thread), then
                each time a blob has been written (on the library's I/O thread, which waits for
                it: keep it quick). A callable that raises is logged once, as a warning with its
                traceback, and not called again; the take goes on and commits as without it.

        Raises:
            NotStatefulError: an app_state value is not Stateful.
            SnapshotExistsError: ``path`` holds a committed snapshot
                (:class:`PathNotEmptyError`: other files).
            StatefulError: a ``state_dict()`` raised.
            UnsupportedValueError: a value cannot be stored (a tensor on the meta device...).
            StorageError: the storage failed; nothing was committed.
            InvalidArgumentError: an argument is refused, before anything is written.

        Across ranks, the snapshot is written at rank 0's ``path``; a rank whose own ``path``
        differs gets a :class:`~snapshot.errors.PathMismatchWarning`.
        """
        # The cyclic collector stays paused for the whole take: the per-tensor records it
        # allocates would otherwise set off collections that walk them.
        with gc_paused():
            job, _ = take_job(
                "Snapshot.take", path, app_state, False, pg, replicated, storage_options,
                _custom_tensor_prepare_func, options=options, base=base,
                user_metadata=user_metadata, progress=progress,
            )  # fmt: skip
            try:
                _start(job)
                manifest = job.finish()
            finally:
                if job.progress is not None:
                    job.progress.end()
            taken_at, storage_options = job.path, job.storage_options
            del job
        return cls(taken_at, pg, storage_options, _manifest=manifest, _committed=True)

    @classmethod
    def async_take(
        cls,
        path: str | os.PathLike[str],
        app_state: dict[str, Any],
        pg: Any | None = None,
        replicated: list[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        _custom_tensor_prepare_func: Prepare | None = None,
        *,
        options: Options | None = None,
        base: Snapshot | str | os.PathLike[str] | None = None,
        user_metadata: dict[str, Any] | None = None,
        progress: ProgressArg = False,
        stage_in_background: bool = False,
    ) -> PendingSnapshot:
        """Like :meth:`take`, but returns once the state is captured; writes go on in the
        background.

        On return every tensor has been copied (within ``Options.memory_budget_bytes``, shared
        by the snapshots still pending: a larger state waits for earlier writes), so the
        caller may change its tensors at once. CUDA tensors are copied after the work queued on
        their device's current stream. Errors found while capturing are raised here; those of
        the background work by :meth:`PendingSnapshot.wait`. A ``base`` must be committed.
        A path that holds a snapshot (or other files) is refused here, before anything is
        written. ``progress`` is as for :meth:`take`: the writes, and so the reports, go on
        after the call returns, until the snapshot is committed (or fails).

        ``stage_in_background=True`` returns before the copies: once the state dicts are
        captured and planned (the tensors referenced, not copied); a thread of the library's
        copies them while the caller goes on. Until it is done, hooks hold each optimizer's
        ``step`` (an app_state value, or an attribute of one) and the ``forward`` of each
        module with buffers (BatchNorm's running statistics); change any other tensor of the
        state (a :class:`StateDict`'s, an object's) in place only after
        :meth:`PendingSnapshot.wait_staged`. The hooks are removed once staging ends (an
        optimizer's by its next step), and a staging error is raised by ``wait_staged`` and
        ``wait``.
        """
        call = "Snapshot.async_take"
        state_dicts.typed(stage_in_background, bool, call, "stage_in_background", str(path))
        job, background = take_job(
            call, path, app_state, True, pg, replicated, storage_options,
            _custom_tensor_prepare_func, options=options, base=base, user_metadata=user_metadata,
            progress=progress,
        )  # fmt: skip
        job.held = stage_in_background
        try:
            _start(job)
        except BaseException:
            if job.progress is not None:
                job.progress.end()
            raise
        guard = None
        if stage_in_background:  # imported only then: the plain take's path stays as it is
            from snapshot._engine.take.guard import StagingGuard

            guard = StagingGuard(app_state)
        finish = job.finish if job.progress is None else functools.partial(_finish, job)
        try:
            queue = runtime.get().queue()
            # The queue's one thread runs the commits in order: each waits for its writes,
            # agrees with the other ranks, and commits.
            index = queue.schedule_async_request(
                AsyncRequest(async_fn=finish, async_fn_args=(background,))
            )
            taken_at, stored = job.path, job.storage_options
            pending = PendingSnapshot(
                taken_at,
                queue,
                index,
                lambda manifest: cls(taken_at, pg, stored, _manifest=manifest, _committed=True),
                guard,
            )
        finally:
            # Last: from here the writes compete with the caller for cores and bandwidth.
            if guard is None:
                job.release_writes()
            else:  # staged, then released, on the guard's thread
                guard.start(job)
        return pending

    def restore(
        self,
        app_state: dict[str, Any],
        strict: bool = True,
        *,
        verify_first: bool = False,
        options: Options | None = None,
        progress: ProgressArg = False,
        verify_key: Any = None,
    ) -> None:
        """Restores ``app_state`` (the one taken, or a subset of its keys) from the snapshot.

        Tensors are loaded in place into the tensors each value's ``state_dict()`` returns
        (cast like ``Tensor.copy_``); then each value's ``load_state_dict`` is called with the
        restored state, :class:`RNGState` values last. Only the given keys' entries are read.

        Args:
            app_state: name -> Stateful, as for :meth:`take`.
            strict: with False, keys the snapshot lacks are left as they are (and named in a
                warning), and ``nn.Module`` values get ``load_state_dict(state,
                strict=False)``, as torchsnapshot passes it.
            verify_first: read every stored range first and check its CRC-32 (and the blobs'
                sizes) before any tensor is written or any ``load_state_dict`` called, on every
                rank of the group: damage then leaves every key untouched, at the cost of
                reading the in-place ranges twice. Every rank must pass the same value.
            options: the tunables of this restore (:class:`~snapshot.Options`).
            progress: as for :meth:`take`, of the bytes this rank reads: the callable is
                called once the reads are planned, then as each read lands (on the I/O
                thread); not for the checking pass of ``verify_first``, nor for the bytes
                another rank reads for this one.
            verify_key: a key (:meth:`snapshot.signing.SigningKey.load`: a public Ed25519 key,
                its PEM file, or the HMAC secret): first checks the snapshot's signature and the
                SHA-256 of its manifest and every blob (and its bases') with
                :func:`snapshot.signing.verify`, on every rank, and refuses an unsigned or wrongly
                signed snapshot with a ``SignatureError`` before anything is written (across
                ranks, a rank that refuses stops every rank: a ``RankFailedError`` naming it). Every
                blob is then read twice (once hashed, once restored). None (default): no check.

        Raises:
            StateMismatchError: a key is not in the snapshot (``strict`` only);
                :class:`ShapeMismatchError` when a tensor's shape differs (nothing is read).
            CorruptSnapshotError: a blob is missing, short, or undecodable.
            UnsafeObjectError: an object would need a type that is not allowed to load.
            StatefulError: a ``state_dict()`` or ``load_state_dict()`` raised.
            NotStatefulError: ``app_state`` is not a dict of str -> Stateful.
            InvalidArgumentError: ``strict`` or ``verify_first`` is not a bool, or
                ``progress`` neither a bool nor a callable.

        A failed restore says what it changed: its error's ``modified`` maps each key this
        rank wrote before the failure to ``"partially"`` or ``"fully"``, ``untouched`` names
        the keys left as they were, and the message ends with the same account.
        """
        state_dicts.typed(strict, bool, "Snapshot.restore", "strict", self.path)
        state_dicts.typed(verify_first, bool, "Snapshot.restore", "verify_first", self.path)
        wanted = _progress(progress, "Snapshot.restore", self.path)
        resolved = resolve(options)
        coordinator = dist.resolve(self.pg, resolved)
        if verify_key is not None:  # refused before any target is touched
            from snapshot.signing import verify

            error = None
            try:
                opts = self.storage_options
                verify(self.path, verify_key, storage_options=opts, options=resolved)
            except Exception as e:
                error = e
            if coordinator.world_size == 1:
                if error is not None:
                    raise error
            else:  # every rank's verdict: one rank refused means every rank stops
                coordinator.agree_outcome("restore: signature", error)
        reporter = _reporter(wanted, "restore", coordinator)
        try:
            with gc_paused():
                # Only a snapshot whose parts a registered strategy reads is restored.
                writers.check_readable(self._manifest.metadata, self.path)
                restore_app_state(
                    self._manifest,
                    app_state,
                    path=self.path,
                    coordinator=coordinator,
                    storage_options=self.storage_options,
                    options=resolved,
                    strict=strict,
                    verify_first=verify_first,
                    reporter=reporter,
                )
        finally:
            if reporter is not None:
                reporter.end()

    def read_object(
        self,
        path: str,
        obj_out: T | None = None,
        memory_budget_bytes: int | None = None,
        *,
        options: Options | None = None,
    ) -> T:
        """Reads one object of the snapshot by its manifest path (``"0/model/layer.weight"``),
        as ``torch.load`` gives it (tensors that were one memory share one storage).

        Args:
            path: a key of :meth:`get_manifest`; a container's path returns the whole container.
            obj_out: a tensor to load a stored tensor into in place (cast if its dtype differs;
                its shape must match); ignored for other values.
            memory_budget_bytes: most bytes of scratch memory to hold at once.
            options: the tunables of this read (:class:`~snapshot.Options`).

        Raises:
            EntryNotFoundError: no entry at ``path``.
            ShapeMismatchError: ``obj_out``'s shape differs from the stored tensor's.
            StateMismatchError: ``obj_out`` cannot receive the stored tensor; nothing is read.
            InvalidArgumentError: ``path`` is not a str, or ``memory_budget_bytes`` is not a
                positive int.
        """
        state_dicts.typed(path, str, "Snapshot.read_object", "path", self.path)
        state_dicts.byte_count(
            memory_budget_bytes, "Snapshot.read_object", "memory_budget_bytes", self.path
        )
        return read_object(
            self._manifest,
            path,
            obj_out,
            memory_budget_bytes,
            path=self.path,
            storage_options=self.storage_options,
            options=resolve(options),
        )

    def get_manifest(self) -> dict[str, Entry]:
        """Logical path -> entry (:mod:`manifest.entries`) for everything in the snapshot,
        every rank's; a replicated entry once, under rank 0's prefix."""
        return dict(self._manifest.entries)

    def get_state_dict_for_key(
        self, key: str, replicate_from_rank0: bool = False, *, options: Options | None = None
    ) -> Any:
        """The state dict stored for ``app_state[key]``, read without an object to load it
        into (tensors are new CPU tensors): this rank's (rank 0's for a rank the snapshot did
        not have), or rank 0's with ``replicate_from_rank0``. ``options``: the tunables of the
        read (:class:`Options`), as ``read_object`` takes them.

        Raises:
            EntryNotFoundError: no state under ``key`` for that rank (the message names the
                keys there are).
            InvalidArgumentError: ``key`` is not a str, or ``replicate_from_rank0`` not a bool.
        """
        call = "Snapshot.get_state_dict_for_key"
        state_dicts.typed(key, str, call, "key", self.path)
        state_dicts.typed(replicate_from_rank0, bool, call, "replicate_from_rank0", self.path)
        manifest = self._manifest
        # Asks torch only: ``dist.resolve`` may make a group, a collective, and this runs on
        # one rank alone.
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        alone = self.pg is None and not distributed
        rank = 0 if replicate_from_rank0 or alone else torch.distributed.get_rank(self.pg)
        prefix = rank_prefix(manifest, rank)
        root = prefix + escape_key(key)
        entries = rank_view(manifest, rank)  # rank 0's replicated leaves too
        if root not in entries:
            available = sorted(
                {p[len(prefix) :].split("/", 1)[0] for p in entries if p.startswith(prefix)}
            )
            raise EntryNotFoundError(
                f"snapshot {self.path} has no app_state key {key!r} under {prefix!r} (the "
                f"entries rank {rank} reads); it holds {available}"
            )
        return self.read_object(root, options=options)

    @functools.cached_property
    def metadata(self) -> SnapshotMetadata:
        """Facts about the snapshot (:class:`~snapshot.metadata.SnapshotMetadata`)."""
        return SnapshotMetadata.from_manifest(self._manifest)


def take_job(
    call: str,
    path: object,
    app_state: dict[str, Any],
    asynchronous: bool,
    pg: Any = None,
    replicated: object = None,
    storage_options: object = None,
    prepare: Any = None,
    *,
    options: Options | None = None,
    base: object = None,
    user_metadata: object = None,
    strategies: dict[str, Any] | None = None,
    progress: object = False,
) -> tuple[TakeJob, Any]:
    """The take job of ``take`` / ``async_take``, its arguments checked before anything is
    written, and (``asynchronous``) the coordinator its commit runs on in the background.
    ``strategies``: the writers recorded (``writers.recorded()``'s by default); ``progress``:
    the call's (the job's ``progress`` reports it; the caller ends it)."""
    where = state_dicts.snapshot_path(path, call)
    state_dicts.process_group(pg, call, where)
    state_dicts.function(prepare, call, "_custom_tensor_prepare_func", where)
    globs = state_dicts.glob_list(replicated, call, where)
    stored = state_dicts.options(storage_options, call, where)
    if isinstance(base, Snapshot):
        base = base.path
    base_path = None if base is None else state_dicts.snapshot_path(base, call, "base")
    user = state_dicts.user_metadata(user_metadata, call, where)
    wanted = _progress(progress, call, where)
    resolved = resolve(options)
    coordinator = dist.resolve(pg, resolved)
    job = TakeJob(
        where,
        app_state,
        strategies=writers.recorded() if strategies is None else strategies,
        coordinator=coordinator,
        replicated=globs,
        storage_options=stored,
        prepare=prepare,
        pool=process_pool(resolved) if asynchronous else None,
        options=resolved,
        base=base_path,
        user_metadata=user,
        progress=_reporter(wanted, "take", coordinator),
    )
    if not asynchronous or coordinator.world_size == 1:
        return job, coordinator if asynchronous else None
    # The background work agrees on a second gloo group, while the caller's thread uses the
    # first; making it is a collective, run here on every rank at the same point.
    return job, dist.GroupCoordinator(pg, resolved, background=True)


def _start(job: TakeJob) -> None:
    """``job.start()``. A path that holds a snapshot or other files is found there, before
    anything is written: its error is raised from the caller's call, without the frames that
    found it (the I/O loop's future, the agreement across ranks), which bury its message."""
    try:
        job.start()
    except SnapshotExistsError as e:  # PathNotEmptyError too
        raise e.with_traceback(None) from None


def _finish(job: TakeJob, coordinator: Any) -> bytes | None:
    """An async take's ``job.finish``, its progress ended after (a bar closed)."""
    try:
        return job.finish(coordinator)
    finally:
        assert job.progress is not None
        job.progress.end()


def _progress(progress: object, call: str, where: str) -> ProgressArg:
    """``progress``, refused unless a bool or a callable."""
    if isinstance(progress, bool) or callable(progress):
        return progress
    raise InvalidArgumentError(
        f"{call} of {where}: progress must be True, False or a callable taking a "
        f"snapshot.options.Progress, got {type(progress).__name__}"
    )


def _reporter(progress: ProgressArg, operation: str, coordinator: Coordinator) -> Reporter | None:
    """The reporter of ``progress``, None when it is False: only then is the progress module
    imported."""
    if progress is False:
        return None
    from snapshot._engine.progress import Reporter

    return Reporter(operation, progress, coordinator.rank, coordinator.world_size)
