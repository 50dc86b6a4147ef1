"""The methods of the async case (``ASYNC_METHODS``): calls that return before the state is
written, each with its wait, and the plain copies that bound how short such a call can be on
the CPU."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.common import (
    StateSpec,
    flatten_state,
)
from benchmarks.methods.base import State, nothing
from benchmarks.methods.engine import staging_figures
from benchmarks.methods.local import (
    WRITERS,
    dcp_prepare,
    ss_prepare,
    statesnap_path,
    ts_path,
    ts_prepare,
)


def _no_setup(spec: StateSpec, state: State) -> None:
    return None


@dataclass(frozen=True)
class AsyncMethod:
    """One way of capturing a state and finishing the write later.

    ``setup(spec, state)`` runs once per worker, untimed, before the first call; what it returns
    is passed to every ``start`` (the preallocated copy's destinations). ``start(spec, state,
    path, fsync, ctx)`` is the call that blocks the caller (the *stall*) and returns a handle;
    ``wait(handle)`` blocks until the handle's work is done. ``reader`` names the ``READERS``
    entry that reads the files back for the check; a method without one keeps its copy in the
    handle (a ``State``). ``pool_stats`` gives statesnap's staging pool (allocated, free bytes),
    ``budget`` the memory budget statesnap computes at that moment
    (from the available memory and the pool; both read by :mod:`benchmarks.methods.engine`).
    ``files``: it writes files (the fsync'd mode applies to it); ``self_fsync`` as for
    :class:`Writer`.
    """

    name: str
    label: str
    objects: bool
    start: Callable[[StateSpec, State, str, bool, Any], Any]
    wait: Callable[[Any], None]
    reader: str | None
    files: bool = True
    self_fsync: bool = True
    prepare: Callable[[], None] = nothing
    setup: Callable[[StateSpec, State], Any] = _no_setup
    pool_stats: Callable[[], tuple[int, int]] | None = None
    budget: Callable[[], int] | None = None
    note: str = ""


def _no_wait(handle: Any) -> None:
    return None


def _ss_async_start(spec: StateSpec, state: State, path: str, fsync: bool, ctx: Any) -> Any:
    from snapshot import Snapshot, StateDict

    app = {g: StateDict(d) for g, d in state.items()}
    return Snapshot.async_take(
        statesnap_path(path), app, storage_options=None if fsync else {"fsync": False}
    )


def _pending_wait(handle: Any) -> None:
    handle.wait()


def _ss_pool_stats() -> tuple[int, int]:
    allocated, free, _budget = staging_figures()
    return allocated, free


def _ss_budget() -> int:
    """The budget a take computes now (the pool's free blocks count as available)."""
    return staging_figures()[2]


def _small_budget_setup(spec: StateSpec, state: State) -> None:
    """A memory budget of a quarter of the state, for this worker (set before the staging pool
    exists, whose size it also bounds)."""
    os.environ["STATESNAP_MEMORY_BUDGET_BYTES"] = str(spec.nbytes // 4)


def _sync_start(writer: str) -> Callable[[StateSpec, State, str, bool, Any], Any]:
    """A synchronous writer's save as an async method's call: the whole save is the stall."""
    save = WRITERS[writer].save

    def start(spec: StateSpec, state: State, path: str, fsync: bool, ctx: Any) -> None:
        save(spec, state, path, fsync)

    return start


def _clone_start(spec: StateSpec, state: State, path: str, fsync: bool, ctx: Any) -> State:
    with torch.no_grad():
        return {
            g: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in d.items()}
            for g, d in state.items()
        }


def _prealloc_setup(spec: StateSpec, state: State) -> State:
    """Destinations of the state's shapes and dtypes, allocated and touched (zero-filled)."""
    from benchmarks.common import make_targets

    return make_targets(spec, with_objects=False)


def _prealloc_start(spec: StateSpec, state: State, path: str, fsync: bool, ctx: Any) -> State:
    with torch.no_grad():
        for t in spec.tensors:
            ctx[t.group][t.name].copy_(state[t.group][t.name])
    return ctx


def _ts_async_start(spec: StateSpec, state: State, path: str, fsync: bool, ctx: Any) -> Any:
    import torchsnapshot

    app = {g: torchsnapshot.StateDict(**d) for g, d in state.items()}
    return torchsnapshot.Snapshot.async_take(path=ts_path(path), app_state=app)


@dataclass
class _DcpPending:
    future: Any
    stager: Any


def _dcp_async_start(spec: StateSpec, state: State, path: str, fsync: bool, ctx: Any) -> Any:
    import torch.distributed.checkpoint as dcp

    if fsync:
        # As documented: the checkpoint_id picks FileSystemWriter (sync_files=True) and
        # async_save makes (and later closes) its DefaultStager.
        return _DcpPending(dcp.async_save(flatten_state(state), checkpoint_id=path), None)
    # The same stager async_save would make for a checkpoint_id, and a writer without fsync.
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(False, False, False, False))
    future = dcp.async_save(
        flatten_state(state),
        storage_writer=dcp.FileSystemWriter(path, sync_files=False),
        async_stager=stager,
    )
    return _DcpPending(future, stager)


def _dcp_async_wait(handle: Any) -> None:
    try:
        handle.future.result()
    finally:
        if handle.stager is not None:
            handle.stager.close()


_SS_ASYNC = AsyncMethod(
    "statesnap-async",
    "statesnap async_take",
    objects=True,
    start=_ss_async_start,
    wait=_pending_wait,
    reader="statesnap",
    prepare=ss_prepare,
    pool_stats=_ss_pool_stats,
    budget=_ss_budget,
    note="Snapshot.async_take(path, app_state) then pending.wait(); "
    'storage_options={"fsync": False} in the page-cache mode',
)


ASYNC_METHODS: dict[str, AsyncMethod] = {
    m.name: m
    for m in (
        _SS_ASYNC,
        dataclasses.replace(
            _SS_ASYNC,
            name="statesnap-async-budget",
            label="statesnap async_take, budget ¼ of the state",
            setup=_small_budget_setup,
            note="the same with STATESNAP_MEMORY_BUDGET_BYTES set to a quarter of the state's "
            "bytes: the call stages what fits, starts writing it, and stages the rest as writes "
            "free buffers",
        ),
        AsyncMethod(
            "statesnap-take",
            "statesnap take",
            objects=True,
            start=_sync_start("statesnap"),
            wait=_no_wait,
            reader="statesnap",
            prepare=ss_prepare,
            budget=_ss_budget,
            note="Snapshot.take (synchronous: the whole take is the stall)",
        ),
        AsyncMethod(
            "copy-fresh",
            "copy into fresh tensors",
            objects=True,
            start=_clone_start,
            wait=_no_wait,
            reader=None,
            files=False,
            note="t.clone() per tensor (new memory every call); writes nothing",
        ),
        AsyncMethod(
            "copy-prealloc",
            "copy into preallocated",
            objects=False,
            start=_prealloc_start,
            wait=_no_wait,
            reader=None,
            files=False,
            setup=_prealloc_setup,
            note="dst.copy_(src) per tensor into tensors allocated and zero-filled before the "
            "first call, the same ones every call; writes nothing",
        ),
        AsyncMethod(
            "torchsnapshot-async",
            "torchsnapshot async_take",
            objects=True,
            start=_ts_async_start,
            wait=_pending_wait,
            reader="torchsnapshot",
            self_fsync=False,
            prepare=ts_prepare,
            note="torchsnapshot 0.1.0 Snapshot.async_take then pending.wait(). Its known race: "
            "it does not copy CPU tensors before returning (the copy it means to make for async "
            "takes is skipped: `_should_copy_cpu_tensor` compares the entry's serializer "
            "string with the enum); tensors under its 128 MiB slab threshold are copied into "
            "slabs anyway, larger ones are written from the live tensor in the background. "
            "Never fsyncs (the harness fsyncs its files after wait, timed, in the fsync'd mode)",
        ),
        AsyncMethod(
            "dcp-async",
            "DCP async_save",
            objects=True,
            start=_dcp_async_start,
            wait=_dcp_async_wait,
            reader="dcp",
            prepare=dcp_prepare,
            note="dcp.async_save(flat_state_dict, checkpoint_id=dir) then future.result(), "
            "single process, no process group (fsync'd mode: sync_files=True, its default); in "
            "the page-cache mode storage_writer=FileSystemWriter(dir, sync_files=False) and "
            "async_stager=DefaultStager(StagingOptions(False, False, False, False)), the stager "
            "async_save makes for a checkpoint_id",
        ),
    )
}
