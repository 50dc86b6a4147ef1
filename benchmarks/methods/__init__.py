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

Modules: ``base`` (Writer, Reader), ``local`` (the single-process methods), ``group`` (every rank
of a process group; resharding), ``s3``, ``asynchronous``, and ``engine``, the one place that
reaches below statesnap's public API. Every statesnap method calls only the public API that
older trees of the library share (``Snapshot.take`` / ``restore`` / ``async_take``,
``StateDict``, ``storage_options``), so that ``--library`` can run them from another tree.
"""

from benchmarks.methods.asynchronous import ASYNC_METHODS, AsyncMethod
from benchmarks.methods.base import Reader, State, Writer
from benchmarks.methods.group import (
    GROUP_READERS,
    GROUP_WRITERS,
    REPLICATED,
    RESHARD_METHODS,
    ReshardMethod,
)
from benchmarks.methods.local import READERS, WRITERS, readers_of, statesnap_path
from benchmarks.methods.s3 import S3_READERS, S3_WRITERS, configure_s3

__all__ = [
    "ASYNC_METHODS",
    "GROUP_READERS",
    "GROUP_WRITERS",
    "READERS",
    "REPLICATED",
    "RESHARD_METHODS",
    "S3_READERS",
    "S3_WRITERS",
    "WRITERS",
    "AsyncMethod",
    "Reader",
    "ReshardMethod",
    "State",
    "Writer",
    "configure_s3",
    "readers_of",
    "statesnap_path",
]
