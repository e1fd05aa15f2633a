"""Configuration: presets as data, overrides, and the explained errors."""

from __future__ import annotations

from datetime import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from capsvc.config import ConfigError, load_settings, parse_settings
from tests.conftest import CONFIG

SHA = "0" * 64


def doc(**game: Any) -> dict[str, Any]:
    return {"games": [{"id": "g", "preset": "fdj-keno-2008", **game}],
            "channels": [{"id": "c", "token_sha256": SHA, "games": ["g"], "scopes": ["sell"]}]}


def test_presets_carry_the_rules() -> None:
    """The two presets have the values of RULES.md §3."""
    games = load_settings(CONFIG).games
    fdj, lnm = games["fdj-keno"], games["lnm-keno"]
    assert (fdj.numbers, fdj.stakes, fdj.cap_limit, fdj.capped_picks) == (
        70, (100, 200, 300, 500, 1000), 5000, frozenset({8, 9, 10}))
    assert (fdj.multiplier, fdj.joker_plus_price, fdj.daily_limit) == (True, 200, None)
    assert (lnm.numbers, lnm.stakes, lnm.daily_limit, lnm.time_zone) == (
        80, (250, 500, 1000, 2500), 4_000_000, "Africa/Casablanca")
    assert (lnm.multiplier, lnm.joker_plus_price, lnm.cancel) == (False, None,
                                                                  "single_draw_only")


def test_overrides_apply() -> None:
    """Any preset field may be overridden per game."""
    g = parse_settings(doc(cap_limit=10000, retention="2h", draw_times=["12:00"])).games["g"]
    assert (g.cap_limit, g.retention_ms, len(g.draw_times)) == (10000, 7_200_000, 1)


def test_no_cap_means_nothing_capped() -> None:
    """Without cap_limit, no grid is capped."""
    g = parse_settings(doc(cap_limit=None)).games["g"]
    assert not g.is_capped(10)


def test_environment_overrides_redis_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """CAPSVC_REDIS_URL wins over the file."""
    monkeypatch.setenv("CAPSVC_REDIS_URL", "redis://example:6379/1")
    assert load_settings(CONFIG).redis_url == "redis://example:6379/1"


@pytest.mark.parametrize(("game", "where"), [
    ({"stakes": []}, "games[0].stakes"),
    ({"numbers": 120}, "games[0].numbers"),
    ({"picks_min": 9, "picks_max": 3}, "games[0].picks_min"),
    ({"durations": [2, 5]}, "games[0].durations"),
    ({"cap_limit": 50}, "games[0].cap_limit"),
    ({"draw_times": ["25:00"]}, "games[0].draw_times[0]"),
    ({"retention": "soon"}, "games[0].retention"),
    ({"subscription_accounting": "monthly"}, "games[0].subscription_accounting"),
    ({"colour": "red"}, "games[0].colour"),
    ({"shadow_cap_limit": 5000}, "games[0].shadow_cap_limit"),  # not below the cap
    ({"shadow_cap_limit": 0}, "games[0].shadow_cap_limit"),
    ({"shadow_cap_limit": 3000, "cap_limit": None}, "games[0].shadow_cap_limit"),
])
def test_errors_name_the_field(game: dict[str, Any], where: str) -> None:
    """Each invalid field is reported where it is."""
    with pytest.raises(ConfigError) as e:
        parse_settings(doc(**game))
    assert any(p.startswith(where) for p in e.value.problems), e.value.problems


def test_all_errors_are_reported_at_once() -> None:
    """Several problems give several lines, not just the first."""
    with pytest.raises(ConfigError) as e:
        parse_settings(doc(stakes=[], cancel="maybe", time_zone="Nowhere/City"))
    assert len(e.value.problems) >= 3


def test_channels_from_a_separate_file(tmp_path: Any) -> None:
    """channels_file adds the channels of another file (a Secret beside a ConfigMap)."""
    (tmp_path / "main.toml").write_text(
        'channels_file = "secret/channels.toml"\n[[games]]\nid = "g"\npreset = "lnm-keno"\n')
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "channels.toml").write_text(
        f'[[channels]]\nid = "c"\ntoken_sha256 = "{SHA}"\ngames = ["g"]\nscopes = ["sell"]\n')
    settings = load_settings(tmp_path / "main.toml")
    assert [c.id for c in settings.channels] == ["c"]


def schedule(**fields: Any) -> tuple[time, ...]:
    return parse_settings(doc(**fields)).games["g"].draw_times


def test_draws_every_few_seconds() -> None:
    """draw_every may be any whole number of seconds; times may carry seconds."""
    times = schedule(draw_every="2s", draw_from="00:00", draw_until="23:59:58")
    assert (len(times), times[1], times[-1]) == (43_200, time(0, 0, 2), time(23, 59, 58))
    assert schedule(draw_every="90s", draw_from="08:00", draw_until="08:05:59") == (
        time(8), time(8, 1, 30), time(8, 3), time(8, 4, 30))
    assert schedule(draw_every="1000ms", draw_from="12:00:58", draw_until="12:01") == (
        time(12, 0, 58), time(12, 0, 59), time(12, 1))
    assert schedule(draw_times=["12:00:30", "08:00"]) == (time(8), time(12, 0, 30))


@given(step=st.integers(1, 1440), first=st.integers(0, 1439), length=st.integers(0, 1439))
def test_minute_schedules_keep_their_times(step: int, first: int, length: int) -> None:
    """Whole-minute schedules give the same times as ever, so stored draw numbers keep."""
    last = min(first + length, 1439)
    times = schedule(draw_every=f"{step}m", draw_from=f"{first // 60:02d}:{first % 60:02d}",
                     draw_until=f"{last // 60:02d}:{last % 60:02d}")
    assert times == tuple(time(m // 60, m % 60) for m in range(first, last + 1, step))


@pytest.mark.parametrize(("game", "where"), [
    ({"draw_every": "1500ms", "draw_from": "00:00", "draw_until": "01:00"}, "draw_every"),
    ({"draw_every": "500ms", "draw_from": "00:00", "draw_until": "01:00"}, "draw_every"),
    ({"draw_every": "0s", "draw_from": "00:00", "draw_until": "01:00"}, "draw_every"),
    ({"draw_every": "2s", "draw_from": "00:00:60", "draw_until": "01:00"}, "draw_from"),
    ({"draw_every": "2s", "draw_from": "00:00", "draw_until": "01:00:5"}, "draw_from"),
    ({"draw_every": "2s", "draw_from": "08:00:01", "draw_until": "08:00"}, "draw_until"),
    ({"draw_times": ["12:00:00:00"]}, "draw_times[0]"),
    ({"draw_times": ["12:00 "]}, "draw_times[0]"),
    ({"draw_times": ["12:00", "12:00:00"]}, "draw_times"),
])
def test_schedule_errors_name_the_field(game: dict[str, Any], where: str) -> None:
    """Bad sub-minute schedules are reported on the field at fault."""
    with pytest.raises(ConfigError) as e:
        parse_settings(doc(**game))
    assert any(p.startswith(f"games[0].{where}") for p in e.value.problems), e.value.problems


def problems(document: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as e:
        parse_settings(document)
    return e.value.problems


@pytest.mark.parametrize(("section", "typo", "meant"), [
    ("redis", "urll", "url"), ("redis", "timout", "timeout"),
    ("server", "prot", "port"), ("server", "timeout", "request_timeout"),
    ("redis", "cluster", None),
    ("janitor", "intervall", "interval"), ("janitor", "pending_deadlines", "pending_deadline"),
    ("audit", "source", "sources"),
])
def test_an_unknown_key_in_a_section_is_an_error_naming_its_path(
        section: str, typo: str, meant: str | None) -> None:
    """A typo anywhere ([redis] urll = …) is an error with its path, and the key it most
    resembles when there is one: never a silently ignored setting."""
    document = {**doc(), section: {typo: "x"}}
    (problem,) = [p for p in problems(document) if typo in p]
    assert problem.startswith(f"{section}.{typo}")
    assert (f"did you mean {meant!r}" in problem) if meant else ("did you mean" not in problem)


def test_the_audit_section_is_read_and_checked() -> None:
    """[audit]: reports, interval, sources (a list of directories), grace; a source that is
    not a directory name is an error naming it."""
    settings = parse_settings({**doc(), "audit": {
        "reports": False, "interval": "5s", "sources": ["/srv/j/pod-1"], "grace": "2m"}})
    assert (settings.audit_reports, settings.audit_interval_ms, settings.audit_sources,
            settings.audit_grace_ms) == (False, 5000, ("/srv/j/pod-1",), 120_000)
    (problem,) = problems({**doc(), "audit": {"sources": "/srv/j"}})
    assert problem.startswith("audit.sources: expected a list of directories")


def test_unknown_keys_of_games_channels_and_sections_are_named() -> None:
    """Unknown keys of a game, of a channel and at the top level are reported the same way."""
    document = doc(cap_limt=100)
    document["channels"][0]["scope"] = ["sell"]
    document["janitr"] = {}
    found = problems(document)
    assert any(p.startswith("games[0].cap_limt") and "'cap_limit'" in p for p in found)
    assert any(p.startswith("channels[0].scope") and "'scopes'" in p for p in found)
    assert any(p.startswith("janitr") and "'janitor'" in p for p in found)


def test_a_missing_token_hash_says_missing() -> None:
    """A channel without token_sha256 is told it is missing, not that it is malformed."""
    document = doc()
    del document["channels"][0]["token_sha256"]
    (problem,) = problems(document)
    assert problem.startswith("channels[0].token_sha256")
    assert "missing" in problem


def test_a_bad_preset_is_reported_once() -> None:
    """A game with an unknown preset is one error, not followed by "no game …" for every
    channel that sells it."""
    (problem,) = problems(doc(preset="fdj-keno-2009"))
    assert problem.startswith("games[0].preset")


def test_a_section_that_is_not_a_table_is_an_error() -> None:
    """`redis = "…"` instead of a [redis] table is explained, never a crash."""
    assert any(p.startswith("redis") and "table" in p
               for p in problems({**doc(), "redis": "redis://x"}))


def _channel_games(value: Any) -> dict[str, Any]:
    document = doc()
    document["channels"][0]["games"] = value
    return document


ODD_DOCUMENTS = [
    ("a game that is not a table", {**doc(), "games": [1]}, "games[0]"),
    ("a channel that is not a table", {**doc(), "channels": ["x"]}, "channels[0]"),
    ("a channel game that is a table", _channel_games([{"a": 1}]), "channels[0].games[0]"),
    ("a zone that is a directory", doc(time_zone="America"), "games[0].time_zone"),
    ("an epoch out of range", doc(draw_epoch="9999-12-31"), "games[0].draw_epoch"),
    ("a retention of ages", doc(retention="999999999999d"), "games[0].retention"),
    ("no request time", {**doc(), "server": {"request_timeout": "0s"}},
     "server.request_timeout"),
    ("a port that is not one", {**doc(), "redis": {"url": "redis://localhost:notaport"}},
     "redis.url"),
    ("a port out of range", {**doc(), "redis": {"url": "redis://localhost:99999"}},
     "redis.url"),
    ("a broken host", {**doc(), "redis": {"url": "redis://[::1"}}, "redis.url"),
    ("a database that is not a number", {**doc(), "redis": {"url": "redis://h:1/abc"}},
     "redis.url"),
    ("a typo beside a bad preset", doc(preset="nope", typo_key=1), "games[0].typo_key"),
]


@pytest.mark.parametrize(("name", "document", "where"), ODD_DOCUMENTS,
                         ids=[d[0] for d in ODD_DOCUMENTS])
def test_odd_documents_are_explained_never_a_crash(name: str, document: dict[str, Any],
                                                   where: str) -> None:
    """Whatever the TOML holds, the answer is a list of problems naming where they are (a
    value that passed here but broke `serve` later, or a traceback, is a bug)."""
    assert any(p.startswith(where) for p in problems(document)), problems(document)


def test_files_that_are_not_text_or_hold_unknown_sections_are_explained(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file that is not UTF-8, a channels file with other sections or a bad `channels`,
    and `redis = 5` with CAPSVC_REDIS_URL set: each a ConfigError, not a traceback."""
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe[server]\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_settings(binary)
    main = tmp_path / "capsvc.toml"
    main.write_text('channels_file = "channels.toml"\n' + CONFIG.read_text())
    channels = tmp_path / "channels.toml"
    for text, expected in (('[server]\nport = 1\n', "server: unknown section"),
                           ('[[channel]]\nid = "typo"\n', "did you mean 'channels'"),
                           ('channels = "oops"\n', "channels: expected")):
        channels.write_text(text)
        with pytest.raises(ConfigError) as e:
            load_settings(main)
        assert any(expected in p for p in e.value.problems), e.value.problems
    odd = tmp_path / "odd.toml"
    odd.write_text("redis = 5\n" + CONFIG.read_text())
    monkeypatch.setenv("CAPSVC_REDIS_URL", "redis://127.0.0.1:6379/0")
    with pytest.raises(ConfigError) as e:
        load_settings(odd)
    assert any(p.startswith("redis") for p in e.value.problems)
