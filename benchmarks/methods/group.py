"""The methods of a process group: every rank saves and loads (``GROUP_WRITERS`` /
``GROUP_READERS``, the dist case), and DTensors restored into another sharding
(``RESHARD_METHODS``, the reshard case)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.common import (
    StateSpec,
)
from benchmarks.methods.base import Reader, State, Writer, nothing
from benchmarks.methods.local import (
    dcp_prepare,
    ss_load,
    ss_prepare,
    statesnap_path,
)

# ---------------------------------------------------------------------------------------------
# Every rank of a process group (the dist case): the model is the same on every rank.

# What statesnap is told is the same on every rank.
REPLICATED = ["model/**"]


def _dcp_group_state(state: State) -> dict[str, Any]:
    """``{"model": {...}, "optim": {"rank<r>": {...}}}``: the model under the same keys on every
    rank (DCP writes it once), each rank's own state under keys no other rank has."""
    import torch.distributed as dist

    return {"model": state["model"], "optim": {f"rank{dist.get_rank()}": state["optim"]}}


def _dcp_group_save(spec: StateSpec, state: State, path: str, fsync: bool) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(_dcp_group_state(state), storage_writer=dcp.FileSystemWriter(path, sync_files=fsync))


def _dcp_group_load(spec: StateSpec, path: str, targets: State | None) -> State:
    import torch.distributed.checkpoint as dcp

    assert targets is not None
    nested = _dcp_group_state(targets)
    dcp.load(nested, checkpoint_id=path)
    (own,) = nested["optim"].values()
    return {"model": nested["model"], "optim": own}


def _ss_group_save(spec: StateSpec, state: State, path: str, fsync: bool) -> None:
    from snapshot import Snapshot, StateDict

    app = {g: StateDict(d) for g, d in state.items()}
    Snapshot.take(
        statesnap_path(path),
        app,
        replicated=REPLICATED,
        storage_options=None if fsync else {"fsync": False},
    )


GROUP_WRITERS: dict[str, Writer] = {
    w.name: w
    for w in (
        Writer(
            "statesnap",
            objects=True,
            self_fsync=True,
            save=_ss_group_save,
            prepare=ss_prepare,
            note='Snapshot.take(path, app_state, replicated=["model/**"]) on every rank; '
            'storage_options={"fsync": False} in the page-cache mode',
        ),
        Writer(
            "dcp",
            objects=True,
            self_fsync=True,
            save=_dcp_group_save,
            prepare=dcp_prepare,
            note="dcp.save on every rank, default planner (dedups keys every rank has), "
            "FileSystemWriter(sync_files=<mode>), thread_count=1 (default); each rank's own "
            "state under optim.rank<r>",
        ),
    )
}

GROUP_READERS: dict[str, Reader] = {
    r.name: r
    for r in (
        Reader(
            "statesnap",
            "statesnap",
            objects=True,
            into_targets=True,
            load=ss_load,
            prepare=ss_prepare,
            note="Snapshot(path) (every rank reads the manifest) + restore, in place, on every "
            "rank",
        ),
        Reader(
            "dcp",
            "dcp",
            objects=True,
            into_targets=True,
            load=_dcp_group_load,
            prepare=dcp_prepare,
            note="dcp.load(state_dict, checkpoint_id=dir) into preallocated targets on every rank",
        ),
    )
}


# ---------------------------------------------------------------------------------------------
# Resharding (the reshard case): a state of DTensors saved by every rank of one group, loaded
# into another sharding by every rank of another (or into plain tensors by one process).


@dataclass(frozen=True)
class ReshardMethod:
    """One way of saving ``state`` (name -> DTensor, this rank's pieces) and of loading it into
    ``targets`` (name -> DTensor of another placement or mesh, or plain tensor), in place.

    ``save(state, path, fsync)``: the method fsyncs its own files when ``fsync``, else none.
    ``load(targets, path)`` returns name -> the restored value (the worker checks that each is
    still the target, with the same local memory).
    """

    name: str
    save: Callable[[dict[str, Any], str, bool], None]
    load: Callable[[dict[str, Any], str], dict[str, Any]]
    prepare: Callable[[], None] = nothing
    save_note: str = ""
    load_note: str = ""


def _dtensor_prepare() -> None:
    # What building the DTensors imports anyway, outside the timed region.
    import torch.distributed.tensor  # noqa: F401


def _ss_reshard_prepare() -> None:
    ss_prepare()
    _dtensor_prepare()


def _ss_reshard_save(state: dict[str, Any], path: str, fsync: bool) -> None:
    from snapshot import Snapshot, StateDict

    Snapshot.take(
        statesnap_path(path),
        {"model": StateDict(state)},
        storage_options=None if fsync else {"fsync": False},
    )


def _ss_reshard_load(targets: dict[str, Any], path: str) -> dict[str, Any]:
    from snapshot import Snapshot, StateDict

    app = {"model": StateDict(targets)}
    Snapshot(statesnap_path(path)).restore(app)
    return dict(app["model"].data)


def _dcp_reshard_prepare() -> None:
    dcp_prepare()
    _dtensor_prepare()


def _dcp_reshard_save(state: dict[str, Any], path: str, fsync: bool) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": state}, storage_writer=dcp.FileSystemWriter(path, sync_files=fsync))


def _dcp_reshard_load(targets: dict[str, Any], path: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    nested = {"model": dict(targets)}
    dcp.load(nested, checkpoint_id=path)
    return nested["model"]


RESHARD_METHODS: dict[str, ReshardMethod] = {
    m.name: m
    for m in (
        ReshardMethod(
            "statesnap",
            save=_ss_reshard_save,
            load=_ss_reshard_load,
            prepare=_ss_reshard_prepare,
            save_note='Snapshot.take(path, {"model": StateDict(dtensors)}) on every rank '
            '(storage_options={"fsync": False} in the page-cache mode)',
            load_note='Snapshot(path) (every rank reads the manifest) + restore({"model": '
            "StateDict(targets)}) on every rank: each target DTensor's local tensor (or each "
            "plain tensor, in one process) filled in place with the runs of bytes its region "
            "makes in the stored shards, read straight into it (through gaps of up to "
            "STATESNAP_READ_GAP_BYTES between runs)",
        ),
        ReshardMethod(
            "dcp",
            save=_dcp_reshard_save,
            load=_dcp_reshard_load,
            prepare=_dcp_reshard_prepare,
            save_note='dcp.save({"model": dtensors}, storage_writer=FileSystemWriter(dir, '
            "sync_files=<mode>)) on every rank, default planner, thread_count=1 (default); in "
            "the fsync'd mode the same as checkpoint_id=dir",
            load_note='dcp.load({"model": targets}, checkpoint_id=dir) on every rank, default '
            "planner: each target's local tensor (or plain tensor) filled in place; its "
            "FileSystemReader reads every stored chunk that overlaps a target whole "
            "(torch.load of the chunk) and copies the overlap",
        ),
    )
}
