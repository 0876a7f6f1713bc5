"""``python -m services.dag``: run the DAG service's HTTP API and its loop."""

from __future__ import annotations

from libs.common import serve
from services.dag import migrate
from services.dag.app import create_app
from services.dag.settings import DagSettings


def main(argv: list[str] | None = None) -> None:
    serve.main(
        name="dag",
        description=__doc__,
        settings_class=DagSettings,
        create_app=create_app,
        upgrade=migrate.upgrade,
        check=migrate.check,
        argv=argv,
        graceful_s=5,
    )


if __name__ == "__main__":
    main()
