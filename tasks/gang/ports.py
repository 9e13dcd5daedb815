"""A free port for a listener that starts later: the rank-0 store, a local server.

The port is picked outside the host's ephemeral range. A port picked by binding port 0 comes
from that range, and between the pick and the listener's own bind the kernel may hand the
same port to any outgoing connection on the host (a Dask worker's, an S3 read's): the
listener then fails with EADDRINUSE, and a gang attempt with it (a CI run here lost one
test so). Outside the range only another explicit bind to the same number can take it.
"""

from __future__ import annotations

import errno
import secrets
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")  # Linux; IPv6 uses the same range
LOWEST_PORT = 1024  # below: privileged
HIGHEST_PORT = 65535
TRIES = 20


def free_port() -> int:
    """A TCP port free right now on this host: one of `TRIES` numbers drawn outside its
    ephemeral range, or one bound at 0 where the range leaves no room or every number drawn was taken.

    Bound dual-stack where the host has IPv6 (free on IPv4 and IPv6 alike, as torch's
    TCPStore listens on both), IPv4 where it has no IPv6, IPv6 where it has no IPv4.
    Numbers are drawn by the OS's randomness, not `random`'s: forked workers share its state,
    and two gangs on one host would try the same numbers in the same order.
    """
    candidates = ports_outside(ephemeral_range())
    for port in secrets.SystemRandom().sample(candidates, min(TRIES, len(candidates))):
        try:
            return bound_port(port)
        except OSError:  # taken: another number
            continue
    return bound_port(0)


def ephemeral_range() -> tuple[int, int] | None:
    """The host's ephemeral ports (`low`, `high`, inclusive); None where it does not say."""
    try:
        low, high = (int(part) for part in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return None
    return low, high


def ports_outside(ephemeral: tuple[int, int] | None) -> list[int]:
    """The unprivileged ports outside `ephemeral`: none where the range is unknown or covers them all.

    >>> len(ports_outside((32768, 60999))), len(ports_outside((1024, 65535))), len(ports_outside(None))
    (36280, 0, 0)
    >>> outside = ports_outside((1024, 60999))
    >>> outside[0], outside[-1], len(outside)
    (61000, 65535, 4536)
    >>> len(ports_outside((70000, 80000)))  # not a range Linux accepts: no number past 65535 either way
    64512
    """
    if ephemeral is None:
        return []
    low, high = (min(max(LOWEST_PORT, bound), HIGHEST_PORT + 1) for bound in ephemeral)
    return [*range(LOWEST_PORT, low), *range(max(LOWEST_PORT, high + 1), HIGHEST_PORT + 1)]


def bound_port(port: int) -> int:
    """`port` once bound on every address family this host has (0: any port), then released."""
    if socket.has_dualstack_ipv6():
        server = socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True)
    else:
        try:
            server = socket.create_server(("", port), family=socket.AF_INET)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:  # taken on IPv4: not free, whatever IPv6 says
                raise
            server = socket.create_server(("::", port), family=socket.AF_INET6)  # an IPv6-only host
    with server:
        bound: int = server.getsockname()[1]
        return bound
