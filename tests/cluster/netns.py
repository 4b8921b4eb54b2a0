"""Several "hosts" on one machine: network namespaces, each joined to the root namespace
by a veth pair, so that a process inside one reaches a server in the root namespace only
over its own link, which a test can cut and restore.

Node i gets the subnet 10.233.<s_i>.0/24: the root side of its link is 10.233.<s_i>.1
(a server listening there is "across the network" for that node), the node side
10.233.<s_i>.2. Subnets are picked under a lock among those no interface or route on this
machine uses yet, and names carry our pid, so concurrent test runs do not collide.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psutil

IP = shutil.which("ip") or "/usr/sbin/ip"
PREFIX = "10.233"  # the tests' own address range, one /24 per node
_LOCK_PATH = "/tmp/modelpool-netns.lock"
_NAME = re.compile(r"^mpt(\d+)n(\d+)$")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([IP, *args], capture_output=True, text=True, check=check, timeout=10)


def unavailable_reason() -> str | None:
    """Why namespaces and veth pairs cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not os.access(IP, os.X_OK):
        return "iproute2 (`ip`) not found"
    probe = f"mpt{os.getpid()}probe"
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"cannot create a network namespace: {made.stderr.strip()}"
        veth = _ip("-n", probe, "link", "add", "mptpa", "type", "veth", "peer", "name", "mptpb",
                   check=False)
        if veth.returncode != 0:
            return f"cannot create a veth pair: {veth.stderr.strip()}"
        return None
    finally:
        _ip("netns", "del", probe, check=False)


@dataclass(frozen=True)
class Node:
    index: int
    netns: str  # namespace name
    host_dev: str  # veth end in the root namespace
    node_dev: str  # veth end inside the namespace
    host_address: str  # root side: where this node reaches the root namespace's servers
    address: str  # the node's own address


class NetNamespaces:
    """`count` namespaces with a veth link each. Use as a context manager, or call
    create() and delete(); delete() is safe to call more than once and after a partial
    create()."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.nodes: list[Node] = []
        self._processes: list[subprocess.Popen[Any]] = []

    def __enter__(self) -> NetNamespaces:
        try:
            self.create()
        except BaseException:
            self.delete()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.delete()

    # -- setup and teardown ------------------------------------------------------------

    def create(self) -> None:
        pid = os.getpid()
        with _address_lock():
            _sweep_leftovers()
            subnets = _free_subnets(self.count)
            for i, subnet in enumerate(subnets):
                node = Node(i, f"mpt{pid}n{i}", f"mpt{pid}h{i}", f"mpt{pid}c{i}",
                            f"{PREFIX}.{subnet}.1", f"{PREFIX}.{subnet}.2")
                self.nodes.append(node)  # before creating it: delete() undoes a half-made one
                _make_node(node)

    def delete(self) -> None:
        """Stop everything running inside, then remove the links and namespaces."""
        self.kill_processes()
        for node in self.nodes:
            _ip("link", "del", node.host_dev, check=False)  # takes its peer with it
            _ip("netns", "del", node.netns, check=False)
        self.nodes = []

    def kill_processes(self, timeout_s: float = 5) -> None:
        """SIGKILL what we started in the namespaces, and whatever else runs in them
        (our own test processes' children)."""
        for process in self._processes:
            if process.poll() is None:
                process.kill()
        for process in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout_s)
        self._processes = []
        procs: list[psutil.Process] = []
        for node in self.nodes:
            listed = _ip("netns", "pids", node.netns, check=False).stdout.split()
            for pid in listed:
                with contextlib.suppress(psutil.NoSuchProcess):
                    procs.append(psutil.Process(int(pid)))
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.send_signal(signal.SIGKILL)
        psutil.wait_procs(procs, timeout=timeout_s)

    # -- use ---------------------------------------------------------------------------

    def host_addresses(self) -> list[str]:
        """The root-side address of every node's link (where a root-namespace server must
        listen to be reachable from all nodes)."""
        return [node.host_address for node in self.nodes]

    def host_address(self, node: int) -> str:
        return self.nodes[node].host_address

    def address(self, node: int) -> str:
        return self.nodes[node].address

    def command(self, node: int, argv: Sequence[str]) -> list[str]:
        """argv wrapped to run inside the node's namespace."""
        return [IP, "netns", "exec", self.nodes[node].netns, *argv]

    def popen(self, node: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start argv inside the node's namespace. The environment is passed through
        (this process's, or env=...); other arguments go to Popen. The process is killed
        by kill_processes()/delete() if still running then."""
        kwargs.setdefault("env", dict(os.environ))
        process = subprocess.Popen(self.command(node, argv), **kwargs)
        self._processes.append(process)
        return process

    def run(self, node: int, argv: Sequence[str], timeout_s: float = 30,
            **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run argv inside the node's namespace to completion (text output captured)."""
        kwargs.setdefault("env", dict(os.environ))
        return subprocess.run(self.command(node, argv), capture_output=True, text=True,
                              timeout=timeout_s, **kwargs)

    def link_down(self, node: int) -> None:
        """Cut the node's link (its side of the veth): new connections from it fail at
        once, established ones hear nothing more in either direction."""
        n = self.nodes[node]
        _ip("-n", n.netns, "link", "set", n.node_dev, "down")

    def link_up(self, node: int, timeout_s: float = 5) -> None:
        """Restore the node's link; returns once its route to the root side is back."""
        n = self.nodes[node]
        _ip("-n", n.netns, "link", "set", n.node_dev, "up")
        deadline = time.monotonic() + timeout_s
        while n.host_address not in _ip("-n", n.netns, "route", "get", n.host_address,
                                         check=False).stdout:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no route back to {n.host_address} from {n.netns}")
            time.sleep(0.01)

    def links_up(self) -> None:
        for i in range(len(self.nodes)):
            self.link_up(i)


def _make_node(node: Node) -> None:
    _ip("netns", "add", node.netns)
    _ip("link", "add", node.host_dev, "type", "veth", "peer", "name", node.node_dev)
    _ip("link", "set", node.node_dev, "netns", node.netns)
    _ip("addr", "add", f"{node.host_address}/24", "dev", node.host_dev)
    _ip("link", "set", node.host_dev, "up")
    _ip("-n", node.netns, "addr", "add", f"{node.address}/24", "dev", node.node_dev)
    _ip("-n", node.netns, "link", "set", node.node_dev, "up")
    _ip("-n", node.netns, "link", "set", "lo", "up")


@contextlib.contextmanager
def _address_lock() -> Iterator[None]:
    with open(_LOCK_PATH, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _free_subnets(count: int) -> list[int]:
    """Third octets s of PREFIX.s.0/24 that no address or route here overlaps."""
    taken: list[ipaddress.IPv4Network] = []
    for line in _ip("-4", "-o", "addr", "show").stdout.splitlines():
        fields = line.split()
        if "inet" in fields:
            taken.append(ipaddress.ip_interface(fields[fields.index("inet") + 1]).network)
    for line in _ip("-4", "route", "show", "table", "all").stdout.splitlines():
        dest = line.split()[0] if line.split() else ""
        if dest[:1].isdigit():
            taken.append(ipaddress.ip_network(dest, strict=False))
    free: list[int] = []
    for third in range(1, 255):
        candidate = ipaddress.ip_network(f"{PREFIX}.{third}.0/24")
        if not any(candidate.overlaps(net) for net in taken if net.prefixlen > 0):
            free.append(third)
            if len(free) == count:
                return free
    raise RuntimeError(f"no {count} free /24 subnets left in {PREFIX}.0.0/16")


def _sweep_leftovers() -> None:
    """Remove the namespaces and links of test runs that died without cleaning up (their
    pid is gone). Processes still inside are left alone; the namespace goes with them."""
    names = _ip("netns", "list", check=False).stdout.split("\n")
    for line in names:
        match = _NAME.match(line.split(" ")[0]) if line else None
        if match and not psutil.pid_exists(int(match.group(1))):
            _ip("link", "del", f"mpt{match.group(1)}h{match.group(2)}", check=False)
            _ip("netns", "del", match.group(0), check=False)
