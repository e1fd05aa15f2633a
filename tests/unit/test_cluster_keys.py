"""A Redis Cluster command goes to the node of its key: for commands whose key is not the
first argument, the key is found where it is (else every call would be a MOVED round trip)."""

from __future__ import annotations

from capsvc.redis.cluster import key_of


def test_the_key_of_each_kind_of_command() -> None:
    assert key_of(("GET", "k")) == "k"
    assert key_of(("FCALL", "capsvc_sell", 2, "t:{a}", "p:{a}", "x")) == "t:{a}"
    assert key_of(("FCALL", "capsvc_version", 0)) is None
    assert key_of(("XINFO", "STREAM", "f:{g}")) == "f:{g}"
    assert key_of(("XREAD", "COUNT", 10, "STREAMS", "f:{g}", "0-0")) == "f:{g}"
    assert key_of(("XREAD", "COUNT", 10, "BLOCK", 5, "STREAMS", "f:{g}", "$")) == "f:{g}"
