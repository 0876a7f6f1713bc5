"""A bad setting stops a process with an error naming the setting and the reason, never
its value: a database URL holds a password, and the error goes to a terminal or a log."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from psycopg.conninfo import conninfo_to_dict

from libs.common.database import keepalive
from libs.common.settings import CairnSettings, libpq_url, load
from libs.common.sources import redact_url
from services.worker.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[3]
PASSWORD = "s3cretPW"


@pytest.mark.parametrize(
    ("command", "url"),
    [
        # not PostgreSQL: pydantic printed the input, the URL whole
        (["services.core"], f"mysql://alice:{PASSWORD}@db:3306/cairn"),
        # an unencoded "/", "," and ":" in the password: a piece of it read as a port
        (["services.core"], f"postgresql://alice:1,h:{PASSWORD}/x@db/cairn"),
        # the CLI's settings (cairn migrate), read from the environment too
        (["cairn", "migrate"], f"mysql://alice:{PASSWORD}@db:3306/cairn"),
    ],
)
def test_a_bad_database_url_is_named_and_its_password_is_not_shown(
    tmp_path: Path, command: list[str], url: str
) -> None:
    _refused(tmp_path, command, url)


def test_a_raw_percent_in_the_password_is_refused_with_the_advice_to_encode_it(
    tmp_path: Path,
) -> None:
    # libpq refuses it at every connection ("invalid percent-encoded token"), quoting the
    # password: the service started, then failed where it first connected
    stderr = _refused(
        tmp_path, ["services.core"], f"postgresql://alice:{PASSWORD}%x@127.0.0.1:9/db"
    )
    assert "%25" in stderr


def test_a_percent_encoded_percent_reaches_libpq_as_a_percent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CAIRN_DATABASE_DIRECT_URL", raising=False)
    settings = CairnSettings(database_url="postgresql://alice:100%25sure@db/cairn")
    url = settings.database_url or ""
    assert conninfo_to_dict(libpq_url(url))["password"] == "100%sure"
    assert keepalive(url)["keepalives"] == 1


def _refused(tmp_path: Path, command: list[str], url: str) -> str:
    """The stderr of ``python -m command`` refusing ``url``, checked."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CAIRN_HOME": str(tmp_path / "home"),
        "CAIRN_CONFIG": str(tmp_path / "config.toml"),
        "CAIRN_DATABASE_URL": url,
    }
    done = subprocess.run(
        [sys.executable, "-m", *command],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "CAIRN_DATABASE_URL" in done.stderr
    assert "Value error" in done.stderr  # and the reason
    assert PASSWORD not in done.stdout + done.stderr
    assert not (tmp_path / "home").exists()  # stopped before it made anything
    return done.stderr


@pytest.mark.parametrize(
    "urls",
    [
        # no scheme: "user:pw@host:port" for "http://user:pw@host:port"
        f"http://127.0.0.1:8400,alice:{PASSWORD}@core-b:8400",
        # a space for a comma, credentials in the first of the two
        f"http://alice:{PASSWORD}@core-a:8400 http://core-b:8400",
        # a query carrying a token
        f"ftp://core-c/?token={PASSWORD}",
    ],
)
def test_a_bad_core_url_is_named_by_its_place_and_its_credentials_are_not_shown(
    urls: str,
) -> None:
    # the validator quoted the entry whole: a password in it reached the terminal or log
    with pytest.raises(ValueError) as refused:
        CairnSettings(core_urls=urls)
    message = str(refused.value)
    assert "CAIRN_CORE_URLS" in message
    assert "is not an http(s) URL" in message
    assert "URL " in message and " of " in message
    assert PASSWORD not in message


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        (f"https://alice:{PASSWORD}@artifacts.corp/a/b.sh", "https://***@artifacts.corp/a/b.sh"),
        (f"https://artifacts.corp/b.sh?X-Amz-Signature={PASSWORD}", "https://artifacts.corp/b.sh"),
        (f"alice:{PASSWORD}@core:8400/x", "***@core:8400/x"),
        ("s3://bucket/key@v1/run.sh", "s3://bucket/key@v1/run.sh"),
        ("file:///opt/jobs/run.sh", "file:///opt/jobs/run.sh"),
    ],
)
def test_a_url_is_shown_without_its_credentials(uri: str, shown: str) -> None:
    assert redact_url(uri) == shown


#: a core that refuses connections: a service that got past its settings on main stops
#: at its first connection, without making a server of its own
UNREACHABLE_DB = "postgresql://cairn:x@127.0.0.1:1/cairn"


@pytest.mark.parametrize(
    ("module", "variable", "value"),
    [
        ("services.core", "CAIRN_HEARTBEAT_INTERVAL_S", "-1"),
        # not above the 60 s interval: every healthy worker buried between two beats
        ("services.core", "CAIRN_HEARTBEAT_TIMEOUT_S", "30"),
        # logging's own ValueError, a traceback, after the settings were taken
        ("services.cron", "CAIRN_LOG_LEVEL", "verbose"),
        # passed gt=0, and reached sleeps, deadlines and JSON answers
        ("services.dag", "CAIRN_RETENTION_DAYS", "inf"),
        # no scheme: taken, and every call to core failed later
        ("services.dag", "CAIRN_URL", "127.0.0.1:8400"),
        # ... the worker retrying its registration for ever
        ("services.worker", "CAIRN_URL", "127.0.0.1:8400"),
        ("services.worker", "CAIRN_WORKER_SLOTS", "0"),
        # core migrated, then failed in its lifespan: a traceback, exit 3
        ("services.core", "CAIRN_SECRETS_KEY", "not-a-key"),
        ("services.core", "CAIRN_SECRETS_KEY", ""),
        ("services.core", "CAIRN_SECRETS_KEY_FILE", "/"),
    ],
)
def test_a_bad_setting_stops_a_service_with_one_line_naming_its_variable(
    tmp_path: Path, module: str, variable: str, value: str
) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CAIRN_HOME": str(tmp_path / "home"),
        "CAIRN_DATABASE_URL": UNREACHABLE_DB,
        "CAIRN_TOKEN": "a-worker-token",
        "CAIRN_WORKER_ISOLATION": "none",
        variable: value,
    }
    try:
        done = subprocess.run(
            [sys.executable, "-m", module],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{module} started with {variable}={value}")
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"cairn {module.split('.')[1]}: bad settings: ")
    assert variable in lines[0]
    assert not (tmp_path / "home").exists()  # stopped before it made anything


@pytest.mark.parametrize(
    ("variable", "value", "reason"),
    [
        # libpq's int() of the port: a traceback at the first connection
        ("CAIRN_DATABASE_URL", "postgresql://cairn@db:5432x/cairn", "port is not a number"),
        # read as the working folder, where the database and keys were then made
        ("CAIRN_HOME", "", "is empty"),
        ("CAIRN_HOME", " ", "is empty"),
    ],
)
def test_a_setting_that_started_wrong_is_refused(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, reason: str
) -> None:
    monkeypatch.setenv(variable, value)
    for settings_class in (CairnSettings, WorkerSettings):
        if variable.lower().removeprefix("cairn_") not in settings_class.model_fields:
            continue
        with pytest.raises(SystemExit) as refused:
            load(settings_class, "cairn test")
        assert str(refused.value).startswith(f"cairn test: bad settings: {variable}: ")
        assert reason in str(refused.value)


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        # what the agent offered core was built after its host's start: a traceback there
        ("CAIRN_WORKER_QUEUES", ""),
        ("CAIRN_WORKER_QUEUES", "batch jobs"),
        ("CAIRN_WORKER_MEMORY_MB", str(2**40)),
    ],
)
def test_an_offer_core_would_refuse_is_refused_by_the_worker_settings(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as refused:
        load(WorkerSettings, "cairn worker")
    assert f"{variable}: not an offer core takes" in str(refused.value)


@pytest.mark.parametrize("value", ["", " "])
def test_an_empty_bind_host_is_refused_not_read_as_every_address(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    # uvicorn bound "" to 0.0.0.0 and [::]: an unset template variable opened the port
    monkeypatch.setenv("CAIRN_BIND_HOST", value)
    with pytest.raises(SystemExit) as refused:
        load(CairnSettings, "cairn core")
    assert str(refused.value).startswith("cairn core: bad settings: CAIRN_BIND_HOST: ")
