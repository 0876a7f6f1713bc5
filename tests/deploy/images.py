"""The one image the deployment runs, built from nothing but Debian's packages and the
wheels of this checkout: a Debian 12 base made with mmdebstrap and ``docker import`` (no
image registry is pulled from), then compose/Dockerfile on it, with no network, from a
wheelhouse that pip builds on the host beside the base (from its cache and index, as
``make install`` did). The spawn helper's build stage starts from a second base with gcc,
made beside the first, so that the image has the helper and no compiler."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.deploy.engine import BUILD_TIMEOUT_S, EngineError, PrivateEngine

ROOT = Path(__file__).resolve().parents[2]
MIRROR = "http://deb.debian.org/debian"
# python3 and venv for Cairn, pgbouncer for the pooler, nftables for the worker's egress
# rules (ca-certificates: so that the Dockerfile needs no apt-get).
INCLUDE = "python3,python3-venv,ca-certificates,pgbouncer,nftables"
# The spawn helper's build stage: a C compiler and libc's headers.
BUILDER_INCLUDE = "gcc,libc6-dev"
# What of the checkout the build context holds (compose/.dockerignore's list).
SOURCES = ("pyproject.toml", "README.md", ".dockerignore", "cairn", "libs", "services", "compose")

CAIRN_IMAGE = "cairn:deploy-test"
BASE_IMAGE = "cairn-deploy-base:bookworm"
BUILDER_IMAGE = "cairn-deploy-builder:bookworm"


def prepare(engine: PrivateEngine) -> dict[str, float]:
    """The two bases and the wheelhouse at once, then the Cairn image; seconds per step."""
    started = time.monotonic()
    context = engine.root / "context"
    _copy_sources(context)
    took: dict[str, float] = {}

    def timed(name: str, step: Callable[[], None]) -> None:
        begun = time.monotonic()
        step()
        took[name] = time.monotonic() - begun

    with ThreadPoolExecutor(3) as pool:
        jobs = [
            pool.submit(
                timed,
                "base image (mmdebstrap + import)",
                lambda: _base(engine, BASE_IMAGE, INCLUDE, "mmdebstrap"),
            ),
            pool.submit(
                timed,
                "builder base, gcc (mmdebstrap + import)",
                lambda: _base(engine, BUILDER_IMAGE, BUILDER_INCLUDE, "mmdebstrap-builder"),
            ),
            pool.submit(timed, "wheelhouse (pip wheel)", lambda: _wheelhouse(context)),
        ]
        for job in jobs:
            job.result()
    begun = time.monotonic()
    engine.docker(
        "build",
        "--network",
        "none",  # everything it installs is in the context
        "--build-arg",
        f"BASE_IMAGE={BASE_IMAGE}",
        "--build-arg",
        f"BUILD_IMAGE={BUILDER_IMAGE}",
        "--tag",
        CAIRN_IMAGE,
        "--file",
        str(context / "compose" / "Dockerfile"),
        str(context),
        timeout=BUILD_TIMEOUT_S,
    )
    took["image build"] = time.monotonic() - begun
    took["images, in all"] = time.monotonic() - started
    return took


def _copy_sources(context: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "_bin")
    context.mkdir()
    for name in SOURCES:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, context / name, ignore=ignore)
        else:
            shutil.copy2(source, context / name)


def _base(engine: PrivateEngine, image: str, include: str, name: str) -> None:
    """mmdebstrap writes the tarball to its stdout, ``docker import`` reads it; its
    chroot lives in the engine's root, a tmpfs (dpkg syncs every file it unpacks)."""
    scratch = engine.root / name
    scratch.mkdir()
    argv = ["mmdebstrap", "--quiet", "--variant=minbase", f"--include={include}"]
    with open(engine.logs / f"{name}.log", "wb") as log:
        made = subprocess.Popen(
            [*argv, "bookworm", "-", MIRROR],
            stdout=subprocess.PIPE,
            stderr=log,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "TMPDIR": str(scratch)},
        )
        assert made.stdout is not None
        imported = subprocess.run(
            ["docker", "import", "-", image],
            stdin=made.stdout,
            env=engine.env,
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
        made.stdout.close()
        made.wait(timeout=60)
    shutil.rmtree(scratch, ignore_errors=True)
    if made.returncode != 0:
        raise EngineError(f"mmdebstrap failed:\n{engine.log_tail(name)}")
    if imported.returncode != 0:
        raise EngineError(f"docker import failed: {imported.stderr}")


def _wheelhouse(context: Path) -> None:
    """The project's wheel and its dependencies' (the same pip, index and cache as this
    checkout's venv), built from the context's copy so that the checkout stays clean."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--disable-pip-version-check",
            "--wheel-dir",
            str(context / "wheelhouse"),
            str(context),
        ],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise EngineError(f"pip wheel failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
