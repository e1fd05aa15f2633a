"""Redis URLs as the configuration gives them: which are Sentinel URLs, how they parse, and
how they are shown with their passwords hidden. Pure functions, below everything that
connects (capsvc.redis.sentinel) and the configuration that checks them (capsvc.config).

A Sentinel URL, as the `limits` library and redis-py's Sentinel support write it::

    redis+sentinel://[user:password@]host:port[,host:port…]/service_name[?db=N]
    rediss+sentinel://…      (TLS to the sentinels and to the primary)

The credentials are the data nodes'; sentinels that need their own are given
`sentinel_username` / `sentinel_password` in the query.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote, urlsplit

SCHEMES = ("redis+sentinel", "rediss+sentinel")
DEFAULT_PORT = 26379
_QUERY_KEYS = frozenset({"db", "sentinel_username", "sentinel_password"})

Address = tuple[str, int]


@dataclass(frozen=True)
class SentinelURL:
    """A parsed `redis+sentinel://` URL."""

    sentinels: tuple[Address, ...]
    service: str
    tls: bool = False
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)


def is_sentinel_url(url: str) -> bool:
    return url.split("://", 1)[0] in SCHEMES


_SECRET_PARAM = re.compile(r"((?:^|[?&])[^=&]*password=)[^&]*", re.IGNORECASE)


def redacted(url: str) -> str:
    """The URL with its passwords (credentials, `…password=` parameters) hidden, for
    messages."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, tail = rest.partition("/")
    path, question, query = tail.partition("?")
    query = _SECRET_PARAM.sub(r"\1***", query)
    creds, at, hosts = netloc.rpartition("@")
    if at:
        user = creds.partition(":")[0] if ":" in creds else ""
        netloc = f"{user}:***@{hosts}"
    return f"{scheme}{sep}{netloc}{slash}{path}{question}{query}"


def parse_sentinel_url(url: str) -> SentinelURL:
    """The parts of a Sentinel URL; raises ValueError saying what is wrong (never with the
    password)."""
    shown = redacted(url)
    scheme, sep, rest = url.partition("://")
    if scheme not in SCHEMES or not sep:
        raise ValueError(f"expected redis+sentinel:// or rediss+sentinel://, got {shown!r}")
    # urlsplit cannot take several host:port pairs: the netloc is split here.
    netloc, _, path_query = rest.partition("/")
    path, _, query = path_query.partition("?")
    creds, at, hosts = netloc.rpartition("@")
    if not at:
        creds, hosts = "", netloc
    username = password = None
    if creds:
        user, colon, secret = creds.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
        if not colon:  # "password@host" is read as a password, as redis-py does
            username, password = None, unquote(user)
    sentinels: list[Address] = []
    for part in hosts.split(","):
        if not part:
            raise ValueError(f"an empty sentinel address in {shown!r}")
        u = urlsplit("//" + part)
        try:
            port = u.port or DEFAULT_PORT
        except ValueError:
            raise ValueError(f"not a host:port: {part!r}") from None
        if not u.hostname:
            raise ValueError(f"not a host:port: {part!r}")
        sentinels.append((u.hostname, port))
    service = unquote(path)
    if not service or "/" in service:
        raise ValueError("the service name (the primary's name in the sentinels' "
                         f"configuration) must follow the addresses: …/mymaster, got {shown!r}")
    params = dict(parse_qsl(query, keep_blank_values=True))
    unknown = set(params) - _QUERY_KEYS
    if unknown:
        raise ValueError(f"unknown parameter(s) {', '.join(sorted(unknown))} in {shown!r} "
                         f"(known: {', '.join(sorted(_QUERY_KEYS))})")
    db = params.get("db", "0")
    if not db.isdigit():
        raise ValueError(f"db must be a number, got {db!r}")
    return SentinelURL(tuple(sentinels), service, scheme == "rediss+sentinel", int(db),
                       username, password, params.get("sentinel_username"),
                       params.get("sentinel_password"))
