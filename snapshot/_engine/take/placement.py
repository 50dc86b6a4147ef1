"""Where a take's payloads go: blobs and slabs, and which rank writes each replicated payload.

A rank's own payloads go to blobs ``<rank>/<n>`` and slabs ``<rank>/s<n>`` (``Placer``), in the
order they are met; replicated ones are placed once their writers are agreed on (``place``,
``assign_writers``). Each complete blob becomes one ``WriteRequest``, whose ``stage`` step the
``Stager`` given to the placer supplies (``stage``: views of the payloads' memory, or copies
into pooled buffers for async take): placement itself reads no payload's bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from snapshot._engine.io import device
from snapshot._engine.io.pipeline import WriteRequest
from snapshot._engine.take.drafts import Layout, Payload, Staged
from snapshot._engine.take.plan import Collected, TakePlan

# Slab members start at multiples of this, so a staging buffer's slice for any member can be
# viewed as the member's dtype (complex128, the widest, is 16 bytes).
ALIGN = 16


@dataclass
class Slab:
    """Small payloads packed into one blob, each after the padding that aligns it."""

    blob: str
    members: list[tuple[int, Payload]] = field(default_factory=list)  # (padding before, payload)
    nbytes: int = 0
    staging_bytes: int = 0
    from_device: bool = False  # a member is copied from a device (async take pins its buffer)

    def label(self) -> str:
        first = self.members[0][1].label
        more = f" and {len(self.members) - 1} more" if len(self.members) > 1 else ""
        return f"{first}{more} (slab {self.blob})"


class Stager(Protocol):
    """How the writes of placed blobs are staged (``stage.stager``). With ``pooled`` (async
    take), every payload is copied into a pooled buffer, so a write never reads the
    application's memory."""

    pooled: bool

    def blob(self, p: Payload, from_device: bool) -> tuple[Callable[[], Staged], int]:
        """The ``stage`` of a blob holding ``p`` alone, and the staging memory it costs."""
        ...

    def slab(self, slab: Slab, checksums: bool) -> tuple[Callable[[], Staged], int]:
        """The ``stage`` of a slab (with ``checksums``, it gives each member its CRC-32), and
        the staging memory it costs."""
        ...

    def settle(self) -> None:
        """Waits until every buffer staged so far holds its bytes (a stage may leave its copy
        running on another thread); raises what a copy raised."""
        ...


class Recorder:
    """Stands in for a rank's own ``Placer`` while a take across ranks plans: it records the
    payloads in the order they are met and places nothing (which of them are the rank's own
    is known only after the first agreement: ``replication.settle`` places them)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.payloads: list[Payload] = []
        self.writes: list[WriteRequest] = []  # none: nothing is placed

    def place(self, p: Payload) -> None:
        self.payloads.append(p)

    def close(self) -> None:
        pass


class Placer:
    """Gives payloads their blobs under one name prefix; collects the writes when ``mine``.

    With a pooled ``stager`` (async take), each write's payloads are copied into one pooled
    buffer when staged, so the write never reads the application's memory.

    A slab's members are checksummed when the slab is staged, on the caller's thread (with a
    pool: right after each member's copy from host memory; after ``Lease.ready`` for a copy
    from a device, which is asynchronous), not by the plugin as it writes. A CRC call on more
    than 5 KiB drops the GIL and must take it back: on a thread other than one busy in Python
    (the caller planning, or running Python while an async take writes), each call waits up to
    the interpreter's switch interval (``sys.getswitchinterval()``), so checksumming thousands
    of slab members on an I/O thread made an async take slow to commit while the caller ran a
    Python loop. Large payloads, a blob each, are checksummed in a few large pieces as they are
    written.
    """

    def __init__(self, prefix: str, layout: Layout, mine: bool, stager: Stager) -> None:
        # ``<rank>/`` (or ``<writer>/r`` for replicated payloads), the take's id inserted after
        # the rank's folder: ``0/1f2e3d4c-s0``.
        if layout.take_id:
            folder, _, rest = prefix.rpartition("/")
            prefix = f"{folder}/{layout.take_id}-{rest}" if folder else f"{layout.take_id}-{rest}"
        self.prefix = prefix
        self.layout = layout
        self.mine = mine
        self.stager = stager
        self.pooled = stager.pooled
        self.writes: list[WriteRequest] = []
        self._next = 0
        self._slab: Slab | None = None
        self._slab_max = layout.slab_threshold_bytes
        self._slab_bytes = layout.slab_bytes

    def _blob(self, kind: str = "") -> str:
        name = f"{self.prefix}{kind}{self._next}"
        self._next += 1
        return name

    def place(self, p: Payload) -> None:
        """In the open slab when small, else in a blob of its own."""
        nbytes = p.nbytes
        pooled = self.pooled
        if nbytes <= self._slab_max:
            slab = self._slab
            if slab is None or slab.nbytes + (-slab.nbytes % ALIGN) + nbytes > self._slab_bytes:
                self.close()
                slab = self._slab = Slab(blob=self._blob("s"))
            # Appended to the slab, after the padding that aligns it (inline: once per tensor).
            pad = -slab.nbytes % ALIGN
            slab.members.append((pad, p))
            p.blob = slab.blob
            p.pos = slab.nbytes + pad
            slab.nbytes += pad + nbytes
            slab.staging_bytes += nbytes if pooled else p.staging_bytes
            if pooled and p.source is not None and not slab.from_device:
                slab.from_device = _from_device(p)
        else:
            blob = self._blob()
            p.blob = blob
            p.pos = 0
            if self.mine:
                from_device = pooled and p.source is not None and _from_device(p)
                stage, staging = self.stager.blob(p, from_device)
                self.writes.append(
                    WriteRequest(
                        blob=blob,
                        nbytes=p.nbytes,
                        staging_bytes=staging,
                        stage=stage,
                        label=p.label,
                        checksum_ranges=((0, p.nbytes),) if self.layout.checksums else (),
                    )
                )
        if self.mine and p.source is not None:
            p.source.remaining += 1

    def close(self) -> None:
        slab, self._slab = self._slab, None
        if slab is not None and slab.members and self.mine:
            stage, staging = self.stager.slab(slab, self.layout.checksums)
            self.writes.append(
                WriteRequest(
                    blob=slab.blob,
                    nbytes=slab.nbytes,
                    staging_bytes=staging,
                    stage=stage,
                    label=slab.label(),
                    # Its members are checksummed as they are staged.
                )
            )


def _from_device(p: Payload) -> bool:
    """Whether a payload with a ``source`` is copied from a CUDA device (its buffer is then
    pinned, for asynchronous copies). The tensor as given decides: a prepare function that moves
    it elsewhere only makes the copies synchronous, or the pinning unneeded."""
    assert p.source is not None
    return device.cuda_index(p.source.tensor) is not None


def place(
    collected: Collected,
    own: Placer,
    *,
    rank: int,
    layout: Layout,
    writer_of: Mapping[tuple[str, int], int],
    stager: Stager,
) -> TakePlan:
    """Places the replicated payloads and makes the plan: this rank's own writes (``own``,
    which placed its own payloads while they were collected) and the writes of the replicated
    payloads ``rank`` writes.

    A rank's own payloads go to blobs ``<rank>/<n>`` and slabs ``<rank>/s<n>``. A replicated
    payload is written once, by ``writer_of[(logical, index)]``, into that writer's blobs
    ``<writer>/r<n>`` and ``<writer>/rs<n>``: every rank places all replicated payloads the same
    way (in sorted order, with the agreed ``layout``), so every rank knows every location
    without asking. ``stager`` stages the writes (with a pooled one, staging copies every
    payload into pooled buffers).
    """
    replicated: dict[int, list[Payload]] = {}
    for p in collected.replicated:
        replicated.setdefault(writer_of[(p.logical, p.index)], []).append(p)
    writes = list(own.writes)
    for writer in sorted(replicated):
        shared = Placer(f"{writer}/r", layout, mine=writer == rank, stager=stager)
        for p in sorted(replicated[writer], key=lambda q: (q.logical, q.index)):
            shared.place(p)
        shared.close()
        writes.extend(shared.writes)
    return TakePlan(
        drafts=collected.entries,
        writes=writes,
        shared=replicated.get(rank, []),
        checksums=layout.checksums,
        grads=collected.grads,
        views=collected.views,
        digests=collected.digests,
    )


def assign_writers(
    signature: Sequence[tuple[str, int, int, str]], local_bytes: Sequence[int]
) -> dict[tuple[str, int], int]:
    """Which rank writes each replicated payload: greedily, largest first, to the rank that has
    the fewest bytes to write so far (its own payloads included; ties go to the lower rank)."""
    load = list(local_bytes)
    writers: dict[tuple[str, int], int] = {}
    for logical, index, nbytes, _ in sorted(signature, key=lambda s: (-s[2], s[0], s[1])):
        rank = min(range(len(load)), key=lambda r: (load[r], r))
        writers[(logical, index)] = rank
        load[rank] += nbytes
    return writers
