"""When a process restores its journal, and how processes on several hosts keep out of one
another's way while they do.

- **Triggers.** The process's start; every connection to a server whose identity the
  process has not reconciled (the gate, capsvc.journal.gate); and a Redis that kept its
  identity but lost its data in place (`FLUSHALL`, a key space swapped): each restore
  leaves the process's field in a marker hash (`j:{journal}`), and a watch reads it every
  WATCH_S — a missing field is a Redis to restore. The same watch keeps an idle process's
  connection in use, so that it notices a restarted or failed-over Redis within WATCH_S
  even when nothing is sold.
- **Several hosts.** Each host restores its own journal. A host that restored first must
  not sell what another host's journal is about to put back: while a process restores, it
  keeps a field in `r:{journal}` (its name, an expiry it refreshes every second), and a
  process that has finished its own restore waits, before selling, until `[journal] settle`
  has passed since the restore began (every live process has noticed the new Redis by then)
  and no other process is restoring. A process that was down when Redis lost its data
  restores when it comes back, after others may have sold: what it puts back then may go
  past the cap; that is counted, logged and alerted (capsvc_journal_restore_over_cap_total).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from pathlib import Path

from capsvc.cluster import connect
from capsvc.config import Settings
from capsvc.games import Catalog
from capsvc.journal.gate import Gate, identity
from capsvc.journal.reader import newest_decisions
from capsvc.journal.recorder import Recorder
from capsvc.journal.restore import Restored, restore_once
from capsvc.journal.restore import identities as _identities
from capsvc.metrics import Metrics
from capsvc.store import Store, lua_source, replies_of, ticket_key

log = logging.getLogger(__name__)

MARKER = "j:{journal}"
"""Hash: journal directory id -> when a process of it last restored (Redis TIME, ms); the
directory's field missing means the data was lost in place (or never restored)."""
DIRECTORY_ID = "journal-id"
"""The file, in the journal directory, naming it (random, made once): its marker field."""
CHECKPOINT = "reconciled.json"
"""The file, in the journal directory, naming the Redis identities it was last reconciled
with: a process starting on one of them, its marker field there, has nothing to restore
(every decision its directory holds was made on that Redis or restored into it)."""
MARKER_TTL_MS = 400 * 86_400_000
RESTORING = "r:{journal}"
"""Hash: process -> expiry (ms, Redis TIME) while that process restores."""
RESTORING_TTL_MS = 5_000
WATCH_S = 0.25
"""The watch's period; `[journal] settle` (1 s by default) should be several of them."""
PEERS_WAIT_S = 120.0
"""How long a process waits for the others' restores before it sells anyway (a process
that died restoring stops refreshing its field: it expires in RESTORING_TTL_MS)."""
RETRY_S = 0.5


class Reconciler:
    """Restores the journal directory into every Redis this process reaches with an
    identity it has not reconciled, on a connection of its own; the gate holds every other
    command meanwhile. See the module's docstring."""

    def __init__(self, settings: Settings, redis_url: str, gate: Gate, catalog: Catalog,
                 metrics: Metrics, proc: str) -> None:
        self.settings = settings
        self.url = redis_url
        self.gate = gate
        self.catalog = catalog
        self.metrics = metrics
        self.proc = proc
        self.task: asyncio.Task[None] | None = None
        self.attempted = asyncio.Event()
        """Set once a restore has been tried (done, or failed: Redis unreachable)."""
        self.dir = Path(settings.journal_dir)
        self.dir_id = directory_id(self.dir)
        gate.on_unknown = self.unknown

    def unknown(self, identity: str) -> None:
        """A connection reached a server not reconciled: restore (once at a time)."""
        if self.task is not None and not self.task.done():
            return
        log.warning("journal: redis %s not reconciled yet: holding sales to restore the "
                    "journal into it", identity)
        self.start()

    def start(self) -> asyncio.Task[None]:
        if self.task is None or self.task.done():
            self.gate.restoring = True
            self.metrics.restoring.set(1)
            self.task = asyncio.get_running_loop().create_task(self._run())
        return self.task

    async def watch(self, store: Store, recorder: Recorder | None = None) -> None:
        """Every WATCH_S, through the process's own connection, three questions; a wrong
        answer is a Redis to restore into:
        - is every primary's identity still one reconciled? (A server can change it without
          a reconnection: `REPLICAOF` a backup, then `REPLICAOF NO ONE`.)
        - is the directory's mark there? (Gone: the data was emptied in place.)
        - does Redis hold the newest decision this process journaled (`recorder.newest`)?
          (Not: Redis went back to an older copy of itself, `DEBUG RELOAD` of an older
          file, a backup put back key by key.)
        The reads also reconnect after a Redis restart or failover, which the gate judges."""
        while True:
            await asyncio.sleep(WATCH_S)
            if self.gate.restoring:
                continue
            try:
                problem = await self._lost(store, recorder)
            except Exception:  # unreachable, or held by the gate: not the watch's to judge
                continue
            if problem is not None and not self.gate.restoring:
                log.warning("journal: %s: holding sales to restore the journal into it",
                            problem)
                self.gate.reconciled.clear()
                self.start()

    async def _lost(self, store: Store, recorder: Recorder | None) -> str | None:
        """Why Redis may have lost decisions of this directory (None: no sign of it)."""
        newest = recorder.newest if recorder is not None else None
        info, present, record = await asyncio.gather(
            store.identities(),
            store.redis.submit("HEXISTS", MARKER, self.dir_id),
            store.ticket(ticket_key(newest[0], newest[1]))
            if newest is not None else _nothing())
        held = None if record is None else record[3]  # Store.ticket: [st, body, sale, sid, …]
        identities = [identity(i) for i in info]
        if any(i is not None and i not in self.gate.reconciled for i in identities):
            return "redis changed identity without a new connection"
        if not present:
            return "redis lost its data in place (the journal directory's mark is gone)"
        if newest is not None and (held is None or held.decode() != newest[2]) and (
                newest[3] > await store.time_ms()):
            return (f"redis lacks the newest decision journaled (ticket {newest[1]}): it went "
                    "back to an older copy of its data")
        return None

    async def _run(self) -> None:
        directory = self.dir
        quiet = False
        while True:
            redis = connect(self.url, timeout_s=max(self.settings.redis_timeout_ms / 1000, 1.0),
                            library=lua_source())
            store = Store.of(redis, self.settings)
            announcing: asyncio.Task[None] | None = None
            try:
                await store.load_library()
                if await self._already_reconciled(store):
                    self.attempted.set()
                    return
                began = await store.time_ms()
                announcing = asyncio.get_running_loop().create_task(self._announce(store))
                done, identities = await restore_once(
                    directory, self.catalog, store, self.metrics.restored_over_cap)
                announcing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await announcing
                await store.redis.submit("HDEL", RESTORING, self.proc)
                await self._wait_for_peers(store, began)
                await store.redis.submit("HSET", MARKER, self.dir_id, await store.time_ms())
                await store.redis.submit("PEXPIRE", MARKER, MARKER_TTL_MS)
                self._checkpoint(identities)
            except Exception as e:  # Redis unreachable, or refusing: try again
                self.attempted.set()
                if not quiet:
                    log.warning("journal: restore into redis failed (%s): retrying", e)
                    quiet = True
                await asyncio.sleep(RETRY_S)
                continue
            finally:
                if announcing is not None:
                    announcing.cancel()
                await redis.aclose()
            self._reconciled(done, identities)
            self.attempted.set()
            return

    async def _already_reconciled(self, store: Store) -> bool:
        """Whether the directory was reconciled with this very Redis and the Redis has kept
        the mark of it: then the gate opens at once (a process restarting on the Redis it
        left does not read its journal again)."""
        try:
            known = json.loads((self.dir / CHECKPOINT).read_text())["identities"]
        except (OSError, ValueError, KeyError, TypeError):
            return False
        identities = await _identities(store)
        if not identities or set(identities) - set(known) or None in identities:
            return False
        if not await store.redis.submit("HEXISTS", MARKER, self.dir_id):
            return False
        # The newest decisions of the directory's files must be there: a Redis put back to
        # an older copy of itself (a backup restored key by key) keeps its identity and the
        # mark, not them.
        now = await store.time_ms()
        newest = [r for r in await asyncio.get_running_loop().run_in_executor(
            None, newest_decisions, self.dir) if r.until > now]
        held = [reply[3] for reply in await replies_of([
            store.ticket(ticket_key(r.channel, r.ticket)) for r in newest])]
        if any(h is None or h.decode() != r.sale for r, h in zip(newest, held, strict=True)):
            log.warning("journal: redis lacks the newest decisions of the journal directory "
                        "(an older copy of its data): restoring in full")
            return False
        self.gate.reconciled.update(i for i in identities if i is not None)
        self.gate.restoring = False
        self.metrics.restoring.set(0)
        log.info("journal: redis already reconciled with the journal directory",
                 extra={"identities": identities})
        return True

    def _checkpoint(self, identities: list[str | None]) -> None:
        """Write down (atomically) the identities the directory is reconciled with."""
        path = self.dir / CHECKPOINT
        tmp = path.with_name(f".{CHECKPOINT}.{os.getpid()}")
        try:
            tmp.write_text(json.dumps({"identities": [i for i in identities if i]}))
            os.replace(tmp, path)
        except OSError as e:  # the next start restores again: slower, not wrong
            log.warning("journal: cannot write %s: %s", path, e)

    def _reconciled(self, done: Restored, identities: list[str | None]) -> None:
        self.gate.reconciled.update(i for i in identities if i is not None)
        self.gate.restoring = False
        self.metrics.restoring.set(0)
        self.metrics.restored_into_redis(done.applied, done.seconds)
        applied = sum(done.applied.values())
        (log.warning if applied else log.info)(
            "journal: redis reconciled with the journal", extra={
                "records": done.records, "put_back": done.applied, "grids": done.grids,
                "over_cap": done.over_cap, "other_sale": done.other_sale,
                "seconds": round(done.seconds, 3)})

    async def _announce(self, store: Store) -> None:
        """Keep this process's field in RESTORING alive while it restores."""
        while True:
            now = await store.time_ms()
            await store.redis.submit("HSET", RESTORING, self.proc, now + RESTORING_TTL_MS)
            await store.redis.submit("PEXPIRE", RESTORING, 10 * RESTORING_TTL_MS)
            await asyncio.sleep(RESTORING_TTL_MS / 5000)

    async def _wait_for_peers(self, store: Store, began: int) -> None:
        """Until `[journal] settle` after `began` (Redis TIME) and no other process
        restoring."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PEERS_WAIT_S
        said = False
        while True:
            now = await store.time_ms()
            wait = began + self.settings.journal_settle_ms - now
            if wait > 0:
                await asyncio.sleep(wait / 1000)
                continue
            fields = await store.redis.submit("HGETALL", RESTORING)
            others = [fields[i].decode() for i in range(0, len(fields), 2)
                      if fields[i].decode() != self.proc and int(fields[i + 1]) > now]
            if not others:
                return
            if loop.time() > deadline:
                log.error("journal: other processes still restoring after %.0f s (%s): "
                          "selling anyway", PEERS_WAIT_S, ", ".join(others))
                return
            if not said:
                log.info("journal: waiting for other processes' restores before selling",
                         extra={"processes": others})
                said = True
            await asyncio.sleep(0.1)


def directory_id(directory: Path) -> str:
    """The journal directory's id (made once, shared by every process writing there)."""
    path = directory / DIRECTORY_ID
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    directory.mkdir(parents=True, exist_ok=True)
    new = os.urandom(8).hex()
    try:
        with open(path, "x") as f:
            f.write(new)
        return new
    except FileExistsError:  # another worker made it first
        return path.read_text().strip()


async def _nothing() -> None:
    return None
