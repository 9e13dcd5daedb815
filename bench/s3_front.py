"""A light, read-only S3 endpoint on loopback that answers every request after a fixed latency.

moto answers in milliseconds but only about 200-300 GETs per second on this 2-core machine
(docs/architecture.md, "Facts: moto"), so a data-path benchmark through moto measures moto.
Real S3 answers in tens of milliseconds and scales far past what one client asks. This front
stands in for it: it serves objects from memory (files loaded from a folder at start),
ignores authentication, waits `latency_ms` before each response, and counts requests by
kind, so a benchmark can check how many HTTP requests a client sends per image.

It is one asyncio process with a hand-rolled HTTP/1.1 parser (keep-alive, no pipelining
needed): BaseHTTPRequestHandler costs a thread and a slow parse per request, which on two
cores would take CPU from the client being measured. The latency is a timer, not a sleep,
so thousands of requests can wait at once.

What it answers, which is what s3fs and boto3 send to read objects:
    GET  /bucket/key                      GetObject (whole object; a Range is refused, 501)
    HEAD /bucket/key                      HeadObject
    GET  /bucket?prefix=..[&list-type=2]  ListObjects (v1) and ListObjectsV2, with paging and
                                          a delimiter (common prefixes)
    GET  /__front__/stats                 {"GET": n, "HEAD": n, "LIST": n, ...}: not delayed,
                                          not counted
Anything else is answered 405 after the same latency.

    python -m bench.s3_front --dir DATA --bucket bench --port 9000 --latency-ms 30
    python -m bench.s3_front --synthetic images 20 5000 --bucket bench --port 9000  # 100k keys
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import hashlib
import json
import time
from collections import Counter
from dataclasses import dataclass
from email.utils import formatdate
from pathlib import Path
from urllib.parse import parse_qs, quote, unquote, urlsplit
from xml.sax.saxutils import escape

STATS_PATH = "/__front__/stats"
MAX_KEYS = 1000  # S3's own page size for listings
LAST_CHAR = chr(0x10FFFF)  # sorts after any character a key can hold
S3_XMLNS = "http://s3.amazonaws.com/doc/2006-03-01/"
REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 501: "Not Implemented"}


@dataclass(frozen=True)
class StoredObject:
    data: bytes
    etag: str


def load_objects(folder: Path) -> dict[str, StoredObject]:
    """Every file below `folder`, keyed by its path relative to it, with '/' separators."""
    objects = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = path.read_bytes()
        objects[path.relative_to(folder).as_posix()] = StoredObject(data, f'"{hashlib.md5(data).hexdigest()}"')
    return objects


def request_kind(method: str, target: str) -> str:
    """GET, HEAD or LIST (a GET of the bucket itself); also used to read moto's request log."""
    path = urlsplit(target).path.strip("/")
    return "LIST" if method == "GET" and "/" not in path else method


def list_page(keys: list[str], query: dict[str, str]) -> tuple[list[tuple[str, bool]], bool]:
    """One page of sorted `keys` as (name, is a common prefix), and whether more follow.

    v1 pages by marker, v2 by token; with a delimiter, keys that have it after the prefix
    are rolled up into one common prefix each, as S3 does. Found by bisection, so a page
    costs the front about what it sends, not a scan of the bucket.
    """
    prefix, delimiter = query.get("prefix", ""), query.get("delimiter", "")
    after = query.get("continuation-token") or query.get("start-after") or query.get("marker") or ""
    limit = min(int(query.get("max-keys", MAX_KEYS)), MAX_KEYS)
    index = bisect.bisect_left(keys, prefix)
    if after:  # past the last name sent; past everything under it, where it was a common prefix
        index = max(index, bisect.bisect_right(keys, after + LAST_CHAR if delimiter and after.endswith(delimiter) else after))
    page: list[tuple[str, bool]] = []
    while index < len(keys) and keys[index].startswith(prefix) and len(page) <= limit:
        rest = keys[index][len(prefix):]
        if delimiter and delimiter in rest:
            common = prefix + rest.split(delimiter, 1)[0] + delimiter
            page.append((common, True))
            index = bisect.bisect_right(keys, common + LAST_CHAR)
        else:
            page.append((keys[index], False))
            index += 1
    return page[:limit], len(page) > limit


def synthetic_objects(prefix: str, classes: int, per_class: int) -> dict[str, StoredObject]:
    """`prefix/classNNN/NNNNNN.jpg` keys of a few bytes each (sizes vary, none empty): a
    bucket to list, not to read."""
    return {f"{prefix}/class{c:03d}/{i:06d}.jpg": StoredObject(b"x" * (1 + (c + i) % 7), f'"{c}-{i}"')
            for c in range(classes) for i in range(per_class)}


class Front:
    """The objects of one bucket, the latency, and the request counts."""

    def __init__(self, bucket: str, objects: dict[str, StoredObject], latency_s: float) -> None:
        self.bucket = bucket
        self.objects = objects
        self.keys = sorted(objects)
        self.latency_s = latency_s
        self.counts: Counter[str] = Counter()
        # Listings show ISO 8601, headers RFC 1123; one start time serves for every object.
        self.modified_header = formatdate(usegmt=True)
        self.modified_iso = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())

    def respond(self, method: str, target: str, headers: dict[str, str]) -> bytes:
        """The whole HTTP response (status line, headers, body) to one request."""
        if target == STATS_PATH:
            return response(200, {"Content-Type": "application/json"}, json.dumps(self.counts).encode())
        self.counts[request_kind(method, target)] += 1
        split = urlsplit(target)
        bucket, _, key = unquote(split.path).lstrip("/").partition("/")
        if method not in ("GET", "HEAD"):
            return error(405, "MethodNotAllowed", f"{method} is not served by this read-only front.")
        if bucket != self.bucket:
            return error(404, "NoSuchBucket", f"Only bucket {self.bucket!r} is served.", method)
        if not key:
            query = {name: values[0] for name, values in parse_qs(split.query, keep_blank_values=True).items()}
            return response(200, {"Content-Type": "application/xml"}, self.listing(query))
        if "range" in headers:
            return error(501, "NotImplemented", "Range requests are not served by this front.", method)
        if key not in self.objects:
            return error(404, "NoSuchKey", f"No object {key!r}.", method)
        return self.object_response(self.objects[key], method)

    def object_response(self, stored: StoredObject, method: str) -> bytes:
        headers = {"Content-Type": "binary/octet-stream", "ETag": stored.etag,
                   "Last-Modified": self.modified_header, "Accept-Ranges": "bytes"}
        if method == "HEAD":  # no body, but the object's length
            return response(200, headers | {"Content-Length": str(len(stored.data))}, b"")
        return response(200, headers, stored.data)

    def listing(self, query: dict[str, str]) -> bytes:
        """A ListBucketResult: ListObjects (v1), or ListObjectsV2 with list-type=2."""
        page, truncated = list_page(self.keys, query)
        v2 = query.get("list-type") == "2"
        url = query.get("encoding-type") == "url"  # botocore asks for it and unquotes the keys

        def shown(key: str) -> str:
            return escape(quote(key, safe="/") if url else key)

        parts = [f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="{S3_XMLNS}">',
                 f"<Name>{escape(self.bucket)}</Name><Prefix>{shown(query.get('prefix', ''))}</Prefix>",
                 f"<MaxKeys>{MAX_KEYS}</MaxKeys><IsTruncated>{str(truncated).lower()}</IsTruncated>"]
        if v2:
            parts.append(f"<KeyCount>{len(page)}</KeyCount>")
        if query.get("delimiter"):
            parts.append(f"<Delimiter>{shown(query['delimiter'])}</Delimiter>")
        if truncated:
            tag = "NextContinuationToken" if v2 else "NextMarker"
            parts.append(f"<{tag}>{escape(page[-1][0])}</{tag}>")
        for name, is_prefix in page:
            if is_prefix:
                parts.append(f"<CommonPrefixes><Prefix>{shown(name)}</Prefix></CommonPrefixes>")
                continue
            stored = self.objects[name]
            parts.append(
                f"<Contents><Key>{shown(name)}</Key><LastModified>{self.modified_iso}</LastModified>"
                f"<ETag>{escape(stored.etag)}</ETag><Size>{len(stored.data)}</Size>"
                "<StorageClass>STANDARD</StorageClass></Contents>"
            )
        parts.append("</ListBucketResult>")
        return "".join(parts).encode()


def response(status: int, headers: dict[str, str], body: bytes) -> bytes:
    head = {"Content-Length": str(len(body))} | headers
    lines = [f"HTTP/1.1 {status} {REASONS[status]}", *(f"{k}: {v}" for k, v in head.items()), "", ""]
    return "\r\n".join(lines).encode("latin-1") + body


def error(status: int, code: str, message: str, method: str = "GET") -> bytes:
    body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>{escape(message)}</Message></Error>")
    return response(status, {"Content-Type": "application/xml"}, b"" if method == "HEAD" else body.encode())


class FrontProtocol(asyncio.Protocol):
    """One client connection: parse each request, answer it `latency_s` later."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := self.buffer.find(b"\r\n\r\n")) >= 0:
            lines = self.buffer[:end].decode("latin-1").split("\r\n")
            method, target, _ = lines[0].split(" ", 2)
            headers = {name.strip().lower(): value.strip()
                       for name, _, value in (line.partition(":") for line in lines[1:])}
            length = int(headers.get("content-length") or 0)
            if len(self.buffer) < end + 4 + length:
                return  # the body is still on its way
            self.buffer = self.buffer[end + 4 + length:]
            self.answer(method, target, headers)

    def answer(self, method: str, target: str, headers: dict[str, str]) -> None:
        data = self.front.respond(method, target, headers)
        close = headers.get("connection", "").lower() == "close" or method not in ("GET", "HEAD")
        delay = 0.0 if target == STATS_PATH else self.front.latency_s
        asyncio.get_running_loop().call_later(delay, self.send, data, close)

    def send(self, data: bytes, close: bool) -> None:
        if self.transport is None or self.transport.is_closing():
            return  # the client gave up
        self.transport.write(data)
        if close:
            self.transport.close()


async def serve(front: Front, host: str, port: int) -> None:
    server = await asyncio.get_running_loop().create_server(lambda: FrontProtocol(front), host, port)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--dir", type=Path, help="Folder whose files become the objects.")
    source.add_argument("--synthetic", nargs=3, metavar=("PREFIX", "CLASSES", "PER_CLASS"),
                        help="Tiny objects PREFIX/classNNN/NNNNNN.jpg, for listing.")
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--latency-ms", type=float, default=30.0, help="Wait before each response.")
    args = parser.parse_args()
    if args.dir:
        objects = load_objects(args.dir)
    else:
        prefix, classes, per_class = args.synthetic
        objects = synthetic_objects(prefix, int(classes), int(per_class))
    front = Front(args.bucket, objects, args.latency_ms / 1000)
    asyncio.run(serve(front, args.host, args.port))


if __name__ == "__main__":
    main()
