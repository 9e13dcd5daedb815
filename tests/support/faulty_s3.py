"""A fault-injecting S3 front: an HTTP reverse proxy on 127.0.0.1 in front of a real S3 server.

moto answers every request, at once; real S3 throttles (503 SlowDown), drops connections,
loses replies, sometimes stalls, and files on stores behind it get cut short. Point a
client's endpoint_url at the front and tell it which requests to break:

    with faulty_s3(s3_endpoint) as front:
        location = block_copy(image_location, endpoint_url=front.endpoint)
        front.fail_gets("test-images/shapes/circle/*", times=3, how="503")
        front.stall_gets("*", seconds=20)            # every GET, until cleared
        assert front.wait_stalled(timeout=10)        # a client is now stuck in a GET
        front.fault("PUT", "bucket/out/latest.json", "drop reply")  # stored, reply lost
        front.fault("PUT", "bucket/out/*/model.pt", "cut")          # stored half, answered 200
        front.clear()
        front.gets["test-images/shapes/circle/0001.jpg"]   # GETs the front received
        front.methods                                      # every request, by method

Patterns are shell-style (fnmatch) and match "bucket/key" as the client asked for it,
unquoted. A rule applies to the next `times` matching requests of its method (None: all of
them, until `clear`); each request uses the earliest rule still matching. What a fault
does (`FAULTS`):

- "reset": the connection is dropped before the request reaches the server (nothing done);
- "drop reply": forwarded, then the connection dropped before the reply (done, unheard of);
- "503", "500", "412": answered with that status and S3's error body, not forwarded;
- "stall": held for `seconds`, then forwarded;
- "cut": a PUT's body is forwarded cut to half its bytes and the server's answer passed
  on (a store that keeps part of a file and says it kept it); a GET's reply carries half
  its body under the whole body's length, then the connection is dropped;
- "call": `action` runs (another client's write, say), then the request is forwarded.

Requests are forwarded with their own Host header, so signatures stay valid.
"""

from __future__ import annotations

import fnmatch
import http.client
import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal
from urllib.parse import unquote, urlsplit

FailHow = Literal["503", "reset"]
Fault = Literal["reset", "drop reply", "503", "500", "412", "stall", "cut", "call"]
FAULTS: tuple[Fault, ...] = ("reset", "drop reply", "503", "500", "412", "stall", "cut", "call")
# What S3 says with each status the front answers itself.
ERRORS = {
    503: ("SlowDown", "Please reduce your request rate."),
    500: ("InternalError", "We encountered an internal error. Please try again."),
    412: ("PreconditionFailed", "At least one of the pre-conditions you specified did not hold"),
}
# A body's checksums, which a store that cuts files short does not keep or send.
CHECKSUM_HEADERS = ("x-amz-checksum-", "x-amz-sdk-checksum-", "content-md5")
# Hop-by-hop headers, and the body's framing that the front sets itself.
NOT_FORWARDED = {"connection", "keep-alive", "transfer-encoding", "content-length", "expect"}


@dataclass
class _Rule:
    pattern: str
    kind: Fault
    remaining: int | None
    seconds: float = 0.0
    method: str = "GET"
    action: Callable[[], None] | None = None


def _method(method: str) -> str:
    if method.upper() not in {"GET", "HEAD", "PUT", "POST", "DELETE"}:
        raise ValueError(f"method={method!r} is not an HTTP method the front serves: GET, HEAD, PUT, POST or DELETE.")
    return method.upper()


# Storage options that pick each of the two S3 readers of a loader process (tasks/data/object_reads.py):
# obstore, and s3fs, which reads where obstore cannot honour an option (a botocore setting
# here), in a loader process forked after its parent started obstore, and outside loader processes.
S3_READERS = {"obstore": {}, "s3fs": {"config_kwargs": {"connect_timeout": 30}}}


class FaultyS3:
    """The front's controls; made by `faulty_s3`, which also starts and stops it."""

    def __init__(self, upstream_endpoint: str) -> None:
        upstream = urlsplit(upstream_endpoint)
        self.upstream = (upstream.hostname or "127.0.0.1", upstream.port or 80)
        self.endpoint = ""  # set once the server listens
        self.gets: Counter[str] = Counter()
        self.readers: Counter[str] = Counter()  # GETs by the client that sent them: "obstore" or "s3fs"
        self.methods: Counter[str] = Counter()  # every request, by method: a HEAD shows here
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        self._stalled = threading.Condition(self._lock)
        self._stalled_now = 0
        self.most_stalled = 0  # the most GETs held at once, so far
        self._stopping = threading.Event()

    def fault(self, method: str, pattern: str, how: Fault, times: int | None = 1, seconds: float = 0.0,
              action: Callable[[], None] | None = None) -> None:
        """Break the next `times` `method` requests matching `pattern` (None: all, until `clear`) as
        `how` says (the module's docstring); `seconds` for "stall", `action` for "call"."""
        if how not in FAULTS:
            raise ValueError(f"how={how!r} is not a fault the front knows: use one of {', '.join(FAULTS)}.")
        if (how == "call") != (action is not None):
            raise ValueError(f"how={how!r} with action={action!r}: an action goes with 'call', and only with it.")
        self._add(_Rule(pattern, how, times, seconds, _method(method), action))

    def fail_gets(self, pattern: str, times: int, how: FailHow = "503") -> None:
        """Fail the next `times` GETs matching `pattern`: 503 SlowDown, or a TCP reset."""
        if how not in ("503", "reset"):
            raise ValueError(f"how={how!r} is not a fault the front knows: use '503' or 'reset'.")
        self.fault("GET", pattern, how, times)

    def stall_gets(self, pattern: str, seconds: float, times: int | None = None) -> None:
        """Hold the next `times` GETs matching `pattern` (None: all) for `seconds`, then answer."""
        self.fault("GET", pattern, "stall", times, seconds)

    def drop_replies(self, method: str, pattern: str, times: int) -> None:
        """Forward the next `times` `method` requests matching `pattern` to the server, then drop the
        connection instead of answering: the write happened, and the client never heard of it."""
        self.fault(method, pattern, "drop reply", times)

    def before_forwarding(self, method: str, pattern: str, action: Callable[[], None], times: int = 1) -> None:
        """Run `action` (another client's write, say) before forwarding the next `times` matching
        requests, after any rule added earlier has been used up by the ones before them."""
        self.fault(method, pattern, "call", times, action=action)

    def rules_left(self) -> int:
        """How many rules still wait for a request to match them (a test's fault that never fired shows here)."""
        with self._lock:
            return sum(1 for rule in self._rules if rule.remaining != 0)

    def count_reader(self, user_agent: str) -> None:
        """Count a GET under its client, told by its User-Agent: obstore's names object_store, botocore's itself."""
        with self._lock:
            self.readers["obstore" if user_agent.startswith("object_store/") else "s3fs"] += 1

    def clear(self) -> None:
        """Drop every rule; GETs already stalled still wait out their time."""
        with self._lock:
            self._rules.clear()

    def wait_stalled(self, timeout: float) -> bool:
        """Wait until at least one GET is being held; False if none is within `timeout`."""
        with self._stalled:
            return self._stalled.wait_for(lambda: self._stalled_now > 0, timeout)

    def _add(self, rule: _Rule) -> None:
        if rule.remaining is not None and rule.remaining < 1:
            raise ValueError(f"times={rule.remaining} must be at least 1, or None for every request.")
        with self._lock:
            self._rules.append(rule)

    def _take_rule(self, key: str, method: str = "GET") -> _Rule | None:
        """Count a request for `key` and return the rule it uses up, if any."""
        with self._lock:
            if method == "GET":
                self.gets[key] += 1
            self.methods[method] += 1
            for rule in self._rules:
                if rule.method == method and rule.remaining != 0 and fnmatch.fnmatchcase(key, rule.pattern):
                    if rule.remaining is not None:
                        rule.remaining -= 1
                    return rule
        return None

    def _stall(self, seconds: float) -> None:
        with self._stalled:
            self._stalled_now += 1
            self.most_stalled = max(self.most_stalled, self._stalled_now)
            self._stalled.notify_all()
        try:
            self._stopping.wait(seconds)  # the front's shutdown releases it early
        finally:
            with self._lock:
                self._stalled_now -= 1


def _handler(front: FaultyS3) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as clients expect of S3

        def log_message(self, *args) -> None:  # quiet: tests read the counters instead
            pass

        def _serve(self) -> None:
            if self.command == "GET":
                front.count_reader(self.headers.get("User-Agent", ""))
            rule = front._take_rule(unquote(urlsplit(self.path).path).lstrip("/"), self.command)
            kind = rule.kind if rule else None
            if kind == "reset":
                self._discard_body()
                self._reset()
                return
            if rule and kind in ("503", "500", "412"):
                self._discard_body()
                code, message = ERRORS[int(kind)]
                body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                        f"<Message>{message}</Message></Error>").encode()
                self._answer(int(kind), {"Content-Type": "application/xml"}, body)
                return
            if rule and kind == "stall":
                front._stall(rule.seconds)
            if rule and rule.action:
                rule.action()
            self._forward(kind)

        do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _serve

        def _forward(self, kind: Fault | None) -> None:
            body = self._discard_body()
            headers = {k: v for k, v in self.headers.items() if k.lower() not in NOT_FORWARDED}
            if kind == "cut" and self.command == "PUT":  # kept without the checksum that would tell
                body = body[: len(body) // 2]
                headers = {k: v for k, v in headers.items() if not k.lower().startswith(CHECKSUM_HEADERS)}
            upstream = http.client.HTTPConnection(*front.upstream, timeout=60)
            try:
                upstream.request(self.command, self.path, body=body or None, headers=headers)
                response = upstream.getresponse()
                data = response.read()
                if kind == "drop reply":
                    self._reset()
                    return
                answer = {k: v for k, v in response.getheaders() if k.lower() not in NOT_FORWARDED
                          and not (kind == "cut" and k.lower().startswith(CHECKSUM_HEADERS))}
                if self.command == "HEAD":  # no body, but the object's length
                    answer["Content-Length"] = response.getheader("Content-Length", "0")
                if kind == "cut" and self.command == "GET":
                    answer["Content-Length"] = str(len(data))
                    self._answer(response.status, answer, data[: len(data) // 2])
                    self._reset()
                    return
                self._answer(response.status, answer, data)
            finally:
                upstream.close()

        def _discard_body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _answer(self, status: int, headers: dict[str, str], data: bytes) -> None:
            try:
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                if "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
                self.close_connection = True

        def _reset(self) -> None:
            # SO_LINGER 0: close() sends RST, as a dropped connection does.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            self.close_connection = True

    return Handler


@contextmanager
def faulty_s3(upstream_endpoint: str) -> Iterator[FaultyS3]:
    """A FaultyS3 front listening on 127.0.0.1 (a free port) until the block ends.

    Args:
        upstream_endpoint: the real S3 server's endpoint, e.g. the session moto server.
    """
    front = FaultyS3(upstream_endpoint)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(front))
    server.daemon_threads = True
    front.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), name="faulty-s3", daemon=True)
    thread.start()
    try:
        yield front
    finally:
        front._stopping.set()
        server.shutdown()
        server.server_close()
        thread.join()
