"""Hosts on one machine, for tests of what crosses a network: Linux network namespaces on a bridge.

Each host is a network namespace with its own loopback and one veth interface (`eth0`)
plugged into a bridge in the root namespace, which holds the bridge's first address:

    root namespace: bridge pddpXXXXXX 10.A.B.1/24  (reaches every host; hosts reach it)
      +-- veth --> namespace pddp-XXXXXX-scheduler  eth0 10.A.B.2
      +-- veth --> namespace pddp-XXXXXX-worker-a   eth0 10.A.B.3
      +-- veth --> namespace pddp-XXXXXX-worker-b   eth0 10.A.B.4

Loopback is per namespace, as on real hosts: a service listening on the root namespace's
127.0.0.1 is out of the hosts' reach, so `forward` puts a listener on the bridge address
in front of it. Names carry a random suffix and the subnet is one no route of the root
namespace covers, so concurrent test runs never share either. Everything made is undone
when `network` ends, on failure too: processes started in the hosts (by process group),
then the veths and namespaces, then the bridge.

    with network(["server", "client"]) as net:
        net.start("server", ["python", "-m", "http.server", "--bind", net.hosts["server"].address],
                  log, dict(os.environ), Path.cwd())
        ...  # reachable from the "client" host, and from this process at the same address
"""

from __future__ import annotations

import ipaddress
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

PREFIX = "pddp"
HOST_INTERFACE = "eth0"  # each host's veth end, named as a real host's interface often is
STOP_WAIT_S = 10


def ip(*args: str) -> None:
    """Run `ip ARGS`, raising with its message when it fails."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")


def unavailable() -> str | None:
    """Why this machine cannot make network namespaces here, or None where it can."""
    if shutil.which("ip") is None:
        return "the `ip` command (Debian package iproute2) is not installed"
    if os.geteuid() != 0:
        return "`ip netns add` needs root"
    probe = f"{PREFIX}-probe-{secrets.token_hex(3)}"
    try:
        ip("netns", "add", probe)
    except RuntimeError as exc:
        return f"network namespaces are not permitted here: {exc}"
    ip("netns", "del", probe)
    return None


def free_subnet() -> ipaddress.IPv4Network:
    """A random 10.x.y.0/24 that no route of the root namespace overlaps (nor its gateways)."""
    routes = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True,
                            check=True).stdout
    taken = []
    for word in routes.split():
        try:
            taken.append(ipaddress.ip_network(word, strict=False))
        except ValueError:
            continue
    for _ in range(100):
        subnet = ipaddress.ip_network(f"10.{random.randint(100, 254)}.{random.randint(0, 255)}.0/24")
        if not any(subnet.overlaps(t) for t in taken if t.version == 4):
            return subnet
    raise RuntimeError(f"no free 10.x.y.0/24 subnet: routes here are {taken}")


@dataclass(frozen=True)
class Host:
    """One network namespace: a host with its own address, ports and loopback."""

    namespace: str
    address: str

    def command(self, args: list[str]) -> list[str]:
        """`args` run inside this host's network namespace."""
        return ["ip", "netns", "exec", self.namespace, *args]


@dataclass
class Network:
    """The hosts of one `network`, and the root namespace's address on their bridge."""

    gateway: str
    hosts: dict[str, Host]
    _stack: ExitStack

    def start(self, host: str, args: list[str], log: Path, env: dict[str, str], cwd: Path) -> subprocess.Popen:
        """Start `args` in `host`, in a process group of its own that the network's end kills."""
        sink = open(log, "wb")
        self._stack.callback(sink.close)
        process = subprocess.Popen(self.hosts[host].command(args), stdout=sink, stderr=subprocess.STDOUT,
                                   env=env, cwd=cwd, start_new_session=True)
        self._stack.callback(stop_group, process)
        return process


def delete_link(name: str) -> None:
    """`ip link del NAME`, where NAME may be gone already (a veth goes with its peer)."""
    if subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0:
        ip("link", "del", name)


def stop_group(process: subprocess.Popen) -> None:
    """SIGKILL the process's whole group: a nanny and the worker it started (or restarted).

    Nothing in a test host needs a graceful end, and a nanny given SIGTERM takes seconds
    to close its worker.
    """
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


@contextmanager
def network(names: list[str]) -> Iterator[Network]:
    """One host per name on a bridge of their own; all of it removed when the block ends."""
    suffix = secrets.token_hex(3)
    subnet = free_subnet()
    addresses = list(subnet.hosts())
    bridge = f"{PREFIX}{suffix}"
    with ExitStack() as stack:
        ip("link", "add", bridge, "type", "bridge")
        stack.callback(ip, "link", "del", bridge)
        ip("addr", "add", f"{addresses[0]}/{subnet.prefixlen}", "dev", bridge)
        ip("link", "set", bridge, "up")
        hosts = {}
        for index, name in enumerate(names, start=1):
            host = Host(f"{PREFIX}-{suffix}-{name}", str(addresses[index]))
            veth = f"{bridge}{index}"
            ip("netns", "add", host.namespace)
            stack.callback(ip, "netns", "del", host.namespace)
            ip("link", "add", veth, "type", "veth", "peer", "name", HOST_INTERFACE, "netns", host.namespace)
            # Deleted by name, before its namespace: here (gVisor) a deleted namespace once
            # left its veths' root ends behind.
            stack.callback(delete_link, veth)
            ip("link", "set", veth, "master", bridge, "up")
            ip("-n", host.namespace, "addr", "add", f"{host.address}/{subnet.prefixlen}", "dev", HOST_INTERFACE)
            ip("-n", host.namespace, "link", "set", HOST_INTERFACE, "up")
            ip("-n", host.namespace, "link", "set", "lo", "up")
            hosts[name] = host
        # Processes go before the namespaces they run in: the ExitStack unwinds in reverse.
        yield Network(str(addresses[0]), hosts, stack)


def relay(source: socket.socket, sink: socket.socket) -> None:
    """Copy `source` to `sink` until it ends; pass the end on, or a reset as a reset both ways."""
    try:
        while data := source.recv(65536):
            sink.sendall(data)
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def connect(client: socket.socket, target: tuple[str, int]) -> None:
    """Relay one accepted connection to `target`, both ways, until both ways end."""
    with client:
        try:
            upstream = socket.create_connection(target)
        except OSError:
            return  # the client sees its connection closed, as with a refused one
        with upstream:
            back = threading.Thread(target=relay, args=(upstream, client), daemon=True)
            back.start()
            relay(client, upstream)
            back.join()


@contextmanager
def forward(url: str, host: str) -> Iterator[str]:
    """A TCP listener on `host` (a free port) that relays every connection to `url`'s host and port.

    Yields `url` with its host and port replaced by the listener's: the same service,
    reachable where `url` is not (a root-namespace loopback service, from the hosts).
    Relays in threads of this process: the traffic of a test (API calls, small images) is light.
    """
    parts = urlsplit(url)
    target = (parts.hostname, parts.port)
    listener = socket.create_server((host, 0))
    listener.settimeout(0.2)  # so that the accept loop sees `stopping`
    stopping = threading.Event()

    def accept() -> None:
        while not stopping.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=connect, args=(client, target), daemon=True).start()

    thread = threading.Thread(target=accept, name=f"forward-{host}", daemon=True)
    with listener:
        thread.start()
        try:
            yield urlunsplit(parts._replace(netloc=f"{host}:{listener.getsockname()[1]}"))
        finally:
            stopping.set()
            thread.join()
