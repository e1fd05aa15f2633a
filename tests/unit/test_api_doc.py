"""docs/api.md, the API reference for integrators, is in step with the code (and the
README's table of metrics with the metrics' types).

Fast and without Redis: the OpenAPI document is built by `openapi_document()` (what
`GET /openapi.json` serves), the served routes are read from the aiohttp router that
`capsvc.http.server.build` wires (building it opens no connection), and the error codes, headers
and metric names are read from the source with `ast`.

The reference documents a route under a heading naming it, e.g.
"### `GET /v1/tickets/{ticket_id}`"; that heading's section runs to the next heading of the
same or a higher level.

Error codes: capsvc has no registry of them. Every error the API answers is an `ApiError`
(capsvc/domain/errors.py), raised directly as `ApiError(status, "code", ...)` or through
`rule_error("code", ...)` (status 422); `unavailable()` and `not_found()` in errors.py are
themselves literal `ApiError` calls. So the codes are the string literals passed as the code
of those calls anywhere in the package. A call whose code is not a literal fails this test
(so a new way of raising cannot go unseen), except inside `rule_error` itself, which
forwards its own parameter. A literal status must be the one documented for the code; a
computed one (aiohttp's parse-error status for `malformed_request`) is not checked.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import capsvc
from capsvc.config import Settings
from capsvc.http.openapi import openapi_document
from capsvc.http.server import build

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "api.md"
PACKAGE = Path(capsvc.__file__).resolve().parent
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
ERROR_FACTORIES = {"ApiError": (0, 1), "rule_error": (None, 0)}
"""Callable -> (position of the status argument, None: always 422; position of the code)."""
HEADER_SOURCES = ("http/app.py", "domain/errors.py")
"""Where the HTTP layer reads and sets headers."""
METRIC_TYPES = {"Counter", "Gauge", "Histogram", "Summary"}

_HEADING_RE = re.compile(r"^(#{1,6})\s+(.+?)\s*$")
_ROUTE_HEADING_RE = re.compile(rf"^`({'|'.join(METHODS)}) (/[^`\s]*)`")
_CODE_ROW_RE = re.compile(r"^\|\s*`([a-z][a-z0-9_]*)`\s*\|([^|]*)\|")


# -- the reference -----------------------------------------------------------------------


@dataclass(frozen=True)
class Section:
    level: int
    title: str
    text: str
    """The heading line and everything up to the next heading of this level or higher."""


@cache
def doc_text() -> str:
    assert DOC_PATH.is_file(), f"{DOC_PATH} is missing"
    return DOC_PATH.read_text(encoding="utf-8")


@cache
def sections() -> tuple[Section, ...]:
    lines = doc_text().splitlines()
    headings: list[tuple[int, int, str]] = []  # (line, level, title), outside code fences
    fenced = False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        m = _HEADING_RE.match(line)
        if m and not fenced:
            headings.append((i, len(m.group(1)), m.group(2)))
    out = []
    for n, (start, level, title) in enumerate(headings):
        end = next((j for j, lv, _ in headings[n + 1:] if lv <= level), len(lines))
        out.append(Section(level, title, "\n".join(lines[start:end])))
    return tuple(out)


@cache
def documented_routes() -> dict[tuple[str, str], str]:
    """(METHOD, path) of every route heading -> the text of its section."""
    routes: dict[tuple[str, str], str] = {}
    duplicates = []
    for s in sections():
        m = _ROUTE_HEADING_RE.match(s.title)
        if m:
            key = (m.group(1), m.group(2))
            if key in routes:
                duplicates.append(key)
            routes[key] = s.text
    assert not duplicates, f"docs/api.md: routes with more than one heading: {duplicates}"
    return routes


def section_titled(title: str) -> Section:
    found = [s for s in sections() if s.title == title]
    assert len(found) == 1, f'docs/api.md needs exactly one heading "{title}"'
    return found[0]


def mentions(name: str, text: str | None = None) -> bool:
    """`name` appears in code style (between backticks) in the text (default: the doc)."""
    return f"`{name}`" in (doc_text() if text is None else text)


def fmt(items: Any) -> str:
    """One item a line; a route (method, path) as "METHOD /path"."""
    return "\n  " + "\n  ".join(" ".join(i) if isinstance(i, tuple) else str(i)
                                 for i in sorted(items))


# -- the code ----------------------------------------------------------------------------


@cache
def openapi() -> dict[str, Any]:
    doc: dict[str, Any] = openapi_document()
    return doc


@cache
def openapi_operations() -> dict[tuple[str, str], dict[str, Any]]:
    return {(method.upper(), path): op
            for path, item in openapi()["paths"].items()
            for method, op in item.items() if method.upper() in METHODS}


@cache
def served_routes() -> frozenset[tuple[str, str]]:
    """Every (method, path template) the service's router answers (HEAD aside: the router
    adds it to every GET). Building the app connects to nothing."""
    app = build(Settings(games={}, channels=()), "redis://127.0.0.1:1/0").app
    return frozenset((m, t) for m, t in app.router.routes if m in METHODS)


def _sources(*names: str) -> Iterator[tuple[str, ast.AST]]:
    files = [PACKAGE / n for n in names] if names else sorted(PACKAGE.rglob("*.py"))
    for f in files:
        yield f.relative_to(PACKAGE.parent).as_posix(), ast.parse(f.read_text("utf-8"))


def _callee(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _arg(call: ast.Call, position: int, keyword: str) -> ast.expr | None:
    if position < len(call.args):
        return call.args[position]
    return next((k.value for k in call.keywords if k.arg == keyword), None)


Function = ast.FunctionDef | ast.AsyncFunctionDef


def _calls_with_function(tree: ast.AST) -> Iterator[tuple[ast.Call, Function | None]]:
    """Every call, with the function definition it is in (None at module level)."""
    def walk(node: ast.AST, fn: Function | None) -> Iterator[tuple[ast.Call, Function | None]]:
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else fn
            if isinstance(child, ast.Call):
                yield child, fn
            yield from walk(child, inner)
    yield from walk(tree, None)


@cache
def error_codes() -> dict[str, frozenset[int]]:
    """Every error code the package can answer -> its HTTP statuses (see the module doc)."""
    codes: dict[str, set[int]] = {}
    unknown = []
    for where, tree in _sources():
        for call, fn in _calls_with_function(tree):
            name = _callee(call)
            if name not in ERROR_FACTORIES:
                continue
            status_at, code_at = ERROR_FACTORIES[name]
            code = _arg(call, code_at, "code")
            status = 422 if status_at is None else _arg(call, status_at, "status")
            if isinstance(code, ast.Name) and fn is not None and fn.name in ERROR_FACTORIES \
                    and code.id in {a.arg for a in fn.args.args}:
                continue  # a factory forwarding its own parameter (rule_error -> ApiError)
            if not (isinstance(code, ast.Constant) and isinstance(code.value, str)):
                unknown.append(f"{where}:{call.lineno}: {name}(...) with a computed code")
                continue
            statuses = codes.setdefault(code.value, set())
            if isinstance(status, ast.Constant) and isinstance(status.value, int):
                statuses.add(status.value)
            elif isinstance(status, int):
                statuses.add(status)
    assert not unknown, ("cannot tell statically which error code or status these calls "
                         "answer; pass literals (or teach tests/unit/test_api_doc.py):"
                         + fmt(unknown))
    assert codes, "found no ApiError/rule_error call in capsvc: the scan is broken"
    return {c: frozenset(s) for c, s in codes.items()}


def _text(node: ast.AST | None) -> str | None:
    """The value of a string literal, else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _is_headers(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "headers"


@cache
def code_headers() -> frozenset[str]:
    """Header names the HTTP layer reads or sets: `….headers.get("X")`, `….headers["X"]`,
    `headers={"X": …}`, and `content_type=` (Content-Type)."""
    found: list[str | None] = []
    for _, tree in _sources(*HEADER_SOURCES):
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript) and _is_headers(node.value):
                found.append(_text(node.slice))
            elif isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Attribute) and f.attr == "get" and _is_headers(f.value) \
                        and node.args:
                    found.append(_text(node.args[0]))
                for k in node.keywords:
                    if k.arg == "headers" and isinstance(k.value, ast.Dict):
                        found += [_text(key) for key in k.value.keys]
                    elif k.arg == "content_type":
                        found.append("Content-Type")
    names = {n for n in found if n is not None}
    assert {"Authorization", "X-Request-ID"} <= names, f"header scan is broken: {names}"
    return frozenset(names)


@cache
def metric_types() -> dict[str, str]:
    """The names the service exports (a Counter `x` is exported as `x_total`), each with
    its type (`Counter`, `Gauge`, `Histogram`, `Summary`)."""
    types = {}
    for _, tree in _sources("ops/metrics.py"):
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _callee(node) in METRIC_TYPES and node.args:
                name = _text(node.args[0])
                if name is None:
                    continue
                if _callee(node) == "Counter" and not name.endswith("_total"):
                    name += "_total"
                types[name] = str(_callee(node))
    assert types, "found no metric in capsvc/ops/metrics.py: the scan is broken"
    return types


def metric_names() -> frozenset[str]:
    return frozenset(metric_types())


def _properties(schema: Any, seen: set[str]) -> Iterator[str]:
    """Property names of a schema and of every schema it refers to or nests."""
    if isinstance(schema, list):
        for s in schema:
            yield from _properties(s, seen)
    if not isinstance(schema, dict):
        return
    ref = schema.get("$ref")
    if isinstance(ref, str):
        name = ref.rsplit("/", 1)[-1]
        if name not in seen:
            seen.add(name)
            yield from _properties(openapi()["components"]["schemas"][name], seen)
    for prop, sub in schema.get("properties", {}).items():
        yield prop
        yield from _properties(sub, seen)
    for key in ("items", "anyOf", "oneOf", "allOf", "additionalProperties", "prefixItems"):
        yield from _properties(schema.get(key), seen)


# -- routes ------------------------------------------------------------------------------


def test_every_openapi_operation_has_a_heading() -> None:
    missing = set(openapi_operations()) - set(documented_routes())
    assert not missing, ("operations of the OpenAPI document without a heading like "
                         "\"### `GET /v1/...`\" in docs/api.md:" + fmt(missing))


def test_every_served_route_has_a_heading() -> None:
    """Including the routes the OpenAPI document leaves out (/metrics, /openapi.json)."""
    missing = served_routes() - set(documented_routes())
    assert not missing, ("routes the service serves without a heading in docs/api.md:"
                         + fmt(missing))


def test_every_documented_route_exists() -> None:
    known = set(openapi_operations()) | served_routes()
    stale = set(documented_routes()) - known
    assert not stale, ("docs/api.md documents routes that are neither in the OpenAPI "
                       "document nor served:" + fmt(stale))


def test_every_parameter_is_described_in_its_route_section() -> None:
    missing = []
    for (method, path), op in openapi_operations().items():
        section = documented_routes().get((method, path), "")
        for p in op.get("parameters", []):
            name = p["name"]
            if not re.search(rf"[`?&{{]{re.escape(name)}[`=}}]", section):
                missing.append(f"{method} {path}: {p['in']} parameter {name!r}")
    assert not missing, "parameters not described in their route's section:" + fmt(missing)


# -- schemas -----------------------------------------------------------------------------


def test_every_schema_property_is_documented() -> None:
    missing = [f"{schema}.{prop}"
               for schema, body in openapi()["components"]["schemas"].items()
               for prop in body.get("properties", {}) if not mentions(prop)]
    assert not missing, ("properties of the OpenAPI schemas not mentioned as `name` in "
                         "docs/api.md:" + fmt(missing))


def test_every_request_field_is_described_in_its_route_section() -> None:
    missing = []
    for (method, path), op in openapi_operations().items():
        body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
        section = documented_routes().get((method, path), "")
        missing += [f"{method} {path}: {prop}"
                    for prop in sorted(set(_properties(body.get("schema"), set())))
                    if not mentions(prop, section)]
    assert not missing, ("request body fields not described (as `name`) in the section of "
                         "their route:" + fmt(missing))


# -- errors ------------------------------------------------------------------------------


@cache
def documented_codes() -> dict[str, str]:
    """Error code -> the status cell of its row in the table under "### Error codes"."""
    rows = {}
    for line in section_titled("Error codes").text.splitlines():
        m = _CODE_ROW_RE.match(line)
        if m:
            rows[m.group(1)] = m.group(2)
    assert rows, "docs/api.md: no `code` | status | ... rows under \"### Error codes\""
    return rows


def test_every_error_code_is_documented_with_its_status() -> None:
    rows = documented_codes()
    missing = sorted(set(error_codes()) - set(rows))
    assert not missing, ("error codes the service can answer that the table under "
                         "\"### Error codes\" in docs/api.md lacks (add a row "
                         "| `code` | status | when |):" + fmt(missing))
    wrong = [f"{code}: documented {rows[code].strip()!r}, the code answers {sorted(statuses)}"
             for code, statuses in error_codes().items()
             if not all(re.search(rf"\b{s}\b", rows[code]) for s in statuses)]
    assert not wrong, "error codes documented with the wrong status:" + fmt(wrong)


def test_every_documented_error_code_exists() -> None:
    stale = set(documented_codes()) - set(error_codes())
    assert not stale, ("docs/api.md documents error codes that no ApiError/rule_error call "
                       "in capsvc answers:" + fmt(stale))


def test_every_error_status_of_the_openapi_document_has_a_code() -> None:
    statuses = {int(s) for op in openapi_operations().values() for s in op["responses"]
                if s.isdigit() and int(s) >= 400}
    covered = {int(s) for cell in documented_codes().values()
               for s in re.findall(r"\b[45]\d\d\b", cell)}
    missing = statuses - covered
    assert not missing, ("error statuses of the OpenAPI document with no code in the table "
                         "under \"### Error codes\":" + fmt(missing))


# -- headers and metrics -----------------------------------------------------------------


def test_every_header_is_documented() -> None:
    from_openapi = {h for op in openapi_operations().values()
                    for r in op["responses"].values() for h in r.get("headers", {})}
    missing = sorted(h for h in code_headers() | from_openapi if not mentions(h))
    assert not missing, ("headers the HTTP layer reads or sets, or the OpenAPI document "
                         "declares, not mentioned as `Name` in docs/api.md:" + fmt(missing))


def test_every_metric_is_documented() -> None:
    missing = sorted(n for n in metric_names() if not mentions(n))
    assert not missing, "metrics exported but not in docs/api.md:" + fmt(missing)
    stale = set(re.findall(r"`(capsvc_[a-z0-9_]+)`", doc_text())) - metric_names()
    assert not stale, "docs/api.md names metrics the service does not export:" + fmt(stale)


def test_the_readme_calls_every_histogram_a_histogram() -> None:
    """The README's table of metrics says "histogram" in each row naming one: a histogram
    read as one value (a gauge's "the last one") is queried wrong."""
    readme = (DOC_PATH.parents[1] / "README.md").read_text()
    histograms = {n for n, t in metric_types().items() if t == "Histogram"}
    rows = [line for line in readme.splitlines() if line.startswith("| `capsvc_")]
    named = {n for row in rows for n in re.findall(r"`(capsvc_[a-z0-9_]+)`", row)}
    assert histograms <= named, "histograms missing from the README's metrics table"
    wrong = [row for row in rows if "histogram" not in row
             and set(re.findall(r"`(capsvc_[a-z0-9_]+)`", row)) & histograms]
    assert not wrong, "README rows naming a histogram without saying so:" + fmt(wrong)


def test_every_operation_has_an_operation_id_and_a_declared_tag() -> None:
    """A client generated from the document gets one function a route, named as an
    integrator would (sellTicket, cancelTicket, …: camelCase, unique), grouped by a tag the
    document declares."""
    document = openapi()
    declared = {t["name"] for t in document["tags"]}
    ops = [op for path in document["paths"].values() for op in path.values()]
    ids = [op["operationId"] for op in ops]
    assert len(ids) == len(set(ids))
    assert all(re.fullmatch(r"[a-z]+(?:[A-Z][a-z]+)+", i) for i in ids), ids
    assert all(len(op["tags"]) == 1 and op["tags"][0] in declared for op in ops)
    names = {(m, p): op["operationId"] for p, path in document["paths"].items()
             for m, op in path.items()}
    assert names["post", "/v1/tickets"] == "sellTicket"
    assert names["post", "/v1/tickets/{ticket_id}/cancel"] == "cancelTicket"
