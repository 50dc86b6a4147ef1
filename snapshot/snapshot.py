"""The public face: Snapshot.take / restore / read_object / get_manifest."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed

from manifest import Entry, Manifest
from snapshot._engine import arguments, runtime
from snapshot._engine.context import gc_paused
from snapshot._engine.dist import dist
from snapshot._engine.flatten import escape_key
from snapshot._engine.format import writers
from snapshot._engine.format.manifest_io import decode_manifest, read_manifest
from snapshot._engine.io.async_queue import AsyncRequest
from snapshot._engine.restore.restore import rank_prefix, rank_view, read_object
from snapshot._engine.restore.restore import restore as restore_app_state
from snapshot._engine.take.take import TakeJob
from snapshot.errors import EntryNotFoundError
from snapshot.metadata import SnapshotMetadata
from snapshot.options import Options, resolve
from snapshot.pending import PendingSnapshot

T = TypeVar("T")


class Snapshot:
    """A committed snapshot of an application's state.

    Create one with :meth:`Snapshot.take`, or reference an existing one with
    ``Snapshot(path)``, which reads its manifest at once.

    Args:
        path: where the snapshot is: a local path, or a URL whose prefix (``memory://``,
            ``s3://``, any fsspec protocol) picks the storage plugin.
        pg: the process group restoring the snapshot; None for the default group when
            ``torch.distributed`` is initialized, else this process alone.
        storage_options: options for the storage plugin (credentials, endpoints, ``fsync``...).
        options: the tunables the manifest is read with (``max_manifest_bytes``,
            ``checksums``...; :class:`~snapshot.Options`, fields left None from the
            environment).

    The manifest is read, and its checksum line and header checked, here; its entries are
    decoded on first use (``restore``, ``read_object``, ``get_manifest``, ``metadata``), which
    raises where they are damaged.

    Raises:
        SnapshotNotFoundError: no committed snapshot at ``path``
            (:class:`IncompleteSnapshotError` when a take started there but never committed).
        ChecksumError: the manifest's bytes do not match their checksum line.
        CorruptSnapshotError: the manifest's header cannot be decoded (its entries: on first
            use).
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
    ) -> None:
        path = arguments.snapshot_path(path, "Snapshot")
        arguments.process_group(pg, "Snapshot", path)
        storage_options = arguments.options(storage_options, "Snapshot", path)
        resolved = resolve(options)
        self.path = path
        self.pg = pg
        self.storage_options = storage_options
        # Whether the manifest's checksum line is checked when it is decoded: one handed over by
        # a take is; one read here was checked as it was read (``read_manifest``), and its bytes
        # are not checked twice.
        self._verify_manifest = bool(resolved.checksums) and _manifest is not None
        # The manifest's bytes are decoded on first use: a take hands over those it wrote (a
        # training script that takes a snapshot and goes on never pays for the decoding), and a
        # restore finds in the bytes read here what it will read, so that the store reads them
        # while the entries are decoded (``restore_app_state``'s ``ahead``). The checks that
        # need no decoding are made here (``read_manifest``).
        self._where = path
        if _manifest is None:
            _manifest, self._where = read_manifest(path, storage_options, resolved)
        self._decoded: Manifest | bytes = _manifest
        self._metadata: SnapshotMetadata | None = None  # built on first use of ``metadata``

    @property
    def _manifest(self) -> Manifest:
        return self._decode()

    def _decode(self) -> Manifest:
        """The manifest, decoded on first use."""
        m = self._decoded
        if isinstance(m, bytes):
            m = self._decoded = decode_manifest(m, self._where, verify=self._verify_manifest)
        return m

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
        _custom_tensor_prepare_func: Callable[[str, torch.Tensor, bool], torch.Tensor]
        | None = None,
        *,
        options: Options | None = None,
        base: Snapshot | str | os.PathLike[str] | None = None,
        user_metadata: dict[str, Any] | None = None,
    ) -> Snapshot:
        """Takes a snapshot of ``app_state`` at ``path`` and returns it once committed.

        Args:
            path: where to write (see the class); must not hold a committed snapshot already.
            app_state: name -> Stateful (``nn.Module``, optimizer, LR scheduler,
                :class:`StateDict`, :class:`RNGState`, anything with ``state_dict()`` and
                ``load_state_dict()``).
            pg: the participating process group (see the class).
            replicated: glob patterns of logical paths (``"model/**"``) whose values are the
                same on every rank: a path is replicated when every rank's patterns match it.
                Without them too, a take across ranks stores once every value whose bytes are
                equal on every rank (compared by a digest, ``snapshot._engine.dist.replication``). A
                replicated value is written by one rank, listed once in the manifest (under
                rank 0), and restored by any rank, on any number of ranks.
            storage_options: options for the storage plugin.
            _custom_tensor_prepare_func: ``f(logical_path, tensor, tracing) -> tensor`` applied
                to each tensor before it is written (to cast to bf16, say). It is called once
                with ``tracing=True`` while planning (only the result's dtype and shape are
                used) and once with ``tracing=False`` when writing; both must agree. The
                manifest records the prepared tensor's dtype and shape.
            options: the tunables of this take (:class:`~snapshot.Options`; fields left None,
                and all of them without one, from the environment).
            base: an earlier snapshot (a :class:`Snapshot` or its path) in the same folder as
                ``path``: an incremental take. Each CPU tensor whose bytes equal the base's at
                the same logical path (same dtype and shape, equal 128-bit digest) is not
                written; its entry points at the base's bytes. The base must stay as long as
                this snapshot is used (``Snapshot(path).metadata.bases`` names the snapshots
                it needs; :class:`~snapshot.CheckpointManager` keeps them); a restore whose
                base is gone raises :class:`MissingBaseError`. Only tensors of a base that
                recorded digests are compared (a take on a base, or with
                ``Options(digests=True)``, records them).
            user_metadata: a dict of plain data (str keys; None, bool, int, finite float,
                str, lists and dicts of them) kept in the manifest and read back as
                ``Snapshot(path).metadata.user``: the step, metrics, a run id.

        Raises:
            NotStatefulError: an app_state value is not Stateful.
            SnapshotExistsError: ``path`` already holds a committed snapshot;
                :class:`PathNotEmptyError` when it is a directory (or prefix) holding other
                files (local disk, memory and S3 are checked; an empty one is fine).
            StatefulError: a ``state_dict()`` raised.
            UnsupportedValueError: a value cannot be stored (a tensor on the meta device...).
            StorageError: the storage failed; nothing was committed.
            InvalidArgumentError: an argument is of the wrong kind (a path that is empty, or
                not a str or ``os.PathLike``; ``replicated`` not a list of str...); raised
                before anything is written.

        Across ranks, the snapshot is written at rank 0's ``path``; a rank whose own ``path``
        differs gets a :class:`~snapshot.errors.PathMismatchWarning`, and the returned
        snapshot's ``path`` is rank 0's.
        """
        path, replicated, storage_options = _take_arguments(
            "Snapshot.take", path, pg, replicated, storage_options, _custom_tensor_prepare_func
        )
        base_path = _base_argument("Snapshot.take", base, path)
        user = arguments.user_metadata(user_metadata, "Snapshot.take", path)
        resolved = resolve(options)
        # The cyclic collector stays paused for the whole take: it allocates a few objects per
        # tensor, which would otherwise set off collections that walk them (and, every so
        # often, the whole process) between its phases. Its per-tensor records are freed
        # before the collector resumes; what remains is the manifest.
        with gc_paused():
            job = TakeJob(
                path,
                app_state,
                strategies=writers.recorded(),
                coordinator=dist.resolve(pg, resolved),
                replicated=replicated,
                storage_options=storage_options,
                prepare=_custom_tensor_prepare_func,
                pool=None,
                options=resolved,
                base=base_path,
                user_metadata=user,
            )
            job.start()
            manifest = job.finish()
            taken_at = job.path
            del job
        return cls(taken_at, pg, storage_options, _manifest=manifest)

    @classmethod
    def async_take(
        cls,
        path: str | os.PathLike[str],
        app_state: dict[str, Any],
        pg: Any | None = None,
        replicated: list[str] | None = None,
        storage_options: dict[str, Any] | None = None,
        _custom_tensor_prepare_func: Callable[[str, torch.Tensor, bool], torch.Tensor]
        | None = None,
        *,
        options: Options | None = None,
        base: Snapshot | str | os.PathLike[str] | None = None,
        user_metadata: dict[str, Any] | None = None,
    ) -> PendingSnapshot:
        """Like :meth:`take`, but returns once the state is captured; writes go on in the
        background.

        When this returns, the snapshot's content is fixed: every tensor has been copied (within
        the memory budget, ``STATESNAP_MEMORY_BUDGET_BYTES``, which the snapshots still pending
        share; a state larger than what is left makes this call wait until enough writes have
        finished), so the caller may change or free its tensors at once. CUDA tensors are
        copied after the work already queued on their device's current stream (the calling
        thread's), and those copies are complete when this returns: kernels queued afterwards
        cannot reach the snapshot. Errors found while capturing are raised here; errors of the
        background work are raised by :meth:`PendingSnapshot.wait`. Arguments are checked as
        :meth:`take` checks them, and ranks that pass different paths are warned alike (the
        returned handle's ``path`` is rank 0's); ``options``, ``base`` and
        ``user_metadata`` are as :meth:`take` takes them (a base must be committed when this is
        called: wait for a pending one first).
        """
        prepare = _custom_tensor_prepare_func
        path, replicated, storage_options = _take_arguments(
            "Snapshot.async_take", path, pg, replicated, storage_options, prepare
        )
        base_path = _base_argument("Snapshot.async_take", base, path)
        user = arguments.user_metadata(user_metadata, "Snapshot.async_take", path)
        resolved = resolve(options)
        coordinator = dist.resolve(pg, resolved)
        background = dist.resolve_background(pg, resolved)
        job = TakeJob(
            path,
            app_state,
            strategies=writers.recorded(),
            coordinator=coordinator,
            replicated=replicated,
            storage_options=storage_options,
            prepare=_custom_tensor_prepare_func,
            pool=runtime.get().staging_pool(resolved),
            options=resolved,
            base=base_path,
            user_metadata=user,
        )
        job.start()
        try:
            queue = runtime.get().queue()
            # The queue's one thread runs the commits in order; each waits for this snapshot's
            # writes, then agrees with the other ranks on a group of its own, and commits.
            index = queue.schedule_async_request(
                AsyncRequest(async_fn=job.finish, async_fn_args=(background,))
            )
            taken_at = job.path
            pending = PendingSnapshot(
                taken_at,
                queue,
                index,
                lambda manifest: cls(taken_at, pg, storage_options, _manifest=manifest),
            )
        finally:
            # Last: from here the writes compete with the caller for cores and memory
            # bandwidth; they start while earlier snapshots are still being committed.
            job.release_writes()
        return pending

    def restore(
        self,
        app_state: dict[str, Any],
        strict: bool = True,
        *,
        verify_first: bool = False,
        options: Options | None = None,
    ) -> None:
        """Restores ``app_state`` (the one taken, or a subset of its keys) from the snapshot.

        Tensors are loaded in place into the tensors that each value's ``state_dict()`` returns
        (cast like ``Tensor.copy_`` when dtypes differ); then each value's ``load_state_dict`` is
        called with the restored state, :class:`RNGState` values last. Only the entries of the
        given keys are read.

        Args:
            app_state: name -> Stateful, as for :meth:`take`.
            strict: with False, keys of ``app_state`` that the snapshot does not hold are left
                as they are (and named in a warning), and ``torch.nn.Module`` values get
                ``load_state_dict(state, strict=False)``, as torchsnapshot passes it: their
                parameters and buffers the snapshot lacks keep their values, and entries the
                module lacks are ignored. Other values' ``load_state_dict`` get the state alone
                either way.
            verify_first: with True, every stored range the restore reads into the given
                values' tensors is read first and checked against its recorded CRC-32 (also
                with ``STATESNAP_CHECKSUMS=0``), and the blobs' sizes against the manifest,
                before any tensor is written or any ``load_state_dict`` is called; across a
                process group, every rank's checks pass before any rank writes. Damage then
                fails the restore with every key untouched. Objects and values read into new
                tensors are read once, in that first pass; the ranges read in place are read
                twice (once to check, once into the targets), so the restore reads up to twice
                the bytes, with no more memory than the budget it reads with. Ranges recorded
                without a CRC-32 (a snapshot taken with checksums off) are only checked to be
                there. Every rank must pass the same value.
            options: the tunables of this restore (:class:`~snapshot.Options`; fields left
                None, and all of them without one, from the environment).

        Raises:
            StateMismatchError: a key is not in the snapshot (``strict`` only);
                :class:`ShapeMismatchError` when a tensor's shape differs (nothing is read then).
            CorruptSnapshotError: a blob is missing, short, or undecodable.
            UnsafeObjectError: an object would need a type that is not allowed to load.
            StatefulError: a ``state_dict()`` or ``load_state_dict()`` raised.
            NotStatefulError: ``app_state`` is not a dict of str -> Stateful.
            InvalidArgumentError: ``strict`` or ``verify_first`` is not a bool.

        A failed restore says what it changed. On its error, whatever the kind, ``modified``
        maps each app_state key whose state this rank's restore wrote before the failure to
        ``"partially"`` or ``"fully"`` (its ``load_state_dict`` returned), ``untouched`` names
        the keys left exactly as they were, and the message ends with the same account. A key
        counts as written from the moment a read into its tensors begins (those tensors are
        usually the object's own memory) or its ``load_state_dict`` is called, and when it
        shares a tensor with a written key. An argument refused here, or a snapshot no
        registered strategy reads, fails before anything is read (``modified`` is None then).
        """
        arguments.flag(strict, "Snapshot.restore", "strict", self.path)
        arguments.flag(verify_first, "Snapshot.restore", "verify_first", self.path)
        resolved = resolve(options)
        coordinator = dist.resolve(self.pg, resolved)
        # The collector stays paused from the decoding to the end: a restore's one collection
        # over the entries decoded runs once it returns (``gc_paused``).
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
            )

    def read_object(
        self,
        path: str,
        obj_out: T | None = None,
        memory_budget_bytes: int | None = None,
        *,
        options: Options | None = None,
    ) -> T:
        """Reads one object of the snapshot by its manifest path (``"0/model/layer.weight"``).

        Values come back as ``torch.load`` gives them: tensors that were one memory (tied
        weights, a tensor and a slice of it) share one storage (entries of the same memory,
        dtype, shape and kind are one tensor object), and ``nn.Parameter`` and
        ``requires_grad`` are as they were taken.

        Args:
            path: a key of :meth:`get_manifest`; a container's path returns the whole container.
            obj_out: a tensor to load into in place (cast if its dtype differs; its shape must
                match). For a stored tensor it must be a tensor that can hold it; for other
                values (objects, primitives, containers), which cannot be loaded in place, it
                is ignored.
            memory_budget_bytes: most bytes of scratch memory to hold at once; reads into
                ``obj_out`` that need a cast go in tiles of at most this size.
            options: the tunables of this read (:class:`~snapshot.Options`; fields left None,
                and all of them without one, from the environment).

        Raises:
            EntryNotFoundError: no entry at ``path``.
            ShapeMismatchError: ``obj_out``'s shape differs from the stored tensor's.
            StateMismatchError: ``obj_out`` cannot receive the stored tensor (not a tensor,
                elements sharing memory, a dtype it cannot be cast to...); nothing is read.
            InvalidArgumentError: ``path`` is not a str, or ``memory_budget_bytes`` is not a
                positive int.
        """
        arguments.logical_path(path, "Snapshot.read_object", "path", self.path)
        arguments.byte_count(
            memory_budget_bytes, "Snapshot.read_object", "memory_budget_bytes", self.path
        )
        resolved = resolve(options)
        return read_object(
            self._manifest,
            path,
            obj_out,
            memory_budget_bytes,
            path=self.path,
            storage_options=self.storage_options,
            options=resolved,
        )

    def get_manifest(self) -> dict[str, Entry]:
        """Logical path -> entry for everything in the snapshot (every rank's entries; a
        replicated entry once, under rank 0's prefix, though ``read_object`` finds it under any
        rank's).

        Entries are frozen dataclasses (:mod:`manifest.entries`): ``TensorEntry`` (dtype, shape,
        chunks, ``nbytes``; ``parameter``, ``requires_grad`` and ``view`` when the tensor was an
        ``nn.Parameter``, required grad, or viewed another entry's storage), ``ObjectEntry``,
        ``PrimitiveEntry`` (the value itself), and ``DictEntry`` / ``ListEntry`` /
        ``TupleEntry`` for containers.
        """
        return dict(self._manifest.entries)

    def get_state_dict_for_key(
        self, key: str, replicate_from_rank0: bool = False, *, options: Options | None = None
    ) -> Any:
        """The state dict stored for ``app_state[key]``, read from the snapshot without an
        object to load it into (tensors are new CPU tensors).

        Args:
            key: an ``app_state`` key of the take.
            replicate_from_rank0: read rank 0's state, whatever this process's rank. Otherwise
                this rank's own (its rank in ``pg``, 0 without a process group), or rank 0's
                for a rank the snapshot did not have.
            options: the tunables of this read, as :meth:`read_object` takes them.

        Raises:
            EntryNotFoundError: the snapshot has no state under ``key`` for that rank; the
                message names the keys it has.
            InvalidArgumentError: ``key`` is not a str, or ``replicate_from_rank0`` not a bool.
        """
        call = "Snapshot.get_state_dict_for_key"
        arguments.logical_path(key, call, "key", self.path)
        arguments.flag(replicate_from_rank0, call, "replicate_from_rank0", self.path)
        manifest = self._manifest
        rank = 0 if replicate_from_rank0 else _rank(self.pg)
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

    @property
    def metadata(self) -> SnapshotMetadata:
        """Facts about the snapshot (:class:`~snapshot.metadata.SnapshotMetadata`): the library
        version that took it, its world size, its manifest (path -> entry), and what else the
        manifest records (torch version, creation time...)."""
        if self._metadata is None:
            self._metadata = SnapshotMetadata.from_manifest(self._manifest)
        return self._metadata


def _take_arguments(
    call: str,
    path: object,
    pg: object,
    replicated: object,
    storage_options: object,
    prepare: object,
) -> tuple[str, list[str], dict[str, Any] | None]:
    """The arguments of a take, checked before anything is written (``snapshot._engine.arguments``):
    the path as a str, the globs as a list, the storage options."""
    where = arguments.snapshot_path(path, call)
    arguments.process_group(pg, call, where)
    arguments.function(prepare, call, "_custom_tensor_prepare_func", where)
    return (
        where,
        arguments.glob_list(replicated, call, where),
        arguments.options(storage_options, call, where),
    )


def _base_argument(call: str, base: object, where: str) -> str | None:
    """An incremental take's ``base`` as a path (checked to be a sibling when the take
    starts: ``incremental.base_name``)."""
    if base is None:
        return None
    if isinstance(base, Snapshot):
        return base.path
    return arguments.snapshot_path(base, call, "base")


def _rank(pg: Any | None) -> int:
    """This process's rank in ``pg`` (the default group when None), 0 when ``torch.distributed``
    is not in use. Asks torch only: unlike ``dist.resolve``, makes no group (which would be a
    collective, and this is called on one rank alone)."""
    if pg is None and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 0
    return torch.distributed.get_rank(pg)
