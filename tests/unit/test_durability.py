"""Durability modes: their configuration, and the policy's answers over a fake transport."""

from __future__ import annotations

from typing import Any

import pytest

from capsvc.config import ConfigError, load_settings, parse_settings
from capsvc.domain.errors import ApiError, Unavailable
from capsvc.redis.durability import Durability
from tests.conftest import CONFIG

SHA = "0" * 64


def doc(**redis: Any) -> dict[str, Any]:
    return {"redis": redis, "games": [{"id": "g", "preset": "fdj-keno-2008"}],
            "channels": [{"id": "c", "token_sha256": SHA, "games": ["g"], "scopes": ["sell"]}]}


class FakeRedis:
    """A transport whose WAIT answers `acks` (or raises it, when it is an exception)."""

    def __init__(self, acks: int | Exception) -> None:
        self.acks = acks
        self.waits: list[tuple[int, int]] = []

    async def wait_replicas(self, replicas: int, timeout_ms: int) -> int:
        self.waits.append((replicas, timeout_ms))
        if isinstance(self.acks, Exception):
            raise self.acks
        return self.acks


def durability(redis: FakeRedis, replicas: int) -> Durability:
    return Durability(redis, replicas, 200, 1)  # type: ignore[arg-type]


def test_default_mode_is_the_default() -> None:
    """Without [redis] durability: no replica, WAIT timeout 200 ms."""
    s = parse_settings(doc())
    assert (s.durability_replicas, s.wait_timeout_ms) == (0, 200)


def test_replicas_mode_parses() -> None:
    """`replicas:N` and a wait_timeout duration are read."""
    s = parse_settings(doc(durability="replicas:2", wait_timeout="50ms"))
    assert (s.durability_replicas, s.wait_timeout_ms) == (2, 50)


@pytest.mark.parametrize(("redis", "where"), [
    ({"durability": "replicas:0"}, "redis.durability"),
    ({"durability": "replicas"}, "redis.durability"),
    ({"durability": "replicas:1\n"}, "redis.durability"),
    ({"durability": "sync"}, "redis.durability"),
    ({"durability": 1}, "redis.durability"),
    ({"wait_timeout": "200"}, "redis.wait_timeout"),
    ({"wait_timeout": "0ms"}, "redis.wait_timeout"),
    ({"durability": "replicas:1", "wait_timeout": "5s"}, "redis.wait_timeout"),
])
def test_bad_values_name_the_path(redis: dict[str, Any], where: str) -> None:
    """Unknown or malformed durability settings are config errors at their path."""
    with pytest.raises(ConfigError) as e:
        parse_settings(doc(**redis))
    assert [p.split(":")[0] for p in e.value.problems] == [where]


def test_environment_overrides_durability(monkeypatch: pytest.MonkeyPatch) -> None:
    """CAPSVC_DURABILITY wins over the file."""
    monkeypatch.setenv("CAPSVC_DURABILITY", "replicas:1")
    assert load_settings(CONFIG).durability_replicas == 1


async def test_default_mode_sends_nothing() -> None:
    """In default mode confirm() returns at once, without a WAIT."""
    redis = FakeRedis(0)
    await durability(redis, 0).confirm()
    assert redis.waits == []


async def test_enough_acknowledgements_confirm() -> None:
    """N acknowledgements (or more) in time: the answer may go."""
    redis = FakeRedis(2)
    await durability(redis, 2).confirm()
    assert redis.waits == [(2, 200)]


@pytest.mark.parametrize("acks", [1, Unavailable("connection lost")])
async def test_too_few_acknowledgements_are_an_unknown_outcome(acks: int | Exception) -> None:
    """Too few acknowledgements, or a failed WAIT: 503 with Retry-After, outcome unknown."""
    with pytest.raises(ApiError) as e:
        await durability(FakeRedis(acks), 2).confirm()
    assert (e.value.kind, e.value.code, e.value.headers) == ("unavailable", "unavailable",
                                                               {"Retry-After": "1"})
    assert e.value.message.startswith("outcome unknown: the operation may have been recorded")
    assert "GET /v1/tickets/{ticket_id}" in e.value.message
