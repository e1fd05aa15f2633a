"""Ablation: capsvc at several commits (and the bare handler), alternating in one run.

    python bench/ab.py REV [REV ...] [--workload one-grid|mix|lnm] [--batch N] [--seconds 5]
                       [--rounds 4] [--journal on|off] [--connections 64] [--redis-arg=ARG ...]

Each REV (a commit, a branch, `WORK` for the working tree as it is, or the path of a tree
prepared by hand) is checked out in a worktree of its own under a temporary directory and
served by `python -m capsvc serve` from it, on a redis-server of its own (two revisions may
ship different Lua libraries), with bench/run.py's configuration. Every server runs pinned
to CPU 0 with `PYTHONHASHSEED=0` (the hash seed alone moves a result by a few µs); wrk and
the Redis servers share CPU 1. Round after round, each target is driven in turn (the order
rotated every round), so that a drift of the machine falls on every target alike.

With `--batch N`, the tickets go N a request (POST /v1/ticket-batches, bench/batch.lua) and
every figure but p99 is per ticket (the bare handler's per request of one ticket).

Prints per target the median tickets/s, p99, server CPU per ticket (and the part of it
spent by threads other than the event loop's: the journal's writer), Redis CPU and commands
per ticket, and each ratio to the first REV and to the bare handler (`rnd`: the median of
the ratios round by round, steadier when the machine's speed drifts). A lever is measured by
naming the commit before it and the commit with it; several levers one at a time by naming
a branch per lever made from the same base. Asserts nothing.
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
from tests.support.servers import RedisServer, free_port
from tests.support.service import ServiceProcess

REPO = HERE.parent


@dataclass
class Target:
    label: str
    url: str
    pid: int
    redis: RedisServer | None = None
    runs: list[Result] = field(default_factory=list)
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


def _enter(tree: str) -> None:
    """In the child, before `capsvc serve`: run from the tree, on CPU 0."""
    os.chdir(tree)
    os.sched_setaffinity(0, {0})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("revs", nargs="+")
    parser.add_argument("--workload", choices=list(WORKLOADS), default="one-grid")
    parser.add_argument("--batch", type=int, default=1,
                        help="tickets a request: above 1, POST /v1/ticket-batches")
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--journal", choices=("on", "off"), default="on")
    parser.add_argument("--redis-arg", action="append", default=[],
                        help="an argument for every redis-server, e.g. --redis-arg=--appendonly "
                             "--redis-arg=no")
    args = parser.parse_args()
    if not tools_present():
        return 2
    root = Path(tempfile.mkdtemp(prefix="capsvc-ab-"))
    config = config_file(journal=args.journal == "on")
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    targets: list[Target] = []
    services: list[ServiceProcess] = []
    port = free_port()
    bare = subprocess.Popen(pinned([sys.executable, str(HERE / "bare.py"), str(port)], "0"),
                            env=env)
    try:
        for rev in args.revs:
            tree = checkout(rev, root)
            redis = RedisServer(extra=tuple(args.redis_arg)).start()
            assert redis.process is not None
            subprocess.run(["taskset", "-pc", "1", str(redis.process.pid)], check=True,
                           capture_output=True)
            # `python -m` puts the working directory first on sys.path: the tree's.
            where = str(tree)
            svc = ServiceProcess(config, redis.url, env={**env, "PYTHONPATH": where},
                                 preexec_fn=lambda where=where: _enter(where))
            services.append(svc.start())
            assert svc.process is not None
            label = "/".join(tree.parts[-2:]) if Path(rev).is_dir() else rev
            targets.append(Target(label, svc.base_url, svc.process.pid, redis))
        wait_listening(port)
        targets.append(Target("bare", f"http://127.0.0.1:{port}", bare.pid))
        script, extra, per = WORKLOADS[args.workload], (), 1
        if args.batch > 1:
            script, per = "batch.lua", args.batch
            extra = (str(args.batch), args.workload)
        def load(t: Target) -> tuple[str, tuple[str, ...]]:
            """The bare handler answers one ticket a request, as its ratio is taken."""
            return (script, extra) if t.redis else (WORKLOADS[args.workload], ())

        for t in targets:  # warm-up
            wrk(t.url, 2, args.connections, f"warm-{targets.index(t)}", *load(t)[:1],
                extra=load(t)[1])
        for r in range(args.rounds):
            shift = r % len(targets)
            for t in targets[shift:] + targets[:shift]:
                before = redis_side(t.redis) if t.redis else None
                cpu, threads = cpu_seconds(t.pid), other_threads_cpu_seconds(t.pid)
                res = wrk(t.url, args.seconds, args.connections,
                          f"ab-{r}-{targets.index(t)}", load(t)[0],  # ids: no "/" of a path
                          extra=load(t)[1])
                if t.redis:  # per ticket (the bare handler: per request)
                    res.rps *= per
                    res.requests *= per
                res.server_cpu_us = 1e6 * (cpu_seconds(t.pid) - cpu) / max(res.requests, 1)
                res.threads_cpu_us = 1e6 * (other_threads_cpu_seconds(t.pid) - threads) / max(
                    res.requests, 1)
                if t.redis and before:
                    after = redis_side(t.redis)
                    res.redis = {k: (after[k] - before[k]) / max(res.requests, 1)
                                 for k in after}
                t.runs.append(res)
        for t, svc in zip(targets, services, strict=False):
            t.journal = journal_bytes(svc.journal_dir)
    finally:
        bare.terminate()
        for svc in services:
            svc.stop()
        for t in targets:
            if t.redis:
                t.redis.stop()
        for tree in root.iterdir():
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                           capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
    batch = f", batches of {args.batch}" if args.batch > 1 else ""
    print(f"workload {args.workload}{batch}, journal {args.journal}: wrk -t1 -c{args.connections} "
          f"-d{args.seconds}s, {args.rounds} rounds alternating, medians; servers on CPU 0 "
          "(PYTHONHASHSEED=0), wrk and Redis on CPU 1")
    print(f"{'target':<24} {'tickets/s':>10} {'p99 ms':>7} {'cpu µs/t':>9} {'thr µs/t':>9} "
          f"{'redis µs/t':>11} "
          f"{'fcall µs/t':>11} {'cmds/t':>7} {'errors':>7} {'/ first':>8} {'/ bare':>7} "
          f"{'rnd':>6} {'jrnl B/t':>8}  rounds (tickets/s)")
    first = statistics.median(r.rps for r in targets[0].runs)
    bare_rps = statistics.median(r.rps for r in targets[-1].runs)
    for t in targets:
        rps = statistics.median(r.rps for r in t.runs)
        p99 = statistics.median(r.p99_ms for r in t.runs)
        cpu = statistics.median(r.server_cpu_us for r in t.runs)
        thr = statistics.median(r.threads_cpu_us for r in t.runs)
        rcpu = statistics.median(r.redis.get("cpu", 0.0) for r in t.runs) * 1e6
        cmds = statistics.median(r.redis.get("executed", 0.0) for r in t.runs)
        fcall = statistics.median(r.redis.get("fcall", 0.0) for r in t.runs) * 1e6
        rounds = " ".join(f"{r.rps:.0f}" for r in t.runs)
        # Round by round against the bare handler's run of the same round: steadier than the
        # ratio of medians when the machine's speed drifts during the run.
        by_round = statistics.median(r.rps / b.rps for r, b in zip(t.runs, targets[-1].runs,
                                                                  strict=True))
        print(f"{t.label:<24} {rps:>10.0f} {p99:>7.2f} {cpu:>9.0f} {thr:>9.1f} {rcpu:>11.1f} "
              f"{fcall:>11.1f} "
              f"{cmds:>7.1f} {sum(r.errors for r in t.runs):>7} "
              f"{rps / first:>8.3f} {rps / bare_rps:>7.3f} {by_round:>6.3f} {t.journal:>8.0f}  "
              f"{rounds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
