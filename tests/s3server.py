"""A real S3 endpoint for tests: moto's S3 server on 127.0.0.1 at a free port, served from a
thread of the test process, behind a WSGI layer that logs every request (with the bytes that
crossed the wire each way) and can fail or stall chosen requests.

The clients under test (s3fs, botocore, the library's plugin, other processes' ranks) reach it
over HTTP like any S3 endpoint; nothing of s3fs or botocore is replaced.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server

REGION = "us-east-1"
KEY_ID = "statesnap-test"
SECRET = "statesnap-test-secret"


@dataclass
class S3Request:
    """One request the server answered: ``bucket`` and ``key`` are decoded from the path."""

    method: str
    bucket: str
    key: str
    query: str
    range: str | None
    status: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    started: float = 0.0  # time.monotonic() when it arrived
    ended: float = 0.0  # ... and when the server answered it (0 until then)


@dataclass
class Fault:
    """Makes requests for which ``match(request)`` holds fail with ``status`` (an S3 error
    document with ``code``), after sleeping ``delay`` seconds; ``times`` such requests fail
    (None: every one). With status 0 the request is served, after the ``delay``, and
    ``cut_after`` drops the connection part-way through the answer's body."""

    match: Callable[[S3Request], bool]
    status: int = 503
    code: str = "SlowDown"
    times: int | None = 1
    delay: float = 0.0
    cut_after: int | None = None  # with status 0: serve, but drop the connection after this
    # many bytes of the response body
    hits: int = field(default=0, init=False)


class _QuietHandler(MotoRequestHandler):
    def log_request(self, *args: Any) -> None:  # one line per request would drown test output
        pass


class S3Server:
    """See the module docstring. ``start()``, then use ``endpoint_url``; ``stop()`` at the end."""

    def __init__(self) -> None:
        self._app = DomainDispatcherApplication(create_backend_app)
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self.requests: list[S3Request] = []
        # bucket -> requests arrived and not yet answered; the most there were at once. (Counted
        # up to the answer, not to the end of its body, which the client may have read before
        # this thread returns: so the count never exceeds what the client had in flight.)
        self._in_flight: dict[str, int] = {}
        self.max_in_flight: dict[str, int] = {}
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._netns: str | None = None

    def start(self, host: str = "127.0.0.1", netns: str | None = None) -> None:
        """Serves on ``host`` (an address of the network namespace ``netns``, tests/netns.py,
        when given) at a free port."""

        def listen() -> Any:
            return make_server(host, 0, self._wsgi, threaded=True, request_handler=_QuietHandler)

        self._netns = netns
        if netns is None:
            self._server = listen()
        else:
            from tests.netns import in_namespace

            self._server = in_namespace(netns, listen)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join()

    @property
    def endpoint_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def storage_options(self) -> dict[str, Any]:
        """What a client passes to reach this server (s3fs's own option names)."""
        return {
            "endpoint_url": self.endpoint_url,
            "key": KEY_ID,
            "secret": SECRET,
            "client_kwargs": {"region_name": REGION},
        }

    def new_bucket(self) -> str:
        """Creates a bucket with a fresh name and returns the name."""
        import boto3

        name = f"b-{uuid.uuid4().hex[:20]}"

        def create() -> None:
            client = boto3.client(
                "s3",
                endpoint_url=self.endpoint_url,
                aws_access_key_id=KEY_ID,
                aws_secret_access_key=SECRET,
                region_name=REGION,
            )
            client.create_bucket(Bucket=name)
            client.close()

        if self._netns is None:
            create()
        else:  # the server is reached from its own host's network only
            from tests.netns import in_namespace

            in_namespace(self._netns, create)
        return name

    # -- faults and the request log ------------------------------------------------------------

    def add_fault(self, fault: Fault) -> Fault:
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def log(self, bucket: str) -> list[S3Request]:
        """The requests made so far to ``bucket``, in the order they arrived."""
        with self._lock:
            return [r for r in self.requests if r.bucket == bucket]

    def _fault_for(self, request: S3Request) -> Fault | None:
        with self._lock:
            for f in self._faults:
                if (f.times is None or f.hits < f.times) and f.match(request):
                    f.hits += 1
                    return f
        return None

    def _wsgi(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = unquote(environ.get("PATH_INFO", ""))
        bucket, _, key = path.lstrip("/").partition("/")
        request = S3Request(
            method=environ["REQUEST_METHOD"],
            bucket=bucket,
            key=key,
            query=environ.get("QUERY_STRING", ""),
            range=environ.get("HTTP_RANGE"),
            bytes_in=int(environ.get("CONTENT_LENGTH") or 0),
            started=time.monotonic(),
        )
        with self._lock:
            self.requests.append(request)
            now = self._in_flight[bucket] = self._in_flight.get(bucket, 0) + 1
            self.max_in_flight[bucket] = max(self.max_in_flight.get(bucket, 0), now)
        try:
            return self._serve(environ, start_response, request, path)
        except BaseException:
            self._done(request)
            raise

    def _serve(
        self,
        environ: dict[str, Any],
        start_response: Callable[..., Any],
        request: S3Request,
        path: str,
    ) -> Iterable[bytes]:
        fault = self._fault_for(request)
        if fault is not None:
            if fault.delay:
                time.sleep(fault.delay)
            if fault.status:
                # Read the body so that the connection stays usable for the client's next call.
                environ["wsgi.input"].read(request.bytes_in)
                body = (
                    f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{fault.code}</Code>'
                    f"<Message>injected fault</Message><Resource>{path}</Resource></Error>"
                ).encode()
                request.status = fault.status
                request.bytes_out = len(body)
                start_response(
                    f"{fault.status} Injected",
                    [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))],
                )
                self._done(request)
                return [body]

        def recording_start(status: str, headers: list[tuple[str, str]], *exc: Any) -> Any:
            request.status = int(status.split()[0])
            self._done(request)
            return start_response(status, headers, *exc)

        cut_after = fault.cut_after if fault is not None else None
        return self._counted(self._app(environ, recording_start), request, cut_after)

    def _done(self, request: S3Request) -> None:
        """The server has answered ``request`` (its status is decided; the body, if any, may
        still be on its way): the client cannot have seen the answer before this moment."""
        with self._lock:
            if request.ended:
                return
            request.ended = time.monotonic()
            self._in_flight[request.bucket] -= 1

    def _counted(
        self, body: Iterable[bytes], request: S3Request, cut_after: int | None = None
    ) -> Iterator[bytes]:
        try:
            for piece in body:
                if cut_after is not None and request.bytes_out + len(piece) > cut_after:
                    yield piece[: cut_after - request.bytes_out]
                    request.bytes_out = cut_after
                    # werkzeug drops the connection on this error: the client sees a body cut
                    # short of its Content-Length, as when a connection is reset.
                    raise ConnectionResetError("injected: connection dropped mid-answer")
                request.bytes_out += len(piece)
                yield piece
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()


@dataclass
class S3Bucket:
    """A fresh bucket on ``server``, for one test."""

    server: S3Server
    name: str

    def url(self, prefix: str = "snap") -> str:
        return f"s3://{self.name}/{prefix}"

    @property
    def storage_options(self) -> dict[str, Any]:
        return self.server.storage_options()

    def log(self) -> list[S3Request]:
        return self.server.log(self.name)

    def fail(self, match: Callable[[S3Request], bool], **how: Any) -> Fault:
        """Injects a :class:`Fault` for this bucket's requests that ``match``."""
        return self.server.add_fault(
            Fault(match=lambda r: r.bucket == self.name and match(r), **how)
        )

    def environ(self) -> dict[str, str]:
        """The AWS_* variables that point botocore at this server, as users set them."""
        return {
            "AWS_ENDPOINT_URL_S3": self.server.endpoint_url,
            "AWS_ACCESS_KEY_ID": KEY_ID,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": REGION,
        }
