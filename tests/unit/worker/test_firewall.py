"""The agent's egress table (services/worker/firewall.py) as the nftables script it
sends, the blocked destinations an operator lists, and the policies an agent that cannot
enforce them refuses. Applied by a real agent: tests/security/test_attempt_egress.py."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from libs.common.models import Egress
from services.worker import firewall
from services.worker.host import Host
from services.worker.isolation import Identity
from services.worker.settings import WorkerSettings


def test_the_table_refuses_link_local_and_the_listed_destinations_to_the_uid_range() -> None:
    refused = firewall.blocked(firewall.parse_blocked("10.0.0.5/32:5432, [fd00::5]:6432"))
    script = firewall.ruleset("cairn_egress_x_1", range(20000, 30000), refused)
    # Made afresh in one transaction: an existing table of that name is replaced.
    assert script.startswith("table inet cairn_egress_x_1 {}\ndelete table inet cairn_egress_x_1\n")
    assert "meta skuid != 20000-29999 return" in script
    for rule in (
        "ip daddr 169.254.0.0/16 goto refuse",
        "ip6 daddr fe80::/10 goto refuse",
        "ip daddr 10.0.0.5/32 meta l4proto { tcp, udp } th dport 5432 goto refuse",
        "ip6 daddr fd00::5/128 meta l4proto { tcp, udp } th dport 6432 goto refuse",
    ):
        assert rule in script
    # The blocklist comes before an allow attempt's own chain.
    assert script.index("goto refuse") < script.index("vmap @attempts")


def test_an_allow_chain_accepts_its_list_and_refuses_the_rest() -> None:
    policy = Egress.model_validate(
        {
            "mode": "allow",
            "allow": [{"cidr": "10.1.0.0/16", "port": 443}, {"cidr": "2001:db8::/32"}],
        }
    )
    script = firewall.allow_rules("t", 20001, policy)
    assert script.splitlines() == [
        "add chain inet t allow_20001",
        "flush chain inet t allow_20001",
        "add rule inet t allow_20001 ct state established,related accept",
        "add rule inet t allow_20001 ip daddr 10.1.0.0/16 meta l4proto { tcp, udp } th dport 443 accept",
        "add rule inet t allow_20001 ip6 daddr 2001:db8::/32 accept",
        "add rule inet t allow_20001 goto refuse",
        "add element inet t attempts { 20001 : jump allow_20001 }",
    ]


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("10.0.0.0/33", "not a CIDR"),
        ("10.0.0.1:0", "port"),
        (",".join(["10.0.0.1"] * 65), "at most"),
    ],
)
def test_bad_blocked_destinations_are_refused_at_start(value: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        WorkerSettings(worker_egress_block=value)


def test_tables_of_one_home_share_a_prefix_apart_from_other_homes() -> None:
    one, again, other = (
        firewall.table_name(Path("/a"), 1),
        firewall.table_name(Path("/a"), 2),
        firewall.table_name(Path("/b"), 1),
    )
    assert one.rpartition("_")[0] == again.rpartition("_")[0] != other.rpartition("_")[0]


def test_an_agent_that_cannot_enforce_a_policy_refuses_it(tmp_path: Path) -> None:
    host = Host(WorkerSettings(home=tmp_path, worker_isolation="none"), tmp_path / "logs")
    none = Egress(mode="none")
    with pytest.raises(firewall.Unenforceable, match="run as the agent's own user"):
        asyncio.run(host._egress(none, None))
    asyncio.run(host._egress(Egress(), None))  # host: nothing to apply
    # Isolated, but without nftables: allow cannot be applied, none can.
    allow = Egress.model_validate({"mode": "allow", "allow": [{"cidr": "10.0.0.0/8"}]})
    with pytest.raises(firewall.Unenforceable, match="nftables is unavailable"):
        asyncio.run(host._egress(allow, Identity(20001, 20001)))
    asyncio.run(host._egress(none, Identity(20001, 20001)))
