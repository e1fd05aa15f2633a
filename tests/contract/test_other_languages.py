"""Clients in other languages, generated from the repository's contract as an integrator
would (openapi-generator from `openapi-3.0.json`, the same contract in OpenAPI 3.0.3, whose
3.1 support it calls beta; openapi-typescript from `openapi.json`), compiled, and run
against the real service: a sale, its replay, a conflicting reuse of its id, its look-up,
its cancel (then `state: cancelled`) and a batch with one ticket refused in its own
result.

- Java: openapi-generator (`java`, `--library native`), compiled by javac 17 against the
  Jackson jars of the local Maven cache;
- TypeScript: openapi-generator (`typescript-fetch`), and openapi-typescript with its
  default options plus openapi-fetch, each compiled by `tsc --strict`, run on Node.

The generators, compilers and runtimes are the machine's (Java 17, Node) and the pinned
packages of `clients/package.json` and the test extras. Where one is missing the tests skip,
unless CAPSVC_REQUIRE_TOOLCHAINS is set (CI sets it): then they fail."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.contract.conftest import TOKEN
from tests.support.service import ServiceProcess

HERE = Path(__file__).parent
CLIENTS = HERE / "clients"
CONTRACT = HERE.parents[1] / "openapi.json"
CONTRACT_30 = HERE.parents[1] / "openapi-3.0.json"
M2 = Path.home() / ".m2" / "repository"
STEPS = ["sold", "replayed", "same receipt", "409 idempotency_conflict", "not cancelled yet",
         "released 700", "state cancelled", "cancelled.released 700", "batch: sold",
         "batch: 422 stake_not_allowed in its result"]


def missing(what: str) -> None:
    if os.environ.get("CAPSVC_REQUIRE_TOOLCHAINS"):
        pytest.fail(f"{what} is missing, and CAPSVC_REQUIRE_TOOLCHAINS is set")
    pytest.skip(f"{what} is missing")


def run(args: list[str], cwd: Path, timeout: float = 300) -> str:
    result = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{args[0]}: {result.stdout[-4000:]}{result.stderr[-4000:]}"
    return result.stdout + result.stderr


def generate(generator: str, out: Path, *options: str) -> str:
    if shutil.which("openapi-generator-cli") is None:
        missing("openapi-generator-cli (pip install -e '.[test]')")
    if shutil.which("java") is None:
        missing("java")
    output = run(["openapi-generator-cli", "generate", "-i", str(CONTRACT_30), "-g",
                  generator, "-o", str(out), *options], cwd=out.parent)
    # The generator read every schema without a warning: no model left unused, none it
    # could not name, no construct it does not support.
    assert [line for line in output.splitlines() if "WARN" in line or "ERROR" in line] == []
    return output


def steps_passed(output: str) -> list[str]:
    return [line[3:] for line in output.splitlines() if line.startswith("ok ")]


def assert_every_step(output: str) -> None:
    passed = steps_passed(output)
    assert [s for s in STEPS if not any(p.startswith(s) for p in passed)] == [], output


@pytest.fixture(scope="module")
def node_modules() -> Path:
    """The pinned TypeScript tools (npm ci from clients/package-lock.json, once)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        missing("node and npm")
    modules = CLIENTS / "node_modules"
    if not (modules / ".package-lock.json").exists():
        run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=CLIENTS,
            timeout=600)
    return modules


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    shutil.copy(CLIENTS / "tsconfig.json", tmp_path / "tsconfig.json")
    return tmp_path


def compile_typescript(workdir: Path, node_modules: Path, program: str) -> None:
    shutil.copy(CLIENTS / program, workdir / program)
    (workdir / "node_modules").symlink_to(node_modules)
    run([str(node_modules / ".bin" / "tsc"), "-p", "tsconfig.json"], cwd=workdir)


def jackson_classpath() -> list[Path]:
    """The jars the generated Java client needs, from the local Maven cache: Jackson
    (databind, core and annotations of one version; the JSR-310 module), JSR-305 and the
    javax.annotation API."""
    def versions(group: str, artifact: str) -> dict[str, Path]:
        folder = M2 / group.replace(".", "/") / artifact
        return {jar.parent.name: jar for jar in folder.glob(f"*/{artifact}-*.jar")
                if jar.name == f"{artifact}-{jar.parent.name}.jar"}

    def key(version: str) -> list[int]:
        return [int(n) for n in re.findall(r"\d+", version)]

    jackson = "com.fasterxml.jackson.core"
    core = [versions(jackson, a) for a in ("jackson-databind", "jackson-core",
                                           "jackson-annotations")]
    common = sorted(set(core[0]) & set(core[1]) & set(core[2]), key=key)
    others = [versions("com.fasterxml.jackson.datatype", "jackson-datatype-jsr310"),
              versions("com.google.code.findbugs", "jsr305"),
              versions("javax.annotation", "javax.annotation-api")]
    if not common or not all(others):
        missing(f"Jackson, JSR-305 or javax.annotation jars in {M2}")
    return [c[common[-1]] for c in core] + [o[max(o, key=key)] for o in others]


def test_java_client_generated_compiled_and_selling(
        contract_service: ServiceProcess, workdir: Path) -> None:
    if shutil.which("javac") is None:
        missing("javac")
    generate("java", workdir / "java", "--library", "native", "--additional-properties",
             "openApiNullable=false,hideGenerationTimestamp=true,invokerPackage=capsvc.gen,"
             "apiPackage=capsvc.gen.api,modelPackage=capsvc.gen.model")
    classpath = ":".join(str(p) for p in jackson_classpath())
    sources = [str(p) for p in (workdir / "java" / "src" / "main").rglob("*.java")]
    run(["javac", "-nowarn", "-d", str(workdir / "classes"), "-cp", classpath, *sources,
         str(CLIENTS / "SellThrough.java")], cwd=workdir)
    output = run(["java", "-cp", f"{workdir / 'classes'}:{classpath}", "SellThrough",
                  contract_service.base_url, TOKEN, "JAVA"], cwd=workdir, timeout=60)
    assert_every_step(output)


def test_typescript_fetch_client_generated_compiled_and_selling(
        contract_service: ServiceProcess, workdir: Path, node_modules: Path) -> None:
    generate("typescript-fetch", workdir / "fetch")
    compile_typescript(workdir, node_modules, "sell_fetch.ts")
    output = run(["node", "out/sell_fetch.js", contract_service.base_url, TOKEN, "TSF"],
                 cwd=workdir, timeout=60)
    assert_every_step(output)


def test_openapi_typescript_types_with_default_options_compiled_and_selling(
        contract_service: ServiceProcess, workdir: Path, node_modules: Path) -> None:
    (workdir / "typed").mkdir()
    run([str(node_modules / ".bin" / "openapi-typescript"), str(CONTRACT), "-o",
         "typed/capsvc.ts"], cwd=workdir)
    compile_typescript(workdir, node_modules, "sell_typed.ts")
    output = run(["node", "out/sell_typed.js", contract_service.base_url, TOKEN, "TST"],
                 cwd=workdir, timeout=60)
    assert_every_step(output)
