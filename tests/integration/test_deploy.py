"""The deploy/ files: alert rules pass promtool and their unit tests, the dashboard and the
rules refer only to metrics the service exports, the manifests say what they should."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry

from capsvc.metrics import Metrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
METRIC_RE = re.compile(r"\b(capsvc_[a-z_]+)")
SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created", "_info")


def exported() -> set[str]:
    """Every sample name the service's registry can export (with _total, _bucket, …)."""
    registry = CollectorRegistry()
    Metrics(registry)
    names = set()
    for family in registry.collect():
        names.add(family.name)
        names.update(f"{family.name}{s}" for s in SUFFIXES)
    return names


def referenced(text: str) -> set[str]:
    return set(METRIC_RE.findall(text))


def test_promtool_checks_and_unit_tests_the_alert_rules() -> None:
    """promtool check rules and promtool test rules both pass."""
    rules = DEPLOY / "prometheus"
    subprocess.run(["promtool", "check", "rules", "alerts.yml"], cwd=rules, check=True)
    subprocess.run(["promtool", "test", "rules", "alerts_test.yml"], cwd=rules, check=True)


def test_alerts_use_exported_metrics() -> None:
    """Every capsvc_* name in the alert rules is one the service exports."""
    text = (DEPLOY / "prometheus" / "alerts.yml").read_text()
    names = referenced(text)
    assert names
    assert names <= exported(), names - exported()


def test_dashboard_loads_and_uses_exported_metrics() -> None:
    """The Grafana dashboard is valid JSON whose queries use only exported metrics."""
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "capsvc.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    names = set().union(*(referenced(e) for e in exprs))
    assert names <= exported(), names - exported()
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("tickets/s", "rejections", "latency", "redis errors", "cap", "near-cap"):
        assert topic in titles, topic


def load_all(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_kubernetes_manifests() -> None:
    """Deployment with probes on /healthz and /readyz, resources and a non-root user;
    Service, PDB, HPA, ConfigMap and Secret present."""
    docs = [d for f in sorted((DEPLOY / "k8s").glob("*.yaml")) for d in load_all(f)]
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
            "ConfigMap", "Secret"} <= kinds
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["resources"]["requests"]
    assert container["resources"]["limits"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (config,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert "token" not in config["data"]["capsvc.toml"].replace("token hashes", "")


def test_compose_stack() -> None:
    """Redis with the AOF/noeviction config, capsvc (2 workers), Prometheus with the rules,
    Grafana provisioned with the dashboard."""
    (compose,) = load_all(DEPLOY / "docker-compose.yml")
    services = compose["services"]
    assert {"redis", "capsvc", "prometheus", "grafana"} <= set(services)
    assert "./redis.conf:/usr/local/etc/redis/redis.conf:ro" in services["redis"]["volumes"]
    assert "workers = 2" in (DEPLOY / "capsvc.toml").read_text()
    redis_conf = (DEPLOY / "redis.conf").read_text()
    assert "maxmemory-policy noeviction" in redis_conf
    assert "appendonly yes" in redis_conf
    (prom,) = load_all(DEPLOY / "prometheus" / "prometheus.yml")
    assert prom["scrape_configs"][0]["static_configs"][0]["targets"] == ["capsvc:8080"]


def test_promtool_checks_the_prometheus_config_from_anywhere(tmp_path: Path) -> None:
    """The shipped prometheus.yml names its rule files relative to itself: promtool accepts
    it from any working directory, and the compose stack mounts every rule file beside the
    config, so the same file works in the container."""
    config = DEPLOY / "prometheus" / "prometheus.yml"
    result = subprocess.run(["promtool", "check", "config", str(config)], cwd=tmp_path,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    rule_files = load_all(config)[0]["rule_files"]
    assert rule_files
    assert not any(Path(f).is_absolute() for f in rule_files), rule_files
    (compose,) = load_all(DEPLOY / "docker-compose.yml")
    prometheus = compose["services"]["prometheus"]
    assert "command" not in prometheus  # the image's --config.file: /etc/prometheus/...
    mounts = {v.split(":")[0]: v.split(":")[1] for v in prometheus["volumes"]}
    in_container = Path(mounts["./prometheus/prometheus.yml"])
    assert in_container == Path("/etc/prometheus/prometheus.yml")
    for name in rule_files:
        assert mounts.get(f"./prometheus/{name}") == str(in_container.parent / name), name
