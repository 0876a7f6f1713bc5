"""What an attempt's network may reach (docs/security.md, "Egress"), by the kernel's
nftables (``nft``), matched on the attempts' uids (``isolation``).

Each agent owns one table, ``inet cairn_egress_<home>_<pid>`` (its home's digest and its
pid), made when it starts. Its output chain looks only at packets from sockets of the
agent's uid range (``CAIRN_WORKER_UIDS``: nothing else on the host runs as them) and

* refuses the blocked destinations, for every attempt: link-local (169.254.0.0/16, the
  cloud metadata endpoint; fe80::/10) and ``CAIRN_WORKER_EGRESS_BLOCK`` (the database's
  host and port), with a TCP reset or an ICMP "administratively prohibited", so a task's
  connection fails at once instead of hanging;
* sends an ``allow`` attempt's packets through a chain of its own (``allow_<uid>``, found
  by its uid in the ``attempts`` map): what the policy lists passes, replies to what it
  accepted pass, everything else is refused. The chain exists from before the attempt
  starts until its processes are gone and its uid is handed back.

A ``none`` attempt needs no rule: it has a network namespace of its own with only
loopback (``spawn.c``, ``isolation.Sandbox``). Rules in several tables all apply (a drop
in any is final), so the table of another agent on the host, whose uid range may
overlap, never opens what this one refuses. The table goes when the agent stops; a table
left by an agent that died is removed by its sidecar, and every table of this home whose
agent is gone by the next agent that starts there.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import logging
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from libs.common.egress import IPNetwork, parse_destination
from libs.common.models import Egress

log = logging.getLogger("cairn.worker.firewall")

#: always refused to attempts: IPv4 and IPv6 link-local (the metadata endpoint)
LINK_LOCAL = ("169.254.0.0/16", "fe80::/10")
#: bounds of the blocked destinations an operator lists
MAX_BLOCKED = 64
_TIMEOUT_S = 10.0

Destination = tuple[IPNetwork, int | None]


class FirewallError(Exception):
    """``nft`` is missing or refused a change."""


class Unenforceable(Exception):
    """This agent cannot apply the attempt's egress policy (the message says why)."""


def parse_blocked(text: str) -> tuple[Destination, ...]:
    """``CAIRN_WORKER_EGRESS_BLOCK``: comma separated ``CIDR[:PORT]`` (``[v6/len]:PORT``)."""
    items = [part for part in text.split(",") if part.strip()]
    if len(items) > MAX_BLOCKED:
        raise ValueError(f"at most {MAX_BLOCKED} destinations")
    return tuple(parse_destination(item) for item in items)


def blocked(extra: Sequence[Destination] = ()) -> tuple[Destination, ...]:
    """Every destination refused to every attempt: link-local, then ``extra``."""
    return (*((ipaddress.ip_network(n), None) for n in LINK_LOCAL), *extra)


def _prefix(home: Path) -> str:
    return f"cairn_egress_{hashlib.sha256(str(home).encode()).hexdigest()[:10]}_"


def table_name(home: Path, agent_pid: int) -> str:
    """The table of the agent of ``home`` running as ``agent_pid``."""
    return f"{_prefix(home)}{agent_pid}"


def _match(destination: Destination) -> str:
    network, port = destination
    family = "ip" if network.version == 4 else "ip6"
    rule = f"{family} daddr {network}"
    if port is not None:
        rule += f" meta l4proto {{ tcp, udp }} th dport {port}"
    return rule


def ruleset(table: str, uids: range, refused: Sequence[Destination]) -> str:
    """The agent's table, made afresh (an ``nft -f`` script: one transaction)."""
    lines = [
        f"table inet {table} {{}}",
        f"delete table inet {table}",
        f"table inet {table} {{",
        "  map attempts { type uid : verdict; }",
        "  chain refuse {",
        "    meta l4proto tcp reject with tcp reset",
        "    reject with icmpx admin-prohibited",
        "  }",
        "  chain output {",
        "    type filter hook output priority filter; policy accept;",
        f"    meta skuid != {uids.start}-{uids.stop - 1} return",
        *(f"    {_match(d)} goto refuse" for d in refused),
        "    meta skuid vmap @attempts",
        "  }",
        "}",
    ]
    return "\n".join(lines) + "\n"


def allow_rules(table: str, uid: int, policy: Egress) -> str:
    """An ``allow`` attempt's chain and its entry in the map (one transaction)."""
    chain = f"allow_{uid}"
    rules = ["ct state established,related accept"]
    rules += [f"{_match((ipaddress.ip_network(r.cidr), r.port))} accept" for r in policy.allow]
    rules.append("goto refuse")
    lines = [f"add chain inet {table} {chain}", f"flush chain inet {table} {chain}"]
    lines += [f"add rule inet {table} {chain} {rule}" for rule in rules]
    lines.append(f"add element inet {table} attempts {{ {uid} : jump {chain} }}")
    return "\n".join(lines) + "\n"


def _nft(script: str | None, *args: str) -> str:
    binary = shutil.which("nft") or "/usr/sbin/nft"
    command = [binary, *args] if script is None else [binary, "-f", "-"]
    try:
        done = subprocess.run(  # noqa: S603 - the host's nft, our own script
            command, input=script, capture_output=True, text=True, timeout=_TIMEOUT_S
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise FirewallError(f"nft: {exc}") from None
    if done.returncode != 0:
        raise FirewallError(f"nft: {done.stderr.strip()[:500]}")
    return done.stdout


def tables() -> list[str]:
    """The names of the inet tables (nftables) in this network namespace."""
    listed = json.loads(_nft(None, "-j", "list", "tables", "inet") or "{}")
    return [item["table"]["name"] for item in listed.get("nftables", []) if "table" in item]


def delete(table: str) -> None:
    """Remove a table, if it is there."""
    with contextlib.suppress(FirewallError):
        _nft(None, "delete", "table", "inet", table)


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


@dataclass
class Firewall:
    """One agent's table: made by :meth:`start`, an ``allow`` attempt's chain added and
    removed by :meth:`open` and :meth:`close`, the table removed by :meth:`stop`."""

    home: Path
    agent_pid: int
    uids: range
    refused: tuple[Destination, ...]

    @property
    def table(self) -> str:
        return table_name(self.home, self.agent_pid)

    def start(self) -> None:
        """Remove the tables earlier agents of this home left (their pid gone), then make
        this one's. Raises ``FirewallError`` (``nft`` missing, no CAP_NET_ADMIN)."""
        prefix = _prefix(self.home)
        for name in tables():
            pid = name.removeprefix(prefix)
            if name.startswith(prefix) and pid.isdigit() and not _alive(int(pid)):
                log.info("removing the egress table %s an earlier agent left", name)
                delete(name)
        _nft(ruleset(self.table, self.uids, self.refused))

    def open(self, uid: int, policy: Egress) -> None:
        """Let ``uid`` reach only what ``policy`` allows (before its attempt starts)."""
        _nft(allow_rules(self.table, uid, policy))

    def close(self, uid: int) -> None:
        """Remove ``uid``'s chain (its attempt's processes are gone)."""
        script = (
            f"delete element inet {self.table} attempts {{ {uid} }}\n"
            f"delete chain inet {self.table} allow_{uid}\n"
        )
        try:
            _nft(script)
        except FirewallError as exc:
            log.warning("the egress chain of uid %s not removed: %s", uid, exc)

    def stop(self) -> None:
        delete(self.table)
