"""A test network of Linux network namespaces: "hosts" on one private subnet, joined by a
bridge in a namespace of its own, so that a test can cut one host off the others (its link
down: its packets vanish, nobody is told) while every process stays on this machine and
shares its file systems.

Nothing is added to the machine's own network: the bridge, the links and the addresses
(10.x.y.0/24, picked per process) live inside the namespaces, which ``TestNetwork`` deletes on
exit. Making namespaces needs root and the ``ip`` tool: ``unavailable()`` says why not where
they cannot be made.

A process (a rank, spawned by tests/multirank.py) enters a host with ``enter(name)`` before it
opens any socket; a thread of the test's own process can serve from a host
(``in_namespace``): a socket belongs to the namespace its thread was in when it was made.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
IFNAME = "eth0"  # every host's link, as the ranks' GLOO_SOCKET_IFNAME names it


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip tool (iproute2) is not installed"
    name = f"ssprobe{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"cannot make a network namespace: {getattr(e, 'stderr', e)}"
    _ip("netns", "del", name)
    return None


def enter(name: str) -> None:
    """Moves the calling thread (a fresh process's only one, or a thread of its own) into the
    network namespace ``name``."""
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def in_namespace(name: str, fn: Callable[[], T]) -> T:
    """``fn()`` run on a thread that entered ``name`` (its sockets are that host's)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            enter(name)
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


class TestNetwork:
    """Hosts named by the test, each a namespace with one link to the bridge and address
    ``address(host)``. Use as a context manager."""

    __test__ = False  # not a test class, whatever pytest thinks of its name

    def __init__(self, hosts: list[str]) -> None:
        tag = os.getpid() % 100000
        self.prefix = f"ss{tag}"
        self.subnet = f"10.{200 + tag % 50}.{(tag // 50) % 250}"
        self.hosts = list(hosts)
        self.switch = f"{self.prefix}-sw"
        self._made: list[str] = []

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def address(self, host: str) -> str:
        return f"{self.subnet}.{self.hosts.index(host) + 1}"

    def _switch_side(self, host: str) -> str:
        return f"v{self.prefix[2:]}s{self.hosts.index(host)}"

    def __enter__(self) -> TestNetwork:
        try:
            for name in (self.switch, *map(self.ns, self.hosts)):
                _ip("netns", "add", name)
                self._made.append(name)
                _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for host in self.hosts:
                outer, inner = (
                    self._switch_side(host),
                    f"v{self.prefix[2:]}h{self.hosts.index(host)}",
                )
                _ip("-n", self.switch, "link", "add", outer, "type", "veth", "peer", "name", inner)
                _ip("-n", self.switch, "link", "set", inner, "netns", self.ns(host))
                _ip("-n", self.ns(host), "link", "set", inner, "name", IFNAME)
                _ip("-n", self.ns(host), "addr", "add", f"{self.address(host)}/24", "dev", IFNAME)
                _ip("-n", self.ns(host), "link", "set", IFNAME, "up")
                _ip("-n", self.switch, "link", "set", outer, "master", "br0")
                _ip("-n", self.switch, "link", "set", outer, "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def cut(self, host: str) -> None:
        """Takes ``host``'s link down at the bridge: its packets, both ways, are dropped
        without a word (no reset, no unreachable), as when a host loses power or its network."""
        _ip("-n", self.switch, "link", "set", self._switch_side(host), "down")

    def __exit__(self, *exc: object) -> None:
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._made.clear()
