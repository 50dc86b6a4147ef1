"""Shared pieces of the benchmark harness: generated states, measurements, page-cache control.

Modules: ``states`` (specs and their kinds), ``tensors`` (their bytes, the bitwise checks,
sharded pieces), ``system`` (RSS, I/O counters, disk, page cache, settled memory) and
``machine`` (the machine description and the self-check); every name below is importable
from ``benchmarks.common``.

States
    A state is described by a :class:`StateSpec` (names, shapes, dtypes, seeds and Python
    objects; no tensor memory), built by :func:`build_spec` from a small JSON-able dict so the
    harness can hand it to a worker process. :func:`make_tensor` fills one tensor
    deterministically from its seed, so a worker can regenerate the expected bytes one tensor at
    a time after a restore instead of keeping a second copy of the state around.

    Kinds:
      ``model``   looks like a model plus its Adam state: six large fp32 tensors (two weights and
                  their ``exp_avg`` / ``exp_avg_sq``) holding most of the bytes, one bf16 tensor
                  (~6 %), one int64 tensor (~1 %), thousands of 4-64 KiB fp32 tensors (small
                  parameters and their two optimizer states), and Python objects (ints, floats,
                  strings, lists) in the optimizer group.
      ``tensors`` ``count`` fp32 tensors of equal size (``many-small``: 20,000; ``single``: 1).
      ``leaves``  ``leaves`` leaves: 90 % tiny fp32 tensors (16-256 elements), 10 % primitives.
      ``dp``      one rank of a data-parallel job (the ``dist`` case): a ``model`` group that is the
                  same on every rank (large fp32 weights and small fp32 norms/biases, seeded by
                  ``seed`` only) and an ``optim`` group of about a tenth of its size that differs
                  per rank (seeded by ``seed`` and ``rank``): two fp32 moment shards, a uint8 RNG
                  state, int64 counters, and Python objects.
      ``dtensors`` the global tensors of a sharded model (the ``reshard`` case): eight 2-D fp32
                  weights of equal size and a few hundred KiB of 1-D fp32 norm weights and biases,
                  every size divisible by 4 so that they shard evenly over 1, 2 and 4 ranks.
                  Each rank takes its piece of each global tensor (:func:`sharded_state`, as
                  DTensors of a layout of :data:`LAYOUTS`) and checks what it restored against
                  the piece of the regenerated global tensor (:func:`check_pieces`).

    Python objects only reach the methods that can store them (statesnap, torchsnapshot,
    torch.save, DCP); ``raw`` and safetensors store tensors only.

Measurements
    :class:`PeakRSS` resets the kernel's high-water mark (``/proc/self/clear_refs``) and reports
    the peak resident set above the RSS right before the operation, falling back to sampling
    when the reset does not work. :func:`proc_io` reads ``/proc/self/io``. :func:`tree_size`
    gives bytes on disk. :func:`check_restored` compares restored tensors with the generated
    ones bitwise (raw bytes, so bf16 and NaN payloads compare exactly); :func:`flip_bits`
    changes every byte of a state in place (the async case's caller mutating its tensors), and
    flipping twice gives the generated state back.

Page cache
    :func:`fsync_tree` fsyncs every file and directory under a path; :func:`set_page_cache`
    reads a tree into the page cache (a warm restore), or (:func:`drop_page_cache`) fsyncs each
    file and then ``posix_fadvise(POSIX_FADV_DONTNEED)`` so the next read comes from the disk
    (no root needed); :func:`resident_fraction` asks ``mincore`` how much of a tree is cached,
    to verify either. :func:`settle_memory` waits until the kernel has stopped handing freed
    memory back to the host (a VM with free page reporting), so that the page-cache writes of
    every method start from memory in the same state.

``python -m benchmarks.common --dir /tmp/statesnap-bench`` checks on this machine that the
peak-RSS reset and the page-cache drop work, and prints the machine description.
"""

from benchmarks.common.machine import library_commit, machine_description, self_check
from benchmarks.common.states import (
    DP_RANK_SHARE,
    DTENSOR_SPLIT,
    GIB,
    KIB,
    MIB,
    READ_OBJECT_TARGET,
    StateSpec,
    TensorSpec,
    build_spec,
    describe_spec,
    fmt_size,
    parse_size,
)
from benchmarks.common.system import (
    SETTLE_QUIET_SECONDS,
    PeakRSS,
    current_rss,
    drop_page_cache,
    fsync_tree,
    io_delta,
    peak_rss,
    proc_io,
    reap,
    reported_kib,
    reset_peak_rss,
    resident_fraction,
    set_page_cache,
    settle_memory,
    tree_size,
    trim_heap,
    warm_page_cache,
)
from benchmarks.common.tensors import (
    LAYOUTS,
    CheckResult,
    check_pieces,
    check_restored,
    flatten_state,
    flip_bits,
    generate_state,
    global_piece,
    local_tensor,
    make_targets,
    make_tensor,
    shard_dim,
    sharded_state,
    tensor_bytes,
    unflatten_state,
    writable_buffer,
)

__all__ = [
    "DP_RANK_SHARE",
    "DTENSOR_SPLIT",
    "GIB",
    "KIB",
    "LAYOUTS",
    "MIB",
    "READ_OBJECT_TARGET",
    "SETTLE_QUIET_SECONDS",
    "CheckResult",
    "PeakRSS",
    "StateSpec",
    "TensorSpec",
    "build_spec",
    "check_pieces",
    "check_restored",
    "current_rss",
    "describe_spec",
    "drop_page_cache",
    "flatten_state",
    "flip_bits",
    "fmt_size",
    "fsync_tree",
    "generate_state",
    "global_piece",
    "io_delta",
    "library_commit",
    "local_tensor",
    "machine_description",
    "make_targets",
    "make_tensor",
    "parse_size",
    "peak_rss",
    "proc_io",
    "reap",
    "reported_kib",
    "reset_peak_rss",
    "resident_fraction",
    "self_check",
    "set_page_cache",
    "settle_memory",
    "shard_dim",
    "sharded_state",
    "tensor_bytes",
    "tree_size",
    "trim_heap",
    "unflatten_state",
    "warm_page_cache",
    "writable_buffer",
]
