"""The methods of the s3 case (``S3_WRITERS``, ``S3_READERS``): every one against one S3
endpoint, ``path`` an ``s3://bucket/prefix`` URL. The worker calls :func:`configure_s3` with the
job's endpoint first."""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.common import (
    StateSpec,
    flatten_state,
    unflatten_state,
    writable_buffer,
)
from benchmarks.methods.base import Reader, State, Writer, quiet
from benchmarks.methods.local import (
    dcp_prepare,
)

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
    quiet()
    import s3fs  # noqa: F401


def _s3_url(path: str, name: str) -> str:
    return f"{path.rstrip('/')}/{name}"


def _s3_ss_prepare() -> None:
    _s3_prepare()
    import storage_plugins.s3  # noqa: F401
    from snapshot import Snapshot  # noqa: F401  (loads the engine: see ss_prepare)


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
    dcp_prepare()
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
