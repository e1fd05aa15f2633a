"""What a Redis Cluster's events cost the sales: a reshard, a slot that loses its writes.

    python bench/cluster_events.py [--event reshard lost] [--slots 3000] [--sellers 4]
                                   [--batch 16] [--before 3] [--after 5]

On a local 3-primary cluster, one `capsvc serve` worker (bench/run.py's configuration),
`--sellers` threads each posting batches of `--batch` one-grid tickets without pause.
After `--before` seconds the event happens:
- reshard: `redis-cli --cluster reshard` moves `--slots` slots from the first primary to
  the second (slots then keys move while the sales run);
- lost: the slot of the first pending index loses its writes — its mark deleted, as a
  primary that came back without them would have it — which the process reads as a loss
  and restores its journal for (every sale held meanwhile).
Prints, before, during and after the event (`--after` seconds past its end), the tickets
answered 200 and 503 a second, and the longest time no ticket was answered 200 after the
event began; then the restores the service logged. Asserts nothing.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from run import TOKEN, config_file, wait_listening

sys.path.append(str(Path(__file__).resolve().parents[1]))
from redis.crc import key_slot

from capsvc.redis.marks import mark_of_slot
from capsvc.redis.store import pending_key
from tests.support.servers import RedisCluster, cli_binary, free_port


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--event", nargs="+", choices=("reshard", "lost"),
                        default=["reshard", "lost"])
    parser.add_argument("--slots", type=int, default=3000)
    parser.add_argument("--sellers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--before", type=float, default=3.0)
    parser.add_argument("--after", type=float, default=5.0)
    args = parser.parse_args()
    for event in args.event:
        run(event, args)
    return 0


def run(event: str, args: argparse.Namespace) -> None:
    cluster = RedisCluster().start()
    config = config_file(redis=f'url = "{cluster.url}"')
    log = Path(config).with_name("service.log")
    port = free_port()
    service = subprocess.Popen(
        [sys.executable, "-m", "capsvc", "serve", "--config", config, "--port", str(port)],
        stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        wait_listening(port)
        answers: list[tuple[float, int]] = []  # (instant, status) a ticket
        stop = threading.Event()
        sellers = [threading.Thread(target=sell, args=(port, k, args.batch, stop, answers))
                   for k in range(args.sellers)]
        for t in sellers:
            t.start()
        time.sleep(args.before)
        began = time.time()
        if event == "reshard":
            ids = [s.client().execute_command("CLUSTER", "MYID").decode()
                   for s in cluster.servers]
            subprocess.run([cli_binary(), "--cluster", "reshard", cluster.addresses[0],
                            "--cluster-from", ids[0], "--cluster-to", ids[1],
                            "--cluster-slots", str(args.slots), "--cluster-yes",
                            "--cluster-pipeline", "10"],
                           check=True, capture_output=True, timeout=600)
        else:
            cluster.client().delete(mark_of_slot(key_slot(pending_key(0).encode())))
        ended = time.time()
        time.sleep(args.after)
        stop.set()
        for t in sellers:
            t.join()
    finally:
        service.terminate()
        service.wait()
        cluster.stop()
    phases = {"before": (began - args.before, began), "during": (began, ended),
              "after": (ended, ended + args.after)}
    print(f"{event}: {ended - began:.1f} s" + (f" ({args.slots} slots)"
                                              if event == "reshard" else ""))
    for name, (start, end) in phases.items():
        span = max(end - start, 1e-3)
        counts = collections.Counter(s for at, s in answers if start <= at < end)
        print(f"  {name:7} {counts[200] / span:8,.0f} answered/s  {counts[503] / span:8,.0f} "
              f"503/s")
    sold = [began, *sorted(at for at, s in answers if s == 200 and at >= began),
            ended + args.after]  # a gap to the end of the run counts as one
    gap = max(b - a for a, b in itertools.pairwise(sold))
    print(f"  longest time without a ticket answered, from the event: {gap:.2f} s")
    for line in log.read_text(errors="replace").splitlines():
        if "restore the journal" in line or "reconciled with the journal\"" in line:
            print("  " + json.loads(line)["message"][:160])


def sell(port: int, k: int, batch: int, stop: threading.Event,
         answers: list[tuple[float, int]]) -> None:
    rng = random.Random(k)
    n = 0
    while not stop.is_set():
        n += 1
        body = {"tickets": [{"ticket_id": f"E{k}-{n}-{i}", "game": "fdj-keno",
                             "grids": [{"numbers": sorted(rng.sample(range(1, 71), 8)),
                                        "stake": 200}]} for i in range(batch)]}
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/ticket-batches", json.dumps(body).encode(),
            {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                results = json.loads(reply.read())["results"]
            now = time.time()
            answers.extend((now, r["status"]) for r in results)
        except urllib.error.HTTPError as e:
            now = time.time()
            answers.extend((now, e.code) for _ in range(batch))
            time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
