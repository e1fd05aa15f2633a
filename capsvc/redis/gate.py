"""The identity gate: no command goes to a Redis this process has not reconciled its
journal with (capsvc.recovery.restore; the transports ask it, capsvc.redis.transport)."""

from __future__ import annotations

from collections.abc import Callable


def identity(info: bytes | str) -> str | None:
    """`run_id/master_replid` from an INFO reply (None: the server does not say)."""
    text = info.decode() if isinstance(info, bytes) else info
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    run_id, replid = fields.get("run_id"), fields.get("master_replid")
    if run_id is None:
        return None
    return f"{run_id.strip()}/{(replid or '').strip()}"


class Gate:
    """The Redis identities this process has reconciled its journal with; what the
    transports ask before sending anything (see the module's docstring)."""

    def __init__(self) -> None:
        self.reconciled: set[str] = set()
        self.restoring = False
        self.epoch = 0
        """Restores begun so far: a request during which it moved answers 503."""
        self.on_unknown: Callable[[str], None] = lambda identity: None

    def admits(self, ident: str | None) -> bool:
        """Whether commands may go to the server of identity `ident` (None: a server that
        does not tell its identity, which cannot be judged)."""
        return ident is None or (not self.restoring and ident in self.reconciled)

    def seen(self, ident: str | None) -> None:
        """A connection reached the server `ident`."""
        if ident is not None and ident not in self.reconciled:
            self.on_unknown(ident)
