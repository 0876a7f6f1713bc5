"""Simulated hosts for the fleet benchmarks: network namespaces, each joined to this host by
a veth pair whose two ends delay every packet with ``tc netem``, as a worker host's network
would. Needs root and iproute2.

    with Hosts(count=4, rtt_ms=2.0, jitter_ms=0.2) as hosts:
        sock = hosts.socket(i)      # a TCP socket made inside host i's namespace
        addr = hosts.core_addr(i)   # this host's address as host i reaches it

Where the kernel has no ``sch_netem`` (this machine's has tbf, htb and pfifo only), the
namespaces and veths are still made and ``client_delay_s`` says the round trip the client
must add itself: the benchmarks' raw HTTP client then waits half of it before sending each
request and half before using its answer, and a round trip before using a new connection.
What core and PostgreSQL see is the same (requests arriving later, connections held
longer); only TCP's own reaction to delay (windows, delayed ACKs) is missing.

A socket belongs to the namespace it was made in, whatever thread later uses it: the
namespace is entered (``setns``) only for the ``socket()`` call, then left. Every
namespace and veth pair is named after this process's pid and removed on exit (deleting a
namespace deletes its veth end, and so the pair).
"""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
from pathlib import Path
from types import TracebackType

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
# 10.213.<i>.0/30 for host i: .1 this host's end, .2 the namespace's
_NET = "10.213"


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class Hosts:
    """``count`` namespaces with ``rtt_ms`` added to every round trip to this host (half
    on each direction), ``jitter_ms`` of normal jitter on each."""

    def __init__(self, count: int, rtt_ms: float, jitter_ms: float = 0.0) -> None:
        if count < 1 or count > 250:
            raise ValueError("between 1 and 250 simulated hosts")
        self.count = count
        self.rtt_ms = rtt_ms
        self.jitter_ms = jitter_ms
        self.tag = f"cf{os.getpid() % 100000}"
        self.fds: list[int] = []
        self.made: list[str] = []
        self.home = -1
        #: the round trip a client must add itself: 0 where netem delays the packets
        self.client_delay_s = 0.0

    def name(self, i: int) -> str:
        return f"{self.tag}-{i}"

    def core_addr(self, i: int) -> str:
        return f"{_NET}.{i}.1"

    def __enter__(self) -> Hosts:
        self.home = os.open("/proc/self/ns/net", os.O_RDONLY)
        try:
            for i in range(self.count):
                self._make(i)
        except BaseException:
            self.close()
            raise
        return self

    def _make(self, i: int) -> None:
        ns, near, far = self.name(i), f"{self.tag}h{i}", f"{self.tag}n{i}"
        _ip("netns", "add", ns)
        self.made.append(ns)
        _ip("link", "add", near, "type", "veth", "peer", "name", far)
        _ip("link", "set", far, "netns", ns)
        _ip("addr", "add", f"{_NET}.{i}.1/30", "dev", near)
        _ip("link", "set", near, "up")
        _ip("-n", ns, "addr", "add", f"{_NET}.{i}.2/30", "dev", far)
        _ip("-n", ns, "link", "set", far, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        if self.rtt_ms > 0:
            delay = ["delay", f"{self.rtt_ms / 2:.3f}ms"]
            if self.jitter_ms > 0:
                delay += [f"{self.jitter_ms:.3f}ms", "distribution", "normal"]
            # a deep queue: netem's default limit (1,000 packets) would drop at the peak
            qdisc = ["qdisc", "add", "dev"]
            netem = ["root", "netem", *delay, "limit", "100000"]
            made = subprocess.run(["tc", *qdisc, near, *netem], capture_output=True, text=True)
            if made.returncode != 0 and "unknown" in made.stderr:
                # a kernel without sch_netem: the client adds the delay (``client_delay_s``)
                self.client_delay_s = self.rtt_ms / 1000
            elif made.returncode != 0:
                raise RuntimeError(f"tc netem: {made.stderr.strip()}")
            else:
                subprocess.run(
                    ["tc", "-n", ns, *qdisc, far, *netem], check=True, capture_output=True
                )
        self.fds.append(os.open(f"/run/netns/{ns}", os.O_RDONLY))

    def socket(self, i: int) -> socket.socket:
        """A non-blocking TCP socket made in host ``i``'s namespace."""
        _setns(self.fds[i % self.count])
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        finally:
            _setns(self.home)
        sock.setblocking(False)
        return sock

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
        for ns in self.made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made.clear()
        if self.home >= 0:
            os.close(self.home)
            self.home = -1

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def available() -> str | None:
    """Why simulated hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root"
    if not Path("/usr/sbin/tc").exists() and not Path("/sbin/tc").exists():
        return "needs tc (iproute2)"
    return None
