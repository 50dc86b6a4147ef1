"""A local S3 endpoint for the ``s3`` case: moto's S3 server in a process of its own.

``python -m benchmarks.s3server`` serves moto (``moto.server.ThreadedMotoServer``: werkzeug,
one thread per connection) on 127.0.0.1 at a free port, prints the port on one line, and runs
until its standard input closes (the harness holds the other end: when the harness exits, for
whatever reason, the server goes too) or it gets SIGTERM. Request logging is off (one log line
per request would be work of the server's that no real S3 does).

:class:`S3Server` is the harness's side: it starts that process in a session of its own, knows
the endpoint and the credentials (any pair works with moto), creates and empties buckets, and
reads the server process's CPU time (utime + stime of all its threads, from
``/proc/PID/stat``) and RSS, so that what the server itself costs can be reported next to each
operation's time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from typing import Any

REGION = "us-east-1"
KEY_ID = "statesnap-bench"
SECRET = "statesnap-bench-secret"

_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (every thread of it), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = stat[stat.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state); utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / _TICKS


def process_rss(pid: int) -> int:
    """VmRSS of process ``pid`` in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class S3Server:
    """moto's S3 server in a child process; see the module docstring. ``start()``, then
    ``endpoint_url`` / ``pid``; ``stop()`` at the end (also a context manager)."""

    def __init__(self, python: str = sys.executable, cwd: str | None = None) -> None:
        self.python = python
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self._fs: Any = None

    def __enter__(self) -> S3Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout: float = 60.0) -> None:
        # The server's stderr goes to an unnamed temporary file: read back if it fails to start.
        with tempfile.TemporaryFile() as errors:
            self.proc = subprocess.Popen(
                [self.python, "-m", "benchmarks.s3server"],
                cwd=self.cwd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=errors,
                start_new_session=True,
            )
            stdout = self.proc.stdout
            assert stdout is not None
            line: list[bytes] = []
            reader = threading.Thread(target=lambda: line.append(stdout.readline()), daemon=True)
            reader.start()
            reader.join(timeout)
            if line and line[0].strip().isdigit():
                self.port = int(line[0])
                return
            self.stop()
            errors.seek(0)
            tail = errors.read()[-600:].decode(errors="replace").strip().splitlines()
        raise RuntimeError(
            "moto's S3 server did not start"
            + (f": {' | '.join(tail[-3:])}" if tail else f" within {timeout:.0f} s")
        )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.pid)

    def rss(self) -> int:
        return process_rss(self.pid)

    def storage_options(self) -> dict[str, Any]:
        """s3fs's options that reach this server (also what statesnap's plugin takes)."""
        return {
            "endpoint_url": self.endpoint_url,
            "key": KEY_ID,
            "secret": SECRET,
            "client_kwargs": {"region_name": REGION},
        }

    def environ(self) -> dict[str, str]:
        """The AWS_* variables that point botocore (torchsnapshot's client) at this server."""
        return {
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": KEY_ID,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": REGION,
            # As the other methods are configured (methods.PEER_S3_CONFIG); its payload signing
            # has no environment variable, so torchsnapshot alone still hashes every body.
            "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
            "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
        }

    def _filesystem(self) -> Any:
        if self._fs is None:
            import s3fs

            self._fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options())
        return self._fs

    def new_bucket(self) -> str:
        """Creates a bucket with a fresh name; returns the name."""
        name = f"bench-{uuid.uuid4().hex[:16]}"
        # Directly: s3fs's mkdir sends a LocationConstraint, which us-east-1 refuses.
        self._filesystem().call_s3("create_bucket", Bucket=name)
        return name

    def stored(self, bucket: str) -> dict[str, int]:
        """Bytes and number of the objects in ``bucket``."""
        fs = self._filesystem()
        sizes = fs.find(bucket, detail=True, refresh=True)
        return {
            "apparent": sum(int(info.get("size") or 0) for info in sizes.values()),
            "files": len(sizes),
        }

    def remove_bucket(self, bucket: str) -> None:
        """Deletes every object of ``bucket`` (and unfinished multipart uploads), then the
        bucket, so that the server does not keep them."""
        fs = self._filesystem()
        with contextlib.suppress(FileNotFoundError):
            fs.rm(bucket, recursive=True)
        with contextlib.suppress(Exception):
            for upload in fs.list_multipart_uploads(bucket):
                fs.abort_mpu(bucket, upload["Key"], upload["UploadId"])
        with contextlib.suppress(FileNotFoundError, OSError):
            fs.rmdir(bucket)
        fs.invalidate_cache()

    def stop(self) -> None:
        """Closes the server's stdin (it exits), then kills its process group if it lingers."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            # Imported here: the server process itself has no use for torch.
            from benchmarks.common import reap

            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            reap(proc)
        if proc.stdout is not None:
            proc.stdout.close()


def main() -> None:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def watch_stdin() -> None:
        sys.stdin.buffer.read()  # returns when the harness closes the pipe or exits
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    print(server.get_host_and_port()[1], flush=True)
    while not stop.wait(1.0):
        pass
    server.stop()


if __name__ == "__main__":
    main()
