"""deploy/: the Prometheus alert rules pass promtool (syntax and their own unit tests), the
Grafana dashboard parses, and every metric either of them queries is one the code exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from outbox import metrics

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "alerts.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "outbox.json"

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is not installed (Debian's prometheus package; .ci/run installs it): "
    "the alert rules are not checked on this machine",
)


def exported() -> set[str]:
    """Every series name the code can export (the database gauges from a sample reading)."""
    metrics.DATABASE.update(
        metrics.DatabaseReading(rows={("d", "pending"): 1}, ages={("d", "pending"): 1.0}, no_consumer=["d"]),
        fresh_for_seconds=60,
    )
    try:
        names = set()
        for family in metrics.REGISTRY.collect():
            if family.type == "counter":
                names.add(f"{family.name}_total")
            elif family.type == "histogram":
                names |= {f"{family.name}_{s}" for s in ("bucket", "count", "sum")}
            else:
                names.add(family.name)
        return names
    finally:
        metrics.DATABASE.update(metrics.DatabaseReading(), fresh_for_seconds=0)


def queried(expr: str) -> set[str]:
    without_labels = re.sub(r"\{[^}]*\}", "", expr)
    return set(re.findall(r"\boutbox_[a-z_]+\b", without_labels))


def rule_exprs() -> list[str]:
    return [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]


def test_rules_and_dashboard_query_only_what_the_code_exports():
    names = exported()
    assert {"outbox_rows", "outbox_deliveries_total", "outbox_written_to_confirmed_seconds_bucket"} <= names
    for where, exprs in (("alerts.yml", rule_exprs()), ("outbox.json", dashboard_exprs())):
        asked = set().union(*(queried(e) for e in exprs))
        assert asked, where
        assert asked <= names, f"{where} queries series the code does not export: {sorted(asked - names)}"


def test_the_dashboard_has_the_panels_the_alerts_need():
    titles = {p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]}
    for needed in (
        "Oldest unknown outcome",
        "Failed rows, by destination",
        "Destinations without a consumer",
    ):
        assert needed in titles
    ids = [p["id"] for p in json.loads(DASHBOARD.read_text())["panels"]]
    assert len(ids) == len(set(ids))


@needs_promtool
def test_promtool_checks_the_rules_and_runs_their_tests(tmp_path):
    for argv in (
        [PROMTOOL, "check", "rules", str(RULES)],
        [PROMTOOL, "test", "rules", str(DEPLOY / "prometheus" / "alerts_test.yml")],
    ):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
    # The scrape configuration, with the rules where the container mounts them.
    config = (
        (DEPLOY / "prometheus" / "prometheus.yml")
        .read_text()
        .replace("/etc/prometheus/alerts.yml", str(RULES))
    )
    (tmp_path / "prometheus.yml").write_text(config)
    done = subprocess.run(
        [PROMTOOL, "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_observability_profile_mounts_what_exists():
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["observability"]
        for volume in services[name]["volumes"]:
            source = volume.split(":", 1)[0]
            assert (ROOT / source).exists(), f"{name} mounts {source}: no such path"
    scraped = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())["scrape_configs"]
    targets = {t for job in scraped for c in job["static_configs"] for t in c["targets"]}
    for name in ("relay", "worker", "reconciler"):
        port = services[name]["environment"]["OUTBOX_METRICS_PORT"]
        assert f"{name}:{port}" in targets
