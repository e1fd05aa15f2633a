"""The deploy/ files: alert rules pass promtool and their unit tests, the dashboard and the
rules refer only to metrics the service exports, the manifests say what they should, and the
journal directory is on a volume that outlives the pod or container wherever capsvc runs
(Kubernetes, docker-compose, the image)."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from capsvc.config import load_settings
from capsvc.ops.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
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


def k8s_docs() -> list[Any]:
    return [d for f in sorted((DEPLOY / "k8s").glob("*.yaml")) if f.name != "kustomization.yaml"
            for d in load_all(f)]


def statefulset() -> dict[str, Any]:
    (sts,) = [d for d in k8s_docs() if d["kind"] == "StatefulSet"]
    return dict(sts)


def configmap_toml() -> dict[str, Any]:
    (config,) = [d for d in k8s_docs() if d["kind"] == "ConfigMap"]
    return tomllib.loads(config["data"]["capsvc.toml"])


def journal_dir(config: dict[str, Any], where: str) -> str:
    """A configuration's [journal] dir: set, absolute (a relative one would be under the
    working directory, on the container's own disk), the journal not turned off."""
    journal = config.get("journal", {})
    assert journal.get("enabled", True) is True, f"{where}: the journal is turned off"
    directory = journal.get("dir")
    assert isinstance(directory, str), f"{where}: no [journal] dir"
    assert PurePosixPath(directory).is_absolute(), f"{where}: [journal] dir {directory!r}"
    return directory


def seconds(duration: str) -> float:
    """A configuration duration ("250ms", "5s", "1m") in seconds."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration)
    assert match, duration
    return float(match.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[match.group(2)]


def test_kubernetes_manifests() -> None:
    """StatefulSet (no Deployment) with probes on /healthz and /readyz, resources and a
    non-root user; Service, PDB, HPA and ConfigMap present, no Secret (the operator creates
    them: deploy/k8s/README.md); kustomize applies every manifest of the directory, and
    only those."""
    docs = k8s_docs()
    kinds = {d["kind"] for d in docs}
    assert {"StatefulSet", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
            "ConfigMap"} <= kinds
    assert "Deployment" not in kinds
    assert "Secret" not in kinds
    (kustomization,) = load_all(DEPLOY / "k8s" / "kustomization.yaml")
    files = {f.name for f in (DEPLOY / "k8s").glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    pod = statefulset()["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "capsvc"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["resources"]["requests"]
    assert container["resources"]["limits"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (config,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert "token" not in config["data"]["capsvc.toml"].replace("token hashes", "")


def test_statefulset_keeps_each_pods_journal_on_a_claim_of_its_own() -> None:
    """The capsvc container mounts, writable, at the ConfigMap's [journal] dir, a volume
    claim template of the StatefulSet (ReadWriteOnce, a size, the cluster's default
    StorageClass), not a pod volume: each pod a claim of its own, kept across restarts and
    rescheduling. The pod's group may write it (fsGroup); the root filesystem stays
    read-only."""
    directory = journal_dir(configmap_toml(), "configmap.yaml capsvc.toml")
    spec = statefulset()["spec"]
    pod = spec["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "capsvc"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == directory]
    assert not mount.get("readOnly", False)
    assert "subPath" not in mount
    templates = {t["metadata"]["name"]: t for t in spec["volumeClaimTemplates"]}
    assert mount["name"] in templates, f"{directory} is not on a volume claim template"
    assert mount["name"] not in {v["name"] for v in pod.get("volumes", [])}
    claim = templates[mount["name"]]["spec"]
    assert claim["accessModes"] == ["ReadWriteOnce"]
    assert claim["resources"]["requests"]["storage"]
    assert "storageClassName" not in claim  # the cluster's default
    # Scaling down or deleting the StatefulSet keeps the claims (the journals on them).
    retention = spec.get("persistentVolumeClaimRetentionPolicy", {})
    assert retention.get("whenScaled", "Retain") == "Retain"
    assert retention.get("whenDeleted", "Retain") == "Retain"
    security = pod["securityContext"]
    assert security["fsGroup"] == security["runAsGroup"] == 10001
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    for init in pod.get("initContainers", []):
        assert mount["name"] not in {m["name"] for m in init["volumeMounts"]}


def test_one_report_per_draw_over_every_pods_journal() -> None:
    """Every pod's container `ship` copies its journal (read-only) into its own directory of
    a shared ReadWriteMany claim; the report CronJob mounts that claim and runs
    `capsvc report --all-final --journals` over it (one run at a time), with the
    configuration's games; it never calls the API."""
    directory = journal_dir(configmap_toml(), "configmap.yaml capsvc.toml")
    pod = statefulset()["spec"]["template"]["spec"]
    (ship,) = [c for c in pod["containers"] if c["name"] == "ship"]
    mounts = {m["mountPath"]: m for m in ship["volumeMounts"]}
    assert mounts[directory].get("readOnly") is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    args = ship["args"]
    assert args[:3] == ["capsvc", "journal", "ship"]
    target = args[args.index("--to") + 1]
    assert target.endswith("/$(POD_NAME)")
    (shared,) = [m for path, m in mounts.items() if target.startswith(path + "/")]
    claim = volumes[shared["name"]]["persistentVolumeClaim"]["claimName"]
    docs = k8s_docs()
    (pvc,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim"
              and d["metadata"]["name"] == claim]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    (cron,) = [d for d in docs if d["kind"] == "CronJob"]
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"
    job = cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    assert job["automountServiceAccountToken"] is False
    (report,) = job["containers"]
    job_volumes = {v["name"]: v for v in job["volumes"]}
    (journals,) = [m for m in report["volumeMounts"]
                   if "persistentVolumeClaim" in job_volumes[m["name"]]]
    assert job_volumes[journals["name"]]["persistentVolumeClaim"]["claimName"] == claim
    cargs = report["args"]
    assert cargs[:3] == ["capsvc", "report", "--all-final"]
    assert cargs[cargs.index("--journals") + 1] == journals["mountPath"]
    config = cargs[cargs.index("--config") + 1]
    assert any(config.startswith(m["mountPath"] + "/") and job_volumes[m["name"]].get(
        "configMap") for m in report["volumeMounts"])
    assert report["securityContext"]["readOnlyRootFilesystem"] is True


def test_statefulset_services_hpa_and_pdb_fit_together() -> None:
    """The StatefulSet's serviceName is a headless Service selecting its pods; the clients'
    Service still has a virtual IP, port 80 to the pods' http port; the HPA scales the
    StatefulSet, the PDB selects its pods; a pod's grace period outlasts its drain."""
    docs = k8s_docs()
    sts = statefulset()
    spec = sts["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    governing = services[spec["serviceName"]]["spec"]
    assert governing["clusterIP"] == "None"
    assert governing["selector"].items() <= labels.items()
    (client,) = [s["spec"] for name, s in services.items() if name != spec["serviceName"]]
    assert client.get("clusterIP") != "None"
    assert client["selector"].items() <= labels.items()
    assert [(p["port"], p["targetPort"]) for p in client["ports"]] == [(80, "http")]
    (hpa,) = [d for d in docs if d["kind"] == "HorizontalPodAutoscaler"]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        "apps/v1", "StatefulSet", sts["metadata"]["name"])
    (pdb,) = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["minAvailable"] < spec["replicas"] <= hpa["spec"]["minReplicas"]
    server = configmap_toml()["server"]
    drain = seconds(server.get("drain_delay", "1s")) + seconds(server.get("request_timeout",
                                                                          "5s"))
    assert spec["template"]["spec"]["terminationGracePeriodSeconds"] > drain


def compose_file() -> dict[str, Any]:
    (compose,) = load_all(DEPLOY / "docker-compose.yml")
    return dict(compose)


def test_compose_keeps_the_journal_on_a_named_volume(monkeypatch: pytest.MonkeyPatch) -> None:
    """The configuration compose mounts (CAPSVC_CONFIG) is deploy/capsvc.toml, valid, whose
    [journal] dir is a named volume of the stack (`docker compose down` keeps it)."""
    compose = compose_file()
    capsvc = compose["services"]["capsvc"]
    binds = {}
    for volume in capsvc["volumes"]:
        source, target, *_ = volume.split(":")
        binds[target] = source
    config_source = binds[capsvc["environment"]["CAPSVC_CONFIG"]]
    config_path = (DEPLOY / config_source).resolve()
    assert config_path == DEPLOY / "capsvc.toml"
    for name in ("CAPSVC_REDIS_URL", "CAPSVC_CONFIG", "CAPSVC_DURABILITY"):
        monkeypatch.delenv(name, raising=False)
    load_settings(config_path)  # as `capsvc check-config` does
    directory = journal_dir(tomllib.loads(config_path.read_text()), "deploy/capsvc.toml")
    assert directory in binds, f"compose mounts nothing at {directory}"
    assert binds[directory] in compose["volumes"], f"{binds[directory]} is not a named volume"


def dockerfile_final_stage() -> list[tuple[str, str]]:
    """The Dockerfile's last stage: (INSTRUCTION, arguments), continuations joined and
    comments dropped."""
    lines = [line for line in (ROOT / "Dockerfile").read_text().splitlines()
             if not line.lstrip().startswith("#")]
    text = re.sub(r"\\\n", " ", "\n".join(lines))
    instructions = [(m.group(1).upper(), m.group(2).strip())
                    for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", text, re.M)]
    last_from = max(i for i, (k, _) in enumerate(instructions) if k == "FROM")
    return instructions[last_from:]


def test_dockerfile_declares_the_journal_volume() -> None:
    """The image declares a VOLUME at the journal directory of the Kubernetes and compose
    configurations, created owned by capsvc (uid/gid 10001) before USER and VOLUME, so a new
    named volume, which takes the directory's owner, is writable by the service."""
    directory = journal_dir(configmap_toml(), "configmap.yaml capsvc.toml")
    compose_config = tomllib.loads((DEPLOY / "capsvc.toml").read_text())
    assert journal_dir(compose_config, "deploy/capsvc.toml") == directory
    stage = dockerfile_final_stage()
    volumes = []
    for i, (keyword, args) in enumerate(stage):
        if keyword == "VOLUME":
            paths = json.loads(args) if args.startswith("[") else args.split()
            volumes.extend((i, p) for p in paths)
    matches = [i for i, p in volumes if p.rstrip("/") == directory]
    assert len(matches) == 1, f"VOLUME {directory} not declared once: {volumes}"
    (index,) = matches
    (user,) = [i for i, (k, _) in enumerate(stage) if k == "USER"]
    created = [i for i, (k, args) in enumerate(stage) if k == "RUN" and directory in args
               and re.search(r"-o capsvc -g capsvc|chown (-R )?(capsvc:capsvc|10001:10001)",
                             args)]
    assert created, f"{directory} is not created owned by capsvc in a RUN"
    assert created[0] < user, "created after USER"
    assert created[0] < index, "created after VOLUME (the change would be lost)"


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


def test_metrics_are_on_a_port_of_their_own_open_to_prometheus_only() -> None:
    """The pod serves /metrics on its named port `metrics` (the ConfigMap's and the
    command's metrics_port, what the scrape annotations name), not on `http`; the
    clients' Service does not expose it; the NetworkPolicy lets only Prometheus's pods of
    the namespace monitoring reach it, and them not the API port."""
    sts = statefulset()
    template = sts["spec"]["template"]
    (container,) = [c for c in template["spec"]["containers"] if c["name"] == "capsvc"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    args = container["args"]
    metrics = int(args[args.index("--metrics-port") + 1])
    assert ports == {"http": int(args[args.index("--port") + 1]), "metrics": metrics}
    assert configmap_toml()["server"]["metrics_port"] == metrics
    annotations = template["metadata"]["annotations"]
    assert (annotations["prometheus.io/port"], annotations["prometheus.io/path"]) == (
        str(metrics), "/metrics")
    docs = k8s_docs()
    services = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "Service"}
    assert "metrics" not in {p["targetPort"] for p in services["capsvc"]["ports"]}
    (policy,) = [d["spec"] for d in docs
                 if d["kind"] == "NetworkPolicy" and d["spec"]["podSelector"]]
    reach: dict[int, list[Any]] = {}
    for rule in policy["ingress"]:
        for port in rule["ports"]:
            reach.setdefault(port["port"], []).extend(rule["from"])
    assert reach[metrics] == [{
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]
    assert all("monitoring" not in str(peer) for peer in reach[ports["http"]])
