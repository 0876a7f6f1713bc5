"""deploy/prometheus/ as promtool reads it: the configuration and rules are valid, and the
unit tests in tests.yml pass, with every alert shown both firing and not firing."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[3] / "deploy" / "prometheus"


def promtool(*args: str) -> str:
    tool = shutil.which("promtool")
    assert tool, "promtool is missing: apt-get install prometheus (.ci/run does)"
    done = subprocess.run(
        [tool, *args], cwd=DEPLOY, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load((DEPLOY / "rules.yml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_the_config_and_rules_are_valid() -> None:
    assert "SUCCESS" in promtool("check", "config", "prometheus.yml")
    assert "SUCCESS" in promtool("check", "rules", "rules.yml")


def test_the_rule_unit_tests_pass() -> None:
    assert "SUCCESS" in promtool("test", "rules", "tests.yml")


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_each_alert_is_tested_firing_and_not_firing(rule: dict[str, Any]) -> None:
    cases = [
        case
        for test in yaml.safe_load((DEPLOY / "tests.yml").read_text())["tests"]
        for case in test.get("alert_rule_test", [])
        if case["alertname"] == rule["alert"]
    ]
    assert any(case["exp_alerts"] for case in cases), "never shown firing"
    assert any(not case["exp_alerts"] for case in cases), "never shown quiet"
    assert rule["annotations"]["summary"], "no summary"
    assert rule["labels"]["severity"] in ("warning", "critical")
