"""The methods compared: how each one saves a generated state and loads it back.

A :class:`Writer` saves ``state`` (group -> name -> tensor or object) under a directory of its
own; a :class:`Reader` loads what a writer saved, either into preallocated targets (in place) or
into tensors it allocates itself. Each call here is what the harness times; everything else
(imports, generating the state, allocating targets, checking) happens outside the timed region.

Writers: ``raw``, ``raw-direct`` (the same bytes written past the page cache, O_DIRECT: what
the device itself takes; no reader), ``torch.save``, ``dcp``, ``safetensors``,
``torchsnapshot``, ``statesnap``, ``statesnap-direct`` (direct I/O in both modes, slabs too; no
reader),
``statesnap-buffered`` (every file through the page cache in both modes; no reader).
Readers: ``raw`` (readinto preallocated), ``raw fresh`` (readinto new tensors), ``torch.load``,
``torch.load mmap`` (mmap'd, then ``copy_`` into preallocated targets, so every byte is read),
``dcp`` (into preallocated), ``safetensors`` (``load_file``, whose tensors are mmap-backed and
read lazily, then ``copy_`` into preallocated targets), ``torchsnapshot``
(into preallocated), ``statesnap`` (in place), and ``statesnap get_manifest`` (``Snapshot(path)``
plus ``get_manifest()``; the scaling case).

Python objects go only to the methods that store them: statesnap, torchsnapshot, torch.save and
DCP. ``raw`` stores tensor bytes only (the reader knows the layout from the spec) and
safetensors stores tensors only (its metadata is str -> str).

``GROUP_WRITERS`` / ``GROUP_READERS`` are the same calls made by every rank of a process group
(the ``dist`` case; the worker has initialized the group): statesnap with
``replicated=["model/**"]``, and DCP with its default planner, which writes a key that every rank
has only once. DCP decides that by key alone, so each rank's own state goes under a key of its
own (``optim.rank<r>...``): under one shared key, DCP would keep one rank's values and drop the
others'.

``RESHARD_METHODS`` (the reshard case) save a state of DTensors on every rank of a group and
load it into DTensors of another sharding, on a group of another size, or into plain tensors in
one process: statesnap's ``Snapshot.take`` / ``Snapshot(path).restore`` and DCP's ``dcp.save`` /
``dcp.load``, both filling the targets in place.

``S3_WRITERS`` / ``S3_READERS`` (the s3 case) save to and load from an S3 endpoint, ``path``
being an ``s3://bucket/prefix`` URL: statesnap's S3 plugin; ``raw-stream``, the tensor bytes as
one multipart upload through s3fs and one streaming GET back into the preallocated tensors;
torch.save into memory + s3fs ``pipe`` / s3fs ``cat`` + torch.load; torchsnapshot's S3 plugin
(endpoint and credentials from the AWS_* environment, the only way it takes them); DCP with
its fsspec writer and reader. The worker passes the endpoint in first (``configure_s3``).

``ASYNC_METHODS`` (the async case) are calls that return before the state is written, each with
its wait: statesnap's ``async_take``, torchsnapshot's ``async_take`` and DCP's ``async_save``;
statesnap's synchronous take for contrast; and two plain copies of the state's tensors (into new
tensors, into preallocated ones) that bound how short such a call can be on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import mmap
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.common import (
    CheckResult,
    StateSpec,
    check_restored,
    flatten_state,
    unflatten_state,
    writable_buffer,
)

State = dict[str, dict[str, Any]]


def _quiet() -> None:
    """DCP warns that it runs without a process group; torchsnapshot about TypedStorage."""
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class Writer:
    """One way of saving a state.

    ``self_fsync``: in the "fsync'd" mode the method makes its own files durable; otherwise the
    harness fsyncs every file and directory it wrote, inside the timed region.
    """

    name: str
    objects: bool
    self_fsync: bool
    save: Callable[[StateSpec, State, str, bool], None]
    prepare: Callable[[], None] = _nothing
    note: str = ""


@dataclass(frozen=True)
class Reader:
    """One way of loading what ``writer`` saved.

    ``into_targets``: loads into preallocated, already-touched tensors (the worker allocates
    them before the timed region); else the reader allocates what it returns.
    """

    name: str
    writer: str
    objects: bool
    into_targets: bool
    load: Callable[[StateSpec, str, State | None], Any]
    prepare: Callable[[], None] = _nothing
    verify: Callable[[StateSpec, Any, bool], CheckResult] = check_restored
    note: str = ""


# ---------------------------------------------------------------------------------------------
# raw: the tensor bytes, one after another, in one file.


def _raw_file(path: str) -> str:
    return os.path.join(path, "raw.bin")


def _raw_save(spec: StateSpec, state: State, path: str, fsync: bool) -> None:
    with open(_raw_file(path), "wb") as f:
        for t in spec.tensors:
            f.write(writable_buffer(state[t.group][t.name]))


def _raw_direct_save(spec: StateSpec, state: State, path: str, fsync: bool) -> None:
    """The tensor bytes, one after another, copied into one page-aligned 8 MiB buffer and
    written from it with O_DIRECT whenever it is full (the kernel wants aligned addresses,
    offsets and lengths); the last piece padded to 4 KiB and the file cut back to its length."""
    piece = 8 << 20
    buf = memoryview(mmap.mmap(-1, piece))
    fd = os.open(_raw_file(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        pos = fill = 0
        for t in spec.tensors:
            data = memoryview(writable_buffer(state[t.group][t.name])).cast("B")
            off = 0
            while off < len(data):
                k = min(len(data) - off, piece - fill)
                buf[fill : fill + k] = data[off : off + k]
                fill, off = fill + k, off + k
                if fill == piece:
                    _pwrite_whole(fd, buf, pos)
                    pos, fill = pos + piece, 0
        if fill:
            _pwrite_whole(fd, buf[: -(-fill // 4096) * 4096], pos)
            os.ftruncate(fd, pos + fill)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _pwrite_whole(fd: int, buf: memoryview, pos: int) -> None:
    n = os.pwrite(fd, buf, pos)
    if n != len(buf):  # a short direct write cannot be resumed at an unaligned offset
        raise OSError(f"direct write of {len(buf)} bytes at {pos} wrote {n}")


def _readinto_full(f: Any, buf: memoryview, name: str) -> None:
    pos = 0
    while pos < len(buf):
        n = f.readinto(buf[pos:])
        if not n:
            raise EOFError(f"{name}: file ended {len(buf) - pos} bytes short")
        pos += n


def _raw_load(spec: StateSpec, path: str, targets: State | None) -> State:
    assert targets is not None
    with open(_raw_file(path), "rb", buffering=0) as f:
        for t in spec.tensors:
            _readinto_full(f, writable_buffer(targets[t.group][t.name]), t.flat_key)
    return targets


def _raw_load_fresh(spec: StateSpec, path: str, targets: State | None) -> State:
    out: State = {g: {} for g in spec.groups}
    with open(_raw_file(path), "rb", buffering=0) as f:
        for t in spec.tensors:
            tensor = torch.empty(t.shape, dtype=t.dtype)
            _readinto_full(f, writable_buffer(tensor), t.flat_key)
            out[t.group][t.name] = tensor
    return out


# ---------------------------------------------------------------------------------------------
# torch.save / torch.load.


def _pt_file(path: str) -> str:
    return os.path.join(path, "state.pt")


def _torch_save(spec: StateSpec, state: State, path: str, fsync: bool) -> None:
    torch.save(flatten_state(state), _pt_file(path))


def _torch_load(spec: StateSpec, path: str, targets: State | None) -> State:
    return unflatten_state(torch.load(_pt_file(path), weights_only=True), spec)


def _torch_load_mmap(spec: StateSpec, path: str, targets: State | None) -> State:
    assert targets is not None
    loaded = torch.load(_pt_file(path), mmap=True, weights_only=True)
    for t in spec.tensors:
        targets[t.group][t.name].copy_(loaded[t.flat_key])
    for key, _value in spec.flat_objects().items():
        group, _, name = key.partition(".")
        targets[group][name] = loaded[key]
    return targets


# ---------------------------------------------------------------------------------------------
# torch.distributed.checkpoint, single process, no process group.


def _dcp_prepare() -> None:
    _quiet()
    import torch.distributed.checkpoint  # noqa: F401


def _dcp_save(spec: StateSpec, state: State, path: str, fsync: bool) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(flatten_state(state), storage_writer=dcp.FileSystemWriter(path, sync_files=fsync))


def _dcp_load(spec: StateSpec, path: str, targets: State | None) -> State:
    import torch.distributed.checkpoint as dcp

    assert targets is not None
    flat = flatten_state(targets)
    dcp.load(flat, checkpoint_id=path)
    return unflatten_state(flat, spec)


# ---------------------------------------------------------------------------------------------
# safetensors.


def _st_file(path: str) -> str:
    return os.path.join(path, "state.safetensors")


def _st_prepare() -> None:
    import safetensors.torch  # noqa: F401


def _st_save(spec: StateSpec, state: State, path: str, fsync: bool) -> None:
    from safetensors.torch import save_file

    save_file({t.flat_key: state[t.group][t.name] for t in spec.tensors}, _st_file(path))


def _st_load(spec: StateSpec, path: str, targets: State | None) -> State:
    from safetensors.torch import load_file

    # load_file returns tensors backed by an mmap of the file (nothing is read until touched),
    # so copy them into the targets, as load_state_dict would: every byte is read.
    assert targets is not None
    loaded = load_file(_st_file(path))
    for t in spec.tensors:
        targets[t.group][t.name].copy_(loaded[t.flat_key])
    return targets


# ---------------------------------------------------------------------------------------------
# torchsnapshot 0.1.0.


def _ts_prepare() -> None:
    _quiet()
    import torchsnapshot  # noqa: F401


def _ts_path(path: str) -> str:
    return os.path.join(path, "torchsnapshot")


def _ts_save(spec: StateSpec, state: State, path: str, fsync: bool) -> None:
    import torchsnapshot

    app = {g: torchsnapshot.StateDict(**d) for g, d in state.items()}
    torchsnapshot.Snapshot.take(path=_ts_path(path), app_state=app)


def _ts_load(spec: StateSpec, path: str, targets: State | None) -> State:
    import torchsnapshot

    assert targets is not None
    app = {g: torchsnapshot.StateDict(**d) for g, d in targets.items()}
    torchsnapshot.Snapshot(path=_ts_path(path)).restore(app_state=app)
    return {g: dict(app[g]) for g in app}


# ---------------------------------------------------------------------------------------------
# statesnap.


def _ss_prepare() -> None:
    # The local storage plugin is imported on first use: import it here, before the clock
    # starts, as every other method's modules are (where bytecode is not cached, compiling it
    # inside the first timed call cost about 4 ms).
    import snapshot  # noqa: F401
    import storage_plugins.fs  # noqa: F401


def statesnap_path(path: str) -> str:
    return os.path.join(path, "statesnap")


def _ss_save(
    spec: StateSpec, state: State, path: str, fsync: bool, direct_io: bool | None = None
) -> None:
    """``Snapshot.take``; ``direct_io`` None leaves the library's "auto" (the default)."""
    from snapshot import Snapshot, StateDict

    app = {g: StateDict(d) for g, d in state.items()}
    options: dict[str, Any] = {} if fsync else {"fsync": False}
    if direct_io is not None:
        options["direct_io"] = direct_io
    Snapshot.take(statesnap_path(path), app, storage_options=options or None)


def _ss_load(spec: StateSpec, path: str, targets: State | None) -> State:
    from snapshot import Snapshot, StateDict

    assert targets is not None
    app = {g: StateDict(d) for g, d in targets.items()}
    Snapshot(statesnap_path(path)).restore(app)
    return {g: dict(app[g].data) for g in app}


def _ss_manifest(spec: StateSpec, path: str, targets: State | None) -> dict[str, Any]:
    from snapshot import Snapshot

    return Snapshot(statesnap_path(path)).get_manifest()


def _ss_verify_manifest(spec: StateSpec, manifest: Any, with_objects: bool) -> CheckResult:
    missing = [
        key
        for key in (
            [f"0/{t.group}/{t.name}" for t in spec.tensors]
            + [f"0/{g}/{k}" for g, objs in spec.objects.items() for k in objs]
        )
        if key not in manifest
    ]
    if missing:
        return CheckResult(False, f"MISMATCH: {len(missing)} leaves missing, e.g. {missing[0]}")
    return CheckResult(True, f"ok ({len(manifest)} entries, every leaf present)")


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


# ---------------------------------------------------------------------------------------------
# The tables.

WRITERS: dict[str, Writer] = {
    w.name: w
    for w in (
        Writer(
            "raw",
            objects=False,
            self_fsync=False,
            save=_raw_save,
            note="tensor bytes in one file, one f.write(memoryview) per tensor",
        ),
        Writer(
            "raw-direct",
            objects=False,
            self_fsync=True,
            save=_raw_direct_save,
            note="the same file written with O_DIRECT from an aligned 8 MiB buffer "
            "(fsync'd in the fsync'd mode)",
        ),
        Writer(
            "torch.save", objects=True, self_fsync=False, save=_torch_save, note="one flat dict"
        ),
        Writer(
            "dcp",
            objects=True,
            self_fsync=True,
            save=_dcp_save,
            prepare=_dcp_prepare,
            note="FileSystemWriter(sync_files=<mode>), thread_count=1 (default)",
        ),
        Writer(
            "safetensors",
            objects=False,
            self_fsync=False,
            save=_st_save,
            prepare=_st_prepare,
            note="save_file, tensors only",
        ),
        Writer(
            "torchsnapshot",
            objects=True,
            self_fsync=False,
            save=_ts_save,
            prepare=_ts_prepare,
            note="Snapshot.take; 0.1.0 never fsyncs",
        ),
        Writer(
            "statesnap",
            objects=True,
            self_fsync=True,
            save=_ss_save,
            prepare=_ss_prepare,
            note="Snapshot.take (fsync'd, the default: files of 1 MiB and more written with "
            "direct I/O, but slabs of small tensors through the page cache); "
            'storage_options={"fsync": False} in the page-cache mode (the same on a VM that '
            "hands its free memory back to the host)",
        ),
        Writer(
            "statesnap-direct",
            objects=True,
            self_fsync=True,
            save=functools.partial(_ss_save, direct_io=True),
            prepare=_ss_prepare,
            note='Snapshot.take; storage_options={"fsync": <mode>, "direct_io": True}: '
            "every file of 1 MiB and more, slabs too, past the page cache, in the page-cache "
            "mode all the same (no fsync)",
        ),
        Writer(
            "statesnap-buffered",
            objects=True,
            self_fsync=True,
            save=functools.partial(_ss_save, direct_io=False),
            prepare=_ss_prepare,
            note='Snapshot.take; storage_options={"fsync": <mode>, "direct_io": False}: '
            "every file through the page cache in both modes",
        ),
    )
}

READERS: dict[str, Reader] = {
    r.name: r
    for r in (
        Reader(
            "raw",
            "raw",
            objects=False,
            into_targets=True,
            load=_raw_load,
            note="readinto preallocated tensors",
        ),
        Reader(
            "raw fresh",
            "raw",
            objects=False,
            into_targets=False,
            load=_raw_load_fresh,
            note="readinto new torch.empty tensors",
        ),
        Reader(
            "torch.load",
            "torch.save",
            objects=True,
            into_targets=False,
            load=_torch_load,
            note="weights_only=True; new tensors",
        ),
        Reader(
            "torch.load mmap",
            "torch.save",
            objects=True,
            into_targets=True,
            load=_torch_load_mmap,
            note="mmap=True, then copy_ into preallocated targets (every byte read)",
        ),
        Reader(
            "dcp",
            "dcp",
            objects=True,
            into_targets=True,
            load=_dcp_load,
            prepare=_dcp_prepare,
            note="dcp.load into preallocated targets",
        ),
        Reader(
            "safetensors",
            "safetensors",
            objects=False,
            into_targets=True,
            load=_st_load,
            prepare=_st_prepare,
            note="load_file (mmap-backed tensors), then copy_ into preallocated targets",
        ),
        Reader(
            "torchsnapshot",
            "torchsnapshot",
            objects=True,
            into_targets=True,
            load=_ts_load,
            prepare=_ts_prepare,
            note="restore into preallocated targets",
        ),
        Reader(
            "statesnap",
            "statesnap",
            objects=True,
            into_targets=True,
            load=_ss_load,
            prepare=_ss_prepare,
            note="Snapshot(path) (reads the manifest) + restore, in place",
        ),
        Reader(
            "statesnap get_manifest",
            "statesnap",
            objects=True,
            into_targets=False,
            load=_ss_manifest,
            prepare=_ss_prepare,
            verify=_ss_verify_manifest,
            note="Snapshot(path) + get_manifest()",
        ),
    )
}


GROUP_WRITERS: dict[str, Writer] = {
    w.name: w
    for w in (
        Writer(
            "statesnap",
            objects=True,
            self_fsync=True,
            save=_ss_group_save,
            prepare=_ss_prepare,
            note='Snapshot.take(path, app_state, replicated=["model/**"]) on every rank; '
            'storage_options={"fsync": False} in the page-cache mode',
        ),
        Writer(
            "dcp",
            objects=True,
            self_fsync=True,
            save=_dcp_group_save,
            prepare=_dcp_prepare,
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
            load=_ss_load,
            prepare=_ss_prepare,
            note="Snapshot(path) (every rank reads the manifest) + restore, in place, on every "
            "rank",
        ),
        Reader(
            "dcp",
            "dcp",
            objects=True,
            into_targets=True,
            load=_dcp_group_load,
            prepare=_dcp_prepare,
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
    prepare: Callable[[], None] = _nothing
    save_note: str = ""
    load_note: str = ""


def _dtensor_prepare() -> None:
    # What building the DTensors imports anyway, outside the timed region.
    import torch.distributed.tensor  # noqa: F401


def _ss_reshard_prepare() -> None:
    _ss_prepare()
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
    _dcp_prepare()
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


def readers_of(writer: str) -> list[str]:
    """Readers that load what ``writer`` saved (without the manifest-only reader)."""
    return [r.name for r in READERS.values() if r.writer == writer and "manifest" not in r.name]


# ---------------------------------------------------------------------------------------------
# S3 (the s3 case): every method against one S3 endpoint, ``path`` an ``s3://bucket/prefix``
# URL. The worker calls ``configure_s3`` with the job's endpoint first.

# The endpoint and credentials as s3fs's options (``storage_options``), the extra options
# statesnap gets (``--s3-option``), and the S3 server's pid; set by ``configure_s3``.
S3_ENDPOINT: dict[str, Any] = {}

# Part size of the raw stream's multipart upload: statesnap's default part size.
RAW_STREAM_PART_BYTES = 32 << 20


def configure_s3(config: dict[str, Any]) -> None:
    """Points the S3 methods at ``config["storage_options"]`` (s3fs's options: endpoint_url,
    key, secret, client_kwargs); ``config["statesnap_options"]`` go to statesnap only."""
    S3_ENDPOINT.clear()
    S3_ENDPOINT.update(config)


# The SDK settings statesnap's plugin uses by default, given to the s3fs-based peers too, so
# that the comparison is of the methods and not of botocore's defaults: no SHA-256 of every
# body for the signature (botocore computes it over plain http, as to this local server, but
# not over https, as to AWS) and no SDK checksum of every request and response.
PEER_S3_CONFIG = {
    "request_checksum_calculation": "when_required",
    "response_checksum_validation": "when_required",
    "s3": {"payload_signing_enabled": False},
}


def _s3_options() -> dict[str, Any]:
    if "storage_options" not in S3_ENDPOINT:
        raise RuntimeError("no S3 endpoint configured (configure_s3 was not called)")
    return {**S3_ENDPOINT["storage_options"], "config_kwargs": PEER_S3_CONFIG}


def _s3_ss_options() -> dict[str, Any]:
    # statesnap with its own defaults (the same SDK settings as PEER_S3_CONFIG).
    return {**S3_ENDPOINT["storage_options"], **S3_ENDPOINT.get("statesnap_options", {})}


def _s3_fs(**kwargs: Any) -> Any:
    """A new synchronous s3fs filesystem on the endpoint (its client is made on first use,
    inside the timed call, as statesnap's plugin makes its own)."""
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, **_s3_options(), **kwargs)


def _s3_prepare() -> None:
    _quiet()
    import s3fs  # noqa: F401


def _s3_url(path: str, name: str) -> str:
    return f"{path.rstrip('/')}/{name}"


def _s3_ss_prepare() -> None:
    _s3_prepare()
    import snapshot  # noqa: F401
    import storage_plugins.s3  # noqa: F401


def _s3_ss_save(spec: StateSpec, state: State, path: str, fsync: bool) -> None:
    from snapshot import Snapshot, StateDict

    app = {g: StateDict(d) for g, d in state.items()}
    Snapshot.take(path, app, storage_options=_s3_ss_options())


def _s3_ss_load(spec: StateSpec, path: str, targets: State | None) -> State:
    from snapshot import Snapshot, StateDict

    assert targets is not None
    app = {g: StateDict(d) for g, d in targets.items()}
    Snapshot(path, storage_options=_s3_ss_options()).restore(app)
    return {g: dict(app[g].data) for g in app}


def _raw_stream_save(spec: StateSpec, state: State, path: str, fsync: bool) -> None:
    # s3fs buffers what is written and, whenever the buffer holds block_size bytes, uploads
    # parts of exactly that size (fixed_upload_size), one after the other; writing in slices of
    # at most a part keeps its buffer under two parts.
    fs = _s3_fs(fixed_upload_size=True)
    part = RAW_STREAM_PART_BYTES
    with fs.open(_s3_url(path, "raw.bin"), "wb", block_size=part) as f:
        for t in spec.tensors:
            view = writable_buffer(state[t.group][t.name])
            for start in range(0, len(view), part):
                f.write(view[start : start + part])


def _raw_stream_load(spec: StateSpec, path: str, targets: State | None) -> State:
    from fsspec.asyn import sync

    assert targets is not None
    fs = _s3_fs()
    bucket, key, _ = fs.split_path(_s3_url(path, "raw.bin"))

    async def fetch() -> None:
        response = await fs._call_s3("get_object", Bucket=bucket, Key=key)
        async with response["Body"] as body:
            for t in spec.tensors:
                view = writable_buffer(targets[t.group][t.name])
                pos = 0
                while pos < len(view):
                    n = await body.readinto(view[pos:])
                    if not n:
                        raise EOFError(f"{t.flat_key}: object ended {len(view) - pos} bytes short")
                    pos += n

    sync(fs.loop, fetch)
    return targets


def _s3_torch_save(spec: StateSpec, state: State, path: str, fsync: bool) -> None:
    import io

    buf = io.BytesIO()
    torch.save(flatten_state(state), buf)
    _s3_fs().pipe(_s3_url(path, "state.pt"), buf.getvalue())


def _s3_torch_load(spec: StateSpec, path: str, targets: State | None) -> State:
    import io

    data = _s3_fs().cat(_s3_url(path, "state.pt"))
    return unflatten_state(torch.load(io.BytesIO(data), weights_only=True), spec)


def _s3_ts_prepare() -> None:
    _s3_prepare()
    import aiobotocore.session  # noqa: F401
    import torchsnapshot  # noqa: F401


def _s3_ts_save(spec: StateSpec, state: State, path: str, fsync: bool) -> None:
    import torchsnapshot

    app = {g: torchsnapshot.StateDict(**d) for g, d in state.items()}
    torchsnapshot.Snapshot.take(path=path, app_state=app)


def _s3_ts_load(spec: StateSpec, path: str, targets: State | None) -> State:
    import torchsnapshot

    assert targets is not None
    app = {g: torchsnapshot.StateDict(**d) for g, d in targets.items()}
    torchsnapshot.Snapshot(path=path).restore(app_state=app)
    return {g: dict(app[g]) for g in app}


def _s3_dcp_prepare() -> None:
    _s3_prepare()
    _dcp_prepare()
    import torch.distributed.checkpoint._fsspec_filesystem  # noqa: F401


def _s3_dcp_save(spec: StateSpec, state: State, path: str, fsync: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    writer = FsspecWriter(path, sync_files=False, **_s3_options())
    dcp.save(flatten_state(state), storage_writer=writer)


def _s3_dcp_load(spec: StateSpec, path: str, targets: State | None) -> State:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    assert targets is not None
    flat = flatten_state(targets)
    dcp.load(flat, storage_reader=FsspecReader(path, **_s3_options()))
    return unflatten_state(flat, spec)


S3_WRITERS: dict[str, Writer] = {
    w.name: w
    for w in (
        Writer(
            "raw-stream",
            objects=False,
            self_fsync=True,
            save=_raw_stream_save,
            prepare=_s3_prepare,
            note="the tensor bytes as ONE multipart upload: s3fs (`fixed_upload_size=True`) "
            f"`open(url, 'wb', block_size={RAW_STREAM_PART_BYTES >> 20} MiB)`, each tensor's "
            "bytes written in slices of at most a part; s3fs copies them into its buffer and "
            f"uploads {RAW_STREAM_PART_BYTES >> 20} MiB parts one at a time as it fills, then "
            "completes the upload",
        ),
        Writer(
            "torch.save",
            objects=True,
            self_fsync=True,
            save=_s3_torch_save,
            prepare=_s3_prepare,
            note="torch.save(flat dict) into an io.BytesIO, then s3fs `pipe(url, "
            "buf.getvalue())` (s3fs's defaults: one PutObject under 100 MiB, else a multipart "
            "upload of 50 MiB parts, up to 10 at once)",
        ),
        Writer(
            "dcp",
            objects=True,
            self_fsync=True,
            save=_s3_dcp_save,
            prepare=_s3_dcp_prepare,
            note="dcp.save(flat dict, storage_writer=FsspecWriter(url, sync_files=False, "
            "**storage_options)), thread_count=1 (default); with sync_files=True (its default) "
            "it would call os.sync() for the fsspec streams, which have no fileno: a flush of "
            "every filesystem of the machine that says nothing about S3",
        ),
        Writer(
            "torchsnapshot",
            objects=True,
            self_fsync=True,
            save=_s3_ts_save,
            prepare=_s3_ts_prepare,
            note="torchsnapshot 0.1.0 Snapshot.take(path='s3://...'); its S3 plugin ignores "
            "storage_options and makes an aiobotocore client per request from the environment: "
            "its workers get AWS_ENDPOINT_URL_S3, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and "
            "AWS_DEFAULT_REGION; one PutObject per write request (no multipart)",
        ),
        Writer(
            "statesnap",
            objects=True,
            self_fsync=True,
            save=_s3_ss_save,
            prepare=_s3_ss_prepare,
            note="Snapshot.take('s3://...', app_state, storage_options=endpoint, credentials and "
            "region + any --s3-option); the plugin's defaults otherwise "
            "(max_concurrent_requests=8, part_bytes=32 MiB)",
        ),
    )
}

S3_READERS: dict[str, Reader] = {
    r.name: r
    for r in (
        Reader(
            "raw-stream",
            "raw-stream",
            objects=False,
            into_targets=True,
            load=_raw_stream_load,
            prepare=_s3_prepare,
            note="ONE GetObject of the whole object, its body streamed into the preallocated "
            "tensors in order (aiobotocore's `body.readinto(view)` on s3fs's event loop: what "
            "aiohttp has received is copied into the tensor's memory)",
        ),
        Reader(
            "torch.save",
            "torch.save",
            objects=True,
            into_targets=False,
            load=_s3_torch_load,
            prepare=_s3_prepare,
            note="s3fs `cat(url)` (s3fs's defaults: a HeadObject, then one GET, or above 50 MiB "
            "ranged GETs of 50 MiB, up to 10 at once, into one buffer), then "
            "torch.load(io.BytesIO(data), weights_only=True); new tensors",
        ),
        Reader(
            "dcp",
            "dcp",
            objects=True,
            into_targets=True,
            load=_s3_dcp_load,
            prepare=_s3_dcp_prepare,
            note="dcp.load(flat dict, storage_reader=FsspecReader(url, **storage_options)) into "
            "preallocated targets",
        ),
        Reader(
            "torchsnapshot",
            "torchsnapshot",
            objects=True,
            into_targets=True,
            load=_s3_ts_load,
            prepare=_s3_ts_prepare,
            note="Snapshot(path='s3://...').restore(app_state) into preallocated targets (the "
            "same environment variables)",
        ),
        Reader(
            "statesnap",
            "statesnap",
            objects=True,
            into_targets=True,
            load=_s3_ss_load,
            prepare=_s3_ss_prepare,
            note="Snapshot('s3://...', storage_options=...) (reads the manifest) + restore, in "
            "place",
        ),
    )
}


# ---------------------------------------------------------------------------------------------
# Async snapshots (the async case): calls that return before the state is on disk, and the
# plain copies that bound how short such a call can be on the CPU.


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
    (``snapshot.knobs.memory_budget_bytes``, from the available memory and the pool).
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
    prepare: Callable[[], None] = _nothing
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
    from snapshot._engine.staging import default_pool

    pool = default_pool()
    return pool.allocated_bytes, pool.free_bytes


def _ss_budget() -> int:
    """The budget a take computes now (the pool's free blocks count as available)."""
    from snapshot import knobs
    from snapshot._engine.staging import default_pool

    return knobs.memory_budget_bytes(default_pool().free_bytes)


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
    return torchsnapshot.Snapshot.async_take(path=_ts_path(path), app_state=app)


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
    prepare=_ss_prepare,
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
            prepare=_ss_prepare,
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
            prepare=_ts_prepare,
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
            prepare=_dcp_prepare,
            note="dcp.async_save(flat_state_dict, checkpoint_id=dir) then future.result(), "
            "single process, no process group (fsync'd mode: sync_files=True, its default); in "
            "the page-cache mode storage_writer=FileSystemWriter(dir, sync_files=False) and "
            "async_stager=DefaultStager(StagingOptions(False, False, False, False)), the stager "
            "async_save makes for a checkpoint_id",
        ),
    )
}
