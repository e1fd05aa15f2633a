"""Bearer token → channel: the cache of proven headers never changes an answer."""

from __future__ import annotations

import hashlib

import pytest
from aiohttp.test_utils import make_mocked_request

from capsvc.config import Channel
from capsvc.domain.errors import ApiError
from capsvc.http.app import Authenticator


def channel(cid: str, token: str) -> Channel:
    return Channel(id=cid, token_sha256=hashlib.sha256(token.encode()).digest(),
                   games=frozenset(), scopes=frozenset({"sell"}))


def ask(auth: Authenticator, header: str) -> str:
    request = make_mocked_request("GET", "/v1/games", headers={"Authorization": header})
    return auth.channel(request).id


def test_cached_answers_are_the_answers_and_the_cache_is_bounded() -> None:
    auth = Authenticator((channel("a", "tok-a"), channel("b", "tok-b")))
    for _ in range(3):
        assert ask(auth, "Bearer tok-a") == "a"
        assert ask(auth, "Bearer tok-b") == "b"
        with pytest.raises(ApiError) as e:
            ask(auth, "Bearer tok-c")
        assert e.value.kind == "unauthorized"
    for spaces in range(1, 40):  # spellings of one valid token cannot grow it for ever
        assert ask(auth, "Bearer" + " " * spaces + "tok-a") == "a"
    assert len(auth._known) <= 4 * len(auth.channels)
    with pytest.raises(ApiError):
        ask(auth, "Bearer tok-a-but-longer")
