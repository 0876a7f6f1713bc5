"""Fetch the Compose Specification's JSON schema for tests/unit/system/test_compose.py.

    python tests/compose_spec.py OUT.json

The schema ships inside the docker-compose 1.29.2 wheel on PyPI (the last Python release,
which adopted the Compose Specification); the wheel is downloaded without its
dependencies, never installed, and only ``compose/config/compose_spec.json`` is kept.
`make test` runs this once and keeps the file in .venv/.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "docker-compose==1.29.2"
MEMBER = "compose/config/compose_spec.json"


def fetch(out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
             "-d", tmp, WHEEL],
            check=True,
        )  # fmt: skip
        [wheel] = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as archive:
            out.write_bytes(archive.read(MEMBER))


if __name__ == "__main__":
    fetch(Path(sys.argv[1]))
