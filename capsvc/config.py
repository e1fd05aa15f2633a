"""Configuration: the TOML file, the game presets it builds on, and their validation.

Everything here is pure: it turns text into frozen settings or into a list of
`ConfigError`s that say, field by field, what is wrong (`capsvc check-config`).
"""

from __future__ import annotations

import difflib
import os
import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import date, time
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from capsvc.urls import is_sentinel_url, parse_sentinel_url, redacted

PRESETS = ("fdj-keno-2008", "lnm-keno")
CANCEL_POLICIES = ("before_first_draw", "single_draw_only", "never")
ACCOUNTING_POLICIES = ("purchase_day", "draw_day")
SCOPES = ("sell", "read", "admin")
# Whole strings: `\Z`, not `$` (which also matches before a final newline), and fullmatch().
ID_RE = re.compile(r"^[A-Za-z0-9._:-]{1,64}\Z")
GAME_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}\Z")
_DURATION_RE = re.compile(r"^([0-9]+)(ms|s|m|h|d)\Z")
_DURATION_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_HHMM_RE = re.compile(r"^([01][0-9]|2[0-3]):([0-5][0-9])\Z")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}\Z")
_DURABILITY_RE = re.compile(r"^replicas:([1-9][0-9]{0,2})\Z")
MAX_AMOUNT = 10**12
DAY_MS = 86_400_000
MAX_DURATION_MS = 3660 * DAY_MS
"""No duration of the configuration goes beyond ten years (Redis TTLs stay in range)."""
"""Upper bound of any amount in minor units: far above any real stake, far below 2**53."""


class ConfigError(Exception):
    """One or more problems in a configuration, each with the place it was found."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True, slots=True)
class GameRules:
    """The complete, validated rules of one game as the API serves it."""

    id: str
    preset: str
    description: str
    currency: str
    numbers: int
    picks_min: int
    picks_max: int
    stakes: tuple[int, ...]
    durations: tuple[int, ...]
    cap_limit: int | None
    capped_picks: frozenset[int]
    daily_limit: int | None
    time_zone: str
    draw_times: tuple[time, ...]
    draw_epoch: date
    cancel: str
    retention_ms: int
    max_grids: int
    sales_horizon: int
    subscription_accounting: str
    multiplier: bool
    joker_plus_price: int | None
    tz: ZoneInfo = field(compare=False, repr=False)
    shadow_cap_limit: int | None = None
    """A lower cap evaluated on every capped grid and never enforced (to try it first)."""
    top_prizes: tuple[tuple[int, int], ...] = ()
    """(picks, prize) of the top rank (all numbers right) for a stake of
    `prize_base_stake`, minor units: what a draw's exposure reports as liability."""
    prize_base_stake: int = 0

    @property
    def min_stake(self) -> int:
        return self.stakes[0]

    def is_capped(self, picks: int) -> bool:
        return self.cap_limit is not None and picks in self.capped_picks


@dataclass(frozen=True, slots=True)
class Channel:
    """A sales system: who it is, what it may sell, what it may do."""

    id: str
    token_sha256: bytes = field(repr=False)
    games: frozenset[str]
    scopes: frozenset[str]


@dataclass(frozen=True, slots=True)
class Settings:
    """The whole service configuration."""

    games: dict[str, GameRules]
    channels: tuple[Channel, ...]
    redis_url: str | None = None
    redis_timeout_ms: int = 250
    durability_replicas: int = 0
    """Replicas that must acknowledge a sale's writes before it is answered (0: default)."""
    one_call_sales: bool = True
    """On a standalone Redis, sell a ticket in one atomic call (`[redis] sale_calls =
    "one"`, the default) rather than in steps ("steps": the protocol a Redis Cluster always
    uses, whose keys are spread over slots)."""
    wait_timeout_ms: int = 200
    host: str = "127.0.0.1"
    port: int = 8080
    metrics_port: int | None = None
    """`[server] metrics_port`: `/metrics` served there, on a listener of its own, and no
    longer on `port` (None: on `port`, the default)."""
    metrics_host: str | None = None
    """`[server] metrics_host`: where the metrics listener binds (None: `host`)."""
    workers: int = 1
    max_body_bytes: int = 64 * 1024
    max_batch: int = 256
    """`[server] max_batch`: the most tickets `POST /v1/ticket-batches` takes at once."""
    request_timeout_ms: int = 5000
    max_in_flight: int = 4096
    pending_deadline_ms: int = 60_000
    janitor_interval_ms: int = 5_000
    sweep_ms: int = 600_000
    """`[janitor] sweep`: how long one process takes to sweep every record bucket once (the
    records past their expiry deleted: capsvc.service.janitor)."""
    retry_after_s: int = 1
    drain_delay_ms: int = 1000
    access_log: bool = False
    journal_enabled: bool = True
    """Every answered decision appended to the journal before the answer (capsvc.journal)."""
    journal_dir: str = "var/journal"
    """Where this host's processes keep their journal files (relative: to the working
    directory)."""
    journal_keep_ms: int = 90 * DAY_MS
    """Journal files are deleted once their last write is older than this."""
    journal_max_file_bytes: int = 64 * 1024 * 1024
    """A journal file is closed and a new one opened past this size (and every UTC day)."""
    journal_settle_ms: int = 1000
    """After restoring into a Redis, how long (from the restore's start) a process waits
    before selling, so that every other live process has noticed that Redis and announced
    its own restore (capsvc.recovery.reconciler)."""
    audit_reports: bool = True
    """Each process writes the report of every draw once final (capsvc.audit)."""
    audit_interval_ms: int = 30_000
    """How often a process looks for draws to report."""
    audit_sources: tuple[str, ...] = ()
    """Journal directories read besides `journal_dir` (other hosts' journals, shipped or
    mounted) for reports and reconciliations."""
    audit_grace_ms: int = 60_000
    """A reconciliation during sales: decisions this young may not be in the export yet."""
    source: str = "<defaults>"


def parse_duration_ms(value: object) -> int:
    """`"24h"`, `"5m"`, `"250ms"` → milliseconds; raises ValueError otherwise."""
    if isinstance(value, str):
        m = _DURATION_RE.fullmatch(value)
        if m:
            return int(m.group(1)) * _DURATION_MS[m.group(2)]
    raise ValueError(f"expected a duration like \"250ms\", \"5m\" or \"24h\", got {value!r}")


def parse_durability(value: object) -> int:
    """`"default"` → 0, `"replicas:N"` → N (1 to 999); raises ValueError otherwise."""
    if value == "default":
        return 0
    if isinstance(value, str):
        m = _DURABILITY_RE.fullmatch(value)
        if m:
            return int(m.group(1))
    raise ValueError(f"expected \"default\" or \"replicas:N\" (N >= 1), got {value!r}")


def _hhmm(value: object) -> time:
    """`"HH:MM"` or `"HH:MM:SS"` → a time of day; raises ValueError otherwise."""
    if isinstance(value, str):
        m = _HHMM_RE.fullmatch(value[:5])
        # Seconds are optional, for draws less than a minute apart (draw_every = "2s").
        seconds = value[5:]
        if m and (not seconds or re.fullmatch(r":[0-5][0-9]", seconds)):
            return time(int(m.group(1)), int(m.group(2)), int(seconds[1:] or 0))
    raise ValueError(f"expected a time \"HH:MM\" or \"HH:MM:SS\", got {value!r}")


def load_preset(name: str) -> dict[str, Any]:
    text = resources.files("capsvc.presets").joinpath(f"{name}.toml").read_text("utf-8")
    return tomllib.loads(text)


class _Checker:
    """Collects every problem instead of stopping at the first one."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def fail(self, where: str, message: str) -> None:
        self.problems.append(f"{where}: {message}")

    def integer(self, where: str, value: object, lo: int, hi: int = MAX_AMOUNT) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(where, f"expected an integer, got {value!r}")
            return lo
        if not lo <= value <= hi:
            self.fail(where, f"must be between {lo} and {hi}, got {value}")
        return value

    def int_list(self, where: str, value: object, lo: int, hi: int = MAX_AMOUNT) -> tuple[int, ...]:
        if not isinstance(value, list) or not value:
            self.fail(where, f"expected a non-empty list of integers, got {value!r}")
            return ()
        items = [self.integer(f"{where}[{i}]", v, lo, hi) for i, v in enumerate(value)]
        if len(set(items)) != len(items):
            self.fail(where, "contains duplicates")
        return tuple(sorted(items))

    def choice(self, where: str, value: object, choices: tuple[str, ...]) -> str:
        if value not in choices:
            self.fail(where, f"must be one of {', '.join(choices)}, got {value!r}")
            return choices[0]
        return str(value)

    def boolean(self, where: str, value: object) -> bool:
        if not isinstance(value, bool):
            self.fail(where, f"expected true or false, got {value!r}")
            return False
        return value

    def text(self, where: str, value: object) -> str:
        if not isinstance(value, str):
            self.fail(where, f"expected a string, got {value!r}")
            return ""
        return value

    def duration(self, where: str, value: object, lo: int = 0, hi: int = MAX_DURATION_MS) -> int:
        try:
            ms = parse_duration_ms(value)
        except ValueError as e:
            self.fail(where, str(e))
            return 0
        if ms < lo:
            self.fail(where, f"must be at least {lo}ms, got {value!r}")
        elif ms > hi:
            self.fail(where, f"must be at most {hi // DAY_MS} days, got {value!r}")
        return ms

    def durability(self, where: str, value: object) -> int:
        try:
            return parse_durability(value)
        except ValueError as e:
            self.fail(where, str(e))
            return 0


_GAME_FIELDS = {
    "id", "preset", "description", "currency", "numbers", "picks_min", "picks_max", "stakes",
    "durations", "cap_limit", "capped_picks", "daily_limit", "time_zone", "draw_times",
    "draw_every", "draw_from", "draw_until", "draw_epoch", "cancel", "retention", "max_grids",
    "sales_horizon", "subscription_accounting", "multiplier", "joker_plus_price",
    "shadow_cap_limit", "top_prizes", "prize_base_stake",
}


def _schedule(c: _Checker, where: str, g: dict[str, Any]) -> tuple[time, ...]:
    """The draw times of a day, from `draw_times` or `draw_every` + `draw_from` + `draw_until`."""
    if "draw_times" in g and "draw_every" not in g:
        raw = g["draw_times"]
        if not isinstance(raw, list) or not raw:
            c.fail(f"{where}.draw_times", "expected a non-empty list of \"HH:MM[:SS]\"")
            return ()
        times: list[time] = []
        for i, v in enumerate(raw):
            try:
                times.append(_hhmm(v))
            except ValueError as e:
                c.fail(f"{where}.draw_times[{i}]", str(e))
        if len(set(times)) != len(times):
            c.fail(f"{where}.draw_times", "contains duplicates")
        return tuple(sorted(times))
    missing = [k for k in ("draw_every", "draw_from", "draw_until") if k not in g]
    if missing:
        c.fail(where, "needs draw_times, or draw_every + draw_from + draw_until "
               f"(missing {', '.join(missing)})")
        return ()
    every = c.duration(f"{where}.draw_every", g["draw_every"])
    try:
        start, end = _hhmm(g["draw_from"]), _hhmm(g["draw_until"])
    except ValueError as e:
        c.fail(f"{where}.draw_from/draw_until", str(e))
        return ()
    if every < 1000 or every % 1000:
        c.fail(f"{where}.draw_every", "must be a whole number of seconds, at least 1s")
        return ()
    # In seconds of the day: minute schedules give the very same times as ever, so the draw
    # numbers already stored keep their meaning.
    step = every // 1000
    first, last = (t.hour * 3600 + t.minute * 60 + t.second for t in (start, end))
    if last < first:
        c.fail(f"{where}.draw_until", "must not be before draw_from")
        return ()
    return tuple(time(s // 3600, s // 60 % 60, s % 60) for s in range(first, last + 1, step))


def build_game(raw: dict[str, Any], where: str, c: _Checker) -> GameRules | None:
    """Merge a `[[games]]` entry over its preset and validate every field."""
    gid = raw.get("id")
    if not isinstance(gid, str) or not GAME_ID_RE.fullmatch(gid):
        c.fail(f"{where}.id", f"expected a game id of [a-z0-9-] (max 32), got {gid!r}")
        gid = "?"
    unknown_keys(c, where, raw, frozenset(_GAME_FIELDS))
    preset = raw.get("preset")
    if not isinstance(preset, str) or preset not in PRESETS:
        c.fail(f"{where}.preset", f"must be one of {', '.join(PRESETS)}, got {preset!r}")
        return None
    g = load_preset(str(preset))
    if "draw_times" in raw:
        for k in ("draw_every", "draw_from", "draw_until"):
            g.pop(k, None)
    if "draw_every" in raw:
        g.pop("draw_times", None)
    g.update(raw)
    w = f"{where}"
    numbers = c.integer(f"{w}.numbers", g.get("numbers"), 2, 99)
    picks_min = c.integer(f"{w}.picks_min", g.get("picks_min"), 1, numbers)
    picks_max = c.integer(f"{w}.picks_max", g.get("picks_max"), 1, numbers)
    if picks_min > picks_max:
        c.fail(f"{w}.picks_min", f"must not exceed picks_max ({picks_max})")
    stakes = c.int_list(f"{w}.stakes", g.get("stakes"), 1)
    durations = c.int_list(f"{w}.durations", g.get("durations"), 1, 1000)
    if durations and durations[0] != 1:
        c.fail(f"{w}.durations", "must include 1 (a single draw)")
    cap = g.get("cap_limit")
    cap_limit = None if cap is None else c.integer(f"{w}.cap_limit", cap, 1)
    capped = c.int_list(f"{w}.capped_picks", g.get("capped_picks", []) or [0], 0, 99)
    if cap_limit is not None and any(not picks_min <= p <= picks_max for p in capped):
        c.fail(f"{w}.capped_picks",
               f"must lie within picks_min..picks_max ({picks_min}..{picks_max})")
    if cap_limit is not None and stakes and stakes[0] > cap_limit:
        c.fail(f"{w}.cap_limit", "is below the smallest stake: nothing could ever be sold")
    shadow = g.get("shadow_cap_limit")
    shadow_cap = None if shadow is None else c.integer(f"{w}.shadow_cap_limit", shadow, 1)
    if shadow_cap is not None and (cap_limit is None or shadow_cap >= cap_limit):
        c.fail(f"{w}.shadow_cap_limit",
               "must be below cap_limit (a lower cap to try before enforcing it)")
        shadow_cap = None
    top_prizes = _top_prizes(c, w, g.get("top_prizes", {}), picks_min, picks_max)
    base = c.integer(f"{w}.prize_base_stake", g.get("prize_base_stake", stakes[0] if stakes else 1),
                     1)
    daily = g.get("daily_limit")
    daily_limit = None if daily is None else c.integer(f"{w}.daily_limit", daily, 1)
    tzname = c.text(f"{w}.time_zone", g.get("time_zone"))
    try:
        tz = ZoneInfo(tzname)
    except (ZoneInfoNotFoundError, ValueError, OSError):  # "America" is a directory
        c.fail(f"{w}.time_zone", f"unknown IANA time zone {tzname!r}")
        tz = ZoneInfo("UTC")
    draw_times = _schedule(c, w, g)
    try:
        epoch = date.fromisoformat(str(g.get("draw_epoch", "2000-01-01")))
        if not date(1900, 1, 1) <= epoch <= date(2100, 12, 31):
            raise ValueError("out of range")
    except ValueError:
        c.fail(f"{w}.draw_epoch",
               f"expected a date YYYY-MM-DD from 1900 to 2100, got {g.get('draw_epoch')!r}")
        epoch = date(2000, 1, 1)
    joker = g.get("joker_plus_price")
    rules = GameRules(
        id=gid,
        preset=str(preset),
        description=c.text(f"{w}.description", g.get("description", "")),
        currency=c.text(f"{w}.currency", g.get("currency", "")),
        numbers=numbers,
        picks_min=picks_min,
        picks_max=picks_max,
        stakes=stakes,
        durations=durations,
        cap_limit=cap_limit,
        capped_picks=frozenset(p for p in capped if p) if cap_limit is not None else frozenset(),
        daily_limit=daily_limit,
        time_zone=tzname,
        draw_times=draw_times,
        draw_epoch=epoch,
        cancel=c.choice(f"{w}.cancel", g.get("cancel"), CANCEL_POLICIES),
        retention_ms=c.duration(f"{w}.retention", g.get("retention", "24h"), 0, 366 * DAY_MS),
        max_grids=c.integer(f"{w}.max_grids", g.get("max_grids", 20), 1, 100),
        sales_horizon=c.integer(f"{w}.sales_horizon", g.get("sales_horizon", 30), 0, 10_000),
        subscription_accounting=c.choice(
            f"{w}.subscription_accounting",
            g.get("subscription_accounting", "purchase_day"),
            ACCOUNTING_POLICIES,
        ),
        multiplier=c.boolean(f"{w}.multiplier", g.get("multiplier", False)),
        joker_plus_price=None if joker is None else c.integer(f"{w}.joker_plus_price", joker, 1),
        tz=tz,
        shadow_cap_limit=shadow_cap,
        top_prizes=top_prizes,
        prize_base_stake=base,
    )
    return rules


def _top_prizes(c: _Checker, w: str, raw: object, low: int, high: int
                ) -> tuple[tuple[int, int], ...]:
    """`top_prizes = { "10" = 100000000, … }`: picks (as TOML keys) to the top prize."""
    if not isinstance(raw, dict):
        c.fail(f"{w}.top_prizes", 'expected a table of picks to prizes, e.g. { "10" = 100000 }')
        return ()
    out = []
    for key, value in raw.items():
        if not (isinstance(key, str) and key.isdigit() and low <= int(key) <= high):
            c.fail(f"{w}.top_prizes.{key}", f"expected a number of picks from {low} to {high}")
            continue
        out.append((int(key), c.integer(f"{w}.top_prizes.{key}", value, 1, 10**15)))
    return tuple(sorted(out))


_SECTIONS = {
    "redis": frozenset({"url", "timeout", "durability", "wait_timeout", "sale_calls"}),
    "server": frozenset({"host", "port", "metrics_host", "metrics_port", "workers",
                         "max_body_bytes", "max_batch", "request_timeout",
                         "max_in_flight", "drain_delay", "access_log"}),
    "janitor": frozenset({"pending_deadline", "interval", "sweep"}),
    "journal": frozenset({"enabled", "dir", "keep", "max_file_bytes", "settle"}),
    "audit": frozenset({"reports", "interval", "sources", "grace"}),
}
_TOP_LEVEL = frozenset({*_SECTIONS, "games", "channels", "channels_file"})
_CHANNEL_FIELDS = frozenset({"id", "token_sha256", "games", "scopes"})


def unknown_keys(c: _Checker, where: str, raw: dict[str, Any], known: frozenset[str],
                 what: str = "field") -> None:
    """Every key of `raw` that is not `known` is an error naming its path, with the known
    key it most resembles (a typo such as `urll` or `intervall`)."""
    for k in sorted(set(raw) - known):
        close = difflib.get_close_matches(k, sorted(known), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        c.fail(f"{where}.{k}" if where else k, f"unknown {what}{hint}")


def _channel(raw: dict[str, Any], where: str, games: set[str], c: _Checker) -> Channel:
    """A `[[channels]]` entry; `games` are the ids of every game declared (even one with
    errors of its own, so that they are not reported again here)."""
    cid = raw.get("id")
    if not isinstance(cid, str) or not ID_RE.fullmatch(cid):
        c.fail(f"{where}.id", f"expected a channel id of [A-Za-z0-9._:-] (max 64), got {cid!r}")
        cid = "?"
    digest = raw.get("token_sha256")
    if digest is None:
        c.fail(f"{where}.token_sha256", "missing: the sha256 hex of the channel's bearer token")
        digest = "0" * 64
    elif not isinstance(digest, str) or not _SHA256_RE.fullmatch(digest):
        c.fail(f"{where}.token_sha256", "expected the sha256 of the token, 64 lowercase hex digits")
        digest = "0" * 64
    if "token" in raw:
        c.fail(f"{where}.token", "unknown field (clear tokens never go in the config: use "
               "token_sha256)")
    unknown_keys(c, where, {k: v for k, v in raw.items() if k != "token"}, _CHANNEL_FIELDS)
    chan_games = raw.get("games", [])
    if not isinstance(chan_games, list):
        c.fail(f"{where}.games", "expected a list of game ids")
        chan_games = []
    for i, g in enumerate(chan_games):
        if not isinstance(g, str) or g not in games:
            c.fail(f"{where}.games[{i}]", f"no game {g!r} is defined")
    scopes = raw.get("scopes", [])
    if not isinstance(scopes, list) or not scopes:
        c.fail(f"{where}.scopes", f"expected a non-empty list of {', '.join(SCOPES)}")
        scopes = []
    for i, s in enumerate(scopes):
        if not isinstance(s, str) or s not in SCOPES:
            c.fail(f"{where}.scopes[{i}]", f"must be one of {', '.join(SCOPES)}, got {s!r}")
    return Channel(
        id=cid,
        token_sha256=bytes.fromhex(digest),
        games=frozenset(str(g) for g in chan_games),
        scopes=frozenset(str(s) for s in scopes),
    )


def parse_settings(doc: dict[str, Any], source: str = "<memory>") -> Settings:
    """Validate a decoded TOML document; raise ConfigError listing every problem."""
    c = _Checker()
    unknown_keys(c, "", doc, _TOP_LEVEL, "section")
    sections: dict[str, dict[str, Any]] = {}
    for name, known in _SECTIONS.items():
        section = doc.get(name, {})
        if not isinstance(section, dict):
            c.fail(name, f"expected a [{name}] table")
            section = {}
        unknown_keys(c, name, section, known)
        sections[name] = section
    redis, server, janitor = sections["redis"], sections["server"], sections["janitor"]
    journal, audit = sections["journal"], sections["audit"]
    sources = audit.get("sources", [])
    if not isinstance(sources, list) or not all(isinstance(d, str) and d for d in sources):
        c.fail("audit.sources", "expected a list of directories, e.g. [\"/srv/journals/pod-1\"]")
        sources = []
    raw_games = doc.get("games", [])
    if not isinstance(raw_games, list) or not raw_games:
        c.fail("games", "at least one [[games]] entry is needed")
        raw_games = []
    games: dict[str, GameRules] = {}
    for i, raw in enumerate(raw_games):
        if not isinstance(raw, dict):
            c.fail(f"games[{i}]", "expected a [[games]] table")
            continue
        g = build_game(raw, f"games[{i}]", c)
        if g is None:
            continue
        if g.id in games:
            c.fail(f"games[{i}].id", f"duplicate game id {g.id!r}")
        games[g.id] = g
    raw_channels = doc.get("channels", [])
    if not isinstance(raw_channels, list):
        c.fail("channels", "expected [[channels]] entries")
        raw_channels = []
    declared = {str(r.get("id")) for r in raw_games if isinstance(r, dict)}
    channels = []
    for i, r in enumerate(raw_channels):
        if isinstance(r, dict):
            channels.append(_channel(r, f"channels[{i}]", declared, c))
        else:
            c.fail(f"channels[{i}]", "expected a [[channels]] table")
    seen: set[bytes] = set()
    for i, ch in enumerate(channels):
        if ch.token_sha256 in seen:
            c.fail(f"channels[{i}].token_sha256", "the same token is used by two channels")
        seen.add(ch.token_sha256)
    url = redis.get("url")
    if url is not None:
        problem = redis_url_problem(url)
        if problem:
            c.fail("redis.url", problem)
    settings = Settings(
        games=games,
        channels=tuple(channels),
        redis_url=url,
        redis_timeout_ms=c.duration("redis.timeout", redis.get("timeout", "250ms"), 1),
        durability_replicas=c.durability("redis.durability", redis.get("durability", "default")),
        one_call_sales=c.choice("redis.sale_calls", redis.get("sale_calls", "one"),
                                ("one", "steps")) == "one",
        # At least 1ms: WAIT with timeout 0 blocks for ever.
        wait_timeout_ms=c.duration("redis.wait_timeout", redis.get("wait_timeout", "200ms"), 1),
        host=c.text("server.host", server.get("host", "127.0.0.1")),
        port=c.integer("server.port", server.get("port", 8080), 0, 65535),
        metrics_port=(None if server.get("metrics_port") is None
                      else c.integer("server.metrics_port", server["metrics_port"], 0, 65535)),
        metrics_host=(None if server.get("metrics_host") is None
                      else c.text("server.metrics_host", server["metrics_host"])),
        workers=c.integer("server.workers", server.get("workers", 1), 1, 256),
        max_body_bytes=c.integer("server.max_body_bytes", server.get("max_body_bytes", 65536),
                                 256),
        max_batch=c.integer("server.max_batch", server.get("max_batch", 256), 1, 8192),
        request_timeout_ms=c.duration("server.request_timeout",
                                      server.get("request_timeout", "5s"), 50),
        max_in_flight=c.integer("server.max_in_flight", server.get("max_in_flight", 4096), 1),
        drain_delay_ms=c.duration("server.drain_delay", server.get("drain_delay", "1s")),
        access_log=c.boolean("server.access_log", server.get("access_log", False)),
        pending_deadline_ms=c.duration("janitor.pending_deadline",
                                       janitor.get("pending_deadline", "60s")),
        janitor_interval_ms=c.duration("janitor.interval", janitor.get("interval", "5s")),
        sweep_ms=c.duration("janitor.sweep", janitor.get("sweep", "10m"), 1),
        journal_enabled=c.boolean("journal.enabled", journal.get("enabled", True)),
        journal_dir=c.text("journal.dir", journal.get("dir", "var/journal")),
        journal_keep_ms=c.duration("journal.keep", journal.get("keep", "90d"), DAY_MS),
        journal_max_file_bytes=c.integer("journal.max_file_bytes",
                                         journal.get("max_file_bytes", 64 * 1024 * 1024),
                                         4096, 1 << 40),
        journal_settle_ms=c.duration("journal.settle", journal.get("settle", "1s"), 0,
                                     60_000),
        audit_reports=c.boolean("audit.reports", audit.get("reports", True)),
        audit_interval_ms=c.duration("audit.interval", audit.get("interval", "30s"), 100),
        audit_sources=tuple(sources),
        audit_grace_ms=c.duration("audit.grace", audit.get("grace", "60s")),
        source=source,
    )
    if settings.metrics_port and settings.metrics_port == settings.port:
        c.fail("server.metrics_port", f"must differ from server.port ({settings.port}): "
               "leave it out to serve /metrics on the API port")
    if settings.pending_deadline_ms < 2 * settings.request_timeout_ms:
        c.fail("janitor.pending_deadline", "must be at least twice server.request_timeout, so that "
               "the janitor never releases a ticket a request is still working on")
    if settings.durability_replicas and settings.wait_timeout_ms >= settings.request_timeout_ms:
        c.fail("redis.wait_timeout", "must be shorter than server.request_timeout, so that a "
               "sale waiting for its replicas answers before the request times out")
    if c.problems:
        raise ConfigError(c.problems)
    return settings


def redis_url_problem(url: object) -> str | None:
    """What is wrong with a Redis URL, or None."""
    schemes = r"^(redis|rediss|unix|redis\+cluster)://"
    if isinstance(url, str) and is_sentinel_url(url):
        try:
            parse_sentinel_url(url)
        except ValueError as e:
            return str(e)
        return None
    if not (isinstance(url, str) and re.match(schemes, url)):
        return (f"expected redis://, rediss://, unix://, redis+cluster:// or "
                f"redis+sentinel://, got {redacted(url) if isinstance(url, str) else url!r}")
    try:
        u = urlsplit(url)
        u.port  # noqa: B018 (raises ValueError when not a port number)
    except ValueError as e:
        return f"not a valid URL ({e}): {redacted(url)!r}"
    db = u.path.strip("/")
    if u.scheme != "unix" and db and not db.isdigit():
        return f"the database after the host must be a number, got {db!r}"
    return None


def default_config_path() -> Path:
    return Path(str(resources.files("capsvc").joinpath("default.toml")))


ConfigPaths = str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None
"""One configuration file, several (merged in order), or None: `$CAPSVC_CONFIG` (paths
separated by `os.pathsep`, `:` on Linux), else the built-in local default."""


def config_paths(paths: ConfigPaths = None) -> list[Path]:
    """The files a configuration is read from, in order (see `ConfigPaths`)."""
    if isinstance(paths, str | os.PathLike):
        return [Path(paths)]
    if paths:
        return [Path(p) for p in paths]
    listed = [p for p in os.environ.get("CAPSVC_CONFIG", "").split(os.pathsep) if p]
    return [Path(p) for p in listed] or [default_config_path()]


_ENTRIES = ("games", "channels")
"""The arrays of tables: concatenated across files (an id twice is an error)."""
_INDEXED = re.compile(r"(games|channels)\[([0-9]+)\](.*)\Z", re.S)


class _Merged:
    """Configuration files merged in order, remembering where each value came from."""

    def __init__(self) -> None:
        self.doc: dict[str, Any] = {}
        self.files: list[Path] = []
        self.origins: dict[str, str] = {}
        """"section", "section.key", top-level key → the file (or variable) that set it."""
        self.entries: dict[str, list[tuple[str, int]]] = {k: [] for k in _ENTRIES}
        """Each merged [[games]] / [[channels]] entry's file and index in that file."""
        self.problems: list[tuple[str, str]] = []
        """(file, problem) found while merging."""

    def add(self, path: Path, doc: dict[str, Any]) -> None:
        """Merge one file: its tables key by key over the earlier files', a scalar over an
        earlier one, its [[games]] and [[channels]] after the earlier files'."""
        name = str(path)
        self.files.append(path)
        for key, value in doc.items():
            if key in _ENTRIES:
                self._entries(name, key, value)
            elif key in _SECTIONS and not isinstance(value, dict):
                self.problems.append((name, f"{key}: expected a [{key}] table"))
            elif key in _SECTIONS:
                section = self.doc.setdefault(key, {})
                self.origins[key] = name
                for k, v in value.items():
                    section[k] = v
                    self.origins[f"{key}.{k}"] = name
            else:
                self.doc[key] = value
                self.origins[key] = name

    def _entries(self, name: str, key: str, value: object) -> None:
        if not isinstance(value, list):
            what = "[[games]] entries" if key == "games" else "[[channels]] entries"
            self.problems.append((name, f"{key}: expected {what}"))
            return
        merged = self.doc.setdefault(key, [])
        self.origins[key] = name
        places = self.entries[key]
        ids: dict[str, int] = {}
        for i, e in enumerate(merged):
            if isinstance(e, dict) and isinstance(e.get("id"), str):
                ids.setdefault(e["id"], i)
        for j, entry in enumerate(value):
            eid = entry.get("id") if isinstance(entry, dict) else None
            known = ids.get(eid) if isinstance(eid, str) else None
            if known is not None and places[known][0] != name:
                first, at = places[known]
                what = "game" if key == "games" else "channel"
                self.problems.append((name, f"{key}[{j}].id: duplicate {what} id "
                                      f"{entry['id']!r} (also {key}[{at}] of {first})"))
                continue
            merged.append(entry)
            places.append((name, j))
            if isinstance(eid, str):
                ids.setdefault(eid, len(merged) - 1)

    def place(self, problem: str) -> str:
        """A problem of the merged document, prefixed with the file it comes from (the
        index of a [[games]] or [[channels]] entry made that of its file)."""
        where, _, message = problem.partition(": ")
        m = _INDEXED.fullmatch(where)
        if m and int(m.group(2)) < len(self.entries[m.group(1)]):
            name, j = self.entries[m.group(1)][int(m.group(2))]
            return f"{name}: {m.group(1)}[{j}]{m.group(3)}: {message}"
        key = where
        while key:
            if key in self.origins:
                return f"{self.origins[key]}: {problem}"
            key = key.rpartition(".")[0]
        return problem


def load_settings(paths: ConfigPaths = None) -> Settings:
    """Read the configuration (one file or several, merged in order: `ConfigPaths`) and
    apply the environment. With more than one file (a `channels_file` included), each
    problem starts with the file it is in."""
    files = config_paths(paths)
    merged = _Merged()
    for p in files:
        doc = load_document(p)
        channels_file = doc.pop("channels_file", None)
        merged.add(p, doc)
        if channels_file is not None:
            # The channels (with their token hashes) may live in a file of their own, e.g.
            # a Kubernetes Secret mounted beside a ConfigMap holding the rest.
            merged.add(*_channels_file(p.parent / str(channels_file)))
    doc = merged.doc
    redis = doc.get("redis", {})
    for env, key in (("CAPSVC_REDIS_URL", "url"), ("CAPSVC_DURABILITY", "durability")):
        value = os.environ.get(env)
        if value and isinstance(redis, dict):  # else parse_settings says [redis] is wrong
            doc["redis"] = redis = {**redis, key: value}
            merged.origins[f"redis.{key}"] = env
    journal = doc.get("journal", {})
    journal_dir = os.environ.get("CAPSVC_JOURNAL_DIR")
    if journal_dir and isinstance(journal, dict):
        doc["journal"] = {**journal, "dir": journal_dir}
        merged.origins["journal.dir"] = "CAPSVC_JOURNAL_DIR"
    several = len(merged.files) > 1
    problems = [f"{name}: {p}" if several else p for name, p in merged.problems]
    try:
        settings = parse_settings(doc, source=", ".join(map(str, files)))
    except ConfigError as e:
        raise ConfigError([*problems, *(merged.place(p) if several else p
                                        for p in e.problems)]) from None
    if problems:
        raise ConfigError(problems)
    return settings


def _channels_file(path: Path) -> tuple[Path, dict[str, Any]]:
    """A `channels_file`: [[channels]] only."""
    extra = load_document(path)
    checker = _Checker()
    unknown_keys(checker, "", extra, frozenset({"channels"}), "section")
    if not isinstance(extra.get("channels", []), list):
        checker.fail("channels", "expected [[channels]] entries")
    if checker.problems:
        raise ConfigError([f"{path}: {problem}" for problem in checker.problems])
    return path, extra


def load_document(p: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(p.read_text("utf-8"))
    except OSError as e:
        raise ConfigError([f"{p}: cannot read: {e.strerror}"]) from e
    except UnicodeDecodeError as e:
        raise ConfigError([f"{p}: not UTF-8 text ({e.reason} at byte {e.start})"]) from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([f"{p}: not valid TOML: {e}"]) from e
