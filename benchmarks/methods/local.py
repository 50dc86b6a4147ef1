"""The single-process methods of the main cases (``WRITERS``, ``READERS``): raw file I/O,
torch.save / torch.load, DCP without a process group, safetensors, torchsnapshot and statesnap."""

from __future__ import annotations

import functools
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from benchmarks.common import (
    CheckResult,
    StateSpec,
    flatten_state,
    unflatten_state,
    writable_buffer,
)
from benchmarks.methods.base import Reader, State, Writer, quiet

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


def _raw_pieces(spec: StateSpec, targets: State, piece: int) -> list[tuple[int, list[memoryview]]]:
    """The raw file as reads of ``piece`` bytes at most: (offset, target buffers), each read
    one run of consecutive bytes (small tensors gathered, large ones split)."""
    reads: list[tuple[int, list[memoryview]]] = []
    pos = start = size = 0
    bufs: list[memoryview] = []
    for t in spec.tensors:
        data = memoryview(writable_buffer(targets[t.group][t.name])).cast("B")
        off = 0
        while off < len(data):
            k = min(len(data) - off, piece - size)
            bufs.append(data[off : off + k])
            size, off, pos = size + k, off + k, pos + k
            if size == piece:
                reads.append((start, bufs))
                start, size, bufs = pos, 0, []
    if bufs:
        reads.append((start, bufs))
    return reads


def _preadv_full(fd: int, bufs: list[memoryview], pos: int) -> None:
    while bufs:
        n = os.preadv(fd, bufs, pos)
        if n <= 0:
            raise EOFError(f"raw file ended at {pos}")
        pos += n
        while bufs and n >= len(bufs[0]):
            n -= len(bufs[0])
            bufs = bufs[1:]
        if bufs and n:
            bufs = [bufs[0][n:], *bufs[1:]]


def _raw_load_parallel(threads: int, piece: int = 8 << 20):
    """readinto preallocated tensors with ``threads`` concurrent buffered readers, reads of
    ``piece`` bytes: the device's best with the page cache in the path is one of these (on
    some devices 1 MiB reads, which keep the kernel's read-ahead a step ahead of each reader,
    move the bytes faster than 8 MiB ones)."""

    def load(spec: StateSpec, path: str, targets: State | None) -> State:
        assert targets is not None
        fd = os.open(_raw_file(path), os.O_RDONLY)
        try:
            reads = _raw_pieces(spec, targets, piece)
            with ThreadPoolExecutor(threads) as pool:
                for _ in pool.map(lambda r: _preadv_full(fd, r[1], r[0]), reads):
                    pass
        finally:
            os.close(fd)
        return targets

    return load


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


def dcp_prepare() -> None:
    quiet()
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


def ts_prepare() -> None:
    quiet()
    import torchsnapshot  # noqa: F401


def ts_path(path: str) -> str:
    return os.path.join(path, "torchsnapshot")


def _ts_save(spec: StateSpec, state: State, path: str, fsync: bool) -> None:
    import torchsnapshot

    app = {g: torchsnapshot.StateDict(**d) for g, d in state.items()}
    torchsnapshot.Snapshot.take(path=ts_path(path), app_state=app)


def _ts_load(spec: StateSpec, path: str, targets: State | None) -> State:
    import torchsnapshot

    assert targets is not None
    app = {g: torchsnapshot.StateDict(**d) for g, d in targets.items()}
    torchsnapshot.Snapshot(path=ts_path(path)).restore(app_state=app)
    return {g: dict(app[g]) for g in app}


# ---------------------------------------------------------------------------------------------
# statesnap.


def ss_prepare() -> None:
    # The local storage plugin is imported on first use: import it here, before the clock
    # starts, as every other method's modules are (where bytecode is not cached, compiling it
    # inside the first timed call would count in that call).
    # ``import snapshot`` alone loads none of the engine (its names are imported on first
    # use): ask for ``Snapshot``, which loads what a take and a restore run.
    import storage_plugins.fs  # noqa: F401
    from snapshot import Snapshot  # noqa: F401


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


def ss_load(spec: StateSpec, path: str, targets: State | None) -> State:
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
            prepare=dcp_prepare,
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
            prepare=ts_prepare,
            note="Snapshot.take; 0.1.0 never fsyncs",
        ),
        Writer(
            "statesnap",
            objects=True,
            self_fsync=True,
            save=_ss_save,
            prepare=ss_prepare,
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
            prepare=ss_prepare,
            note='Snapshot.take; storage_options={"fsync": <mode>, "direct_io": True}: '
            "every file of 1 MiB and more, slabs too, past the page cache, in the page-cache "
            "mode all the same (no fsync)",
        ),
        Writer(
            "statesnap-buffered",
            objects=True,
            self_fsync=True,
            save=functools.partial(_ss_save, direct_io=False),
            prepare=ss_prepare,
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
        *(
            Reader(
                f"raw {n} readers",
                "raw",
                objects=False,
                into_targets=True,
                load=_raw_load_parallel(n),
                note=f"preadv into preallocated tensors, 8 MiB reads, {n} threads",
            )
            for n in (4, 8, 16)
        ),
        *(
            Reader(
                f"raw {n} readers 1MiB",
                "raw",
                objects=False,
                into_targets=True,
                load=_raw_load_parallel(n, 1 << 20),
                note=f"preadv into preallocated tensors, 1 MiB reads, {n} threads",
            )
            for n in (2, 4)
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
            prepare=dcp_prepare,
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
            prepare=ts_prepare,
            note="restore into preallocated targets",
        ),
        Reader(
            "statesnap",
            "statesnap",
            objects=True,
            into_targets=True,
            load=ss_load,
            prepare=ss_prepare,
            note="Snapshot(path) (reads the manifest) + restore, in place",
        ),
        Reader(
            "statesnap, buffered take",
            "statesnap-buffered",
            objects=True,
            into_targets=True,
            load=ss_load,
            prepare=ss_prepare,
            note="Snapshot(path) + restore, in place, of a snapshot taken through the page cache",
        ),
        Reader(
            "statesnap get_manifest",
            "statesnap",
            objects=True,
            into_targets=False,
            load=_ss_manifest,
            prepare=ss_prepare,
            verify=_ss_verify_manifest,
            note="Snapshot(path) + get_manifest()",
        ),
    )
}


def readers_of(writer: str) -> list[str]:
    """Readers that load what ``writer`` saved (without the manifest-only reader)."""
    return [r.name for r in READERS.values() if r.writer == writer and "manifest" not in r.name]
