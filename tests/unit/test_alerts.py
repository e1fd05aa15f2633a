"""The alert rules' conventions (their behaviour: promtool, tests/integration/test_deploy.py):
each alert has a runbook section, and none aggregates away the job it is about."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())["groups"][0]["rules"]


def test_each_alert_links_its_section_of_the_runbook() -> None:
    headings = {line[3:].strip().lower() for line in
                (ROOT / "docs/runbook.md").read_text().splitlines() if line.startswith("## ")}
    for rule in RULES:
        url = rule["annotations"]["runbook_url"]
        assert url == f"docs/runbook.md#{rule['alert'].lower()}"
        assert rule["alert"].lower() in headings, rule["alert"]


def test_no_alert_aggregates_away_its_job() -> None:
    """An aggregation (sum, max, min) always keeps `job` (and, for one process, `instance`):
    an alert must say which deployment, or which process, it is about."""
    for rule in RULES:
        for agg in re.findall(r"\b(?:sum|max|min)\s*(by\s*\([^)]*\))?\s*\(", rule["expr"]):
            assert "job" in agg, (rule["alert"], rule["expr"])
