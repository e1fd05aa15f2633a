"""The gate: what a connection's handshake learns of a server decides whether commands may
go to it (the transports ask it before sending anything, capsvc.redis.transport).

Two things are judged, on every new connection, from the replies the handshake awaits
before anything queued goes out:

- **The identity** (`run_id/master_replid`, INFO): no command goes to a Redis this process
  has not reconciled its journal with (capsvc.recovery.restore).
- **The eviction policy** (`CONFIG GET maxmemory-policy`, or the `maxmemory_policy` field
  of `INFO memory` where CONFIG is refused: renamed, disabled, an ACL): a Redis that may
  evict drops counters and tickets without a word — a cap passed, answered sales gone — so
  nothing goes to a node whose policy is not `noeviction` (or cannot be read). The node is
  named in one log line with the fix, the process is not ready, and commands fail with
  `Evicting` (503). Each connection reads the policy again every POLICY_S while it is used,
  so a `CONFIG SET maxmemory-policy` on a running node is seen within that time, either
  way. A node that keeps what it is given again may have evicted meanwhile: `on_kept` is
  told (the process re-applies its whole journal before it sells again).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from capsvc.domain.errors import Unavailable

log = logging.getLogger(__name__)

KEEPS = "noeviction"
"""The one maxmemory-policy capsvc sells on."""
POLICY_S = 1.0
"""How often a connection in use reads its node's maxmemory-policy again (one CONFIG GET
a second per connection, whatever the traffic: none per sale)."""


class Evicting(Unavailable):
    """Commands held: their node may evict what capsvc writes (its maxmemory-policy is not
    noeviction). Nothing was sent."""


def info_field(info: bytes | str, name: str) -> str | None:
    """A field of an INFO reply (None: absent)."""
    text = info.decode() if isinstance(info, bytes) else info
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key == name:
            return value.strip()
    return None


def identity(info: bytes | str) -> str | None:
    """`run_id/master_replid` from an INFO reply (None: the server does not say)."""
    run_id = info_field(info, "run_id")
    if run_id is None:
        return None
    return f"{run_id}/{info_field(info, 'master_replid') or ''}"


def policy_problem(node: str, policy: str | None) -> str | None:
    """The one line that says why capsvc sells nothing on `node` with this maxmemory-policy
    (None: noeviction, nothing to say). `policy` None: the node did not tell it."""
    if policy == KEEPS:
        return None
    fix = ("set `maxmemory-policy noeviction` in its configuration (and `CONFIG SET "
           "maxmemory-policy noeviction` on the running node, or the managed service's "
           "parameter): capsvc serves again on its own")
    if policy is None:
        return (f"redis at {node} does not tell its maxmemory-policy (CONFIG GET and INFO "
                f"memory refused): capsvc sells only on a Redis that cannot evict what it "
                f"wrote, so it is not ready and sells nothing; {fix}")
    return (f"redis at {node} has maxmemory-policy {policy}: it may evict capsvc's counters "
            f"and tickets (a cap passed, answered sales lost), so capsvc is not ready and "
            f"sells nothing; {fix}")


class Gate:
    """The Redis identities this process has reconciled its journal with and the nodes whose
    eviction policy holds their commands; what the transports ask before sending anything
    (see the module's docstring). `reconciles` False: identities are not judged (no
    journal; a command-line tool), only the policy. `logs` False: neither the policy lines
    nor the transport's out-of-memory lines are logged (a command-line tool prints the
    error it gets instead)."""

    def __init__(self, *, reconciles: bool = True, logs: bool = True) -> None:
        self.reconciles = reconciles
        self.logs = logs
        self.reconciled: set[str] = set()
        self.restoring = False
        self.epoch = 0
        """Restores begun so far: a request during which it moved answers 503."""
        self.on_unknown: Callable[[str], None] = lambda identity: None
        self.evicting: dict[str, str] = {}
        """Nodes whose commands are held for their maxmemory-policy: the line saying so."""
        self.on_kept: Callable[[str], None] = lambda node: None
        """A node held for its policy no longer is (noeviction again, or no longer used):
        it may have evicted what it held meanwhile."""
        self.on_evicting: Callable[[int], None] = lambda nodes: None
        """Told the number of nodes held for their policy whenever it changes."""

    def admits(self, ident: str | None, node: str | None = None) -> bool:
        """Whether commands may go to the server of identity `ident` (None: a server that
        does not tell its identity, which cannot be judged) at address `node`."""
        if node is not None and node in self.evicting:
            return False
        return not self.reconciles or ident is None or (
            not self.restoring and ident in self.reconciled)

    def seen(self, ident: str | None) -> None:
        """A connection reached the server `ident`."""
        if self.reconciles and ident is not None and ident not in self.reconciled:
            self.on_unknown(ident)

    def policy(self, node: str, policy: str | None) -> None:
        """A connection read the maxmemory-policy of `node` (None: it could not)."""
        problem = policy_problem(node, policy)
        if problem is None:
            if node in self.evicting:
                del self.evicting[node]
                self.on_evicting(len(self.evicting))
                if self.logs:
                    log.warning("redis at %s has maxmemory-policy noeviction again: capsvc "
                                "serves on it once what it may have evicted is put back",
                                node)
                self.on_kept(node)
            return
        if self.evicting.get(node) != problem:
            self.evicting[node] = problem
            self.on_evicting(len(self.evicting))
            if self.logs:
                log.error("%s", problem)

    def forget(self, node: str) -> None:
        """`node` is no longer used (a failover moved away from it, a cluster dropped it)."""
        if self.evicting.pop(node, None) is not None:
            self.on_evicting(len(self.evicting))
            self.on_kept(node)

    def problem(self, node: str | None) -> str | None:
        """Why commands to `node` are held for its policy (None: they are not)."""
        return None if node is None else self.evicting.get(node)
