"""When a process puts its journal back into Redis, and how processes on several hosts keep
out of one another's way while they do.

- **Triggers.** The process's start; a connection to a server whose identity the process
  has not reconciled (the gate, capsvc.redis.gate: a failover, a restart); a marked call
  that Redis refused because its mark is behind what the process saw (capsvc.redis.marks: a
  rollback in place, an emptied Redis, a backup put back); and the watch, which reads the
  one mark of a standalone Redis, or every cluster primary's count, every WATCH_S (and the
  marks of the cluster's slots the directory wrote through every WATCH_CLUSTER_S) on the
  process's own connection, so that an idle process notices as soon as one that sells, and
  a primary whose slots it never used is judged against what it saw there all the same.
- **A node that may have evicted.** A node the gate held for its maxmemory-policy
  (capsvc.redis.gate) that keeps what it is given again, or is left: it may have evicted
  any key, marks included, so the marks cannot tell what it lacks. The whole journal
  directory is re-applied (what the Redis has is found there and left), as for a backup
  of unknown origin.
- **What is restored.** For this process's lifetime and every lifetime of the journal
  directory whose process is gone (the lifetimes before it; a worker that died), the records
  the Redis lacks: those stamped above the lifetime's field in the mark
  (capsvc.journal.lives). A lifetime whose process still runs (another worker of the
  directory: its lock is held, capsvc.journal.writer.alive) restores its own, and this
  process judges nothing until it has: what its files stamp, read after the loss, is what
  Redis must hold of it (`_peers_behind`), however long it takes. A Redis that lost
  nothing costs a read of the marks; a failover that lost the last seconds, the read of the
  files' ends; an emptied Redis, a full restore. Then each lifetime's field is raised to
  what it had written, never lowered.
- **Several processes.** A process that restores announces it on every node (the one mark,
  or every primary's count; lua/capsvc.lua, MARKS): every marked call of every process is
  refused meanwhile. It
  keeps announcing until `[journal] settle` has passed since its restore began — every live
  process has looked at the marks by then (WATCH_S) and announced its own restore if it
  lost anything — and, like any process that found Redis behind it, sells again only once
  no announcement is left. Meanwhile it looks at the marks as its watch would: Redis that
  went back again and lost what it put back makes it restore again at once (announcing
  first), not once the others' announcements have ended. So a live process may judge on a
  node that lost another live process's decisions only if those were made after this
  process last saw the node's mark or count (its own calls there and its watch, which reads
  every primary's: at most WATCH_S before the loss when idle), and only until the process
  that lost them has looked (WATCH_S after the loss at most; WATCH_CLUSTER_S for a slot's
  mark) and announced. A process that starts has
  seen nothing: it waits `[journal] settle` and for announcements to end before it sells,
  as a restore does, so that a peer whose announcement Redis lost (going back again during
  its restore) has renewed it by then. That time bound is for other hosts' processes; the
  workers of one directory wait for each other's fields instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from redis.exceptions import ResponseError

from capsvc.config import Settings
from capsvc.domain.games import Catalog
from capsvc.journal.lives import Life, covered, lacking, lives_of, made_by
from capsvc.journal.recorder import Recorder
from capsvc.journal.writer import alive
from capsvc.ops.metrics import Metrics
from capsvc.recovery.restore import RESTORE_TIMEOUT_S, Restored, Restorer, identities
from capsvc.redis.cluster import connect
from capsvc.redis.gate import Gate
from capsvc.redis.marks import NODE_MARK, Marks
from capsvc.redis.replies import MarkState
from capsvc.redis.store import Store, lua_source

log = logging.getLogger(__name__)

WATCH_S = 0.05
"""The watch's period: a read of the one mark of a standalone Redis, or of every cluster
primary's count."""
WATCH_CLUSTER_S = 1.0
"""How often the watch reads, on a cluster, every slot's mark the directory wrote through."""
CHECKPOINT_S = 1.0
"""How often the process writes down, in its journal, what it has written through each
mark (capsvc.journal.records.Checkpoint), when that moved: how far back a restore reads."""
KEEP_S = 3600.0
"""How often the watch pushes the marks' TTL on, notes this lifetime alive in them, clears
announcements past their end and the fields of lifetimes long gone (capsvc_mark_keep)."""
ANNOUNCE_MS = 5000
"""How long an announcement holds unless renewed (renewed every ANNOUNCE_MS / 5) or ended
(a restore that is done ends its own at once): how long a process that died restoring, or
whose restore failed, still holds the others, and how long a restoring process may stall
(descheduled, stopped, paused by its host) before the others judge without it. Long, since
a restore that is done ends its own at once: a stall of a fraction of a second must not let
another process sell on a Redis that still lacks this one's decisions, and a worker killed
while restoring is started again and announces its own restore within about 2 s."""
PEERS_WAIT_S = 120.0
"""How long a process waits for the others' announcements to end before it sells anyway
(a process that died restoring stops renewing its own: it ends within ANNOUNCE_MS)."""
PEERS_POLL_S = 0.05
"""How often a process waiting for the others' announcements to end reads them."""
RETRY_S = 0.2
"""The pause before a failed restore is tried again: shorter than ANNOUNCE_MS, so that an
announcement the failed attempt made still holds when the next one renews it."""


class Reconciler:
    """Restores the journal directory into the Redis this process uses whenever that Redis
    may lack decisions of it, on a connection of its own, while the gate holds every other
    command. See the module's docstring."""

    def __init__(self, settings: Settings, redis_url: str, gate: Gate, catalog: Catalog,
                 metrics: Metrics, marks: Marks, recorder: Recorder) -> None:
        self.settings = settings
        self.url = redis_url
        self.gate = gate
        self.catalog = catalog
        self.metrics = metrics
        self.marks = marks
        self.recorder = recorder
        self.dir = Path(settings.journal_dir)
        self.life = marks.life
        self.task: asyncio.Task[None] | None = None
        self.attempted = asyncio.Event()
        """Set once a restore has been tried (done, or failed: Redis unreachable)."""
        self.others: dict[str, dict[str, int]] = {}
        """What each other lifetime of the directory had written through each mark, as its
        files told the last restore (the watch checks their fields too)."""
        self._made_cache: dict[tuple[Path, int, float], dict[str, int]] = {}
        self._announced = False
        """Whether the last attempt at a restore announced it."""
        self._fresh = True
        """No restore has ended yet: this process has seen nothing of the marks before."""
        self._full = 0
        """Whole re-applications asked for (a node may have evicted), and done:"""
        self._full_done = 0
        gate.on_unknown = self.unknown
        gate.on_kept = self.kept
        marks.on_behind = self.behind

    def unknown(self, identity: str) -> None:
        """A connection reached a server not reconciled: restore (once at a time)."""
        self.trouble(f"redis {identity} not reconciled with the journal yet")

    def kept(self, node: str) -> None:
        """A node held for its eviction policy no longer is: it may have evicted anything
        meanwhile, marks included."""
        self._full += 1
        self.trouble(f"redis at {node} may have evicted keys while its maxmemory-policy was "
                     "not noeviction: re-applying the whole journal")

    def behind(self, mark: str, found: str) -> None:
        """A marked call was refused: Redis is behind what this process saw of `mark`."""
        self.trouble(f"redis is behind what this process saw of {mark} (it holds {found}): "
                     "it lost writes")

    def trouble(self, why: str) -> None:
        if self.task is not None and not self.task.done():
            return
        log.warning("journal: %s: holding sales to restore the journal into it", why)
        self.start()

    def start(self) -> asyncio.Task[None]:
        if self.task is None or self.task.done():
            self.gate.restoring = True
            self.gate.epoch += 1
            self.metrics.restoring.set(1)
            self.task = asyncio.get_running_loop().create_task(self._run())
        return self.task

    # -- the watch -------------------------------------------------------------------------

    async def watch(self, store: Store) -> None:
        """Every WATCH_S, on the process's own connection: is any mark behind what this
        process saw, or behind what another lifetime of the directory wrote — on a cluster,
        every primary's count each time, the marks of the slots the directory wrote through
        every WATCH_CLUSTER_S? Then restore. Also: the checkpoint in the journal, once a
        second; the marks' TTL, once an hour. The reads also reconnect after a Redis
        restart or failover, which the gate judges."""
        loop = asyncio.get_running_loop()
        checkpointed = loop.time()
        kept = checkpointed - KEEP_S  # at once: the lifetime noted alive from its start
        looked = checkpointed
        while True:
            await asyncio.sleep(WATCH_S)
            now = loop.time()
            if now - checkpointed >= CHECKPOINT_S:
                checkpointed = now
                self.recorder.checkpoint(self.marks.made)
            if self.gate.restoring:
                continue
            slots = store.single_node or now - looked >= WATCH_CLUSTER_S
            try:
                problem = await self._look(store, slots)
                if slots:
                    looked = now
                if problem is None and now - kept >= KEEP_S:
                    kept = now
                    for mark in sorted({*self._marks(store), *await store.nodes()}):
                        await store.mark_call("capsvc_mark_keep", mark, [self.life])
            except Exception:  # unreachable, or held by the gate: not the watch's to judge
                continue
            if problem is not None:
                self.trouble(problem)

    def _marks(self, store: Store) -> list[str]:
        if store.single_node:
            return [NODE_MARK]
        keys = set(self.marks.seen)
        for made in self.others.values():
            keys.update(made)
        return sorted(keys)

    async def _look(self, store: Store, slots: bool = True) -> str | None:
        """Why Redis may lack decisions of this directory (None: no sign of it). `slots`:
        the marks too, not only the cluster's primaries' counts."""
        lives = [self.life, *self.others]
        nodes = [] if store.single_node else await store.nodes()
        marks = self._marks(store) if slots else []
        # What the process saw of the marks when the reads were sent: they travel behind
        # every call sent before them on the connection, not behind the ones sent after
        # (whose replies may be read before this coroutine resumes).
        seen, made = dict(self.marks.seen), dict(self.marks.made)
        node_seen = dict(self.marks.node_seen)
        node_states, states = await _read_marks(store, nodes, marks, lives)
        # A node that does not answer hides nothing of the others: every read that came
        # back is judged, and only then is the failure raised (the watch looks again).
        failed = next((s for s in node_states if isinstance(s, BaseException)), None)
        for node, state in zip(nodes, node_states, strict=True):
            if isinstance(state, BaseException):
                continue
            if state.g < node_seen.get(node, 0):
                return f"redis went back in time on {node} ({state.g} < {node_seen[node]})"
            self.marks.saw_node(node, state.g)
        if isinstance(states, BaseException):
            raise states
        if failed is not None:
            raise failed
        for mark, state in zip(marks, states, strict=True):
            g, fields = state.g, state.lives
            if g < seen.get(mark, 0):
                return f"redis went back in time on {mark} ({g} < {seen[mark]})"
            if fields[0] < made.get(mark, 0):
                return f"redis lost writes of this process on {mark}"
            for life, field in zip(lives[1:], fields[1:], strict=True):
                if field < self.others[life].get(mark, 0):
                    return f"redis lost writes of the journal's lifetime {life} on {mark}"
            self.marks.saw(mark, g)
        return None

    # -- the restore -----------------------------------------------------------------------

    async def _run(self) -> None:
        quiet = False
        announced = False
        """Whether the attempt before announced: the next one announces at once, before
        anything else, so that no other process judges between the two."""
        while True:
            redis = connect(self.url, timeout_s=max(self.settings.redis_timeout_ms / 1000,
                                                    RESTORE_TIMEOUT_S),
                            library=lua_source())
            store = Store(redis)
            full = self._full
            try:
                # The library is loaded by the transport if Redis lacks it (a first call
                # answered "Function not found"): no FUNCTION LOAD ahead of the announcement.
                done, held = await self._reconcile(store, announced, full > self._full_done)
            except WentBack as e:
                log.warning("journal: %s: restoring again", e)
                announced = True
                continue
            except Exception as e:  # Redis unreachable, or refusing: try again
                announced = announced or self._announced
                self.attempted.set()
                if not quiet:
                    log.warning("journal: restore into redis failed (%s): retrying", e)
                    quiet = True
                await asyncio.sleep(RETRY_S)
                continue
            finally:
                await redis.aclose()
            self._full_done = full
            if self._full > full:  # a node left eviction behind during this restore: again
                continue
            self._reconciled(done, held)
            self.attempted.set()
            return

    async def _reconcile(self, store: Store, announce: bool = False, full: bool = False
                         ) -> tuple[Restored | None, list[str | None]]:
        """Put back what Redis lacks of this lifetime and of the directory's lifetimes gone;
        what was done (None: nothing was lacking) and the identities of the Redis it was
        done on. `announce`: announce at once (an attempt before did). `full`: re-apply the
        whole directory, whatever the marks say (a node may have evicted)."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        # The announcement goes to every node (a cluster's primaries' counts): every call of
        # every process, on whatever slot, is refused while it holds.
        own = self._marks(store)
        nodes = [] if store.single_node else await store.nodes()
        mine = dict(self.marks.made)
        # Every mark read at once (one call a node), not one round trip a mark: a process
        # that wrote through thousands of a cluster's slots held its sales ~10 s a read.
        first = dict(zip([*own, *nodes],
                         await store.mark_states([*own, *nodes], [self.life]), strict=True))
        went_back = (any(first[m].g < self.marks.seen.get(m, 0) for m in own)
                     or any(first[n].g < self.marks.node_seen.get(n, 0) for n in nodes))
        announcer = _Announcer(store, self.life, await store.nodes())
        # Each write of the restore counts itself in its mark, which its end checks: Redis
        # going back to a snapshot taken while it ran (its token there, not all it wrote
        # after) is caught, as a loss before it began is by the token.
        store.marks = Marks.restoring(announcer.token, store.single_node)
        try:
            if announce or not covered(mine, {m: first[m].lives[0] for m in own}):
                # Its own writes lost (or an attempt before announced): announced at once,
                # before the journal is read, so that other processes stop judging as soon
                # as possible.
                await announcer.begin(own)
            held = await identities(store)
            now = await store.time_ms()
            restorer = Restorer(self.dir, self.catalog, store, self.metrics.restored_over_cap)
            since = restorer.oldest_useful(now)
            lives = await loop.run_in_executor(None, lambda: lives_of(self.dir,
                                                                      modified_since=since))
            # Another process that still runs (a worker of the same directory) restores its
            # own: nobody else raises its field, or a request of its own, answered once its
            # record is written, could find its writes lost and its field raised over them.
            living = {life: await loop.run_in_executor(None, alive, self.dir, life)
                      for life in lives if life != self.life}
            gone = [life for life, running in living.items() if not running]
            made = {life: await loop.run_in_executor(None, self._made_by, lives[life])
                    for life in gone}
            self.others = made
            # What each live worker of the directory had journaled, read after the loss:
            # answered, so Redis held it; where Redis lacks it now, that worker restores it
            # and this process judges nothing until it has (whatever the time it takes).
            peers = {life: await loop.run_in_executor(None, self._made_by, lives[life])
                     for life, running in living.items() if running}
            made = {**made, self.life: mine}
            marks = self._marks(store)
            names = list(made)
            state = dict(zip(marks, await store.mark_states(marks, names), strict=True))
            fields = {life: {mark: state[mark].lives[i] for mark in marks}
                      for i, life in enumerate(names)}
            floor = {mark: state[mark].g for mark in marks}
            """G as this restore leaves each mark: never lower unless Redis went back."""
            for node in nodes:
                floor[node] = first[node].g
            for mark in marks:  # what the process has seen of the marks from now on
                self.marks.saw(mark, floor[mark])
            lacking_lives = (names if full else
                             [life for life in names if not covered(made[life], fields[life])])
            done: Restored | None = None
            if lacking_lives:
                await announcer.begin(marks)
                if full or all(not any(fields[life].values()) for life in lacking_lives):
                    # Redis has no mark of any of them (emptied, or never reconciled), or
                    # may have evicted anything: the whole directory, read and planned
                    # apart from the event loop.
                    done = await restorer.run()
                else:
                    done = Restored()
                    for life in lacking_lives:
                        life_of = lives.get(life, Life(life, []))
                        done.merge(await restorer.restore(lacking(life_of, fields[life],
                                                                  now)))
                counter, written = store.marks.counter, store.marks.written
                restored: dict[str, list[Any]] = {
                    mark: [self.life, "", counter, written[mark]]
                    for mark in sorted(set(written) - set(marks))}  # not announced there
                for mark in marks:
                    args: list[Any] = [self.life, announcer.token, counter,
                                       written.get(mark, 0)]
                    for life in lacking_lives:
                        if made[life].get(mark):
                            args += [life, made[life][mark]]
                    if self.marks.sent.get(mark):  # the number of its newest write sent there
                        args += [f"#{self.life}", self.marks.sent[mark]]
                    restored[mark] = args
                gs = await asyncio.gather(*[self._mark_restored(store, mark, args)
                                            for mark, args in restored.items()])
                floor.update((mark, g) for mark, g in zip(restored, gs, strict=True)
                             if mark in floor)
            behind = await self._peers_behind(store, peers)
            if lacking_lives or went_back or announcer.marks or self._fresh or behind:
                # Every live process has looked at the marks by then (its watch), and
                # announced its own restore if it lost anything; then none is left. A
                # process that starts waits so too: it knows nothing of the others, and
                # one restoring may have had its announcement lost with the rest (Redis
                # going back again) and not have renewed it yet. Meanwhile it looks, as its
                # watch would, whether Redis lost again what it put back: then it runs
                # again at once, announcing at once, before another process judges on it.
                def still() -> Awaitable[dict[str, int]]:
                    return self._still(store, marks, names, floor, made, nodes)

                settled = began + self.settings.journal_settle_ms / 1000
                while (left := settled - loop.time()) > 0:
                    await asyncio.sleep(min(WATCH_S, left))
                    await still()
                await announcer.release()
                await self._wait_for_peers(store, sorted({*marks, *announcer.everywhere}),
                                           still, WATCH_S, peers)
                # What was seen beyond G was lost by other processes, which have put back
                # what they answered: G goes on from what is read here.
                for key, g in (await still()).items():
                    if key in nodes:
                        self.marks.node_seen[key] = g
                    else:
                        self.marks.seen[key] = max(g, self.marks.made.get(key, 0))
            return done, held
        finally:
            self._announced = bool(announcer.marks)
            await announcer.end()

    @staticmethod
    async def _mark_restored(store: Store, mark: str, args: list[Any]) -> int:
        """capsvc_mark_restored; WentBack when Redis went back in time again while the
        restore ran (LOST): then it runs again, from the start, at once."""
        try:
            return _g(await store.mark_call("capsvc_mark_restored", mark, args))
        except ResponseError as e:
            if str(e).startswith("LOST"):
                raise WentBack(f"redis went back in time again on {mark} while the journal "
                               "was put back") from e
            raise

    def _made_by(self, life: Life) -> dict[str, int]:
        """made_by, remembered while the lifetime's newest file does not change."""
        newest = life.files[-1]
        try:
            st = newest.stat()
        except FileNotFoundError:
            return made_by(life)
        key = (newest, st.st_size, st.st_mtime)
        cached = self._made_cache.get(key)
        if cached is None:
            cached = self._made_cache[key] = made_by(life)
        return cached

    @staticmethod
    async def _still(store: Store, marks: list[str], names: list[str], floor: dict[str, int],
                    made: dict[str, dict[str, int]], nodes: list[str]) -> dict[str, int]:
        """The G of each of `marks` and the N of each of `nodes`, each raised into `floor`;
        WentBack when Redis lost what the restore put back, or writes made since (lower
        than it was read before: other processes' writes and restores raise them, never
        lower them)."""
        gs = {}
        node_states, states = await _read_marks(store, nodes, marks, names)
        for state in (*node_states, states):
            if isinstance(state, BaseException):
                raise state
        for node, state in zip(nodes, node_states, strict=True):
            assert not isinstance(state, BaseException)
            if state.g < floor[node]:
                raise WentBack(f"redis went back in time again on {node} while the journal "
                               "was put back")
            gs[node] = floor[node] = state.g
        assert not isinstance(states, BaseException)
        for mark, state in zip(marks, states, strict=True):
            if state.g < floor[mark] or any(state.lives[i] < made[life].get(mark, 0)
                                            for i, life in enumerate(names)):
                raise WentBack(f"redis went back in time again on {mark} while the journal "
                               "was put back")
            gs[mark] = floor[mark] = state.g
        return gs

    async def _wait_for_peers(self, store: Store, marks: list[str],
                              still: Callable[[], Awaitable[object]], period: float,
                              peers: dict[str, dict[str, int]]) -> None:
        """Until no process announces a restore any more and Redis holds what each live
        worker of the directory had journaled (`peers`; PEERS_WAIT_S at most), `still()`
        every `period` meanwhile. A worker that died meanwhile without putting back what it
        had journaled: WentBack (the restore runs again, and puts it back itself)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PEERS_WAIT_S
        looked = loop.time()
        said = False
        while True:
            now = await store.time_ms()
            ends = [state.announced_until for state in await store.mark_states(marks, [])]
            behind = await self._peers_behind(store, peers)
            for life in behind:
                if not await loop.run_in_executor(None, alive, self.dir, life):
                    raise WentBack(f"the journal's lifetime {life} ended before it put back "
                                   "what Redis lacks of it")
            if all(end <= now for end in ends) and not behind:
                return
            if loop.time() > deadline:
                log.error("journal: other processes still restoring, or workers of the "
                          "journal directory not having put back what redis lost of theirs "
                          "(%s), after %.0f s: selling anyway", ", ".join(behind) or "none",
                          PEERS_WAIT_S)
                return
            if not said:
                log.info("journal: waiting for other processes' restores before selling")
                said = True
            await asyncio.sleep(PEERS_POLL_S)
            if loop.time() - looked >= period:
                await still()
                looked = loop.time()

    @staticmethod
    async def _peers_behind(store: Store, peers: dict[str, dict[str, int]]) -> list[str]:
        """The live workers of `peers` (lifetime: what it had journaled through each mark)
        whose field in a mark is below what it had journaled there: Redis lost their
        writes, and they have not put them back yet."""
        behind = []
        for life, made in peers.items():
            marks = sorted(made)
            states = await asyncio.gather(*[store.mark_state(mark, [life]) for mark in marks])
            if not covered(made, {m: s.lives[0] for m, s in zip(marks, states, strict=True)}):
                behind.append(life)
        return behind

    def _reconciled(self, done: Restored | None, held: list[str | None]) -> None:
        self._fresh = False
        self.gate.reconciled.update(i for i in held if i is not None)
        self.gate.restoring = False
        self.metrics.restoring.set(0)
        if done is None:
            log.info("journal: redis reconciled with the journal: it holds every decision of "
                     "the directory", extra={"identities": held})
            return
        self.metrics.restored_into_redis(done.applied, done.seconds)
        log.warning("journal: redis reconciled with the journal", extra={
            "records": done.records, "put_back": done.applied, "grids": done.grids,
            "over_cap": done.over_cap, "other_sale": done.other_sale,
            "seconds": round(done.seconds, 3)})


class WentBack(Exception):
    """Redis lost, while a restore waited for the other processes, what the restore had put
    back: it runs again."""


class _Announcer:
    """A restore's announcement in the marks (lua/capsvc.lua, MARKS): begun with a token of
    its own (which capsvc_mark_restored checks), renewed every ANNOUNCE_MS / 5 until ended
    (`end`: stopped renewing, it runs out; `release`: ended at once)."""

    def __init__(self, store: Store, life: str, everywhere: list[str]) -> None:
        self.store = store
        self.life = life
        self.everywhere = everywhere
        """Where it is announced whatever is restored: every node (on a cluster, every
        primary's count)."""
        self.token = os.urandom(8).hex()
        self.marks: list[str] = []
        self._renewing: asyncio.Task[None] | None = None

    async def begin(self, marks: list[str]) -> None:
        """Announce on `marks` too (at once on every node first: what every call checks on
        a cluster), all in one round trip, not one a mark: a process restoring thousands of
        slots' records announces in milliseconds."""
        for group in (self.everywhere, sorted(set(marks))):
            new = [m for m in group if m not in self.marks]
            await asyncio.gather(*[self.store.mark_call(
                "capsvc_announce", mark, [ANNOUNCE_MS, self.life, self.token])
                for mark in new])
            self.marks += new
        if self._renewing is None:
            self._renewing = asyncio.get_running_loop().create_task(self._renew())

    async def _renew(self) -> None:
        """Every ANNOUNCE_MS / 5, every mark at once (a renewal that fails is tried again
        at the next: the restore itself fails on a Redis that does not answer)."""
        while True:
            await asyncio.sleep(ANNOUNCE_MS / 5000)
            await asyncio.gather(*[self.store.mark_call(
                "capsvc_announce", mark, [ANNOUNCE_MS, self.life]) for mark in self.marks],
                return_exceptions=True)

    async def end(self) -> None:
        """Stop renewing (the announcement ends within ANNOUNCE_MS): a restore that failed,
        whose next attempt renews it before it ends (RETRY_S)."""
        if self._renewing is not None:
            self._renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewing
            self._renewing = None

    async def release(self) -> None:
        """The restore is done: its announcement ended at once (capsvc_announce_end; the
        others' hold on). A renewal still in flight goes out first, on the same
        connection."""
        await self.end()
        await asyncio.gather(*[self.store.mark_call("capsvc_announce_end", mark, [self.life])
                               for mark in self.marks])


def _g(value: Any) -> int:
    return int(value) if value else 0


async def _read_marks(store: Store, nodes: list[str], marks: list[str], lives: list[str]
                      ) -> tuple[list[MarkState | BaseException],
                                 list[MarkState] | BaseException]:
    """Every primary's count of `nodes` (each its own state, or why it could not be read)
    and each of `marks` with the G of `lives` (or why they could not all be read), the reads
    sent at once (behind every call sent before, ahead of every call sent after)."""
    node_reads = asyncio.gather(*[store.mark_state(node, []) for node in nodes],
                                return_exceptions=True)
    mark_reads = store.mark_states(marks, lives)
    (counts, states) = await asyncio.gather(node_reads, mark_reads, return_exceptions=True)
    assert not isinstance(counts, BaseException)  # its own failures are its items
    return counts, states
