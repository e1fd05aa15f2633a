"""Clients in other languages, generated from the repository's contract as an integrator
would (openapi-generator from `openapi-3.0.json`, the same contract in OpenAPI 3.0.3, whose
3.1 support it calls beta; openapi-typescript from `openapi.json`), compiled, and run
against the real service: a sale, its replay, a conflicting reuse of its id, its look-up,
its cancel (then `state: cancelled`) and a batch with one ticket refused in its own
result.

- Java: openapi-generator (`java`, `--library native`), compiled by javac 17 against the
  dependencies docs/client.md names (their jars from the local Maven cache); its money
  and counts are `Long`, and a sale past 2^31 minor units reads back exactly;
- TypeScript: openapi-generator (`typescript-fetch`), and openapi-typescript with its
  default options plus openapi-fetch, each compiled by `tsc --strict`, run on Node.

The generators, compilers and runtimes are the machine's (Java 17, Node) and the pinned
packages of `clients/package.json` and the test extras. Where one is missing the tests skip,
unless CAPSVC_REQUIRE_TOOLCHAINS is set (CI sets it): then they fail."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest

from tests.contract.conftest import TOKEN
from tests.support.service import ServiceProcess

HERE = Path(__file__).parent
CLIENTS = HERE / "clients"
CONTRACT = HERE.parents[1] / "openapi.json"
CONTRACT_30 = HERE.parents[1] / "openapi-3.0.json"
CLIENT_DOC = HERE.parents[1] / "docs" / "client.md"
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


@dataclass(frozen=True)
class JavaDependency:
    group: str
    artifact: str
    version: str
    scope: str

    @property
    def jar(self) -> Path:
        """Its jar in the local Maven cache."""
        return (M2 / self.group.replace(".", "/") / self.artifact / self.version
                / f"{self.artifact}-{self.version}.jar")


def documented_java_dependencies() -> list[JavaDependency]:
    """The Maven `<dependencies>` block of docs/client.md's "Clients in other languages":
    what that page tells a Java integrator a generated client needs."""
    section = CLIENT_DOC.read_text().split("## Clients in other languages", 1)[1]
    (block,) = re.findall(r"```xml\n(<dependencies>.*?</dependencies>)\n```", section, re.S)
    return [JavaDependency(*(d.findtext(k, "").strip() for k in ("groupId", "artifactId",
                                                                   "version")),
                           d.findtext("scope", "compile").strip())
            for d in ElementTree.fromstring(block).iter("dependency")]


def java_classpath(*, compiling: bool) -> str:
    """The documented dependencies' jars, from the local Maven cache: to compile, all of
    them; to run, all but those `provided`. The tests compile and run the client with
    exactly what docs/client.md names, so the page cannot drift from what works."""
    documented = documented_java_dependencies()
    absent = [d.jar for d in documented if not d.jar.is_file()]
    if absent:
        missing(f"the jars docs/client.md names, in {M2}: {', '.join(map(str, absent))}")
    return ":".join(str(d.jar) for d in documented if compiling or d.scope != "provided")


@dataclass(frozen=True)
class JavaClient:
    classes: Path
    sources: Path


@pytest.fixture(scope="module")
def java_client(tmp_path_factory: pytest.TempPathFactory) -> JavaClient:
    """The Java client generated from `openapi-3.0.json` and compiled, with the programs of
    `clients/` that use it, against the documented dependencies (once for the module)."""
    if shutil.which("javac") is None:
        missing("javac")
    where = tmp_path_factory.mktemp("java")
    generate("java", where / "java", "--library", "native", "--additional-properties",
             "openApiNullable=false,hideGenerationTimestamp=true,invokerPackage=capsvc.gen,"
             "apiPackage=capsvc.gen.api,modelPackage=capsvc.gen.model")
    sources = [str(p) for p in (where / "java" / "src" / "main").rglob("*.java")]
    run(["javac", "-nowarn", "-d", str(where / "classes"), "-cp",
         java_classpath(compiling=True), *sources, str(CLIENTS / "SellThrough.java"),
         str(CLIENTS / "LargeAmounts.java")], cwd=where)
    return JavaClient(where / "classes", where / "java" / "src" / "main" / "java" / "capsvc"
                      / "gen" / "model")


def run_java(client: JavaClient, program: str, service: ServiceProcess, prefix: str) -> str:
    return run(["java", "-cp", f"{client.classes}:{java_classpath(compiling=False)}", program,
                service.base_url, TOKEN, prefix], cwd=client.classes, timeout=60)


def test_the_documented_java_dependencies_are_the_ones_compiled_with() -> None:
    """docs/client.md names each dependency once, with its version, the Jackson modules of
    one minor version: the block the Java test compiles and runs with."""
    documented = documented_java_dependencies()
    names = [(d.group, d.artifact) for d in documented]
    assert len(set(names)) == len(names)
    assert {a for _, a in names} == {
        "jackson-databind", "jackson-core", "jackson-annotations", "jackson-datatype-jsr310",
        "jsr305", "javax.annotation-api"}
    assert all(re.fullmatch(r"\d+(\.\d+)+", d.version) for d in documented), documented
    assert len({tuple(d.version.split(".")[:2]) for d in documented
                if d.group.startswith("com.fasterxml.jackson")}) == 1
    assert [d.artifact for d in documented if d.scope != "compile"] == ["javax.annotation-api"]


def test_java_client_generated_compiled_and_selling(
        contract_service: ServiceProcess, java_client: JavaClient) -> None:
    assert_every_step(run_java(java_client, "SellThrough", contract_service, "JAVA"))


def java_fields(models: Path) -> dict[str, str]:
    """`Schema.json_name` -> the Java type of its field, read from the generated models."""
    field = re.compile(r'JSON_PROPERTY_\w+ = "([^"]+)";\s*(?:@[\w.]+\s*)*'
                       r"private ([\w<>, ]+?) \w+(?: = [^;]*)?;")
    return {f"{source.stem}.{name}": java for source in models.glob("*.java")
            for name, java in field.findall(source.read_text())}


def test_java_client_types_money_and_counts_as_long(java_client: JavaClient) -> None:
    """Every integer the document says is `int64` is a `Long` in the generated models (or a
    list or map of them), every other one an `Integer`: `TicketOut.totalCost`,
    `ExposureOut.topLiability`, `GridIn.stake`… hold amounts past 2^31."""
    def java(schema: dict[str, Any]) -> str | None:
        if schema.get("type") == "array":
            inner = java(schema["items"])
            return None if inner is None else f"List<{inner}>"
        if schema.get("type") == "object" and isinstance(schema.get("additionalProperties"),
                                                         dict):
            inner = java(schema["additionalProperties"])
            return None if inner is None else f"Map<String, {inner}>"
        if schema.get("type") == "integer" and "enum" not in schema:
            return "Long" if schema.get("format") == "int64" else "Integer"
        return None

    schemas = json.loads(CONTRACT_30.read_text())["components"]["schemas"]
    expected = {f"{name}.{field}": t for name, s in schemas.items()
                for field, prop in s.get("properties", {}).items()
                if (t := java(prop)) is not None}
    generated = java_fields(java_client.sources)
    assert {k: generated.get(k) for k in expected} == expected
    assert generated["TicketOut.total_cost"] == "Long"
    assert generated["ExposureOut.top_liability"] == "Long"
    assert generated["GameOut.stakes"] == "List<Long>"
    assert generated["GridOut.index"] == "Integer"


def test_java_client_sells_and_reads_amounts_past_2_31(
        contract_service: ServiceProcess, java_client: JavaClient) -> None:
    """A stake of 3,000,000,000 minor units on big-keno (cap 6,000,000,000): the sale's
    cost, the exposure's cap, stake and top-rank liability (6 x 10^14), the combination's
    stake and room and the cancel's release, each read back exactly through Java."""
    output = run_java(java_client, "LargeAmounts", contract_service, "JAVA-BIG")
    assert steps_passed(output) == [
        "sold", "total_cost 3000000000", "grid cost 3000000000", "cap 6000000000",
        "top staked 3000000000", "liability 600000000000000",
        "top_liability 600000000000000",
        "combination staked 3000000000, remaining 3000000000", "released 3000000000"], output


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
