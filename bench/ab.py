"""Side by side in one run: capsvc at several commits or settings, and the bare handler.

    python bench/ab.py TARGET [TARGET ...] [--workload one-grid|mix|lnm] [--batch N]
                       [--workers 1|2] [--cluster] [--paced F] [--seconds 5] [--rounds 4]
                       [--connections 64] [--redis-arg=ARG ...]

A TARGET is a tree — a commit, a branch, `WORK` for the working tree as it is, or the path
of a tree prepared by hand — with, after commas, settings of its own: `journal=off`,
`durability=replicas:N` (its Redis then has N replicas), `sale_calls=steps`. Each tree is
checked out in a worktree of its own under a temporary directory and served by `python -m
capsvc serve` from it, on a Redis of its own (two revisions may ship different Lua
libraries; `--cluster`: a local 3-primary Redis Cluster), with bench/run.py's configuration.
Round after round, each target is driven in turn (the order rotated every round), so that
a drift of the machine falls on every target alike.

With one worker (the default) every server runs pinned to CPU 0 with `PYTHONHASHSEED=0`
(the hash seed alone moves a result by a few µs); wrk and the Redis servers share CPU 1.
With `--workers 2` nothing is pinned: the workers, Redis, the journal and wrk share the
cores, as on a host that runs them all. With `--batch N` the tickets go N a request (POST
/v1/ticket-batches, bench/batch.lua), and every figure but the latencies is per ticket (the
bare handler's per request of one ticket). `--paced F`: then one run per capsvc target at F
times its median rate (each connection pausing between requests, exponentially
distributed), its latencies those of a service below saturation. `--connections 4` gives
the latency of a light load.

Prints per target the median tickets/s, p50 and p99, server CPU per ticket (all its
processes; with one worker also the part of it spent by threads other than the event
loop's: the journal's writer), Redis CPU and commands per ticket (all nodes), the journal's
bytes per ticket decided, WAITs per ticket, and each ratio to the first target and to the
bare handler (`rnd`: the median of the ratios round by round, steadier when the machine's
speed drifts). A lever is measured by naming the commit before it and the commit with it;
several levers one at a time by naming a branch per lever made from the same base.
Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import (
    HERE,
    WORKLOADS,
    Result,
    config_file,
    cpu_seconds,
    other_threads_cpu_seconds,
    pinned,
    redis_side,
    tools_present,
    wait_listening,
    wrk,
)

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repository: tests.support
from tests.support.servers import RedisCluster, RedisServer, free_port
from tests.support.service import ServiceProcess

REPO = HERE.parent
SETTINGS = {"journal": ("on", "off"), "durability": None, "sale_calls": ("one", "steps")}


class Redis:
    """A target's Redis: one server (with replicas for `replicas:N`), or a local 3-primary
    cluster; on CPU `cpu` unless None."""

    def __init__(self, cluster: bool, replicas: int, extra: tuple[str, ...],
                 cpu: str | None) -> None:
        self.cluster = RedisCluster().start() if cluster else None
        if self.cluster is not None:
            self.servers = list(self.cluster.servers)
            self.url = self.cluster.url
        else:
            primary = RedisServer(extra=extra).start()
            self.servers = [primary] + [RedisServer(replica_of=primary).start()
                                        for _ in range(replicas)]
            self.url = primary.url
        for server in self.servers:
            assert server.process is not None
            if cpu:
                subprocess.run(["taskset", "-pc", cpu, str(server.process.pid)], check=True,
                               capture_output=True)

    def side(self) -> dict[str, float]:
        """Commands executed, CPU seconds and the like, summed over the nodes selling (not
        the replicas)."""
        serving = self.servers if self.cluster is not None else self.servers[:1]
        sides = [redis_side(server) for server in serving]
        out = {k: sum(side[k] for side in sides) for k in sides[0]}
        stats = serving[0].client().info("commandstats")
        out["waits"] = float(stats.get("cmdstat_wait", {}).get("calls", 0))
        return out

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        else:
            for server in reversed(self.servers):
                server.stop()


@dataclass
class Target:
    label: str
    url: str
    pid: int
    redis: Redis | None = None
    service: ServiceProcess | None = None
    runs: list[Result] = field(default_factory=list)
    paced: Result | None = None
    journal: float = 0.0
    """Bytes of journal a ticket decided (its files ÷ the decisions in them)."""


def journal_bytes(directory: Path) -> float:
    """The journal's bytes on disk a decision journaled, every line counted (checkpoints
    and file headers too)."""
    size = tickets = 0
    for path in directory.glob("capsvc-*.jsonl"):
        data = path.read_bytes()
        size += len(data)
        for line in data.splitlines():
            kind = json.loads(line).get("type") if line.startswith(b"{") else None
            if kind in ("sale", "cancel"):
                tickets += 1
            elif kind == "sales":
                tickets += len(json.loads(line)["sales"])
    return size / max(tickets, 1)


def parse_target(spec: str) -> tuple[str, dict[str, str]]:
    """`REV[,key=value…]`: the tree and its settings."""
    rev, *pairs = spec.split(",")
    settings = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        allowed = SETTINGS.get(key, ())
        if key not in SETTINGS or (allowed is not None and value not in allowed) or (
                key == "durability" and not (value == "default"
                                             or value.startswith("replicas:"))):
            raise SystemExit(f"{spec}: unknown setting {pair!r} (journal=on|off, "
                             "durability=default|replicas:N, sale_calls=one|steps)")
        settings[key] = value
    return rev, settings


def checkout(rev: str, root: Path) -> Path:
    """A worktree of `rev` (the repository itself for WORK), importable as `capsvc` with
    its Lua library in place (the wheel maps lua/ to capsvc.lua; here a link does)."""
    if rev == "WORK":
        return REPO
    if Path(rev).is_dir():  # a tree prepared by hand (e.g. with compiled modules)
        return Path(rev)
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", rev],
                             capture_output=True, text=True, check=True).stdout.strip()
    tree = root / sha
    if not tree.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), sha],
                       capture_output=True, check=True)
    link = tree / "capsvc" / "lua"
    if tree != REPO and not link.exists():
        link.symlink_to(tree / "lua", target_is_directory=True)
    return tree


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and of its children (a master and its workers)."""
    total = cpu_seconds(pid)
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        for child in task.read_text().split():
            total += tree_cpu_seconds(int(child))
    return total


def _enter(tree: str, cpu: str | None) -> None:
    """In the child, before `capsvc serve`: run from the tree (on CPU `cpu`)."""
    os.chdir(tree)
    if cpu is not None:
        os.sched_setaffinity(0, {int(cpu)})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("targets", nargs="+", metavar="TARGET")
    parser.add_argument("--workload", choices=list(WORKLOADS), default="one-grid")
    parser.add_argument("--batch", type=int, default=1,
                        help="tickets a request: above 1, POST /v1/ticket-batches")
    parser.add_argument("--workers", type=int, choices=(1, 2), default=1)
    parser.add_argument("--cluster", action="store_true",
                        help="each target on a local 3-primary Redis Cluster")
    parser.add_argument("--paced", type=float, default=0.0,
                        help="then one run per target at this fraction of its rate")
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--redis-arg", action="append", default=[],
                        help="an argument for every redis-server, e.g. --redis-arg=--appendonly "
                             "--redis-arg=no")
    args = parser.parse_args()
    if not tools_present():
        return 2
    specs = [parse_target(spec) for spec in args.targets]
    one = args.workers == 1
    server_cpu, side_cpu = ("0", "1") if one else (None, None)
    root = Path(tempfile.mkdtemp(prefix="capsvc-ab-"))
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    targets: list[Target] = []
    port = free_port()
    bare_cmd = [sys.executable, str(HERE / "bare.py"), str(port)]
    bare = subprocess.Popen(pinned(bare_cmd, server_cpu) if server_cpu else bare_cmd, env=env)
    try:
        for rev, settings in specs:
            tree = checkout(rev, root)
            durability = settings.get("durability", "default")
            replicas = int(durability.split(":")[1]) if durability != "default" else 0
            redis = Redis(args.cluster, replicas, tuple(args.redis_arg), side_cpu)
            lines = [f'durability = "{durability}"',
                     f'sale_calls = "{settings.get("sale_calls", "one")}"']
            config = config_file(journal=settings.get("journal", "on") == "on",
                                 redis="\n".join(lines))
            # `python -m` puts the working directory first on sys.path: the tree's.
            where = str(tree)
            svc = ServiceProcess(config, redis.url, env={**env, "PYTHONPATH": where},
                                 args=("--workers", str(args.workers)),
                                 preexec_fn=lambda where=where: _enter(where, server_cpu))
            svc.start()
            assert svc.process is not None
            label = ("/".join(tree.parts[-2:]) if Path(rev).is_dir() else rev) + "".join(
                f",{k}={v}" for k, v in settings.items())
            targets.append(Target(label, svc.base_url, svc.process.pid, redis, svc))
        wait_listening(port)
        targets.append(Target("bare", f"http://127.0.0.1:{port}", bare.pid))
        script, extra, per = WORKLOADS[args.workload], (), 1
        if args.batch > 1:
            script, per = "batch.lua", args.batch
            extra = (str(args.batch), args.workload)

        def load(t: Target) -> tuple[str, tuple[str, ...]]:
            """The bare handler answers one ticket a request, as its ratio is taken."""
            return (script, extra) if t.redis else (WORKLOADS[args.workload], ())

        def drive(t: Target, name: str, pause_ms: float = 0.0) -> Result:
            """One wrk run on `t`, its figures per ticket."""
            before = t.redis.side() if t.redis else None
            cpu, threads = tree_cpu_seconds(t.pid), other_threads_cpu_seconds(t.pid)
            res = wrk(t.url, args.seconds, args.connections, name, load(t)[0], pause_ms,
                      extra=load(t)[1], cpu=side_cpu)
            if t.redis:  # per ticket (the bare handler: per request)
                res.rps *= per
                res.requests *= per
            res.server_cpu_us = 1e6 * (tree_cpu_seconds(t.pid) - cpu) / max(res.requests, 1)
            res.threads_cpu_us = 1e6 * (other_threads_cpu_seconds(t.pid) - threads) / max(
                res.requests, 1)
            if t.redis and before:
                after = t.redis.side()
                res.redis = {k: (after[k] - before[k]) / max(res.requests, 1) for k in after}
            return res

        for t in targets:  # warm-up
            wrk(t.url, 2, args.connections, f"warm-{targets.index(t)}", load(t)[0],
                extra=load(t)[1], cpu=side_cpu)
        for r in range(args.rounds):
            shift = r % len(targets)
            for t in targets[shift:] + targets[:shift]:
                # ids: no "/" of a path, none repeated
                t.runs.append(drive(t, f"ab-{r}-{targets.index(t)}"))
        if args.paced:
            for t in targets[:-1]:
                requests = statistics.median(res.rps for res in t.runs) / per
                # A connection's cycle is its answer's latency plus its pause; the latency
                # at the paced rate is unknown until measured: one run, then one corrected.
                pause_ms = 1000 * args.connections / (args.paced * requests)
                for attempt in range(2):
                    t.paced = drive(t, f"paced-{attempt}-{targets.index(t)}", pause_ms)
                    pause_ms = max(0.0, pause_ms * t.paced.rps / per / (args.paced * requests))
        for t in targets:
            if t.service is not None:
                t.journal = journal_bytes(t.service.journal_dir)
    finally:
        bare.terminate()
        for t in targets:
            if t.service is not None:
                t.service.stop()
            if t.redis:
                t.redis.stop()
        for tree in root.iterdir():
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                           capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
    report(args, targets)
    return 0


def report(args: argparse.Namespace, targets: list[Target]) -> None:
    batch = f", batches of {args.batch}" if args.batch > 1 else ""
    where = ("servers on CPU 0 (PYTHONHASHSEED=0), wrk and Redis on CPU 1"
             if args.workers == 1 else "nothing pinned: the workers, Redis, the journal and "
             "wrk share the cores")
    print(f"workload {args.workload}{batch}, {args.workers} worker(s), "
          f"{'a 3-primary Redis Cluster' if args.cluster else 'one Redis'}: wrk -t1 "
          f"-c{args.connections} -d{args.seconds}s, {args.rounds} rounds alternating, "
          f"medians; {where}")
    print(f"{'target':<28} {'tickets/s':>10} {'p50 ms':>7} {'p99 ms':>7} {'cpu µs/t':>9} "
          f"{'thr µs/t':>9} {'redis µs/t':>11} {'fcall µs/t':>11} {'cmds/t':>7} "
          f"{'WAIT/t':>7} {'errors':>7} {'/ first':>8} {'/ bare':>7} {'rnd':>6} "
          f"{'jrnl B/t':>8}  rounds (tickets/s)")
    first = statistics.median(r.rps for r in targets[0].runs)
    bare_rps = statistics.median(r.rps for r in targets[-1].runs)
    for t in targets:
        def med(value: object, runs: list[Result] = t.runs) -> float:
            return float(statistics.median(value(r) for r in runs))  # type: ignore[operator]

        rps = med(lambda r: r.rps)
        rounds = " ".join(f"{r.rps:.0f}" for r in t.runs)
        # Round by round against the bare handler's run of the same round: steadier than the
        # ratio of medians when the machine's speed drifts during the run.
        by_round = statistics.median(r.rps / b.rps for r, b in zip(t.runs, targets[-1].runs,
                                                                  strict=True))
        thr = med(lambda r: r.threads_cpu_us) if args.workers == 1 else float("nan")
        print(f"{t.label:<28} {rps:>10.0f} {med(lambda r: r.p50_ms):>7.2f} "
              f"{med(lambda r: r.p99_ms):>7.2f} {med(lambda r: r.server_cpu_us):>9.0f} "
              f"{thr:>9.1f} {med(lambda r: r.redis.get('cpu', 0.0)) * 1e6:>11.1f} "
              f"{med(lambda r: r.redis.get('fcall', 0.0)) * 1e6:>11.1f} "
              f"{med(lambda r: r.redis.get('executed', 0.0)):>7.1f} "
              f"{med(lambda r: r.redis.get('waits', 0.0)):>7.3f} "
              f"{sum(r.errors for r in t.runs):>7} {rps / first:>8.3f} {rps / bare_rps:>7.3f} "
              f"{by_round:>6.3f} {t.journal:>8.0f}  {rounds}")
    paced = [t for t in targets if t.paced is not None]
    if paced:
        print(f"paced to {args.paced:.0%} of each target's rate (one run):")
        for t in paced:
            assert t.paced is not None
            peak = statistics.median(r.rps for r in t.runs)
            print(f"{t.label:<28} {t.paced.rps:>10.0f} tickets/s ({t.paced.rps / peak:4.0%} of "
                  f"its peak), p50 {t.paced.p50_ms:.2f} ms, p99 {t.paced.p99_ms:.2f} ms")


if __name__ == "__main__":
    sys.exit(main())
