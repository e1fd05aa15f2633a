"""A client generated from the served /openapi.json by openapi-python-client, as an
integrator in another team would: functions named after the operations (sell_ticket,
get_ticket, cancel_ticket…) in modules by tag, one ticket model whatever the games, and a sale, its
look-up and its cancel through it against the real service."""

from __future__ import annotations

import importlib
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from tests.contract.conftest import TOKEN
from tests.support.service import ServiceProcess

TEN = [3, 7, 12, 18, 25, 33, 41, 56, 60, 70]


@pytest.fixture(scope="module")
def generated(contract_service: ServiceProcess, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[str]:
    """The package generated into a temporary folder, importable as `capsvc_generated`."""
    where = tmp_path_factory.mktemp("generated")
    document = where / "openapi.json"
    with urllib.request.urlopen(contract_service.base_url + "/openapi.json") as resp:
        document.write_bytes(resp.read())
    result = subprocess.run(
        [sys.executable, "-m", "openapi_python_client", "generate", "--path", str(document),
         "--meta", "none", "--output-path", str(where / "capsvc_generated")],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    # Every operation generated: none skipped for a construct the generator cannot read.
    assert "will not be generated" not in result.stdout + result.stderr, result.stdout
    sys.path.insert(0, str(where))
    yield "capsvc_generated"
    sys.path.remove(str(where))
    for name in [m for m in sys.modules if m.startswith("capsvc_generated")]:
        del sys.modules[name]


def module(package: str, name: str) -> ModuleType:
    return importlib.import_module(f"{package}.{name}")


def test_functions_are_named_after_operations_and_grouped_by_tag(generated: str) -> None:
    for tag, functions in {"tickets": ["sell_ticket", "get_ticket", "cancel_ticket"],
                           "availability": ["get_combination", "check_availability",
                                            "list_capped_combinations"],
                           "draws": ["get_current_draw", "get_draw", "close_draw"],
                           "players": ["get_player", "set_player_limit",
                                       "record_player_stake"],
                           "audit": ["get_draw_report", "reconcile_draw"]}.items():
        for function in functions:
            assert hasattr(module(generated, f"api.{tag}.{function}"), "sync_detailed")


def test_sell_look_up_and_cancel_through_the_generated_client(
        generated: str, contract_service: ServiceProcess) -> None:
    client_module = module(generated, "client")
    models = module(generated, "models")
    sell, get, cancel = (module(generated, f"api.tickets.{f}")
                         for f in ("sell_ticket", "get_ticket", "cancel_ticket"))
    current = module(generated, "api.draws.get_current_draw")
    client: Any = client_module.AuthenticatedClient(base_url=contract_service.base_url,
                                                    token=TOKEN)
    with client:
        draw = current.sync(client=client, game="fdj-keno").draw
        body = models.TicketIn.from_dict({
            "ticket_id": "GEN-1", "game": "fdj-keno", "first_draw": draw,
            "grids": [{"numbers": TEN, "stake": 500}, {"numbers": [1, 2], "stake": 200}]})
        sold = sell.sync_detailed(client=client, body=body)
        assert sold.status_code == 200
        assert (sold.parsed.status, sold.parsed.total_cost) == ("accepted", 700)
        replay = sell.sync_detailed(client=client, body=body)
        assert replay.headers["Idempotent-Replayed"] == "true"
        assert replay.parsed.receipt.receipt_id == sold.parsed.receipt.receipt_id
        looked_up = get.sync(client=client, ticket_id="GEN-1")
        assert looked_up.total_cost == 700
        cancelled = cancel.sync(client=client, ticket_id="GEN-1")
        assert (cancelled.status, cancelled.released) == ("cancelled", 700)
        assert get.sync(client=client, ticket_id="GEN-1").cancelled.released == 700

        # Errors come back as the documented ErrorOut, by status.
        other = models.TicketIn.from_dict({
            "ticket_id": "GEN-1", "game": "fdj-keno", "first_draw": draw,
            "grids": [{"numbers": TEN, "stake": 200}]})
        conflict = sell.sync_detailed(client=client, body=other)
        assert (conflict.status_code, conflict.parsed.error.code) == (
            409, "idempotency_conflict")
        missing = get.sync_detailed(client=client, ticket_id="GEN-404")
        assert (missing.status_code, missing.parsed.error.code) == (404, "not_found")
