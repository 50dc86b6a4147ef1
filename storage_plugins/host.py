"""What the machine the plugins run on is, where it changes how they should move bytes."""

from __future__ import annotations

import functools
import logging
import os

logger = logging.getLogger("storage_plugins.fs")

# A VM guest whose kernel reports its free memory to the host (virtio-balloon's free page
# reporting) gives freed pages back a second or two after they are freed, and allocating them
# again then faults on the host: writing through the page cache then pays those faults for
# every page, where direct I/O reuses one buffer per thread (figures:
# benchmarks/results/2026-11-23-ba9f183-8e60bb4-settled-memory.md). On such a machine "auto"
# writes directly also without fsync. Read from sysfs: the balloon device (virtio device id 5)
# and its negotiated feature bits, one character per bit (VIRTIO_BALLOON_F_REPORTING is bit 5).
_VIRTIO_DEVICES = "/sys/bus/virtio/devices"
_VIRTIO_ID_BALLOON = 5
_VIRTIO_BALLOON_F_REPORTING = 5


def reports_free_memory() -> bool:
    """Whether this machine is a VM that hands its free memory back to the host (a virtio
    balloon device with free page reporting)."""
    devices = _VIRTIO_DEVICES
    try:
        names = os.listdir(devices)
    except OSError:
        return False
    for name in names:
        try:
            with open(os.path.join(devices, name, "device")) as f:
                if int(f.read().strip(), 16) != _VIRTIO_ID_BALLOON:
                    continue
            with open(os.path.join(devices, name, "features")) as f:
                bits = f.read().strip()
        except (OSError, ValueError):
            continue
        if len(bits) > _VIRTIO_BALLOON_F_REPORTING and bits[_VIRTIO_BALLOON_F_REPORTING] == "1":
            return True
    return False


@functools.cache
def direct_without_fsync() -> bool:
    """Whether the local plugin's ``direct_io="auto"`` writes directly also without fsync:
    on a machine that reports its free memory (decided once per process, said once)."""
    if not reports_free_memory():
        return False
    logger.info(
        "this machine hands its free memory back to the host (virtio-balloon free page "
        "reporting), which makes page-cache memory slow to allocate: files of 1 MiB and more "
        "are written with direct I/O also without fsync "
        "(storage_options direct_io=False writes them through the page cache)"
    )
    return True
