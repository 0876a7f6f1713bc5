"""The images the deployment runs, built from nothing but Debian's and PyPI's packages: a
Debian 12 base made with debootstrap and ``docker import`` (no registry is pulled from),
then compose/Dockerfile (Cairn) and compose/postgres.Dockerfile (PostgreSQL) on it."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.deploy.engine import BUILD_TIMEOUT_S, EngineError, PrivateEngine

ROOT = Path(__file__).resolve().parents[2]
MIRROR = "http://deb.debian.org/debian"
# python3 and venv for the Cairn image; ca-certificates for pip.
INCLUDE = "python3,python3-venv,ca-certificates"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
HOST_EXTRA_CAS = Path("/usr/local/share/ca-certificates")

CAIRN_IMAGE = "cairn:deploy-test"
POSTGRES_IMAGE = "cairn-postgres:deploy-test"


def base_key() -> str:
    """What the base image is made of: the debootstrap call and the host's CA bundle."""
    digest = hashlib.sha256(f"bookworm minbase {INCLUDE} {MIRROR}".encode())
    if HOST_CA.exists():
        digest.update(HOST_CA.read_bytes())
    return digest.hexdigest()[:16]


def base_image(engine: PrivateEngine) -> str:
    """A Debian 12 image from debootstrap, tagged by its content key; one already in the
    engine's data root (kept between runs only when asked) is used as it is."""
    tag = f"cairn-deploy-base:{base_key()}"
    if engine.docker("image", "inspect", tag, check=False).returncode == 0:
        return tag
    rootfs = engine.root / "rootfs"
    rootfs.mkdir()
    # In memory: dpkg syncs every file it unpacks, which on a busy disk is most of the time.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2g", "tmpfs", str(rootfs)], check=True)
    try:
        _debootstrap(rootfs)
        _trust_what_the_host_trusts(rootfs)
        _import(engine, rootfs, tag)
    finally:
        subprocess.run(["umount", str(rootfs)], check=False)
        rootfs.rmdir()
    return tag


def _debootstrap(rootfs: Path) -> None:
    done = subprocess.run(
        [
            "debootstrap",
            "--variant=minbase",
            f"--include={INCLUDE}",
            "bookworm",
            str(rootfs),
            MIRROR,
        ],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise EngineError(f"debootstrap failed:\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}")
    shutil.rmtree(rootfs / "var" / "cache" / "apt" / "archives", ignore_errors=True)


def _import(engine: PrivateEngine, rootfs: Path, tag: str) -> None:
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    assert tar.stdout is not None
    imported = subprocess.run(
        ["docker", "import", "-", tag],
        stdin=tar.stdout,
        env=engine.env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    tar.stdout.close()
    tar.wait()
    if imported.returncode != 0 or tar.returncode != 0:
        raise EngineError(f"docker import failed: {imported.stderr}")


def _trust_what_the_host_trusts(rootfs: Path) -> None:
    """pip in the image build trusts the base's CA bundle: make it the host's (which may
    hold a proxy's CA), also for a later update-ca-certificates."""
    if HOST_CA.exists():
        shutil.copyfile(HOST_CA, rootfs / "etc" / "ssl" / "certs" / "ca-certificates.crt")
    extra = rootfs / "usr" / "local" / "share" / "ca-certificates"
    for cert in HOST_EXTRA_CAS.glob("*.crt") if HOST_EXTRA_CAS.is_dir() else []:
        extra.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(cert, extra / cert.name)


def build(engine: PrivateEngine, base: str) -> None:
    """Both images, at once. The builds use the host's network (the engine adds no NAT
    rule, so its bridge reaches nothing outside)."""
    jobs = [("compose/Dockerfile", CAIRN_IMAGE), ("compose/postgres.Dockerfile", POSTGRES_IMAGE)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [
            pool.submit(
                engine.docker,
                "build",
                "--network",
                "host",
                "--build-arg",
                f"BASE_IMAGE={base}",
                "--tag",
                tag,
                "--file",
                str(ROOT / dockerfile),
                str(ROOT),
                timeout=BUILD_TIMEOUT_S,
            )
            for dockerfile, tag in jobs
        ]
        for future in futures:
            future.result()
