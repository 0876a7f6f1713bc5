"""Signing in from the command line: ``cairn login`` (the OAuth 2.0 device authorization
grant, RFC 8628, at the provider core names), ``cairn logout`` and ``cairn whoami``.
The tokens are kept in the CLI's config file (``cairn/config.py``), made 0600."""

from __future__ import annotations

from typing import Annotated

import httpx
import typer

from cairn import config, output
from cairn.tasks_cli import JsonFlag, ctx_of
from libs.common import signin
from libs.common.client import CoreClient
from libs.common.errors import CairnError, NotFound, Unavailable
from libs.common.models import LoginConfig, WhoAmI


def _login_config(url: str) -> LoginConfig:
    try:
        with httpx.Client(timeout=signin.TIMEOUT) as http:
            answer = http.get(f"{url.rstrip('/')}/v1/login/config")
    except httpx.HTTPError as exc:
        raise Unavailable(f"core at {url} cannot be reached ({exc})") from None
    if answer.status_code == 404:
        raise NotFound("core has no sign-in configured (CAIRN_OIDC_CLIENT_ID): use a token")
    if answer.status_code != 200:
        raise Unavailable(f"core answered {answer.status_code} to GET /v1/login/config")
    return LoginConfig.model_validate_json(answer.content)


def login(
    ctx: typer.Context,
    poll_interval: Annotated[
        float | None,
        typer.Option(
            help="seconds between polls of the provider (default: what it says, else 5)",
            min=0.05,
            max=60,
        ),
    ] = None,
) -> None:
    """Sign in at the identity provider core names: open the URL shown, type the code;
    the tokens are kept in the config file (0600) and refreshed before they expire."""
    settings = ctx_of(ctx).settings
    try:
        found = _login_config(settings.url)
        with httpx.Client(timeout=signin.TIMEOUT) as http:
            provider = signin.discover(http, found.issuer)
            device = signin.start_device(http, provider, found.client_id, found.scopes)
            where = device.verification_uri_complete or device.verification_uri
            # What the provider said is shown as text: it can neither style nor move.
            output.console.print(
                f"Open {output.safe(device.verification_uri)} and enter the code"
                f" {output.safe(device.user_code)}\n  (or open {output.safe(where)})",
                highlight=False,
                soft_wrap=True,
            )
            tokens = signin.poll_device(
                http, provider, found.client_id, device, interval=poll_interval
            )
    except CairnError as exc:
        output.errors.print(f"cairn: {output.safe(exc.detail)}")
        raise typer.Exit(1) from None
    config.save_login(found.issuer, found.client_id, provider, tokens)
    if settings.token:
        output.errors.print(
            "cairn: note: a token is configured too (CAIRN_TOKEN, --token or"
            " the config file's token), and it is what is sent"
        )
    who = _whoami(settings.url, tokens.id_token)
    output.console.print(
        f"signed in as {output.safe(who.name)} ({who.role}); kept in {config.config_path()}",
        highlight=False,
    )


def logout() -> None:
    """Forget the tokens of ``cairn login`` (and revoke the refresh token at the provider)."""
    gone = config.forget_login()
    if gone is None:
        output.console.print("not signed in")
        return
    endpoint, token = gone.get("revocation_endpoint"), gone.get("refresh_token")
    if endpoint and token:
        try:
            with httpx.Client(timeout=signin.TIMEOUT) as http:
                signin.revoke(http, endpoint, gone["client_id"], token)
        except CairnError as exc:
            output.errors.print(
                f"cairn: the provider did not revoke the token ({output.safe(exc.detail)})"
            )
    output.console.print("signed out")


def _whoami(url: str, token: str | None) -> WhoAmI:
    async def go() -> WhoAmI:
        async with CoreClient(url, token) as core:
            return await core.whoami()

    found: WhoAmI = output.call(go)
    return found


def whoami(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Who the CLI calls as: name, role, and each team with where it comes from (a
    recorded membership, the provider's groups claim and until when it stands)."""
    c = ctx_of(ctx)
    who = _whoami(c.settings.url, c.settings.bearer())
    if c.json or as_json:
        output.dump(who)
        return
    output.console.print(f"{output.safe(who.name)} ({who.role})", highlight=False)
    if who.expires_at is not None:
        output.console.print(f"credential expires {output.when(who.expires_at)}")
    rows = [
        [
            s.team,
            ", ".join(s.sources),
            output.when(s.standing_until) if s.standing_until else "",
        ]
        for s in who.team_sources
    ]
    if rows:
        output.table(None, ["team", "from", "claim stands until"], rows)
    else:
        output.console.print("no team")


def register(app: typer.Typer) -> None:
    app.command()(login)
    app.command()(logout)
    app.command()(whoami)
