"""The gate's judgment of a node's maxmemory-policy (capsvc.redis.gate), and how the
transport reads the policy from CONFIG GET's reply or INFO's."""

from __future__ import annotations

import logging

import pytest

from capsvc.redis.gate import Gate, identity, info_field, policy_problem
from capsvc.redis.transport import _policy_of

INFO = (b"# Server\r\nredis_version:7.0.15\r\nrun_id:abc\r\n# Replication\r\n"
        b"master_replid:def\r\n# Memory\r\nmaxmemory:8388608\r\n"
        b"maxmemory_policy:allkeys-lru\r\n")


def test_the_policy_is_read_from_config_get_or_from_info() -> None:
    """CONFIG GET's reply (a list or a RESP3 map) and INFO's memory field give the policy."""
    assert _policy_of([b"maxmemory-policy", b"noeviction"], False) == "noeviction"
    assert _policy_of({b"maxmemory-policy": b"volatile-lru"}, False) == "volatile-lru"
    assert _policy_of([], False) is None
    assert _policy_of(INFO, True) == "allkeys-lru"
    assert _policy_of(b"# Memory\r\n", True) is None
    assert info_field(INFO, "maxmemory") == "8388608"
    assert identity(INFO) == "abc/def"


def test_only_noeviction_is_admitted_and_the_line_names_node_setting_and_fix() -> None:
    """Any policy but noeviction, or none told, has a line naming node, setting and fix."""
    assert policy_problem("h:1", "noeviction") is None
    line = policy_problem("h:1", "allkeys-lru")
    assert line is not None
    assert line.startswith("redis at h:1 has maxmemory-policy allkeys-lru:")
    assert "set `maxmemory-policy noeviction`" in line
    unknown = policy_problem("h:1", None)
    assert unknown is not None
    assert "does not tell its maxmemory-policy" in unknown


def test_a_held_node_is_logged_once_and_released_with_on_kept(
        caplog: pytest.LogCaptureFixture) -> None:
    """Held and logged once; noeviction again or the node left releases it via on_kept."""
    gate = Gate()
    kept: list[str] = []
    gate.on_kept = kept.append
    gate.reconciled.add("id")
    with caplog.at_level(logging.WARNING, logger="capsvc.redis.gate"):
        for _ in range(3):
            gate.policy("h:1", "allkeys-lru")
    assert [r.levelname for r in caplog.records] == ["ERROR"]
    assert not gate.admits("id", "h:1")
    assert gate.admits("id", "h:2")
    gate.policy("h:1", "noeviction")
    assert gate.admits("id", "h:1")
    assert kept == ["h:1"]
    gate.policy("h:1", "volatile-ttl")
    gate.forget("h:1")
    assert kept == ["h:1", "h:1"]
    assert not gate.evicting


def test_a_gate_without_journal_judges_the_policy_only() -> None:
    """Without reconciliation (no journal, a tool) only the policy holds a node."""
    gate = Gate(reconciles=False, logs=False)
    assert gate.admits("never-reconciled", "h:1")
    gate.policy("h:1", "allkeys-random")
    assert not gate.admits("never-reconciled", "h:1")
    assert gate.problem("h:1") == policy_problem("h:1", "allkeys-random")
