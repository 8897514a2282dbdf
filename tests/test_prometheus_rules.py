"""Prometheus config and alert rules, checked by the real promtool: syntax, and unit tests of every alert
on synthetic series (`promtool test rules`, compose/prometheus/tests/)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.prometheus_support import PROM_DIR, RULES, contract_violations, load_yaml, prometheus_binaries

RULE_TESTS = sorted((PROM_DIR / "tests").glob("*.yml"))


def promtool(*args: str, cwd: Path = PROM_DIR) -> subprocess.CompletedProcess[str]:
    _prom, tool = prometheus_binaries()
    return subprocess.run([tool, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


def alert_rules() -> list[dict[str, object]]:
    return [r for path in RULES for g in load_yaml(path)["groups"] for r in g["rules"] if "alert" in r]


def test_config_is_valid_and_loads_the_rules() -> None:
    proc = promtool("check", "config", "prometheus.yml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(RULES)} rule files found" in proc.stdout


def test_rules_are_valid() -> None:
    proc = promtool("check", "rules", *[str(p) for p in RULES])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_rule_unit_tests_pass() -> None:
    assert RULE_TESTS
    proc = promtool("test", "rules", *[str(p) for p in RULE_TESTS])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_alert_has_a_unit_test_that_expects_it_to_fire() -> None:
    firing = {
        case["alertname"]
        for path in RULE_TESTS
        for test in load_yaml(path)["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    names = {str(r["alert"]) for r in alert_rules()}
    assert names >= {"TunegateCanaryPinned", "TunegateMirrorDropping", "TunegateCandidateErrorBurst",
                     "TunegateDecisionStuck"}  # fmt: skip
    assert names <= firing, f"alerts without a firing unit test: {sorted(names - firing)}"


def test_alerts_use_only_the_metric_contract() -> None:
    for rule in alert_rules():
        assert not contract_violations(str(rule["expr"])), rule["alert"]
        labels = rule.get("labels")
        assert isinstance(labels, dict) and labels.get("severity") in ("warning", "critical"), rule["alert"]


def test_a_broken_threshold_fails_the_unit_tests(tmp_path: Path) -> None:
    """The unit tests can fail: the mirror alert at 50% instead of 5% misses the 20% drop scenario."""
    (tmp_path / "rules").mkdir()
    (tmp_path / "tests").mkdir()
    for path in RULES:
        (tmp_path / "rules" / path.name).write_text(path.read_text().replace("> 0.05", "> 0.5"))
    for path in RULE_TESTS:
        shutil.copy(path, tmp_path / "tests" / path.name)
    proc = promtool("test", "rules", *[f"tests/{p.name}" for p in RULE_TESTS], cwd=tmp_path)
    assert proc.returncode != 0
    assert "TunegateMirrorDropping" in proc.stdout + proc.stderr
