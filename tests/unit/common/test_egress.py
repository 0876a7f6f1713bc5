"""The guarded client for user-named URLs (libs/common/egress.py): which addresses it
refuses, and that it connects to the address it checked, against a real server."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from libs.common import egress
from tests.webhooks import Receiver


def test_a_name_that_changes_its_answer_is_connected_to_where_it_was_checked() -> None:
    """DNS rebinding between check and connect: the guarded client resolves once and
    connects to that address; a resolver asked a second time would say 127.0.0.1."""
    hook = Receiver()
    port = int(hook.url.split(":")[2].split("/")[0])
    asked: list[str] = []

    async def rebinding(host: str, _port: int) -> list[str]:
        asked.append(host)
        return ["127.0.0.2"] if len(asked) == 1 else ["127.0.0.1"]

    async def go() -> Exception | None:
        # 127.0.0.2 is opened, 127.0.0.1 (where the receiver listens) is not.
        policy = egress.Policy(allow=egress.parse_cidrs("127.0.0.2/32"))
        async with egress.client(policy, httpx.Timeout(2.0), rebinding) as http:
            try:
                await egress.post(http, f"http://rebind.test:{port}/hook", b"{}", {}, 4096)
            except Exception as exc:
                return exc
        return None

    try:
        failure = asyncio.run(go())
    finally:
        hook.close()
    assert isinstance(failure, httpx.ConnectError)
    assert asked == ["rebind.test"]
    assert hook.all() == []


@pytest.mark.parametrize(
    ("answer", "refused"),
    [
        (["93.184.216.34"], False),
        (["93.184.216.34", "10.0.0.1"], True),
        (["2606:2800:220:1::1"], False),
        (["2002:7f00:1::1"], True),  # 6to4 of 127.0.0.1
        (["::ffff:10.0.0.1"], True),
        (["64:ff9b::a9fe:a9fe"], True),  # NAT64 of the metadata address
        (["64:ff9b::7f00:1"], True),  # NAT64 of 127.0.0.1
        (["64:ff9b::5db8:d822"], False),  # NAT64 of 93.184.216.34: DNS64 answers so
        (["64:ff9b:1::5db8:d822"], True),  # NAT64's local-use prefix
        (["::ffff:0:7f00:1"], True),  # SIIT of 127.0.0.1
        (["::ffff:0:5db8:d822"], False),  # SIIT of a public address
        (["::7f00:1"], True),  # IPv4-compatible 127.0.0.1
        (["::1"], True),
        (["fec0::1"], True),  # site-local
        (["3fff::1"], True),  # documentation (RFC 9637)
        (["4000::1"], True),  # outside global unicast 2000::/3
    ],
)
def test_every_address_a_name_answers_is_checked(answer: list[str], refused: bool) -> None:
    async def resolver(_host: str, _port: int) -> list[str]:
        return answer

    got = asyncio.run(egress.refused("https://mixed.test/h", egress.Policy(), resolver))
    assert got is refused


def test_the_databases_host_is_refused_and_its_port_even_inside_an_allowed_range() -> None:
    public_db = asyncio.run(egress.guarding("93.184.216.34", 5432, ()))
    assert public_db.permits("93.184.216.35", 443)
    assert not public_db.permits("93.184.216.34", 443)  # public, but the database's host
    assert not public_db.permits("::ffff:93.184.216.34", 443)
    local_db = asyncio.run(egress.guarding("127.0.0.1", 5432, egress.parse_cidrs("127.0.0.0/8")))
    assert local_db.permits("127.0.0.1", 8080)  # opened on purpose
    assert not local_db.permits("127.0.0.1", 5432)
    assert not local_db.permits("192.168.0.1", 80)
    assert not local_db.permits("169.254.169.254", 80)
    assert local_db.permits("64:ff9b::7f00:1", 8080)  # NAT64 of an opened address
    assert not local_db.permits("64:ff9b::7f00:1", 5432)
    assert asyncio.run(egress.guarding(None, None, ())) == egress.Policy()


def test_behind_a_pooler_both_the_poolers_and_the_databases_hosts_are_refused() -> None:
    allow = egress.parse_cidrs("127.0.0.0/8")
    pooler = asyncio.run(egress.guarding("127.0.0.1", 6432, allow))
    both = pooler.also(asyncio.run(egress.guarding("93.184.216.34", 5432, allow)))
    assert not both.permits("127.0.0.1", 6432) and not both.permits("93.184.216.34", 443)
    assert both.permits("127.0.0.1", 8080) and both.permits("93.184.216.35", 443)
    assert not pooler.permits("127.0.0.1", 6432) and pooler.permits("93.184.216.34", 443)


def test_a_bad_range_is_refused() -> None:
    with pytest.raises(ValueError, match="CIDR"):
        egress.parse_cidrs("10.0.0.0/8,nope")
