"""compose/docker-compose.yml run for real (``pytest tests/deploy``, marker ``deploy``)."""

#: seconds per step of this run, printed in pytest's summary (tests/deploy/conftest.py)
TIMES: dict[str, float] = {}
