"""What a Redis that runs out of memory costs the sales, for each maxmemory-policy.

    python bench/eviction.py [--policy allkeys-lru volatile-lru noeviction] [--evictions N]

Runs the scenario of tests/support/eviction.py on each policy: a Redis with `maxmemory
8mb`, six combinations sold to their cap, another client writing keys until Redis has
evicted N keys (2,400 by default) or refuses its writes, the same combinations sold again,
`capsvc journal verify --redis-url` while Redis is full, then every answered sale asked for
again; with `--switched`, Redis starts with noeviction, is switched to the policy after the
first round and back once the keys are deleted, and the combinations are sold a third time.
Prints per policy: whether capsvc was ready, the sales answered accepted, those lost
(the service no longer has them), the combinations whose answered stakes pass the cap, the
answers 503, the keys evicted and verify's exit status and last line. Asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # the repository: tests.support
from tests.support.eviction import eviction_scenario

POLICIES = ("allkeys-lru", "volatile-lru", "noeviction")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", nargs="+", default=list(POLICIES))
    parser.add_argument("--evictions", type=int, default=2400)
    parser.add_argument("--switched", action="store_true",
                        help="start on noeviction, switch to the policy (CONFIG SET) after "
                             "the first round, back once the keys are deleted, sell again")
    args = parser.parse_args()
    for policy in args.policy:
        run = asyncio.run(eviction_scenario(policy, evictions=args.evictions,
                                            switched=args.switched))
        print(run.line(), flush=True)
        said = [line for line in run.verify[1].splitlines() if line.strip()]
        print(f"{'':<14} verify: {said[-1] if said else '(nothing on stderr)'}"
              f"{' [traceback]' if 'Traceback' in run.verify[1] else ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
