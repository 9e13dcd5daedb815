"""moto's S3 server, started with an image folder already in its bucket.

Putting 100k objects through moto's HTTP API runs at moto's request rate (a few hundred
per second on this 2-core machine; docs/architecture.md,
"Facts: moto"), minutes of setup for a benchmark that
measures listings. This process writes the objects straight into moto's in-memory
backend, then serves it: what clients list over HTTP is the same.

    python -m bench.seeded_moto --port 5123 --bucket b --prefix images --classes 20 --per-class 5000
"""

from __future__ import annotations

import argparse

from moto.core import DEFAULT_ACCOUNT_ID
from moto.s3.models import s3_backends
from moto.server import main as serve

from prefect_ddp.deployments.local_services import MOTO_REGION

# A few bytes stand in for a JPEG: listings carry keys and sizes, never contents.
OBJECT_BYTES = b"\xff\xd8\xff\xe0tiny"


def image_keys(prefix: str, classes: int, per_class: int) -> list[str]:
    """`<prefix>/<class>/<image>.jpg` keys, the layout build_manifest expects."""
    return [f"{prefix}/class{c:03d}/{i:06d}.jpg" for c in range(classes) for i in range(per_class)]


def seed(bucket: str, keys: list[str]) -> None:
    """Create `bucket` holding `keys` in this process's moto backend."""
    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    backend.create_bucket(bucket, MOTO_REGION)
    for key in keys:
        backend.put_object(bucket, key, OBJECT_BYTES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--classes", type=int, required=True)
    parser.add_argument("--per-class", type=int, required=True)
    args = parser.parse_args()
    seed(args.bucket, image_keys(args.prefix, args.classes, args.per_class))
    serve(["-H", "127.0.0.1", "-p", str(args.port)])


if __name__ == "__main__":
    main()
