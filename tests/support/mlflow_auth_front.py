"""A basic-auth front for the session's `mlflow server`: a reverse proxy on 127.0.0.1 that
answers 401 to any request without the user's Authorization header, and 403 to the calls a
test denies that user (as a tracking server's permissions would).

    with mlflow_auth_front(mlflow_uri, "trainer", "secret") as front:
        MlflowTracking(tracking_uri=front.uri, username="trainer", password="secret")
        front.deny("POST", "/registered-models/alias")   # this user may not move aliases
        front.unauthorized                               # requests that came without the header
        front.denied                                     # requests refused by a deny rule

The session's server itself asks for no credentials, so this front is what proves that every
request the project makes carries them (mlflow's own `--app-name basic-auth` needs a second
server and its admin set-up for each user and permission).
"""

from __future__ import annotations

import base64
import http.client
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from tests.support.faulty_s3 import NOT_FORWARDED


class MlflowAuthFront:
    """The front's controls and what it saw; made by `mlflow_auth_front`."""

    def __init__(self, upstream_uri: str, username: str, password: str) -> None:
        upstream = urlsplit(upstream_uri)
        self.upstream = (upstream.hostname or "127.0.0.1", upstream.port or 80)
        self.authorization = "Basic " + base64.standard_b64encode(f"{username}:{password}".encode()).decode()
        self.uri = ""  # set once the server listens
        self.unauthorized: list[str] = []  # "METHOD path" of each request without the header
        self.denied: list[str] = []
        self.seen: list[str] = []  # every authorized request, "METHOD path"
        self._rules: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def deny(self, method: str, path_suffix: str) -> None:
        """Answer 403 PERMISSION_DENIED to `method` requests whose path ends with `path_suffix`."""
        with self._lock:
            self._rules.add((method, path_suffix))

    def allow_all(self) -> None:
        with self._lock:
            self._rules.clear()

    def _verdict(self, method: str, path: str, authorization: str | None) -> int:
        """200 to forward, 401 or 403 to refuse; counts the request."""
        request = f"{method} {path}"
        with self._lock:
            if authorization != self.authorization:
                self.unauthorized.append(request)
                return 401
            if any(method == m and urlsplit(path).path.endswith(suffix) for m, suffix in self._rules):
                self.denied.append(request)
                return 403
            self.seen.append(request)
            return 200


def _handler(front: MlflowAuthFront) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet: tests read the front's lists instead
            pass

        def _handle(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            verdict = front._verdict(self.command, self.path, self.headers.get("Authorization"))
            if verdict != 200:
                code = "UNAUTHENTICATED" if verdict == 401 else "PERMISSION_DENIED"
                message = json.dumps({"error_code": code, "message": f"{code} by the test's auth front"}).encode()
                self._answer(verdict, {"Content-Type": "application/json"}, message)
                return
            headers = {k: v for k, v in self.headers.items() if k.lower() not in NOT_FORWARDED | {"authorization"}}
            upstream = http.client.HTTPConnection(*front.upstream, timeout=120)
            try:
                upstream.request(self.command, self.path, body=body or None, headers=headers)
                response = upstream.getresponse()
                data = response.read()
                self._answer(response.status,
                             {k: v for k, v in response.getheaders() if k.lower() not in NOT_FORWARDED}, data)
            finally:
                upstream.close()

        do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _handle

        def _answer(self, status: int, headers: dict[str, str], data: bytes) -> None:
            try:
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True

    return Handler


@contextmanager
def mlflow_auth_front(upstream_uri: str, username: str, password: str) -> Iterator[MlflowAuthFront]:
    """An MlflowAuthFront listening on 127.0.0.1 (a free port) until the block ends."""
    front = MlflowAuthFront(upstream_uri, username, password)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(front))
    server.daemon_threads = True
    front.uri = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="mlflow-auth-front", daemon=True)
    thread.start()
    try:
        yield front
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
