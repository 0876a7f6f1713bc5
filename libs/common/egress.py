"""Outbound HTTP to addresses that users name (webhooks): one guarded client.

A user who names a URL must not reach what only Cairn can reach: loopback, the private
networks, link-local (the cloud metadata address 169.254.169.254), unique-local IPv6, and
the database's host. The host is resolved once per connection and every address checked;
the connection is then made to a checked address, never by name again, so a name that
answers differently a moment later (DNS rebinding) changes nothing. TLS still names the
URL's host (SNI and certificate check), as httpcore passes the origin's name to
``start_tls``. Redirects are not followed, proxies from the environment are not used, and
an answer's body is read to a bound only (:func:`post`).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
import ssl
import typing
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpcore
import httpx

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
#: (host, port) -> the addresses it resolves to
Resolver = Callable[[str, int], Awaitable[list[str]]]

REFUSED = "its address is refused (loopback, private and link-local addresses are not reached)"


#: httpx's own pool bounds (httpcore's would allow 10 connections, not 100)
LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=5.0)


class Refused(Exception):
    """The target resolves to an address this client may not connect to."""


def parse_cidrs(text: str) -> tuple[IPNetwork, ...]:
    """``10.1.0.0/16,fd00::/8``: the networks of a comma separated list."""
    items = [part.strip() for part in text.split(",") if part.strip()]
    try:
        return tuple(ipaddress.ip_network(item, strict=False) for item in items)
    except ValueError as exc:
        raise ValueError(f"not a CIDR range: {exc}") from None


def parse_destination(text: str) -> tuple[IPNetwork, int | None]:
    """``10.0.0.5/32:5432``, ``10.0.0.0/8``, ``[fd00::/64]:443`` or ``fd00::1``: a network
    (a bare address is one host) and its port, if one is given (an IPv6 one's port
    follows its bracketed range)."""
    text = text.strip()
    network, port = text, ""
    if text.startswith("["):
        network, _, rest = text[1:].partition("]")
        if rest and not rest.startswith(":"):
            raise ValueError(f"{text!r}: a bracketed range is followed by :PORT or nothing")
        port = rest[1:]
    elif text.count(":") == 1:
        network, _, port = text.partition(":")
    try:
        parsed = ipaddress.ip_network(network, strict=False)
    except ValueError:
        raise ValueError(f"{text!r} is not a CIDR range (with an optional :PORT)") from None
    if not port:
        return parsed, None
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{text!r}: the port must be a number from 1 to 65535")
    return parsed, int(port)


#: IPv6 ranges that carry an IPv4 address in their last 32 bits: NAT64's well-known prefix
#: (RFC 6052: what DNS64 answers for an IPv4-only host), SIIT's IPv4-translated addresses
#: (RFC 2765) and the deprecated IPv4-compatible ones (RFC 4291)
_CARRIERS = tuple(ipaddress.IPv6Network(n) for n in ("64:ff9b::/96", "::ffff:0:0:0/96", "::/96"))
#: Global unicast IPv6 (RFC 4291): every other range (site-local fec0::/10, NAT64's
#: local-use 64:ff9b:1::/48, ...) is not reached
_UNICAST = ipaddress.IPv6Network("2000::/3")
#: Inside 2000::/3 yet not public, and newer than Python's tables: documentation (RFC 9637)
_NOT_PUBLIC = (ipaddress.IPv6Network("3fff::/20"),)


def _embedded(address: IPAddress) -> IPAddress:
    """The IPv4 address an IPv6 one carries (mapped, NAT64, SIIT, IPv4-compatible, 6to4,
    Teredo), else itself: a check of ``::ffff:127.0.0.1`` or ``64:ff9b::a9fe:a9fe`` is a
    check of 127.0.0.1 or 169.254.169.254."""
    if isinstance(address, ipaddress.IPv6Address):
        inner = address.ipv4_mapped or address.sixtofour
        if inner is not None:
            return inner
        if address.teredo is not None:
            return address.teredo[1]
        if any(address in network for network in _CARRIERS):
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address


def is_public(address: IPAddress) -> bool:
    """Whether ``address`` is a global unicast one (not loopback, private, link-local,
    unique-local, site-local, shared, reserved, multicast or unspecified); an IPv6 address
    that carries an IPv4 one is judged by both, and one that is only a carrier (NAT64,
    SIIT) by the IPv4 address it carries."""
    inner = _embedded(address)
    carrier = isinstance(address, ipaddress.IPv6Address) and any(
        address in network for network in _CARRIERS
    )
    return all(_global(a) for a in ({inner} if carrier else {address, inner}))


def _global(address: IPAddress) -> bool:
    if address.is_multicast or not address.is_global:
        return False
    if isinstance(address, ipaddress.IPv6Address):
        return address in _UNICAST and not any(address in n for n in _NOT_PUBLIC)
    return True


@dataclass(frozen=True)
class Policy:
    """Which addresses may be connected to: public ones, and those in ``allow`` (ranges an
    administrator opened), except ``never`` (host, port) pairs (the database itself) and
    ``guarded`` addresses (the database's host) outside ``allow``."""

    allow: tuple[IPNetwork, ...] = ()
    guarded: frozenset[IPAddress] = field(default_factory=frozenset)
    never: frozenset[tuple[IPAddress, int]] = field(default_factory=frozenset)

    def permits(self, address: str, port: int) -> bool:
        ip = _embedded(ipaddress.ip_address(address.split("%", 1)[0]))
        if (ip, port) in self.never:
            return False
        if any(ip in network for network in self.allow if network.version == ip.version):
            return True
        return ip not in self.guarded and is_public(ip)

    def also(self, other: Policy) -> Policy:
        """This policy refusing what ``other`` guards as well (the same ``allow``)."""
        return Policy(self.allow, self.guarded | other.guarded, self.never | other.never)


async def resolve(host: str, port: int) -> list[str]:
    """The addresses of ``host``, by the system's resolver (in a thread: one lookup, the
    same whichever event loop runs)."""
    found = await asyncio.to_thread(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in found))


async def guarding(host: str | None, port: int | None, allow: tuple[IPNetwork, ...]) -> Policy:
    """The policy that guards ``host`` (the database's): its addresses are refused unless
    ``allow`` opens them, and its port on them always. No host (a Unix socket): none."""
    if not host or host.startswith("/"):
        return Policy(allow=allow)
    try:
        addresses = [ipaddress.ip_address(a) for a in await resolve(host, port or 5432)]
    except OSError:
        addresses = []
    never = frozenset((_embedded(a), port or 5432) for a in addresses)
    return Policy(allow, frozenset(_embedded(a) for a in addresses), never)


async def refused(url: str, policy: Policy, resolver: Resolver = resolve) -> bool:
    """Whether ``url``'s host resolves now to an address ``policy`` refuses (a host that
    does not resolve is not refused here: the connection is checked again)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        addresses = await resolver(parts.hostname or "", port)
    except (OSError, UnicodeError):
        return False
    return not all(policy.permits(a, port) for a in addresses)


class GuardedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend, connecting only to addresses ``policy`` permits."""

    def __init__(self, policy: Policy, resolver: Resolver = resolve) -> None:
        self.policy = policy
        self.resolver = resolver
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[typing.Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            addresses = await self.resolver(host, port)
        except (OSError, UnicodeError) as exc:  # a name the resolver cannot even encode
            raise httpcore.ConnectError(str(exc)) from None
        # Every address is checked, not only the one used: a name that answers both a
        # public and a private address is refused whole.
        if not addresses or not all(self.policy.permits(a, port) for a in addresses):
            raise Refused(REFUSED)
        failure: Exception = httpcore.ConnectError("no address")
        for address in addresses:
            try:
                return await self._inner.connect_tcp(
                    address, port, timeout, local_address, socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                failure = exc
        raise failure

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[typing.Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise Refused("Unix sockets are not reached")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


@functools.cache
def _tls() -> ssl.SSLContext:
    """The certificate checks of every guarded client: httpx's default context, made once
    a process (loading the certificate store costs tens of ms of CPU a client)."""
    return httpx.create_ssl_context(trust_env=False)


class GuardedTransport(httpx.AsyncHTTPTransport):
    """httpx's transport over :class:`GuardedBackend`, without proxies."""

    def __init__(self, policy: Policy, resolver: Resolver = resolve) -> None:
        context = _tls()
        super().__init__(verify=context, trust_env=False)
        # httpx takes no network backend of its own: its pool is rebuilt with one, as
        # the pool httpx would make without a proxy (the same certificate checks).
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=context,
            max_connections=LIMITS.max_connections,
            max_keepalive_connections=LIMITS.max_keepalive_connections,
            keepalive_expiry=LIMITS.keepalive_expiry,
            network_backend=GuardedBackend(policy, resolver),
        )


def client(
    policy: Policy, timeout: httpx.Timeout, resolver: Resolver = resolve
) -> httpx.AsyncClient:
    """The one client for user-named URLs: guarded, no redirects, no proxies."""
    return httpx.AsyncClient(
        transport=GuardedTransport(policy, resolver),
        timeout=timeout,
        follow_redirects=False,
        trust_env=False,
    )


@dataclass(frozen=True)
class Answer:
    """A bounded view of an answer: its status, reason and at most ``limit`` bytes."""

    status: int
    reason: str
    head: bytes


async def post(
    http: httpx.AsyncClient, url: str, content: bytes, headers: dict[str, str], limit: int
) -> Answer:
    """POST ``content`` and read at most ``limit`` bytes of the answer's body, as sent
    (``identity`` asked for: a compressed body is not inflated); the rest is never
    read, the connection is closed instead."""
    sent = {**headers, "Accept-Encoding": "identity"}
    async with http.stream("POST", url, content=content, headers=sent) as answer:
        head = b""
        if not answer.is_success:
            async for chunk in answer.aiter_raw():
                head += chunk[: limit - len(head)]
                if len(head) >= limit:
                    break
        return Answer(answer.status_code, answer.reason_phrase, head)
